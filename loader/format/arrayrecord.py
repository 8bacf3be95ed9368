"""An ArrayRecord file's footer: where each record's chunk is, read without ArrayRecord's reader.

The layout (array_record's `cpp/layout.proto` and `array_record_writer.cc`; riegeli's
`doc/riegeli_records_file_format.md`), for files written with `group_size:1` (one record per chunk):

    64 KiB blocks, each starting with a 24-byte block header
    [signature chunk at 0] [chunk of record 0 at 64] [chunk of record 1] ... [footer chunk] [postscript chunk]
    footer chunk:     a simple chunk of records: RiegeliFooterMetadata{array_record_metadata{version,
                      num_chunks, num_records, writer_options}}, then one ArrayRecordFooter{chunk_offset,
                      decoded_data_size, num_records} per data chunk; compressed like the data
    postscript chunk: at the start of the last 64 KiB block, uncompressed: RiegeliPostscript{footer_offset,
                      magic = 0x71930e704fdae05e}

A record's chunk ends where the next begins (the last one where the footer begins). The chunks themselves are
decoded by the C extension (loader/format/_riegeli.c), which checks riegeli's hashes.

Nothing in a footer is trusted (its hashes can be recomputed by anyone): its chunk offsets must increase from the
first data chunk (64) to the footer, each entry's record count must agree with the writer's group_size and the
counts add up to the metadata's record count. A file that fails is refused by name before ArrayRecord's own reader
(the fallback for chunks of several records, transposed or brotli chunks) ever sees it.

    footer = read_footer("/data/x.array_record-00000-of-00008")
    footer.offsets[:3]           # chunk offsets of records 0..2 (uint64)
    footer.fallback_reason       # None, or why this reader leaves the file to ArrayRecord's
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dataset_format import sniff, storage
from dataset_format.wire import varint
from loader.format import _riegeli

BLOCK_SIZE = 1 << 16
MAGIC = 0x71930E704FDAE05E


FIRST_CHUNK = 64  # the file signature (a 24-byte block header and a 40-byte chunk header) comes first: no chunk before
MIN_CHUNK = 40  # a chunk header: no chunk is shorter


@dataclasses.dataclass(frozen=True)
class Footer:
    offsets: np.ndarray  # uint64, the chunk offset of each chunk (of each record with group_size:1)
    counts: np.ndarray  # uint64, the records in each chunk
    footer_offset: int  # where the last chunk ends
    writer_options: str
    fallback_reason: str | None  # why our reader cannot read this file (ArrayRecord's reader is used instead)

    @property
    def num_records(self) -> int:
        return int(self.counts.sum())


def _fields(message: bytes) -> dict[int, int | bytes]:
    """The varint and length-delimited fields of a protobuf message (last one wins), enough for these messages."""
    fields: dict[int, int | bytes] = {}
    at = 0
    while at < len(message):
        key, at = varint(message, at)
        if key & 7 == 0:
            fields[key >> 3], at = varint(message, at)
        elif key & 7 == 2:
            size, at = varint(message, at)
            fields[key >> 3], at = message[at:at + size], at + size
        else:
            raise ValueError(f"unexpected protobuf wire type {key & 7}")
    return fields


def _records(chunk: bytes, position: int) -> list[bytes]:
    sizes, values = _riegeli.decode_chunk(chunk, position, True, len(chunk))  # (a record takes at least a byte)
    ends = np.cumsum(np.frombuffer(sizes, dtype="<u8")).tolist()
    return [values[start:end] for start, end in zip([0] + ends[:-1], ends)]


class TFRecordFileError(ValueError):
    """A file read as ArrayRecord that is a TFRecord file (not converted yet)."""


def read_footer(path: str, size: int, generation: int | None = None) -> Footer:
    """The chunk offsets of the ArrayRecord file of `size` bytes at `path` (local or gs://), from two reads at its
    end. Raises ValueError naming the file when it is not a whole ArrayRecord file (truncated, not ArrayRecord).
    `generation`: a gs:// object's as listed (storage.ObjectChanged when it is another by now).
    """
    try:
        if size < 2 * BLOCK_SIZE or size % BLOCK_SIZE:
            raise ValueError(f"its size, {size:,} bytes, is not a whole number of 64 KiB blocks, or under "
                             "the two blocks a file has at least")
        last = size - BLOCK_SIZE
        postscript = _fields(_records(storage.read_range(path, last, size, generation=generation), last)[0])
        if postscript.get(2) != MAGIC or not isinstance(postscript.get(1), int) or not 0 < postscript[1] < last:
            raise ValueError("its last block holds no ArrayRecord postscript")
        footer_offset = postscript[1]
        # a footer record per chunk (and the metadata): each chunk takes at least MIN_CHUNK bytes before the footer
        most = (footer_offset - FIRST_CHUNK) // MIN_CHUNK + 1
        try:
            sizes, values = _riegeli.decode_chunk(storage.read_range(path, footer_offset, last, generation=generation),
                                                 footer_offset, True, most)
        except _riegeli.UnsupportedError as e:  # the footer compressed as the records are (brotli; zstd, no libzstd)
            return _theirs(path, footer_offset, _reason(e))
        first = int(np.frombuffer(sizes, dtype="<u8", count=1)[0]) if sizes else 0
        metadata = _fields(_fields(values[:first]).get(1, b""))
        options = metadata.get(4, b"").decode("utf-8", "replace") if isinstance(metadata.get(4), bytes) else ""
        settings = _settings(options)
        group = settings.get("group_size", "")
        group = min(int(group), 1 << 62) if group.isdigit() else 0  # (0: not said; the checks then skip it)
        offsets, counts, total = _riegeli.footer_offsets(sizes, values, footer_offset, group)
        del sizes, values
        offsets, counts = np.frombuffer(offsets, dtype="<u8"), np.frombuffer(counts, dtype="<u8")
        if isinstance(metadata.get(3), int) and metadata[3] != total:
            raise ValueError(f"footer record counts that add up to {total}, not the {metadata[3]} of its metadata")
        if isinstance(metadata.get(2), int) and metadata[2] != len(counts):
            raise ValueError(f"{len(counts)} footer entries, not the {metadata[2]} chunks of its metadata")
    except (ValueError, _riegeli.CorruptError, _riegeli.UnsupportedError) as e:
        head = _head(path, size)
        if sniff.is_tfrecord_header(head, size):
            raise TFRecordFileError(f"{path} is a TFRecord file, not ArrayRecord: convert it first (python -m pipelines "
                             f"convert --input {path} --output DIR), then load DIR") from None
        if sniff.is_text(head):
            raise ValueError(f"{path} is not an ArrayRecord file: it begins with text ({head.decode('ascii')!r}...); "
                             "write the data as TFRecord files of tf.train.Example records, convert them (python -m "
                             "pipelines convert --input ... --output DIR), then load DIR") from None
        raise ValueError(f"{path} is not a whole ArrayRecord file ({_reason(e)}); it is truncated or damaged: re-run "
                         "the conversion or restage the data") from e
    return Footer(offsets, counts, footer_offset, options, _fallback_reason(settings, total == len(counts)))


def _head(path: str, size: int) -> bytes:
    """The file's first 12 bytes (fewer for a smaller file; none where they cannot be read)."""
    try:
        return storage.read_range(path, 0, min(sniff.HEAD_BYTES, size))
    except OSError:
        return b""




def _theirs(path: str, footer_offset: int, why: str) -> Footer:
    """A file whose footer our reader does not decode: its record count and options from ArrayRecord's reader, which
    reads it (Footer.fallback_reason says why; it has no chunk offsets of ours)."""
    from array_record.python.array_record_module import ArrayRecordReader

    try:
        reader = ArrayRecordReader(path, "readahead_buffer_size:0,max_parallelism:0")
        try:
            records, options = reader.num_records(), reader.writer_options_string()
        finally:
            reader.close()
    except RuntimeError as e:  # (riegeli's errors)
        lines = str(e).strip().splitlines()
        raise ValueError(f"{path} is not a whole ArrayRecord file ({lines[0] if lines else why}); it is truncated or "
                         "damaged: re-run the conversion or restage the data") from None
    settings = _settings(options)
    return Footer(np.zeros(0, "<u8"), np.array([records], "<u8"), footer_offset, options,
                  _fallback_reason(settings, settings.get("group_size") == "1") or why)


def _settings(options: str) -> dict[str, str]:
    return dict(part.partition(":")[::2] for part in options.split(",") if part)


def _reason(e: Exception) -> str:
    return e.args[0] if isinstance(e, (_riegeli.CorruptError, _riegeli.UnsupportedError)) else str(e)


def _fallback_reason(settings: dict[str, str], single: bool) -> str | None:
    """Why this file goes to ArrayRecord's reader, or None: it reads simple chunks of one record, stored
    uncompressed or with snappy or zstd (zstd through the system's libzstd.so.1)."""
    if not single:
        return f"chunks of several records (group_size:{settings.get('group_size', '?')})"
    if settings.get("transpose") == "true":
        return "transposed chunks"
    if "brotli" in settings:
        return "brotli compression"
    if "zstd" in settings and not _riegeli.HAS_ZSTD:
        return "zstd compression and no libzstd.so.1 on this machine"
    return None
