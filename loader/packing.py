"""Packing variable-length sequences into rows of `seq_len` tokens, keeping the loader's guarantees.

Each example's token count is read once, up front (one pass over the data; Megatron's indexed datasets keep the
same "sizes" array). Then each epoch's layout is a pure function of (lengths, seed, epoch): the examples in that
epoch's permutation, each cut into pieces of at most `seq_len` targets, placed first-fit into a window of the
`WINDOW` newest rows. Global batch k is a fixed run of `batch_size` rows of that layout; host i of n takes rows
[i*B/n, (i+1)*B/n) of it. So the global batches are the same for any host count, the state is the batch index
(exact resume), and a seed gives one sequence of batches.

A row carries `tokens`, `targets`, `segment_ids` (1, 2, ... per piece, 0 = padding) and `positions` (restarting at
each piece): a model that masks attention by segment never lets one example see another.

    packing = loader.Packing(feature="text", seq_len=1024, tokenize=lambda text: my_ids(text))
    batches = loader.load("out/train", batch_size=32, packing=packing)   # 32 rows of 1024 tokens a batch
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from loader.permutation import Permutation

log = logging.getLogger(__name__)

WINDOW = 64  # rows still open for first-fit; older rows are closed
_LENGTH_READ = 16384  # records per read in the lengths pass


@dataclasses.dataclass(frozen=True)
class Packing:
    """What to pack: `tokenize(value)` turns a record's `feature` into token ids (int array); an example of k ids
    gives k - 1 next-token targets (its first id is only an input, e.g. BOS)."""

    feature: str
    seq_len: int
    tokenize: Callable[[Any], np.ndarray]
    # Optional: many values at once (a tokenizer's batch call, in native threads); used in place of `tokenize`.
    tokenize_batch: Callable[[list], list[np.ndarray]] | None = None

    def __post_init__(self):
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1 (got seq_len={self.seq_len})")


def pack_rows(lengths: np.ndarray, order: np.ndarray, seq_len: int, window: int = WINDOW) -> list[list[tuple]]:
    """Rows of (record, first target, targets) pieces: `order`'s examples cut into pieces of <= seq_len targets,
    each placed in the first of the `window` newest rows with room, else in a new row."""
    rows: list[list[tuple]] = []
    free = np.zeros(max(16, len(order)), np.int64)
    for record in order:
        total = int(lengths[record])
        for start in range(0, max(total, 1), seq_len):
            n = min(seq_len, total - start)
            if n <= 0:
                break
            lo = max(0, len(rows) - window)
            fits = np.flatnonzero(free[lo:len(rows)] >= n)
            if fits.size:
                row = lo + int(fits[0])
            else:
                row = len(rows)
                rows.append([])
                if row >= len(free):
                    free = np.concatenate([free, np.zeros(len(free), np.int64)])
                free[row] = seq_len
            rows[row].append((int(record), start, n))
            free[row] -= n
    return rows


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: hashed by identity, for the per-epoch cache
class PackedPlan:
    """Which pieces make up each global batch of packed rows, and which rows belong to this host."""

    lengths: np.ndarray  # targets per record
    seq_len: int
    batch_size: int  # rows per global batch
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = None
    shard_index: int = 0
    shard_count: int = 1

    def __post_init__(self):
        if self.batch_size % self.shard_count:
            raise ValueError(f"the global batch_size={self.batch_size} does not split evenly over "
                             f"shard_count={self.shard_count} hosts; use a multiple of {self.shard_count}")

    @functools.lru_cache(maxsize=2)
    def rows(self, epoch: int) -> list[list[tuple]]:
        n = len(self.lengths)
        order = Permutation(n, self.seed, epoch)(np.arange(n)) if self.shuffle else np.arange(n)
        started = time.monotonic()
        rows = pack_rows(self.lengths, order, self.seq_len)
        used = int(self.lengths.sum())
        kept = len(rows) // self.batch_size * self.batch_size
        log.info("packing epoch %d: %d examples into %d rows of %d (%.1f%% real tokens); %d batches, the last %d "
                 "row(s) wait for no batch this epoch; %.2f s", epoch, n, len(rows), self.seq_len,
                 100 * used / max(1, len(rows) * self.seq_len), kept // self.batch_size, len(rows) - kept,
                 time.monotonic() - started)
        return rows

    def efficiency(self, epoch: int = 0) -> float:
        """Real tokens / all tokens of the rows of `epoch`."""
        rows = self.rows(epoch)
        return sum(n for row in rows for _, _, n in row) / (len(rows) * self.seq_len)

    @functools.lru_cache(maxsize=None)  # noqa: B019 - an int per epoch, for the plan's life
    def batches_in(self, epoch: int) -> int:
        """Batches of `epoch`, kept once known: `locate` walks the epochs before k, and laying each out again
        (the layouts themselves are cached two at a time) made every batch of a later epoch repack all earlier ones."""
        return len(self.rows(epoch)) // self.batch_size

    @property
    def num_batches(self) -> int | None:
        if self.num_epochs is None:
            return None
        return sum(self.batches_in(e) for e in range(self.num_epochs))

    def locate(self, k: int) -> tuple[int, int]:
        """Global batch k -> (epoch, batch within the epoch)."""
        epoch = 0
        while self.num_epochs is None or epoch < self.num_epochs:
            count = self.batches_in(epoch)
            if k < count:
                return epoch, k
            k -= count
            epoch += 1
        raise IndexError("past the last batch")

    def host_rows(self, k: int) -> list[list[tuple]]:
        epoch, j = self.locate(k)
        per_host = self.batch_size // self.shard_count
        first = j * self.batch_size + self.shard_index * per_host
        return self.rows(epoch)[first:first + per_host]


def assemble(rows: list[list[tuple]], ids: dict[int, np.ndarray], seq_len: int) -> dict[str, np.ndarray]:
    """The arrays of packed rows, from each record's token ids."""
    out = {k: np.zeros((len(rows), seq_len), np.int32) for k in ("tokens", "targets", "segment_ids", "positions")}
    for r, row in enumerate(rows):
        at = 0
        for segment, (record, start, n) in enumerate(row, 1):
            piece = ids[record]
            out["tokens"][r, at:at + n] = piece[start:start + n]
            out["targets"][r, at:at + n] = piece[start + 1:start + n + 1]
            out["segment_ids"][r, at:at + n] = segment
            out["positions"][r, at:at + n] = np.arange(n)
            at += n
    return out


class PackedLoader:
    """An iterable of packed batches; each `iter()` starts at batch 0 (`set_state` resumes exactly)."""

    def __init__(self, source, reader, decoder, packing: Packing, plan_args: dict, prefetch: int = 2,
                 sharding=None, device_prefetch: int = 2):
        self.source, self._reader, self._decoder, self.packing = source, reader, decoder, packing
        self._prefetch, self._sharding, self._device_prefetch = prefetch, sharding, device_prefetch
        self.plan = PackedPlan(self._lengths(), packing.seq_len, **plan_args)
        self.plan.rows(0)  # now, before reader threads would race to compute it

    def _ids(self, records: list[bytes]) -> list[np.ndarray]:
        values = [self._decoder(r)[self.packing.feature] for r in records]
        if self.packing.tokenize_batch is not None:
            return [np.asarray(ids) for ids in self.packing.tokenize_batch(values)]
        return [np.asarray(self.packing.tokenize(v)) for v in values]

    def _lengths(self) -> np.ndarray:
        started, n = time.monotonic(), len(self.source)
        lengths = np.empty(n, np.int64)
        for first in range(0, n, _LENGTH_READ):
            indices = np.arange(first, min(n, first + _LENGTH_READ))
            lengths[indices] = [max(len(t) - 1, 0) for t in self._ids(self._reader(indices))]
        log.info("packing: read the token counts of %d examples (%d targets) in %.1f s", n, int(lengths.sum()),
                 time.monotonic() - started)
        return lengths

    def __len__(self) -> int:
        if self.plan.num_batches is None:
            raise TypeError("an endless loader (num_epochs=None) has no length")
        return self.plan.num_batches

    def __iter__(self) -> PackedIterator:
        return PackedIterator(self)

    def host_batch(self, k: int) -> dict[str, np.ndarray]:
        rows = self.plan.host_rows(k)
        records = np.array(sorted({record for row in rows for record, _, _ in row}), np.int64)
        ids = dict(zip(records.tolist(), self._ids(self._reader(records)))) if len(records) else {}
        return assemble(rows, ids, self.plan.seq_len)

    def state_key(self) -> dict:
        plan = self.plan
        return {"num_records": len(plan.lengths), "batch_size": plan.batch_size, "seed": plan.seed,
                "shuffle": plan.shuffle, "num_epochs": plan.num_epochs, "seq_len": plan.seq_len,
                "packed_targets": int(plan.lengths.sum())}


class PackedIterator(Iterator):
    """Batches from the current index on, `prefetch` of them read ahead on threads; `get_state()`/`set_state()`."""

    def __init__(self, loader: PackedLoader):
        self._loader = loader
        self._lock = threading.Lock()
        self._start(0)

    def _start(self, k: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max(1, self._loader._prefetch), thread_name_prefix="packing")
        self._next, self._consumed, self._pending = k, k, {}
        self._device = None
        if self._loader._sharding is not None:
            from loader.device import DevicePrefetcher

            self._device = DevicePrefetcher(self._host_next, self._loader._sharding, self._loader._device_prefetch)

    def _total(self) -> int | None:
        return self._loader.plan.num_batches

    def _batch(self, k: int) -> dict[str, np.ndarray]:
        return self._loader.host_batch(k)

    def _host_next(self):
        with self._lock:
            k = self._next
            total = self._total()
            if total is not None and k >= total:
                raise StopIteration
            for ahead in range(k, k + max(1, self._loader._prefetch) + 1):
                if (total is None or ahead < total) and ahead not in self._pending:
                    self._pending[ahead] = self._pool.submit(self._batch, ahead)
            future = self._pending.pop(k)
            self._next = k + 1
        return future.result()

    def __next__(self):
        batch = self._device.get() if self._device is not None else self._host_next()
        self._consumed += 1
        return batch

    def get_state(self) -> dict:
        return {"next_batch": self._consumed, **self._loader.state_key()}

    def set_state(self, state: dict) -> None:
        key = self._loader.state_key()
        mismatched = {k: (state.get(k), v) for k, v in key.items() if state.get(k) != v}
        if mismatched:
            raise ValueError(f"this packed loader state does not match the data or options (saved, now): {mismatched}")
        self.close()
        self._start(int(state["next_batch"]))

    def close(self) -> None:
        if self._device is not None:
            self._device.close()
        for future in self._pending.values():
            future.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
