"""The compact record index: where each record's chunk lies, for every shard of a source, in one file that all
processes on a host memory-map (the main process and every grain worker share its pages).

ArrayRecord's own reader keeps a `uint64` offset per record in each open reader of each process (8 bytes a
record, 37 per host with two workers). This file keeps, per shard, the chunk offsets (and the end of the last
chunk) in an Elias-Fano code: each offset's low `l` bits packed end to end (l = floor(log2(file size / records))),
its high part in unary in a bit vector of about 2 bits a record, and the position of every STRIDE-th high bit.
l + 2 to l + 3 bits a record: ~1.5 bytes for records of ~1 KB, under 2 bytes up to ~7 KB, ~1 byte for tiny ones, 3
bytes for records of several MB.
A lookup starts at the sample at or before the record and counts set bits forward (loader/format/_riegeli.c `locate`).

Layout (little-endian; every section 8-byte aligned):

    header   8 x u64: magic, version, num_shards, stride, info_at, trailer_at, trailer_len, file_hash (a HighwayHash of
             the seven words before it and of the HighwayHash of everything after the header)
    shards   per shard: u64 samples, u64 words of high bits, u64 words of low bits
    info     int64 [num_shards, 6]: samples at, highs at, lows at (offsets in u64 words), l, values (records + 1;
             0: a shard left to ArrayRecord's reader), STRIDE
    trailer  JSON: {"key": ..., "fallback": {shard: reason}}

Built once per source (from each shard's footer, one shard at a time per thread, never the whole dataset in
memory) into a cache directory, named by a hash of the shards' paths, sizes and versions (locally inode, change and
modification times; on gs:// the object generation: loader/format/source.py), so a changed or replaced shard gets a new
index and a rerun reuses the old one. The file is written under a temporary name and renamed; when it is opened its
header is checked against the file's size and the whole file against the hash in its header (15 ms for the 150 MB
index of 100M 1 KB records, AVX2), so a damaged index is noticed and rebuilt (one log line), never trusted. The hash
finds damage; a file crafted with a matching hash is kept out by ownership: an index not owned by this user, or
writable by others, is rebuilt too (`_check_owner`). `locate` checks every word it
reads lies in its shard's section, and the reader checks the spans it gets lie within their shard.

    index = RecordIndex.for_source(source)      # builds on first use (logged), then maps the file
    begins, ends = index.locate(shards, local_indices)
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import mmap
import os
import tempfile
import time

import numpy as np

from dataset_format import storage
from dataset_format.manifest import redo
from loader.format import _riegeli
from loader.format.arrayrecord import Footer, read_footer
from loader.format.source import ShardedSource

log = logging.getLogger(__name__)

MAGIC = int.from_bytes(b"ARIDX\x00\x00\x01", "little")
VERSION = 3
STRIDE = 1024  # records between samples: 8 B / 1024 = 0.008 B a record; a lookup counts < 1024 set bits
HEADER = 64
BUILD_THREADS = 16  # footers read at once (I/O and decoding release the GIL)
WINDOW = 256  # shards in flight while building: bounds the footers held in memory
ENV_DIR = "LOADER_INDEX_DIR"


def default_dir() -> str:
    """Where indexes are cached: $LOADER_INDEX_DIR, else ~/.cache/arrayrecord-platform/index."""
    return os.environ.get(ENV_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "arrayrecord-platform", "index")


def source_key(source: ShardedSource) -> str:
    """A hash of what the index depends on: each shard's path, size and modification time (or generation)."""
    # "loader.index" is the hash's domain, not a module path (renaming it would rebuild every cached index).
    h = hashlib.sha256(f"loader.index:{VERSION}:{STRIDE}".encode())
    h.update("\n".join(source.paths).encode())  # whole columns at once: 100,000 shards hash in ~10 ms
    for column in (source.shard_bytes, source.shard_versions):
        h.update(b"\0" + np.asarray(column or (), dtype="<i8").tobytes())
    return h.hexdigest()[:40]


def _shard_code(footer: Footer) -> tuple[int, int, bytes, bytes, bytes]:
    """(l, values, samples, highs, lows): the Elias-Fano code of the shard's chunk offsets and its end."""
    values = np.append(footer.offsets.astype("<u8"), np.uint64(footer.footer_offset))
    low_bits, samples, highs, lows = _riegeli.ef_encode(values, STRIDE)
    return low_bits, len(values), samples, highs, lows


class DamagedIndex(ValueError):
    """An index file that fails its checks (a flipped bit, a truncated or foreign file): rebuild it."""


class RecordIndex:
    """A memory-mapped index file (see module doc). Picklable: a copy maps the same file."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file
                raise DamagedIndex(f"{path} is empty") from None
        self._check_and_map()

    def _check_and_map(self) -> None:
        size = len(self._map)
        if size < HEADER:
            raise DamagedIndex(f"{self.path} is {size} bytes, not a whole index")
        header = np.frombuffer(self._map, dtype="<u8", count=8)
        if int(header[0]) != MAGIC or int(header[1]) != VERSION:
            raise DamagedIndex(f"{self.path} is not a loader index of version {VERSION}")
        num_shards, info_at, trailer_at, trailer_len = (int(header[i]) for i in (2, 4, 5, 6))
        if not (HEADER <= info_at and info_at % 8 == 0 and num_shards <= (size - info_at) // 48
                and info_at + 48 * num_shards <= trailer_at and trailer_len == size - trailer_at):
            raise DamagedIndex(f"{self.path}: its header's section offsets and sizes do not fit a file of "
                               f"{size:,} bytes")
        if _file_hash(self._map) != int(header[7]):
            raise DamagedIndex(f"{self.path} does not match its hash")
        self.info = np.frombuffer(self._map, dtype="<i8", count=6 * num_shards, offset=info_at).reshape(-1, 6)
        try:
            trailer = json.loads(self._map[trailer_at:trailer_at + trailer_len])
            self.key = trailer["key"]
            self.fallback = {int(shard): reason for shard, reason in trailer["fallback"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise DamagedIndex(f"{self.path} has a trailer that does not parse ({e})") from None
        if any(not 0 <= shard < num_shards for shard in self.fallback):
            raise DamagedIndex(f"{self.path} names shards it does not have")
        self._all = np.frombuffer(self._map, dtype="<u8", count=size // 8)

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])

    def __len__(self) -> int:
        return len(self.info)

    def locate(self, shards: np.ndarray, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """File spans [begin, end) of the chunks of records `local` of `shards` (int64 arrays; shards that are not
        in `fallback`). Fastest with each shard's records together and ascending."""
        begins = np.empty(len(shards), dtype=np.int64)
        ends = np.empty(len(shards), dtype=np.int64)
        _riegeli.locate(self._all, self.info, np.ascontiguousarray(shards, dtype=np.int64),
                        np.ascontiguousarray(local, dtype=np.int64), begins, ends)
        return begins, ends

    @classmethod
    def for_source(cls, source: ShardedSource, directory: str | None = None) -> RecordIndex:
        """The index of `source`, built into `directory` (default: default_dir()) if it is not there yet, or rebuilt
        (with one log line) if the file there is damaged."""
        directory = directory or default_dir()
        key = source_key(source)
        path = os.path.join(directory, f"{key}.idx")
        if not os.path.exists(path):
            build(source, path, key)
            return cls(path)
        try:
            _check_owner(path)
            index = cls(path)
            if index.key != key or len(index) != len(source.paths):
                raise DamagedIndex(f"{path} is the index of another source")
            return index
        except DamagedIndex as e:
            log.warning("%s; the index is rebuilt", e)
            build(source, path, key)
            return cls(path)


def _check_owner(path: str) -> None:
    """An index is trusted as this user's own file: its hash finds damage, not a file crafted with a hash to match. One
    that another user could have written (owned by someone else, or writable by group or others: a cache directory
    shared between accounts) is DamagedIndex, and rebuilt."""
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise DamagedIndex(f"{path} is not this user's own file (owner uid {st.st_uid}, mode {st.st_mode & 0o777:o}), "
                           "so another account could have written it")


def build(source: ShardedSource, path: str, key: str) -> None:
    """Writes the index of `source` to `path` (under a temporary name, then renamed: concurrent builders on one
    host each write a whole file, the last rename wins). Raises ValueError naming the shard whose footer is bad or
    whose record count disagrees with the source's metadata."""
    started = time.monotonic()
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    sizes = source.shard_bytes or (None,) * len(source.paths)
    fallback: dict[str, str] = {}
    info = np.zeros((len(source.paths), 6), dtype="<i8")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".idx")
    try:
        with os.fdopen(fd, "wb") as out, concurrent.futures.ThreadPoolExecutor(BUILD_THREADS) as pool:
            out.write(b"\0" * HEADER)
            at, last_log = HEADER, started
            for window in range(0, len(source.paths), WINDOW):
                shards = range(window, min(window + WINDOW, len(source.paths)))
                footers = pool.map(lambda s: _footer(source, s, sizes[s]), shards)
                for shard, footer in zip(shards, footers):
                    if footer.fallback_reason:
                        fallback[str(shard)] = footer.fallback_reason
                        info[shard] = (0, 0, 0, 0, 0, STRIDE)
                        continue
                    try:
                        low_bits, count, samples, highs, lows = _shard_code(footer)
                    except ValueError as e:
                        raise ValueError(f"{source.paths[shard]}: its footer is damaged ({e}); re-run the "
                                         "conversion") from None
                    info[shard] = (at // 8, (at + len(samples)) // 8, (at + len(samples) + len(highs)) // 8,
                                   low_bits, count, STRIDE)
                    out.write(samples + highs + lows)  # each a whole number of u64 words
                    at += len(samples) + len(highs) + len(lows)
                if time.monotonic() - last_log > 10:
                    last_log = time.monotonic()
                    log.info("indexing %d shards: %d done (%.0f s)", len(source.paths), shards.stop,
                             last_log - started)
            info_at = at
            at += _write_aligned(out, info)
            trailer = json.dumps({"key": key, "fallback": fallback}).encode()
            out.write(trailer)
            out.seek(0)
            out.write(np.array([MAGIC, VERSION, len(source.paths), STRIDE, info_at, at, len(trailer), 0],
                               dtype="<u8").tobytes())
            out.flush()
            with open(tmp, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as written:
                file_hash = _file_hash(written)
            out.seek(7 * 8)
            out.write(np.array([file_hash], dtype="<u8").tobytes())
        os.replace(tmp, path)  # (no fsync: a file a crash left torn fails its hash when opened, and is rebuilt)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    for shard, reason in sorted(fallback.items(), key=lambda kv: int(kv[0])):
        log.info("%s: read through ArrayRecord's reader (%s)", source.paths[int(shard)], reason)
    log.info("indexed %d shards (%d records) in %.2f s: %s (%.1f MB)", len(source.paths), sum(source.records_in_files),
             time.monotonic() - started, path, os.path.getsize(path) / 1e6)


def _footer(source: ShardedSource, shard: int, size: int | None) -> Footer:
    path = source.paths[shard]
    if size is None:
        size = storage.list_sizes(path.rsplit("/", 1)[0]).get(storage.basename(path))
        if size is None:
            raise FileNotFoundError(f"{path} does not exist; re-run the conversion or restage the data")
    footer = read_footer(path, size, source.shard_versions[shard] if source.shard_versions and storage.is_remote(path)
                         else None)
    if footer.num_records != source.records_in_files[shard]:
        raise ValueError(f"{path} holds {footer.num_records} records but the dataset's metadata says "
                         f"{source.records_in_files[shard]}; the shard was replaced or the metadata is stale: "
                         f"{redo(path)}")
    return footer


def _file_hash(data) -> int:
    """The index file's check: a HighwayHash of its header's first seven words and of the hash of its body."""
    view = memoryview(data)
    body = _riegeli.hash64(view[HEADER:]).to_bytes(8, "little")
    return _riegeli.hash64(bytes(view[:HEADER - 8]) + body)


def _write_aligned(out, array: np.ndarray) -> int:
    """Writes `array`, padded to a multiple of 8 bytes; returns the bytes written."""
    data = array.tobytes()
    pad = -len(data) % 8
    out.write(data + b"\0" * pad)
    return len(data) + pad
