"""Packing a mixture: each component packs its own examples into rows of `seq_len`, and the mixture draws rows.

    packing = loader.Packing("text", seq_len=1024, tokenize=ids_of)
    batches = loader.load({"web": W, "code": C}, weights={"web": 0.7, "code": 0.3}, batch_size=32, packing=packing)

Component c's rows form an endless stream: its epoch e is the block-wise layout (loader/planning/packing.py) of its
examples in its own permutation for (seed, name, e), laid out as it is reached, epoch after epoch, every row kept. Row t
of the mixed stream is row j of component c's stream (loader/planning/mixture.py), so the weights count rows of
`seq_len` tokens: token proportions, which is what a pretraining mixture sets. Global batch k is rows [k*B, (k+1)*B) of
the mixed stream and host i of n takes rows [i*B/n, (i+1)*B/n), so the global batches are the same for any host count.
The state is the mixture's (rows taken from each component), so resume is exact and new weights continue each
component's stream where it stopped. A packed mixture is endless (a component's epochs repeat), and `component` says
each row's component.
"""

from __future__ import annotations

import bisect
import functools
import threading

import numpy as np

from loader.packed import Inputs, Jobs, PackedIterator, PackedLoader
from loader.planning.mixture import MixturePlan, component_seed, COMPONENT_KEY
from loader.planning.packing import Job, Layout, BLOCK, START, WINDOW
from loader.planning.state import check, check_kind, said_new_batch_size


class RowStream:
    """A component's rows, epoch after epoch, every row kept: `row(j)` -> the pieces (record, first target, targets)
    of row j. The rows are its Layout's blocks in order (loader/planning/packing.py), laid out as they are reached, from
    the stream's start or from an anchor: (i, r), its block i (epoch i // blocks, block i % blocks) begins at row r,
    which a saved state holds so that a resume lays out nothing before it."""

    def __init__(self, name: str, layout: Layout):
        self._name, self._layout = name, layout
        self._lock = threading.Lock()
        self._seek(0, 0)

    def _seek(self, block: int, row: int) -> None:
        self._first_block, self._first_row = block, row
        self._ends: list[int] = []  # rows up to the end of each block laid out from the anchor on
        self._epoch_rows: int | None = None  # rows of the epoch being laid out, from its first block on

    def anchor(self, j: int) -> tuple[int, int]:
        """(i, r): the block holding row j and the row it begins at."""
        with self._lock:
            if j == self._first_row and not self._ends:  # nothing taken since the anchor (a weight-0 component's
                return self._first_block, self._first_row  # rows: none): it is the anchor, laid out or not
            i = self._reach(j)
            return self._first_block + i, self._first_row + (self._ends[i - 1] if i else 0)

    def seek(self, block: int, row: int) -> None:
        """Starts the stream's layout at an anchor (from a saved state) unless it has laid out past it already."""
        with self._lock:
            if block > self._first_block + len(self._ends):
                self._seek(block, row)

    def _reach(self, j: int) -> int:
        """Lays out blocks until row j (j >= the anchor's row); returns its block's index from the anchor."""
        layout = self._layout
        if j < self._first_row:  # before the anchor (not reached by a resumed loader): lay out from the start
            self._seek(0, 0)
        j -= self._first_row
        while not self._ends or self._ends[-1] <= j:
            epoch, b = divmod(self._first_block + len(self._ends), layout.blocks)
            rows = layout.rows_in(epoch, b)
            self._epoch_rows = rows + (self._epoch_rows or 0) if b else rows
            if b == layout.blocks - 1 and self._epoch_rows == 0:  # a whole epoch without rows
                raise ValueError(f"mixture component {self._name!r} has no tokens to pack: every example has "
                                 "fewer than 2 tokens")
            self._ends.append((self._ends[-1] if self._ends else 0) + rows)
        return bisect.bisect_right(self._ends, j)

    def row(self, j: int) -> list[tuple]:
        layout = self._layout
        with self._lock:
            i = self._reach(j)
            first = self._first_row + (self._ends[i - 1] if i else 0)
            block = self._first_block + i
        return layout.block(*divmod(block, layout.blocks)).row(j - first)


class PackedMixtureLoader(PackedLoader):
    """An endless iterable of packed batches drawn from a mixture's components by its weights."""

    def __init__(self, names: tuple[str, ...], inputs: Inputs, config, plan: MixturePlan):
        """`config`: the LoaderConfig (loader/pipeline.py), its `packing` set; `plan`: the mixture's."""
        self._setup(inputs, config)
        self.components, self.plan = names, plan
        self._offsets = plan.offsets
        self._streams = []
        for name, offset, size in zip(names, self._offsets, plan.sizes):
            layout = Layout(functools.partial(_shifted, self.counts, int(offset)), int(size), self.packing.seq_len,
                            self.packing.fit, component_seed(plan.seed, name), plan.shuffle)
            self._streams.append(RowStream(name, layout))

    def __len__(self) -> int:
        raise TypeError("a packed mixture is endless (its components repeat their epochs): it has no length")

    def __iter__(self) -> PackedMixtureIterator:
        return PackedMixtureIterator(self)

    def mixed_job(self, k: int, plan: MixturePlan) -> Job:
        """Host batch k's Job: its rows drawn from the components' streams, each row's component beside them."""
        rows = plan.host_positions_range(k, k + 1)[0]
        component, j = plan.streams(rows)
        pieces = [[(int(self._offsets[c]) + record, start, n) for record, start, n in self._streams[c].row(int(jj))]
                  for c, jj in zip(component.tolist(), j.tolist())]
        return Job.of(pieces, self.counts, {COMPONENT_KEY: component.astype(np.int32)})

    def state_key(self) -> dict:
        return {"seq_len": self.packing.seq_len, "feature": self.packing.feature or "tokens", "fit": self.packing.fit,
                "layout": f"blocks of {BLOCK}, window {WINDOW}", "counts": self.counts.how}


def _shifted(counts, offset: int, records: np.ndarray) -> np.ndarray:
    """A component's token counts: its records are the mixture's from `offset` on."""
    return counts(np.asarray(records, np.int64) + offset)


class PackedMixtureIterator(PackedIterator):
    """`get_state()` holds the mixture's rows per component; `set_state` may be given a state saved under other
    weights or components (MixturePlan.restored)."""

    def __init__(self, loader: PackedMixtureLoader):
        self._plan = loader.plan
        super().__init__(loader)

    def _new_jobs(self, k: int, position) -> Jobs:
        plan = self._plan
        return Jobs(lambda k, at: (self._loader.mixed_job(k, plan), at), k, position)

    def get_state(self) -> dict:
        mixture = self._plan.state(self._consumed)
        anchors = {name: list(stream.anchor(mixture["components"][name]["rows"]))
                   for name, stream in zip(self._loader.components, self._loader._streams)}
        return {"next_batch": self._consumed, "packing": self._loader.state_key(), "mixture": mixture,
                "anchors": anchors}

    def set_state(self, state: dict) -> None:
        check_kind(state, "a packed mixture", "this packed mixture")
        if not isinstance(state.get("packing"), dict):
            raise ValueError(f"this packed mixture's state is damaged: its 'packing' is {state.get('packing')!r}")
        saved = dict(state["packing"])
        if str(saved.get("counts", "")).startswith("files:"):  # (a state saved when it named the components' files)
            saved["counts"] = "files"
        check(saved, self._loader.state_key(), "the packed mixture's state", "restore with the same "
              "packing options (the components and weights may change)")
        self.close()
        self._plan = self._loader.plan.restored(state["mixture"], int(state["next_batch"]))
        said_new_batch_size(state, self._plan.batch_size)
        anchors = state.get("anchors", {})  # (block, its first row) of each component's next row
        taken = dict(zip(self._loader.components, self._plan.counts_at(int(state["next_batch"]))))
        for name, stream in zip(self._loader.components, self._loader._streams):
            block, row = map(int, anchors.get(name, (0, 0)))
            if block >= 0 and 0 <= row <= taken[name]:  # (else not a state of ours: laid out from the start)
                stream.seek(block, row)
        self._start(int(state["next_batch"]), START)
