"""The .wandb block reader against an independent encoder of the format, damage included.

The encoder below follows the LevelDB log writer as wandb-core runs it (7-byte W&B header,
32 KiB blocks, trailer padding under 7 bytes, zero-length FIRST chunks when exactly 7 bytes are
left, CRC-32 of type byte + payload). Real files from the wandb SDK are read in
test_wandb_offline.py.
"""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rldiag.importers import WandbImportError
from rldiag.importers.wandb_log import BLOCK_LEN, FIRST, FULL, LAST, MIDDLE, LogStats, iter_records, iter_records_bytes
from rldiag.importers.wandb_values import flatten_row, parse_json, unwrap_config

HEADER = b":W&B" + struct.pack("<H", 0xBEE1) + b"\x00"


def encode(records: list[bytes]) -> tuple[bytes, list[int]]:
    """The file for ``records`` and the offset just past each record."""
    out = bytearray(HEADER)
    ends = []
    for rec in records:
        first, data = True, rec
        while True:
            left = BLOCK_LEN - len(out) % BLOCK_LEN
            if left < 7:
                out += b"\0" * left
                left = BLOCK_LEN
            frag, data = data[:left - 7], data[left - 7:]
            last = not data
            t = FULL if first and last else FIRST if first else LAST if last else MIDDLE
            out += struct.pack("<IHB", zlib.crc32(bytes([t]) + frag), len(frag), t) + frag
            first = False
            if last:
                break
        ends.append(len(out))
    return bytes(out), ends


def read(data: bytes) -> tuple[list[bytes], LogStats]:
    stats = LogStats("t")
    return [p for _, p in iter_records_bytes(data, stats)], stats


def payload(n: int, seed: int = 0) -> bytes:
    return bytes((i * 31 + seed) % 251 for i in range(n))


def test_round_trip_at_block_edges():
    first_room = BLOCK_LEN - 7 - 7  # payload that fills the first block exactly
    sizes = [0, 1, 100, first_room, 5, BLOCK_LEN - 7, 3 * BLOCK_LEN + 11, 0, 17]
    # records that leave 1..7 bytes at the end of a block (padding, then a zero-length FIRST)
    for gap in range(1, 8):
        sizes += [BLOCK_LEN - 7 - 7 - gap, 40]
    records = [payload(n, i) for i, n in enumerate(sizes)]
    data, _ = encode(records)
    got, stats = read(data)
    assert got == records
    assert not stats.damaged and stats.unread_tail_bytes == 0
    assert stats.chunks["first"] > 0 and stats.chunks["middle"] > 0 and stats.chunks["last"] > 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=70_000), min_size=0, max_size=12), st.integers(0, 1000))
def test_round_trip_property(sizes, seed):
    records = [payload(n, seed + i) for i, n in enumerate(sizes)]
    data, _ = encode(records)
    got, stats = read(data)
    assert got == records and stats.records == len(records) and not stats.damaged


def test_every_cut_yields_a_prefix_and_says_so():
    records = [payload(n, i) for i, n in enumerate([300, 40_000, 7, 20_000, 90_000, 1, 500])]
    data, ends = encode(records)
    cuts = sorted(set(range(7, len(data), 997)) | {e - 1 for e in ends} | set(ends) | {e + 3 for e in ends})
    for cut in cuts:
        if cut > len(data):
            continue
        got, stats = read(data[:cut])
        complete = sum(1 for e in ends if e <= cut)
        assert got == records[:complete], cut
        assert stats.end_of_records + stats.unread_tail_bytes == cut
        if cut == 7 or cut in ends:
            assert not stats.damaged and stats.unread_tail_bytes == 0, cut
        elif any(data[stats.end_of_records:cut]):  # a cut inside a chunk, not in block padding
            assert stats.damaged and stats.problems(), cut


def test_corrupt_chunk_skips_the_rest_of_its_block():
    records = [payload(2000, i) for i in range(40)]  # 80 kB: three blocks
    data, ends = encode(records)
    bad = bytearray(data)
    bad[100] ^= 0xFF  # inside record 0
    got, stats = read(bytes(bad))
    assert stats.corrupt_chunks == 1 and stats.skipped_bytes > 0
    # records that start in block 1 or later are back; the one crossing into block 1 is an orphan
    starts = [7] + ends[:-1]
    expect = [r for r, s in zip(records, starts) if s >= BLOCK_LEN]
    assert got == expect
    assert stats.orphan_chunks == 1
    assert any("corrupt chunk" in p for p in stats.problems())


def test_zero_filled_tail_is_not_damage():
    records = [payload(5000, i) for i in range(3)]
    data, _ = encode(records)
    got, stats = read(data + b"\0" * 3000)
    assert got == records and not stats.damaged


def test_header_checks(tmp_path):
    with pytest.raises(WandbImportError, match="shorter than the 7-byte header"):
        list(iter_records_bytes(b":W&B"))
    with pytest.raises(WandbImportError, match="not a W&B run file"):
        list(iter_records_bytes(b"PK\x03\x04\x00\x00\x00"))
    with pytest.raises(WandbImportError, match="version 1"):
        list(iter_records_bytes(HEADER[:6] + b"\x01"))
    f = tmp_path / "empty.wandb"
    f.write_bytes(HEADER)
    assert list(iter_records(f)) == []
    data, _ = encode([b"abc"])
    f.write_bytes(data)
    assert [p for _, p in iter_records(f)] == [b"abc"]


def test_values():
    row = {"_step": 3, "a/b": 1, "val": {"acc": 0.5, "r": {"m": 2}}, "img": {"_type": "image-file", "path": "x"}}
    assert flatten_row(row) == {
        "_step": 3, "a/b": 1, "val.acc": 0.5, "val.r.m": 2, "img": {"_type": "image-file", "path": "x"}}
    assert flatten_row({"val": {"acc": 1}}, sep="/") == {"val/acc": 1}
    raw = {"_wandb": {"value": {"cli_version": "0.31"}}, "algorithm": {"value": {"gamma": 1.0}, "desc": None},
           "data": {"value": {"value": 3}}}
    assert unwrap_config(raw) == {"algorithm": {"gamma": 1.0}, "data": {"value": 3}}
    plain_cfg = {"_wandb": {"x": 1}, "algorithm": {"gamma": 1.0}, "reward": {"value": 3}}  # already unwrapped
    assert unwrap_config(plain_cfg) == {"algorithm": {"gamma": 1.0}, "reward": {"value": 3}}
    z = parse_json("-0")
    assert isinstance(z, float) and str(z) == "-0.0"
    assert parse_json("12") == 12 and isinstance(parse_json("12"), int)
    assert str(parse_json("[NaN, Infinity, -Infinity]")) == "[nan, inf, -inf]"
