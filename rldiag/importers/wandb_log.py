"""A reader for W&B's transaction log (``run-<id>.wandb``), written from the file format.

wandb (0.30 and later) ships no supported reader for these files; the format is a LevelDB log
with a W&B header, as wandb-core writes it::

    file    := header block*
    header  := ident ":W&B" (4 bytes) | magic 0xBEE1 (uint16 LE) | version 0 (uint8)   7 bytes
    block   := chunk* padding?          32 KiB; the first block is 7 bytes short (the header)
    chunk   := crc (uint32 LE) | length (uint16 LE) | type (uint8) | payload[length]
    type    := FULL 1 | FIRST 2 | MIDDLE 3 | LAST 4

- ``crc`` is the standard CRC-32 (IEEE 802.3, zlib's ``crc32``; *not* LevelDB's masked CRC-32C)
  of the type byte followed by the payload.
- A chunk never crosses a block boundary. When fewer than 7 bytes are left in a block they are
  zero padding and the next chunk starts at the next block.
- A record is one FULL chunk, or FIRST, any number of MIDDLE, then LAST. Each record is one
  serialized ``wandb_internal.Record`` protobuf message.

The reader is pure Python (``zlib`` and ``struct``), streams the file through ``mmap`` and never
raises on damaged content: a file cut off mid-write (a run killed while logging) yields every
complete record and :class:`LogStats` says what was left over; a chunk with a bad checksum skips
the rest of its block, as LevelDB's own recovery does.
"""

from __future__ import annotations

import mmap
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from rldiag.errors import WandbImportError

WANDB_IDENT = b":W&B"
WANDB_MAGIC = 0xBEE1
WANDB_VERSION = 0
FILE_HEADER_LEN = 7
BLOCK_LEN = 32 * 1024
CHUNK_HEADER_LEN = 7

FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
CHUNK_NAMES = {FULL: "full", FIRST: "first", MIDDLE: "middle", LAST: "last"}

_CHUNK_HEADER = struct.Struct("<IHB")
_TYPE_CRC = {t: zlib.crc32(bytes([t])) for t in CHUNK_NAMES}


def chunk_crc(chunk_type: int, payload) -> int:
    """The checksum a chunk of ``chunk_type`` carrying ``payload`` must have."""
    return zlib.crc32(payload, zlib.crc32(bytes([chunk_type])))


@dataclass
class LogStats:
    """What reading one file found, good and bad."""

    path: str
    file_size: int = 0
    records: int = 0
    chunks: dict[str, int] = field(default_factory=lambda: {n: 0 for n in CHUNK_NAMES.values()})
    end_of_records: int = FILE_HEADER_LEN  # offset just past the last complete record
    incomplete_records: int = 0  # records whose chunks stop before their LAST chunk
    truncated_tail: bool = False  # the file ends inside a chunk (torn write)
    corrupt_chunks: int = 0  # chunks with a bad checksum, length or type
    skipped_bytes: int = 0  # bytes skipped to recover from corrupt chunks
    orphan_chunks: int = 0  # MIDDLE/LAST chunks without their FIRST (after a skip)

    @property
    def unread_tail_bytes(self) -> int:
        """Bytes after the last complete record that held no complete record."""
        return max(0, self.file_size - self.end_of_records)

    @property
    def damaged(self) -> bool:
        return bool(self.truncated_tail or self.incomplete_records or self.corrupt_chunks or self.orphan_chunks)

    def problems(self) -> list[str]:
        """Plain-language lines for each kind of damage; empty for a clean file."""
        out = []
        if self.truncated_tail or self.incomplete_records:
            out.append(
                f"{self.path} ends mid-record (the run was killed or is still writing): "
                f"{self.incomplete_records} incomplete record(s), the last {self.unread_tail_bytes} bytes "
                f"(after offset {self.end_of_records}) not imported"
            )
        if self.corrupt_chunks or self.orphan_chunks:
            out.append(
                f"{self.path}: {self.corrupt_chunks} corrupt chunk(s) (checksum, length or type), "
                f"{self.skipped_bytes} bytes skipped, {self.orphan_chunks} chunk(s) of records whose start was lost"
            )
        return out

    def as_dict(self) -> dict:
        return {
            "file_size": self.file_size,
            "records": self.records,
            "chunks": dict(self.chunks),
            "end_of_records": self.end_of_records,
            "unread_tail_bytes": self.unread_tail_bytes,
            "incomplete_records": self.incomplete_records,
            "truncated_tail": self.truncated_tail,
            "corrupt_chunks": self.corrupt_chunks,
            "skipped_bytes": self.skipped_bytes,
            "orphan_chunks": self.orphan_chunks,
        }


def check_header(head: bytes, path: str) -> None:
    if len(head) < FILE_HEADER_LEN:
        raise WandbImportError(f"{path} is not a W&B run file: {len(head)} bytes, shorter than the 7-byte header")
    ident, magic, version = struct.unpack("<4sHB", head[:FILE_HEADER_LEN])
    if ident != WANDB_IDENT or magic != WANDB_MAGIC:
        raise WandbImportError(f"{path} is not a W&B run file (header {head[:FILE_HEADER_LEN]!r}, expected ':W&B' 0xBEE1)")
    if version != WANDB_VERSION:
        raise WandbImportError(f"{path}: W&B log format version {version}; this reader knows version {WANDB_VERSION}")


def iter_records(path: str | Path, stats: LogStats | None = None) -> Iterator[tuple[int, bytes]]:
    """Yield ``(offset, payload)`` for every complete record of the file, in order.

    ``offset`` is where the record's first chunk starts. ``stats`` (optional) is filled in as the
    file is read; it is complete once the iterator is exhausted.
    """
    path = Path(path)
    stats = stats if stats is not None else LogStats(str(path))
    try:
        fh = path.open("rb")
    except OSError as exc:
        raise WandbImportError(f"cannot open {path}: {exc}") from exc
    with fh:
        size = path.stat().st_size
        stats.file_size = size
        check_header(fh.read(FILE_HEADER_LEN), str(path))
        if size == FILE_HEADER_LEN:
            return
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            yield from _iter_buffer(memoryview(mm), size, stats)


def iter_records_bytes(data: bytes, stats: LogStats | None = None, name: str = "<bytes>") -> Iterator[tuple[int, bytes]]:
    """:func:`iter_records` over a file's content held in memory."""
    stats = stats if stats is not None else LogStats(name)
    stats.file_size = len(data)
    check_header(bytes(data[:FILE_HEADER_LEN]), name)
    yield from _iter_buffer(memoryview(data), len(data), stats)


def _iter_buffer(buf: memoryview, size: int, stats: LogStats) -> Iterator[tuple[int, bytes]]:
    pos = FILE_HEADER_LEN
    parts: list[memoryview] = []  # chunks of the record being assembled
    start = -1  # offset of its first chunk
    unpack = _CHUNK_HEADER.unpack_from
    counts = stats.chunks
    payload: memoryview | None = None
    try:
        while pos < size:
            block_end = (pos // BLOCK_LEN + 1) * BLOCK_LEN
            if block_end - pos < CHUNK_HEADER_LEN:  # block trailer: zero padding
                pos = block_end
                continue
            if pos + CHUNK_HEADER_LEN > size:  # the file ends inside a chunk header
                if any(buf[pos:size]):
                    stats.truncated_tail = True
                break
            crc, length, ctype = unpack(buf, pos)
            if crc == 0 and length == 0 and ctype == 0:
                # A zeroed region (preallocated or never written): nothing more in this block.
                if any(buf[pos:min(block_end, size)]):
                    stats.corrupt_chunks += 1
                    stats.skipped_bytes += min(block_end, size) - pos
                pos = block_end
                continue
            end = pos + CHUNK_HEADER_LEN + length
            if end > block_end or ctype not in CHUNK_NAMES:
                corrupt = True
            else:
                if end > size:  # the file ends inside this chunk's payload: a torn write
                    stats.truncated_tail = True
                    break
                payload = buf[pos + CHUNK_HEADER_LEN:end]
                corrupt = zlib.crc32(payload, _TYPE_CRC[ctype]) != crc
            if corrupt:  # skip the rest of the block; a record in progress is lost
                stats.corrupt_chunks += 1
                stats.skipped_bytes += min(block_end, size) - pos
                if parts:
                    stats.incomplete_records += 1
                    parts, start = [], -1
                pos = block_end
                continue
            assert payload is not None  # read above for every chunk that is not corrupt
            counts[CHUNK_NAMES[ctype]] += 1
            if ctype == FULL:
                if parts:
                    stats.incomplete_records += 1
                    parts = []
                stats.records += 1
                stats.end_of_records = end
                yield pos, bytes(payload)
                start = -1
            elif ctype == FIRST:
                if parts:
                    stats.incomplete_records += 1
                parts, start = [payload], pos
            elif not parts:  # MIDDLE or LAST whose FIRST was lost to a skipped block
                stats.orphan_chunks += 1
            elif ctype == MIDDLE:
                parts.append(payload)
            else:  # LAST
                parts.append(payload)
                record = b"".join(parts)
                rec_start = start
                parts, start = [], -1
                stats.records += 1
                stats.end_of_records = end
                yield rec_start, record
            pos = end
        if parts:  # the file ends between the FIRST and LAST chunk of a record
            stats.incomplete_records += 1
    finally:
        # Drop every view into the buffer so that the caller's mmap can be closed.
        del parts, payload, buf
