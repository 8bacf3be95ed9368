"""The caches of a gs:// dataset's chunks that the reader (loader/fetch/reader.py `_RemoteSpans`) reads through: one
interface, three kinds.

    cache = make(cache_bytes, disk, planned)        # None: no cache
    data = cache.lookup(read)                       # each chunk's bytes, or None where it is not kept
    cache.store(read, data, indices)                # after the chunks at `indices` were downloaded into `data`
    cache.checked                                   # what lookup returns must have its hashes checked ...
    cache.forget(read, indices)                     # ... and what failed is dropped

- `FirstRead` (here): in memory, the first chunks read, kept;
- `PlannedChunks` (loader/fetch/planned_cache.py): in memory, what this host reads again soonest (multi-host jobs);
- `DiskChunks` (loader/fetch/disk_cache.py): on local disk, shared by the host's processes and kept across runs.

A read is a `ChunkRead`: its distinct chunks and which record each holds.
"""

from __future__ import annotations

import threading
from typing import Protocol

import numpy as np


class ChunkRead:
    """One read's distinct chunks ((shard, begin, end), in file order), as the caches see them: `chunk_of[k]` is the
    chunk of record `records[k]` (a global record number), `plan` the read's (next reads, position) or None."""

    __slots__ = ("chunks", "chunk_of", "records", "plan", "_chunk_records")

    def __init__(self, chunks: list, chunk_of: np.ndarray, records: np.ndarray, plan: tuple | None):
        self.chunks, self.chunk_of, self.records, self.plan = chunks, chunk_of, records, plan
        self._chunk_records: np.ndarray | None = None

    @property
    def chunk_records(self) -> np.ndarray:
        """Each chunk's global record number (group_size 1: a chunk holds one record)."""
        if self._chunk_records is None:
            self._chunk_records = np.empty(len(self.chunks), dtype=np.int64)
            self._chunk_records[self.chunk_of] = self.records
        return self._chunk_records


class ChunkCache(Protocol):
    checked: bool

    def lookup(self, read: ChunkRead) -> list: ...

    def store(self, read: ChunkRead, data: list, indices: list[int]) -> None: ...


def make(cache_bytes: int, disk: dict | None = None, planned: bool = False) -> ChunkCache | None:
    """The cache the reader's options ask for: on disk (`disk`: DiskCache.open's arguments), else `cache_bytes` in
    memory (`planned`: by next read, else the first read), else none."""
    if disk is not None:
        from loader.fetch.disk_cache import DiskChunks

        return DiskChunks(disk)
    if cache_bytes:
        if planned:
            from loader.fetch.planned_cache import PlannedChunks

            return PlannedChunks(cache_bytes)
        return FirstRead(cache_bytes)
    return None


class FirstRead:
    """At most `capacity` bytes of chunks in memory: the first chunks read, kept; once full it admits no more.
    Thread-safe.

    The loader reads every epoch in a new shuffled order, and each chunk (group_size 1: one record) once an epoch, so
    a chunk's last read says nothing of its next one. Least-recently-used eviction keeps the chunks read last and
    evicts most before the next epoch reaches them: a cache of half the dataset saved 15-20% of the bytes of each
    later epoch, a fixed set 53% (tests/loader/fetch/test_reader.py). A fixed set serves capacity / dataset of every
    later epoch's reads, and the whole dataset after the first epoch where it fits."""

    checked = False

    def __init__(self, capacity: int):
        self._capacity = capacity
        self._blocks: dict = {}
        self._size = 0
        self._lock = threading.Lock()

    def lookup(self, read: ChunkRead) -> list:
        return [self._blocks.get(chunk) for chunk in read.chunks]  # a dict read is atomic; entries are never removed

    def store(self, read: ChunkRead, data: list, indices: list[int]) -> None:
        with self._lock:
            for i in indices:
                key = read.chunks[i]
                if key not in self._blocks and self._size + len(data[i]) <= self._capacity:
                    self._blocks[key] = bytes(data[i])  # a view would keep the whole piece it is of
                    self._size += len(data[i])
