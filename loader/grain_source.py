"""The loader's reader as a grain data source: a drop-in for `grain.sources.ArrayRecordDataSource`.

For a grain pipeline of your own (MaxText's, Flax's) on converted data. Record i is the record grain's source gives
at i (the shards in the same order), read by the loader's reader (loader/fetch/reader.py: a batch of indices in one
call, grouped by chunk, riegeli's hashes checked, the GIL released) through the compact index (loader/format/index.py):
one memory-mapped file per dataset whose pages every process on the host shares, where ArrayRecord's readers hold 8
bytes a record in each reader of each process.

It pickles as its shard list, its options and the index file's path; a copy (in a grain worker process) maps the
same index and opens files on its first read.

    import grain
    import loader
    source = loader.DataSource("out/train")        # what loader.resolve takes: a converted dir, a glob, gs://
    source = loader.DataSource(["a.array_record", "b.array_record"])   # or a list of files, as grain's source takes
    ds = grain.MapDataset.source(source).shuffle(seed=0).map(decode)
    with loader.DataSource(paths) as source: ...   # a context manager, as grain's: its files are closed after
"""

from __future__ import annotations

import hashlib
import operator
import os
import threading
from collections.abc import Sequence
from typing import SupportsIndex

import numpy as np

from loader.fetch.reader import BatchReader, MAX_RECORD_BYTES
from loader.format.index import RecordIndex
from loader.format.source import ShardedSource, of_files, resolve, select


class DataSource:
    """grain's RandomAccessDataSource protocol (`len`, `source[i]`, `source.__getitems__(indices)`) over converted
    data. Thread-safe; picklable.

    `data`: what `loader.resolve` takes (a directory written by `python -m pipelines convert`, a TFDS array_record
    directory with `split=`, a glob of ArrayRecord files, local or gs://), a list of ArrayRecord files (numbered in
    that order, as grain's `ArrayRecordDataSource(paths)`), or a `loader.ShardedSource`.
    `split`, `allow_incomplete`, `check_hashes`, `cache_bytes`, `cache_dir`, `max_record_bytes`: as for
    `loader.load`.

        source = loader.DataSource("out/train")
        source[0]                        # the bytes of record 0
        source.__getitems__([7, 3, 7])   # [record 7, record 3, record 7], in one read
    """

    def __init__(self, data: str | os.PathLike | Sequence[str | os.PathLike] | ShardedSource, *,
                 split: str | None = None, allow_incomplete: bool = False, check_hashes: bool = True,
                 cache_bytes: int = 0, cache_dir: str | None = None, max_record_bytes: int = MAX_RECORD_BYTES):
        if isinstance(data, (list, tuple)):
            data = of_files([os.fspath(p) for p in data])
        if isinstance(data, ShardedSource):
            self._source = select(data, split)
            more = len(data.paths) - 1
            self._name = f"{data.paths[0]} and {more} more" if more else data.paths[0]
        else:
            self._name = os.fspath(data)
            self._source = resolve(self._name, split=split, allow_incomplete=allow_incomplete)
        self._split = split  # (messages name it: the records of a slice, not of the directory)
        self._options = {"check_hashes": check_hashes, "cache_bytes": cache_bytes, "cache_dir": cache_dir,
                         "max_record_bytes": max_record_bytes}
        self._length = len(self._source)
        index = RecordIndex.for_source(self._source)  # built here, once, before any worker process starts
        self._index_dir = os.path.dirname(index.path)
        self._lock = threading.Lock()
        self._reader: BatchReader | None = BatchReader(self._source, index=index, **self._options)

    def __getstate__(self):
        return {"source": self._source, "name": self._name, "options": self._options, "index_dir": self._index_dir,
                "split": self._split}

    def __setstate__(self, state):
        self._source, self._name, self._options = state["source"], state["name"], state["options"]
        self._split = state.get("split")
        self._index_dir = state["index_dir"]
        self._length = len(self._source)
        self._lock = threading.Lock()
        self._reader = None  # opened on the first read, in the process that reads

    def __enter__(self) -> DataSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Closes its open files (a later read opens them again)."""
        with self._lock:
            reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()

    def _read(self, indices: np.ndarray) -> list[bytes]:
        if self._reader is None:
            with self._lock:
                if self._reader is None:
                    # the same index file (rebuilt, with a log line, only if it went missing or is damaged)
                    index = RecordIndex.for_source(self._source, self._index_dir)
                    self._reader = BatchReader(self._source, index=index, **self._options)
        return self._reader(indices)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: SupportsIndex) -> bytes:
        i = operator.index(index)
        if not 0 <= i < self._length:
            raise IndexError(self._out_of_range(i))
        return self._read(np.array([i], dtype=np.int64))[0]

    def __getitems__(self, indices: Sequence[SupportsIndex]) -> list[bytes]:
        """The records at `indices`, in that order (duplicates allowed), in one read."""
        keys = np.asarray(indices)
        if keys.dtype.kind not in "iu":
            if not len(keys):
                return []
            keys = np.array([operator.index(i) for i in indices], dtype=np.int64)  # TypeError for a non-integer
        keys = keys.astype(np.int64, copy=False).reshape(-1)
        bad = np.flatnonzero((keys < 0) | (keys >= self._length))
        if len(bad):
            raise IndexError(self._out_of_range(int(keys[bad[0]])))
        return self._read(keys)

    # the name grain's datasets call for a batched read (SupportsBatchedReadRandomAccessDataSource); array_record's
    # own source, and PyTorch's DataLoader, use `__getitems__`
    _getitems = __getitems__

    def _out_of_range(self, i: int) -> str:
        sliced = f" split={self._split}" if self._split is not None else ""
        return (f"index {i} is out of range for {self._name!r}{sliced}, which holds {self._length} records "
                f"(0..{self._length - 1})")

    @property
    def paths(self) -> tuple[str, ...]:
        """The shards, in the order their records are numbered (grain's sources have `paths` too)."""
        return self._source.paths

    def __repr__(self) -> str:
        # grain's DataLoader compares repr(source) when it restores a checkpoint: stable, and short for many shards
        h = hashlib.sha1("\n".join(self._source.paths).encode()).hexdigest()[:16]
        return f"DataSource({self._name!r}, records={self._length}, shards={len(self._source.paths)}, paths_hash={h})"
