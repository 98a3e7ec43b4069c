"""Offline runs written by the real wandb SDK -> run directories, value for value."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from rldiag.cli.main import main as cli_main
from rldiag.importers import WandbImportError, import_wandb
from rldiag.importers.wandb_log import BLOCK_LEN, LogStats, iter_records
from rldiag.importers.wandb_records import read_offline_run
from rldiag.io.rundir import RunDir, iter_metrics_lines

pytest.importorskip("wandb")

from .conftest import BASE_CONFIG, BIG_STEP, BIG_VALUE_LEN, CONFIG_UPDATE, STEPS, flat_expected, same_value

pytestmark = pytest.mark.slow  # runs a subprocess / a cluster: `make test-fast` leaves it out


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_rows_match(lines: list[dict], expected_rows: list) -> None:
    assert [ln["step"] for ln in lines] == [step for step, _ in expected_rows]
    for line, (step, data) in zip(lines, expected_rows):
        got = dict(line["data"])
        assert isinstance(got.pop("_timestamp"), float)
        assert isinstance(got.pop("_runtime"), (int, float))
        want = flat_expected(data)
        assert set(got) == set(want), (step, set(got) ^ set(want))
        for key, value in want.items():
            assert same_value(got[key], value), (step, key, got[key], value)


@pytest.mark.parametrize("key", ["main", "typed"])
def test_history_config_and_exit_code(wandb_runs, tmp_path, key):
    out = tmp_path / "run"
    rep = import_wandb(wandb_runs.folder(key), out, artifact_dirs=[wandb_runs.carried])
    assert rep.kind == "offline"
    assert rep.run_id == wandb_runs.result[key]["run_id"]
    assert rep.project == "rldiag-test"
    assert rep.exit_code == (0 if key == "main" else 3)
    assert rep.warnings == []
    # every history row, every key, every value
    assert rep.history_rows == STEPS and (rep.first_step, rep.last_step) == (1, STEPS)
    assert_rows_match(read_jsonl(out / "metrics.jsonl"), wandb_runs.rows)
    # the config: nested as verl's, with the later update applied, as wandb itself sees it
    config = yaml.safe_load((out / "run.yaml").read_text())
    assert config == {**BASE_CONFIG, **CONFIG_UPDATE}
    assert config == wandb_runs.result[key]["config"]
    assert rep.config_updates >= 1
    # the import record
    record = json.loads((out / "rldiag" / "import" / "wandb.json").read_text())
    assert record["exit_code"] == rep.exit_code and record["history"]["rows"] == STEPS
    assert "WANDB_API_KEY" not in json.dumps(record)


def test_special_values_keep_their_type(wandb_runs, tmp_path):
    """Ints stay ints (exact beyond 2**53), NaN and +-inf survive, tiny floats are exact."""
    import_wandb(wandb_runs.folder("main"), tmp_path / "run")
    lines = {ln["step"]: ln["data"] for ln in read_jsonl(tmp_path / "run" / "metrics.jsonl")}
    assert lines[1]["global_seqlen/sum"] == 2**53 + 1 and isinstance(lines[1]["global_seqlen/sum"], int)
    assert isinstance(lines[2]["response_length/max"], int)
    assert math.isnan(lines[3]["actor/grad_norm"])
    assert lines[4]["actor/grad_norm"] == math.inf and lines[5]["actor/grad_norm"] == -math.inf
    assert lines[6]["actor/ppo_kl"] == 5e-324 and lines[6]["critic/score/mean"] == 1e-300
    assert lines[2]["rldiag/flag"] is True and lines[1]["rldiag/flag"] is False
    # metrics.jsonl is what verl's file logger writes, and rldiag's own reader takes it
    logged = dict(iter_metrics_lines(tmp_path / "run" / "metrics.jsonl"))
    assert logged[3]["actor/pg_clipfrac"] == wandb_runs.rows[2][1]["actor/pg_clipfrac"]
    assert logged[2]["val.reward.mean"] == wandb_runs.rows[1][1]["val"]["reward"]["mean"]


def test_typed_values_keep_float_type(wandb_runs, tmp_path):
    """With wandb's typed history values a logged 12.0 comes back as a float, not as 12."""
    import_wandb(wandb_runs.folder("typed"), tmp_path / "run")
    lines = {ln["step"]: ln["data"] for ln in read_jsonl(tmp_path / "run" / "metrics.jsonl")}
    for step, data in wandb_runs.rows:
        got = lines[step]["response_length/mean"]
        assert isinstance(got, float) and got == data["response_length/mean"]


def test_nested_separator_option(wandb_runs, tmp_path):
    import_wandb(wandb_runs.folder("main"), tmp_path / "run", nested_sep="/", batches=False)
    first = read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]["data"]
    assert first["val/reward/mean"] == wandb_runs.rows[0][1]["val"]["reward"]["mean"]
    assert "val.acc" not in first


def test_record_split_across_blocks(wandb_runs, tmp_path):
    """The 80 kB value is one record in FIRST, MIDDLE... and LAST chunks; it comes back whole."""
    stats = LogStats("main")
    payloads = list(iter_records(wandb_runs.wandb_file("main"), stats))
    assert stats.chunks["first"] >= 1 and stats.chunks["middle"] >= 1 and stats.chunks["last"] >= 1
    assert any(len(p) > 2 * BLOCK_LEN for _, p in payloads)
    assert not stats.damaged and stats.unread_tail_bytes == 0
    import_wandb(wandb_runs.folder("main"), tmp_path / "run", batches=False)
    lines = {ln["step"]: ln["data"] for ln in read_jsonl(tmp_path / "run" / "metrics.jsonl")}
    big = lines[BIG_STEP]["rldiag/notes"]
    assert len(big) == BIG_VALUE_LEN and big == wandb_runs.rows[BIG_STEP - 1][1]["rldiag/notes"]


def test_batches_from_the_artifact_and_recompute(wandb_runs, tmp_path):
    out = tmp_path / "run"
    rep = import_wandb(wandb_runs.folder("main"), out)
    assert rep.batch_steps == [1, 2, 3]
    art = rep.artifacts[0]
    assert art["type"] == "rl-batches" and not art["missing"]
    assert all(f["how"] == "recorded path" for f in art["found"])
    for sf in RunDir(wandb_runs.synth).step_files():
        assert (out / "batches" / sf.path.name).read_bytes() == sf.path.read_bytes()
    first = pq.read_table(wandb_runs.synth / "batches" / "step_1.parquet")
    assert pq.read_table(out / "batches" / "step_1.parquet").equals(first)

    from rldiag.scenario.recompute import recompute

    got = recompute(out)
    want = recompute(wandb_runs.synth)
    assert got.steps_done == want.steps_done == [1, 2, 3] and not got.steps_failed
    assert got.settings["algorithm.adv_estimator"] == "grpo"
    for g, w in zip(sorted(got.metrics, key=lambda r: r["step"]), sorted(want.metrics, key=lambda r: r["step"])):
        assert g.keys() == w.keys()
        for k in g:
            assert same_value(g[k], w[k]), k


def test_moved_artifact_files_found_by_digest(wandb_runs, tmp_path):
    """typed's staged files were moved and renamed: --artifact-dir finds them by MD5."""
    rep = import_wandb(wandb_runs.folder("typed"), tmp_path / "run", artifact_dirs=[wandb_runs.carried])
    assert rep.batch_steps == [1, 2, 3] and rep.warnings == []
    assert all(Path(f["found_at"]).parent == wandb_runs.carried for f in rep.artifacts[0]["found"])
    for sf in RunDir(wandb_runs.synth).step_files():
        assert (tmp_path / "run" / "batches" / sf.path.name).read_bytes() == sf.path.read_bytes()


def test_missing_artifact_files_are_reported(wandb_runs, tmp_path):
    rep = import_wandb(wandb_runs.folder("typed"), tmp_path / "run")
    assert rep.batch_steps == []
    assert not (tmp_path / "run" / "batches").exists()
    assert len(rep.warnings) == 1 and "3 of 3 batch files not found (steps 1, 2, 3)" in rep.warnings[0]
    assert rep.history_rows == STEPS  # the rest of the run is imported


def test_a_copied_file_with_other_content_is_not_taken(wandb_runs, tmp_path):
    """A file under the staged name but with other bytes fails the digest check."""
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    run, _ = read_offline_run(wandb_runs.wandb_file("typed"), lambda s, d: None)
    for entry in run.artifacts[0].entries:
        (decoy / Path(entry.local_path).name).write_bytes(b"not the batch")
        (decoy / entry.path).write_bytes(b"not the batch either")
    rep = import_wandb(wandb_runs.folder("typed"), tmp_path / "run", artifact_dirs=[decoy])
    assert rep.batch_steps == [] and "not found" in rep.warnings[0]


def test_torn_file_imports_what_is_complete(wandb_runs, tmp_path):
    """A run killed mid-write: the file is cut inside a block; complete records are imported."""
    src = wandb_runs.wandb_file("main")
    data = src.read_bytes()
    cut = BLOCK_LEN * 2 + 5000 + 3  # inside the third block, not at a record boundary
    assert len(data) > cut + BLOCK_LEN
    torn = tmp_path / "offline-run-torn" / src.name
    torn.parent.mkdir()
    torn.write_bytes(data[:cut])
    rep = import_wandb(torn.parent, tmp_path / "run", batches=False)
    assert rep.exit_code is None and rep.state == "unfinished"
    log = rep.log
    assert log["unread_tail_bytes"] > 0 and (log["truncated_tail"] or log["incomplete_records"])
    assert log["end_of_records"] + log["unread_tail_bytes"] == cut
    assert any("ends mid-record" in w and f"the last {log['unread_tail_bytes']} bytes" in w for w in rep.warnings)
    assert any("no exit record" in w for w in rep.warnings)
    lines = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    n = len(lines)
    assert 0 < n < STEPS
    assert_rows_match(lines, wandb_runs.rows[:n])
    # exactly the history records that end before the cut (read from the whole file)
    from rldiag.importers.wandb_sdk import record_class

    full = LogStats("full")
    rec = record_class()()
    complete = 0
    for _offset, payload in iter_records(src, full):
        rec.ParseFromString(payload)
        if rec.WhichOneof("record_type") == "history" and full.end_of_records <= cut:
            complete += 1
    assert n == complete


def test_torn_inside_a_split_record(wandb_runs, tmp_path):
    """Cut inside the big record's MIDDLE chunk: that record is incomplete, the ones before are kept."""
    src = wandb_runs.wandb_file("main")
    from rldiag.importers.wandb_sdk import record_class

    rec = record_class()()
    big = []
    for off, payload in iter_records(src):
        rec.ParseFromString(payload)
        if len(payload) > 2 * BLOCK_LEN and rec.WhichOneof("record_type") == "history":
            big.append(off)
    (off,) = big
    cut = off + BLOCK_LEN + 100
    torn = tmp_path / "run-torn.wandb"
    torn.write_bytes(src.read_bytes()[:cut])
    rep = import_wandb(torn, tmp_path / "run", batches=False)
    assert rep.log["incomplete_records"] == 1
    assert rep.last_step == BIG_STEP - 1
    assert_rows_match(read_jsonl(tmp_path / "run" / "metrics.jsonl"), wandb_runs.rows[:BIG_STEP - 1])


def test_reimport_updates_in_place(wandb_runs, tmp_path):
    out = tmp_path / "run"
    import_wandb(wandb_runs.folder("main"), out)
    # things that are not the import's: another step's batch, a scenario, a note
    shutil.copy(out / "batches" / "step_1.parquet", out / "batches" / "step_99.parquet")
    (out / "batches" / "README").write_text("kept")
    (out / "rldiag" / "scenarios" / "baseline").mkdir(parents=True)
    (out / "rldiag" / "scenarios" / "baseline" / "scenario.json").write_text("{}")
    (out / "batches" / "step_2.parquet").write_bytes(b"stale")
    before = (out / "metrics.jsonl").read_bytes()
    inode = os.stat(out / "metrics.jsonl").st_ino
    rep = import_wandb(wandb_runs.folder("main"), out)
    assert rep.batch_steps == [1, 2, 3]
    assert (out / "metrics.jsonl").read_bytes() == before
    assert os.stat(out / "metrics.jsonl").st_ino != inode  # replaced by a rename, not rewritten
    assert (out / "batches" / "step_2.parquet").read_bytes() == (wandb_runs.synth / "batches" / "step_2.parquet").read_bytes()
    assert (out / "batches" / "step_99.parquet").is_file() and (out / "batches" / "README").read_text() == "kept"
    assert (out / "rldiag" / "scenarios" / "baseline" / "scenario.json").is_file()
    assert not [p for p in out.rglob(".*") if p.name.endswith(".tmp")]  # no staging left behind
    assert sorted(p.name for p in out.iterdir()) == ["batches", "metrics.jsonl", "rldiag", "run.yaml"]


def test_export_round_trip(wandb_runs, tmp_path):
    """rldiag.capture.wandb_export.export_run -> offline run -> import: the same run directory."""
    src = wandb_runs.export_src
    rep = import_wandb(wandb_runs.folder("export"), tmp_path / "run")
    assert rep.exit_code == 0 and rep.warnings == []
    assert yaml.safe_load((tmp_path / "run" / "run.yaml").read_text()) == yaml.safe_load((src / "run.yaml").read_text())
    for sf in RunDir(src).step_files():
        assert (tmp_path / "run" / "batches" / sf.path.name).read_bytes() == sf.path.read_bytes()
    want = [json.loads(line) for line in (src / "metrics.jsonl").read_text().splitlines()]
    got = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [g["step"] for g in got] == [w["step"] for w in want]
    for g, w in zip(got, want):
        data = {k: v for k, v in g["data"].items() if k not in ("_timestamp", "_runtime")}
        assert data == w["data"]


def test_source_errors(wandb_runs, tmp_path):
    with pytest.raises(WandbImportError, match="not a W&B run file"):
        bad = tmp_path / "x.wandb"
        bad.write_bytes(b"garbage-garbage")
        import_wandb(bad, tmp_path / "run")
    with pytest.raises(WandbImportError, match="is a wandb folder with"):
        import_wandb(wandb_runs.folder("main").parent, tmp_path / "run")
    with pytest.raises(WandbImportError, match="no such file or folder"):
        import_wandb(tmp_path / "nope", tmp_path / "run")
    with pytest.raises(WandbImportError, match="nothing to import"):
        import_wandb(None, tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_cli(wandb_runs, tmp_path, capsys):
    out = tmp_path / "run"
    rc = cli_main(["import-wandb", str(wandb_runs.wandb_file("main")), "--out", str(out), "--no-progress"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert f"{STEPS} rows, steps 1..{STEPS}" in cap.out and "exit code      0" in cap.out
    assert "3 step files" in cap.out
    rc = cli_main(["import-wandb", str(wandb_runs.folder("typed")), "--out", str(tmp_path / "t"), "--no-progress"])
    cap = capsys.readouterr()
    assert rc == 0 and "warning:" in cap.err and "not found" in cap.err
    rc = cli_main(["import-wandb", str(tmp_path / "nope"), "--out", str(tmp_path / "u")])
    assert rc == 1 and "WandbImportError" in capsys.readouterr().err
