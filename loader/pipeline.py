"""`loader.load`: deterministic, globally shuffled, prefetched batches, exactly resumable.

    import loader
    batches = loader.load("out/", batch_size=256, seed=0)   # a converted dir, a TFDS dir, or a glob
    it = iter(batches)
    batch = next(it)                  # {"image": array[256, ...], "label": array[256]}
    state = it.get_state()            # small, JSON-serialisable
    it.set_state(state)               # continues with bitwise-identical batches

Reads are batched (nearby records of a shard come in one read: loader/fetch/reader.py), so batching comes first: the
plan cuts the epochs into read groups of consecutive global batches, and an executor (loader/executors) computes them:

    read_group(g)            reading schedule from the start batch: 1, 4, 16, ... G batches a group; per batch k: the
                             exact permutation of (seed, epoch), this host's rows; one gather of the group's records;
                             decode (~4k records a call), map_fn, collate
    executor.map(read_group) in order, computed ahead: this process's threads, worker processes, Ray actors or auto
                             (loader/executors)
    then the iterator hands the group's batches out one by one (and, with sharding=, onto devices).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import inspect
import logging
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from dataset_format import storage
from dataset_format.suggest import did_you_mean
from loader import executors
from loader.decoding.decode import Decoder, collate, decoder_at, source_decoder
from loader.executors.device import DevicePrefetcher
from loader.executors.handout import HostBatches, WorkerControls, close_at_exit
from loader.executors.padding import handed_out
from loader.executors.stages import Group, Stopwatch
from loader.fetch.reader import MAX_RECORD_BYTES, BatchReader
from loader.format.source import ShardedSource, resolve, select
from loader.packed import Inputs, PackedLoader
from loader.planning import mixture
from loader.planning.batches import FOREVER, BatchPlan
from loader.planning.counts import tokenization
from loader.planning.packing import Packing
from loader.planning.state import check, check_kind, said_new_batch_size

log = logging.getLogger(__name__)

STATE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class LoaderConfig:
    """Everything `load` takes besides the source. Validated on construction."""

    batch_size: int
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = None  # a mixture: one for all components or {name: epochs}; it ends when one runs out
    drop_remainder: bool = True
    # With drop_remainder=False: every batch has its full rows, a short one padded with zeros, and "_mask" says
    # which rows are real (loader/executors/padding.py): one shape for every batch, equal parts on every host.
    pad_remainder: bool = False
    shard_index: int | None = None  # default: jax.process_index() when JAX is in use, else 0
    shard_count: int | None = None  # default: jax.process_count() when JAX is in use, else 1
    decode: str | Decoder | None = "auto"
    features: tuple[str, ...] | None = None  # decode, collate and place only these features (None: all)
    packing: Packing | None = None  # token rows (loader/planning/packing.py); batch_size counts rows
    map_fn: Callable[[Any], Any] | None = None  # applied to each record after decoding
    # Or, for augmentation: fn(record, rng) with a numpy Generator seeded from (seed, epoch, global record index),
    # so the same record in the same epoch gets the same draw on any host count, worker count, and after a resume.
    random_map_fn: Callable[[Any, np.random.Generator], Any] | None = None
    # A TFDS source's split (default "train"), a slice of one ("train[:99%]", TFDS's syntax), or a slice alone for
    # other sources ("[:99%]"): loader/format/source.py
    split: str | None = None
    weights: Mapping[str, float] | None = None  # a mixture's weight per component (loader/planning/mixture.py)
    # Worker processes (0: none, reads run on this process's threads; one that dies is replaced), or "auto": this
    # process's threads, or as many worker processes as the caller's demand needs, measured as it runs
    # (loader/executors/tuning.py).
    worker_count: int | str = 0
    # Run the workers as Ray actors on the cluster at this address ("auto", "host:port", "ray://host:10001") instead
    # of local processes; each needs 1 CPU and ray_resources (e.g. {"data_cpu": 1}, a resource only CPU nodes offer).
    ray_address: str | None = None
    ray_resources: Mapping[str, float] | None = None
    num_threads: int = 2  # prefetch threads per process (reads and decompression release the GIL)
    prefetch: int = 2  # reads (groups of batches) ahead; raised to num_threads, 0: none
    # Batches are read in groups of about this many records: more records a group put more of them close together
    # in each shard (fewer, longer reads), at the cost of memory and of the first batches' latency.
    records_per_read: int = 32768
    allow_incomplete: bool = False
    check_hashes: bool = True  # check riegeli's chunk hashes: a damaged byte is an error naming shard and record
    # gs:// sources: keep up to this many bytes of chunks (the first read), in memory, or on local disk in cache_dir
    # (shared by this host's processes, kept for later runs: loader/fetch/disk_cache.py)
    cache_bytes: int = 0
    cache_dir: str | None = None
    # A larger record is an error, checked before it is allocated; a read group may decode to this much, or 1,024 times
    # its stored bytes when that is more (loader/format/_riegeli.c: decompression bombs).
    max_record_bytes: int = MAX_RECORD_BYTES
    sharding: Any = None  # a jax.sharding.Sharding: yield global jax.Arrays placed ahead of time
    device_prefetch: int = 2  # batches in flight to the devices when sharding is set

    def __post_init__(self):
        for name in ("shuffle", "drop_remainder", "pad_remainder", "allow_incomplete", "check_hashes"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):  # shuffle="no" shuffled: a string is true
                raise ValueError(f"{name} must be True or False (got {name}={getattr(self, name)!r})")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)):
            raise ValueError(f"seed must be an integer (got seed={self.seed!r}): the same seed gives the same batches")
        if self.weights is not None and not isinstance(self.weights, Mapping):
            raise ValueError(f"weights= takes a dict of a weight per component, {{name: weight}}, with the sources as "
                             f"{{name: source}} (got weights={self.weights!r})")
        if self.packing is not None and not isinstance(self.packing, Packing):
            length = "N" if isinstance(self.packing, bool) or not isinstance(self.packing, int) else self.packing
            raise ValueError(f"packing= takes a loader.Packing, e.g. packing=loader.Packing(seq_len={length}) for a "
                             f"pre-tokenized dataset (got packing={self.packing!r})")
        if isinstance(self.worker_count, bool) or not isinstance(self.worker_count, (int, np.integer)):
            if self.worker_count != "auto":
                raise ValueError(f"worker_count must be a number of worker processes or 'auto' (got "
                                 f"worker_count={self.worker_count!r})")
            if self.ray_address is not None:
                raise ValueError(f"worker_count='auto' tunes this host's workers; with ray_address="
                                 f"{self.ray_address!r} pass the number of Ray actors (worker_count=N), and resize "
                                 "them with the iterator's resize_workers(n)")
        for name in ("prefetch", "device_prefetch") + (("worker_count",) if self.worker_count != "auto" else ()):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (got {name}={getattr(self, name)})")
        if self.records_per_read < 1:
            raise ValueError(f"records_per_read must be >= 1 (got records_per_read={self.records_per_read})")
        if self.cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0 (got cache_bytes={self.cache_bytes})")
        if self.cache_dir is not None and self.cache_bytes < 4096:
            raise ValueError(f"cache_dir={self.cache_dir!r} keeps chunks on disk up to cache_bytes: pass cache_bytes= "
                             f"(the most disk to use, >= 4096; got cache_bytes={self.cache_bytes})")
        if self.max_record_bytes < 1:
            raise ValueError(f"max_record_bytes must be >= 1 (got max_record_bytes={self.max_record_bytes})")
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 (got num_threads={self.num_threads})")
        if self.features is not None:
            if isinstance(self.features, str) or not self.features:
                raise ValueError(f"features must be a non-empty list of feature names (got features={self.features!r})")
            object.__setattr__(self, "features", tuple(self.features))
        if self.ray_address is not None and self.worker_count == 0:
            raise ValueError(f"ray_address={self.ray_address!r} runs worker_count workers on the Ray cluster: pass "
                             "worker_count=N (N >= 1)")
        if self.ray_resources is not None and self.ray_address is None:
            raise ValueError("ray_resources= places Ray actors: pass ray_address= too")
        if self.map_fn is not None and self.random_map_fn is not None:
            raise ValueError("pass map_fn= or random_map_fn=, not both (random_map_fn can do what map_fn does; its "
                             "rng argument may go unused)")
        if self.pad_remainder and self.drop_remainder:
            raise ValueError("pad_remainder=True pads the last, short batch that drop_remainder=False keeps: pass "
                             "drop_remainder=False too")
        if (self.shard_index is None) != (self.shard_count is None):
            raise ValueError("pass both shard_index and shard_count, or neither (to use JAX's process index/count)")
        if self.shard_count is not None:  # (each plan checks it too; a mixture's and a packed one's did not)
            whole = [isinstance(v, (int, np.integer)) and not isinstance(v, bool)
                     for v in (self.shard_index, self.shard_count)]
            if not whole[1] or self.shard_count < 1:
                raise ValueError(f"shard_count must be the number of hosts, >= 1 (got shard_count="
                                 f"{self.shard_count!r})")
            if not whole[0] or not 0 <= self.shard_index < self.shard_count:
                raise ValueError(f"shard_index must be in [0, shard_count) (got shard_index={self.shard_index!r}, "
                                 f"shard_count={self.shard_count}): hosts are numbered from 0, as jax.process_index()")
        for name, fn, arguments, other in (("map_fn", self.map_fn, 1, "random_map_fn"),
                                           ("random_map_fn", self.random_map_fn, 2, "map_fn")):
            if fn is not None and _takes(fn, arguments) is False and _takes(fn, 3 - arguments):
                what = "(record, rng)" if arguments == 1 else "(record) only"
                raise ValueError(f"{name}={_name(fn)} takes {what}: pass it as {other}= (map_fn is called with the "
                                 "record, random_map_fn with the record and a numpy Generator)")


def check_sharding(config: LoaderConfig, shard_count: int, records: int | None) -> None:
    """sharding= against what placing the batches needs, at load(): this process's rows are its part of a global array
    over every process, each batch splits over the devices its first axis is laid over, and the last, short batch
    (drop_remainder=False; `records` in the run, None: not known before it ends) does too, or is padded."""
    if config.sharding is None:
        return
    import jax

    if config.shard_count is not None and shard_count != jax.process_count():
        raise ValueError(f"sharding= makes each batch a global array of every process's rows, and shard_count="
                         f"{shard_count} says {shard_count} hosts where JAX has {jax.process_count()} processes: leave "
                         "shard_index and shard_count unset with sharding=")
    devices = _batch_devices(config.sharding)
    if config.batch_size % devices:
        raise ValueError(f"batch_size={config.batch_size} does not split over the {devices} devices sharding= lays a "
                         f"batch's first axis over; use a multiple of {devices}")
    if config.drop_remainder or config.pad_remainder:
        return
    short = None if records is None else records % config.batch_size
    if short is None or (short and (short % devices or shard_count > 1)):
        rows = "a last batch of fewer rows" if short is None else f"a last batch of {short} rows"
        raise ValueError(f"drop_remainder=False with sharding= gives {rows}, which the {devices} devices (and "
                         f"{shard_count} host(s)) cannot split evenly: pass pad_remainder=True (the batch padded with "
                         "zeros, `_mask` marking its real rows), or keep drop_remainder=True")


def _batch_devices(sharding) -> int:
    """The devices a batch's first axis is split over (1 where the sharding does not say)."""
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    if spec is None or mesh is None or not len(spec) or spec[0] is None:
        return 1
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    return int(np.prod([mesh.shape[a] for a in axes]))


def _check_features(config: LoaderConfig, source: ShardedSource, map_fn) -> None:
    """features= against what the records hold (the manifest's feature statistics, where it has them) and what the
    map function reads: a misspelt name, or a map function's input left out, is one line at load(), not an error
    naming some record at the first batch."""
    if config.features is None:
        return
    held = source.feature_stats
    tfds = config.decode in ("auto", "tfds") and source.features_dir and source.component_features is None
    if held is not None and tfds:  # (TFDS decodes a nested FeaturesDict whole, by its own name: `meta`, not `meta/id`)
        held = dict.fromkeys(name.split("/", 1)[0] for name in held)
    unknown = [f for f in config.features if held is not None and f not in held]
    if unknown:
        hint = did_you_mean(unknown, held)
        nested = (" (a TFDS dataset's nested features come whole, under their top-level name)"
                  if tfds and any("/" in f for f in unknown) else "")
        raise ValueError(f"features={list(config.features)}: {source.location}'s records have no "
                         f"{', '.join(map(repr, unknown))}; they have {sorted(held)}{nested}" +
                         (f" ({hint})" if hint else ""))
    reads = [f for f in getattr(map_fn, "encoded_features", ()) if f not in config.features]
    if reads:
        raise ValueError(f"features={list(config.features)} leaves out {', '.join(map(repr, reads))}, which "
                         f"{_name(map_fn)} reads: add it to features= (it names the records' features the loader "
                         "decodes and hands the map function; the batch holds what the map function returns)")


def _takes(fn, arguments: int) -> bool | None:
    """Whether `fn` can be called with `arguments` positional arguments (None: its signature cannot be read)."""
    try:
        inspect.signature(fn, follow_wrapped=False).bind(*([None] * arguments))  # a wrapper's own arguments
    except TypeError:
        return False
    except ValueError:
        return None
    return True


def _name(fn) -> str:
    return type(fn).__name__ + "(...)" if dataclasses.is_dataclass(fn) else getattr(fn, "__name__", repr(fn))


def _host_shard(config: LoaderConfig) -> tuple[int, int]:
    if config.shard_count is not None:
        return config.shard_index, config.shard_count
    if "jax" in sys.modules:  # JAX is in use: one host shard per process
        import jax

        return jax.process_index(), jax.process_count()
    return 0, 1


# Read groups grow by this factor from one batch (a quick first batch) to `max_batches` (long reads).
RAMP_GROWTH = 4

# Records decoded per `decode_batch` call: enough to amortise NumPy's per-call costs, few enough that the
# joined records stay in cache (in an A/B on 1 KB records, 4096 beat whole 16k-record groups by 5-12%).
DECODE_RECORDS = 4096
# A planned cache (multi-host, gs://, cache_bytes= in memory) reads the plan this many epochs ahead at most (2 per
# host sharing the data: a record comes back to a host every ~host-count epochs).
PLAN_HORIZON = 16
PLAN_SLACK_GROUPS = 4  # groups read at once (threads, prefetch): their reads may come in any order

# With a map function, a read group holds at most this many records: its output can be far larger than the records
# (a 60 KB JPEG becomes a 150 KB 224x224 crop), and the decode, not the read, is the work to spread over threads.
MAPPED_RECORDS_PER_READ = 1024


def _runs_of_batches(per_batch: list[np.ndarray], records: int) -> Iterator[list[np.ndarray]]:
    """Consecutive batches in runs of about `records` rows (at least one batch a run)."""
    run, size = [], 0
    for rows in per_batch:
        run.append(rows)
        size += len(rows)
        if size >= records:
            yield run
            run, size = [], 0
    if run:
        yield run


class _ReadGroup:
    """Group g of the reading schedule -> this host's batches in it (raw lists, or collated decoded records).

    The schedule starts at batch `start` with groups of 1, 4, 16, ... batches, up to `max_batches`: the
    first batch comes quickly, later reads are long (many records of each shard close together, read by few
    calls). A batch's contents depend only on its global index,
    so where the groups fall does not change the data.
    """

    def __init__(self, plan: BatchPlan, source: ShardedSource, reader: BatchReader, decoder: Decoder | None, map_fn,
                 start: int, max_batches: int, random_map_fn=None):
        self._plan = plan
        self._source = source
        self._reader = reader
        self._decoder = decoder
        self._map_fn = map_fn
        self._random_map_fn = random_map_fn
        self._start = start
        self._max = max_batches
        # Ramp groups of 1, RAMP_GROWTH, RAMP_GROWTH^2, ... batches (while below max_batches), then max_batches each.
        self._ramp_offsets = [0]  # first batch of each ramp group, relative to `start`, and the end of the ramp
        size = 1
        while size < max_batches:
            self._ramp_offsets.append(self._ramp_offsets[-1] + size)
            size *= RAMP_GROWTH

    def first_batch(self, g: int) -> int:
        ramp = len(self._ramp_offsets) - 1
        if g <= ramp:
            offset = self._ramp_offsets[g]
        else:
            offset = self._ramp_offsets[-1] + (g - ramp) * self._max
        return min(self._start + offset, self._plan.num_batches)

    def num_groups(self) -> int:
        remaining = max(0, self._plan.num_batches - self._start)
        ramp_total = self._ramp_offsets[-1]
        if remaining <= ramp_total:
            return bisect.bisect_left(self._ramp_offsets, remaining)
        return len(self._ramp_offsets) - 1 + -(-(remaining - ramp_total) // self._max)

    def __call__(self, g: int) -> Group:
        """Group g's batches, with what each stage cost (loader/executors/stages.py)."""
        clock = Stopwatch()
        clock.stage("plan")
        first, end = self.first_batch(int(g)), self.first_batch(int(g) + 1)
        positions = self._plan.host_positions_range(first, end)
        per_batch = np.split(self._plan.indices_at(np.concatenate(positions)),
                             np.cumsum([len(p) for p in positions])[:-1])
        clock.stage("read")
        indices = np.concatenate(per_batch)
        if self._reader.wants_next_reads:  # a BatchPlan's reader on several hosts (Loader)
            every = np.concatenate(positions)
            horizon = min(2 * self._plan.shard_count, PLAN_HORIZON)
            # what the cache may forget: reads due before this group and the few groups read beside it
            first, last = (int(every.min()), int(every.max())) if len(every) else (0, 0)
            records = self._reader(indices, self._plan.next_reads(every, indices, horizon),
                                   first - PLAN_SLACK_GROUPS * (last - first + 1))
        else:
            records = self._reader(indices)
        batches, at = [], 0
        for run in _runs_of_batches(per_batch, DECODE_RECORDS):
            run_records = records[at:at + sum(map(len, run))]
            at += len(run_records)
            clock.stage("decode")
            columns = self._decode_run(run_records)
            offset = 0
            for rows in run:
                part = slice(offset, offset + len(rows))
                offset += len(rows)
                if columns is not None and len(rows):
                    clock.stage("collate")
                    batch = {key: column[part] for key, column in columns.items()}
                else:
                    batch = self._finish(run_records[part], rows, positions[len(batches)], clock)
                batches.append(self._labelled(batch, positions[len(batches)]))
        return clock.group(batches, len(records))

    def describe(self, g: int) -> str:
        """Group `g`'s batches and records, for errors."""
        first, end = self.first_batch(int(g)), self.first_batch(int(g) + 1)
        indices = self._plan.indices_at(np.concatenate(self._plan.host_positions_range(first, end)))
        return f"batches {first}-{end - 1} ({len(indices)} records: {self._source.where_all(indices)})"

    def _labelled(self, batch, positions: np.ndarray):
        """A mixture's decoded batch gains mixture.COMPONENT_KEY: each row's component (its index in the mixture)."""
        if not isinstance(self._plan, mixture.MixturePlan) or not isinstance(batch, dict):
            return batch
        if mixture.COMPONENT_KEY in batch:
            raise ValueError(f"the mixture's records have a feature named {mixture.COMPONENT_KEY!r}, the key that says "
                             "each row's component; rename the feature, or select features= without it")
        return {**batch, mixture.COMPONENT_KEY: self._plan.components_at(positions)}

    def _decode_run(self, records: list[bytes]) -> dict | None:
        """Consecutive batches decoded at once (the batches are slices of it), when the decoder can."""
        if self._map_fn is not None or self._random_map_fn is not None or not records or \
                not hasattr(self._decoder, "decode_batch"):
            return None
        try:
            return self._decoder.decode_batch(records)
        except Exception:  # noqa: BLE001 - decode record by record, which names the bad record
            return None

    def _finish(self, records: list[bytes], indices: np.ndarray, positions: np.ndarray, clock: Stopwatch):
        if not records:  # this host's share of a short last batch (drop_remainder=False) can be empty
            return []
        if self._decoder is None and self._map_fn is None and self._random_map_fn is None:
            return records
        clock.stage("decode")
        items = [self._decode(r, i) for r, i in zip(records, indices)] if self._decoder else records
        clock.stage("map")
        if self._map_fn is not None:
            items = [self._mapped(self._map_fn, i, item) for item, i in zip(items, indices)]
        if self._random_map_fn is not None:
            items = [self._mapped(self._random_map_fn, i, item, rng)
                     for item, i, rng in zip(items, indices, self._plan.record_rngs(positions, indices))]
        clock.stage("collate")
        if isinstance(self._plan, mixture.MixturePlan) and items and isinstance(items[0], dict):
            self._check_components(items, positions)
        if self._map_fn is not None or self._random_map_fn is not None:
            self._check_mapped(items, indices)
        return collate(items)

    def _check_mapped(self, items: list, indices: np.ndarray) -> None:
        """A map function's records must stack: per feature one dtype and rank in every record. Otherwise one line
        naming the feature, a record of the batch's most common form and one of another, and what each gave (a record
        of another dtype promoted the whole batch without a word, float64 for a float32 among uint8 images; one of
        another rank made the batch a list)."""
        first = items[0]
        for key in list(first) if isinstance(first, dict) else [None]:
            values = [item.get(key) if isinstance(item, dict) else None for item in items] if key is not None else items
            one = values[0]
            if isinstance(one, (np.ndarray, np.generic)) and all(
                    isinstance(v, (np.ndarray, np.generic)) and v.dtype == one.dtype and v.ndim == one.ndim
                    for v in values):
                continue  # (the usual case: ~0.4 us a record and feature; the forms below cost ~10)
            forms = [_stack_form(v) for v in values]
            seen = collections.Counter(f for f in forms if f is not None)
            if len(seen) < 2:
                continue
            usual = seen.most_common(1)[0][0]
            odd = next(k for k, f in enumerate(forms) if f is not None and f != usual)
            fn = self._random_map_fn or self._map_fn
            what = "its output" if key is None else f"feature {key!r}"
            raise ValueError(
                f"{self._where(int(indices[odd]))}: {getattr(fn, '__name__', type(fn).__name__)} gave {what} as "
                f"{_said(forms[odd])}, where for {self._where(int(indices[forms.index(usual)]))} (and "
                f"{seen[usual] - 1} more of this batch) it gave {_said(usual)}: a batch stacks its records, so a map "
                f"function must give every record one dtype and rank; convert it (e.g. np.asarray(value, "
                f"np.{usual[0]}))")

    def _check_components(self, items: list[dict], positions: np.ndarray) -> None:
        """A mixture's rows must stack: the same feature names, and per feature one dtype and rank, in every component
        of the batch. Otherwise one line naming the feature and the components (a feature some rows lack was named
        without its component; one of two dtypes came out as a list, and training failed in NumPy)."""
        components = self._plan.components_at(positions)
        first: dict[int, dict] = {}
        for item, c in zip(items, components.tolist()):
            first.setdefault(c, item)
        if len(first) < 2:
            return
        names = self._plan.names
        forms = {c: {k: _form(v) for k, v in first[c].items()} for c in sorted(first)}
        (a, fa), *others = forms.items()
        for b, fb in others:
            if fa.keys() != fb.keys():
                only_a, only_b = sorted(fa.keys() - fb.keys()), sorted(fb.keys() - fa.keys())
                raise ValueError(
                    f"the mixture's components give different features: {names[a]!r} has {only_a or 'none'} that "
                    f"{names[b]!r} has not, and {names[b]!r} has {only_b or 'none'} that {names[a]!r} has not; rows of "
                    "one batch need the same features: give them the same names (a map_fn renaming them, or "
                    "features= choosing the shared ones)")
            for key in fa:
                if fa[key] is not None and fb[key] is not None and fa[key] != fb[key]:
                    raise ValueError(
                        f"feature {key!r} is {_said(fa[key])} in the mixture's component {names[a]!r} and "
                        f"{_said(fb[key])} in {names[b]!r}: rows of one batch must stack; make them one dtype and "
                        "rank (a map_fn converting one, or an image op, e.g. images.CenterCrop, giving both uint8 "
                        "[H, W, 3])")

    def _where(self, index: int) -> str:
        return self._source.where(index)

    def _decode(self, record: bytes, index: int):
        try:
            return decoder_at(self._decoder, index)(record)
        except KeyError as e:  # a feature asked for (features=, an image op's) that the data does not have
            text = str(e.args[0]) if e.args else ""
            if not text.startswith("no feature "):
                raise ValueError(f"{self._where(index)} does not decode (KeyError: {e}); pass decode=None for raw "
                                 "bytes, or another decode=") from e
            raise ValueError(f"{self._where(index)}: {text}: check the names in features= (and the features the "
                             "map_fn's image ops read)") from e
        except Exception as e:  # noqa: BLE001 - re-raised with the shard and record named
            raise ValueError(f"{self._where(index)} does not decode ({type(e).__name__}: {e}); pass decode=None for "
                             "raw bytes, or another decode=") from e

    def _mapped(self, fn, index: int, *args):
        try:
            value = fn(*args)
        except Exception as e:  # noqa: BLE001 - re-raised with the shard and record named
            raise ValueError(f"{self._where(index)}: {getattr(fn, '__name__', type(fn).__name__)} failed "
                             f"({type(e).__name__}: {e})") from e
        if value is None:  # (collated, it was an AttributeError naming neither the function nor the record)
            raise ValueError(f"{self._where(index)}: {getattr(fn, '__name__', type(fn).__name__)} returned None; "
                             "it must return the mapped record (a dict of features, or one value)")
        return value


def _form(value) -> tuple[str, int] | None:
    """(dtype, rank) of an array or scalar feature value; None for other values (lists of bytes, ...)."""
    if isinstance(value, (np.ndarray, np.generic)):
        return str(value.dtype), value.ndim
    return None


def _stack_form(value) -> tuple[str, int] | None:
    """_form, with strings of any width one form (they stack to the widest)."""
    form = _form(value)
    return (value.dtype.kind, form[1]) if form is not None and value.dtype.kind in "SU" else form


def _said(form: tuple[str, int]) -> str:
    return f"{form[0]} of rank {form[1]}"


class Loader:
    """An iterable of batches; each `iter()` starts at batch 0 (use `set_state` to resume)."""

    def __init__(self, source: str | ShardedSource | Mapping[str, str | ShardedSource], config: LoaderConfig):
        self.config = config
        shard_index, shard_count = _host_shard(config)
        if isinstance(source, Mapping):
            self.components, self.source, self.plan, parts = _mixture(source, config, shard_index, shard_count)
            if self.plan.num_batches == 0:  # (as _check_batch_fits says of one source)
                raise ValueError(f"batch_size={config.batch_size} is more than the {self.plan.end_row:,} rows the "
                                 f"mixture gives before component {self.plan.ending!r} ends it (num_epochs="
                                 f"{_said_epochs(config.num_epochs)}): no batch would be made; lower batch_size, raise "
                                 "num_epochs, or pass drop_remainder=False")
        else:
            if config.weights is not None:
                raise ValueError("weights= is for a mixture: pass the sources as {name: source} (one source takes no "
                                 "weights)")
            if isinstance(config.num_epochs, Mapping):
                raise ValueError(f"num_epochs={dict(config.num_epochs)} names components, but the source is not a "
                                 "mixture; pass one number")
            self.components, parts = None, {}
            self.source = _resolved(source, config)
            self.plan = BatchPlan(len(self.source), config.batch_size, config.seed, config.shuffle, config.num_epochs,
                                  config.drop_remainder, shard_index, shard_count)
            _check_batch_fits(len(self.source), config, self.source.location)
        map_fn = config.map_fn or config.random_map_fn
        for name, part in parts.items():  # (the mixture's records hold the union of its components' features)
            try:
                _check_features(config, part, None)
            except ValueError as e:
                raise ValueError(f"mixture component {name!r}: {e}") from None
        _check_features(config, self.source, map_fn)
        epochs = config.num_epochs
        check_sharding(config, shard_count, len(self.source) * epochs if self.components is None and epochs else None)
        if config.pad_remainder and config.decode is None and map_fn is None:
            raise ValueError("pad_remainder=True pads batches of decoded features, and decode=None gives raw records: "
                             "decode them (decode='auto', or a map_fn that returns a dict)")
        self._decoder = source_decoder(config.decode, self.source, config.features,
                                       tuple(getattr(map_fn, "encoded_features", ())))
        # Batches per read: ~records_per_read records, at most ~64 MB of (compressed) data.
        per_batch = self.plan.per_host
        by_bytes = max(1, (64 << 20) // max(1, per_batch * self.source.mean_record_bytes))
        records = config.records_per_read
        if config.map_fn is not None or config.random_map_fn is not None:
            records = min(records, MAPPED_RECORDS_PER_READ)
        self.batches_per_read = max(1, min(records // per_batch, by_bytes))
        # One reader for every iterator of this loader: a restart (set_state, a new epoch loop) keeps its open files.
        # On several hosts, a memory cache keeps what this host reads again soonest.
        self._reader = _reader(self.source, config,
                               planned=isinstance(self.plan, BatchPlan) and self.plan.shard_count > 1)

    def __len__(self) -> int:
        if self.config.num_epochs is None:
            raise TypeError("an endless loader (num_epochs=None) has no length")
        if self.plan.num_batches >= FOREVER:  # a mixture whose num_epochs bounds no component it draws from
            raise TypeError(f"this mixture is endless: num_epochs={self.config.num_epochs} bounds none of the "
                            "components it draws from (weight > 0), so it has no length")
        return self.plan.num_batches

    def __iter__(self) -> LoaderIterator:
        return LoaderIterator(self)

    def _groups(self, start: int, plan=None, worker_count: int | str | None = None):
        """Groups of batches from global batch `start` on (each element: a list of batches), computed by the
        loader's executor (loader/executors), with `worker_count` workers (default: the config's)."""
        read_group = _ReadGroup(plan or self.plan, self.source, self._reader, self._decoder, self.config.map_fn, start,
                                self.batches_per_read, random_map_fn=self.config.random_map_fn)
        c = self.config
        executor = executors.make(c.worker_count if worker_count is None else worker_count,
                                  num_threads=c.num_threads, prefetch=c.prefetch,
                                  ray_address=c.ray_address, ray_resources=c.ray_resources,
                                  describe=read_group.describe)
        return executor.map(read_group, read_group.num_groups())

    def zero_rows(self, plan) -> Any:
        """A batch of no rows shaped as this loader's: pad_remainder's for a host whose share of a batch is none when
        it has handed out no batch since it (re)started (a resume at the last, short batch). Host 0's share of the
        plan's first batch, read and decoded, cut to no rows."""
        host_0 = dataclasses.replace(plan, shard_index=0)
        group = _ReadGroup(host_0, self.source, self._reader, self._decoder, self.config.map_fn, plan.start_batch, 1,
                           random_map_fn=self.config.random_map_fn)
        (batch,) = group(0).batches
        return {k: v[:0] for k, v in batch.items()} if isinstance(batch, dict) else batch

    def state_key(self) -> dict:
        """What a saved state must agree with to be restored here (the host/worker counts may differ). A mixture's
        is in its state's "mixture" entry (MixturePlan.restored)."""
        plan = self.plan
        if self.components is not None:
            return {}
        key = {"dataset": self.source.identity, "num_records": plan.num_records, "batch_size": plan.batch_size,
               "seed": plan.seed, "shuffle": plan.shuffle, "num_epochs": plan.num_epochs,
               "drop_remainder": plan.drop_remainder}
        return {**key, "records": self.source.slice_bounds} if self.source.offsets is not None else key


class LoaderIterator(WorkerControls, Iterator):
    """Iterator over a Loader's batches with `get_state()` / `set_state()`.

    The state counts the batches handed to the caller, so batches prefetched (to host or device)
    but not yet taken are read again after a restore, never skipped.
    """

    def __init__(self, loader: Loader, start: int = 0):
        self._loader = loader
        self._taking = threading.Lock()
        self._ray = loader.config.ray_address is not None
        self._plan = loader.plan  # a restored mixture state may continue on a plan of its own
        self._next = start
        self._prefetcher: DevicePrefetcher | None = None
        self._restart(start)
        close_at_exit(self)

    def _restart(self, start: int) -> None:
        self.close()
        self._failed = False
        self._host = HostBatches(self._loader._groups(start, self._plan, self._worker_count()))
        plan = self._plan
        self._take = handed_out(self._host.next, self._loader.config.pad_remainder, plan.per_host,
                                lambda: self._loader.zero_rows(plan))
        sharding = self._loader.config.sharding
        if sharding is not None:
            self._prefetcher = DevicePrefetcher(self._take, sharding, self._loader.config.device_prefetch)

    def __next__(self):
        batch = self._handed(lambda: self._take() if self._prefetcher is None else self._prefetcher.get(),
                             lambda: self._restart(self._next))
        self._next += 1
        return batch

    def close(self) -> None:
        """Stops the device-prefetch thread and grain's prefetch threads and worker processes (also done when the
        iterator is garbage collected, and at exit). A closed iterator yields nothing more until `set_state`."""
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
        host = getattr(self, "_host", None)
        if host is not None:
            host.close()

    def __del__(self):
        self.close()

    def get_state(self) -> dict:
        state = {"version": STATE_VERSION, "next_batch": self._next, **self._loader.state_key()}
        if self._loader.components is not None:
            state["mixture"] = self._plan.state(self._next)
        elif self._plan.origin:  # batch k begins at origin + k * batch_size (after a resume with another batch size)
            state["origin"] = self._plan.origin
        return state

    def set_state(self, state: dict) -> None:
        mixed = self._loader.components is not None
        check_kind(state, "a mixture" if mixed else "a loader of one source",
                   "this mixture" if mixed else "this loader of one source")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')!r} is not {STATE_VERSION}; it was saved by "
                             "another version of the loader")
        check(state, self._loader.state_key(), "loader state")
        self._next = int(state["next_batch"])
        if "mixture" in state:
            self._plan = self._loader.plan.restored(state["mixture"], self._next)
        else:  # another batch size continues the stream where it stopped
            size = int(state.get("batch_size", self._loader.plan.batch_size))
            self._plan = self._loader.plan.continued(self._next, int(state.get("origin", 0)) + self._next * size)
        said_new_batch_size(state, self._plan.batch_size)
        self._restart(self._next)


def load(source: str | ShardedSource | Mapping[str, str | ShardedSource], *, batch_size: int, **options) -> Loader:
    """Batches from `source` (see module doc), or from a mixture {name: source} with weights={name: weight}
    (loader/planning/mixture.py). Options: the fields of `LoaderConfig`."""
    known = [f.name for f in dataclasses.fields(LoaderConfig) if f.name != "batch_size"]
    unknown = sorted(set(options) - set(known))
    if unknown:
        hint = did_you_mean(unknown, known)
        raise TypeError(f"load() got unknown options {unknown}" + (f" ({hint})" if hint else "")
                        + f"; the options are {sorted(known)}")
    config = LoaderConfig(batch_size=batch_size, **options)
    return _packed(source, config) if config.packing is not None else Loader(source, config)


def _said_epochs(num_epochs) -> str:
    return repr(dict(num_epochs)) if isinstance(num_epochs, Mapping) else str(num_epochs)


def _check_batch_fits(records: int, config: LoaderConfig, where: str) -> None:
    """A batch larger than the records: with num_epochs and drop_remainder, no batch at all (an empty loop, without a
    word); endless, each batch holds records several times over (a warning)."""
    if config.batch_size <= records:
        return
    if config.num_epochs is not None and config.drop_remainder and config.batch_size > records * config.num_epochs:
        raise ValueError(f"batch_size={config.batch_size} is more than the {records:,} records of {where} over "
                         f"num_epochs={config.num_epochs}: no batch would be made; lower batch_size, raise num_epochs, "
                         "or pass drop_remainder=False")
    if config.num_epochs is None or config.num_epochs > 1:  # one epoch, not dropped: one short batch, no repeats
        log.warning("batch_size=%d is more than the %s records of %s: each batch spans epochs and holds records more "
                    "than once", config.batch_size, f"{records:,}", where)


def _reader(source: ShardedSource, config: LoaderConfig, planned: bool = False) -> BatchReader:
    if config.cache_bytes and not any(storage.is_remote(p) for p in source.paths):
        log.warning("cache_bytes=%d caches chunks read from gs://, and %s is local: nothing is cached (the OS's page "
                    "cache keeps what local reads bring in); drop cache_bytes=", config.cache_bytes, source.location)
    return BatchReader(source, check_hashes=config.check_hashes, cache_bytes=config.cache_bytes,
                       cache_dir=config.cache_dir, max_record_bytes=config.max_record_bytes, planned=planned)


def _resolved(source: str | ShardedSource, config: LoaderConfig) -> ShardedSource:
    if isinstance(source, ShardedSource):
        return select(source, config.split)
    return resolve(source, split=config.split, allow_incomplete=config.allow_incomplete)


def _mixture(sources: Mapping, config: LoaderConfig, shard_index: int, shard_count: int, packed: bool = False):
    """(names, the components' shards end to end, the MixturePlan, {name: its source}) for a mapping of name -> source;
    `packed`: the plan also holds how each pre-tokenized component was tokenised (its rows' layout depends on it)."""
    names = tuple(sources)
    if not names:
        raise ValueError("the mixture has no components; pass {name: source, ...}")
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise ValueError(f"mixture component names must be non-empty strings (got {bad!r})")
    weights = mixture.check_weights(names, config.weights)
    resolved = {}
    for name, source in sources.items():
        try:
            resolved[name] = _resolved(source, config)
        except (ValueError, FileNotFoundError) as e:
            raise type(e)(f"mixture component {name!r}: {e}") from None
    epochs = config.num_epochs
    if isinstance(epochs, Mapping):
        unknown = sorted(set(epochs) - set(names))
        if unknown:
            raise ValueError(f"num_epochs names {unknown}, which are not components of the mixture {list(names)}")
        epochs = tuple(epochs.get(n) for n in names)
    elif epochs is not None:
        epochs = (epochs,) * len(names)
    plan = mixture.MixturePlan(names, tuple(len(s) for s in resolved.values()), tuple(weights.values()),
                               config.batch_size, config.seed, config.shuffle, epochs, config.drop_remainder,
                               shard_index, shard_count, datasets=tuple(s.identity for s in resolved.values()),
                               tokens=tuple(tokenization(s) for s in resolved.values()) if packed else None)
    return names, mixture.concatenate(resolved), plan, resolved


def _packed(source: str | ShardedSource, config: LoaderConfig) -> PackedLoader:
    """A loader of packed rows (loader/packed.py): the same source, reader, decoder, host sharding and executor."""
    if config.map_fn is not None or config.random_map_fn is not None:
        raise ValueError("packing= reads one feature and tokenises it in Packing.tokenize: it takes no map_fn= or "
                         "random_map_fn=")
    if config.features is not None:
        raise ValueError(f"packing= reads one feature, Packing.feature, and gives rows of token ids: drop "
                         f"features={list(config.features)} (name the text feature as Packing(feature=...))")
    shard_index, shard_count = _host_shard(config)
    check_sharding(config, shard_count, None)  # (a packed epoch's rows are known once it is laid out)
    if isinstance(source, Mapping):
        from loader.packed_mixture import PackedMixtureLoader

        if config.num_epochs is not None:
            raise ValueError(f"a packed mixture is endless (each component repeats its epochs); leave num_epochs unset "
                             f"(got num_epochs={config.num_epochs})")
        if not config.drop_remainder:
            raise ValueError("a packed mixture is endless (each component repeats its epochs), so it has no last, "
                             "short batch to keep: leave drop_remainder=True")
        names, src, plan, _ = _mixture(source, config, shard_index, shard_count, packed=True)
        return PackedMixtureLoader(names, _packing_inputs(src, config), config, plan)
    src = _resolved(source, config)
    return PackedLoader(_packing_inputs(src, config), config, shard_index, shard_count)


def _packing_inputs(src: ShardedSource, config: LoaderConfig) -> Inputs:
    """The records of a packed source and their token counts: a pre-tokenized dataset's own (its `.counts` files), or
    counted from the decoded feature (cached under the index's directory when the packing names a cache_key)."""
    from loader.format import index
    from loader.planning.counts import TokenCounts

    packing = config.packing
    if packing.tokenized and src.tokens_dtype is None and packing.feature is None:
        raise ValueError(f"Packing(seq_len=...) without tokenize= packs a pre-tokenized dataset, and {src.paths[0]} "
                         "is not one: convert the text with `python -m pipelines convert --tokenizer PATH --text-key "
                         "KEY`, or pass Packing(feature=..., tokenize=...)")
    feature = packing.feature or "tokens"
    stats = (src.feature_stats or {}).get(feature) if packing.tokenized and src.tokens_dtype is None else None
    if stats is not None and stats["kind"] != "int64":  # text (or floats) where ids were expected
        from loader.packed import untokenized_fix

        raise ValueError(f"Packing(feature={feature!r}) without tokenize= packs token ids, but {src.location}'s "
                         f"{feature!r} holds {stats['kind']} values: {untokenized_fix(feature)}")
    inputs = Inputs(src, _reader(src, config), source_decoder(config.decode, src, (feature,)))
    if packing.tokenized and src.tokens_dtype is not None:
        max_count = config.max_record_bytes // np.dtype(src.tokens_dtype).itemsize
        return dataclasses.replace(inputs, counts=TokenCounts.of_source(src, max_count))
    # (the counts cached per record of the source: a slice's under a key of its own)
    return dataclasses.replace(inputs, index_key=index.source_key(src) + src.slice_key, cache_dir=index.default_dir())
