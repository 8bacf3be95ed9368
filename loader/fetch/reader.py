"""Batched random reads from a sharded ArrayRecord dataset: the records at a read group's global indices.

One path for every run length. The indices are sorted (which groups them by shard, ascending within it), the
compact index (loader/format/index.py) gives each record's chunk span, and the C extension (loader/format/_riegeli.c)
reads the spans: chunks of one file less than `max_gap` bytes apart come in one `pread`, block headers are removed,
riegeli's hashes are checked, and the records are decompressed (snappy, zstd or none) straight into the bytes objects
returned, all with the GIL released, so the loader's threads read in parallel. On gs:// the same spans become range
requests, up to 128 in flight a process (loader/fetch/remote.py), through an optional bounded cache of chunks
(`cache_bytes`).

Files our reader does not decode (group_size > 1, transposed chunks, brotli) are read through ArrayRecord's
reader; building the index logs one line for each.

    reader = BatchReader(loader.resolve("out/"))
    reader(np.array([7, 3, 7]))     # [record 7, record 3, record 7]
"""

from __future__ import annotations

import hashlib
import logging
import os
import resource
import threading

import numpy as np

from dataset_format import storage
from dataset_format.manifest import redo
from loader.fetch import chunk_cache, disk_cache, remote
from loader.format import _riegeli
from loader.format.arrayrecord import FIRST_CHUNK
from loader.format.index import RecordIndex, source_key
from loader.format.source import ShardedSource

log = logging.getLogger(__name__)
# Chunks closer than this are read in one pread (the bytes between are read and dropped). Measured on 1 KB records
# (docs/benchmarks.md): 0 and 2 KiB alike, 4 KiB 5-15% and 8 KiB 15-40% slower, where the gaps copied cost more than
# the syscalls saved.
LOCAL_GAP = 2 << 10
# On gs:// a request costs a round trip (~10-50 ms) and every byte costs bandwidth. Two chunks' ranges are merged into
# one request when the gap between them is at most REMOTE_GAP (what a link of ~100 MB/s moves in the ~2.5 ms a
# request costs with 8 in flight: reading the gap is cheaper than asking again) and the merged request reads at most
# REMOTE_WASTE percent more bytes than its records hold (so a read downloads at most 1.5x the bytes it serves: spans
# merged by gap alone spanned whole shards of small records, 40-55x the bytes served).
REMOTE_GAP = 256 << 10
REMOTE_WASTE = 50
# The largest record read by default. Every record's size is checked against it before it is allocated, so a damaged
# or crafted chunk cannot make a read allocate what the file does not hold (a decompression bomb); real records
# (tf.Examples, images, documents) are far smaller. loader.load(max_record_bytes=) raises it.
MAX_RECORD_BYTES = 256 << 20


def _open_limit() -> int:
    """Files kept open: half the process's descriptor limit, at most 4096 (the rest are opened per read)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, min(4096, (soft if soft != resource.RLIM_INFINITY else 8192) // 2))


class BatchReader:
    """`reader(indices)` -> the records at those global indices, in that order. Picklable (a copy reopens files)."""

    def __init__(self, source: ShardedSource, *, check_hashes: bool = True, cache_bytes: int = 0,
                 cache_dir: str | None = None, index: RecordIndex | None = None,
                 max_record_bytes: int = MAX_RECORD_BYTES, planned: bool = False):
        """`check_hashes`: check riegeli's chunk hashes (a flipped byte is then an error, never a wrong record).
        `cache_bytes`: on gs://, keep up to this many bytes of chunks, the first read (0: none): in memory, or in
        `cache_dir` on local disk (shared by the host's processes, kept across runs: loader/fetch/disk_cache.py).
        `planned`: the memory cache keeps the chunks this host reads again soonest (loader/fetch/planned_cache.py), as
        each read's `next_reads` say, instead of the first read (multi-host jobs).
        `max_record_bytes`: a larger record is an error naming it (checked before anything is allocated for it)."""
        self._paths = source.paths
        self._starts = source.starts
        self._first = source.first_records  # a slice's first record of each shard's file (zeros: whole shards)
        # Caches name a record by its number among all the shards' records, a slice's (split="train[:99%]") as the
        # whole source's: one disk cache serves the whole and each slice of it.
        self._file_starts = source.file_starts
        self._total = len(source)
        self._check = check_hashes
        self._cache_bytes = cache_bytes
        self._max_record = max_record_bytes
        self._remote = any(storage.is_remote(p) for p in source.paths)
        # gs:// objects' generations as listed (the index and caches are of them): a read pins them
        self._generations = (source.shard_versions if self._remote and source.shard_versions
                             and all(storage.is_remote(p) for p in source.paths) else None)
        self._disk = None
        if cache_dir is not None and self._remote:
            self._disk = {"directory": os.path.expanduser(cache_dir), "key": source_key(source),
                          "capacity": cache_bytes, "mean_chunk": source.mean_record_bytes,
                          "records": sum(source.records_in_files),
                          "dataset": hashlib.sha256("\n".join(source.paths).encode()).hexdigest()[:32]}
        # where each shard ends: no span from the index may pass it (-1: unknown)
        self._ends = np.asarray(source.shard_bytes if source.shard_bytes else [-1] * len(source.paths),
                                dtype=np.int64)
        self._index = index or RecordIndex.for_source(source)
        self._fallback = np.zeros(len(source.paths), dtype=bool)
        self._fallback[list(self._index.fallback)] = True
        self._planned = planned and self._remote and bool(cache_bytes) and self._disk is None
        # What a copy (a worker's) is made of: every field set above; what _setup() makes is made again in the copy.
        self._state = tuple(vars(self))
        self._setup()

    def _setup(self) -> None:
        self._lock = threading.Lock()
        self._fds = np.full(len(self._paths), -1, dtype=np.int64)
        self._open_count = 0
        self._limit = _open_limit()
        self._array_readers: dict[int, object] = {}
        self._remote_reader = (_RemoteSpans(self._paths, self._cache_bytes, self._disk, self._planned,
                                            self._generations) if self._remote else None)

    def __getstate__(self):
        return {name: getattr(self, name) for name in (*self._state, "_state")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._setup()

    def close(self) -> None:
        """Closes the files it holds open (a later read opens them again)."""
        with self._lock:
            fds, self._fds = self._fds, np.full(len(self._paths), -1, dtype=np.int64)
            self._open_count = 0
            readers, self._array_readers = self._array_readers, {}
        for fd in fds.tolist():
            if fd >= 0:
                os.close(fd)
        for reader in readers.values():
            reader.close()

    def __del__(self):
        fds = getattr(self, "_fds", None)
        for fd in fds.tolist() if fds is not None else ():
            if fd >= 0:
                os.close(fd)

    @property
    def wants_next_reads(self) -> bool:
        """Whether reads should say when this host reads each record next (a planned cache)."""
        return self._planned

    def __call__(self, indices: np.ndarray, next_reads: np.ndarray | None = None, now: int = 0) -> list[bytes]:
        """The records at global `indices`, in that order (duplicates allowed). With a planned cache, `next_reads`
        gives the stream position of each record's next read on this host, and `now` this read's position."""
        indices = np.asarray(indices, dtype=np.int64)
        order = np.argsort(indices, kind="stable")
        sorted_indices = indices[order]
        plan = None
        if next_reads is not None and self._planned:
            plan = (np.asarray(next_reads, dtype=np.int64)[order], now)
        shards = np.searchsorted(self._starts, sorted_indices, side="right") - 1
        local = sorted_indices - self._starts[shards] + self._first[shards]  # the record of the shard's file
        records = np.empty(len(indices), dtype=object)
        fallback = self._fallback[shards]
        ours = ~fallback
        if ours.all():
            records[order] = self._read(shards, local, plan)
        else:
            records[order[ours]] = self._read(shards[ours], local[ours], plan and (plan[0][ours], plan[1]))
            records[order[fallback]] = self._read_fallback(shards[fallback], local[fallback])
        return records.tolist()

    def _read(self, shards: np.ndarray, local: np.ndarray, plan: tuple | None = None) -> list[bytes]:
        if not len(shards):
            return []
        try:
            begins, ends = self._index.locate(shards, local)
        except _riegeli.CorruptError:
            raise OSError(f"the index {self._index.path} changed while it was in use and is damaged; delete it (the "
                          "next load rebuilds it)") from None
        limits = self._ends[shards]
        outside = np.flatnonzero((begins < FIRST_CHUNK) | (ends <= begins) | ((limits >= 0) & (ends > limits)))
        if len(outside):  # cannot be, with the index's hash checked: the index changed under this process
            i = int(outside[0])
            raise OSError(f"{self._paths[int(shards[i])]}: the index {self._index.path} places record {int(local[i])} "
                          f"at bytes {int(begins[i])}..{int(ends[i])}, outside the file; delete the index (the next "
                          "load rebuilds it)")
        try:
            if self._remote:
                return self._remote_reader.read(shards, begins, ends, self._check, self._max_record,
                                                self._file_starts[shards] + local, plan)
            fds, temporary = self._fds_for(shards)
            try:
                return _riegeli.read(fds, begins, ends, self._check, LOCAL_GAP, self._max_record)
            finally:
                for fd in temporary:
                    os.close(fd)
        except _riegeli.TooLargeError as e:
            why, at, size = e.args
            where = f"{self._paths[int(shards[at])]}: record {int(local[at])}"
            what = (f"is {size:,} bytes, over max_record_bytes={self._max_record:,}" if why.startswith("a record") else
                    f"brings this read's records to {size:,} bytes, over 1,024 times the bytes they are stored in plus "
                    f"64 MiB, and over max_record_bytes={self._max_record:,} (a decompression bomb?)")
            raise OSError(f"{where} {what}; if the records are genuine, pass a larger max_record_bytes= (to "
                          "loader.load, or python -m trainer; a damaged or crafted shard can claim any size)") from None
        except (_riegeli.CorruptError, _riegeli.UnsupportedError) as e:
            why, at, _ = e.args
            shard, record = int(shards[at]), int(local[at])
            raise OSError(f"{self._paths[shard]}: record {record} cannot be read ({why}); the shard is corrupt: "
                          f"{redo(self._paths[shard])} (python -m pipelines verify --deep finds such shards)") from None
        except (storage.ObjectChanged, disk_cache.CacheDirError):
            raise  # (each names what to fix, which is not the files)
        except OSError as e:
            raise OSError(f"cannot read {self._paths[int(shards[0])]} and others of this read ({e}); check the "
                          "files are there and readable, or restage the data") from e

    def _fds_for(self, shards: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """Per record, an open descriptor of its shard; and those opened for this read only (to close after)."""
        fds = self._fds[shards]
        if (fds >= 0).all():  # every shard of this read is open already: the common case, and cheap
            return fds, []
        firsts = np.flatnonzero(np.r_[True, shards[1:] != shards[:-1]])
        needed = shards[firsts]
        fds = self._fds[needed]
        temporary = []
        if (fds < 0).any():
            with self._lock:
                for i in np.flatnonzero(self._fds[needed] < 0).tolist():
                    shard = int(needed[i])
                    fd = self._open(shard)
                    if self._open_count < self._limit:
                        self._fds[shard] = fd
                        self._open_count += 1
                    else:
                        temporary.append(fd)
                    fds[i] = fd
                fds = np.where(self._fds[needed] >= 0, self._fds[needed], fds)
        counts = np.diff(np.r_[firsts, len(shards)])
        return np.repeat(fds, counts), temporary

    def _open(self, shard: int) -> int:
        try:
            return os.open(self._paths[shard], os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise OSError(f"cannot open {self._paths[shard]} ({e.strerror}); check the file is there and readable, "
                          "or restage the data") from None

    def _read_fallback(self, shards: np.ndarray, local: np.ndarray) -> list[bytes]:
        """Records of shards our reader does not decode, through ArrayRecord's reader (one list call per shard)."""
        from array_record.python.array_record_module import ArrayRecordReader

        records: list[bytes] = []
        bounds = np.flatnonzero(np.r_[True, shards[1:] != shards[:-1], True])
        for first, end in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            shard = int(shards[first])
            with self._lock:
                if shard not in self._array_readers:
                    self._array_readers[shard] = ArrayRecordReader(self._paths[shard],
                                                                   "readahead_buffer_size:0,max_parallelism:0")
            try:
                records += self._array_readers[shard].read(local[first:end].tolist())
            except Exception as e:  # noqa: BLE001 - array_record raises bare RuntimeErrors; name the shard
                raise OSError(f"{self._paths[shard]}: cannot read records {int(local[first])}..{int(local[end - 1])} "
                              f"({e}); the shard is corrupt: {redo(self._paths[shard])}") from e
        return records


class _RemoteSpans:
    """The chunks of gs:// shards, read as range requests all at once (loader/fetch/remote.py; nearby chunks merged
    within REMOTE_GAP and the REMOTE_WASTE budget), through an optional cache of chunks (a chunk in it is not downloaded
    again): in memory (`cache_bytes`: the first read, kept, or with `planned` what this host reads again soonest), or on
    local disk shared by the host's processes and kept across runs (`cache_dir`, loader/fetch/disk_cache.py)."""

    def __init__(self, paths: tuple[str, ...], cache_bytes: int, disk: dict | None = None, planned: bool = False,
                 generations: tuple[int, ...] | None = None):
        """`generations`: each shard's object generation as listed (what the index and caches are keyed by): a read
        of another is storage.ObjectChanged."""
        self._paths = paths
        self._generations = generations
        self._cache = chunk_cache.make(cache_bytes, disk, planned)
        # records asked for, the bytes of their chunks, and the range requests and bytes planned to read them
        # (benchmarks/gcs_read_bench.py, the tests)
        self.requests = self.downloaded = self.records = self.served = 0

    def read(self, shards: np.ndarray, begins: np.ndarray, ends: np.ndarray, check: bool, max_record: int,
             records: np.ndarray, plan: tuple[np.ndarray, int] | None = None) -> list[bytes]:
        """The records (global numbers `records`) whose chunks are at `begins`..`ends` of `shards`. `plan`: (each
        record's next read on this host, this read's position), for a planned cache."""
        chunk_of = np.empty(len(shards), dtype=np.int64)
        chunks = _riegeli.plan_spans(shards, begins, ends, -1, chunk_of)  # each distinct chunk once, in file order
        with _COUNT_LOCK:
            self.records += len(shards)
            self.served += sum(end - begin for _, begin, end in chunks)
        read, cache = chunk_cache.ChunkRead(chunks, chunk_of, records, plan), self._cache
        data = cache.lookup(read) if cache is not None else [None] * len(chunks)
        missing = [i for i, d in enumerate(data) if d is None]
        # what came from the disk is checked whatever check_hashes says: the disk may have lost it
        suspect = [i for i, d in enumerate(data) if d is not None] if cache is not None and cache.checked else []
        self._download(chunks, data, missing)
        # What goes into the disk cache is checked, whatever check_hashes says: a later read checks what it takes
        # from there, and would blame the disk for a chunk the object holds damaged.
        checked = cache is not None and cache.checked

        def decode(verify: bool) -> list[bytes]:
            return _riegeli.decode(data, shards, begins, ends, verify, -1, max_record)

        try:
            records = decode(check or bool(suspect) or checked)
        except _riegeli.CorruptError as e:
            # the disk's fault only where the chunk that failed came from it; else the object's (said as such, and
            # nothing of this read is kept: a damaged chunk is never cached, good ones are not appended again)
            if int(chunk_of[e.args[1]]) in suspect:
                log.warning("%s: chunks read from the disk cache fail their checks; reading them from gs:// again",
                            cache.disk.path)
                cache.forget(read, suspect)
                self._download(chunks, data, suspect)
                missing = sorted(missing + suspect)
                try:
                    records = decode(check or checked)
                except _riegeli.CorruptError:
                    if check:
                        raise
                    return decode(False)  # the object's damage, its hashes not asked for: as it is, not cached
            elif check:
                raise
            else:
                return decode(False)
        if cache is not None:  # (what decoded: with the hashes checked, what they cover is the object's)
            cache.store(read, data, missing)
        return records

    def _download(self, chunks: list, data: list, which: list[int]) -> None:
        """data[i] = the bytes of chunks[i] for each i in `which`.

        The requests are those the rule makes for every chunk of the read, cached ones included, less those that
        hold none of `which`, each cut to its first and last chunk of `which`. A cached chunk between two missing
        ones is then read again when it costs less than a request (a gap), so a cache never adds requests: planned
        over the missing chunks alone, a cache of half the dataset made the gaps wider, 1.5x the requests and 0.7x
        the records/s of no cache on 1 KB records (benchmarks/disk_cache_bench.py)."""
        requests: list[tuple[int, int, int]] = []
        if which:
            every = np.array(chunks, dtype=np.int64).reshape(-1, 3)
            request_of = np.empty(len(chunks), dtype=np.int64)
            shards, begins, ends = (np.ascontiguousarray(every[:, k]) for k in range(3))
            planned = _riegeli.plan_spans(shards, begins, ends, REMOTE_GAP, request_of, REMOTE_WASTE)
            wanted = np.asarray(which, dtype=np.int64)
            used, request_of = np.unique(request_of[wanted], return_inverse=True)
            first = np.full(len(used), np.iinfo(np.int64).max, dtype=np.int64)
            last = np.zeros(len(used), dtype=np.int64)
            np.minimum.at(first, request_of, begins[wanted])
            np.maximum.at(last, request_of, ends[wanted])
            requests = [(planned[u][0], b, e) for u, b, e in zip(used.tolist(), first.tolist(), last.tolist())]
        with _COUNT_LOCK:  # counted as planned (a read cut short by its iterator's close still counts whole)
            self.requests += len(requests)
            self.downloaded += sum(end - begin for _, begin, end in requests)
        if not which:
            return
        got = remote.fetch_bodies([(self._paths[shard], begin, end) for shard, begin, end in requests],
                                  [self._generations[shard] for shard, _, _ in requests] if self._generations else None)
        for (shard, begin, end), body in zip(requests, got):
            storage.check_length(self._paths[shard], begin, end, body)
        for j, i in enumerate(which):  # views of the bodies, not copies (the caches copy what they keep)
            shard, begin, end = chunks[i]
            at = requests[request_of[j]][1]
            data[i] = got[request_of[j]].view(begin - at, end - at)


_COUNT_LOCK = threading.Lock()
