"""Crafting ArrayRecord files the way an attacker would: chunks rewritten with their HighwayHashes recomputed (the
key is public, so hashes stop random damage, not intent), footers re-encoded, sizes that wrap around 2^64.

Positions are file positions; the bytes of a chunk skip the 24-byte header of every 64 KiB block it crosses, as
riegeli lays them out (loader/format/_riegeli.c's module doc).

    data = bytearray(open(path, "rb").read())
    header, body = chunk_at(data, 64)                       # the first record's chunk
    put_chunk(data, 64, body, num_records=1, decoded_size=2**40)   # hashes recomputed
"""

from __future__ import annotations

import struct

import numpy as np

from dataset_format.wire import varint as _read_varint
from loader.format import _riegeli

BLOCK = 1 << 16
BLOCK_HEADER = 24
CHUNK_HEADER = 40


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _positions(pos: int, n: int) -> list[int]:
    """The file positions of n chunk bytes starting at file position pos (block headers skipped)."""
    out = []
    while len(out) < n:
        if pos % BLOCK < BLOCK_HEADER:
            pos += BLOCK_HEADER - pos % BLOCK
            continue
        out.append(pos)
        pos += 1
    return out


def read_logical(data: bytes, pos: int, n: int) -> bytes:
    return bytes(data[p] for p in _positions(pos, n))


def write_logical(data: bytearray, pos: int, payload: bytes) -> None:
    for p, byte in zip(_positions(pos, len(payload)), payload):
        data[p] = byte


def chunk_at(data: bytes, pos: int) -> tuple[dict, bytes]:
    """The chunk at file position pos: its header fields and its data."""
    header_hash, data_size, data_hash, type_count, decoded = struct.unpack("<5Q", read_logical(data, pos, 40))
    header = {"data_size": data_size, "type": type_count & 0xFF, "num_records": type_count >> 8,
              "decoded_size": decoded}
    return header, read_logical(data, pos + 0, CHUNK_HEADER + data_size)[CHUNK_HEADER:]


def put_chunk(data: bytearray, pos: int, body: bytes, *, num_records: int, decoded_size: int,
              chunk_type: int = ord("r"), data_size: int | None = None) -> None:
    """Writes a chunk header (hashes recomputed) and `body` at file position pos. `data_size` defaults to len(body)."""
    size = len(body) if data_size is None else data_size
    # header bytes 8..40: data_size, data_hash, type | num_records << 8, decoded_size; header_hash covers them
    type_and_count = (chunk_type | (num_records << 8)) % (1 << 64)
    rest = struct.pack("<QQQQ", size, _riegeli.hash64(body), type_and_count, decoded_size)
    write_logical(data, pos, struct.pack("<Q", _riegeli.hash64(rest)) + rest + body)


def simple_chunk(sizes: list[int], values: bytes) -> bytes:
    """An uncompressed simple chunk's data: compression 0, the sizes blob (a varint each), the values."""
    blob = b"".join(varint(s) for s in sizes)
    return b"\0" + varint(len(blob)) + blob + values


def footer(data: bytes) -> tuple[int, list[int], bytes]:
    """(footer_offset, record sizes, values) of an uncompressed file's footer chunk."""
    _, body = chunk_at(data, len(data) - BLOCK)
    offset = _postscript_offset(body)
    header, body = chunk_at(data, offset)
    assert body[0] == 0, "forge footers of uncompressed files only"
    blob_len, at = _read_varint(body, 1)
    sizes, i = [], at
    while i < at + blob_len:
        size, i = _read_varint(body, i)
        sizes.append(size)
    return offset, sizes, body[at + blob_len:]


def _postscript_offset(body: bytes) -> int:
    """footer_offset from the postscript chunk's data (uncompressed: 0, sizes blob, one message)."""
    at = 1
    blob_len, at = _read_varint(body, at)
    at += blob_len
    return parse_entry(body[at:])[1]


def footer_entries(values: bytes, sizes: list[int]) -> list[bytes]:
    """The footer's records: metadata first, then one ArrayRecordFooter message per chunk."""
    ends = np.cumsum(sizes).tolist()
    return [values[a:b] for a, b in zip([0] + ends[:-1], ends)]


def parse_entry(message: bytes) -> dict[int, int]:
    """An ArrayRecordFooter message's varint fields."""
    fields, i = {}, 0
    while i < len(message):
        key, i = _read_varint(message, i)
        fields[key >> 3], i = _read_varint(message, i)
    return fields


def entry(chunk_offset: int, decoded_size: int, num_records: int) -> bytes:
    """An ArrayRecordFooter message {1: chunk_offset, 2: decoded_data_size, 3: num_records}."""
    return b"\x08" + varint(chunk_offset) + b"\x10" + varint(decoded_size) + b"\x18" + varint(num_records)


def rewrite_footer(data: bytearray, records: list[bytes], sizes: list[int] | None = None) -> None:
    """Replaces the footer chunk's records (uncompressed), hashes recomputed; `sizes` overrides the sizes blob (e.g.
    sizes that wrap around 2^64 yet sum to the right total)."""
    offset, _, _ = footer(bytes(data))
    values = b"".join(records)
    sizes = [len(r) for r in records] if sizes is None else sizes
    body = simple_chunk(sizes, values)
    assert offset + CHUNK_HEADER + len(body) + 2 * BLOCK_HEADER < len(data) - BLOCK, "no room for the new footer"
    put_chunk(data, offset, body, num_records=len(sizes), decoded_size=len(values))
