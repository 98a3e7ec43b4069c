"""Small runs for the rescore tests, written through ``RunWriter`` as a trainer would write them:
word-level responses (a tokenizer that decodes), verl's reward inputs in the non-tensor batch."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from rldiag.capture import RunWriter

PAD = 0


class WordTokenizer:
    """Id 0 is ``<pad>`` (special); every other id a word; decode joins the words with spaces."""

    def __init__(self, words: list[str]):
        self.words = ["<pad>", *dict.fromkeys(words)]
        self.ids = {w: i for i, w in enumerate(self.words)}

    def encode(self, text: str) -> list[int]:
        return [self.ids[w] for w in text.split()]

    def convert_ids_to_tokens(self, ids):
        return [self.words[i] for i in ids]

    def batch_decode(self, rows, skip_special_tokens=False):
        return [" ".join(self.words[i] for i in r if not (skip_special_tokens and i == PAD)) for r in rows]


def write_text_run(path: Path, steps: list[list[dict]], config: dict | None = None, n: int = 2) -> Path:
    """One step per list of rows; a row: ``text`` (its response), ``data_source``, ``ground_truth``,
    ``score`` (the captured one, at the last token), optional ``extra_info``, ``session_id`` and
    ``output_index`` (every row or none). Rows ``n`` by ``n``
    share a uid (groups)."""
    words = [w for rows in steps for r in rows for w in r["text"].split()] + ["q"]
    tok = WordTokenizer(words)
    cfg = {"algorithm": {"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": True},
           "actor_rollout_ref": {"rollout": {"n": n}}, **(config or {})}
    with RunWriter(path, config=cfg, tokenizer=tok, on_error="raise") as w:
        for step, rows in enumerate(steps, 1):
            ids = [tok.encode(r["text"]) for r in rows]
            width = max(len(i) for i in ids)
            responses = torch.full((len(rows), width), PAD, dtype=torch.long)
            attn = torch.zeros((len(rows), width), dtype=torch.long)
            scores = torch.zeros((len(rows), width))
            for i, (r, x) in enumerate(zip(rows, ids)):
                responses[i, : len(x)] = torch.tensor(x)
                attn[i, : len(x)] = 1
                scores[i, len(x) - 1] = r["score"]
            prompts = torch.full((len(rows), 1), tok.ids["q"], dtype=torch.long)
            batch = {"prompts": prompts, "responses": responses, "response_mask": attn,
                     "attention_mask": torch.cat([torch.ones((len(rows), 1), dtype=torch.long), attn], 1),
                     "token_level_scores": scores,
                     "old_log_probs": torch.full((len(rows), width), -1.0) * attn}
            non = {"uid": np.array([f"s{step}-p{i // n}" for i in range(len(rows))], dtype=object),
                   "data_source": np.array([r["data_source"] for r in rows], dtype=object),
                   "reward_model": np.array([{"ground_truth": r["ground_truth"]} for r in rows], dtype=object),
                   "extra_info": np.array([r.get("extra_info", {"index": i}) for i, r in enumerate(rows)],
                                          dtype=object)}
            for key in ("session_id", "output_index"):  # a V1 multi-output session's rows
                if key in rows[0]:
                    non[key] = np.array([r[key] for r in rows], dtype=object if key == "session_id" else np.int64)
            w.write_batch(step, SimpleNamespace(batch=batch, non_tensor_batch=non))
    return path
