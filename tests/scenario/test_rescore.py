"""``rldiag rescore``: the saved rollouts scored again, everything after the scores recomputed.

The toy task's own reward re-scores the bundled sample to its captured scores and the baseline,
bit for bit; another reward's scores give the scenario a recompute gives on a run whose
``token_level_scores`` hold them; calls that raise, hang or crash are reported, their rows keep
their captured scores, and no worker is left behind."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rldiag.errors import RewardError
from rldiag.io.run_layout import RunLayout
from rldiag.io.rundir import RunDir
from rldiag.scenario.recompute import recompute
from rldiag.scenario.rescore import rescore
from tests.scenario.rescore_runs import write_text_run

pytestmark = pytest.mark.slow  # worker processes

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "grpo-tool"
TOY = "rldiag.toy.task:compute_score"


def _metrics(run: Path, name: str) -> pa.Table:
    return pq.read_table(RunLayout(run).scenario(name).metrics)


def _rows(run: Path, name: str, step: int) -> pa.Table:
    return pq.read_table(RunLayout(run).scenario(name).rows_file(step))


def _assert_same_metrics(run_a: Path, a: str, run_b: Path, b: str) -> None:
    ta, tb = _metrics(run_a, a), _metrics(run_b, b)
    shared = [c for c in tb.column_names if c in ta.column_names]
    assert set(tb.column_names) <= set(ta.column_names), set(tb.column_names) - set(ta.column_names)
    for c in shared:
        np.testing.assert_array_equal(np.asarray(ta[c].to_pylist(), dtype=float), np.asarray(tb[c].to_pylist(), dtype=float),
                                      err_msg=c)


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("rescore") / "grpo-tool"
    shutil.copytree(SAMPLE, run, ignore=shutil.ignore_patterns("rldiag"))
    recompute(run)
    return run


def test_the_toy_reward_rescores_the_sample_to_its_baseline_bit_for_bit(sample):
    recompute(sample)  # the whole baseline, whatever step range another test of the module left it at
    rep = rescore(sample, TOY, workers=2)
    assert rep.ok and rep.changed == 0 and not rep.failures
    assert rep.rows == 30 * 64 and rep.calls < rep.rows  # identical (source, reply, truth, extra_info) once
    _assert_same_metrics(sample, "reward=compute_score", sample, "baseline")
    extra = set(_metrics(sample, "reward=compute_score").column_names) - set(_metrics(sample, "baseline").column_names)
    assert extra == {"rldiag/reward/acc/mean", "rldiag/rescore/failed_rows", "rldiag/rescore/changed_rows"}
    for sf in RunDir(sample).step_files():
        new, base = _rows(sample, "reward=compute_score", sf.step), _rows(sample, "baseline", sf.step)
        for c in base.column_names:
            assert new[c].equals(base[c]), (sf.step, c)
        assert new["score_captured"].to_pylist() == new["score"].to_pylist()
        # a float result is recorded as verl records it, component "acc" (the function's float64 value)
        np.testing.assert_array_equal(np.float32(new["reward_acc"].to_numpy()), np.float32(new["score"].to_numpy()))
        assert set(new["rescore_failed"].to_pylist()) == {0}
    meta = json.loads(RunLayout(sample).scenario("reward=compute_score").meta.read_text())
    assert meta["reward"]["name"] == "compute_score" and meta["reward"]["module"] == "rldiag.toy.task"
    assert meta["reward"]["sha256"] == __import__("hashlib").sha256(Path(meta["reward"]["file"]).read_bytes()).hexdigest()
    assert meta["reward"]["dedupe"] is True and meta["reward"]["manager"]["name"] == "naive"


TAG_ONLY = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Pays for the end tag alone: a planted shortcut."""
    return {"score": 1.0 if "<eos>" in solution_str else 0.0, "words": float(len(solution_str.split()))}
'''


def test_new_scores_give_the_scenario_of_a_run_that_had_them(sample, tmp_path):
    """Everything downstream follows the new scores: the rescored scenario is, bit for bit, the
    baseline of a copy of the run whose token_level_scores hold the new scores at each row's last
    token (float32)."""
    fn = tmp_path / "tag_only.py"
    fn.write_text(TAG_ONLY)
    rep = rescore(sample, f"{fn}:compute_score", name="tag", workers=2, steps="1:6")
    assert rep.ok and rep.changed > 0
    copy = tmp_path / "copy"
    shutil.copytree(sample, copy, ignore=shutil.ignore_patterns("rldiag"))
    for sf in RunDir(copy).step_files():
        if sf.step > 6:
            sf.path.unlink()
            continue
        t = pq.read_table(sf.path)
        texts = t["response_text"].to_pylist()
        want = [1.0 if "<eos>" in s else 0.0 for s in texts]
        rows = _rows(sample, "tag", sf.step)
        assert rows["score"].to_pylist() == want
        assert rows["reward_words"].to_pylist() == [float(len(s.split())) for s in texts]
        assert rows["score_captured"].to_pylist() == t["score"].to_pylist()
        tls = [[0.0] * (len(m) - 1) + [w] for m, w in zip(t["response_mask"].to_pylist(), want)]
        t = t.set_column(t.column_names.index("token_level_scores"), "token_level_scores",
                         pa.array(tls, type=pa.list_(pa.float32())))
        pq.write_table(t, sf.path)
    recompute(copy)
    _assert_same_metrics(sample, "tag", copy, "baseline")
    words = _metrics(sample, "tag")["rldiag/reward/words/mean"].to_pylist()
    assert words[0] == pytest.approx(np.mean([len(s.split()) for s in pq.read_table(
        RunDir(sample).step_files()[0].path)["response_text"].to_pylist()]))


TROUBLE = '''
import os, signal, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    print("noise on stdout")
    if data_source == "sleep":
        time.sleep(60)  # interrupted by the worker's SIGALRM
    if data_source == "hang":  # SIGALRM blocked: only the parent's kill ends it
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(60)
    if data_source == "crash":
        os._exit(3)
    if data_source == "raise":
        raise ValueError("cannot grade " + solution_str)
    if data_source == "swallow":  # a function's own except Exception does not swallow the timeout
        try:
            time.sleep(60)
        except Exception:
            return 1.0
    return float(solution_str.split()[-1] == str(ground_truth))
'''


def _row(text: str, source: str = "ok", truth: str = "7", score: float = 0.5) -> dict:
    return {"text": text, "data_source": source, "ground_truth": truth, "score": score}


def test_failed_calls_keep_their_scores_are_reported_and_leave_no_worker(tmp_path):
    run = write_text_run(tmp_path / "run", [
        [_row("a 7"), _row("b 8", "sleep"), _row("c 7", "raise"), _row("d 7"), _row("e 7", "swallow"), _row("x 7")],
        [_row("e 7", "hang"), _row("f 9"), _row("g 7", "crash"), _row("h 7")],
        [_row("i 7", "raise"), _row("j 7", "raise"), _row("k 7", "raise"), _row("l 7")],  # 3 of 4 fail
    ])
    fn = tmp_path / "trouble.py"
    fn.write_text(TROUBLE)
    rep = rescore(run, f"{fn}:compute_score", workers=2, timeout=0.3, dedupe=False)
    assert len(rep.worker_pids) == 4  # two, then the replacements of the hung one and the crashed one
    for pid in rep.worker_pids:  # every worker ended and reaped: none left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    why = {(f.step, f.row): (f.data_source, f.message) for f in rep.failures}
    assert set(why) == {(1, 1), (1, 2), (1, 4), (2, 0), (2, 2), (3, 0), (3, 1), (3, 2)}
    assert why[1, 4][1].startswith("TimeoutError: the call took longer than 0.3 s")
    assert why[1, 1][1].startswith("TimeoutError: the call took longer than 0.3 s")
    assert why[1, 2] == ("raise", "ValueError: cannot grade c 7")
    assert why[2, 0][1].startswith("TimeoutError: no answer within 0.3 s + 2 s")
    assert why[2, 2][1].startswith("WorkerDied")
    assert rep.workers_replaced == 2  # the hung one and the crashed one
    assert set(rep.steps_failed) == {3} and "3 of 4 rows' reward calls failed" in rep.steps_failed[3]
    assert rep.scenario.steps_done == [1, 2]  # the others are written
    r1, r2 = _rows(run, "reward=compute_score", 1), _rows(run, "reward=compute_score", 2)
    assert r1["score"].to_pylist() == [1.0, 0.5, 0.5, 1.0, 0.5, 1.0]  # failed rows: the captured 0.5
    assert r1["rescore_failed"].to_pylist() == [0, 1, 1, 0, 1, 0]
    assert r2["score"].to_pylist() == [0.5, 0.0, 0.5, 1.0]
    assert _metrics(run, "reward=compute_score")["rldiag/rescore/failed_rows"].to_pylist() == [3.0, 2.0]


def test_identical_calls_are_made_once_unless_asked(tmp_path):
    rows = [_row("a 7"), _row("a 7"), _row("b 7"), _row("a 7", truth="8")]
    run = write_text_run(tmp_path / "run", [[{**r, "extra_info": {"split": "test"}} for r in rows]])
    counter = tmp_path / "calls.txt"
    fn = tmp_path / "count.py"
    fn.write_text(f"def score(data_source, solution_str, ground_truth, extra_info):\n"
                  f"    open({str(counter)!r}, 'a').write('x')\n"
                  f"    return float(solution_str.endswith(ground_truth))\n")
    assert rescore(run, f"{fn}:score", workers=1).calls == 3
    assert len(counter.read_text()) == 3
    assert rescore(run, f"{fn}:score", workers=1, dedupe=False, name="all").calls == 4
    assert len(counter.read_text()) == 7
    meta = json.loads(RunLayout(run).scenario("all").meta.read_text())
    assert meta["reward"]["dedupe"] is False and meta["reward"]["calls"] == 4


def test_an_async_function_with_the_runs_reward_kwargs_from_config(tmp_path, capsys):
    fn = tmp_path / "judge.py"
    fn.write_text("async def judge(data_source, solution_str, ground_truth, extra_info, bonus=0.0):\n"
                  "    return {'score': float(solution_str.endswith(ground_truth)) + bonus, 'idx': extra_info['index']}\n")
    run = write_text_run(tmp_path / "run", [[_row("a 7"), _row("b 8")]], config={
        "reward": {"custom_reward_function": {"path": str(fn), "name": "judge", "reward_kwargs": {"bonus": 0.25}}}})
    rep = rescore(run, "from-config", workers=1)
    assert rep.function.file == str(fn.resolve()) and rep.function.kwargs == {"bonus": 0.25}
    rows = _rows(run, "reward=judge", 1)
    assert rows["score"].to_pylist() == [1.25, 0.25]
    assert rows["reward_idx"].to_pylist() == [0.0, 1.0]


def test_dapo_adds_its_overlong_penalty_and_other_managers_are_refused(tmp_path):
    fn = tmp_path / "one.py"
    fn.write_text("def one(data_source, solution_str, ground_truth, extra_info):\n    return 1.0\n")
    reward = {"reward_manager": {"name": "dapo"}, "reward_kwargs": {
        "max_resp_len": 4, "overlong_buffer_cfg": {"enable": True, "len": 2, "penalty_factor": 1.0, "log": True}}}
    run = write_text_run(tmp_path / "run", [[_row("a"), _row("a b c"), _row("a b c d"), _row("a b")]],
                         config={"reward": reward})
    rescore(run, f"{fn}:one", workers=1)
    rows = _rows(run, "reward=one", 1)
    # expected length 4 - 2 = 2; 3 tokens: -0.5, 4 tokens: -1.0 (verl's dapo reward manager)
    assert rows["score"].to_pylist() == [1.0, 0.5, 0.0, 1.0]
    assert rows["reward_overlong_reward"].to_pylist() == [0.0, -0.5, -1.0, 0.0]
    other = write_text_run(tmp_path / "prime", [[_row("a"), _row("b")]],
                           config={"reward": {"reward_manager": {"name": "prime"}}})
    with pytest.raises(RewardError, match="'prime' is not supported by rescore"):
        rescore(other, f"{fn}:one", workers=1)
    assert not RunLayout(other).scenario("reward=one").dir.exists()


def test_compare_never_recomputes_a_rescore_as_a_plain_recompute(sample, tmp_path):
    """compare recomputes a scenario lacking per-token outputs from its overrides; a rescored one
    would lose its scores so: it is left as it is (its steps listed without tokens), and a rescore
    with --save-tokens is compared token by token."""
    from rldiag.analysis.compare import compare
    from rldiag.scenario.tokens import step_tokens

    fn = tmp_path / "tag_only.py"
    fn.write_text(TAG_ONLY)
    rescore(sample, f"{fn}:compute_score", name="tag2", workers=1, steps="1:2")
    before = RunLayout(sample).scenario("tag2").metrics.read_bytes()
    rep = compare(sample, "baseline", "tag2", steps="1:2")
    assert "tag2" not in rep.recomputed and rep.steps_without_tokens["tag2"] == [1, 2]
    assert RunLayout(sample).scenario("tag2").metrics.read_bytes() == before  # not rewritten
    assert "is a rescore" in (step_tokens(sample, 1, "tag2").error or "")
    rescore(sample, f"{fn}:compute_score", name="tag2", workers=1, steps="1:2", save_tokens=True)
    rep = compare(sample, "baseline", "tag2", steps="1:2")
    assert rep.token_steps == [1, 2] and rep.summary["sign_agreement"] < 1.0
    assert "score_captured" in _rows(sample, "tag2", 1).column_names


def test_what_the_reward_changed(tmp_path):
    from rldiag.analysis.reward_change import reward_changes
    from rldiag.scenario.tokens import ensure_scenario

    # a copy of its own: ensure_scenario rewrites the baseline for steps 1:3 only, which the
    # module's shared sample must not see (test order: make test-order, seed 1)
    sample = shutil.copytree(SAMPLE, tmp_path / "grpo-tool", ignore=shutil.ignore_patterns("rldiag"))
    recompute(sample, steps="1:3")
    fn = tmp_path / "tag_only.py"
    fn.write_text(TAG_ONLY)
    rescore(sample, f"{fn}:compute_score", name="tag3", workers=1, steps="1:3", save_tokens=True)
    ensure_scenario(sample, "baseline", None, "1:3")  # the baseline's tokens, as compare makes them
    c = reward_changes(sample, "baseline", "tag3", steps="1:3")
    assert c is not None and c.rows == 3 * 64 and c.token_steps == [1, 2, 3]
    changed = gained = lost = flips = 0
    for step in (1, 2, 3):
        a, b = _rows(sample, "baseline", step), _rows(sample, "tag3", step)
        changed += sum(x != y for x, y in zip(a["score"].to_pylist(), b["score"].to_pylist()))
        flips += sum(x * y < 0 for x, y in zip(a["advantage_mean"].to_pylist(), b["advantage_mean"].to_pylist()))
        first = {}
        for u, sa, sb in zip(a["uid"].to_pylist(), a["group_has_signal"].to_pylist(), b["group_has_signal"].to_pylist()):
            first.setdefault(u, (sa, sb))
        gained += sum(1 for sa, sb in first.values() if sb and not sa)
        lost += sum(1 for sa, sb in first.values() if sa and not sb)
    assert (c.score_changed, c.gained_signal, c.lost_signal, c.sign_flips) == (changed, gained, lost, flips)
    assert c.score_changed > 0 and c.by_source == {"toy/digit_sum": {"rows": 192, "changed": changed}}
    top = c.top_tokens[0]
    assert abs(top["weight_b"] - top["weight_a"]) >= abs(c.top_tokens[-1]["weight_b"] - c.top_tokens[-1]["weight_a"])
    text = pq.read_table(RunDir(sample).step_files()[top["step"] - 1].path)["response_tokens"].to_pylist()
    assert top["token"] == text[top["row"]][top["position"]]
    for side, key in (("baseline", "weight_a"), ("tag3", "weight_b")):  # |A| x w of the saved outputs
        t = pq.read_table(RunLayout(sample).scenario(side).tokens_file(top["step"]))
        adv = t["advantages"].to_pylist()[top["row"]][top["position"]]
        w = t["loss_weight"].to_pylist()[top["row"]][top["position"]]
        assert top[key] == pytest.approx(abs(adv) * w, rel=1e-6)
    assert reward_changes(sample, "baseline", "baseline") is None


def test_a_v1_session_is_scored_on_its_last_output(tmp_path):
    """verl's reward loop scores a multi-output session on its last output: only those rows are
    called; the earlier outputs keep their captured scores and are not failures."""
    rows = [{**_row(t), "session_id": sid, "output_index": k}
            for t, sid, k in (("a 1", "s0", 0), ("b 7", "s0", 1), ("c 7", "s1", 0), ("d 2", "s2", 1), ("e 7", "s2", 0))]
    run = write_text_run(tmp_path / "run", [rows])
    counter = tmp_path / "calls.txt"
    fn = tmp_path / "count.py"
    fn.write_text(f"def score(data_source, solution_str, ground_truth, extra_info):\n"
                  f"    open({str(counter)!r}, 'a').write(solution_str[0])\n"
                  f"    return float(solution_str.endswith(ground_truth))\n")
    rep = rescore(run, f"{fn}:score", workers=1)
    assert sorted(counter.read_text()) == ["b", "c", "d"] and not rep.failures
    r = _rows(run, "reward=score", 1)
    assert r["score"].to_pylist() == [0.5, 1.0, 1.0, 0.0, 0.5]
    assert r["rescore_failed"].to_pylist() == [0] * 5


def test_a_rescored_scenario_is_never_reused_as_a_recompute(tmp_path):
    """A rescored scenario has the run's resolved settings but not its scores: the baseline
    computed after it, or a recompute under the rescored name, never reuses its steps (found when
    a baseline made after a rescore came back equal to the rescore)."""
    run = shutil.copytree(SAMPLE, tmp_path / "run", ignore=shutil.ignore_patterns("rldiag"))  # no outputs
    fn = tmp_path / "tag_only.py"
    fn.write_text(TAG_ONLY)
    rescore(run, f"{fn}:compute_score", name="tag", workers=1, steps="1:2")
    base = recompute(run, name="baseline", steps="1:2")
    assert base.steps_reused == [] and base.steps_done == [1, 2]
    meta = json.loads(RunLayout(run).scenario("baseline").meta.read_text())
    assert "reused_from" not in meta or meta["reused_from"] is None
    captured = [v for s in (1, 2) for v in _rows(run, "baseline", s)["score"].to_pylist()]
    new = [v for s in (1, 2) for v in _rows(run, "tag", s)["score"].to_pylist()]
    assert captured != new  # the baseline holds the batches' scores, not the rescore's
    # a plain recompute named as the rescore: the rescored steps are not its to reuse (the
    # baseline's, equal by resolved settings, are)
    recompute(run, name="tag", steps="1:2")
    meta = json.loads(RunLayout(run).scenario("tag").meta.read_text())
    assert meta.get("reused_from") == "baseline" and not meta.get("reward")
    assert [v for s in (1, 2) for v in _rows(run, "tag", s)["score"].to_pylist()] == captured
