"""The scenario driver: plan a scenario's steps, find what is reusable, run them on an executor,
and write the result or keep it in memory.

- :mod:`.plan`: the settings checked, what an earlier write left for reuse, the steps in chunks;
- :mod:`.write`: :class:`~rldiag.scenario.write.ScenarioWriter` (staged open, each outcome
  recorded, commit or abort) and its report;
- :mod:`.recompute`: ``rldiag recompute`` (one scenario) and ``--follow``;
- :mod:`.sweep`: ``rldiag sweep`` (many scenarios from one read of each step file);
- :mod:`.tokens`: per-token outputs on demand (a scenario kept up to date, the step-token cache);
- :mod:`.memory`: scenarios recomputed in memory (nothing written).

It sits above :mod:`rldiag.executors` and under :mod:`rldiag.analysis`; the command line and the
app reach it through :mod:`rldiag.api`. Importing the package imports none of its modules.
"""
