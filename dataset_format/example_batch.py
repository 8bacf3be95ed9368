"""Parses a whole batch of `tf.train.Example` records at once, with NumPy, from the wire format.

Records written by one program share one layout: the same features in the same order, each with the
same kind and number of values. For such a batch each step of the parse (read a tag, a length, a key,
the values) is one NumPy operation over all the records at once, instead of a protobuf parse and
Python loops per record (`benchmarks/decode_bench.py` measures the two side by side).

    parse_examples([record, ...])  # {"label": int64 [N], "image": int64 [N, 64], "jpeg": [bytes] * N}

Keys come sorted. A feature with one value per record becomes a column of N values (a list for bytes), more values an
[N, width] array (object dtype for bytes). Anything else returns None: features that differ between
records (keys, order, kinds, widths), empty or unpacked numeric lists, unknown fields, and records
that are not valid Examples. The caller then decodes record by record, which handles every valid
Example and names the record that is not one.

Wire format (protobuf): Example{1: Features{1: repeated FeatureEntry{1: key, 2: Feature{1: BytesList,
2: FloatList, 3: Int64List}}}}; the lists hold `repeated value = 1`, packed for floats and ints.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

_LEN = 0x0A  # field 1, wire type 2 (length-delimited): Example.features, Features.feature, entry key, list values
_VALUE = 0x12  # field 2, wire type 2: FeatureEntry.value
_KIND_TAGS = {0x0A: "bytes", 0x12: "float", 0x1A: "int64"}  # Feature's oneof, fields 1-3
_PAD = bytes(16)  # lets a varint read run past the last record without an index check per byte
_MAX_BYTES_VALUES = 64  # bytes lists are walked value by value; longer ones go record by record


class _Irregular(Exception):
    """The batch is not one shared layout (or not valid): decode it record by record."""


def parse_examples(records: Sequence[bytes]) -> dict[str, Any] | None:
    """{feature: column of len(records)} for a batch sharing one layout; None otherwise (see module doc)."""
    if not records:
        return None
    try:
        return _Batch(records).parse()
    except _Irregular:
        return None


class _Batch:
    def __init__(self, records: Sequence[bytes]):
        self.n = len(records)
        lengths = np.fromiter(map(len, records), dtype=np.int64, count=self.n)
        self.ends = np.cumsum(lengths)
        self.pos = self.ends - lengths  # one cursor per record
        self.data = b"".join(itertools.chain(records, (_PAD,)))  # `join(...) + _PAD` copies twice: 10x slower
        self.buf = np.frombuffer(self.data, dtype=np.uint8)

    def parse(self) -> dict[str, Any]:
        self.tag(_LEN)
        features_end = self.length()
        if not np.array_equal(features_end, self.ends):  # an Example holds its features and nothing else
            raise _Irregular
        out = {}
        while not self.at(features_end):
            self.tag(_LEN)
            entry_end = self.length(within=features_end)
            key = self.key()
            if key in out:
                raise _Irregular  # a repeated map key (the last one wins): leave it to protobuf
            self.tag(_VALUE)
            if not np.array_equal(self.length(within=entry_end), entry_end):
                raise _Irregular
            kind = _KIND_TAGS.get(int(self.buf[self.pos[0]]))
            if kind is None:
                raise _Irregular
            self.tag(self.buf[self.pos[0]])
            list_end = self.length(within=entry_end)
            if not np.array_equal(list_end, entry_end):
                raise _Irregular
            out[key] = self.bytes_values(list_end) if kind == "bytes" else self.packed(kind, list_end)
        return dict(sorted(out.items()))  # as the other decoders: not the writer's map order

    # -- one step of the parse, on every record at once --------------------------------------

    def at(self, end: np.ndarray) -> bool:
        """True when every cursor is at `end`; all or none must be (else the layouts differ)."""
        done = self.pos >= end
        if done.all():
            return True
        if done.any():
            raise _Irregular
        return False

    def tag(self, tag: int) -> None:
        if not (self.buf[self.pos] == tag).all():
            raise _Irregular
        self.pos += 1

    def varint(self) -> np.ndarray:
        """The varint at each cursor (as uint64), moving the cursors past it."""
        b = self.buf[self.pos]
        if (b < 0x80).all():  # the common case: lengths and tags under 128
            self.pos += 1
            return b.astype(np.uint64)
        value = (b & 0x7F).astype(np.uint64)
        more = b >= 0x80
        self.pos += 1
        for shift in range(7, 70, 7):
            if not more.any():
                break
            b = self.buf[self.pos]
            value |= ((b & 0x7F).astype(np.uint64) << np.uint64(shift)) * more
            self.pos += more
            more &= b >= 0x80
        if more.any():
            raise _Irregular  # over 10 bytes: not a varint
        return value

    def length(self, within: np.ndarray | None = None) -> np.ndarray:
        """Reads a length prefix; returns where the field ends (checked to lie inside `within`)."""
        n = self.varint()
        end = self.pos + n.astype(np.int64)
        if (n > np.uint64(1 << 40)).any() or (end > (self.ends if within is None else within)).any():
            raise _Irregular  # truncated or corrupt
        return end

    def key(self) -> str:
        self.tag(_LEN)
        end = self.length()
        size = int(end[0] - self.pos[0])
        if not (end - self.pos == size).all():
            raise _Irregular
        rows = self.buf[self.pos[:, None] + np.arange(size)]
        if not (rows == rows[0]).all():
            raise _Irregular
        self.pos = end
        try:
            return rows[0].tobytes().decode()
        except UnicodeDecodeError:
            raise _Irregular from None

    def packed(self, kind: str, list_end: np.ndarray) -> np.ndarray:
        """A packed float or int64 list that fills the Feature: [N] for one value, else [N, width]."""
        if self.at(list_end):
            raise _Irregular  # empty lists: no width to stack
        self.tag(_LEN)
        end = self.length(within=list_end)
        if not np.array_equal(end, list_end):
            raise _Irregular  # more than one packed run, or unpacked values
        sizes = end - self.pos
        if kind == "float":
            size = int(sizes[0])
            if size % 4 or not (sizes == size).all():
                raise _Irregular
            values = self.buf[self.pos[:, None] + np.arange(size)].view("<f4").astype(np.float32, copy=False)
        else:
            values = self.varints(sizes)
        self.pos = end
        return values[:, 0] if values.shape[1] == 1 else values

    def varints(self, sizes: np.ndarray) -> np.ndarray:
        """The packed varints between each cursor and cursor + size, as int64 [N, width]."""
        size = int(sizes[0])
        region_starts = np.cumsum(sizes) - sizes  # where each record's values start in `b`
        if (sizes == size).all():
            b = self.buf[self.pos[:, None] + np.arange(size)].reshape(-1)
            if (b < 0x80).all():  # every value one byte (0-127): the bytes are the values
                return b.astype(np.int64).reshape(self.n, size)
        else:
            b = self.buf[np.arange(int(sizes.sum())) + np.repeat(self.pos - region_starts, sizes)]
        last = b < 0x80  # a varint's last byte
        if not last[region_starts + sizes - 1].all():
            raise _Irregular  # a varint runs past its list
        first = np.flatnonzero(np.concatenate(([True], last[:-1])))  # each varint's first byte
        per_record = np.diff(np.append(np.searchsorted(first, region_starts), len(first)))
        width = int(per_record[0])
        if not (per_record == width).all():
            raise _Irregular
        value = (b[first] & 0x7F).astype(np.uint64)
        longer = np.flatnonzero(~last[first])  # the varints with more bytes, shrinking byte by byte
        for shift in range(7, 70, 7):
            if not longer.size:
                break
            more = b[first[longer] + shift // 7]
            value[longer] |= (more & 0x7F).astype(np.uint64) << np.uint64(shift)
            longer = longer[more >= 0x80]
        if longer.size:
            raise _Irregular  # over 10 bytes: not a varint
        return value.view(np.int64).reshape(self.n, width)

    def bytes_values(self, list_end: np.ndarray) -> list | np.ndarray:
        """A BytesList: [bytes] * N for one value per record, else an object array [N, width]."""
        columns = []
        while not self.at(list_end):
            if len(columns) == _MAX_BYTES_VALUES:
                raise _Irregular
            self.tag(_LEN)
            end = self.length(within=list_end)
            data = self.data
            columns.append([data[s:e] for s, e in zip(self.pos.tolist(), end.tolist())])
            self.pos = end
        if not columns:
            raise _Irregular
        if len(columns) == 1:
            return columns[0]
        out = np.empty((self.n, len(columns)), dtype=object)
        for j, column in enumerate(columns):
            out[:, j] = column
        return out
