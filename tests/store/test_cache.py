"""The store's result cache: served while the signatures match, bounded in entries and bytes."""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa

from rldiag.store.cache import SigCache, nbytes


def test_nbytes_of_frames_tables_arrays_and_tuples():
    arr = np.zeros(1000)
    frame = pl.DataFrame({"x": np.arange(500, dtype=np.int64)})
    table = pa.table({"x": np.arange(250, dtype=np.int64)})
    assert nbytes(arr) == 8000 and nbytes(frame) == 4000 and nbytes(table) == 2000
    assert nbytes((arr, [frame, table], "text", 3)) == 14000
    assert nbytes({"a": arr}) == 0 and nbytes(None) == 0


def test_cache_serves_on_same_signature_and_recomputes_on_a_new_one():
    c = SigCache()
    calls = []
    get = lambda sig: c.get("k", sig, lambda: calls.append(sig) or len(calls))  # noqa: E731
    assert get(1) == 1 and get(1) == 1 and get(2) == 2
    assert calls == [1, 2] and c.hits == 1 and c.misses == 2


def test_cache_drops_least_recently_used_past_its_bytes():
    c = SigCache(max_bytes=20_000)
    for k in "abc":
        c.get(k, 0, lambda: np.zeros(1000))  # 8,000 bytes each
    assert c.bytes == 16_000  # "a" went first
    c.get("b", 0, lambda: None)  # a hit: "b" is now the newest
    c.get("d", 0, lambda: np.zeros(1000))
    assert c.bytes == 16_000
    recomputed = []
    for k in "abcd":
        c.get(k, 0, lambda k=k: recomputed.append(k) or np.zeros(1))
    assert recomputed[:2] == ["a", "c"]  # dropped; "b" and "d" were kept
    big = c.get("big", 0, lambda: np.zeros(10_000))  # bigger than the bound: kept alone
    assert big.size == 10_000 and c.bytes == 80_000
    c.get("big", 1, lambda: np.zeros(10))  # replaced under a new signature: its bytes go
    assert c.bytes == 80
    c.clear()
    assert c.bytes == 0


def test_cache_bounded_in_entries():
    c = SigCache(maxsize=3)
    for i in range(10):
        c.get(i, 0, lambda i=i: i)
    misses = c.misses
    assert [c.get(i, 0, lambda: -1) for i in (7, 8, 9)] == [7, 8, 9] and c.misses == misses
    assert c.get(0, 0, lambda: -1) == -1
