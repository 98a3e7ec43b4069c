"""Per-token KL estimators, keyed by verl's ``kl_penalty`` / ``kl_loss_type`` strings.

``d = logprob - ref_logprob``. Estimators from J. Schulman, "Approximating KL divergence"
(2020), http://joschu.net/blog/kl-approx.html. The straight-through forms ``k1+``/``k3+`` (and
``kl+``, ``abs+``, ``low_var_kl+``) have the forward value of their base estimator; only their
gradient differs (verl's ``kl_penalty`` strips the ``+`` and adds ``k2 - sg(k2)``; ``mse+``/``k2+``
are plain k2), which a recompute never needs. verl's ``full`` (``full+``) needs the whole
vocabulary distribution and raises NotImplementedError in verl; here it is rejected by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rldiag.engine import kl_native
from rldiag.engine.layout import Rows
from rldiag.errors import ConfigError
from rldiag.registry import Entry, Registry

KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _KLRegistry(Registry):
    """The KL registry, with a precise error for verl's unimplemented ``full`` estimator."""

    def get(self, name):
        if isinstance(name, str) and name.rstrip("+") == "full":
            raise ConfigError(
                f"KL estimator {name!r} is not supported: it needs the full vocabulary distribution of "
                "both policies, which batch files do not carry (verl raises NotImplementedError for it "
                f"too); use one of {', '.join(self.names())}"
            )
        return super().get(name)


@dataclass(frozen=True)
class KLMeta(Entry):
    """A KL estimator's registration: ``formula``, what it computes from ``d = logprob - ref``."""

    formula: str = ""


KL_ESTIMATORS: Registry[KLFn] = _KLRegistry("KL estimator", meta=KLMeta)


@KL_ESTIMATORS.register("kl", "k1", "kl+", "k1+", formula="d")
def kl_k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k1: ``logprob - ref_logprob``; shape as the inputs."""
    return logprob - ref_logprob


@KL_ESTIMATORS.register("abs", "abs+", formula="|d|")
def kl_abs(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return (logprob - ref_logprob).abs()


@KL_ESTIMATORS.register("mse", "k2", "mse+", "k2+", formula="0.5 d^2")
def kl_k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logprob - ref_logprob).square()


@KL_ESTIMATORS.register("low_var_kl", "k3", "low_var_kl+", "k3+",
                        formula="clip(exp(-d~) + d~ - 1, -10, 10), d~ = clip(d, -20, 20)")
def kl_k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k3 (low variance): with ``x = clamp(ref - logprob, -20, 20)``, ``clamp(e^x - x - 1, -10, 10)``."""
    return k3_from_diff(logprob - ref_logprob)


def kl_estimate(name: str, logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """Per-token estimate ``(tokens,)`` under the estimator ``name``."""
    return KL_ESTIMATORS.get(name)(logprob, ref_logprob)


def k3_from_diff(d: torch.Tensor) -> torch.Tensor:
    """k3 from ``d = logprob - ref_logprob`` ``(tokens,)``, equal to :func:`kl_k3` (``-d`` is
    exactly ``ref - logprob``); works in place on one new tensor."""
    x = torch.neg(d).clamp_(min=-20.0, max=20.0)
    return torch.exp(x).sub_(x).sub_(1.0).clamp_(min=-10.0, max=10.0)


def kl_row_sums(logprob: torch.Tensor, ref_logprob: torch.Tensor, mask: torch.Tensor, rows: Rows,
                *, keep_diff: bool = True) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Per-row masked sums ``(rows,)`` of k1, k2 and k3 from one difference ``d``, and ``d``
    itself ``(tokens,)`` (k1, for callers that keep the token values; None with
    ``keep_diff=False``). On the host, one compiled read (:mod:`rldiag.engine.kl_native`: float64
    sums and k3 without float32's rounding of ``exp``); elsewhere torch's passes below."""
    sums64 = kl_native.row_sums(logprob, ref_logprob, mask, rows.offsets)
    if sums64 is not None:
        out = torch.from_numpy(sums64)
        sums = {"k1": out[:, 0], "k2": 0.5 * out[:, 1], "k3": out[:, 2]}
        sums = {k: v.to(logprob.dtype) for k, v in sums.items()}
        return sums, (logprob - ref_logprob) if keep_diff else None
    d = logprob - ref_logprob
    sums = {
        "k1": rows.masked_sum(d, mask),
        "k2": 0.5 * rows.masked_square_sum(d, mask),
        "k3": rows.masked_sum(k3_from_diff(d), mask),
    }
    return sums, d if keep_diff else None
