"""Queries over one step: its rows from the batch, what a scenario's recompute wrote for them
(its per-row table: the groups, each row's mean advantage and reward) and its per-token outputs
(the mask after rollout correction, advantages, ratios, IS weights).

Everything here is SQL over the step's batch (:class:`BatchSource`), the scenarios'
``rows/step_<N:06d>.parquet`` and ``tokens/step_<N:06d>.parquet``, joined on the row index (all
in batch order). What a recompute writes per row is read, not derived again from the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from rldiag.store.batches import BatchSource
from rldiag.store.db import Db, quote_ident

INT_MASK = "list_transform(response_mask, lambda x: x::INTEGER)"


def batch_rows_sql(src: BatchSource) -> str:
    """One row per batch row: ``row, uid, grp, session, length, actor_tokens, tool_tokens,
    score_total, score_scalar, loss_tokens, outside_loss, mask`` (``mask`` the batch's response_mask
    as ints; ``outside_loss`` its tokens that ``loss_mask``, the mask before rollout correction, has 0).

    ``tool_tokens`` counts mask-0 tokens before the row's last actor token (tool observations,
    which reach the estimators as interior zeros); ``score_total`` is the row's reward-manager
    total (``token_level_scores`` summed, else the scalar ``score``).
    """
    has = src.has
    if has("token_level_scores"):
        score_total = "list_sum(token_level_scores)::DOUBLE"
    else:
        score_total = "score::DOUBLE"
    score_scalar = "score::DOUBLE" if has("score") else "NULL::DOUBLE"
    if has("loss_mask"):  # the mask before rollout correction: response_mask may only drop tokens of it
        loss = "list_sum(list_transform(loss_mask, lambda x: x::INTEGER))"
        outside = "len(list_filter(mask, lambda x, i: x = 1 AND coalesce(loss_mask[i]::INTEGER, 0) = 0))"
    else:
        loss, outside = "NULL::BIGINT", "NULL::BIGINT"
    session = "CAST(session_id AS VARCHAR)" if has("session_id") else "NULL::VARCHAR"
    return f"""
        SELECT row, uid, grp, session, length, actor_tokens,
               len(list_filter(mask, lambda x, i: x = 0 AND i < last1)) AS tool_tokens,
               score_total, score_scalar, loss_tokens, outside_loss, mask
        FROM (
            SELECT row, CAST(uid AS VARCHAR) AS uid, CAST(uid AS VARCHAR) AS grp, {session} AS session,
                   len(response_mask) AS length, mask,
                   coalesce(list_sum(mask), 0) AS actor_tokens,
                   CASE WHEN list_contains(mask, 1) THEN len(mask) + 1 - list_position(list_reverse(mask), 1)
                        ELSE 0 END AS last1,
                   {score_total} AS score_total, {score_scalar} AS score_scalar, {loss} AS loss_tokens,
                   {outside} AS outside_loss
            FROM (SELECT *, {INT_MASK} AS mask FROM {src.sql})
        )
    """


def tokens_rows_sql(columns: list[str]) -> str:
    """Per row of a scenario's tokens file (bound as the next parameter): ``row, adv_mean,
    reward_total`` (a scenario written before per-row tables)."""
    adv = ("list_avg(list_filter(advantages, lambda x, i: response_mask[i] = 1))"
           if "advantages" in columns else "NULL::DOUBLE")
    rew = "list_sum(token_level_rewards)::DOUBLE" if "token_level_rewards" in columns else "NULL::DOUBLE"
    return f"SELECT row, {adv} AS adv_mean, {rew} AS reward_total FROM read_parquet(?, hive_partitioning = false)"


#: per row of a scenario's per-row table (bound as the next parameter): ``row, adv_mean,
#: reward_total`` (a row without an actor token has no mean advantage: null, not NaN)
PER_ROW_SQL = ("SELECT row, CASE WHEN actor_tokens = 0 THEN NULL ELSE advantage_mean END AS adv_mean, "
               "reward AS reward_total FROM read_parquet(?, hive_partitioning = false)")


def step_rows(db: Db, src: BatchSource, tokens: dict[str, tuple[Path, list[str]]],
              rows: dict[str, Path] | None = None) -> pl.DataFrame:
    """The step's rows with, per scenario ``s`` of ``rows`` (name -> its per-row table) or else of
    ``tokens`` (name -> (tokens file, columns)), the columns ``adv:s`` (mean advantage over the
    row's post-correction actor tokens) and ``reward:s`` (its reward total, after any KL shaping)."""
    rows = rows or {}
    sql = f"WITH b AS ({batch_rows_sql(src)})"
    params = list(src.params)
    select = ["b.row", "b.uid", "b.grp", "b.session", "b.length", "b.actor_tokens", "b.tool_tokens",
              "b.score_total", "b.score_scalar", "b.loss_tokens"]
    joins = []
    for i, name in enumerate({**tokens, **rows}):  # the order asked for (rows may name more scenarios)
        sql += f", t{i} AS ({PER_ROW_SQL if name in rows else tokens_rows_sql(tokens[name][1])})"
        params.append(str(rows[name] if name in rows else tokens[name][0]))
        select += [f"t{i}.adv_mean AS {quote_ident('adv:' + name)}", f"t{i}.reward_total AS {quote_ident('reward:' + name)}"]
        joins.append(f"LEFT JOIN t{i} USING (row)")
    sql += f" SELECT {', '.join(select)} FROM b {' '.join(joins)} ORDER BY b.row"
    return db.frame(sql, params, where=str(src.path), arrow=src.arrow)


@dataclass
class StepFacts:
    """The numbers the step checklist judges, for one step (and one scenario)."""

    step: int
    rows: int
    columns: list[str]
    # groups
    groups: int = 0
    group_sizes: dict[int, int] = field(default_factory=dict)  # rows per uid -> number of uids
    sessions: int | None = None  # distinct (uid, session_id), when the batch has session_id
    multi_groups: int = 0  # groups of two rows or more
    flat_groups: int = 0  # of those, groups whose rows all have the same score
    # scores
    score_min: float | None = None
    score_max: float | None = None
    score_mean: float | None = None
    score_nonfinite: int = 0
    score_zero_rows: int = 0
    score_vs_scalar_mismatch: int | None = None  # rows where sum(token_level_scores) != score
    # masks (original)
    rows_without_actor: int = 0
    tool_rows: int = 0
    tool_tokens: int = 0
    actor_tokens: int = 0
    # with loss_mask (the mask before rollout correction): rows with a response_mask token outside it
    # (never legitimate), and the tokens rejected before the capture (in loss_mask, not in response_mask)
    rows_outside_loss_mask: int | None = None
    rejected_before_capture: int | None = None
    # scenario outputs (None without a scenario's tokens for this step)
    scenario: str | None = None
    rewards_compared: int | None = None
    rewards_sign_flips: int | None = None
    rewards_max_abs_change: float | None = None
    rejected_tokens: int | None = None  # original 1 -> 0 after rollout correction
    unmasked_tokens: int | None = None  # original 0 -> 1 (never legitimate)
    adv_tokens: int | None = None
    adv_mean: float | None = None
    adv_std: float | None = None
    adv_positive_fraction: float | None = None
    adv_nonfinite: int | None = None
    ratio_tokens: int | None = None
    ratio_mean: float | None = None
    ratio_min: float | None = None
    ratio_max: float | None = None


def step_facts(db: Db, src: BatchSource, scenario: str | None, tokens: tuple[Path, list[str]] | None,
               rows: Path | None = None) -> StepFacts:
    """Aggregate the step into :class:`StepFacts`: the batch as captured (scores, masks); its
    groups and ``scenario``'s rewards from the scenario's per-row table ``rows``
    (``rows/step_<N>.parquet``: each row's ``uid``, ``score``, ``reward``, ``group_size``, as the
    recompute wrote them); the mask after correction, the advantages and the ratio from its
    ``tokens``. Without a per-row table (no scenario, or one written before them) the groups come
    from the batch's own ``uid`` and scores, and the rewards facts stay None."""
    base = batch_rows_sql(src)
    params = list(src.params)
    where = str(src.path)
    arrow = src.arrow
    (n_rows, score_min, score_max, score_mean, nonfinite, zero_rows, mismatch, no_actor, tool_rows,
     tool_tokens, actor_tokens, outside_rows, pre_rejected, sessions) = db.rows(
        f"""
        WITH b AS ({base})
        SELECT count(*),
               min(score_total) FILTER (WHERE isfinite(score_total)),
               max(score_total) FILTER (WHERE isfinite(score_total)),
               avg(score_total) FILTER (WHERE isfinite(score_total)),
               count(*) FILTER (WHERE NOT isfinite(score_total) OR score_total IS NULL),
               count(*) FILTER (WHERE score_total = 0),
               count(*) FILTER (WHERE score_scalar IS NOT NULL
                                AND abs(score_total - score_scalar) > 1e-6 * (1 + abs(score_scalar))),
               count(*) FILTER (WHERE actor_tokens = 0),
               count(*) FILTER (WHERE tool_tokens > 0),
               coalesce(sum(tool_tokens), 0), coalesce(sum(actor_tokens), 0),
               count(*) FILTER (WHERE outside_loss > 0),
               coalesce(sum(loss_tokens - (actor_tokens - outside_loss)), 0),
               count(DISTINCT (uid, session)) FILTER (WHERE session IS NOT NULL)
        FROM b
        """,
        params, where=where, arrow=arrow,
    )[0]
    facts = StepFacts(
        step=src.step, rows=n_rows, columns=list(src.columns),
        score_min=score_min, score_max=score_max, score_mean=score_mean, score_nonfinite=nonfinite,
        score_zero_rows=zero_rows,
        score_vs_scalar_mismatch=mismatch if src.has("token_level_scores") and src.has("score") else None,
        rows_outside_loss_mask=outside_rows if src.has("loss_mask") else None,
        rejected_before_capture=int(pre_rejected) if src.has("loss_mask") else None,
        rows_without_actor=no_actor, tool_rows=tool_rows, tool_tokens=int(tool_tokens),
        actor_tokens=int(actor_tokens), sessions=sessions if src.has("session_id") else None,
    )
    table = "read_parquet(?, hive_partitioning = false)"
    if rows is not None:  # the groups as the recompute saw them: rows per uid, each row's score
        groups = db.rows(GROUPS_SQL.format(rows=f"SELECT uid, score FROM {table}"), [str(rows)], where=str(rows))
    else:
        groups = db.rows(GROUPS_SQL.format(rows=f"SELECT grp AS uid, score_total AS score FROM ({base})"),
                         params, where=where, arrow=arrow)
    facts.group_sizes = {int(n): int(c) for n, c, _ in groups}
    facts.groups = sum(facts.group_sizes.values())
    facts.multi_groups = sum(c for n, c, _ in groups if n > 1)
    facts.flat_groups = sum(int(f) for _, _, f in groups)
    if scenario is None or (tokens is None and rows is None):
        return facts
    facts.scenario = scenario
    if rows is not None:
        facts.rewards_compared, facts.rewards_sign_flips, facts.rewards_max_abs_change = db.rows(
            f"""
            SELECT count(*) FILTER (WHERE reward IS NOT NULL),
                   count(*) FILTER (WHERE sign(reward) <> sign(score) AND score <> 0), max(abs(reward - score))
            FROM {table}
            """,
            [str(rows)], where=str(rows),
        )[0]
    if tokens is not None:
        token_facts(db, src, tokens, facts)
    return facts


#: per group size ``n``: the groups of ``n`` rows, and those of them (``n > 1``) whose rows all
#: have the same score, over ``{rows}`` (a query giving each row's ``uid`` and ``score``)
GROUPS_SQL = """
    SELECT n, count(*), count(*) FILTER (WHERE n > 1 AND distinct_scores = 1)
    FROM (SELECT count(*) AS n, count(DISTINCT score) AS distinct_scores FROM ({rows}) GROUP BY CAST(uid AS VARCHAR))
    GROUP BY n ORDER BY n
"""


def token_facts(db: Db, src: BatchSource, tokens: tuple[Path, list[str]], facts: StepFacts) -> None:
    """Fill ``facts``' mask changes (the batch's mask against the scenario's after correction),
    advantages and ratio from the scenario's tokens file (over its actor tokens)."""
    path, cols = tokens
    (rejected, unmasked) = db.rows(
        f"""
        WITH b AS (SELECT row, {INT_MASK} AS mask FROM {src.sql}),
             t AS (SELECT row, {INT_MASK} AS post_mask FROM read_parquet(?, hive_partitioning = false))
        SELECT coalesce(sum(len(list_filter(b.mask, lambda x, i: x = 1 AND t.post_mask[i] = 0))), 0),
               coalesce(sum(len(list_filter(b.mask, lambda x, i: x = 0 AND t.post_mask[i] = 1))), 0)
        FROM b JOIN t USING (row)
        """,
        list(src.params) + [str(path)], where=str(src.path), arrow=src.arrow,
    )[0]
    facts.rejected_tokens, facts.unmasked_tokens = int(rejected), int(unmasked)
    if "advantages" in cols:
        (n, mean, std, pos, bad) = db.rows(
            f"""
            SELECT count(*), avg(a) FILTER (WHERE isfinite(a)), stddev_samp(a) FILTER (WHERE isfinite(a)),
                   avg((a > 0)::INTEGER), count(*) FILTER (WHERE NOT isfinite(a))
            FROM (SELECT unnest(advantages) AS a, unnest({INT_MASK}) AS m
                  FROM read_parquet(?, hive_partitioning = false)) WHERE m = 1
            """,
            [str(path)], where=str(path),
        )[0]
        facts.adv_tokens, facts.adv_mean, facts.adv_std, facts.adv_positive_fraction, facts.adv_nonfinite = (
            n, mean, std, pos, bad)
    if "ratio" in cols:
        (n, mean, lo, hi) = db.rows(
            f"""
            SELECT count(*), avg(r), min(r), max(r)
            FROM (SELECT unnest(ratio) AS r, unnest({INT_MASK}) AS m FROM read_parquet(?, hive_partitioning = false)) WHERE m = 1
            """,
            [str(path)], where=str(path),
        )[0]
        facts.ratio_tokens, facts.ratio_mean, facts.ratio_min, facts.ratio_max = n, mean, lo, hi


TOKEN_STRIPS = ("advantages", "ratio", "rollout_is_weights", "token_level_rewards", "ref_kl")


def row_tokens(db: Db, src: BatchSource, row: int, tokens: tuple[Path, list[str]] | None) -> dict[str, Any]:
    """One row's tokens: its ``uid`` and original ``mask`` from the batch, and from the scenario
    (when given) ``post_mask`` and whichever of :data:`TOKEN_STRIPS` it saved (None: a null list)."""
    base = db.rows(
        f"SELECT uid, mask FROM ({batch_rows_sql(src)}) WHERE row = ?", src.params + [row],
        where=str(src.path), arrow=src.arrow,
    )
    if not base:
        return {}
    out: dict[str, Any] = {"uid": base[0][0], "mask": list(base[0][1])}
    if tokens is None:
        return out
    path, cols = tokens
    have = [c for c in TOKEN_STRIPS if c in cols]
    sel = ", ".join([f"{INT_MASK} AS post_mask"] + [quote_ident(c) for c in have])
    got = db.rows(f"SELECT {sel} FROM read_parquet(?, hive_partitioning = false) WHERE row = ?", [str(path), row],
                  where=str(path))
    if got:
        out["post_mask"] = list(got[0][0])
        for c, v in zip(have, got[0][1:]):
            out[c] = list(v) if v is not None else None
    return out
