"""Weighted mixtures of datasets: which component each row of the mixed stream comes from, and which record.

    batches = loader.load({"web": "out/web", "code": "out/code"}, weights={"web": 0.7, "code": 0.3},
                          batch_size=256, seed=0)
    batch["component"]      # per row, the index of its component in batches.components

The mixed stream is an endless sequence of rows. Which component row t comes from is a periodic schedule made by
Balinski and Young's quota method over the weights taken as integers a_c (summing to the period D): after any number
of rows T, component c has given floor(T*w_c) or ceil(T*w_c) rows, so every prefix is within one row of the exact
proportion (stratified, not sampled), and the schedule is a function of the weights alone. Component c's j-th row is
position j of its own stream: record perm(j mod N_c) of its epoch j // N_c, the permutation keyed by (seed, name), so
each component walks its own epochs and a small one repeats without ending the mix. Global batch k is rows
[k*B, (k+1)*B); host i of n takes rows [i*B/n, (i+1)*B/n), so the global batches are the same for any host count.

A plan holds one segment: from batch `start_batch` the schedule runs from the row counts `base`. The iterator's
state records the segment and weights; restored under other weights, or with a component added, a new segment
starts at the saved batch from the counts each component had reached, so every component continues where it
stopped: no record skipped, none repeated before its epoch ends.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
import numbers
from collections.abc import Mapping
from fractions import Fraction

import numpy as np

from dataset_format import storage
from dataset_format.tfds_info import FEATURES_NAME
from loader.format.source import ShardedSource, joined
from loader.planning.batches import check_hosts, host_rows, record_rng, FOREVER
from loader.planning.permutation import Permutation
from loader.planning.state import check

log = logging.getLogger(__name__)

COMPONENT_KEY = "component"  # in a mixture's batches: each row's component, an index into `components`

# Weights that are ratios of small integers (0.7/0.3, 1/3 each) are kept exactly; others are rounded to integers
# summing to this period, so the mix follows them to 1 part in MAX_PERIOD.
MAX_PERIOD = 10_000


def integer_weights(weights: Mapping[str, float]) -> dict[str, int]:
    """The weights as integers with the same proportions (exact when they are ratios of small integers), reduced."""
    for name, w in weights.items():
        if not isinstance(w, numbers.Real) or isinstance(w, (bool, np.bool_)) or not math.isfinite(w):
            raise ValueError(f"weights[{name!r}] = {w!r} is not a number; give each component a weight >= 0")
        if w < 0:
            raise ValueError(f"weights[{name!r}] = {w} is negative; weights must be >= 0")
    weights = {name: float(w) for name, w in weights.items()}  # (numpy's float32: Fraction takes no such number)
    total = sum(weights.values())
    if total <= 0:
        raise ValueError(f"all weights are 0 ({dict(weights)}); give at least one component a positive weight")
    fractions = {name: Fraction(w / total).limit_denominator(1000) for name, w in weights.items()}
    period = math.lcm(*(f.denominator for f in fractions.values()))
    exact = all(abs(float(f) - w / total) <= 1e-9 for f, w in zip(fractions.values(), weights.values()))
    if exact and sum(fractions.values()) == 1 and period <= MAX_PERIOD:
        ints = {name: int(f * period) for name, f in fractions.items()}
    else:  # largest remainders of the exact shares of MAX_PERIOD
        shares = {name: w / total * MAX_PERIOD for name, w in weights.items()}
        ints = {name: int(s) for name, s in shares.items()}
        by_remainder = sorted(shares, key=lambda n: (-(shares[n] - ints[n]), list(shares).index(n)))
        for name in by_remainder[:MAX_PERIOD - sum(ints.values())]:
            ints[name] += 1
    lost = [name for name, w in weights.items() if w > 0 and ints[name] == 0]
    if lost:  # below one row in MAX_PERIOD: it would read nothing, silently
        raise ValueError(f"weights[{lost[0]!r}] = {weights[lost[0]]} is under 1 part in {MAX_PERIOD:,} of the total "
                         f"({total:g}): the schedule would give {lost[0]!r} no rows; give it a larger weight, or 0 to "
                         "leave it out")
    rows = sum(ints.values())
    off = {name: (w / total, ints[name] / rows) for name, w in weights.items()
           if w > 0 and abs(ints[name] / rows - w / total) > 0.01 * w / total}
    if off:  # (a small component's share rounded by more than 1% of itself)
        log.warning("mixture weights are kept to 1 part in %s: %s", f"{MAX_PERIOD:,}", "; ".join(
            f"{name!r} asked for {asked:.4%} of the rows and gets {got:.4%}" for name, (asked, got) in off.items()))
    divisor = math.gcd(*ints.values())
    return {name: v // divisor for name, v in ints.items()}


def quota_schedule(weights: tuple[int, ...]) -> np.ndarray:
    """One period (sum(weights) rows) of the component of each row, by the quota method: each next row goes to the
    component with the largest weight / (rows + 1) among those still below their upper quota. Within every prefix of
    T rows each component c has floor or ceil of T * w_c / D rows (checked here)."""
    period = sum(weights)
    counts = [0] * len(weights)
    schedule = np.empty(period, dtype=np.int32)
    for t in range(1, period + 1):
        best, best_priority = -1, -1.0
        for c, w in enumerate(weights):
            if w and counts[c] * period < t * w:  # below its upper quota after this row
                priority = w / (counts[c] + 1)
                if priority > best_priority:
                    best, best_priority = c, priority
        counts[best] += 1
        schedule[t - 1] = best
    prefix = np.cumsum(np.eye(len(weights), dtype=np.int64)[schedule], axis=0)  # (period, C)
    exact = np.arange(1, period + 1)[:, None] * np.asarray(weights)[None, :]
    if np.any(np.abs(prefix * period - exact) >= period):  # a bug, never the user's input
        raise AssertionError(f"the quota schedule for weights {weights} strays a row or more from the weights")
    return schedule


def component_seed(seed: int, name: str) -> int:
    """The permutation key of component `name`: depends on the seed and the name only, so adding or reordering
    components changes no component's order."""
    # "loader.mixture" is the hash's domain, not a module path: renaming it would change every mixture's order.
    return int.from_bytes(hashlib.blake2b(f"loader.mixture:{seed}:{name}".encode(), digest_size=7).digest(), "little")


@dataclasses.dataclass(frozen=True, eq=False)
class MixturePlan:
    """The mixture's counterpart of `BatchPlan`: positions are rows of the mixed stream; `indices_at` gives each
    row's global record index in the concatenation of the components (component c's records start at offsets[c])."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]  # records per component
    weights: tuple[int, ...]  # integer weights (integer_weights)
    batch_size: int
    seed: int = 0
    shuffle: bool = True
    num_epochs: tuple[int | None, ...] | None = None  # per component; the mix ends when one runs out
    drop_remainder: bool = True
    shard_index: int = 0
    shard_count: int = 1
    start_batch: int = 0  # this segment's first batch
    base: tuple[int, ...] | None = None  # rows each component had given before start_batch
    dormant: tuple[tuple[str, int], ...] = ()  # (name, rows given) of components left out of the mix since
    # Per component, which records of which shards (ShardedSource.identity): a state restores only onto the same.
    datasets: tuple[str, ...] | None = None
    # Per component, how a packed mixture's pre-tokenized component was tokenised (loader/planning/counts.py
    # tokenization; None: not said): a component tokenised again lays out other rows, so a state refuses it.
    tokens: tuple[str | None, ...] | None = None

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 (got batch_size={self.batch_size})")
        check_hosts(self.batch_size, self.shard_index, self.shard_count)
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0 (got seed={self.seed})")
        if self.base is None:
            object.__setattr__(self, "base", (0,) * len(self.names))
        if self.num_epochs is None:
            object.__setattr__(self, "num_epochs", (None,) * len(self.names))
        for name, e in zip(self.names, self.num_epochs):
            if e is not None and e < 1:
                raise ValueError(f"num_epochs for component {name!r} must be >= 1 or None for forever (got {e})")
        schedule = quota_schedule(self.weights)
        rank = np.empty(len(schedule), dtype=np.int64)  # each row's count of earlier rows of its component
        for c in range(len(self.weights)):
            rows = np.flatnonzero(schedule == c)
            rank[rows] = np.arange(len(rows))
        object.__setattr__(self, "_schedule", schedule)
        object.__setattr__(self, "_rank", rank)
        object.__setattr__(self, "_offsets", np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64))
        object.__setattr__(self, "_seeds", tuple(component_seed(self.seed, n) for n in self.names))

    @property
    def offsets(self) -> np.ndarray:
        """The global index of each component's first record in the concatenation of the components."""
        return self._offsets

    @property
    def period(self) -> int:
        return len(self._schedule)

    @property
    def per_host(self) -> int:
        return self.batch_size // self.shard_count

    @property
    def num_records(self) -> int:
        return int(sum(self.sizes))

    @functools.cached_property
    def _ends(self) -> dict[int, int]:
        """Per component bounded by its num_epochs (and drawn from), the first of its rows the mix cannot give."""
        ends = {}
        for c, epochs in enumerate(self.num_epochs):
            if epochs is None or not self.weights[c]:
                continue
            remaining = epochs * self.sizes[c] - self.base[c]  # rows of c still allowed
            full, r = divmod(max(0, remaining), self.weights[c])  # the first row not allowed: c's next occurrence
            ends[c] = full * self.period + int(np.flatnonzero(self._schedule == c)[r])
        return ends

    @property
    def end_row(self) -> int | None:
        """The first row the mix cannot give (a component past its num_epochs), or None when it is endless."""
        return self.start_batch * self.batch_size + min(self._ends.values()) if self._ends else None

    @property
    def ending(self) -> str | None:
        """The component whose num_epochs ends the mix (None: endless)."""
        return self.names[min(self._ends, key=self._ends.get)] if self._ends else None

    @property
    def num_batches(self) -> int:
        if self.end_row is None:
            return FOREVER
        return self.end_row // self.batch_size if self.drop_remainder else -(-self.end_row // self.batch_size)

    def host_positions_range(self, first_batch: int, end_batch: int) -> list[np.ndarray]:
        """Per batch k in [first_batch, end_batch), the rows of the mixed stream that are this host's."""
        if first_batch < self.start_batch:
            raise IndexError(f"batch {first_batch} comes before this plan's segment, which starts at batch "
                             f"{self.start_batch}")
        return host_rows(first_batch, end_batch, self.batch_size, self.shard_index, self.shard_count,
                         self.num_batches, self.end_row)

    def streams(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each row's (component, position in that component's own stream of rows)."""
        relative = np.asarray(rows, dtype=np.int64) - self.start_batch * self.batch_size
        cycles, within = np.divmod(relative, self.period)
        component = self._schedule[within]
        j = np.asarray(self.base, np.int64)[component] + cycles * np.asarray(self.weights, np.int64)[component] \
            + self._rank[within]
        return component, j

    def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each row's (component, epoch of that component, record within the component)."""
        component, j = self.streams(rows)
        sizes = np.asarray(self.sizes, np.int64)[component]
        epoch, position = np.divmod(j, sizes)
        record = position.copy()
        if self.shuffle:  # one permutation call per (component, epoch) present
            keys = component.astype(np.int64) << 40 | epoch
            for key in np.unique(keys).tolist():
                mask = keys == key
                record[mask] = self._permutation(key >> 40, key & ((1 << 40) - 1))(position[mask])
        return component, epoch, record

    @functools.lru_cache(maxsize=16)
    def _permutation(self, component: int, epoch: int) -> Permutation:
        return Permutation(self.sizes[component], self._seeds[component], epoch)

    def indices_at(self, rows: np.ndarray) -> np.ndarray:
        component, _, record = self.locate(rows)
        return self._offsets[component] + record

    def components_at(self, rows: np.ndarray) -> np.ndarray:
        relative = np.asarray(rows, dtype=np.int64) - self.start_batch * self.batch_size
        return self._schedule[relative % self.period]

    def record_rngs(self, rows: np.ndarray, indices: np.ndarray) -> list[np.random.Generator]:
        """For `random_map_fn`: a generator per row from (component's key, its epoch, record), so a record's draw
        does not depend on the other components or the weights; `indices` are `indices_at(rows)`, which the caller
        has already (no permutation is evaluated again)."""
        component, j = self.streams(rows)
        epoch = j // np.asarray(self.sizes, np.int64)[component]
        record = np.asarray(indices, np.int64) - self._offsets[component]
        return [record_rng(self._seeds[c], int(e), int(r)) for c, e, r in zip(component, epoch, record)]

    def counts_at(self, batch: int) -> tuple[int, ...]:
        """Rows each component has given before global batch `batch`."""
        relative = batch * self.batch_size - self.start_batch * self.batch_size
        if relative < 0:
            raise IndexError(f"batch {batch} comes before this plan's segment (batch {self.start_batch})")
        cycles, within = divmod(relative, self.period)
        part = np.bincount(self._schedule[:within], minlength=len(self.names))
        return tuple(int(b + cycles * w + p) for b, w, p in zip(self.base, self.weights, part))

    # -- state ------------------------------------------------------------------------------------------------
    def state(self, next_batch: int) -> dict:
        counts = self.counts_at(next_batch)
        return {"seed": self.seed, "batch_size": self.batch_size, "shuffle": self.shuffle,
                "drop_remainder": self.drop_remainder, "start_batch": self.start_batch,
                "components": {n: {"records": s, "weight": w, "base": b, "rows": r, "num_epochs": e,
                                   **({"dataset": self.datasets[c]} if self.datasets is not None else {}),
                                   **({"tokens": self.tokens[c]} if self.tokens and self.tokens[c] else {})}
                               for c, (n, s, w, b, r, e) in
                               enumerate(zip(self.names, self.sizes, self.weights, self.base, counts,
                                             self.num_epochs))},
                **({"dormant": dict(self.dormant)} if self.dormant else {})}

    def restored(self, saved: dict, next_batch: int) -> MixturePlan:
        """This plan continued from a saved state: the saved segment itself when the components, weights and batch size
        are the same (the batches continue bitwise), else a new segment at `next_batch` from each component's saved
        count."""
        options = ("seed", "batch_size", "shuffle", "drop_remainder")  # (another batch_size: a new segment)
        mine, given = {k: getattr(self, k) for k in options}, {k: saved.get(k) for k in options}
        components = saved.get("components", {})
        for c, name in enumerate(self.names):  # a component named in both is the same records
            for key, now in (("records", self.sizes[c]), ("dataset", self.datasets[c] if self.datasets else None),
                             ("tokens", self.tokens[c] if self.tokens else None)):
                if name in components and key in components[name] and now is not None:
                    mine[f"{key} of component {name!r}"], given[f"{key} of component {name!r}"] = \
                        now, components[name][key]
            if mine.get(f"dataset of component {name!r}") != given.get(f"dataset of component {name!r}"):
                mine.pop(f"records of component {name!r}", None)  # (its dataset's identity names its records)
                given.pop(f"records of component {name!r}", None)
        check(given, mine, "the mixture's state",
              "restore with the same datasets and options (weights and components may change)")
        rows = {**saved.get("dormant", {}), **{name: c["rows"] for name, c in components.items()}}
        dormant = tuple((n, r) for n, r in sorted(rows.items()) if n not in self.names)
        epochs = {n: (components[n]["num_epochs"], e) for n, e in zip(self.names, self.num_epochs)
                  if "num_epochs" in components.get(n, {}) and components[n]["num_epochs"] != e}
        if epochs:  # an end condition: the rows so far are the same, the mix ends elsewhere
            log.info("restoring a mixture's state saved with other num_epochs (%s): the mix goes on as saved and ends "
                     "when a component's new num_epochs runs out",
                     ", ".join(f"{n} {a} -> {b}" for n, (a, b) in epochs.items()))
        was = {n: c["weight"] for n, c in components.items()}
        now = dict(zip(self.names, self.weights))
        if list(components) == list(self.names) and saved.get("batch_size") == self.batch_size and was == now:
            return dataclasses.replace(self, start_batch=saved["start_batch"], dormant=dormant,
                                       base=tuple(components[n]["base"] for n in self.names))
        if was == now and saved.get("batch_size") == self.batch_size:  # the same mix, its components listed in
            # another order: each component goes on exactly, but the rows interleave in a new order from here
            log.warning("restoring a mixture's state saved with its components in the order %s under %s: each "
                        "component's rows go on where they stopped, but the batches from batch %d differ from an "
                        "uninterrupted run's; list the components as saved to continue it exactly",
                        list(components), list(self.names), next_batch)
        elif was != now:  # (another batch size alone is said by said_new_batch_size)
            log.info("restoring a mixture's state saved with weights %s (as integers) under %s: from batch %d each "
                     "component's rows follow the new weights, going on from the %s rows each had given", was, now,
                     next_batch, ", ".join(f"{n} {rows.get(n, 0):,}" for n in self.names))
        return dataclasses.replace(self, start_batch=next_batch, dormant=dormant,
                                   base=tuple(rows.get(n, 0) for n in self.names))


def concatenate(sources: Mapping[str, ShardedSource]) -> ShardedSource:
    """The components' shards end to end, in the mapping's order: one source for the reader and its index."""
    parts = list(sources.values())
    tokens = {name: p.tokens_dtype for name, p in sources.items()}
    if len(set(tokens.values())) > 1:
        raise ValueError(f"the mixture's components hold different records (token id types, None: not pre-tokenized: "
                         f"{tokens}); mix pre-tokenized datasets of one tokenizer, or text datasets")
    check_one_tokenizer({name: p.tokenizer for name, p in sources.items()}, "the mixture's components")
    alike = len({features_text(p.features_dir) for p in parts}) == 1
    return dataclasses.replace(joined(parts), kind="mixture", features_dir=parts[0].features_dir if alike else None,
                               component_features=None if alike else tuple(p.features_dir for p in parts),
                               component_lengths=None if alike else tuple(len(p) for p in parts))


def check_one_tokenizer(tokenizers: Mapping[str, str | None], what: str) -> None:
    """Raises when pre-tokenized datasets (`tokenizers`: name -> loader.format.source.tokenizer_identity, None for
    data that is not pre-tokenized) were tokenized by different tokenizers: the same id is another token in each."""
    digests = {name: t.rsplit("(", 1)[-1] for name, t in tokenizers.items() if t is not None}
    if len(set(digests.values())) > 1:
        listed = ", ".join(f"{name}: {t}" for name, t in tokenizers.items() if t is not None)
        raise ValueError(f"{what} were tokenized by different tokenizers ({listed}): an id means another token in "
                         "each; convert them all with one --tokenizer")


def check_weights(names: tuple[str, ...], weights: Mapping[str, float] | None) -> dict[str, int]:
    if weights is None:
        raise ValueError(f"a mixture of {list(names)} needs weights=, e.g. weights={{{', '.join(f'{n!r}: 1' for n in names)}}}")
    if set(weights) != set(names):
        missing, extra = sorted(set(names) - set(weights)), sorted(set(weights) - set(names))
        raise ValueError(f"weights do not match the mixture's components {list(names)}: "
                         + "; ".join(([f"no weight for {missing}"] if missing else [])
                                     + ([f"weights for unknown {extra}"] if extra else [])))
    return integer_weights({n: weights[n] for n in names})


def features_text(features_dir: str | None) -> str | None:
    """A TFDS dataset's features.json, to tell whether two components decode alike (None: tf.Examples)."""
    if features_dir is None:
        return None
    return storage.read_text(storage.join(features_dir, FEATURES_NAME))
