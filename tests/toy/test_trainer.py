"""The toy trainer trains for real and writes a run directory as docs/run-directory.md describes it."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from rldiag.config.settings import resolve_settings
from rldiag.engine.requirements import recompute_columns
from rldiag.io.loader import load_step
from rldiag.io.rundir import RunDir, iter_metrics_lines
from rldiag.toy import ToyTrainer, grpo_tool, ppo_gae
from rldiag.toy.algos import masked_whiten
from rldiag.toy.task import (
    CALL,
    CLOSE,
    DIGITS,
    OPEN,
    PAD,
    SEP,
    TOKEN_NAMES,
    ToyTokenizer,
    sample_prompts,
    score_responses,
)

ACTOR = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "actor/entropy_loss")
DATA = ("critic/score/mean", "critic/advantages/mean", "critic/returns/max", "response_length/mean",
        "response_length/clip_ratio", "prompt_length/mean", "response/aborted_ratio")


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("toy") / "grpo"
    ToyTrainer(grpo_tool(steps=3)).run(out)
    return out


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("toy") / "ppo"
    ToyTrainer(ppo_gae(steps=3, prompts_per_step=32)).run(out)
    return out


def test_grpo_run_files(grpo_run):
    rd = RunDir(grpo_run)
    assert [sf.step for sf in rd.step_files()] == [1, 2, 3]
    cfg = yaml.safe_load((grpo_run / "run.yaml").read_text())
    assert cfg["algorithm"]["adv_estimator"] == "grpo"
    assert cfg["actor_rollout_ref"]["rollout"]["n"] == 8
    assert cfg["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"] == 1
    assert cfg["data"]["max_response_length"] == 12 and cfg["data"]["max_prompt_length"] == 5
    lines = list(iter_metrics_lines(rd.metrics_file))
    assert [s for s, _ in lines] == [1, 2, 3]
    for _, m in lines:
        assert set(ACTOR + DATA + ("actor/kl_loss", "actor/kl_coef")) <= set(m)
    t = pq.read_table(rd.step_files()[0].path)
    assert {"uid", "step", "prompt_length", "score", "response_mask", "token_level_scores", "old_log_probs",
            "log_probs", "ref_log_prob", "rollout_log_probs", "entropy", "token_level_rewards", "advantages",
            "returns"} <= set(t.column_names)
    assert t.num_rows == 64 and len(set(t.column("uid").to_pylist())) == 8
    settings = resolve_settings(grpo_run)
    step = load_step(rd.step_files()[0], settings, recompute_columns(settings))
    b = step.batch
    tool_tokens = b.response_mask == 0  # every packed token is inside its row
    assert bool(tool_tokens.any()), "some rows have tool-observation tokens (mask 0 inside the row)"
    live = b.response_mask.bool()
    assert not torch.equal(b.rollout_log_probs[live], b.old_log_probs[live]), "bf16 rollout differs from fp32"
    assert bool((b.log_probs[live] != b.old_log_probs[live]).any()), "later mini-batches moved off ratio 1"


def test_ppo_run_files(ppo_run):
    rd = RunDir(ppo_run)
    lines = list(iter_metrics_lines(rd.metrics_file))
    assert len(lines) == 3
    for _, m in lines:
        assert {"critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/values/mean",
                "critic/vf_explained_var", "actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff"} <= set(m)
    t = pq.read_table(rd.step_files()[-1].path)
    assert {"values", "vpreds"} <= set(t.column_names)
    assert len(set(t.column("uid").to_pylist())) == t.num_rows == 32  # n = 1
    clipfracs = [m["actor/pg_clipfrac"] for _, m in lines]
    assert max(clipfracs) > 0, "clipping occurs"


@pytest.mark.parametrize("fixture", ["grpo_run", "ppo_run"])
def test_the_run_has_the_text_of_every_prompt_and_response_token(fixture, request):
    run = request.getfixturevalue(fixture)
    digits, sep = set(TOKEN_NAMES[:DIGITS]), TOKEN_NAMES[SEP]
    for sf in RunDir(run).step_files():
        t = pq.read_table(sf.path)
        prompts, responses = t["prompt_tokens"].to_pylist(), t["response_tokens"].to_pylist()
        masks = t["response_mask"].to_pylist()
        assert [len(p) for p in prompts] == t["prompt_length"].to_pylist()
        assert [len(r) for r in responses] == [len(m) for m in masks]
        for prompt in prompts:  # 2-4 digits then "=", the left padding gone
            assert prompt[-1] == sep and set(prompt[:-1]) <= digits and 2 <= len(prompt) - 1 <= 4
        for response, mask in zip(responses, masks):  # the tool's observation: mask 0, <obs> ... </obs>
            observed = [w for w, m in zip(response, mask) if m == 0]
            if observed:  # right after the policy's <call>
                assert observed[0] == TOKEN_NAMES[OPEN] and set(observed[1:-1]) <= digits
                assert response[mask.index(0) - 1] == TOKEN_NAMES[CALL]


@pytest.mark.parametrize("fixture", ["grpo_run", "ppo_run"])
def test_the_run_carries_what_its_reward_function_reads(fixture, request):
    """The trainer hands the capture verl's reward inputs; ``compute_score`` called on the
    captured columns as verl calls it gives each row its score (float32), ``<pad>`` left out of
    the text as ``skip_special_tokens=True`` leaves it out."""
    import json

    from rldiag.toy.task import DATA_SOURCE, compute_score

    run = request.getfixturevalue(fixture)
    ids = {w: i for i, w in enumerate(TOKEN_NAMES)}
    for sf in RunDir(run).step_files():
        t = pq.read_table(sf.path)
        assert set(t["data_source"].to_pylist()) == {DATA_SOURCE}
        texts = t["response_text"].to_pylist()
        assert texts == ToyTokenizer().batch_decode([[ids[w] for w in r] for r in t["response_tokens"].to_pylist()],
                                                    skip_special_tokens=True)
        scores = [np.float32(compute_score(data_source=d, solution_str=s, ground_truth=json.loads(g),
                                           extra_info=json.loads(e)))
                  for d, s, g, e in zip(t["data_source"].to_pylist(), texts, t["ground_truth"].to_pylist(),
                                        t["extra_info"].to_pylist())]
        np.testing.assert_array_equal(np.asarray(scores, dtype=np.float64), np.asarray(t["score"].to_pylist()))


def test_the_toy_tokenizer_names_the_vocabulary():
    assert ToyTokenizer().convert_ids_to_tokens([3, SEP, PAD, CALL, OPEN, CLOSE]) == [
        "3", "=", "<pad>", "<call>", "<obs>", "</obs>"]


def test_writing_the_text_leaves_the_training_numbers_alone(tmp_path):
    """The text is made on the capture's writer thread, outside training and its random streams:
    a run that writes nothing logs the same metrics, bit for bit."""
    torch.set_num_threads(1)
    cfg = grpo_tool(steps=2, prompts_per_step=2, n=4)
    logged: dict[str, list] = {"written": [], "not": []}
    ToyTrainer(cfg).run(tmp_path, on_step=lambda s, m: logged["written"].append(m))
    ToyTrainer(cfg).run(None, on_step=lambda s, m: logged["not"].append(m))
    assert "prompt_tokens" in pq.read_table(RunDir(tmp_path).step_files()[0].path).column_names
    assert logged["written"] == logged["not"]
    assert [m for _, m in iter_metrics_lines(RunDir(tmp_path).metrics_file)] == logged["not"]


def test_training_is_deterministic(tmp_path):
    torch.set_num_threads(1)
    cfg = grpo_tool(steps=2, prompts_per_step=2, n=4)
    for name in ("a", "b"):
        ToyTrainer(cfg).run(tmp_path / name)
    for step in (1, 2):
        a = pq.read_table(tmp_path / "a" / "batches" / f"step_{step:06d}.parquet")
        b = pq.read_table(tmp_path / "b" / "batches" / f"step_{step:06d}.parquet")
        assert a.equals(b)
    assert (tmp_path / "a" / "metrics.jsonl").read_text() == (tmp_path / "b" / "metrics.jsonl").read_text()


def test_prompts_and_grader():
    p = sample_prompts(np.random.default_rng(0), 16, 2, 4)
    assert p.ids.shape == (16, 5) and bool((p.ids[:, -1] == SEP).all())
    digits = torch.where(p.ids < 10, p.ids, 0).sum(-1)
    width = p.target.shape[1]
    as_int = [int("".join(str(d) for d in row[:n])) for row, n in zip(p.target.tolist(), p.target_len.tolist())]
    assert as_int == digits.tolist()
    assert bool((p.observation[:, 0] == OPEN).all()) and width == 2
    # row 0 answers through the tool (CALL, observation, EOS); row 1 answers wrongly by itself
    obs = p.observation[0, : p.observation_len[0]].tolist()
    wrong = [(as_int[1] + 1) // 10 % 10, (as_int[1] + 1) % 10]
    r0 = [CALL] + obs + [12]
    r1 = wrong + [12]
    responses = torch.full((2, 8), PAD)
    mask = torch.zeros((2, 8), dtype=torch.long)
    responses[0, : len(r0)] = torch.tensor(r0)
    mask[0, : len(r0)] = torch.tensor([1] + [0] * len(obs) + [1])
    responses[1, : len(r1)] = torch.tensor(r1)
    mask[1, : len(r1)] = 1
    sub = type(p)(*(t[:2] for t in (p.ids, p.attention, p.target, p.target_len, p.observation, p.observation_len)))
    score, exact = score_responses(responses, mask, torch.tensor([len(r0), len(r1)]), sub)
    assert exact.tolist() == [True, False] and score[0] == 1.0 and 0 <= score[1] < 0.5
    assert obs[-1] == CLOSE


def test_whitening_raises_where_verl_does():
    with pytest.raises(ValueError):
        masked_whiten(torch.ones(1, 3), torch.tensor([[0.0, 1.0, 0.0]]))
