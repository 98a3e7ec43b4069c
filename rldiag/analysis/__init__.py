"""Analyses over a run: ``verify`` (recompute vs the trainer's logs), ``compare`` (two scenarios,
or a scenario and the logs). Each is a pure function returning a dataclass; the CLI and the app
only format it."""
