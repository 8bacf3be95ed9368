"""Packing a mixture: each component packs its own examples into rows of `seq_len`, and the mixture draws rows.

    packing = loader.Packing("text", seq_len=1024, tokenize=ids_of)
    batches = loader.load({"web": W, "code": C}, weights={"web": 0.7, "code": 0.3}, batch_size=32, packing=packing)

Component c's rows form an endless stream: its epoch e is the first-fit layout (loader/packing.py) of its examples in
its own permutation for (seed, name, e), epoch after epoch, every row kept. Row t of the mixed stream is row j of
component c's stream (loader/mixture.py), so the weights count rows of `seq_len` tokens: token proportions, which is
what a pretraining mixture sets. Global batch k is rows [k*B, (k+1)*B) of the mixed stream and host i of n takes rows
[i*B/n, (i+1)*B/n), so the global batches are the same for any host count. The state is the mixture's (rows taken
from each component), so resume is exact and new weights continue each component's stream where it stopped. A
packed mixture is endless (a component's epochs repeat), and `component` says each row's component.
"""

from __future__ import annotations

import bisect
import functools
import threading

import numpy as np

from loader.mixture import COMPONENT_KEY, MixturePlan, component_seed
from loader.packing import PackedIterator, PackedLoader, Packing, assemble, pack_rows
from loader.permutation import Permutation


class RowStream:
    """Component rows, epoch after epoch: `row(j)` -> the pieces (record, first target, targets) of row j."""

    def __init__(self, lengths: np.ndarray, seq_len: int, seed: int, shuffle: bool):
        self._lengths, self._seq_len, self._seed, self._shuffle = lengths, seq_len, seed, shuffle
        self._ends: list[int] = []  # rows up to the end of each epoch laid out so far
        self._lock = threading.Lock()

    @functools.lru_cache(maxsize=4)
    def rows(self, epoch: int) -> list[list[tuple]]:
        n = len(self._lengths)
        order = Permutation(n, self._seed, epoch)(np.arange(n)) if self._shuffle else np.arange(n)
        return pack_rows(self._lengths, order, self._seq_len)

    def row(self, j: int) -> list[tuple]:
        with self._lock:
            while not self._ends or self._ends[-1] <= j:
                self._ends.append((self._ends[-1] if self._ends else 0) + len(self.rows(len(self._ends))))
            epoch = bisect.bisect_right(self._ends, j)
            first = self._ends[epoch - 1] if epoch else 0
        return self.rows(epoch)[j - first]


class PackedMixtureLoader(PackedLoader):
    """An endless iterable of packed batches drawn from a mixture's components by its weights."""

    def __init__(self, names: tuple[str, ...], source, reader, decoder, packing: Packing, plan: MixturePlan,
                 prefetch: int = 2, sharding=None, device_prefetch: int = 2):
        self.source, self._reader, self._decoder, self.packing = source, reader, decoder, packing
        self._prefetch, self._sharding, self._device_prefetch = prefetch, sharding, device_prefetch
        self.components, self.plan = names, plan
        lengths = self._lengths()
        self._offsets = plan.offsets
        self._streams = []
        for name, offset, size in zip(names, self._offsets, plan.sizes):
            part = lengths[offset:offset + size]
            if not part.sum():
                raise ValueError(f"mixture component {name!r} has no tokens to pack: every example of its "
                                 f"{packing.feature!r} has fewer than 2 tokens")
            self._streams.append(RowStream(part, packing.seq_len, component_seed(plan.seed, name), plan.shuffle))

    def __len__(self) -> int:
        raise TypeError("a packed mixture is endless (its components repeat their epochs): it has no length")

    def __iter__(self) -> PackedMixtureIterator:
        return PackedMixtureIterator(self)

    def host_batch(self, k: int, plan: MixturePlan | None = None) -> dict[str, np.ndarray]:
        plan = plan or self.plan
        rows = plan.host_positions_range(k, k + 1)[0]
        component, j = plan.streams(rows)
        pieces = [[(int(self._offsets[c]) + record, start, n) for record, start, n in self._streams[c].row(int(jj))]
                  for c, jj in zip(component.tolist(), j.tolist())]
        records = np.array(sorted({record for row in pieces for record, _, _ in row}), np.int64)
        ids = dict(zip(records.tolist(), self._ids(self._reader(records)))) if len(records) else {}
        return {**assemble(pieces, ids, self.packing.seq_len), COMPONENT_KEY: component.astype(np.int32)}

    def state_key(self) -> dict:
        return {"seq_len": self.packing.seq_len, "feature": self.packing.feature}


class PackedMixtureIterator(PackedIterator):
    """`get_state()` holds the mixture's rows per component; `set_state` may be given a state saved under other
    weights or components (MixturePlan.restored)."""

    def __init__(self, loader: PackedMixtureLoader):
        self._plan = loader.plan
        super().__init__(loader)

    def _total(self) -> None:
        return None

    def _batch(self, k: int) -> dict[str, np.ndarray]:
        return self._loader.host_batch(k, self._plan)

    def get_state(self) -> dict:
        return {"next_batch": self._consumed, "packing": self._loader.state_key(),
                "mixture": self._plan.state(self._consumed)}

    def set_state(self, state: dict) -> None:
        if "mixture" not in state or state.get("packing") != self._loader.state_key():
            raise ValueError(f"cannot restore this packed mixture from a state saved by another loader (its packing: "
                             f"{state.get('packing')!r}, this one's: {self._loader.state_key()!r})")
        self.close()
        self._plan = self._loader.plan.restored(state["mixture"], int(state["next_batch"]))
        self._start(int(state["next_batch"]))
