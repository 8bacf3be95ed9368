"""Which records make up global batch k, and which rows of it belong to this host.

The dataset is an endless sequence of positions: position p is record `perm_e(p mod N)` of
epoch e = p // N, where perm_e is the exact permutation for (seed, e) (the identity when
shuffling is off). Global batch k is positions [k*B, (k+1)*B); host i of n takes rows
[i*B/n, (i+1)*B/n) of it. Nothing here depends on the host count or the worker count, so
concatenating the hosts' batches gives the same global batch for any n, and the iterator
state is just k.

A resume with another batch size continues the stream where it stopped: a plan whose batches
from `start_batch` on begin at `start_position` (global batch k >= start_batch is positions
[start_position + (k - start_batch)*B, ...)), so every record is still read once an epoch.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from loader.planning.permutation import Permutation

FOREVER = 1 << 62  # batches in an endless run: an index grain can hold, never reached
NEVER = np.iinfo(np.int64).max  # next_reads: not read again on this host within the horizon


def check_hosts(batch_size: int, shard_index: int, shard_count: int) -> None:
    """A plan's host `shard_index` of `shard_count`, each taking an equal part of a global batch of `batch_size`."""
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index must be in [0, shard_count) (got shard_index={shard_index}, "
                         f"shard_count={shard_count})")
    if batch_size % shard_count:
        raise ValueError(f"the global batch_size={batch_size} does not split evenly over shard_count={shard_count} "
                         f"hosts; use a multiple of {shard_count}")


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    num_records: int
    batch_size: int  # global
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = None  # None: forever
    drop_remainder: bool = True
    shard_index: int = 0
    shard_count: int = 1
    start_batch: int = 0  # this segment's first batch (a resume with another batch size)
    start_position: int = 0  # where it begins in the stream

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 (got batch_size={self.batch_size})")
        check_hosts(self.batch_size, self.shard_index, self.shard_count)
        if self.num_epochs is not None and self.num_epochs < 1:
            raise ValueError(f"num_epochs must be >= 1 or None for forever (got num_epochs={self.num_epochs})")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0 (got seed={self.seed})")

    @property
    def per_host(self) -> int:
        return self.batch_size // self.shard_count

    @property
    def origin(self) -> int:
        """Where batch 0 would begin: batch k begins at origin + k * batch_size."""
        return self.start_position - self.start_batch * self.batch_size

    def position(self, k: int) -> int:
        """Where global batch k begins in the stream."""
        return self.origin + k * self.batch_size

    def continued(self, next_batch: int, position: int) -> BatchPlan:
        """This plan with batch `next_batch` beginning at stream `position` (a state saved with another batch size)."""
        if next_batch < 0 or position < 0:
            raise ValueError(f"a loader state puts batch {next_batch} at record {position} of the stream, before its "
                             "start: it is not a state get_state() gave; restore one that is")
        if position == next_batch * self.batch_size:
            return dataclasses.replace(self, start_batch=0, start_position=0)
        return dataclasses.replace(self, start_batch=next_batch, start_position=position)

    @property
    def num_batches(self) -> int:
        if self.num_epochs is None:
            return FOREVER
        total = max(0, self.num_epochs * self.num_records - self.start_position)
        left = total // self.batch_size if self.drop_remainder else -(-total // self.batch_size)
        return self.start_batch + left

    @functools.lru_cache(maxsize=4)
    def _permutation(self, epoch: int) -> Permutation:
        return Permutation(self.num_records, self.seed, epoch)

    def host_indices(self, k: int) -> np.ndarray:
        """Global record indices of this host's rows of global batch k, in row order."""
        return self.host_indices_range(k, k + 1)[0]

    def host_indices_range(self, first_batch: int, end_batch: int) -> list[np.ndarray]:
        """`host_indices(k)` for k in [first_batch, end_batch), computed in one vectorised pass."""
        positions = self.host_positions_range(first_batch, end_batch)
        counts = [len(p) for p in positions]
        return np.split(self.indices_at(np.concatenate(positions)), np.cumsum(counts)[:-1])

    def host_positions_range(self, first_batch: int, end_batch: int) -> list[np.ndarray]:
        """Per batch k in [first_batch, end_batch), the positions of this host's rows (position p is record
        `indices_at(p)` of epoch `p // num_records`)."""
        if first_batch < self.start_batch:
            raise IndexError(f"batch {first_batch} comes before this plan's segment, which starts at batch "
                             f"{self.start_batch}")
        total = None if self.num_epochs is None else self.num_epochs * self.num_records
        return host_rows(first_batch, end_batch, self.batch_size, self.shard_index, self.shard_count,
                         self.num_batches, total, self.origin)

    def next_reads(self, positions: np.ndarray, records: np.ndarray, horizon: int) -> np.ndarray:
        """For the record read at each stream position, the position of its next read by this host within the
        `horizon` epochs that follow (loader/fetch/planned_cache.py), else NEVER. `records` are the records at
        `positions` (`indices_at(positions)`)."""
        n, per_host = self.num_records, self.per_host
        positions = np.asarray(positions, dtype=np.int64)
        records = np.asarray(records, dtype=np.int64)
        out = np.full(len(positions), NEVER, dtype=np.int64)
        total = None if self.num_epochs is None else self.num_epochs * n
        pending = np.arange(len(positions))
        for step in range(1, horizon + 1):
            epochs = positions[pending] // n + step
            found = np.zeros(len(pending), dtype=bool)
            for epoch in np.unique(epochs).tolist():
                at = np.flatnonzero(epochs == epoch)
                mine = records[pending[at]]
                within = self._permutation(epoch).inverse(mine) if self.shuffle else mine
                then = epoch * n + within
                here = ((then - self.origin) % self.batch_size) // per_host == self.shard_index
                if total is not None:
                    here &= then < total
                if self.drop_remainder:
                    here &= then < self.position(self.num_batches)
                out[pending[at[here]]] = then[here]
                found[at[here]] = True
            pending = pending[~found]
            if not len(pending):
                break
        return out

    def record_rngs(self, positions: np.ndarray, indices: np.ndarray) -> list[np.random.Generator]:
        """For `random_map_fn`: a generator per position from (seed, epoch, record) alone; `indices` are
        `indices_at(positions)`, which the caller has already."""
        positions = np.asarray(positions, dtype=np.int64)
        return [record_rng(self.seed, int(p), int(i)) for p, i in zip(positions // self.num_records, indices)]

    def indices_at(self, positions: np.ndarray) -> np.ndarray:
        """The global record index at each position."""
        if not self.shuffle:
            return positions % self.num_records
        epochs = positions // self.num_records
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self._permutation(int(epoch))(positions[mask] % self.num_records)
        return out


def record_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator `random_map_fn` gets for global record `index` in `epoch`: a function of these alone."""
    return np.random.default_rng((seed, epoch, index))


def host_rows(first_batch: int, end_batch: int, batch_size: int, shard_index: int, shard_count: int,
              num_batches: int, total: int | None, origin: int = 0) -> list[np.ndarray]:
    """Per global batch k in [first_batch, end_batch), this host's positions of the stream: rows
    [o + k*B + i*B/n, o + k*B + (i+1)*B/n) for host i of n (o: `origin`), cut at `total` positions (a partial last
    batch)."""
    if not 0 <= first_batch < end_batch <= num_batches:
        raise IndexError(f"batches [{first_batch}, {end_batch}) are outside [0, {num_batches})")
    per_host = batch_size // shard_count
    ks = np.arange(first_batch, end_batch, dtype=np.int64)
    starts = origin + ks * batch_size + shard_index * per_host
    positions = (starts[:, None] + np.arange(per_host, dtype=np.int64)[None, :]).ravel()
    if total is None:
        return np.split(positions, np.arange(1, len(ks)) * per_host)
    positions = positions[positions < total]  # the last batch may be partial (drop_remainder=False)
    counts = np.clip(total - starts, 0, per_host)
    return np.split(positions, np.cumsum(counts)[:-1])
