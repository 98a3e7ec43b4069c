"""Degenerate repetition by compression ratio: a response that loops compresses far better than
text does. The ratio of a response is ``len(zlib(text)) / len(text)`` over the UTF-8 bytes of its
actor tokens' text joined (the batch's ``response_tokens``, one string per token, where the mask
is 1), on the last :data:`WINDOW_BYTES` of it: a response that falls into a loop usually loops
until it is cut, so the tail holds the loop, and the cost per row is bounded.

Compressibility as a measure of repetition: degenerate text repeats itself (Holtzman et al., The
Curious Case of Neural Text Degeneration, arXiv:1904.09751); text-quality filters drop documents
by their compression ratio (e.g. the "compression ratio" filter of Whisper's decoding, arXiv:
2212.04356, which rejects a transcript whose gzip ratio exceeds 2.4, ours inverted: 1 / 2.4 =
0.42). Measured with zlib level 6 on 4 KB windows: prose 0.45-0.55, source code about 0.39,
markdown tables 0.24-0.30, a loop of one sentence 0.02 (half a window of loop: 0.25). So
:data:`THRESHOLD` 0.2 sits below structured text, and only rows of at least :data:`MIN_TOKENS`
actor tokens are judged (zlib's header and an unprimed Huffman table make a short text's
ratio high whatever it says: a 256-byte loop is about 0.19).

The per-row ratios are string work (one ``zlib.compress`` per row, at most ``WINDOW_BYTES``
each: the loader computes them once per step, :func:`compression_ratios`); the step statistics
are tensor reductions (:func:`repetition_metrics`).
"""

from __future__ import annotations

import zlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from rldiag.engine.segments import seg_count, seg_sum

#: the batch's text column, one string per response token (rldiag.io.schema.RESPONSE_TEXT_COLUMN)
TEXT_COLUMN = "response_tokens"
#: the ``Batch.extra`` entry the loader writes, ``(rows,)`` float32 (NaN: a row without actor text)
COMPRESSION_COLUMN = "rldiag_compression_ratio"
#: the bytes of a response's tail that are compressed
WINDOW_BYTES = 4096
#: a judged response below this ratio is repetitive
THRESHOLD = 0.2
#: rows with fewer actor tokens are not judged
MIN_TOKENS = 64
#: zlib's level (the default)
LEVEL = 6

__all__ = ["COMPRESSION_COLUMN", "MIN_TOKENS", "TEXT_COLUMN", "THRESHOLD", "WINDOW_BYTES", "compression_ratio",
           "compression_ratios", "repetition_metrics"]


def compression_ratio(data: bytes, window: int = WINDOW_BYTES) -> float:
    """``len(zlib(tail)) / len(tail)`` of the last ``window`` bytes of ``data`` (NaN when empty)."""
    tail = data[-window:]
    return len(zlib.compress(tail, LEVEL)) / len(tail) if tail else float("nan")


def compression_ratios(text: pa.Array | pa.ChunkedArray, mask: np.ndarray, window: int = WINDOW_BYTES) -> np.ndarray:
    """``(rows,)`` float32: each row's compression ratio over its actor tokens' text.

    ``text``: a list<string> column, one string per token; ``mask`` ``(tokens,)`` its flat mask
    (1: an actor token). The kept tokens are joined per row by Arrow (no loop over tokens); the
    loop over rows compresses at most ``window`` bytes each."""
    arr = text.combine_chunks() if isinstance(text, pa.ChunkedArray) else text
    lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
    keep = np.asarray(mask) > 0
    flat = pc.list_flatten(arr).filter(pa.array(keep))
    kept_before = np.r_[0, np.cumsum(keep, dtype=np.int64)]  # actor tokens before each position
    ends = np.cumsum(lengths)
    per_row = kept_before[ends] - kept_before[ends - lengths]
    offsets = pa.array(np.r_[0, np.cumsum(per_row)].astype(np.int32 if len(flat) < 2**31 else np.int64))
    kept = (pa.LargeListArray if offsets.type == pa.int64() else pa.ListArray).from_arrays(offsets, flat)
    tails = pc.binary_slice(pc.cast(pc.binary_join(kept, ""), pa.binary()), -window)  # Arrow cuts the tails
    return np.array([compression_ratio(b, window) if b else np.nan for b in tails.to_pylist()], dtype=np.float32)


def repetition_metrics(ratio: torch.Tensor, actor_tokens: torch.Tensor, step_ids: torch.Tensor,
                       n_steps: int) -> dict[str, torch.Tensor]:
    """Per step ``(n_steps,)``: ``repetition_fraction``, the share of the step's rows judged
    (at least :data:`MIN_TOKENS` actor tokens) whose ratio is below :data:`THRESHOLD`, over all
    its rows; ``compression_ratio_mean``, the mean ratio over the judged rows (NaN: none).
    ``ratio``, ``actor_tokens``, ``step_ids`` ``(rows,)``."""
    judged = (actor_tokens >= MIN_TOKENS) & torch.isfinite(ratio)
    r = torch.where(judged, ratio.to(torch.float64), torch.zeros((), dtype=torch.float64, device=ratio.device))
    low = (judged & (ratio < THRESHOLD)).to(torch.float64)
    n_judged = seg_sum(judged.to(torch.float64), step_ids, n_steps)
    mean = seg_sum(r, step_ids, n_steps) / n_judged  # 0 / 0: NaN without a judged row
    fraction = seg_sum(low, step_ids, n_steps) / seg_count(step_ids, n_steps, torch.float64)
    return {"repetition_fraction": fraction.to(torch.float32), "compression_ratio_mean": mean.to(torch.float32)}
