"""Batched random reads from a sharded ArrayRecord dataset.

Measured on 1 KB records (docs/benchmarks.md): `reader.read([i, ...])` has a per-call cost
that grows with the number of records in the file, and grain's ArrayRecordDataSource reads
one record per call; a reader opened with `readahead_buffer_size:0,max_parallelism:0` that
`seek(i)`s and `read()`s costs ~7 us a record whatever the file's size. So a batch's indices
are grouped by shard and sorted (nearby records share decompressed chunks' cache lines and
the OS page cache), read with one such reader per shard and process, and put back in order.
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
        indices = np.asarray(indices, dtype=np.int64)
        shards = np.searchsorted(self._starts, indices, side="right") - 1
        order = np.lexsort((indices, shards))
        out: list[bytes | None] = [None] * len(indices)
        for pos in order:
            shard = int(shards[pos])
            local = int(indices[pos] - self._starts[shard])
            reader = self._reader(shard)
            try:
                reader.seek(local)
                out[pos] = reader.read()
            except Exception as e:  # noqa: BLE001 - name the shard and record, keep the cause
                raise OSError(f"{self._paths[shard]}: cannot read record {local} ({e}); the shard is corrupt: "
                              "re-run the conversion (python -m pipelines verify finds such shards)") from e
        return out  # type: ignore[return-value]
