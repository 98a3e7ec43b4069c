"""An offline run whose artifact manifest file is damaged (a truncated gzip, lines that are not
file entries): the import goes on, keeps the entries it can read and names the rest."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from rldiag.importers import import_wandb
from rldiag.importers.wandb_artifacts import file_digest
from rldiag.importers.wandb_records import artifact_info
from rldiag.importers.wandb_sdk import record_class
from rldiag.synth import SynthSpec, write_synth_run
from tests.importers.test_wandb_log import encode


def _entry(path: Path, name: str) -> dict:
    return {"path": name, "digest": file_digest(path), "size": path.stat().st_size, "local_path": str(path)}


def _manifest(tmp_path: Path, lines: list[str], cut: int | None = None) -> Path:
    """A gzipped JSON-lines manifest; ``cut``: keep only that many bytes of the gzip (torn write)."""
    p = tmp_path / "manifest.jsonl.gz"
    data = gzip.compress(("\n".join(lines) + "\n").encode())
    p.write_bytes(data[:cut] if cut is not None else data)
    return p


def _artifact_record(manifest: Path):
    rec = record_class()()
    art = rec.artifact
    art.name, art.type = "rollouts", "rl-batches"
    art.manifest.manifest_file_path = str(manifest)
    return rec


def _run_file(tmp_path: Path, manifest: Path) -> Path:
    Record = record_class()
    records = []
    r = Record()
    r.run.run_id, r.run.project = "abc123", "proj"
    records.append(r)
    for step in (1, 2, 3):
        h = Record()
        item = h.history.item.add()
        item.key, item.value_json = "critic/score/mean", json.dumps(step / 10)
        h.history.step.num = step
        records.append(h)
    records.append(_artifact_record(manifest))
    e = Record()
    e.exit.exit_code = 0
    records.append(e)
    data, _ = encode([x.SerializeToString() for x in records])
    d = tmp_path / "offline-run-20260101_000000-abc123"
    d.mkdir()
    (d / "run-abc123.wandb").write_bytes(data)
    return d


def test_truncated_manifest_keeps_the_entries_before_the_cut(tmp_path):
    src = write_synth_run(tmp_path / "src", SynthSpec(steps=3, seed=1))
    files = [src / "batches" / f"step_{s}.parquet" for s in (1, 2, 3)]
    lines = [json.dumps(_entry(f, f.name)) for f in files]
    full = gzip.compress(("\n".join(lines) + "\n").encode())
    manifest = _manifest(tmp_path, lines, cut=len(full) - 12)  # the gzip trailer and a little more gone
    info = artifact_info(_artifact_record(manifest).artifact)
    assert [e.path for e in info.entries] == ["step_1.parquet", "step_2.parquet"]
    assert len(info.problems) == 1
    assert info.problems[0].startswith(f"artifact rollouts: its manifest {manifest} cannot be read past line 2 (EOFError: ")
    assert info.problems[0].endswith("; the 2 entries before line 3 are kept")


def test_non_object_manifest_lines_are_named_and_skipped(tmp_path):
    src = write_synth_run(tmp_path / "src", SynthSpec(steps=2, seed=1))
    good = [json.dumps(_entry(src / "batches" / f"step_{s}.parquet", f"step_{s}.parquet")) for s in (1, 2)]
    lines = [good[0], "[1, 2]", '"text"', '{"digest": "x"}', '{"path": "step_9.parquet", "size": -3}',
             "[" * 100_000 + "]" * 100_000, good[1]]
    manifest = _manifest(tmp_path, lines)
    info = artifact_info(_artifact_record(manifest).artifact)
    assert [e.path for e in info.entries] == ["step_1.parquet", "step_2.parquet"]
    prefix = f"artifact rollouts: manifest {manifest} line"
    assert info.problems == [
        f"{prefix} 2 skipped: not a JSON object but list",
        f"{prefix} 3 skipped: not a JSON object but str",
        f'{prefix} 4 skipped: no "path"',
        f"{prefix} 5 skipped: size -3 is not a byte count",
        f"{prefix} 6 skipped: nested too deeply",
    ]


def test_the_import_goes_on_past_a_damaged_manifest(tmp_path):
    src = write_synth_run(tmp_path / "src", SynthSpec(steps=3, seed=1))
    files = [src / "batches" / f"step_{s}.parquet" for s in (1, 2, 3)]
    lines = [json.dumps(_entry(files[0], files[0].name)), "[1, 2]", json.dumps(_entry(files[1], files[1].name)),
             json.dumps(_entry(files[2], files[2].name))]
    full = gzip.compress(("\n".join(lines) + "\n").encode())
    manifest = _manifest(tmp_path, lines, cut=len(full) - 12)
    out = tmp_path / "out"
    report = import_wandb(_run_file(tmp_path, manifest), out)
    assert report.exit_code == 0 and report.batch_steps == [1, 2]
    assert sorted(p.name for p in (out / "batches").iterdir()) == ["step_1.parquet", "step_2.parquet"]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert f"artifact rollouts: manifest {manifest} line 2 skipped: not a JSON object but list" in report.warnings
    assert any(w.startswith(f"artifact rollouts: its manifest {manifest} cannot be read past line 3 (EOFError")
               for w in report.warnings)
