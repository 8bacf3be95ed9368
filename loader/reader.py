"""Batched random reads from a sharded ArrayRecord dataset.

The loader reads many batches at once: their indices are grouped by shard and sorted, each shard's
run is read with that shard's reader (opened for random access), and the records are put back in
order. ArrayRecord offers two ways to read a run of k records from a shard of N records, and
each is slow where the other is fast (1 KB records, 2 cores; docs/benchmarks.md, "Reading a shard"):

- `reader.read([i, ...])`: a call costs ~60 us (it dispatches to ArrayRecord's thread pool) plus
  ~3.5 ns per record in the file (it allocates a slot per chunk), then ~3 us a record, decoded on
  the pool's threads with the GIL released. It pays for long runs: 2.8-3.8 us a record at k=2048,
  but 12-43 us a record at k=16 (files of 100 to 125k records).
- `reader.seek(i); reader.read()`: ~4-6 us a record, no per-call cost, in the calling thread.

So a run is read with one list call when it is long for its file (k >= SEEK_BELOW + N / SEEK_PER_FILE),
record by record otherwise. Many shards, or big ones, make each group's runs short: without the
per-record path a dataset of 1000 shards read 3x slower than the same records in 8.

Small shards (up to SMALL_SHARD_BYTES, or up to WHOLE_FILE_BYTES where a read group takes enough of
their records: see _whole_file) are opened with a read-ahead buffer that holds the whole file and are
always read with list calls: a call then reads the span from its first to its last record in one
`pread` and decodes only the records asked for, in the calling thread with the GIL released, at or below
the cost of `seek` + `read` for any run length (200 KB files of 100 records: 5.7 us a record for one
record, 2.8 us for 16, 1.7 us for 64, against 5.5, 3.4 and 2.9), and two threads read at once. (Such a
reader must not seek: its first `seek` decodes and keeps the whole file.)

One reader per shard serves every thread. Opening one reads the file's whole chunk index (~15 ms for
125k records), so readers are opened once, several at a time (the GIL is released while they open).
List calls are const and may run concurrently (ArrayRecord's own data source shares its readers the same
way; riegeli's `NewReader`, which each read starts from, is thread-safe even against a seek); a
`seek` + `read` pair moves the reader, so a shard's pairs hold that shard's lock.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader

from dataset_format import storage
from loader.source import ShardedSource

RANDOM_ACCESS = "readahead_buffer_size:0,max_parallelism:0"
# Shards read through one whole-file buffer: up to SMALL_SHARD_BYTES always; up to WHOLE_FILE_BYTES when a read
# group's list call copies at most WHOLE_FILE_COPY bytes of the file's span per record it asks for (measured, 1 KB
# records: ~17 KB a record read 28-60% faster than `seek` + `read`, ~33 KB 3-22% faster, ~97 KB 35-45% slower).
SMALL_SHARD_BYTES = 256 << 10
WHOLE_FILE_BYTES = 4 << 20
WHOLE_FILE_COPY = 32 << 10

# A run of k records from a file of N is read by one list call when k >= SEEK_BELOW + N // SEEK_PER_FILE
# (measured crossovers: k ~ 256 in files of 100 to 25k records, ~500 at 125k), else record by record.
SEEK_BELOW = 256
SEEK_PER_FILE = 500

OPEN_THREADS = 8  # readers opened at once


def _whole_file(lengths: np.ndarray, size: np.ndarray, group_records: int | None, total: int) -> np.ndarray:
    """Per shard of `lengths` records and `size` bytes: read through one whole-file buffer? A list call of k records
    spread over a file of S bytes copies the span between its first and last record, on average S (k - 1) / (k + 1),
    so S (k - 1) / (k (k + 1)) a record, with k the shard's share of a read group."""
    if not group_records:
        return size <= SMALL_SHARD_BYTES
    k = np.maximum(group_records * lengths / total, 1.0)
    copy = size * (k - 1) / (k * (k + 1))
    return (size <= SMALL_SHARD_BYTES) | ((size <= WHOLE_FILE_BYTES) & (copy <= WHOLE_FILE_COPY))


class BatchReader:
    """`reader(indices)` -> the records at those global indices, in that order. Picklable."""

    def __init__(self, source: ShardedSource, group_records: int | None = None):
        """`group_records`: records read at once (a read group); it decides which shards are read through a
        whole-file buffer. None: only those up to SMALL_SHARD_BYTES."""
        self._paths = source.paths
        self._starts = source.starts
        self._total = len(source)
        # per shard: the shortest run read with one list call. Remote shards (gs://) always take list calls: each
        # record is a range request, which a list call issues from ArrayRecord's pool, not one after another. So do
        # shards read through a whole-file buffer (by their stored sizes, else lengths x the mean record size).
        lengths = np.asarray(source.lengths, dtype=np.int64)
        sizes = np.asarray(source.shard_bytes if source.shard_bytes else lengths * source.mean_record_bytes)
        self.group_records = group_records
        self._whole_file = _whole_file(lengths, sizes, group_records, self._total)
        remote = np.array([storage.is_remote(p) for p in source.paths], dtype=bool)
        self._list_from = np.where(remote | self._whole_file, 0, SEEK_BELOW + lengths // SEEK_PER_FILE)
        self._open_readers()

    def _open_readers(self) -> None:
        self._readers: dict[int, ArrayRecordReader] = {}
        self._seek_locks: dict[int, threading.Lock] = {}
        self._opening = threading.Lock()

    def __getstate__(self):
        return {"paths": self._paths, "starts": self._starts, "total": self._total, "list_from": self._list_from,
                "whole_file": self._whole_file, "group_records": self.group_records}

    def __setstate__(self, state):
        self._paths, self._starts, self._total = state["paths"], state["starts"], state["total"]
        self._list_from, self._whole_file = state["list_from"], state["whole_file"]
        self.group_records = state["group_records"]
        self._open_readers()

    def list_share(self, group_records: int | None = None) -> float:
        """The share of records read by list calls when a group of `group_records` (default: this reader's read
        group) uniformly spread records is read (a shard of N records holds ~group_records * N / total of them)."""
        group_records = group_records or self.group_records or 1
        lengths = np.asarray(np.diff(np.append(self._starts, self._total)), dtype=np.int64)
        expected = group_records * lengths / self._total
        return float(lengths[expected >= self._list_from].sum() / self._total)

    def _open(self, shards: list[int]) -> None:
        """Opens the readers of `shards` that are not open yet, up to OPEN_THREADS at once."""
        if all(shard in self._readers for shard in shards):
            return
        with self._opening:
            missing = [shard for shard in shards if shard not in self._readers]
            if len(missing) > 1:
                with ThreadPoolExecutor(min(len(missing), OPEN_THREADS)) as pool:
                    opened = list(pool.map(self._open_one, missing))
            else:
                opened = [self._open_one(shard) for shard in missing]
            for shard, reader in zip(missing, opened):
                self._seek_locks[shard] = threading.Lock()
                self._readers[shard] = reader

    def _open_one(self, shard: int) -> ArrayRecordReader:
        try:
            options = f"readahead_buffer_size:{WHOLE_FILE_BYTES},max_parallelism:0" if self._whole_file[shard] \
                else RANDOM_ACCESS
            return ArrayRecordReader(self._paths[shard], options)
        except Exception as e:  # noqa: BLE001 - array_record raises bare RuntimeErrors; name the file
            raise OSError(f"cannot open {self._paths[shard]} ({e}); the shard is corrupt or unreadable: "
                          "re-run the conversion or restage the data") from e

    def __call__(self, indices: np.ndarray) -> list[bytes]:
        """The records at global `indices`, in that order (duplicates allowed)."""
        indices = np.asarray(indices, dtype=np.int64)
        # Shards hold contiguous ranges of global indices, so sorting the indices also groups them by shard (an
        # unstable sort: equal indices are the same record). 5x cheaper than a lexsort by (shard, index).
        order = np.argsort(indices)
        sorted_indices = indices[order]
        sorted_shards = np.searchsorted(self._starts, sorted_indices, side="right") - 1
        bounds = np.flatnonzero(np.diff(sorted_shards)) + 1
        firsts = np.r_[0, bounds] if len(indices) else np.zeros(0, dtype=np.int64)
        self._open(sorted_shards[firsts].tolist())  # errors name the shard
        records: list[bytes] = []
        for first, end in zip(firsts.tolist(), np.r_[bounds, len(indices)].tolist()):
            shard = int(sorted_shards[first])
            local = (sorted_indices[first:end] - self._starts[shard]).tolist()
            reader = self._readers[shard]
            try:
                if len(local) >= self._list_from[shard]:
                    records += reader.read(local)
                else:
                    with self._seek_locks[shard]:
                        for i in local:
                            reader.seek(i)
                            records.append(reader.read())
            except Exception as e:  # noqa: BLE001 - name the shard and records, keep the cause
                raise OSError(f"{self._paths[shard]}: cannot read records {local[0]}..{local[-1]} ({e}); the shard "
                              "is corrupt: re-run the conversion (python -m pipelines verify finds such shards)") from e
        out = np.empty(len(indices), dtype=object)
        out[order] = records  # back to the order asked for
        return out.tolist()
