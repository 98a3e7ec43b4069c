"""The recompute engine: pure tensor functions, vectorised over rows, groups and steps.

Token tensors are flat ``(tokens,)``: the rows one after the other, nothing padded, with their
layout in :class:`~rldiag.engine.layout.Rows` (offsets ``(rows + 1,)``, row ids ``(tokens,)``);
per-row reductions are segment reductions over the offsets, methods of ``Rows`` (``rows.sum``,
``rows.masked_sum(values, mask)``, ...). Rows of several steps may be packed into one batch, with
``step_ids`` ``(rows,)`` naming each row's step (0..S-1) and ``group_ids`` ``(rows,)`` naming its
(step, uid) group. Every reduction that verl does "over the batch" is a segment reduction keyed
by step here, and every group statistic a segment reduction keyed by group.
"""
