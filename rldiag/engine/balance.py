"""verl's workload balancing: the largest differencing partition of rows into sets.

verl uses it twice, with the same partition function (``karmarkar_karp`` and
``get_seqlen_balanced_partitions`` in ``verl/utils/seqlen_balancing.py``):

- the trainer's ``_balance_batch`` deals a step's rows to the ``dp_size`` data-parallel ranks in
  sets of *equal size* (the V1 ``PPOTrainer`` on every step; the legacy ``RayPPOTrainer`` when
  ``trainer.balance_batch``); :func:`dispatch_order`;
- ``rearrange_micro_batches`` (``use_dynamic_bsz``) cuts each rank's mini-batch into micro-batches
  of *any size* (:mod:`rldiag.engine.dynamic_bsz`).

Each row's workload is ``24576 s + s^2`` (``calculate_workload``; s = prompt + response tokens).
The partition is the largest differencing method (Karmarkar & Karp 1982; the multi-way form of
Korf 2009, "Multi-way number partitioning"): rows sorted by (workload, index) become partial
solutions of ``k`` sets (``k`` rows at a time for equal sizes, one row each otherwise); the two
partial solutions of largest spread are merged repeatedly, the largest set of one with the
smallest of the other. Ties are broken as verl breaks them (sets by total, then size, then
members; solutions by spread, then their largest set), so the same sets result. The sets end in
decreasing order of workload, each listed in increasing row index; set ``r`` goes to rank ``r``.
The algorithm is sequential by nature (a heap of partial solutions): it runs in Python on the
host, ``O(rows log rows)`` heap operations per partition.
"""

from __future__ import annotations

import heapq

import torch


def workload(seq_len: torch.Tensor) -> torch.Tensor:
    """verl's attention-workload estimate of a row of ``seq_len`` tokens ``(rows,)`` int64."""
    s = seq_len.to(torch.int64)
    return 24576 * s + s * s


class PartitionError(ValueError):
    """verl's ``get_seqlen_balanced_partitions`` asserts on this input (fewer rows than sets, an
    empty set); the caller fails the step."""


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
        self.sets = sorted(
            ((a[0] + b[0], a[1] + b[1]) for a, b in zip(self.sets, reversed(other.sets))), key=_set_key, reverse=True
        )


def _set_key(s: tuple[int, list[tuple[int, int]]]):
    return (s[0], len(s[1]), s[1])


def balanced_partitions(loads: list[int], k: int, equal_size: bool = True) -> list[list[int]]:
    """Row indices of ``k`` sets of balanced total ``loads``, largest set first, each in
    increasing index order. ``equal_size``: every set has ``len(loads) / k`` rows (the count
    must divide; ``ValueError`` otherwise), as the trainer's balancing asks; else any size, as
    ``rearrange_micro_batches`` asks. Raises :class:`PartitionError` where verl asserts."""
    if len(loads) < k:
        raise PartitionError(f"{len(loads)} rows cannot fill {k} sets")
    if equal_size and len(loads) % k:
        raise ValueError(f"{len(loads)} rows do not split into {k} equal sets")
    order = sorted((load, i) for i, load in enumerate(loads))
    heap: list[_Partial] = []
    if equal_size:
        for start in range(0, len(order), k):
            heapq.heappush(heap, _Partial([(load, [(i, load)]) for load, i in order[start : start + k]]))
    else:
        empty: list[tuple[int, list[tuple[int, int]]]] = [(0, []) for _ in range(k - 1)]
        for load, i in order:
            heapq.heappush(heap, _Partial([(load, [(i, load)]), *empty]))
    while len(heap) > 1:
        first, second = heapq.heappop(heap), heapq.heappop(heap)
        first.merge(second)
        heapq.heappush(heap, first)
    parts = [sorted(i for i, _ in members) for _, members in heap[0].sets] if heap else [[] for _ in range(k)]
    if any(not p for p in parts):
        raise PartitionError(f"a set of the partition of {len(loads)} rows into {k} is empty")
    return parts


def dispatch_order(loads: list[int], dp_size: int, legacy: bool = False) -> list[int]:
    """The rows of one step in the order the trainer dispatches them (rank 0's rows first):
    verl's equal-size partition over ``dp_size`` ranks. The V1 trainer keeps each rank's rows in
    index order; the legacy trainer (``RayPPOTrainer._balance_batch``) sorts them by (workload,
    index) and lays the even places first, then the odd ones reversed, so that the lightest rows
    sit at both ends."""
    parts = balanced_partitions(loads, dp_size, equal_size=True)
    if legacy:
        ordered = []
        for part in parts:
            part = sorted(part, key=lambda i: (loads[i], i))
            ordered.append(part[::2] + part[1::2][::-1])
        parts = ordered
    return [i for part in parts for i in part]


def balanced_positions(
    seq_len: torch.Tensor, step_ids: torch.Tensor, n_steps: int, dp_size: int, legacy: bool = False
) -> torch.Tensor:
    """Each row's position within its step after the trainer's balancing ``(rows,)`` int64, the
    rows of a step taken in batch order; a step whose row count is not a multiple of
    ``dp_size`` keeps batch order (verl would pad it first or fail: see
    :mod:`rldiag.engine.microbatch`). The partition runs on the host, once per step."""
    rows = step_ids.shape[0]
    dev = step_ids.device
    per_step = torch.bincount(step_ids, minlength=n_steps)[:n_steps]
    order = torch.sort(step_ids, stable=True).indices
    start = torch.cumsum(per_step, 0) - per_step
    pos = torch.empty(rows, dtype=torch.long, device=dev)
    pos[order] = torch.arange(rows, device=dev) - start[step_ids[order]]
    if dp_size <= 1:
        return pos
    loads = workload(seq_len).cpu()
    members = order.cpu()
    for a, count in zip(start.tolist(), per_step.tolist()):
        if count == 0 or count % dp_size:
            continue
        idx = members[a : a + count]  # batch rows of the step, in batch order
        # the partition is computed on the CPU on purpose (a heap of Python lists); its result
        # goes to the batch's device explicitly
        new = torch.tensor(dispatch_order(loads[idx].tolist(), dp_size, legacy), dtype=torch.long, device="cpu")
        placed = torch.empty(count, dtype=torch.long, device="cpu")
        placed[new] = torch.arange(count, device="cpu")
        pos[idx.to(dev)] = placed.to(dev)
    return pos
