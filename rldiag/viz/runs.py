"""Which runs the app opens: the command line, else ``$RLDIAG_RUN``, else none (the picker).

The picker offers a path box, the runs opened recently (kept in a small JSON file of the user's
rldiag directory) and the bundled sample. The bundled sample lives inside the install, which
must never be written: it is opened as a copy in the user's rldiag directory, where a
recompute can write its outputs. That copy is on local disk by design (the app reads runs on
local disk only, :func:`rldiag.store.cache.local_path`); it is written through the staged
writer (:mod:`rldiag.io.staged`) like every run directory rldiag writes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from rldiag.io.atomic import write_bytes_atomic
from rldiag.io.run_layout import BATCHES_DIR, METRICS_FILE, RUN_CONFIG, STEP_FORMATS, RunLayout
from rldiag.io.staged import open_staged

#: the bundled sample runs, in order of preference
PREFERRED_SAMPLES = ("grpo-tool", "ppo-gae")
ENV_VAR = "RLDIAG_RUN"
#: where rldiag keeps the user's state (recent runs, sample copies); default ~/.cache/rldiag
HOME_VAR = "RLDIAG_HOME"
#: the user's rldiag directory under ``$XDG_CACHE_HOME`` (not a run directory's ``rldiag/``)
USER_DIR_NAME = "rldiag"
RECENT_FILE = "recent_runs.json"
RECENT_MAX = 10
#: what a run directory's copy takes from a sample (never its outputs)
SAMPLE_FILES = (RUN_CONFIG, METRICS_FILE, BATCHES_DIR)


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


def user_dir(env: dict | None = None) -> Path:
    environ: Mapping[str, str] = os.environ if env is None else env
    if environ.get(HOME_VAR):
        return Path(environ[HOME_VAR])
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / USER_DIR_NAME


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


def sample_copy(env: dict | None = None, sample: Path | None = None) -> Path:
    """A user-writable copy of the bundled sample (made once, atomically: staged beside it and
    swapped in), to open in the app. Local disk only, by design: the app reads local runs."""
    src = sample or default_run()
    if src is None:
        from rldiag.errors import RunDirError

        raise RunDirError(f"no bundled sample run under {samples_dir()}")
    dest = user_dir(env) / "samples" / src.name
    if has_batches(dest):
        return dest
    with open_staged(dest) as writer:
        for name in SAMPLE_FILES:
            s = src / name
            if s.is_dir():
                writer.add_tree(name, s)
            elif s.is_file():
                writer.add_file(name, s)
        writer.commit()
    return dest


def writable(run: str | Path) -> bool:
    """Whether rldiag may write its outputs (``RUN/rldiag``) in ``run``."""
    run = Path(run)
    if is_bundled(run):
        return False
    out = RunLayout(run).output_dir
    return os.access(out if out.exists() else run, os.W_OK)


READ_ONLY = ("This run is read-only here (the bundled sample inside the install, or a directory you cannot "
             "write): recomputing is off. Open the sample from the picker (it makes a copy you can write) or a "
             "run directory of your own.")

HOW_TO = """No run is open. Give one:

- on the command line: `rldiag app /path/to/RUN` (several runs: `rldiag app RUN_A RUN_B`);
- or type its path below, pick a recent one, or open the bundled sample.

A run directory holds `batches/step_<N>.parquet` (one file per training step), and optionally
`metrics.jsonl` and `run.yaml`."""
