"""Every row of every step, queried: the per-row tables a recompute writes
(``RUN/rldiag/scenarios/<name>/rows/step_<N:06d>.parquet``) filtered, sorted and paged by DuckDB.

:func:`query_rows` and :func:`count_rows` are :func:`rldiag.rows` and :func:`rldiag.rows_count`.
Nothing is loaded whole: DuckDB reads the tables' Parquet files (``read_parquet`` over the
scenario's files, their columns unioned by name), and the filter, the order and the
``LIMIT``/``OFFSET`` run inside it, so a page of 50 rows of a million-row run costs a scan of the
columns the query touches and 50 rows out.

The filter, ``where``, is one SQL boolean expression over the table's columns. It is checked
before it reaches DuckDB, token by token (DuckDB's own tokenizer): a name is a column of the table
(else a :class:`~rldiag.errors.QueryError` naming it and listing the columns) or, before ``(``, a
function of :data:`FUNCTIONS`; keywords are those of an expression (:data:`KEYWORDS`: no
``SELECT``, ``FROM``, ...), operators those of arithmetic and comparison (:data:`OPERATORS`: no
``;``, no parameters), no comments. So the text can only be an expression over the row's own
values: no statement, no subquery, no table function, no file read. What DuckDB then refuses
(a syntax or type error) is a :class:`QueryError` quoting the expression and DuckDB's message.

``other``: a second scenario joined by ``(step, row)``, its per-row values as ``other_<name>``
columns (``other_advantage_mean``): :data:`SIGN_DIFFERS` filters the rows whose mean advantage
changes sign under it. ``search``: the rows whose response text (the batch files'
``response_tokens``, one string per token, joined) contains the text, case-insensitively; rows of
a batch without text never match.

Each query opens its own connection (:class:`~rldiag.store.db.Db`), which reads only the run's
directories (:mod:`rldiag.store.sandbox`): even an expression the checker let through by mistake
cannot read another file.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from rldiag.errors import QueryError, RunDirError
from rldiag.io.fs import as_path, is_remote
from rldiag.io.outputs import ROW_OUTPUTS
from rldiag.io.run_layout import RunLayout
from rldiag.io.rundir import RunDir, StepFile
from rldiag.io.schema import RESPONSE_TEXT_COLUMN
from rldiag.store.batches import read_arrow
from rldiag.store.cache import SigCache, file_sig, local_path
from rldiag.store.db import Db
from rldiag.store.errors import StoreError
from rldiag.store.sandbox import served_dirs

#: the batch column holding each response token's text
TEXT_COLUMN = RESPONSE_TEXT_COLUMN
#: the prefix of the joined scenario's columns
OTHER_PREFIX = "other_"
#: the filter of rows whose mean advantage has another sign under the joined scenario
SIGN_DIFFERS = f"sign(advantage_mean) <> sign({OTHER_PREFIX}advantage_mean)"
#: the column of the response text a page's rows get with ``preview``
PREVIEW_COLUMN = "response"

#: functions a filter may call (scalar, of the row's own values)
FUNCTIONS = frozenset({
    "abs", "sign", "ln", "log", "log2", "log10", "sqrt", "exp", "pow", "power", "round", "floor", "ceil",
    "ceiling", "greatest", "least", "coalesce", "ifnull", "nullif", "isnan", "isinf", "isfinite", "lower",
    "upper", "length", "strlen", "contains", "starts_with", "ends_with", "prefix", "suffix", "regexp_matches",
})
#: keywords a filter may hold: those of one expression
KEYWORDS = frozenset({
    "and", "or", "not", "is", "null", "true", "false", "in", "between", "like", "ilike", "glob", "case", "when",
    "then", "else", "end", "cast", "as", "isnull", "notnull",
})
#: type names, after ``::`` or ``CAST(... AS``
TYPES = frozenset({"double", "float", "real", "integer", "int", "bigint", "smallint", "varchar", "text",
                   "boolean", "bool", "decimal", "numeric"})
#: operators a filter may hold
OPERATORS = frozenset({"(", ")", ",", "+", "-", "*", "/", "//", "%", "^", "**", "=", "==", "!=", "<>", "<", ">",
                       "<=", ">=", "||", "::"})

_READ = "union_by_name = true, hive_partitioning = false"


@dataclass(frozen=True)
class RowsQuery:
    """What one query reads: the scenario's per-row files, and the joined scenario's."""

    run: Path
    scenario: str
    files: list[str]
    other: str | None = None
    other_files: tuple[str, ...] = ()


def _local_run(run: Any) -> Path:
    path = as_path(run)
    if is_remote(path):
        raise RunDirError(f"{path}: rldiag rows reads run directories on local disk; copy the run to a local directory")
    return Path(RunDir(path).path)  # a RunDirError when the directory does not exist


def _files(run: Path, scenario: str) -> list[str]:
    """The scenario's per-row files (a RunDirError saying to recompute when it has none)."""
    sc = RunLayout(run).scenario(scenario)
    steps = sc.row_steps()
    if not steps:
        what = "has no per-row tables" if sc.dir.is_dir() else "does not exist"
        how = "rldiag recompute RUN" if scenario == "baseline" else f"rldiag recompute RUN --name {scenario} ..."
        raise RunDirError(f"{run}: scenario {scenario!r} {what} (rows/step_<N>.parquet); run `{how}` first")
    return [str(sc.rows_file(s)) for s in steps]


def _source(run: Any, scenario: str, other: str | None) -> RowsQuery:
    path = _local_run(run)
    if other is not None and other == scenario:
        raise QueryError(f"other: {other!r} is the scenario itself; pick another scenario to compare with")
    return RowsQuery(path, scenario, _files(path, scenario), other,
                     tuple(_files(path, other)) if other is not None else ())


def _relation_sql(q: RowsQuery, other_columns: Sequence[str]) -> str:
    """``r``: the per-row table, the joined scenario's values as ``other_<name>`` columns."""
    base = f"SELECT * FROM read_parquet($files, {_READ})"
    if q.other is None:
        return f"r AS ({base})"
    cols = ", ".join(f"b.{_ident(c)} AS {_ident(OTHER_PREFIX + c)}" for c in other_columns)
    return (f"r AS (SELECT a.*, {cols} FROM ({base}) a LEFT JOIN "
            f"(SELECT * FROM read_parquet($other_files, {_READ})) b ON a.step = b.step AND a.row = b.row)")


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _run(con: duckdb.DuckDBPyConnection, sql: str, params: dict, what: str) -> Any:
    try:
        return con.execute(sql, params)
    except duckdb.IOException as exc:
        raise RunDirError(f"{what}: {_first_line(exc)} (a recompute may be replacing the scenario; query again)") from exc
    except duckdb.Error as exc:
        raise QueryError(f"{what}: {_first_line(exc)}") from exc


def _table(con: duckdb.DuckDBPyConnection, sql: str, params: dict, what: str) -> pa.Table:
    try:
        return con.sql(sql, params=params).to_arrow_table()
    except duckdb.IOException as exc:
        raise RunDirError(f"{what}: {_first_line(exc)} (a recompute may be replacing the scenario; query again)") from exc
    except duckdb.Error as exc:
        raise QueryError(f"{what}: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _columns(con: duckdb.DuckDBPyConnection, sql: str, params: dict) -> list[str]:
    rows = _run(con, f"DESCRIBE {sql}", params, "the per-row tables").fetchall()
    return [r[0] for r in rows]


def _schema(con: duckdb.DuckDBPyConnection, q: RowsQuery) -> tuple[list[str], list[str], dict]:
    """(the relation's columns, the joined scenario's columns, the parameters)."""
    params: dict[str, Any] = {"files": q.files}
    other_cols: list[str] = []
    if q.other is not None:
        params["other_files"] = list(q.other_files)
        have = _columns(con, f"SELECT * FROM read_parquet($other_files, {_READ})", {"other_files": list(q.other_files)})
        other_cols = [c for c in ROW_OUTPUTS if c in have]
    names = _columns(con, f"WITH {_relation_sql(q, other_cols)} SELECT * FROM r", params)
    return names, other_cols, params


# ---- the filter --------------------------------------------------------------------------------


def _tokens(expr: str) -> list[tuple[str, str]]:
    """``(text, kind)`` of each token of ``expr`` (DuckDB's tokenizer gives the starts)."""
    try:
        found = duckdb.tokenize(expr)
    except duckdb.Error as exc:
        raise QueryError(f"where {expr!r}: {_first_line(exc)}") from exc
    starts = [p for p, _ in found] + [len(expr)]
    return [(expr[starts[i]:starts[i + 1]].strip(), kind.name) for i, (_, kind) in enumerate(found)]


def _unquote(name: str) -> str:
    if len(name) >= 2 and name[0] == name[-1] == '"':
        return name[1:-1].replace('""', '"')
    return name


def check_expression(expr: str, names: Sequence[str], what: str = "where") -> str:
    """``expr`` when it is one expression over the columns ``names`` (see the module's
    docstring); else a :class:`QueryError` naming the column, function, keyword or operator."""
    known = {n.lower() for n in names}
    toks = _tokens(expr)
    depth = 0
    for i, (text, kind) in enumerate(toks):
        nxt = toks[i + 1][0] if i + 1 < len(toks) else ""
        prev = toks[i - 1][0].lower() if i else ""
        low = text.lower()
        if kind == "comment":
            raise QueryError(f"{what} {expr!r}: comments are not allowed in a filter")
        if kind in ("identifier", "keyword"):
            if nxt == "(":  # a call, or a keyword that takes parentheses (IN (...), CAST(...), NOT (...))
                if low not in FUNCTIONS and not (kind == "keyword" and low in KEYWORDS | TYPES):
                    raise QueryError(f"{what} {expr!r}: function {text!r} is not allowed in a filter; "
                                     f"allowed: {', '.join(sorted(FUNCTIONS))}")
            elif (prev in ("::", "as") and low in TYPES) or _unquote(text).lower() in known:
                pass
            elif kind == "keyword" and low in KEYWORDS:
                pass
            elif kind == "identifier":
                raise QueryError(f"{what} {expr!r}: no column {_unquote(text)!r} in the per-row table"
                                 f"{_did_you_mean(_unquote(text), names)}; columns: {', '.join(names)}")
            else:
                raise QueryError(f"{what} {expr!r}: {text!r} is not allowed: a filter is one expression over "
                                 "the columns (AND, OR, NOT, IS NULL, IN, BETWEEN, LIKE, CASE, CAST)")
        elif kind == "operator":
            if text not in OPERATORS:
                raise QueryError(f"{what} {expr!r}: {text!r} is not allowed in a filter; "
                                 f"operators: {' '.join(sorted(OPERATORS))}")
            depth += (text == "(") - (text == ")")
            if depth < 0:
                raise QueryError(f"{what} {expr!r}: a ')' without its '('")
    if depth:
        raise QueryError(f"{what} {expr!r}: a '(' without its ')'")
    return expr


def _did_you_mean(name: str, names: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(names), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _order(sort: str | None, names: Sequence[str]) -> str:
    if not sort or not sort.strip():
        return "ORDER BY step, row"
    key = sort.strip()
    desc = key.startswith("-")
    key = key[1:].strip() if desc else key
    match = next((n for n in names if n == key), None) or next((n for n in names if n.lower() == key.lower()), None)
    if match is None:
        raise QueryError(f"sort: no column {key!r} in the per-row table{_did_you_mean(key, names)}; "
                         f"columns: {', '.join(names)}")
    return f"ORDER BY {_ident(match)} {'DESC' if desc else 'ASC'} NULLS LAST, step, row"


# ---- the response text -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Texts:
    """The batch files' texts as ``(step, row, text)``: a SQL source and what it binds."""

    sql: str
    params: dict
    arrow: dict


def _texts(con: duckdb.DuckDBPyConnection, run: Path, steps: Sequence[int] | None = None) -> _Texts | None:
    """Every row's response text of the batches of ``steps`` (all when None); None when no batch has text."""
    files = [sf for sf in RunDir(run).step_files() if steps is None or sf.step in steps]
    parquet = [sf for sf in files if sf.format == "parquet"]
    parts: list[str] = []
    params: dict[str, Any] = {}
    arrow: dict[str, pa.Table] = {}
    if parquet:
        names = [str(sf.path) for sf in parquet]
        cols = _columns(con, f"SELECT * FROM read_parquet($t_files, {_READ})", {"t_files": names})
        if TEXT_COLUMN in cols:
            params.update(t_files=names, t_names=names, t_steps=[sf.step for sf in parquet])
            parts.append(
                f"SELECT m.step, t.file_row_number AS row, array_to_string(t.{TEXT_COLUMN}, '') AS text "
                f"FROM read_parquet($t_files, {_READ}, filename = true, file_row_number = true) t "
                "JOIN (SELECT unnest($t_names) AS filename, unnest($t_steps) AS step) m USING (filename)")
    tables = [t for sf in files if sf.format == "arrow" and (t := _arrow_text(sf)) is not None]
    if tables:
        arrow["arrow_texts"] = pa.concat_tables(tables)
        parts.append(f"SELECT step, row, array_to_string({TEXT_COLUMN}, '') AS text FROM arrow_texts")
    if not parts:
        return None
    return _Texts(" UNION ALL ".join(parts), params, arrow)


def _arrow_text(sf: StepFile) -> pa.Table | None:
    """An Arrow IPC batch's text column with ``step`` and ``row`` (memory-mapped, not copied)."""
    try:
        table = read_arrow(sf)
    except StoreError:
        return None  # a file still being written: its rows have no text yet
    if TEXT_COLUMN not in table.column_names:
        return None
    n = table.num_rows
    return pa.table({"step": pa.array([sf.step] * n, pa.int64()), "row": pa.array(range(n), pa.int64()),
                     TEXT_COLUMN: table[TEXT_COLUMN]})


#: the last searches' matches, by (run, text), kept while the batch files keep their signatures
#: (:func:`rldiag.store.cache.file_sig`): a page counts its rows and then reads them, each with
#: the same search, and pages through them after
HITS = SigCache(maxsize=8)


def search_hits(con: duckdb.DuckDBPyConnection, run: Path, search: str) -> pa.Table | None:
    """``(step, row)`` of every response whose text contains ``search`` (any case); None when no
    batch has text. The last few searches are kept while the batch files stay the same."""
    sigs = tuple(file_sig(local_path(sf.path)) for sf in RunDir(run).step_files())

    def compute() -> pa.Table | None:
        texts = _texts(con, run)
        if texts is None:
            return None
        for name, table in texts.arrow.items():
            con.register(name, table)
        return _table(con, f"SELECT DISTINCT step, row FROM ({texts.sql}) WHERE contains(lower(text), lower($search))",
                      {**texts.params, "search": search}, "the response text")

    return HITS.get((str(run), search.lower()), sigs, compute)


# ---- the queries -------------------------------------------------------------------------------


def _where(con, q: RowsQuery, names: list[str], params: dict, where: str | None,
           search: str | None) -> tuple[str, dict]:
    """(the WHERE clause, every parameter)."""
    conds = []
    if where is not None and where.strip():
        conds.append(f"({check_expression(where.strip(), names)})")
    if search is not None and search != "":
        hits = search_hits(con, q.run, search)
        if hits is None:
            conds.append("false")  # no batch has text: nothing matches
        else:
            con.register("search_hits", hits)
            conds.append("(step, row) IN (SELECT step, row FROM search_hits)")
    return (f"WHERE {' AND '.join(conds)}" if conds else ""), params


def query_rows(run: Any, where: str | None = None, sort: str | None = None, limit: int | None = 50, offset: int = 0,
               scenario: str = "baseline", search: str | None = None, *, other: str | None = None,
               preview: int = 0) -> pa.Table:
    """A page of the scenario's per-row table: the rows matching ``where`` and ``search``, in
    ``sort`` order (a column, ``-`` before it for descending; then step, row), ``limit`` of them
    (None: all) from ``offset``. ``preview``: a ``response`` column of the page's rows with
    the first ``preview`` characters of their response text (null without text)."""
    page = _page(limit, offset)
    q = _source(run, scenario, other)
    with Db(served_dirs(q.run)) as db, db.cursor() as con:
        names, other_cols, params = _schema(con, q)
        cond, params = _where(con, q, names, params, where, search)
        sql = f"WITH {_relation_sql(q, other_cols)} SELECT * FROM r {cond} {_order(sort, names)}{page}"
        table = _table(con, sql, params, f"where {where!r}" if where else f"scenario {scenario!r}")
        if preview > 0:
            table = _with_preview(con, q.run, table, int(preview))
    return table


def _page(limit: int | None, offset: int) -> str:
    """`` LIMIT n OFFSET k`` (checked: neither negative)."""
    if limit is not None and int(limit) < 0:
        raise QueryError(f"limit must be >= 0, not {limit}")
    if int(offset) < 0:
        raise QueryError(f"offset must be >= 0, not {offset}")
    return (f" LIMIT {int(limit)}" if limit is not None else "") + (f" OFFSET {int(offset)}" if offset else "")


def count_rows(run: Any, where: str | None = None, scenario: str = "baseline", search: str | None = None, *,
               other: str | None = None) -> int:
    """How many rows of the scenario's per-row table match ``where`` and ``search``."""
    q = _source(run, scenario, other)
    with Db(served_dirs(q.run)) as db, db.cursor() as con:
        names, other_cols, params = _schema(con, q)
        cond, params = _where(con, q, names, params, where, search)
        sql = f"WITH {_relation_sql(q, other_cols)} SELECT count(*) FROM r {cond}"
        got = _run(con, sql, params, f"where {where!r}" if where else f"scenario {scenario!r}").fetchone()
        return int(got[0]) if got else 0


def _with_preview(con: duckdb.DuckDBPyConnection, run: Path, table: pa.Table, chars: int) -> pa.Table:
    """``table`` with the first ``chars`` characters of each row's response (only its steps' batches read)."""
    steps = sorted(set(table["step"].to_pylist())) if table.num_rows else []
    texts = _texts(con, run, steps) if steps else None
    if texts is None:
        return table.append_column(PREVIEW_COLUMN, pa.nulls(table.num_rows, pa.string()))
    for name, t in texts.arrow.items():
        con.register(name, t)
    con.register("page", table.select(["step", "row"]).append_column("i", pa.array(range(table.num_rows), pa.int64())))
    sql = (f"SELECT CASE WHEN length(t.text) > $chars THEN left(t.text, $chars) || '…' ELSE t.text END AS text "
           f"FROM page LEFT JOIN ({texts.sql}) t USING (step, row) ORDER BY page.i")
    got = _table(con, sql, {**texts.params, "chars": chars}, "the response text")
    return table.append_column(PREVIEW_COLUMN, got["text"].cast(pa.string()))


# ---- groups ------------------------------------------------------------------------------------

#: ``group_by`` -> the key columns: a uid's rows are one prompt group of one step
GROUP_KEYS = {"uid": ("step", "uid"), "step": ("step",), "data_source": ("data_source",)}
#: per-row counts, summed over a group (``<col>_sum``; the plain name sorts by the sum); every other
#: numeric column is averaged (``<col>_mean``)
COUNT_COLUMNS = ("length", "actor_tokens", "turns", "clipped_tokens")
#: the column of the number of rows in a group
ROWS_COLUMN = "rows"


def _group_select(names: Sequence[str], numeric: dict[str, str], by: str
                  ) -> tuple[tuple[str, ...], list[str], list[str]]:
    """(the keys, the SELECT items, the output columns) of the groups of ``by`` (``numeric``: the
    table's numeric columns and their DuckDB types)."""
    if by not in GROUP_KEYS:
        raise QueryError(f"group by {by!r}: choose one of {', '.join(GROUP_KEYS)}")
    keys = GROUP_KEYS[by]
    missing = [k for k in keys if k not in names]
    if missing:
        raise QueryError(f"group by {by!r}: the per-row table has no column {', '.join(map(repr, missing))} "
                         f"(the batch files do not carry it); columns: {', '.join(names)}")
    items = [_ident(k) for k in keys] + [f"count(*) AS {ROWS_COLUMN}", "min(row) AS first_row"]
    out = [*keys, ROWS_COLUMN, "first_row"]
    for n in [n for n in names if n not in keys and n not in ("step", "row") and n in numeric]:
        if n in COUNT_COLUMNS:  # a sum keeps its column's kind (DuckDB widens an integer sum to a decimal)
            kind = "DOUBLE" if numeric[n] in ("DOUBLE", "FLOAT", "REAL") else "BIGINT"
            items.append(f"CAST(sum({_ident(n)}) AS {kind}) AS {_ident(n + '_sum')}")
            suffix = "_sum"
        else:
            items.append(f"avg({_ident(n)}) AS {_ident(n + '_mean')}")
            suffix = "_mean"
        out.append(n + suffix)
    return keys, items, out


def _group_order(sort: str | None, keys: Sequence[str], out: Sequence[str]) -> str:
    """``ORDER BY``: a group column, or a per-row column's name for its sum (a count) or mean."""
    tie = ", ".join(_ident(k) for k in keys)
    if not sort or not sort.strip():
        return f"ORDER BY {tie}"
    key = sort.strip()
    desc = key.startswith("-")
    key = key[1:].strip() if desc else key
    match = next((c for c in out if c == key), None) or next(
        (c for c in (key + "_sum", key + "_mean") if c in out), None)
    if match is None:
        raise QueryError(f"sort: no group column {key!r}{_did_you_mean(key, list(out))}; columns: {', '.join(out)}")
    return f"ORDER BY {_ident(match)} {'DESC' if desc else 'ASC'} NULLS LAST, {tie}"


def query_groups(run: Any, by: str, where: str | None = None, sort: str | None = None, limit: int | None = 50,
                 offset: int = 0, scenario: str = "baseline", search: str | None = None, *,
                 preview: int = 0) -> pa.Table:
    """The scenario's rows matching ``where`` and ``search``, grouped ``by`` (:data:`GROUP_KEYS`):
    per group its keys, ``rows``, ``first_row`` (its first row), each count of
    :data:`COUNT_COLUMNS` summed (``<col>_sum``) and every other numeric column averaged
    (``<col>_mean``: a share for a 0/1 column), in ``sort`` order (a group column, or a per-row
    column's name: its sum or mean; ``-`` for descending; then the keys), ``limit`` groups from
    ``offset``. ``preview``: a ``response`` column, the first row's response text (``step`` groups
    and ``uid`` groups: the step's; ``data_source`` groups have no single step: null)."""
    page = _page(limit, offset)
    q = _source(run, scenario, None)
    with Db(served_dirs(q.run)) as db, db.cursor() as con:
        names, _, params = _schema(con, q)
        types = _run(con, f"DESCRIBE WITH {_relation_sql(q, [])} SELECT * FROM r", params, "the per-row tables").fetchall()
        numeric = {r[0]: str(r[1]).upper() for r in types if str(r[1]).upper() in _NUMERIC_TYPES}
        keys, items, out = _group_select(names, numeric, by)
        cond, params = _where(con, q, names, params, where, search)
        sql = (f"WITH {_relation_sql(q, [])} SELECT {', '.join(items)} FROM r {cond} "
               f"GROUP BY {', '.join(_ident(k) for k in keys)} {_group_order(sort, keys, out)}{page}")
        table = _table(con, sql, params, f"group by {by!r}")
        if preview > 0:
            if "step" in keys:
                rows = table.select(["step", "first_row"]).rename_columns(["step", "row"])
                texts = _with_preview(con, q.run, rows, int(preview))[PREVIEW_COLUMN]
            else:
                texts = pa.nulls(table.num_rows, pa.string())
            table = table.append_column(PREVIEW_COLUMN, texts)
    return table


def count_groups(run: Any, by: str, where: str | None = None, scenario: str = "baseline",
                 search: str | None = None) -> int:
    """How many groups :func:`query_groups` gives with the same ``by``, ``where`` and ``search``."""
    q = _source(run, scenario, None)
    with Db(served_dirs(q.run)) as db, db.cursor() as con:
        names, _, params = _schema(con, q)
        keys = _group_select(names, {}, by)[0]
        cond, params = _where(con, q, names, params, where, search)
        sql = (f"WITH {_relation_sql(q, [])} SELECT count(*) FROM (SELECT 1 FROM r {cond} "
               f"GROUP BY {', '.join(_ident(k) for k in keys)})")
        got = _run(con, sql, params, f"group by {by!r}").fetchone()
        return int(got[0]) if got else 0


_NUMERIC_TYPES = frozenset({"BIGINT", "INTEGER", "SMALLINT", "TINYINT", "DOUBLE", "FLOAT", "REAL", "HUGEINT",
                            "UBIGINT", "UINTEGER", "BOOLEAN", "DECIMAL"})
