"""TFRecord framing: read and write without TensorFlow.

A TFRecord file is a sequence of frames::

    uint64 length (little endian)
    uint32 masked_crc32c(length bytes)
    byte   data[length]
    uint32 masked_crc32c(data)

Importing TensorFlow costs ~7 s per process; the framing needs only `struct` and
`google_crc32c`, so the conversion path never touches TensorFlow.

Reading streams: one frame is in memory at a time, whatever the file's size.

    with open_binary(path) as f:
        for record in iter_records(f, path=path):
            ...
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable, Iterator
from typing import BinaryIO

from dataset_format.sniff import is_array_record, is_text, masked_crc32c

_HEADER = struct.Struct("<QI")  # length, masked crc of the length bytes
_FOOTER = struct.Struct("<I")  # masked crc of the data
# A length field this large is not a real record (TFRecord writers cap well below):
# treat it as corruption instead of trying to read petabytes.
_MAX_RECORD_BYTES = 1 << 40
# How far a resynchronising scan looks for the next valid frame before giving up.
_RESYNC_WINDOW = 1 << 20


def encode_record(data: bytes) -> bytes:
    """One TFRecord frame for `data`."""
    length = struct.pack("<Q", len(data))
    return b"".join(
        (length, _FOOTER.pack(masked_crc32c(length)), data, _FOOTER.pack(masked_crc32c(data)))
    )


class CorruptRecordError(ValueError):
    """A TFRecord frame that fails its checks. Names the file, byte offset, record (its index in the file, counting
    from 0: the records before it read whole) and reason."""

    def __init__(self, path: str, offset: int, reason: str, record: int | None = None, message: str | None = None):
        self.path = path
        self.offset = offset
        self.reason = reason
        self.record = record
        where = f"byte offset {offset}" + (f", record {record}" if record is not None else "")
        super().__init__(message or (
            f"{path}: corrupt TFRecord at {where}: {reason}. "
            "Re-create or re-copy this shard, or pass --skip-corrupt to convert the "
            "readable records and list the corrupt ones in the report."))


class CompressedStreamError(CorruptRecordError):
    """A compressed input (named .gz, .zlib, ...) whose stream does not decompress: damaged, cut short, or not
    compressed the way its name says. Fails the shard even with --skip-corrupt: nothing after the damage can be
    found again in a compressed stream."""

    def __init__(self, path: str, offset: int, reason: str, compression: str, cut: bool = False):
        # (a stream that gave data, or ended early, is compressed as named: damaged or cut short, not misnamed)
        misnamed = "" if offset or cut else (f"; a file that is not {compression}-compressed needs a name without "
                                             "its suffix (the suffix says how it is read)")
        super().__init__(path, offset, reason, message=(
            f"{path}: its {compression} stream does not decompress after {offset:,} bytes of TFRecord data: {reason}. "
            f"Re-create or re-copy this shard{misnamed}"))


class NotTFRecordError(CorruptRecordError):
    """A file that begins with text (JSON lines, CSV, plain text) where a TFRecord frame header should be: not a
    damaged TFRecord (12 printable bytes are never a valid header: the length would be over 2 PB) but another format.
    Fails the shard even with --skip-corrupt, which would otherwise keep none of its records."""

    def __init__(self, path: str, head: bytes):
        if is_array_record(head):  # a converted shard given back as input (a glob over an output directory)
            super().__init__(path, 0, "an ArrayRecord file where a TFRecord file should be", message=(
                f"{path} is an ArrayRecord file (converted already), not a TFRecord file: convert and `pipelines "
                "tokenizer` read the TFRecord sources, so pass those as --input; the loader and `python -m "
                "trainer.tokenizer` read converted data"))
            return
        super().__init__(path, 0, "text where a TFRecord header should be", message=(
            f"{path} is not a TFRecord file: it begins with text ({head.decode('ascii')!r}...); convert reads TFRecord "
            "files of tf.train.Example records: write the data as such (e.g. with tf.io.TFRecordWriter, one "
            "Example a line or document) and convert those"))


@dataclasses.dataclass(frozen=True)
class Corruption:
    """A corrupt region that `iter_records(on_corrupt=...)` skipped."""

    offset: int  # byte offset where the bad frame starts
    length: int  # bytes skipped (the whole frame, or up to the next valid frame / EOF)
    reason: str
    records_before: int = 0  # the records read (yielded) before it: a later record's place among those read


def iter_records(
    f: BinaryIO,
    *,
    path: str,
    on_corrupt: Callable[[Corruption], None] | None = None,
) -> Iterator[bytes]:
    """Yields each record's bytes in file order.

    Raises CorruptRecordError at the first bad frame unless `on_corrupt` is given; then
    each bad frame (data CRC mismatch) or unreadable region (bad length CRC: scanned
    forward to the next frame whose header and data both check; truncated tail) is
    passed to `on_corrupt` and reading goes on.
    """
    offset = index = 0  # index: the frame's place in the file (what an error names; not kept past a resync)
    good = 0  # the records yielded
    while True:
        header = f.read(_HEADER.size)
        if not header:
            return
        if len(header) < _HEADER.size:
            _report(path, Corruption(offset, len(header),
                                     f"truncated header: {len(header)} of 12 bytes before end of file", good),
                    on_corrupt, index)
            return
        length, length_crc = _HEADER.unpack(header)
        length_ok = length_crc == masked_crc32c(header[:8])
        if not length_ok and offset == 0 and (is_text(header) or is_array_record(header)):
            raise NotTFRecordError(path, header)
        if not length_ok or length > _MAX_RECORD_BYTES:
            reason = "length CRC mismatch" if not length_ok else f"implausible record length {length}"
            if on_corrupt is None:
                raise CorruptRecordError(path, offset, reason, index)
            skipped = _resync(f, offset)
            on_corrupt(Corruption(offset, skipped, f"{reason}; skipped {skipped} bytes to the next valid record", good))
            offset += skipped
            continue
        data = f.read(length)
        footer = f.read(_FOOTER.size)
        if len(data) < length or len(footer) < _FOOTER.size:
            got = len(header) + len(data) + len(footer)
            _report(path, Corruption(offset, got,
                                     f"truncated record: frame needs {length + 16} bytes, file ends after {got}", good),
                    on_corrupt, index)
            return
        if _FOOTER.unpack(footer)[0] == masked_crc32c(data):
            yield data
            good += 1
        else:
            _report(path, Corruption(offset, length + 16, f"data CRC mismatch in a {length}-byte record", good),
                    on_corrupt, index)
        offset += length + 16
        index += 1


def _report(path: str, corruption: Corruption, on_corrupt: Callable[[Corruption], None] | None,
            index: int) -> None:
    """Raises for `corruption`, or hands it to `on_corrupt` when skipping is on."""
    if on_corrupt is None:
        raise CorruptRecordError(path, corruption.offset, corruption.reason, index)
    on_corrupt(corruption)


def _resync(f: BinaryIO, bad_offset: int) -> int:
    """Seeks `f` to the next offset after `bad_offset` where a whole valid frame starts.

    Returns the number of bytes skipped; at end of file, the bytes to the end.
    A false match needs a 32-bit header CRC and a 32-bit data CRC to agree by chance.
    """
    start = bad_offset + 1
    while True:
        f.seek(start)
        window = f.read(_RESYNC_WINDOW + _HEADER.size)
        if len(window) < _HEADER.size:
            f.seek(0, 2)
            end = f.tell()
            f.seek(end)
            return end - bad_offset
        for i in range(len(window) - _HEADER.size + 1):
            length, crc = _HEADER.unpack_from(window, i)
            if length > _MAX_RECORD_BYTES or crc != masked_crc32c(window[i:i + 8]):
                continue
            f.seek(start + i + _HEADER.size)
            data = f.read(length)
            footer = f.read(_FOOTER.size)
            if len(data) == length and len(footer) == 4 and _FOOTER.unpack(footer)[0] == masked_crc32c(data):
                f.seek(start + i)
                return start + i - bad_offset
        start += len(window) - _HEADER.size + 1


def write_records(f: BinaryIO, records) -> int:
    """Writes each record of `records` as a TFRecord frame; returns the count."""
    n = 0
    for record in records:
        f.write(encode_record(record))
        n += 1
    return n
