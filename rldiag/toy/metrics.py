"""The toy trainer's data metrics: verl's ``compute_data_metrics`` names and semantics.

Scores and rewards are row sums over non-aborted rows; advantages, returns and values are taken
over ``response_mask`` tokens; lengths come from the attention mask (tool observations count);
clip ratios compare with the padded widths (verl's ``responses.shape[-1]`` and prompt width).
"""

from __future__ import annotations

import torch


def _stats(prefix: str, x: torch.Tensor) -> dict[str, float]:
    if x.numel() == 0:
        nan = float("nan")
        return {f"{prefix}/mean": nan, f"{prefix}/max": nan, f"{prefix}/min": nan}
    return {f"{prefix}/mean": x.mean().item(), f"{prefix}/max": x.max().item(), f"{prefix}/min": x.min().item()}


def data_metrics(
    token_level_scores: torch.Tensor,
    token_level_rewards: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    values: torch.Tensor | None = None,
) -> dict[str, float]:
    """``(B, R)`` response tensors and the ``(B, P + R)`` attention mask -> metrics of the step."""
    width = response_mask.shape[1]
    prompt_width = attention_mask.shape[1] - width
    mask = response_mask.bool()
    response_length = attention_mask[:, -width:].sum(-1).float()
    prompt_length = attention_mask[:, :prompt_width].sum(-1).float()
    live = response_length > 0
    out: dict[str, float] = {}
    out.update(_stats("critic/score", token_level_scores.sum(-1)[live]))
    out.update(_stats("critic/rewards", token_level_rewards.sum(-1)[live]))
    valid_adv = torch.masked_select(advantages, mask)
    valid_ret = torch.masked_select(returns, mask)
    out.update(_stats("critic/advantages", valid_adv))
    out.update(_stats("critic/returns", valid_ret))
    if values is not None:
        valid_values = torch.masked_select(values, mask)
        out.update(_stats("critic/values", valid_values))
        diff_var = torch.var(valid_ret - valid_values)
        out["critic/vf_explained_var"] = (1.0 - diff_var / (torch.var(valid_ret) + 1e-5)).item()
    out.update(_stats("response_length", response_length))
    out["response_length/clip_ratio"] = torch.eq(response_length, width).float().mean().item()
    out.update(_stats("response_length_non_aborted", response_length[live]))
    out["response_length_non_aborted/clip_ratio"] = (
        torch.eq(response_length[live], width).float().mean().item() if bool(live.any()) else float("nan")
    )
    out["response/aborted_ratio"] = (~live).float().mean().item()
    out.update(_stats("prompt_length", prompt_length))
    out["prompt_length/clip_ratio"] = torch.eq(prompt_length, prompt_width).float().mean().item()
    return out
