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

:class:`RunLayout` gives these paths for a run on local disk (:class:`~pathlib.Path`) and in an
object store (:class:`~rldiag.io.fs.RemotePath`) alike: it only joins names, never touches the
files (except :meth:`ScenarioLayout.token_steps`, a listing). Modules name files through it
(``RunLayout(run).scenario(name).metrics``), and writers take the names relative to the
directory they write (``ScenarioLayout.METRICS``, ``ScenarioLayout.tokens_rel(12)``,
``RunLayout.WANDB_IMPORT``): see :mod:`rldiag.io.staged`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
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
#: Between the two sides of a comparison's directory name (``base__vs__rloo``).
PAIR_SEP = "__vs__"


def step_file_name(step: int, fmt: str = "parquet", width: int = 6) -> str:
    """``step_000012.parquet``: the name of step ``step``'s batch file (or token file), its
    number zero-padded to ``width`` digits (1: no padding)."""
    if fmt not in STEP_FORMATS:
        raise ValueError(f"a step file is one of {', '.join(STEP_FORMATS)}, not {fmt!r}")
    return f"step_{int(step):0{max(1, width)}d}.{fmt}"


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

    __slots__ = ("root",)

    @overload
    def __init__(self: RunLayout[Path], root: Path) -> None: ...
    @overload
    def __init__(self: RunLayout[RemotePath], root: RemotePath) -> None: ...
    @overload
    def __init__(self: RunLayout[AnyPath], root: str | os.PathLike | AnyPath) -> None: ...
    def __init__(self, root):
        self.root = as_path(root)

    def __repr__(self) -> str:
        return f"RunLayout({str(self.root)!r})"

    def _at(self, *names: str) -> P:
        return _join(cast(P, self.root), *names)

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
        return self._at(OUTPUT_DIR)

    @property
    def scenarios_dir(self) -> P:
        return self._at(OUTPUT_DIR, SCENARIOS_DIR)

    def scenario(self, name: str) -> ScenarioLayout[P]:
        return ScenarioLayout(self._at(OUTPUT_DIR, SCENARIOS_DIR, name))

    @property
    def comparisons_dir(self) -> P:
        return self._at(OUTPUT_DIR, COMPARISONS_DIR)

    def comparison(self, a: str, b: str) -> ComparisonLayout[P]:
        """Where ``rldiag compare`` writes the comparison of sides ``a`` and ``b``."""
        return ComparisonLayout(self._at(OUTPUT_DIR, COMPARISONS_DIR, f"{a}{PAIR_SEP}{b}"))

    @property
    def sweeps_dir(self) -> P:
        return self._at(OUTPUT_DIR, SWEEPS_DIR)

    def sweep(self, name: str) -> SweepLayout[P]:
        """Where ``rldiag sweep`` writes the sweep ``name``'s summary and record."""
        return SweepLayout(self._at(OUTPUT_DIR, SWEEPS_DIR, name))

    @property
    def layout_audit(self) -> LayoutAuditLayout[P]:
        """Where ``rldiag layout-audit`` writes (:class:`LayoutAuditLayout`)."""
        return LayoutAuditLayout(self._at(OUTPUT_DIR, SWEEPS_DIR, LAYOUT_AUDIT_DIR))

    @property
    def import_dir(self) -> P:
        return self._at(OUTPUT_DIR, IMPORT_DIR)

    @property
    def wandb_import_record(self) -> P:
        return self._at(*self.WANDB_IMPORT.split("/"))
