"""Sampling responses with tool turns, on a bfloat16 copy of the policy (the "rollout engine").

The rollout engine gets the policy's weights at the start of each step (as vLLM/SGLang get
them from the trainer) but computes in bfloat16, while training runs in float32: the log-probs
it reports (``rollout_log_probs``) differ from the trainer's ``old_log_probs`` for the same
tokens, as they do between a real inference engine and its trainer.

Generation is vectorised over rows, one forward per response position. When a row samples
``CALL`` for the first time, the environment's observation is forced into the following
positions (``response_mask`` 0, rollout log-prob 0 as verl's agent loop pads them), then the
row samples again. A row ends at ``EOS`` or at the response width.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from rldiag.toy.task import CALL, EOS, PAD, Prompts


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


@torch.no_grad()
def generate(
    engine: nn.Module,
    prompts: Prompts,
    width: int,
    generator: torch.Generator,
    temperature: float = 1.0,
    tool: bool = True,
) -> Rollout:
    """Sample up to ``width`` response tokens per prompt row."""
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
        logits = engine(ids[:, : p + t], attn[:, : p + t])[:, -1].float() / temperature
        logp = torch.log_softmax(logits, dim=-1)
        sampled = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
        forced = active & (obs_pos < obs_len)
        obs_tok = prompts.observation[rows, obs_pos.clamp_max(prompts.observation.shape[1] - 1)]
        tok = torch.where(forced, obs_tok, sampled)
        acted = active & ~forced
        ids[:, p + t] = torch.where(active, tok, PAD)
        attn[:, p + t] = active.long()
        mask[:, t] = acted.long()
        rollout_lp[:, t] = torch.where(acted, logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1), 0.0)
        obs_pos += forced.long()
        new_call = acted & (tok == CALL) & ~called if tool else torch.zeros_like(acted)
        obs_len = torch.where(new_call, prompts.observation_len, obs_len)
        called |= new_call
        done |= acted & (tok == EOS)
    lengths = attn[:, p:].sum(-1)
    return Rollout(ids, attn, ids[:, p:], mask, rollout_lp, lengths, called)
