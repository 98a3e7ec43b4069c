"""The recompute engine: pure tensor functions, vectorised over rows, groups and steps.

Tensors are padded ``(rows, tokens)``; rows of several steps may be packed into one batch, with
``step_ids`` ``(rows,)`` naming each row's step (0..S-1) and ``group_ids`` ``(rows,)`` naming its
(step, uid) group. Every reduction that verl does "over the batch" is a segment reduction keyed
by step here, and every group statistic a segment reduction keyed by group.
"""
