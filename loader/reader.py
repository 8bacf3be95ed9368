"""Batched random reads from a sharded ArrayRecord dataset.

Measured on 1 KB records, 125k per file (docs/benchmarks.md): grain's ArrayRecordDataSource
reads one record per call (~300 us each at that file size); `reader.read([i, ...])` has a
per-call cost that grows with the records in the file, so it pays only for long lists:
~28 us a record for one batch of 256 spread over 8 shards, 5.5 us for 64 batches at once,
which is the cost of a sequential read. So the loader reads many batches per call: their
indices are grouped by shard and sorted, read with one call per shard (one reader per
shard and process, opened for random access), and put back in order.
"""

from __future__ import annotations

import threading

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader

from loader.source import ShardedSource

RANDOM_ACCESS = "readahead_buffer_size:0,max_parallelism:0"


class BatchReader:
    """`reader(indices)` -> the records at those global indices, in that order. Picklable."""

    def __init__(self, source: ShardedSource):
        self._paths = source.paths
        self._starts = source.starts
        self._total = len(source)
        self._local = threading.local()

    def __getstate__(self):
        return {"paths": self._paths, "starts": self._starts, "total": self._total}

    def __setstate__(self, state):
        self._paths, self._starts, self._total = state["paths"], state["starts"], state["total"]
        self._local = threading.local()

    def _reader(self, shard: int) -> ArrayRecordReader:
        readers = getattr(self._local, "readers", None)
        if readers is None:
            readers = self._local.readers = {}
        reader = readers.get(shard)
        if reader is None:
            try:
                reader = readers[shard] = ArrayRecordReader(self._paths[shard], RANDOM_ACCESS)
            except Exception as e:  # noqa: BLE001 - array_record raises bare RuntimeErrors; name the file
                raise OSError(f"cannot open {self._paths[shard]} ({e}); the shard is corrupt or unreadable: "
                              "re-run the conversion or restage the data") from e
        return reader

    def __call__(self, indices: np.ndarray) -> list[bytes]:
        """The records at global `indices`, in that order (duplicates allowed)."""
        indices = np.asarray(indices, dtype=np.int64)
        shards = np.searchsorted(self._starts, indices, side="right") - 1
        order = np.lexsort((indices, shards))  # by shard, then by index within the shard
        sorted_shards = shards[order]
        bounds = np.flatnonzero(np.diff(sorted_shards)) + 1
        out: list[bytes | None] = [None] * len(indices)
        for run in np.split(order, bounds):
            if not len(run):
                continue
            shard = int(shards[run[0]])
            local = (indices[run] - self._starts[shard]).tolist()
            reader = self._reader(shard)  # raises its own error naming the shard
            try:
                records = reader.read(local)
            except Exception as e:  # noqa: BLE001 - name the shard and records, keep the cause
                raise OSError(f"{self._paths[shard]}: cannot read records {local[0]}..{local[-1]} ({e}); the shard "
                              "is corrupt: re-run the conversion (python -m pipelines verify finds such shards)") from e
            for pos, record in zip(run.tolist(), records):
                out[pos] = record
        return out  # type: ignore[return-value]
