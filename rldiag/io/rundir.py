"""The run directory (docs/run-directory.md; its paths: :mod:`rldiag.io.run_layout`): its step
files, ``--steps``, the lines of ``metrics.jsonl``."""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from rldiag.errors import ConfigError, RunDirError
from rldiag.io.fs import RemotePath
from rldiag.io.run_layout import STEP_FILE, RunLayout

#: the steps of a run to work on: a ``--steps`` spec (``"10:20"``, ``"1,5,9"``), the step numbers
#: themselves, or None for every step (:func:`parse_steps`)
Steps = str | Sequence[int] | None

#: The largest step number: steps are int64 in every output (``metrics.parquet``, the app's store).
MAX_STEP = 2**63 - 1


def step_number_problem(step: int) -> str | None:
    """Why a step number read from a file name cannot be recorded (None when it can)."""
    if step > MAX_STEP:
        return f"the step number in the file name is larger than {MAX_STEP}, the largest step rldiag records"
    return None


@dataclass(frozen=True)
class StepFile:
    step: int
    path: Path | RemotePath

    @property
    def format(self) -> str:
        return "arrow" if self.path.suffix == ".arrow" else "parquet"


class RunDir:
    """A run directory on disk, or a prefix in an object store (``s3://bucket/run``, see
    :mod:`rldiag.io.fs`)."""

    def __init__(self, path: str | Path | RemotePath):
        self.layout = RunLayout(path)
        self.path = self.layout.root
        if not self.path.exists():
            raise RunDirError(f"run directory {self.path} does not exist")
        if not self.path.is_dir():
            raise RunDirError(f"{self.path} is not a directory")

    @property
    def batches_dir(self) -> Path | RemotePath:
        return self.layout.batches_dir

    @property
    def output_dir(self) -> Path | RemotePath:
        return self.layout.output_dir

    @property
    def metrics_file(self) -> Path | RemotePath:
        return self.layout.metrics_file

    def step_files(self) -> list[StepFile]:
        """Every batch file, sorted by step. Two files for one step is an error naming both."""
        if not self.batches_dir.is_dir():
            return []
        by_step: dict[int, Path | RemotePath] = {}
        entries: list[Path | RemotePath] = list(self.batches_dir.iterdir())
        for p in sorted(entries, key=lambda e: e.name):
            m = STEP_FILE.match(p.name)
            if not m or not p.is_file():
                continue
            step = int(m.group(1))
            if step in by_step:
                raise RunDirError(
                    f"step {step} has two batch files: {by_step[step]} and {p}; keep one"
                )
            by_step[step] = p
        return [StepFile(s, by_step[s]) for s in sorted(by_step)]

    def listing(self) -> dict[int, tuple[int, int]]:
        """Each batch file's ``(size, mtime_ns)`` by step: what a follower compares between two
        looks (a file still being written changes one or the other when its writer finishes)."""
        out = {}
        for sf in self.step_files():
            st = sf.path.stat()
            out[sf.step] = (int(st.st_size), int(st.st_mtime_ns))
        return out

    def require_steps(self) -> list[StepFile]:
        files = self.step_files()
        if not files:
            raise RunDirError(
                f"run directory {self.path} has no batch files (expected {self.batches_dir}/step_<N>.parquet)"
            )
        return files


def parse_steps(spec: Steps, available: list[int]) -> list[int]:
    """``--steps``: ``12``, ``10:20`` (inclusive of both ends), ``10:``, ``:20`` or ``1,5,9``;
    or the step numbers themselves (a sequence of ints, in any order).

    Returns the available steps selected, in order. A named step that does not exist is an error.
    """
    if spec is not None and not isinstance(spec, str):
        return _chosen_steps(spec, available)
    if spec is None or spec.strip() in ("", ":", "all"):
        return list(available)
    have = set(available)
    chosen: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if ":" in part:
                lo_s, hi_s = part.split(":", 1)
                lo = int(lo_s) if lo_s.strip() else min(available, default=0)
                hi = int(hi_s) if hi_s.strip() else max(available, default=0)
                if lo > hi:
                    raise ConfigError(f"--steps {part!r}: start {lo} is after end {hi}")
                chosen.update(s for s in available if lo <= s <= hi)
            else:
                s = int(part)
                _require_step(s, have, available)
                chosen.add(s)
        except ValueError:
            raise ConfigError(f"--steps {spec!r}: expected N, A:B, A:, :B or a comma list") from None
    if not chosen:
        raise ConfigError(f"--steps {spec!r} selects no step of this run")
    return sorted(chosen)


def _chosen_steps(steps: Sequence[int], available: list[int]) -> list[int]:
    """Step numbers given as numbers: each must have a batch file; sorted, each once."""
    have = set(available)
    chosen: set[int] = set()
    for value in steps:
        try:
            if isinstance(value, bool):
                raise TypeError
            s = operator.index(value)  # an int, or a numpy integer
        except TypeError:
            raise ConfigError(f"steps: expected step numbers (ints), not {value!r}") from None
        _require_step(s, have, available)
        chosen.add(s)
    if not chosen:
        raise ConfigError("steps: an empty list selects no step of this run (None means every step)")
    return sorted(chosen)


def _require_step(s: int, have: set[int], available: list[int]) -> None:
    if s not in have:
        raise ConfigError(
            f"--steps: step {s} has no batch file (steps {min(available)}..{max(available)} exist)"
            if available
            else f"--steps: step {s} has no batch file"
        )


def _line_step(obj: object) -> tuple[int | None, str]:
    """The step of a decoded ``metrics.jsonl`` line, or ``(None, why not)``."""
    if not isinstance(obj, dict):
        return None, f"not a JSON object but {type(obj).__name__}"
    if "step" not in obj:
        return None, "no \"step\""
    v = obj["step"]
    if isinstance(v, bool):
        step = None
    elif isinstance(v, int):
        step = v
    elif isinstance(v, float) and math.isfinite(v) and v.is_integer():
        step = int(v)
    elif isinstance(v, str) and v.strip().isdigit():
        step = int(v)
    else:
        step = None
    if step is None or not 0 <= step <= MAX_STEP:
        return None, f"step {v!r} is not a step number (an integer from 0 to {MAX_STEP})"
    return step, ""


def metrics_record(raw: bytes) -> tuple[int, dict] | str | None:
    """One line of ``metrics.jsonl`` (without its newline) as ``(step, payload)``; None for a blank
    line; a string saying why for a line that is not a JSON object with an integer step (0 to
    :data:`MAX_STEP`). Accepts verl's file-logger form ``{"step": 12, "data": {...}}`` and the flat
    form; the payload is as logged (any JSON values)."""
    raw = raw.strip()
    if not raw:
        return None
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than Python's stack
        return "nested too deeply" if isinstance(exc, RecursionError) else f"not JSON ({exc})"
    step, why = _line_step(obj)
    if step is None:
        return why
    payload = obj["data"] if isinstance(obj.get("data"), dict) else {k: v for k, v in obj.items() if k != "step"}
    return step, payload


def numeric_metrics(payload: dict) -> dict[str, int | float]:
    """The values of a line's payload that are numbers (booleans are not)."""
    return {k: v for k, v in payload.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def iter_metrics_records(path: Path | RemotePath, skipped: list[tuple[int, str]] | None = None) -> Iterator[tuple[int, dict]]:
    """Every complete line of ``metrics.jsonl`` as ``(step, payload)``, in file order, with the
    payload as logged (any JSON values; :func:`metrics_record`).

    A last line without its newline (still being written) is skipped; a complete line that is
    not a JSON object with an integer step is skipped too (training logs may hold other noise),
    never raised: ``skipped``, when given, gets ``(line number, why)`` for each.
    """
    if not path.is_file():
        return
    with path.open("rb") as fh:
        data = fh.read()
    lines = data.split(b"\n")
    if lines and lines[-1] != b"":
        lines = lines[:-1]  # incomplete last line: picked up once complete
    for number, raw in enumerate(lines, 1):
        rec = metrics_record(raw)
        if isinstance(rec, str):
            if skipped is not None:
                skipped.append((number, rec))
        elif rec is not None:
            yield rec


class MetricsTail:
    """``metrics.jsonl`` read as it grows: each :meth:`read` returns the lines completed since the
    last one, reading from the byte offset where it stopped. A last line without its newline
    (the trainer is still writing it) is kept until its newline arrives, as
    :func:`iter_metrics_records` skips it; a file that became shorter (rewritten) is read again
    from its start. ``skipped`` collects ``(line number, why)`` of the lines that are not metrics."""

    def __init__(self, path: Path | RemotePath) -> None:
        self.path = path
        self.offset = 0  # bytes consumed, the partial last line included
        self.lines = 0  # complete lines read
        self.skipped: list[tuple[int, str]] = []
        self._partial = b""

    def read(self) -> list[tuple[int, dict[str, int | float]]]:
        """The new complete lines as ``(step, {name: number})``, in file order."""
        if not self.path.is_file():
            return []
        data = self._new_bytes()
        if not data:
            return []
        self.offset += len(data)
        *complete, self._partial = (self._partial + data).split(b"\n")
        out = []
        for raw in complete:
            self.lines += 1
            rec = metrics_record(raw)
            if isinstance(rec, str):
                self.skipped.append((self.lines, rec))
            elif rec is not None:
                out.append((rec[0], numeric_metrics(rec[1])))
        return out

    def _new_bytes(self) -> bytes:
        if isinstance(self.path, RemotePath):  # an object is read whole (no seek on its stream)
            whole = self.path.read_bytes()
            if len(whole) < self.offset:
                self.offset, self.lines, self._partial = 0, 0, b""
            return whole[self.offset:]
        with self.path.open("rb") as fh:
            fh.seek(0, 2)
            if fh.tell() < self.offset:  # rewritten shorter: start over
                self.offset, self.lines, self._partial = 0, 0, b""
            fh.seek(self.offset)
            return fh.read()


def iter_metrics_lines(path: Path | RemotePath, skipped: list[tuple[int, str]] | None = None) -> Iterator[tuple[int, dict]]:
    """Logged metrics as ``(step, {name: number})``, in file order (see
    :func:`iter_metrics_records`); values that are not numbers are left out."""
    for step, payload in iter_metrics_records(path, skipped):
        yield step, numeric_metrics(payload)
