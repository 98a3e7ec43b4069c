"""Step metrics verl logs outside the update loop, from verl's own functions, against
``rldiag recompute``: ``compute_data_metrics`` (critic/*, response_length/*, prompt_length/*,
num_turns/*, tool_call_counts/*), ``calculate_debug_metrics`` (training/rollout_*), the old
policy's ``actor/entropy`` (``agg_loss`` over the whole step, as ``_compute_old_log_prob``) and
``actor/loss`` (the update's total loss)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.verl.harness import assert_close, in_rows, long_tail_table, padded, run_rldiag, scalar, write_run

metric_utils = pytest.importorskip("verl.trainer.ppo.metric_utils")
from verl import DataProto  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.utils.debug.metrics import calculate_debug_metrics  # noqa: E402

ACTOR = "actor_rollout_ref.actor."
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
#: data metrics verl computes from fields a run directory does not hold (the prompt's padded width)
NOT_FROM_A_RUN = {"prompt_length/clip_ratio"}


def _run(tmp_path, overrides, seed):
    rng = np.random.default_rng(seed)
    tables = [long_tail_table(rng, s) for s in (1, 2)]
    run = write_run(tmp_path / "run", tables, {"algorithm": {"adv_estimator": "grpo"}})
    return tables, *run_rldiag(run, overrides)


def _data_proto(table, tokens) -> DataProto:
    rows, inside = table.num_rows, in_rows(table)
    prompt = torch.tensor(scalar(table, "prompt_length"))
    width_p = int(prompt.max())
    prompt_mask = (torch.arange(width_p)[None, :] >= (width_p - prompt)[:, None]).long()  # left-padded prompts
    return DataProto.from_dict(
        tensors={
            "token_level_scores": padded(table, "token_level_scores"),
            "token_level_rewards": padded(tokens, "token_level_rewards"),
            "advantages": padded(tokens, "advantages"), "returns": padded(tokens, "returns"),
            "response_mask": padded(table, "response_mask"),
            "prompts": torch.zeros(rows, width_p, dtype=torch.long),
            "responses": torch.zeros(rows, inside.shape[1], dtype=torch.long),
            "attention_mask": torch.cat([prompt_mask, inside.long()], 1),
            "old_log_probs": padded(table, "old_log_probs"), "rollout_log_probs": padded(table, "rollout_log_probs"),
        },
        non_tensors={"__num_turns__": scalar(table, "num_turns"), "tool_call_counts": scalar(table, "tool_call_counts")},
    )


def test_data_and_rollout_debug_metrics_match_verl(tmp_path):
    tables, metrics, tokens = _run(tmp_path, {}, seed=3)
    for table in tables:
        step = int(table["step"][0].as_py())
        batch = _data_proto(table, tokens[step])
        want = {**metric_utils.compute_data_metrics(batch, use_critic=False), **calculate_debug_metrics(batch)}
        assert {"num_turns/mean", "tool_call_counts/max", "training/rollout_actor_probs_pearson_corr"} <= set(want)
        for name, value in want.items():
            if name in NOT_FROM_A_RUN:
                continue
            assert name in metrics[step], f"rldiag does not report {name}"
            assert_close(metrics[step][name], float(value), f"{name}, step {step}", atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_actor_entropy_and_total_loss_match_verl(tmp_path, agg):
    overrides = {ACTOR + "loss_agg_mode": agg, ACTOR + "entropy_coeff": 0.01, ACTOR + "use_kl_loss": True,
                 ACTOR + "kl_loss_coef": 0.05}
    tables, metrics, _ = _run(tmp_path, overrides, seed=11 + AGG_MODES.index(agg))
    for table in tables:
        step = int(table["step"][0].as_py())
        mask = padded(table, "response_mask").bool()
        # _compute_old_log_prob: agg_loss over the whole step with no global batch info
        entropy = core_algos.agg_loss(padded(table, "entropy"), mask, agg, loss_scale_factor=None)
        assert_close(metrics[step]["actor/entropy"], entropy, f"{agg} actor/entropy")
        got = metrics[step]
        want = got["actor/pg_loss"] - 0.01 * got["actor/entropy_loss"] + 0.05 * got["actor/kl_loss"]
        assert_close(got["actor/loss"], want, f"{agg} actor/loss")
