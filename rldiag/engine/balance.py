"""``trainer.balance_batch``: verl reorders a step's rows so that each data-parallel rank gets a
similar attention workload, before the rows are dealt to ranks in contiguous chunks.

verl (``RayPPOTrainer._balance_batch``, ``utils/seqlen_balancing.py``) estimates each row's
workload as ``24576 s + s^2`` (s = prompt + response tokens) and partitions the rows into
``dp_size`` sets of equal size by the largest differencing method (Karmarkar & Karp 1982; the
multi-way form of Korf 2009, "Multi-way number partitioning"): the rows, sorted by workload,
are taken ``k`` at a time as k-set partial solutions; the two partial solutions of largest spread
are merged repeatedly, the largest set of one with the smallest of the other. The sets end in
decreasing order of workload; rank ``r`` takes set ``r``, its rows in batch order. Ties are
broken as verl breaks them (sets by total, then size, then members; solutions by spread, then
their largest set), so the same ranks result.

A step whose row count is not a multiple of ``dp_size`` is not reordered here (verl pads such a
batch with dummy rows first, which a run directory does not record).
"""

from __future__ import annotations

import heapq

import torch

from rldiag.engine.segments import seg_count


def workload(seq_len: torch.Tensor) -> torch.Tensor:
    """verl's attention-workload estimate of a row of ``seq_len`` tokens ``(rows,)`` int64."""
    s = seq_len.to(torch.int64)
    return 24576 * s + s * s


class _Partial:
    """A partial solution: ``k`` sets, each ``(total, members)`` with members ``[(row, load)]``,
    kept in decreasing order of ``(total, len(members), members)``."""

    __slots__ = ("sets",)

    def __init__(self, sets: list[tuple[int, list[tuple[int, int]]]]) -> None:
        self.sets = sorted(sets, key=_set_key, reverse=True)

    @property
    def spread(self) -> int:
        return self.sets[0][0] - self.sets[-1][0]

    def __lt__(self, other: _Partial) -> bool:  # heapq pops the largest spread first
        if self.spread != other.spread:
            return self.spread > other.spread
        return _set_key(self.sets[0]) > _set_key(other.sets[0])

    def merge(self, other: _Partial) -> None:
        k = len(self.sets)
        self.sets = sorted(
            ((a[0] + b[0], a[1] + b[1]) for a, b in zip(self.sets, reversed(other.sets))), key=_set_key, reverse=True
        )
        assert len(self.sets) == k


def _set_key(s: tuple[int, list[tuple[int, int]]]):
    return (s[0], len(s[1]), s[1])


def balanced_partitions(loads: list[int], k: int) -> list[list[int]]:
    """Row indices of ``k`` equal-size sets of balanced total ``loads``, largest set first, each
    in increasing index order (``len(loads)`` must be a multiple of ``k``)."""
    if len(loads) % k:
        raise ValueError(f"{len(loads)} rows do not split into {k} equal sets")
    order = sorted((load, i) for i, load in enumerate(loads))
    heap: list[_Partial] = []
    for start in range(0, len(order), k):
        heapq.heappush(heap, _Partial([(load, [(i, load)]) for load, i in order[start : start + k]]))
    while len(heap) > 1:
        first, second = heapq.heappop(heap), heapq.heappop(heap)
        first.merge(second)
        heapq.heappush(heap, first)
    return [sorted(i for i, _ in members) for _, members in heap[0].sets] if heap else [[] for _ in range(k)]


def balanced_positions(seq_len: torch.Tensor, step_ids: torch.Tensor, n_steps: int, dp_size: int) -> torch.Tensor:
    """Each row's position within its step after verl's balancing ``(rows,)`` int64 (batch order
    for a step whose row count is not a multiple of ``dp_size``)."""
    per_step = seg_count(step_ids, n_steps, torch.long)
    order = torch.sort(step_ids, stable=True).indices
    start = torch.cumsum(per_step, 0) - per_step
    pos = torch.empty(step_ids.shape[0], dtype=torch.long, device=step_ids.device)
    pos[order] = torch.arange(step_ids.shape[0], device=step_ids.device) - start[step_ids[order]]
    if dp_size <= 1:
        return pos
    loads = workload(seq_len).cpu()
    members = order.cpu()
    for a, count in zip(start.tolist(), per_step.tolist()):
        if count == 0 or count % dp_size:
            continue
        idx = members[a : a + count]  # batch rows of step s, in batch order
        parts = balanced_partitions(loads[idx].tolist(), dp_size)
        # the partition is computed on the CPU on purpose (a heap of Python lists); its result
        # goes to the batch's device explicitly
        new = torch.tensor([j for part in parts for j in part], dtype=torch.long, device="cpu")
        placed = torch.empty(count, dtype=torch.long, device="cpu")
        placed[new] = torch.arange(count, device="cpu")
        pos[idx.to(pos.device)] = placed.to(pos.device)
    return pos
