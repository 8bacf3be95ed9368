"""`loader.load`: deterministic, globally shuffled, prefetched batches, exactly resumable.

    import loader
    batches = loader.load("out/", batch_size=256, seed=0)   # a converted dir, a TFDS dir, or a glob
    it = iter(batches)
    batch = next(it)                  # {"image": array[256, ...], "label": array[256]}
    state = it.get_state()            # small, JSON-serialisable
    it.set_state(state)               # continues with bitwise-identical batches

The grain chain, one global batch per element (reads are batched, so batching comes first):

    MapDataset.range(start, num_batches)     global batch index k
      .map(host rows of batch k)             exact permutation per (seed, epoch); host slice
      .map(read, decode, map_fn, collate)    reads grouped by shard
      .to_iter_dataset(ReadOptions)          thread prefetch
      .mp_prefetch(...)                      worker processes, when asked for
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import grain
import numpy as np

from loader.batches import BatchPlan
from loader.decode import Decoder, collate, make_decoder
from loader.device import to_global_arrays
from loader.reader import BatchReader
from loader.source import ShardedSource, resolve

log = logging.getLogger(__name__)

STATE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class LoaderConfig:
    """Everything `load` takes besides the source. Validated on construction."""

    batch_size: int
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = None
    drop_remainder: bool = True
    shard_index: int | None = None  # default: jax.process_index() when JAX is in use, else 0
    shard_count: int | None = None  # default: jax.process_count() when JAX is in use, else 1
    decode: str | Decoder | None = "auto"
    map_fn: Callable[[Any], Any] | None = None  # applied to each record after decoding
    split: str | None = None  # for TFDS sources; default "train"
    worker_count: int = 0  # grain worker processes (0: none, reads run in this process)
    num_threads: int = 1  # prefetch threads per process
    prefetch: int = 4  # batches read ahead
    allow_incomplete: bool = False
    sharding: Any = None  # a jax.sharding.Sharding: yield global jax.Arrays placed ahead of time
    device_prefetch: int = 2  # batches in flight to the devices when sharding is set

    def __post_init__(self):
        for name in ("worker_count", "prefetch", "device_prefetch"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (got {name}={getattr(self, name)})")
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 (got num_threads={self.num_threads})")
        if (self.shard_index is None) != (self.shard_count is None):
            raise ValueError("pass both shard_index and shard_count, or neither (to use JAX's process index/count)")


def _host_shard(config: LoaderConfig) -> tuple[int, int]:
    if config.shard_count is not None:
        return config.shard_index, config.shard_count
    if "jax" in sys.modules:  # JAX is in use: one host shard per process
        import jax

        return jax.process_index(), jax.process_count()
    return 0, 1


class _ReadBatch:
    """Global batch index -> this host's batch (raw list of bytes, or collated decoded records)."""

    def __init__(self, plan: BatchPlan, source: ShardedSource, decoder: Decoder | None, map_fn):
        self._plan = plan
        self._source = source
        self._reader = BatchReader(source)
        self._decoder = decoder
        self._map_fn = map_fn

    def __call__(self, k: int):
        indices = self._plan.host_indices(int(k))
        records = self._reader(indices)
        if self._decoder is None and self._map_fn is None:
            return records
        items = [self._decode(r, i) for r, i in zip(records, indices)] if self._decoder else records
        if self._map_fn is not None:
            items = [self._map_fn(item) for item in items]
        return collate(items)

    def _decode(self, record: bytes, index: int):
        try:
            return self._decoder(record)
        except Exception as e:  # noqa: BLE001 - re-raised with the shard and record named
            shard = int(np.searchsorted(self._source.starts, index, side="right") - 1)
            local = int(index - self._source.starts[shard])
            raise ValueError(f"{self._source.paths[shard]}: record {local} does not decode ({type(e).__name__}: "
                             f"{e}); pass decode=None for raw bytes, or another decode=") from e


class Loader:
    """An iterable of batches; each `iter()` starts at batch 0 (use `set_state` to resume)."""

    def __init__(self, source: str | ShardedSource, config: LoaderConfig):
        self.config = config
        self.source = source if isinstance(source, ShardedSource) else resolve(
            source, split=config.split, allow_incomplete=config.allow_incomplete)
        shard_index, shard_count = _host_shard(config)
        self.plan = BatchPlan(len(self.source), config.batch_size, config.seed, config.shuffle, config.num_epochs,
                              config.drop_remainder, shard_index, shard_count)
        self._read_batch = _ReadBatch(self.plan, self.source, make_decoder(config.decode, self.source.features_dir),
                                      config.map_fn)

    def __len__(self) -> int:
        if self.config.num_epochs is None:
            raise TypeError("an endless loader (num_epochs=None) has no length")
        return self.plan.num_batches

    def __iter__(self) -> LoaderIterator:
        return LoaderIterator(self)

    def _dataset(self, start: int) -> grain.IterDataset:
        ds = (
            grain.MapDataset.range(start, self.plan.num_batches)
            .map(self._read_batch)
            .to_iter_dataset(grain.ReadOptions(num_threads=self.config.num_threads,
                                               prefetch_buffer_size=self.config.prefetch))
        )
        if self.config.worker_count:
            _absl_flags_parsed()
            ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.config.worker_count,
                                                             per_worker_buffer_size=max(1, self.config.prefetch)))
        return ds

    def state_key(self) -> dict:
        """What a saved state must agree with to be restored here (the host/worker counts may differ)."""
        plan = self.plan
        return {"num_records": plan.num_records, "batch_size": plan.batch_size, "seed": plan.seed,
                "shuffle": plan.shuffle, "num_epochs": plan.num_epochs, "drop_remainder": plan.drop_remainder}


def _absl_flags_parsed() -> None:
    """grain's worker processes read absl flags; outside `absl.app.run` nobody parsed them.
    Mark them parsed with their defaults (a caller's own parsing, if any, already happened)."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


class LoaderIterator(Iterator):
    """Iterator over a Loader's batches with `get_state()` / `set_state()`.

    The state counts the batches handed to the caller, so batches prefetched (to host or device)
    but not yet taken are read again after a restore, never skipped.
    """

    def __init__(self, loader: Loader, start: int = 0):
        self._loader = loader
        self._next = start
        self._restart(start)

    def _restart(self, start: int) -> None:
        self._it = iter(self._loader._dataset(start))
        self._on_device: collections.deque = collections.deque()

    def __next__(self):
        sharding = self._loader.config.sharding
        if sharding is None:
            batch = next(self._it)
        else:
            while len(self._on_device) <= self._loader.config.device_prefetch:
                try:
                    self._on_device.append(to_global_arrays(next(self._it), sharding))
                except StopIteration:
                    break
            if not self._on_device:
                raise StopIteration
            batch = self._on_device.popleft()
        self._next += 1
        return batch

    def get_state(self) -> dict:
        return {"version": STATE_VERSION, "next_batch": self._next, **self._loader.state_key()}

    def set_state(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')!r} is not {STATE_VERSION}; it was saved by "
                             "another version of the loader")
        key = self._loader.state_key()
        mismatched = {k: (state.get(k), v) for k, v in key.items() if state.get(k) != v}
        if mismatched:
            detail = ", ".join(f"{k}: saved {saved!r}, now {now!r}" for k, (saved, now) in mismatched.items())
            raise ValueError(f"cannot restore loader state: {detail}; restore with the same dataset and options")
        self._next = int(state["next_batch"])
        self._restart(self._next)


def load(source: str | ShardedSource, *, batch_size: int, **options) -> Loader:
    """Batches from `source` (see module doc). Options: the fields of `LoaderConfig`."""
    unknown = set(options) - {f.name for f in dataclasses.fields(LoaderConfig)}
    if unknown:
        raise TypeError(f"load() got unknown options {sorted(unknown)}; the options are "
                        f"{sorted(f.name for f in dataclasses.fields(LoaderConfig) if f.name != 'batch_size')}")
    return Loader(source, LoaderConfig(batch_size=batch_size, **options))
