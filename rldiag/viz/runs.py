"""Which run the app opens: the command line, else the bundled sample, else none."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

#: the bundled sample runs, in order of preference
PREFERRED_SAMPLES = ("grpo-tool", "ppo-gae")
ENV_VAR = "RLDIAG_RUN"


def samples_dir() -> Path:
    """``samples/`` of the repository this rldiag is installed from."""
    return Path(__file__).resolve().parents[2] / "samples"


def has_batches(path: Path) -> bool:
    b = path / "batches"
    return b.is_dir() and any(p.suffix in (".parquet", ".arrow") for p in b.iterdir())


def default_run(samples: Path | None = None) -> Path | None:
    """The preferred sample run, else the first directory under ``samples`` with batches."""
    samples = samples or samples_dir()
    if not samples.is_dir():
        return None
    for name in PREFERRED_SAMPLES:
        if has_batches(samples / name):
            return samples / name
    for p in sorted(samples.iterdir()):
        if p.is_dir() and has_batches(p):
            return p
    return None


def run_from_argv(argv: Sequence[str]) -> str | None:
    """``streamlit run app/main.py -- RUN``: Streamlit leaves ``[script, RUN]`` in ``sys.argv``.
    Anything else (a test runner's argv) gives None."""
    if not argv or not str(argv[0]).endswith(".py") or Path(argv[0]).name != "main.py":
        return None
    args = [a for a in argv[1:] if not a.startswith("-")]
    return args[0] if args else None


def initial_run(argv: Sequence[str], env: dict | None = None) -> str:
    """The run to open: command line, then ``$RLDIAG_RUN``, then the default sample ("" if none)."""
    env = os.environ if env is None else env
    got = run_from_argv(argv) or env.get(ENV_VAR)
    if got:
        return str(got)
    d = default_run()
    return str(d) if d else ""


HOW_TO = """No run is open. Give one:

- on the command line: `streamlit run app/main.py -- /path/to/RUN`
- or in the sidebar's *Run directory* box.

A run directory holds `batches/step_<N>.parquet` (one file per training step), and optionally
`metrics.jsonl` and `run.yaml` (see docs/app.md)."""
