"""A tiny decoder-only transformer, as a policy (token logits) or a critic (one value per position).

Sequences are ``prompt (left-padded, width P) + response (right-padded, width R)`` with an
attention mask; positions count real tokens only, so padding never shifts them. Every position
attends to itself, so fully padded prefixes stay finite.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-LayerNorm self-attention + MLP."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """``x`` ``(B, S, d)``; ``allowed`` ``(B, 1, S, S)`` bool (query may see key)."""
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """Token + position embeddings, ``n_layers`` blocks, a final LayerNorm and a head.

    ``head="lm"``: ``forward`` returns logits ``(B, S, vocab)``; ``head="value"``: values ``(B, S)``.
    """

    def __init__(self, vocab: int, d_model: int, n_heads: int, n_layers: int, max_len: int, head: str = "lm"):
        super().__init__()
        self.head_kind = head
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab if head == "lm" else 1)

    def forward(self, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """``ids``, ``attention``: ``(B, S)`` long."""
        s = ids.shape[1]
        positions = (attention.cumsum(-1) - 1).clamp_min(0)
        x = self.tok(ids) + self.pos(positions)
        causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
        allowed = causal & attention.bool()[:, None, :]
        allowed = (allowed | torch.eye(s, dtype=torch.bool, device=ids.device)).unsqueeze(1)
        for block in self.blocks:
            x = block(x, allowed)
        out = self.head(self.ln(x))
        return out if self.head_kind == "lm" else out.squeeze(-1)


def response_logprobs(
    logits: torch.Tensor, responses: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each response token and the entropy of its distribution.

    ``logits`` ``(B, P + R, V)`` over the whole sequence; ``responses`` ``(B, R)``. The logits at
    position ``P + t - 1`` predict response token ``t``. Returns ``(log_probs, entropy)``,
    both ``(B, R)`` float32; entropy as ``logsumexp(z) - sum(softmax(z) * z)``.
    """
    r = responses.shape[1]
    z = logits[:, -r - 1 : -1].float() / temperature
    logp = torch.log_softmax(z, dim=-1)
    log_probs = logp.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    entropy = torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)
    return log_probs, entropy


def response_values(values: torch.Tensor, width: int) -> torch.Tensor:
    """Critic values ``(B, P + R)`` -> the value of the state before each response token ``(B, R)``."""
    return values[:, -width - 1 : -1]
