"""Every path under a run directory, declared once (docs/run-directory.md)::

    RUN/
      run.yaml | config.yaml | .hydra/config.yaml   the training config (the first that exists)
      metrics.jsonl                                  logged metrics, one JSON object a line
      batches/step_<N>.parquet | step_<N>.arrow      one file per training step
      rldiag/                                        everything rldiag writes
        scenarios/<name>/                            rldiag recompute
          scenario.json                              written last: marks the scenario complete
          metrics.parquet                            one row per step
          tokens/step_<N:06d>.parquet                with --save-tokens
          rows/step_<N:06d>.parquet                  per-row values (rldiag.io.outputs.rows_table)
        comparisons/<A>__vs__<B>/                    rldiag compare
          comparison.json                            written last
          metrics.parquet  tokens.parquet  groups.parquet
        import/wandb.json                            rldiag import-wandb, written last
        sweeps/<name>/                               rldiag sweep (its scenarios are under scenarios/)
          sweep.json                                 written last: the grid, the scenarios
          summary.parquet                            every scenario's metrics, long format
        sweeps/layout-audit/                         rldiag layout-audit
          <layout>/                                  one scenario per layout, as scenarios/<name>/
          metrics.parquet                            one row per metric (spread, best match, why)
          audit.json                                 written last: the layouts and the metrics
        cache/<name>/                                per-token outputs of scenario <name> computed on
                                                     demand for a few steps (the app's Step page),
                                                     laid out as scenarios/<name>/

    $RLDIAG_HOME/                                    default ~/.cache/rldiag ($XDG_CACHE_HOME/rldiag)
      runs/<key>/                                    RUN/rldiag/ of a run rldiag may not write into:
                                                     <key> the first 16 hex digits of the SHA-256 of
                                                     the run's resolved path (or its URI)
        source.json                                  which run the mirror belongs to

Where ``RUN/rldiag/`` is (:func:`output_dir_of`): ``RUN/rldiag/`` itself when rldiag may write
there (it exists and is writable, or it does not and ``RUN`` is writable), else the run's
*mirror* ``$RLDIAG_HOME/runs/<key>/``, which then plays its part for every command, readers and
writers alike. A run inside rldiag's install (the bundled samples) and one named in
``$RLDIAG_READ_ONLY`` are always mirrored; a run in an object store keeps its outputs in the
store unless ``$RLDIAG_READ_ONLY`` names it (no request is made to find out).

:class:`RunLayout` gives these paths for a run on local disk (:class:`~pathlib.Path`) and in an
object store (:class:`~rldiag.io.fs.RemotePath`) alike: it only joins names, never touches the
files (except :meth:`ScenarioLayout.token_steps`, a listing). Modules name files through it
(``RunLayout(run).scenario(name).metrics``), and writers take the names relative to the
directory they write (``ScenarioLayout.METRICS``, ``ScenarioLayout.tokens_rel(12)``,
``RunLayout.WANDB_IMPORT``): see :mod:`rldiag.io.staged`. Finding where ``RUN/rldiag/`` is
(:attr:`RunLayout.output_dir`) looks at the run's permissions once per layout, and creates the
mirror when it is the answer.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import ClassVar, Generic, TypeVar, cast, overload

from rldiag.config.settings import CONFIG_FILES
from rldiag.io.fs import RemotePath, as_path

AnyPath = Path | RemotePath
#: The kind of path a layout gives: a local run's are :class:`Path`, a store's :class:`RemotePath`.
P = TypeVar("P", bound=AnyPath)


def _join(base: P, *names: str) -> P:
    out: AnyPath = base
    for name in names:
        out = out / name
    return cast(P, out)  # Path / str is a Path, RemotePath / str a RemotePath

#: The training config's file names, in the order they are looked for, are
#: :data:`rldiag.config.settings.CONFIG_FILES` (config sits below io and finds the file itself);
#: the first is the one rldiag writes (capture, import).
RUN_CONFIG = CONFIG_FILES[0]
METRICS_FILE = "metrics.jsonl"
BATCHES_DIR = "batches"
#: The formats of a batch file, by suffix.
STEP_FORMATS = ("parquet", "arrow")
#: A batch file's name: ``step_<N>.parquet`` or ``step_<N>.arrow`` (any zero padding).
STEP_FILE = re.compile(r"^step_(\d+)\.(parquet|arrow)$")
#: Where rldiag writes, and its parts.
OUTPUT_DIR = "rldiag"
SCENARIOS_DIR = "scenarios"
COMPARISONS_DIR = "comparisons"
IMPORT_DIR = "import"
SWEEPS_DIR = "sweeps"
#: ``rldiag layout-audit``'s sweep, under ``SWEEPS_DIR``
LAYOUT_AUDIT_DIR = "layout-audit"
#: Per-token outputs computed on demand for a few steps, one scenario directory per scenario name.
CACHE_DIR = "cache"
#: Between the two sides of a comparison's directory name (``base__vs__rloo``).
PAIR_SEP = "__vs__"


def step_file_name(step: int, fmt: str = "parquet", width: int = 6) -> str:
    """``step_000012.parquet``: the name of step ``step``'s batch file (or token file), its
    number zero-padded to ``width`` digits (1: no padding)."""
    if fmt not in STEP_FORMATS:
        raise ValueError(f"a step file is one of {', '.join(STEP_FORMATS)}, not {fmt!r}")
    return f"step_{int(step):0{max(1, width)}d}.{fmt}"


# -- rldiag's own directory, and the mirrors of runs it may not write into --------------------------

#: where rldiag keeps what belongs to no run directory it may write into (recent runs, mirrors)
HOME_VAR = "RLDIAG_HOME"
#: runs (paths or URIs, ``os.pathsep``-separated) rldiag must not write into: each is mirrored
READ_ONLY_VAR = "RLDIAG_READ_ONLY"
#: the default home's name under ``$XDG_CACHE_HOME`` (else ``~/.cache``)
HOME_NAME = "rldiag"
#: the mirrors of read-only runs, under the home
MIRRORS_DIR = "runs"
#: a mirror's record of its run, in the mirror
MIRROR_SOURCE = "source.json"
#: hex digits of a mirror's key
MIRROR_KEY_LEN = 16
#: rldiag's install: never written (its bundled sample runs are mirrored)
INSTALL_DIR = Path(__file__).resolve().parents[1]


def rldiag_home(env: Mapping[str, str] | None = None) -> Path:
    """``$RLDIAG_HOME``, else ``$XDG_CACHE_HOME/rldiag``, else ``~/.cache/rldiag``."""
    environ: Mapping[str, str] = os.environ if env is None else env
    if environ.get(HOME_VAR):
        return Path(environ[HOME_VAR])
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / HOME_NAME


def run_identity(root: str | os.PathLike | AnyPath) -> str:
    """What a run's mirror is keyed on: its resolved path, or its URI (no trailing slash)."""
    p = as_path(root)
    return str(p).rstrip("/") if isinstance(p, RemotePath) else os.path.realpath(p)


def mirror_key(root: str | os.PathLike | AnyPath) -> str:
    """The first 16 hex digits of the SHA-256 of :func:`run_identity`."""
    return hashlib.sha256(run_identity(root).encode()).hexdigest()[:MIRROR_KEY_LEN]


def mirror_dir(root: str | os.PathLike | AnyPath, env: Mapping[str, str] | None = None) -> Path:
    """``$RLDIAG_HOME/runs/<key>/``: where the outputs of the run ``root`` go when rldiag may not
    write into it (laid out as ``RUN/rldiag/``)."""
    return rldiag_home(env) / MIRRORS_DIR / mirror_key(root)


def _within(identity: str, base: str) -> bool:
    base = base.rstrip("/") or "/"
    return identity == base or identity.startswith(base if base.endswith("/") else base + "/")


@lru_cache(maxsize=4096)
def _inside_install(real: str) -> bool:
    return _within(real, str(INSTALL_DIR))


def declared_read_only(root: str | os.PathLike | AnyPath, env: Mapping[str, str] | None = None) -> bool:
    """Whether the run is inside rldiag's install or at or under a path (URI) of ``$RLDIAG_READ_ONLY``."""
    environ: Mapping[str, str] = os.environ if env is None else env
    p = as_path(root)
    ident = run_identity(p)
    # the install's bundled samples may be a link out of it (a checkout's rldiag/app/samples)
    if isinstance(p, Path) and (_inside_install(ident) or _inside_install(os.path.abspath(p))):
        return True
    for entry in read_only_entries(environ.get(READ_ONLY_VAR) or ""):
        if _within(ident, entry if "://" in entry else os.path.realpath(entry)):
            return True
    return False


def read_only_entries(text: str) -> list[str]:
    """``$RLDIAG_READ_ONLY``'s paths and URIs: ``os.pathsep``-separated, a URI's ``scheme://``
    kept whole (``/data/a:s3://bucket/run``)."""
    out: list[str] = []
    for piece in text.split(os.pathsep):
        if out and piece.startswith("//") and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", out[-1]):
            out[-1] += os.pathsep + piece
        else:
            out.append(piece)
    return [e.strip() for e in out if e.strip()]


def run_is_writable(root: str | os.PathLike | AnyPath, env: Mapping[str, str] | None = None) -> bool:
    """Whether rldiag may write ``RUN/rldiag/`` of the run: not declared read-only, and (on local
    disk) ``RUN/rldiag`` writable where it exists, else ``RUN`` itself. A run that does not exist
    counts as writable (there is nothing to mirror). An object store is not asked."""
    p = as_path(root)
    if declared_read_only(p, env):
        return False
    if isinstance(p, RemotePath):
        return True
    out = p / OUTPUT_DIR
    if out.is_dir():
        return os.access(out, os.W_OK)
    return not p.exists() or os.access(p, os.W_OK)


def output_dir_of(root: str | os.PathLike | AnyPath, env: Mapping[str, str] | None = None) -> AnyPath:
    """Where the run's ``RUN/rldiag/`` is: in the run when rldiag may write there
    (:func:`run_is_writable`), else its mirror (:func:`mirror_dir`), made here with its
    ``source.json`` (best effort: a home that cannot be written is found out by the writer)."""
    p = as_path(root)
    if run_is_writable(p, env):
        return p / OUTPUT_DIR
    mirror = mirror_dir(p, env)
    _make_mirror(mirror, run_identity(p))
    return mirror


def _make_mirror(mirror: Path, identity: str) -> None:
    record = mirror / MIRROR_SOURCE
    if record.is_file():
        return
    try:
        mirror.mkdir(parents=True, exist_ok=True)
        tmp = mirror / f".{MIRROR_SOURCE}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"run": identity}, indent=1) + "\n")
        os.replace(tmp, record)
    except OSError:
        pass


def mirror_source(mirror: Path) -> str | None:
    """The run a mirror belongs to (its ``source.json``), None when unknown."""
    try:
        got = json.loads((mirror / MIRROR_SOURCE).read_text())
    except (OSError, ValueError):
        return None
    return got.get("run") if isinstance(got, dict) and isinstance(got.get("run"), str) else None


class Entry:
    """A file (or directory) of an output directory, named by one of its class's constants:
    ``meta = Entry("META")`` gives ``layout.meta == layout.dir / layout.META``."""

    def __init__(self, constant: str):
        self.constant = constant

    @overload
    def __get__(self, obj: None, owner: type) -> Entry: ...
    @overload
    def __get__(self, obj: OutputLayout[P], owner: type) -> P: ...
    def __get__(self, obj, owner):
        if obj is None:
            return self
        return _join(obj.dir, getattr(obj, self.constant))


@dataclass(frozen=True)
class OutputLayout(Generic[P]):
    """One directory rldiag writes whole: its ``META`` JSON file (written last, marking the
    directory complete) and its ``METRICS`` table."""

    dir: P
    META: ClassVar[str]
    METRICS: ClassVar[str] = "metrics.parquet"

    meta = Entry("META")
    metrics = Entry("METRICS")

    @property
    def name(self) -> str:
        return self.dir.name


@dataclass(frozen=True)
class ScenarioLayout(OutputLayout[P]):
    """``RUN/rldiag/scenarios/<name>/``: one ``rldiag recompute``."""

    META: ClassVar[str] = "scenario.json"
    TOKENS: ClassVar[str] = "tokens"
    ROWS: ClassVar[str] = "rows"
    #: A token file's name (``step_000012.parquet``).
    TOKEN_FILE: ClassVar[re.Pattern[str]] = re.compile(r"^step_(\d+)\.parquet$")
    #: Every token file of a scenario, as a glob over ``tokens_dir`` (DuckDB's ``read_parquet``).
    TOKEN_GLOB: ClassVar[str] = "step_*.parquet"
    #: The step of a token file's path, as a regular expression DuckDB's ``regexp_extract`` takes.
    TOKEN_STEP_SQL: ClassVar[str] = r"step_([0-9]+)\.parquet$"

    tokens_dir = Entry("TOKENS")

    @classmethod
    def tokens_rel(cls, step: int) -> str:
        """Step ``step``'s token file relative to the scenario (what its writer takes)."""
        return f"{cls.TOKENS}/{step_file_name(step)}"

    def tokens_file(self, step: int) -> P:
        return _join(self.dir, self.TOKENS, step_file_name(step))

    @classmethod
    def rows_rel(cls, step: int) -> str:
        """Step ``step``'s per-row file relative to the scenario (what its writer takes)."""
        return f"{cls.ROWS}/{step_file_name(step)}"

    def rows_file(self, step: int) -> P:
        """``rows/step_<N:06d>.parquet``: step ``step``'s per-row values."""
        return _join(self.dir, self.ROWS, step_file_name(step))

    rows_dir = Entry("ROWS")

    def row_steps(self) -> list[int]:
        """The steps that have a per-row file (a listing of ``rows/``)."""
        d = self.rows_dir
        if not d.is_dir():
            return []
        return sorted(int(m.group(1)) for p in d.iterdir() if (m := self.TOKEN_FILE.match(p.name)) and p.is_file())

    def token_steps(self) -> list[int]:
        """The steps that have a token file (a listing of ``tokens/``)."""
        d = self.tokens_dir
        if not d.is_dir():
            return []
        return sorted(int(m.group(1)) for p in d.iterdir() if (m := self.TOKEN_FILE.match(p.name)) and p.is_file())


@dataclass(frozen=True)
class ComparisonLayout(OutputLayout[P]):
    """``RUN/rldiag/comparisons/<A>__vs__<B>/``: one ``rldiag compare``."""

    META: ClassVar[str] = "comparison.json"
    TOKENS: ClassVar[str] = "tokens.parquet"
    GROUPS: ClassVar[str] = "groups.parquet"

    tokens = Entry("TOKENS")
    groups = Entry("GROUPS")


@dataclass(frozen=True)
class SweepLayout(OutputLayout[P]):
    """``RUN/rldiag/sweeps/<name>/``: one ``rldiag sweep`` (each of its scenarios is written
    under ``scenarios/`` as ``rldiag recompute`` writes it)."""

    META: ClassVar[str] = "sweep.json"
    SUMMARY: ClassVar[str] = "summary.parquet"

    summary = Entry("SUMMARY")


@dataclass(frozen=True)
class LayoutAuditLayout(OutputLayout[P]):
    """``RUN/rldiag/sweeps/layout-audit/``: one ``rldiag layout-audit``: a scenario directory per
    layout (laid out as ``RUN/rldiag/scenarios/<name>/``), the per-metric table and ``audit.json``."""

    META: ClassVar[str] = "audit.json"

    def scenario(self, name: str) -> ScenarioLayout[P]:
        """The scenario of the layout ``name`` (``own``, ``dp=2``, ``micro_batch_x0.5``, ...)."""
        return ScenarioLayout(_join(self.dir, name))


class RunLayout(Generic[P]):
    """The paths of the run directory ``root``: :class:`Path` for a local run (a path, or a
    string that is not a URI), :class:`RemotePath` for one in an object store (a URI)."""

    #: ``rldiag import-wandb``'s record, relative to the run (written last by the import).
    WANDB_IMPORT: ClassVar[str] = f"{OUTPUT_DIR}/{IMPORT_DIR}/wandb.json"

    __slots__ = ("root", "_out")

    @overload
    def __init__(self: RunLayout[Path], root: Path) -> None: ...
    @overload
    def __init__(self: RunLayout[RemotePath], root: RemotePath) -> None: ...
    @overload
    def __init__(self: RunLayout[AnyPath], root: str | os.PathLike | AnyPath) -> None: ...
    def __init__(self, root):
        self.root = as_path(root)
        self._out: AnyPath | None = None

    def __repr__(self) -> str:
        return f"RunLayout({str(self.root)!r})"

    def _at(self, *names: str) -> P:
        return _join(cast(P, self.root), *names)

    def _out_at(self, *names: str) -> P:
        return _join(self.output_dir, *names)

    # -- what a trainer writes -------------------------------------------------------------------
    @property
    def config_files(self) -> tuple[P, ...]:
        """Where the training config may be, in the order looked for."""
        return tuple(self._at(*name.split("/")) for name in CONFIG_FILES)

    @property
    def run_config(self) -> P:
        """``run.yaml``: the config file rldiag writes."""
        return self._at(RUN_CONFIG)

    @property
    def metrics_file(self) -> P:
        return self._at(METRICS_FILE)

    @property
    def batches_dir(self) -> P:
        return self._at(BATCHES_DIR)

    def batch_file(self, step: int, fmt: str = "parquet", width: int = 6) -> P:
        """The batch file of step ``step`` as rldiag names it (``batches/step_000012.parquet``)."""
        return self._at(BATCHES_DIR, step_file_name(step, fmt, width))

    # -- what rldiag writes ----------------------------------------------------------------------
    @property
    def output_dir(self) -> P:
        """``RUN/rldiag/``, or the run's mirror ``$RLDIAG_HOME/runs/<key>/`` when rldiag may not
        write into the run (:func:`output_dir_of`; looked up once per layout). A mirror is local
        disk, also for a run in an object store."""
        if self._out is None:
            self._out = output_dir_of(self.root)
        return cast(P, self._out)

    @property
    def mirrored(self) -> bool:
        """Whether the run's outputs are in its mirror rather than in ``RUN/rldiag/``."""
        return self.output_dir != self._at(OUTPUT_DIR)

    @property
    def scenarios_dir(self) -> P:
        return self._out_at(SCENARIOS_DIR)

    def scenario(self, name: str) -> ScenarioLayout[P]:
        return ScenarioLayout(self._out_at(SCENARIOS_DIR, name))

    @property
    def cache_dir(self) -> P:
        return self._out_at(CACHE_DIR)

    def token_cache(self, name: str) -> ScenarioLayout[P]:
        """``RUN/rldiag/cache/<name>/``: scenario ``name``'s per-token outputs recomputed on
        demand for a few steps, laid out as a scenario (``scenario.json`` written last)."""
        return ScenarioLayout(self._out_at(CACHE_DIR, name))

    @property
    def comparisons_dir(self) -> P:
        return self._out_at(COMPARISONS_DIR)

    def comparison(self, a: str, b: str) -> ComparisonLayout[P]:
        """Where ``rldiag compare`` writes the comparison of sides ``a`` and ``b``."""
        return ComparisonLayout(self._out_at(COMPARISONS_DIR, f"{a}{PAIR_SEP}{b}"))

    @property
    def sweeps_dir(self) -> P:
        return self._out_at(SWEEPS_DIR)

    def sweep(self, name: str) -> SweepLayout[P]:
        """Where ``rldiag sweep`` writes the sweep ``name``'s summary and record."""
        return SweepLayout(self._at(OUTPUT_DIR, SWEEPS_DIR, name))

    @property
    def layout_audit(self) -> LayoutAuditLayout[P]:
        """Where ``rldiag layout-audit`` writes (:class:`LayoutAuditLayout`)."""
        return LayoutAuditLayout(self._out_at(SWEEPS_DIR, LAYOUT_AUDIT_DIR))

    # the import's record is part of the run directory the import writes (never mirrored)
    @property
    def import_dir(self) -> P:
        return self._at(OUTPUT_DIR, IMPORT_DIR)

    @property
    def wandb_import_record(self) -> P:
        return self._at(*self.WANDB_IMPORT.split("/"))
