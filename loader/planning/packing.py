"""Packing variable-length token sequences into rows of `seq_len` tokens, lazily, keeping the loader's guarantees.

The layout needs one number per document, its token count (loader/planning/counts.py: a pre-tokenized dataset's
`.counts` column, memory-mapped, or counted once at load time and cached). Epoch e's permutation is cut into blocks of
BLOCK documents; block b is packed alone, in C (loader/planning/_pack.c): each document cut into pieces of at most
`seq_len` targets, each piece placed into one of the WINDOW newest rows of the block that has room (first fit: the
oldest; best fit: the fullest), else into a new row. A block's rows are a pure function of (counts, seed, epoch, block),
so the first batch needs only the first block (milliseconds, whatever the corpus size) and memory holds a few blocks,
never the corpus.

Epoch e's rows are its blocks' rows in order; its batch j is rows [j*B, (j+1)*B) (the last rows of an epoch that fill
no batch wait for none); host i of n takes rows [i*B/n, (i+1)*B/n) of each. So the global batches are the same for
any host count, and a loader's state (the batch index and where that batch's first row lies: epoch, block, row)
resumes exactly, on any number of hosts, without laying out what came before.

A row carries `tokens`, `targets`, `segment_ids` (1, 2, ... per piece, 0 = padding) and `positions` (restarting at
each piece): a model that masks attention by segment never lets one example see another. `keys="maxtext"` names them
as MaxText's pipeline does (inputs, targets, inputs_segmentation, inputs_position, targets_segmentation,
targets_position).

    batches = loader.load("out/tokens", batch_size=32, packing=loader.Packing(seq_len=1024))  # pre-tokenized
    packing = loader.Packing("text", 1024, tokenize=my_ids, cache_key="my-tokenizer-v1")      # tokenised on the fly

The plan's parts are defined here (`PackedPlan.batch_at`: which pieces go in which row of batch k; `Job`: one batch's
pieces and the records they read); loader/packed.py makes each batch's Job in order (`Jobs`) and does the work
(reading, decoding and tokenising the records, laying the pieces into arrays: `Assembler`) on the loader's executor.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from loader.planning import _pack
from loader.planning.batches import check_hosts
from loader.planning.permutation import Permutation

log = logging.getLogger(__name__)

BLOCK = 1 << 16  # documents of the epoch's permutation packed together: ~10 ms in C
WINDOW = 64  # rows of a block still open for a piece; older rows are closed
FITS = ("first", "best")
ROW_KEYS = ("tokens", "targets", "segment_ids", "positions")
KEY_PRESETS = {
    "default": {k: (k,) for k in ROW_KEYS},
    # MaxText's names (its grain pipeline's packed features); segmentation and positions serve inputs and targets.
    "maxtext": {"tokens": ("inputs",), "targets": ("targets",),
                "segment_ids": ("inputs_segmentation", "targets_segmentation"),
                "positions": ("inputs_position", "targets_position")},
}


@dataclasses.dataclass(frozen=True)
class Packing:
    """What to pack. A pre-tokenized dataset needs only `seq_len`. For text, `tokenize(value)` turns a record's
    `feature` into token ids (int array); an example of k ids gives k - 1 next-token targets (its first id is only an
    input, e.g. BOS)."""

    feature: str | None = None  # None: the pre-tokenized dataset's tokens
    seq_len: int | None = None
    tokenize: Callable[[Any], np.ndarray] | None = None
    # Optional: many values at once (a tokenizer's batch call, in native threads); used in place of `tokenize`.
    tokenize_batch: Callable[[list], list[np.ndarray]] | None = None
    fit: str = "first"  # "first" or "best": the open row a piece goes to (best fit leaves less padding)
    # Names the tokenizer (e.g. its file's hash): the token counts are then cached and counted once per dataset.
    cache_key: str | None = None
    keys: str | Mapping[str, str | tuple[str, ...]] = "default"  # "maxtext", or {our name: its name(s)}

    def __post_init__(self):
        if self.feature is not None and not isinstance(self.feature, str):
            raise ValueError(f"Packing's first argument is feature=, the records' text feature (got "
                             f"{self.feature!r}); pass the row length by name: Packing(seq_len={self.feature!r})")
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, (int, np.integer)) or self.seq_len < 1:
            raise ValueError(f"seq_len must be a whole number >= 1 (got seq_len={self.seq_len!r})")
        for name in ("tokenize", "tokenize_batch"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise ValueError(f"{name}= takes a function (got {name}={getattr(self, name)!r})")
        if self.fit not in FITS:
            raise ValueError(f"fit={self.fit!r} is not one of {FITS}")
        if (self.tokenize is not None or self.tokenize_batch is not None) and self.feature is None:
            raise ValueError("tokenize= needs feature= (the record's text feature to tokenise)")
        row_keys(self.keys)

    @property
    def tokenized(self) -> bool:
        """True when the records hold token ids already (no tokenize function)."""
        return self.tokenize is None and self.tokenize_batch is None


def row_keys(keys: str | Mapping) -> dict[str, tuple[str, ...]]:
    """{our row array: the names it is given} for `Packing.keys`."""
    if isinstance(keys, str):
        if keys not in KEY_PRESETS:
            raise ValueError(f"keys={keys!r} is not one of {sorted(KEY_PRESETS)} or a mapping of {ROW_KEYS} to names")
        return KEY_PRESETS[keys]
    unknown = set(keys) - set(ROW_KEYS)
    if unknown:
        raise ValueError(f"keys= names {sorted(unknown)}, which are not packed arrays; map some of {ROW_KEYS}")
    return {k: (lambda v: (v,) if isinstance(v, str) else tuple(v))(keys.get(k, k)) for k in ROW_KEYS}


class Block(NamedTuple):
    """One block's rows, as segments ordered by row: segment s is `records[s]` from target `starts[s]`, `lengths[s]`
    targets, in row `first_rows[s]`; a run of a long document's full rows is one segment of `row_counts[s]` rows (row
    first_rows[s] + j holds its targets from starts[s] + j * lengths[s]). Its size is bounded by its documents."""

    records: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    first_rows: np.ndarray
    row_counts: np.ndarray
    rows: int

    def row(self, r: int) -> list[tuple[int, int, int]]:
        if not 0 <= r < self.rows:
            raise IndexError(f"row {r} of a block of {self.rows} rows")
        lo, hi = np.searchsorted(self.first_rows, r, "left"), np.searchsorted(self.first_rows, r, "right")
        if lo == hi:  # inside a run that began on an earlier row
            lo, hi = lo - 1, lo
        if hi - lo == 1:
            s = int(lo)
            n = int(self.lengths[s])
            return [(int(self.records[s]), int(self.starts[s]) + (r - int(self.first_rows[s])) * n, n)]
        return list(zip(self.records[lo:hi].tolist(), self.starts[lo:hi].tolist(), self.lengths[lo:hi].tolist()))

    def row_list(self) -> list[list[tuple[int, int, int]]]:
        return [self.row(r) for r in range(self.rows)]

    @property
    def targets(self) -> int:
        """The real (not padding) targets of its rows."""
        return int(np.dot(self.lengths, self.row_counts))


def pack_block(targets: np.ndarray, seq_len: int, fit: str = "first", window: int = WINDOW
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """(docs, starts, lengths, first rows, row counts, rows) of the segments of documents with `targets` targets
    each, in order (loader/planning/_pack.c); memory and time are bounded by the documents, whatever their targets."""
    targets = np.ascontiguousarray(targets, np.int64)
    out = [np.empty(max(2 * len(targets), 1), np.int64) for _ in range(5)]
    rows, segments = _pack.pack(targets.tobytes(), seq_len, window, fit == "best", *out)
    return (*(a[:segments] for a in out), rows)


def pack_rows(lengths: np.ndarray, order: np.ndarray, seq_len: int, fit: str = "first", window: int = WINDOW
              ) -> list[list[tuple]]:
    """Rows of (record, first target, targets) pieces of `order`'s examples packed together (one block)."""
    order = np.asarray(order, np.int64)
    docs, *rest = pack_block(np.asarray(lengths)[order], seq_len, fit, window)
    return Block(order[docs], *rest).row_list()


class Layout:
    """The rows of every (epoch, block): a pure function of the token counts, seq_len, fit, seed and shuffle."""

    def __init__(self, counts: Callable[[np.ndarray], np.ndarray], n: int, seq_len: int, fit: str = "first",
                 seed: int = 0, shuffle: bool = True, block: int | None = None):
        if n < 1:
            raise ValueError("there are no documents to pack")
        self.counts, self.n, self.seq_len, self.fit = counts, n, seq_len, fit
        self.seed, self.shuffle, self.block_size = seed, shuffle, block or BLOCK
        self.blocks = -(-n // self.block_size)  # per epoch
        self._rows: dict[tuple[int, int], int] = {}
        self._told = False  # the first block laid out is logged (rows_in's counts, before it, are not)
        self._lock = threading.Lock()
        self.block = functools.lru_cache(maxsize=8)(self._block)  # a few blocks, per layout (not a global cache)

    def _records(self, epoch: int, b: int) -> np.ndarray:
        positions = np.arange(b * self.block_size, min(self.n, (b + 1) * self.block_size), dtype=np.int64)
        return Permutation(self.n, self.seed, epoch)(positions) if self.shuffle else positions

    def _targets(self, records: np.ndarray) -> np.ndarray:
        return np.maximum(np.asarray(self.counts(records), np.int64) - 1, 0)

    def _block(self, epoch: int, b: int) -> Block:
        """Block b of `epoch`, packed (`block`: the same, cached)."""
        started = time.monotonic()
        records = self._records(epoch, b)
        docs, *rest = pack_block(self._targets(records), self.seq_len, self.fit)
        block = Block(records[docs], *rest)
        with self._lock:
            first, self._told, self._rows[epoch, b] = not self._told, True, block.rows
        if first:
            log.info("packing %d examples into rows of %d tokens (%s fit, blocks of %d examples): block %d of epoch %d "
                     "is %d rows, %.1f%% real tokens, laid out in %.0f ms", self.n, self.seq_len, self.fit,
                     self.block_size, b, epoch, block.rows, 100 * block.targets / max(1, block.rows * self.seq_len),
                     1000 * (time.monotonic() - started))
        return block

    def rows_in(self, epoch: int, b: int) -> int:
        """Rows of block b of `epoch` (counted without keeping the block when it is not at hand)."""
        with self._lock:
            known = self._rows.get((epoch, b))
        if known is None:
            known = _pack.pack(self._targets(self._records(epoch, b)).tobytes(), self.seq_len, WINDOW,
                               self.fit == "best", None, None, None, None, None)
            with self._lock:
                self._rows[epoch, b] = known
        return known

    def epoch_rows(self, epoch: int) -> int:
        started = time.monotonic()
        rows = sum(self.rows_in(epoch, b) for b in range(self.blocks))
        if time.monotonic() - started > 1:
            log.info("packing: laid out all %d blocks of epoch %d (%d rows) in %.1f s to count its batches",
                     self.blocks, epoch, rows, time.monotonic() - started)
        return rows


class Position(NamedTuple):
    """Where a batch's first row lies: block `block` of epoch `epoch`, its row `row`."""

    epoch: int
    block: int
    row: int


START = Position(0, 0, 0)


@dataclasses.dataclass(frozen=True, eq=False)
class PackedPlan:
    """Which rows make up each global batch, and which of them belong to this host."""

    layout: Layout
    batch_size: int  # rows per global batch
    num_epochs: int | None = None
    shard_index: int = 0
    shard_count: int = 1
    drop_remainder: bool = True  # False: an epoch's rows that fill no batch are its last, short batch

    def __post_init__(self):
        check_hosts(self.batch_size, self.shard_index, self.shard_count)
        if not self.drop_remainder and self.num_epochs is None:
            raise ValueError("drop_remainder=False keeps each epoch's last, short batch, and an endless loader "
                             "(num_epochs=None) has no last batch: set num_epochs, or keep drop_remainder=True")
        if self.drop_remainder and self.layout.blocks == 1:  # a small corpus (one block: counting its rows costs
            self.batches_in(0)                              # little), where a batch_size over them is likely: said now

    @property
    def seq_len(self) -> int:
        return self.layout.seq_len

    def batch_at(self, at: Position) -> tuple[list[tuple[Block, int]], Position] | None:
        """This host's rows (block, row) of the batch whose first row is at or after `at`, and the position after it;
        None past the last epoch. An epoch's last rows that fill no batch are passed over, or with drop_remainder=False
        are its last batch: host i of n takes its rows [i*B/n, (i+1)*B/n) of it, so fewer, or none."""
        layout, size = self.layout, self.batch_size
        epoch, b, r = at
        while self.num_epochs is None or epoch < self.num_epochs:
            rows: list[tuple[Block, int]] = []
            while len(rows) < size and b < layout.blocks:
                block = layout.block(epoch, b)
                take = min(size - len(rows), block.rows - r)
                rows += [(block, r + i) for i in range(take)]
                r += take
                if r >= block.rows:
                    b, r = b + 1, 0
            if len(rows) == size or (rows and not self.drop_remainder):
                per_host = size // self.shard_count
                return rows[self.shard_index * per_host:(self.shard_index + 1) * per_host], Position(epoch, b, r)
            if at == Position(epoch, 0, 0) and self.drop_remainder:
                raise self._short(epoch, len(rows))
            epoch, b, r = epoch + 1, 0, 0
            at = Position(epoch, 0, 0)
        return None

    def _short(self, epoch: int, rows: int) -> ValueError:
        return ValueError(f"epoch {epoch} packs into {rows} rows of {self.seq_len} tokens, fewer than "
                          f"batch_size={self.batch_size}: lower batch_size or seq_len, or add data")

    def batches_in(self, epoch: int) -> int:
        """The batches of `epoch`; an epoch whose rows fill no batch (drop_remainder) is the error iterating gives, so
        that len() never counts batches iterating does not reach. (Epochs of a shuffled corpus pack into rows a few
        apart: a batch_size close to them may fit one epoch and not the next.)"""
        rows = self.layout.epoch_rows(epoch)  # (the layout keeps each block's row count)
        if self.drop_remainder and rows < self.batch_size:
            raise self._short(epoch, rows)
        return rows // self.batch_size if self.drop_remainder else -(-rows // self.batch_size)

    @property
    def num_batches(self) -> int | None:
        if self.num_epochs is None:
            return None
        return sum(self.batches_in(e) for e in range(self.num_epochs))

    def efficiency(self, epoch: int = 0) -> float:
        """Real tokens / all tokens of the rows of `epoch` (lays out the whole epoch)."""
        layout = self.layout
        real = rows = 0
        for b in range(layout.blocks):
            block = layout.block(epoch, b)
            real += block.targets
            rows += block.rows
        return real / max(1, rows * self.seq_len)


@dataclasses.dataclass(frozen=True)
class Job:
    """One packed batch as the plan lays it out: its rows' pieces (record, first target, targets), the records they
    read (sorted), each one's token count, and arrays the batch carries as they are (a mixture's components)."""

    rows: list[list[tuple[int, int, int]]]
    records: np.ndarray
    counts: np.ndarray
    extra: dict

    @classmethod
    def of(cls, rows: list[list[tuple]], counts: Callable[[np.ndarray], np.ndarray], extra: dict | None = None) -> Job:
        records = np.array(sorted({record for row in rows for record, _, _ in row}), np.int64)
        return cls(rows, records, np.asarray(counts(records)) if len(records) else np.empty(0, np.int64), extra or {})
