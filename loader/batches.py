"""Which records make up global batch k, and which rows of it belong to this host.

The dataset is an endless sequence of positions: position p is record `perm_e(p mod N)` of
epoch e = p // N, where perm_e is the exact permutation for (seed, e) (the identity when
shuffling is off). Global batch k is positions [k*B, (k+1)*B); host i of n takes rows
[i*B/n, (i+1)*B/n) of it. Nothing here depends on the host count or the worker count, so
concatenating the hosts' batches gives the same global batch for any n, and the iterator
state is just k.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from loader.permutation import Permutation

FOREVER = 1 << 62  # batches in an endless run: an index grain can hold, never reached


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

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 (got batch_size={self.batch_size})")
        if not 0 <= self.shard_index < self.shard_count:
            raise ValueError(f"shard_index must be in [0, shard_count) (got shard_index={self.shard_index}, "
                             f"shard_count={self.shard_count})")
        if self.batch_size % self.shard_count:
            raise ValueError(f"the global batch_size={self.batch_size} does not split evenly over "
                             f"shard_count={self.shard_count} hosts; use a multiple of {self.shard_count}")
        if self.num_epochs is not None and self.num_epochs < 1:
            raise ValueError(f"num_epochs must be >= 1 or None for forever (got num_epochs={self.num_epochs})")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0 (got seed={self.seed})")

    @property
    def per_host(self) -> int:
        return self.batch_size // self.shard_count

    @property
    def num_batches(self) -> int:
        if self.num_epochs is None:
            return FOREVER
        total = self.num_epochs * self.num_records
        return total // self.batch_size if self.drop_remainder else -(-total // self.batch_size)

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
        if not 0 <= first_batch < end_batch <= self.num_batches:
            raise IndexError(f"batches [{first_batch}, {end_batch}) are outside [0, {self.num_batches})")
        ks = np.arange(first_batch, end_batch, dtype=np.int64)
        starts = ks * self.batch_size + self.shard_index * self.per_host
        positions = (starts[:, None] + np.arange(self.per_host, dtype=np.int64)[None, :]).ravel()
        if self.num_epochs is not None:  # the last batch may be partial (drop_remainder=False)
            positions = positions[positions < self.num_epochs * self.num_records]
        counts = np.clip(self.num_epochs * self.num_records - starts, 0, self.per_host) if self.num_epochs is not None \
            else np.full(len(ks), self.per_host)
        return np.split(positions, np.cumsum(counts)[:-1])

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
