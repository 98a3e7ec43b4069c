"""A run rldiag may not write into: every command writes and reads its outputs in the run's
mirror ``$RLDIAG_HOME/runs/<key>/`` (laid out as ``RUN/rldiag/``), and the app's store sees them.

"Read-only" is decided by ``os.access(W_OK)``, which is always true for root (CI's containers
run as root): these tests declare the run read-only with ``$RLDIAG_READ_ONLY`` (the same switch a
user has), and one test with real permissions runs only as another user.
"""

from __future__ import annotations

import json
import os

import pytest

from rldiag import api
from rldiag.cli.main import main
from rldiag.io.run_layout import RunLayout, mirror_dir
from rldiag.synth import SynthSpec, write_synth_run


def _files(d) -> dict[str, int]:
    return {p.relative_to(d).as_posix(): p.stat().st_mtime_ns for p in d.rglob("*")}


@pytest.fixture
def read_only_run(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("RLDIAG_HOME", str(home))
    run = write_synth_run(tmp_path / "run", SynthSpec(steps=3, prompts=2, n=4, seed=5))
    monkeypatch.setenv("RLDIAG_READ_ONLY", str(run))
    return run


def test_every_command_writes_and_reads_the_mirror(read_only_run, capsys):
    run = read_only_run
    before = _files(run)
    mirror = mirror_dir(run)
    assert main(["recompute", str(run)]) == 0
    assert (mirror / "scenarios" / "baseline" / "scenario.json").is_file()
    assert main(["recompute", str(run), "--estimator", "rloo", "--save-tokens"]) == 0
    # a second command reads them back: the compare finds both scenarios (recomputing the
    # baseline with tokens, into the mirror), the doctor reuses every step of the baseline
    assert main(["compare", str(run), "baseline", "adv_estimator=rloo", "--json"]) == 0
    assert (mirror / "comparisons" / "baseline__vs__adv_estimator=rloo" / "comparison.json").is_file()
    capsys.readouterr()
    main(["doctor", str(run), "--json"])
    meta = json.loads((mirror / "scenarios" / "baseline" / "scenario.json").read_text())
    assert meta["steps_reused"] == [1, 2, 3]
    assert main(["verify", str(run)]) in (0, 1)
    assert _files(run) == before  # nothing written into the run
    # the app's store sees the mirror's scenarios
    from rldiag.store import Store

    store = Store(run)
    assert store.scenario_names() == ["adv_estimator=rloo", "baseline"]
    assert store.scenarios_with_tokens(2) == ["adv_estimator=rloo", "baseline"]
    assert set(store.joined(["critic/advantages/mean"], ["baseline"])["baseline"].to_list()) != {None}


def test_the_api_and_the_token_cache_use_the_mirror(read_only_run):
    run = read_only_run
    got = api.step_tokens(run, 2)
    assert got.source == "cache" and got.path == RunLayout(run).token_cache("baseline").tokens_file(2)
    assert str(got.path).startswith(str(mirror_dir(run)))
    diag = api.mismatch(run)
    assert diag.steps == [1, 2, 3]
    assert not (run / "rldiag").exists()


def test_a_directory_without_write_permission(tmp_path, monkeypatch):
    if os.geteuid() == 0:
        pytest.skip("root writes whatever the permissions say (os.access answers yes)")
    monkeypatch.setenv("RLDIAG_HOME", str(tmp_path / "home"))
    run = write_synth_run(tmp_path / "run", SynthSpec(steps=2, seed=1))
    paths = [run, *run.rglob("*")]
    for p in paths:
        p.chmod(0o555 if p.is_dir() else 0o444)
    try:
        assert RunLayout(run).mirrored
        res = api.recompute(run)
        assert res.path == mirror_dir(run) / "scenarios" / "baseline"
    finally:
        for p in paths:
            p.chmod(0o755 if p.is_dir() else 0o644)
