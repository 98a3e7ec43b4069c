"""Which runs the app opens: the command line, else ``$RLDIAG_RUN``, else none (the picker).

The picker offers a path box, the runs opened recently (kept in a small JSON file of the user's
rldiag directory, ``$RLDIAG_HOME``) and the bundled sample. The bundled sample lives inside the
install, which is never written: it is opened where it is, and what rldiag computes for it goes
to its mirror ``$RLDIAG_HOME/runs/<key>/`` (:func:`rldiag.io.run_layout.output_dir_of`), as for
any run rldiag may not write into.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from rldiag.io.atomic import write_bytes_atomic
from rldiag.io.run_layout import HOME_VAR, READ_ONLY_VAR, STEP_FORMATS, RunLayout, rldiag_home

#: the bundled sample runs, in order of preference
PREFERRED_SAMPLES = ("grpo-tool", "ppo-gae")
ENV_VAR = "RLDIAG_RUN"
#: the recent runs, in the user's rldiag directory (``$RLDIAG_HOME``, default ~/.cache/rldiag:
#: :func:`rldiag.io.run_layout.rldiag_home`, which also holds the mirrors of read-only runs)
RECENT_FILE = "recent_runs.json"
RECENT_MAX = 10


def samples_dir() -> Path:
    """The sample runs shipped with rldiag (``rldiag/app/samples``)."""
    return Path(__file__).resolve().parents[1] / "app" / "samples"


def has_batches(path: Path) -> bool:
    b = RunLayout(path).batches_dir
    return b.is_dir() and any(p.suffix.lstrip(".") in STEP_FORMATS for p in b.iterdir())


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


def runs_from_argv(argv: Sequence[str]) -> list[str]:
    """``streamlit run .../main.py -- RUN [RUN ...]``: Streamlit leaves ``[script, RUN...]`` in
    ``sys.argv``. Anything else (a test runner's argv) gives no run."""
    if not argv or not str(argv[0]).endswith(".py") or Path(argv[0]).name != "main.py":
        return []
    return [a for a in argv[1:] if not a.startswith("-")]


def run_from_argv(argv: Sequence[str]) -> str | None:
    """The first run of :func:`runs_from_argv` (None: none)."""
    runs = runs_from_argv(argv)
    return runs[0] if runs else None


def initial_runs(argv: Sequence[str], env: dict | None = None) -> list[str]:
    """The runs to open: the command line's, else ``$RLDIAG_RUN`` (``os.pathsep``-separated), else none."""
    environ: Mapping[str, str] = os.environ if env is None else env
    got = runs_from_argv(argv)
    if not got and environ.get(ENV_VAR):
        got = [p for p in environ[ENV_VAR].split(os.pathsep) if p]
    return [str(g) for g in got]


def initial_run(argv: Sequence[str], env: dict | None = None) -> str:
    """The first of :func:`initial_runs` ("" when none: the app shows its picker)."""
    runs = initial_runs(argv, env)
    return runs[0] if runs else ""


# -- the user's rldiag directory --------------------------------------------------------------


def user_dir(env: Mapping[str, str] | None = None) -> Path:
    """The user's rldiag directory (:func:`rldiag.io.run_layout.rldiag_home`)."""
    return rldiag_home(env)


def recent_runs(env: dict | None = None) -> list[str]:
    """Run directories opened recently, newest first, those that still exist."""
    try:
        got = json.loads((user_dir(env) / RECENT_FILE).read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(got, list):
        return []
    return [p for p in got if isinstance(p, str) and Path(p).is_dir()][:RECENT_MAX]


def remember_run(path: str | Path, env: dict | None = None) -> None:
    """Put ``path`` first in the recent runs (best effort: an unwritable home is no error)."""
    p = str(Path(path).resolve())
    runs = [p] + [r for r in recent_runs(env) if r != p]
    try:
        write_bytes_atomic(user_dir(env) / RECENT_FILE, json.dumps(runs[:RECENT_MAX], indent=1).encode())
    except OSError:
        pass


def is_bundled(path: str | Path) -> bool:
    """Whether ``path`` is inside the install's bundled samples (which are never written)."""
    try:
        Path(path).resolve().relative_to(samples_dir().resolve())
        return True
    except ValueError:
        return False


def writable(run: str | Path) -> bool:
    """Whether rldiag may write the run's outputs: in ``RUN/rldiag``, or in its mirror under
    ``$RLDIAG_HOME`` when the run itself is read-only (:attr:`RunLayout.output_dir`)."""
    out = Path(RunLayout(Path(run)).output_dir)
    while not out.exists() and out.parent != out:
        out = out.parent
    return os.access(out, os.W_OK)


def output_note(run: str | Path) -> str | None:
    """Where rldiag keeps what it computes for a run it may not write into (None: in the run)."""
    layout = RunLayout(Path(run))
    if not layout.mirrored:
        return None
    return (f"This run is read-only here (the bundled sample inside the install, a read-only directory, or one "
            f"named in ${READ_ONLY_VAR}): rldiag keeps what it computes for it in `{layout.output_dir}`.")


READ_ONLY = ("rldiag can write neither into this run nor into its mirror under your rldiag directory "
             f"(${HOME_VAR}): recomputing is off. Set {HOME_VAR} to a directory you can write.")

HOW_TO = """No run is open. Give one:

- on the command line: `rldiag app /path/to/RUN` (several runs: `rldiag app RUN_A RUN_B`);
- or type its path below, pick a recent one, or open the bundled sample.

A run directory holds `batches/step_<N>.parquet` (one file per training step), and optionally
`metrics.jsonl` and `run.yaml`."""
