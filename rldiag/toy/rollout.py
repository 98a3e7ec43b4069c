"""Sampling responses with tool turns, on a bfloat16 copy of the policy (the "rollout engine").

The rollout engine gets the policy's weights at the start of each step (as vLLM/SGLang get
them from the trainer) but computes in bfloat16, while training runs in float32: the log-probs
it reports (``rollout_log_probs``) differ from the trainer's ``old_log_probs`` for the same
tokens, as they do between a real inference engine and its trainer.

Generation is vectorised over rows, one forward per response position. When a row samples
``CALL`` for the first time, the environment's observation is forced into the following
positions (``response_mask`` 0, rollout log-prob 0 as verl's agent loop pads them), then the
row samples again. A row ends at ``EOS`` or at the response width. How the engine samples and
what log-prob it reports (top-p / top-k, raw or processed log-probs, a log-softmax in bfloat16,
an off-by-one, an outlier kernel: each a cause of a rollout/trainer gap) is
:mod:`rldiag.toy.engine`'s.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from rldiag.toy.engine import EngineOptions, sample_and_score
from rldiag.toy.task import CALL, EOS, PAD, Prompts

DEFAULT_ENGINE = EngineOptions()


@dataclass
class Rollout:
    """Padded rollout output, verl's field names. Shapes: ``B`` rows, ``P`` prompt, ``R`` response.

    Attributes:
        input_ids: ``(B, P + R)`` prompt then response.
        attention_mask: ``(B, P + R)`` 1 on real tokens (tool observations included).
        responses: ``(B, R)``.
        response_mask: ``(B, R)`` 1 on tokens the policy sampled, 0 on observations and padding.
        rollout_log_probs: ``(B, R)`` float32 log-probs of the rollout engine (0 off the mask).
        lengths: ``(B,)`` response lengths.
        tool_calls: ``(B,)`` bool, the row called the tool.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    responses: torch.Tensor
    response_mask: torch.Tensor
    rollout_log_probs: torch.Tensor
    lengths: torch.Tensor
    tool_calls: torch.Tensor


def rollout_engine(policy: nn.Module) -> nn.Module:
    """A bfloat16 copy of the policy (the weight sync of this step)."""
    return copy.deepcopy(policy).to(torch.bfloat16).eval()


def merge_rollouts(parts: list[tuple[torch.Tensor, Rollout]], rows: int) -> Rollout:
    """One rollout of ``rows`` rows from rollouts of some of them: ``parts`` holds each part's
    batch rows ``(k,)`` and its rollout (every part of the same widths)."""
    first = parts[0][1]
    merged = {name: torch.zeros((rows, *getattr(first, name).shape[1:]), dtype=getattr(first, name).dtype)
              for name in Rollout.__dataclass_fields__}
    for idx, part in parts:
        for name, out in merged.items():
            out.index_copy_(0, idx, getattr(part, name))
    return Rollout(**merged)


@torch.no_grad()
def generate(
    engine: nn.Module,
    prompts: Prompts,
    width: int,
    generator: torch.Generator,
    temperature: float = 1.0,
    tool: bool = True,
    engine_options: EngineOptions = DEFAULT_ENGINE,
    kernel_generator: torch.Generator | None = None,
) -> Rollout:
    """Sample up to ``width`` response tokens per prompt row, each token's log-prob as the
    engine reports it (:func:`rldiag.toy.engine.sample_and_score`; ``engine_options.logprob_shift``
    1: the log-prob of a token is written in the previous actor token's slot, the row's last actor
    token keeps 0.0)."""
    b, p = prompts.ids.shape
    ids = torch.full((b, p + width), PAD, dtype=torch.long)
    attn = torch.zeros((b, p + width), dtype=torch.long)
    ids[:, :p], attn[:, :p] = prompts.ids, prompts.attention
    mask = torch.zeros((b, width), dtype=torch.long)
    rollout_lp = torch.zeros((b, width), dtype=torch.float32)
    done = torch.zeros(b, dtype=torch.bool)
    called = torch.zeros(b, dtype=torch.bool)
    obs_pos = torch.zeros(b, dtype=torch.long)
    obs_len = torch.zeros(b, dtype=torch.long)  # 0 until the row calls the tool
    rows = torch.arange(b)
    for t in range(width):
        active = ~done
        if not bool(active.any()):
            break
        logits = engine(ids[:, : p + t], attn[:, : p + t])[:, -1]
        sampled, lp = sample_and_score(logits, temperature, engine_options, generator, kernel_generator)
        forced = active & (obs_pos < obs_len)
        obs_tok = prompts.observation[rows, obs_pos.clamp_max(prompts.observation.shape[1] - 1)]
        tok = torch.where(forced, obs_tok, sampled)
        acted = active & ~forced
        ids[:, p + t] = torch.where(active, tok, PAD)
        attn[:, p + t] = active.long()
        mask[:, t] = acted.long()
        if engine_options.logprob_shift:  # off by one: into the previous actor token's slot
            if t > 0:
                into = acted & (mask[:, t - 1] > 0)
                rollout_lp[:, t - 1] = torch.where(into, lp, rollout_lp[:, t - 1])
        else:
            rollout_lp[:, t] = torch.where(acted, lp, 0.0)
        obs_pos += forced.long()
        new_call = acted & (tok == CALL) & ~called if tool else torch.zeros_like(acted)
        obs_len = torch.where(new_call, prompts.observation_len, obs_len)
        called |= new_call
        done |= acted & (tok == EOS)
    lengths = attn[:, p:].sum(-1)
    return Rollout(ids, attn, ids[:, p:], mask, rollout_lp, lengths, called)
