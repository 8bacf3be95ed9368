"""Packed batches (loader/planning/packing.py lays them out) computed on the loader's executor (loader/executors): this
process's threads, worker processes (worker_count=, or "auto"), or Ray actors, healed and resized as for any loader,
so the batches are the same with any of them. Each batch's `Job` (its rows' pieces and the records they read) is made
here, in order; the `Assembler` reads, decodes and tokenises the records and lays the pieces into arrays.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from dataset_format.manifest import redo
from loader import executors
from loader.decoding.decode import decoder_at
from loader.executors.handout import End, HostBatches, WorkerControls, close_at_exit, END
from loader.executors.padding import handed_out
from loader.executors.stages import Group, Stopwatch
from loader.planning.batches import FOREVER
from loader.planning.state import check, check_kind, said_new_batch_size
from loader.planning.packing import (KEY_PRESETS, ROW_KEYS, START, WINDOW, Job, Layout, PackedPlan, Packing, Position,
                                      row_keys)


def assemble(rows: list[list[tuple]], ids: dict[int, np.ndarray], seq_len: int,
             keys: Mapping[str, tuple[str, ...]] = KEY_PRESETS["default"]) -> dict[str, np.ndarray]:
    """The arrays of packed rows, from each record's token ids."""
    out = {k: np.zeros((len(rows), seq_len), np.int32) for k in ROW_KEYS}
    for r, row in enumerate(rows):
        at = 0
        for segment, (record, start, n) in enumerate(row, 1):
            piece = ids[record]
            out["tokens"][r, at:at + n] = piece[start:start + n]
            out["targets"][r, at:at + n] = piece[start + 1:start + n + 1]
            out["segment_ids"][r, at:at + n] = segment
            out["positions"][r, at:at + n] = np.arange(n)
            at += n
    if keys is KEY_PRESETS["default"]:
        return out
    named = {}
    for ours, names in keys.items():
        for i, name in enumerate(names):
            named[name] = out[ours] if i == 0 else out[ours].copy()
    return named


MAX_TOKEN_ID = 2**31 - 1  # the rows are int32


class TokenReader:
    """The token ids of records: read, decoded and tokenised (in this process, or in a worker's copy)."""

    def __init__(self, source, reader, decoder, feature: str, packing: Packing):
        self.source, self._reader, self._decoder = source, reader, decoder
        self._feature, self._packing = feature, packing

    @property
    def reads_counts_files(self) -> bool:
        """The counts come from the dataset's own `.counts` files (pre-tokenized data), not from counting."""
        return self._packing.tokenized and self.source.tokens_dtype is not None

    def _decoded(self, record: bytes, index: int):
        try:
            return decoder_at(self._decoder, index)(record)[self._feature]
        except Exception as e:  # noqa: BLE001 - re-raised with the shard and record named
            raise ValueError(f"{self.source.where(index)} does not decode ({type(e).__name__}: {e}); check decode= "
                             "and Packing.feature") from e

    def __call__(self, records: np.ndarray, clock: Stopwatch | None = None) -> list[np.ndarray]:
        """The token ids of global records `records` (each stage timed on `clock`)."""
        clock = clock or Stopwatch()
        clock.stage("read")
        raw = self._reader(records)
        clock.stage("decode")
        values = [self._decoded(r, i) for r, i in zip(raw, records.tolist())]
        clock.stage("map")
        packing = self._packing
        if packing.tokenize_batch is not None:
            return [self._tokenized(ids, i, packing.tokenize_batch)
                    for ids, i in zip(packing.tokenize_batch(values), records.tolist())]
        if packing.tokenize is not None:
            return [self._tokenized(packing.tokenize(v), i, packing.tokenize) for v, i in zip(values, records.tolist())]
        return [self._ids(v, i) for v, i in zip(values, records.tolist())]

    def _tokenized(self, ids, index: int, fn) -> np.ndarray:
        """What `fn` (tokenize=, tokenize_batch=) gave for record `index`, checked: one document's ids, a 1-D array of
        integers in [0, 2^31) (the rows are int32: a float id was truncated, one of 2^31 or more wrapped negative, and
        a 2-D array failed in NumPy naming no record)."""
        ids = np.asarray(ids)
        bad = (f"shape {ids.shape}" if ids.ndim != 1 else
               f"{ids.dtype} values" if ids.size and ids.dtype.kind not in "iu" else
               f"ids from {int(ids.min())} to {int(ids.max())}"
               if ids.size and (int(ids.min()) < 0 or int(ids.max()) > MAX_TOKEN_ID) else None)
        if bad is not None:
            raise ValueError(f"{self.source.where(index)}: {getattr(fn, '__name__', type(fn).__name__)} gave {bad}; "
                             f"it must give one document's token ids, a 1-D array of integers from 0 to {MAX_TOKEN_ID}")
        return ids

    def _ids(self, value, index: int) -> np.ndarray:
        """A feature that holds token ids already (Packing without tokenize=), as a 1-D integer array."""
        ids = np.asarray(value)
        if not ids.size:  # an empty document, whatever its array's type
            return np.zeros(0, np.int64)
        if ids.dtype.kind not in "iu":
            kind = "bytes" if ids.dtype.kind in "SUO" else ids.dtype.name
            raise ValueError(f"{self.source.where(index)}: feature {self._feature!r} holds {kind} values, "
                             f"not token ids: {untokenized_fix(self._feature)}")
        return ids.reshape(-1)


def untokenized_fix(feature: str) -> str:
    """How to pack a feature that is text, not ids."""
    return (f"pass Packing(feature={feature!r}, seq_len=N, tokenize=...) to tokenise it as it loads, or convert the "
            f"dataset with `python -m pipelines convert --tokenizer PATH --text-key {feature}`")


class Assembler:
    """A Job -> its batch (a stages.Group of one batch): the records read, decoded and tokenised, each checked against
    its token count (a count that disagrees would misplace every piece of its row), the pieces laid into rows. None
    (past the last batch) -> END."""

    def __init__(self, tokens: TokenReader, seq_len: int, keys: Mapping[str, tuple[str, ...]]):
        self.tokens, self.seq_len, self.keys = tokens, seq_len, keys

    def __call__(self, job: Job | None) -> Group | End:
        if job is None:
            return END
        clock = Stopwatch()
        ids = self.tokens(job.records, clock) if len(job.records) else []
        for record, got, want in zip(job.records.tolist(), ids, job.counts.tolist()):
            if len(got) != want:
                source = self.tokens.source
                fix = (redo(source.path_of(record)) if self.tokens.reads_counts_files else
                       "the token counts were cached under the same Packing.cache_key by another tokenizer: change "
                       "the cache_key when the tokenizer changes")
                raise ValueError(f"{source.where(record)} has {len(got)} token ids but its token count says {want}; "
                                 f"the counts are stale or damaged: {fix}")
        clock.stage("collate")
        batch = assemble(job.rows, dict(zip(job.records.tolist(), ids)), self.seq_len, self.keys)
        return clock.group([{**batch, **job.extra}], len(job.records))


class Lengths:
    """A span (first, end) of records -> their token counts (the counting pass before the first layout)."""

    def __init__(self, tokens: TokenReader):
        self.tokens = tokens

    def __call__(self, span: tuple[int, int]) -> np.ndarray:
        return np.array([len(t) for t in self.tokens(np.arange(*span))], np.int64)


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What a packed loader reads: the records (source, reader, decoder) and their token counts: a pre-tokenized
    dataset's (`counts`), or counted from the decoded feature, cached under `cache_dir` by `index_key`."""

    source: Any
    reader: Any
    decoder: Any
    counts: Any = None
    index_key: str = ""
    cache_dir: str = ""


class PackedLoader:
    """An iterable of packed batches; each `iter()` starts at batch 0 (`set_state` resumes exactly). This process lays
    out the rows; the loader's executor (`config.worker_count`: threads here, worker processes, "auto", Ray actors)
    reads, decodes and tokenises the records and assembles the rows, so the batches are the same with any of them."""

    def __init__(self, inputs: Inputs, config, shard_index: int, shard_count: int):
        """`config`: the LoaderConfig (loader/pipeline.py), its `packing` set."""
        self._setup(inputs, config)
        layout = Layout(self.counts, len(inputs.source), self.packing.seq_len, self.packing.fit, config.seed,
                        config.shuffle)
        self.plan = PackedPlan(layout, config.batch_size, config.num_epochs, shard_index, shard_count,
                               config.drop_remainder)

    def _setup(self, inputs: Inputs, config) -> None:
        self.source, self.config, self.packing = inputs.source, config, config.packing
        keys, feature = row_keys(self.packing.keys), self.packing.feature or "tokens"
        tokens = TokenReader(inputs.source, inputs.reader, inputs.decoder, feature, self.packing)
        self.assembler = Assembler(tokens, self.packing.seq_len, keys)
        counts = inputs.counts
        if counts is None:
            from loader.planning.counts import TokenCounts

            counts = TokenCounts.counted(inputs.source, inputs.index_key, feature, self.packing.cache_key,
                                         functools.partial(self._count, Lengths(tokens)), inputs.cache_dir)
        self.counts = counts

    def executor(self, worker_count: int | str | None = None, **options) -> executors.Executor:
        """The loader's executor, with `worker_count` workers (default: the config's)."""
        c = self.config
        return executors.make(c.worker_count if worker_count is None else worker_count,
                              **{"num_threads": c.num_threads, "prefetch": max(1, c.prefetch),
                                 "ray_address": c.ray_address, "ray_resources": c.ray_resources, **options})

    def _count(self, lengths: Lengths, spans: list[tuple[int, int]]) -> Iterator[np.ndarray]:
        """Token counts of each span, in order, computed by the executor (every core of this host on threads)."""
        cores = os.cpu_count() or 1
        def describe(g: int) -> str:
            first, end = spans[g]
            return f"the token counts of records {first}-{end - 1} ({self.source.where_all(np.arange(first, end))})"

        groups = self.executor(num_threads=cores, prefetch=cores, describe=describe).map(
            lengths, len(spans), args=spans.__getitem__)
        try:
            yield from groups
        finally:
            groups.close()

    def job(self, k: int, position: Position) -> tuple[Job, Position] | None:
        """Batch k's Job (k starts at `position`), and the position after it; None past the last batch."""
        got = self.plan.batch_at(position)
        if got is None:
            return None
        rows, after = got
        return Job.of([block.row(r) for block, r in rows], self.counts), after

    def __len__(self) -> int:
        if self.plan.num_batches is None:
            raise TypeError("an endless loader (num_epochs=None) has no length")
        return self.plan.num_batches

    def __iter__(self) -> PackedIterator:
        return PackedIterator(self)

    def state_key(self) -> dict:
        layout = self.plan.layout
        return {"dataset": self.source.identity, "num_records": layout.n, "batch_size": self.plan.batch_size,
                "seed": layout.seed, "shuffle": layout.shuffle, "num_epochs": self.plan.num_epochs,
                "drop_remainder": self.plan.drop_remainder, "seq_len": layout.seq_len,
                "feature": self.packing.feature or "tokens", "fit": layout.fit,
                "layout": f"blocks of {layout.block_size}, window {WINDOW}",
                "counts": self.counts.identity,
                **({"records": self.source.slice_bounds} if self.source.offsets is not None else {})}


class Jobs:
    """Batch k's Job for k >= `start`, made in order here (each batch's rows begin where the one before ended), asked
    for in any order within the executor's window (thread-safe). Keeps each batch's Job and where it begins until the
    caller has taken it (for errors, and the state)."""

    def __init__(self, make: Callable[[int, Any], tuple[Job, Any] | None], start: int, position: Any):
        self._make = make
        self._lock = threading.Lock()
        self._next, self._at = start, position
        self._made: dict[int, Job | None] = {}
        self._positions = {start: position}

    def __call__(self, k: int) -> Job | None:
        with self._lock:
            self._make_to(k)
            return self._made[k]

    def _make_to(self, k: int) -> None:
        """Makes the Jobs up to batch k (the lock held)."""
        while self._next <= k:
            got = self._make(self._next, self._at) if self._at is not None else None
            self._made[self._next], self._at = got if got is not None else (None, None)
            self._next += 1
            self._positions[self._next] = self._at

    def describe(self, k: int, source) -> str:
        """Batch k and its records, for errors."""
        with self._lock:
            job = self._made.get(k)
        if job is None:
            return f"packed batch {k}"
        return f"packed batch {k} ({len(job.records)} records: {source.where_all(job.records)})"

    def position(self, k: int) -> Any:
        """Where batch k begins (None: past the last batch)."""
        with self._lock:
            self._make_to(k - 1)  # batch k begins where k - 1 ends (made already unless nothing was read ahead)
            return self._positions[k]

    def taken(self, k: int) -> None:
        """Batches before k are the caller's: their positions are not needed again."""
        with self._lock:
            for old in [j for j in self._positions if j < k]:
                del self._positions[old]
                self._made.pop(old, None)


class PackedIterator(WorkerControls, Iterator):
    """Batches from the current index on, computed ahead by the loader's executor; `get_state()`/`set_state()`."""

    def __init__(self, loader: PackedLoader):
        self._loader = loader
        self._taking = threading.Lock()
        self._ray = loader.config.ray_address is not None
        self._host, self._device = None, None
        self._start(0, START)
        close_at_exit(self)

    def _start(self, k: int, position) -> None:
        self._failed = False
        self._consumed = k
        self._jobs = self._new_jobs(k, position)
        jobs, source = self._jobs, self._loader.source
        groups = self._loader.executor(self._worker_count(), describe=lambda g: jobs.describe(k + g, source)).map(
            self._loader.assembler, FOREVER, args=lambda g: jobs(k + g))
        self._host = HostBatches(groups)
        plan = self._loader.plan
        self._take = handed_out(self._host.next, self._loader.config.pad_remainder,
                                plan.batch_size // plan.shard_count)
        if self._loader.config.sharding is not None:
            from loader.executors.device import DevicePrefetcher

            self._device = DevicePrefetcher(self._take, self._loader.config.sharding,
                                            self._loader.config.device_prefetch)

    def _new_jobs(self, k: int, position) -> Jobs:
        return Jobs(self._loader.job, k, position)

    def __next__(self):
        batch = self._handed(lambda: self._device.get() if self._device is not None else self._take(),
                             lambda: self._start(self._consumed, self._jobs.position(self._consumed)))
        self._consumed += 1
        self._jobs.taken(self._consumed)
        return batch

    def get_state(self) -> dict:
        position = self._jobs.position(self._consumed)
        return {"next_batch": self._consumed, "position": list(position) if position else None,
                **self._loader.state_key()}

    def set_state(self, state: dict) -> None:
        key = self._loader.state_key()
        if state.get("counts") is not None and state.get("counts") == self._loader.counts.legacy:
            key["counts"] = state["counts"]  # (saved by an earlier release, which named the counts by their paths)
        check_kind(state, "a packed loader of one source", "this packed loader")
        check(state, key, "the packed loader's state")  # (another batch_size: rows read on)
        said_new_batch_size(state, self._loader.plan.batch_size)
        position = state.get("position")
        self.close()
        self._start(int(state["next_batch"]), Position(*position) if position is not None else None)

    def close(self) -> None:
        if self._device is not None:
            self._device.close()
            self._device = None
        if self._host is not None:
            self._host.close()
