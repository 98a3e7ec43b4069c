"""The toy task: write the sum of some digits, with a calculator tool.

Prompt: ``k`` digits then ``SEP`` (left-padded to ``max_digits + 1``). Answer: the decimal
digits of their sum, then ``EOS``. The policy may emit ``CALL`` once: the environment then
appends the observation ``OPEN <digits of the sum> CLOSE`` (tokens the actor did not sample:
``response_mask`` 0), and the policy goes on writing. The tool fails on a share of calls
(observation ``OPEN CLOSE``), so the policy must also learn to answer by itself.

The reward is verifiable: the grader takes the last number of the response before ``EOS``
(observations included); 1 when it is the sum and the response ends with ``EOS``, else
``partial_credit`` times the share of its digits in the right place (so that a random policy
already sees some signal).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

DIGITS = 10
PAD, SEP, EOS, CALL, OPEN, CLOSE = range(DIGITS, DIGITS + 6)
VOCAB = DIGITS + 6
TOKEN_NAMES = [str(d) for d in range(DIGITS)] + ["<pad>", "=", "<eos>", "<call>", "<obs>", "</obs>"]


class ToyTokenizer:
    """The task's vocabulary as a tokenizer for the capture's token text (``RunWriter(...,
    tokenizer=...)``): ``convert_ids_to_tokens``, as Hugging Face tokenizers name it."""

    _names = np.array(TOKEN_NAMES, dtype=object)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        """The name of each token id (one lookup for all of them)."""
        return self._names[np.asarray(ids, dtype=np.int64)].tolist()


@dataclass
class Prompts:
    """A batch of prompts.

    Attributes:
        ids: ``(B, P)`` long, left-padded with ``PAD``.
        attention: ``(B, P)`` long, 1 on real tokens.
        target: ``(B, A)`` long, the answer digits, right-padded with ``PAD``.
        target_len: ``(B,)`` long.
        observation: ``(B, O)`` long, what the tool returns (right-padded with ``PAD``).
        observation_len: ``(B,)`` long.
    """

    ids: torch.Tensor
    attention: torch.Tensor
    target: torch.Tensor
    target_len: torch.Tensor
    observation: torch.Tensor
    observation_len: torch.Tensor

    def select(self, rows: torch.Tensor) -> Prompts:
        """The prompts of ``rows`` ``(k,)``, in that order."""
        return Prompts(*(t.index_select(0, rows) for t in (
            self.ids, self.attention, self.target, self.target_len, self.observation, self.observation_len)))

    def repeat(self, n: int) -> Prompts:
        """Each prompt ``n`` times in a row (verl's ``repeat(interleave=True)``)."""
        return Prompts(*(t.repeat_interleave(n, dim=0) for t in (
            self.ids, self.attention, self.target, self.target_len, self.observation, self.observation_len)))


def _digits(values: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Decimal digits of non-negative ints, most significant first: ``(B, width)`` padded, ``(B,)`` lengths."""
    lengths = np.maximum(1, np.floor(np.log10(np.maximum(values, 1))).astype(np.int64) + 1)
    pos = np.arange(width)[None, :]
    power = 10 ** np.clip(lengths[:, None] - 1 - pos, 0, None)
    digits = (values[:, None] // power) % 10
    return np.where(pos < lengths[:, None], digits, PAD), lengths


def sample_prompts(rng: np.random.Generator, count: int, min_digits: int, max_digits: int) -> Prompts:
    """``count`` random prompts of ``min_digits..max_digits`` digits."""
    k = rng.integers(min_digits, max_digits + 1, size=count)
    width = max_digits + 1
    digits = rng.integers(0, DIGITS, size=(count, max_digits))
    pos = np.arange(max_digits)[None, :]
    used = pos < k[:, None]
    total = (digits * used).sum(-1)
    # left padding: row i holds its k_i digits and SEP in the last k_i + 1 places
    ids = np.full((count, width), PAD, dtype=np.int64)
    col = width - 1 - k[:, None] + pos  # where digit j of row i goes
    rows = np.broadcast_to(np.arange(count)[:, None], col.shape)
    ids[rows[used], col[used]] = digits[used]
    ids[:, -1] = SEP
    attention = (ids != PAD).astype(np.int64)
    answer_width = len(str(9 * max_digits))
    target, target_len = _digits(total, answer_width)
    obs = np.full((count, answer_width + 2), PAD, dtype=np.int64)
    obs[:, 0] = OPEN
    obs[:, 1 : 1 + answer_width] = target
    obs[np.arange(count), 1 + target_len] = CLOSE
    as_t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    return Prompts(as_t(ids), as_t(attention), as_t(target), as_t(target_len), as_t(obs), as_t(target_len + 2))


def with_tool_failures(prompts: Prompts, rng: np.random.Generator, rate: float) -> Prompts:
    """The tool fails on a random share ``rate`` of rows: its observation is then ``OPEN CLOSE``."""
    failed = torch.from_numpy(rng.random(prompts.ids.shape[0]) < rate)
    obs = prompts.observation.clone()
    obs[failed, 1] = CLOSE
    obs[failed, 2:] = PAD
    obs_len = torch.where(failed, 2, prompts.observation_len)
    return Prompts(prompts.ids, prompts.attention, prompts.target, prompts.target_len, obs, obs_len)


def score_responses(
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    lengths: torch.Tensor,
    prompts: Prompts,
    partial_credit: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The environment's verdict per row: ``(score (B,) float32, exact (B,) bool)``.

    Like a regex grader, it reads the row's text up to the first ``EOS`` the actor wrote and
    takes the *last number* in it, tool observations included: calling the tool and stopping
    right after its answer is a (legitimate, learnable) way to be right. The environment reads
    each answer like a grader would (a loop over rows).
    """
    resp = responses.tolist()
    mask = response_mask.tolist()
    target = prompts.target.tolist()
    tlen = prompts.target_len.tolist()
    scores, exact = [], []
    for i, n in enumerate(lengths.tolist()):
        answer, run, ended = [], [], False
        for tok, m in zip(resp[i][:n], mask[i][:n]):
            if m and tok == EOS:
                ended = True
                break
            if tok < DIGITS:
                run.append(tok)
            elif run:
                answer, run = run, []
        answer = run or answer
        want = target[i][: tlen[i]]
        ok = ended and answer == want
        right = sum(a == b for a, b in zip(answer, want)) / max(len(answer), len(want))
        scores.append(1.0 if ok else partial_credit * right)
        exact.append(ok)
    return torch.tensor(scores, dtype=torch.float32), torch.tensor(exact)
