"""trainer.balance_batch: verl's largest-differencing partition of a step's rows over DP ranks."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from rldiag.engine.balance import balanced_partitions, balanced_positions, workload
from rldiag.engine.microbatch import segmentation_for
from tests.conftest import settings


def test_four_rows_over_two_ranks():
    # sorted loads 1, 2, 3, 4 -> partial solutions {2 | 1} and {4 | 3}, spread 1 each; the one
    # with the larger top set ({4}) pops first and takes the other's smallest: {4, 1} and {3, 2},
    # totals 5 and 5; equal totals and sizes go by members, so {rows 2, 3} is rank 0
    assert balanced_partitions([4, 1, 3, 2], 2) == [[2, 3], [0, 1]]
    # one long row and three short ones: the long row's rank takes the shortest partner
    assert balanced_partitions([100, 1, 2, 3], 2) == [[0, 1], [2, 3]]


@hsettings(max_examples=60, deadline=None)
@given(st.integers(1, 4).flatmap(
    lambda k: st.tuples(st.just(k), st.lists(st.integers(1, 5000), min_size=1, max_size=10).map(lambda xs: xs * k))))
def test_partitions_are_equal_size_and_cover_every_row(case):
    k, loads = case
    parts = balanced_partitions(loads, k)
    assert len(parts) == k and all(len(p) == len(loads) // k for p in parts)
    assert sorted(i for p in parts for i in p) == list(range(len(loads)))
    totals = [sum(loads[i] for i in p) for p in parts]
    assert totals == sorted(totals, reverse=True)  # the largest set goes to rank 0
    # never worse than dealing the rows in order
    dealt = [sum(loads[r * len(loads) // k:(r + 1) * len(loads) // k]) for r in range(k)]
    assert max(totals) - min(totals) <= max(dealt) - min(dealt) or k == 1


def test_positions_per_step_and_the_setting():
    lengths = torch.tensor([100, 1, 2, 3, 5, 6, 7])  # step 0: 4 rows; step 1: 3 rows (not a multiple of 2)
    sid = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    pos = balanced_positions(lengths, sid, 2, 2)
    # workloads keep the order of lengths: step 0 -> ranks [rows 0, 1] and [rows 2, 3]
    assert pos.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert workload(torch.tensor([2])).item() == 24576 * 2 + 4
    moved = segmentation_for(sid, 2, settings(**{"rldiag.dp_size": 2}), torch.tensor([2, 3, 100, 1, 5, 6, 7]))
    assert moved.seg_ids.tolist()[:4] == [1, 1, 0, 0]  # rows 2 (100) and 3 (1) form rank 0
