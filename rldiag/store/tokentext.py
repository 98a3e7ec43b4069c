"""A step's response text (the batch's ``response_tokens``, one string per response token) and
the tokens that stand out: the largest |log ratio|, reference KL and rollout IS weight over the
step's actor tokens, each with the tokens around it."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from rldiag.io.schema import PROMPT_TEXT_COLUMN, RESPONSE_TEXT_COLUMN
from rldiag.store.batches import BatchSource
from rldiag.store.db import Db

TEXT_COLUMN = RESPONSE_TEXT_COLUMN
#: the batch column of the prompt's text, one string per prompt token (when the capture wrote it)
PROMPT_COLUMN = PROMPT_TEXT_COLUMN

#: kind -> (tokens-file column, SQL score of a value ``v`` to rank by, SQL condition on ``v``)
RANKINGS = {
    "|log ratio|": ("ratio", "abs(ln(v))", "v > 0"),
    "ref KL": ("ref_kl", "abs(v)", "true"),
    "IS weight": ("rollout_is_weights", "v", "true"),
}


def row_text(db: Db, src: BatchSource, row: int, column: str = TEXT_COLUMN) -> list[str] | None:
    """One row's response tokens as text (None: the batch has no ``response_tokens``);
    ``column=PROMPT_COLUMN``: its prompt's."""
    if not src.has(column):
        return None
    got = db.rows(f"SELECT {column} FROM {src.sql} WHERE row = ?", src.params + [row], where=str(src.path),
                  arrow=src.arrow)
    return [("" if t is None else str(t)) for t in got[0][0]] if got and got[0][0] is not None else None


def top_tokens(db: Db, src: BatchSource, tokens: tuple[Path, list[str]], kind: str, k: int = 10,
               context: int = 6) -> pl.DataFrame:
    """The step's ``k`` actor tokens (mask 1 after correction) ranked by ``kind`` (a key of
    :data:`RANKINGS`): ``row, position, token, value, before, after`` (``position`` from 0;
    ``before`` / ``after`` up to ``context`` tokens each side). Empty when the scenario did not
    save the quantity or the batch has no text."""
    path, cols = tokens
    column, score, cond = RANKINGS[kind]
    if column not in cols or not src.has(TEXT_COLUMN):
        return pl.DataFrame(schema={"row": pl.Int64, "position": pl.Int64, "token": pl.String, "value": pl.Float64,
                                    "before": pl.List(pl.String), "after": pl.List(pl.String)})
    k, c = int(k), int(context)
    sql = f"""
        WITH t AS (
            SELECT row, unnest(generate_series(1, len({column}))) AS pos, unnest({column})::DOUBLE AS v,
                   unnest(response_mask)::INTEGER AS m
            FROM read_parquet(?, hive_partitioning = false)
        ),
        top AS (
            SELECT row, pos, v, {score} AS score FROM t WHERE m = 1 AND v IS NOT NULL AND isfinite(v) AND {cond}
            ORDER BY score DESC, row, pos LIMIT {k}
        )
        SELECT top.row, top.pos - 1 AS position, b.{TEXT_COLUMN}[top.pos] AS token, top.v AS value,
               list_slice(b.{TEXT_COLUMN}, greatest(1, top.pos - {c}), top.pos - 1) AS before,
               list_slice(b.{TEXT_COLUMN}, top.pos + 1, top.pos + {c}) AS after
        FROM top JOIN (SELECT row, {TEXT_COLUMN} FROM {src.sql}) b USING (row)
        ORDER BY top.score DESC, top.row, top.pos
    """
    return db.frame(sql, [str(path)] + src.params, where=str(path), arrow=src.arrow)
