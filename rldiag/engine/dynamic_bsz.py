"""``use_dynamic_bsz``: micro-batches by token budget instead of by row count.

verl's workers cut each rank's mini-batch with ``rearrange_micro_batches``
(``verl/utils/seqlen_balancing.py``, called by ``prepare_micro_batches`` in
``verl/workers/engine/utils.py`` with the data-parallel group and ``same_micro_num_in_dp``):

1. each rank asserts that its longest row fits the budget ``max_token_len``
   (``ppo_max_token_len_per_gpu``; rows are prompt + response tokens, the nested
   ``input_ids``' lengths);
2. each rank asks for ``min(rows, ceil(tokens / max_token_len))`` micro-batches; the ranks take
   the largest request (an all-reduce MAX), so every rank runs as many micro-batches;
3. the rank's rows are partitioned into that many sets of balanced workload
   (:func:`rldiag.engine.balance.balanced_partitions`, any set size);
4. verl 0.9.1 only (``dynamic_bsz_token_limit`` in :mod:`rldiag.config.verl_versions`): while a
   set of some rank holds more than ``max_token_len`` tokens (an all-reduce MIN of "within the
   limit"), every rank asks for one micro-batch more and partitions again; more micro-batches
   than a rank has rows is an error. Earlier releases keep the first partition.

verl then sorts the micro-batches by workload and interleaves them (a pipeline-bubble
optimisation): the order does not change a metric, which is a mean or sum over micro-batches,
so it is not reproduced. The number of micro-batches and each one's rows are.
"""

from __future__ import annotations

from rldiag.engine.balance import PartitionError, balanced_partitions, workload


class BudgetError(ValueError):
    """verl raises on this mini-batch (a row longer than the budget, more micro-batches needed
    than a rank has rows, or a partition verl's assertion refuses)."""


def _ceildiv(a: int, b: int) -> int:
    return -(a // -b)


def token_budget_micro_batches(seq_lens: list[list[int]], max_token_len: int, until_within: bool) -> list[list[int]]:
    """The micro-batch of each row of one mini-batch, rank by rank.

    ``seq_lens[r]``: the token count of each row of rank ``r``'s share of the mini-batch, in the
    order the rank holds them; ``until_within``: verl 0.9.1's loop (step 4 above). Returns, for
    each rank, each row's micro-batch index (``[0, n_micro)``, the same count on every rank);
    raises :class:`BudgetError` where verl raises.
    """
    for lens in seq_lens:
        longest = max(lens) if lens else 0
        if longest > max_token_len:
            raise BudgetError(
                f"a row of {longest} tokens exceeds the token budget {max_token_len} (ppo_max_token_len_per_gpu): "
                "verl's rearrange_micro_batches asserts max_token_len >= the longest row")
    wanted = [min(len(lens), _ceildiv(sum(lens), max_token_len)) for lens in seq_lens]
    n_micro = max(wanted) if wanted else 0
    fewest = min(len(lens) for lens in seq_lens) if seq_lens else 0
    loads = [workload_list(lens) for lens in seq_lens]
    while True:
        if n_micro > fewest:
            raise BudgetError(
                f"{n_micro} micro-batches are needed to keep every one within {max_token_len} tokens, but a rank "
                f"has only {fewest} rows (verl's rearrange_micro_batches raises)")
        try:
            parts = [balanced_partitions(ld, n_micro, equal_size=False) for ld in loads]
        except PartitionError as exc:
            raise BudgetError(f"verl's get_seqlen_balanced_partitions asserts: {exc}") from None
        within = all(sum(lens[i] for i in p) <= max_token_len for lens, ps in zip(seq_lens, parts) for p in ps)
        if within or not until_within:
            break
        n_micro += 1
    out = []
    for lens, ps in zip(seq_lens, parts):
        micro = [0] * len(lens)
        for m, p in enumerate(ps):
            for i in p:
                micro[i] = m
        out.append(micro)
    return out


def workload_list(lens: list[int]) -> list[int]:
    """:func:`rldiag.engine.balance.workload` of plain integers."""
    return [24576 * s + s * s for s in lens]


__all__ = ["BudgetError", "token_budget_micro_batches", "workload", "workload_list"]
