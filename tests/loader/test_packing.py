"""Packing token sequences into rows: a fixed layout, exact resume, the same global batches for any host count."""

import itertools
import os
import signal
import time

import numpy as np
import pytest

import loader
from loader.packed import assemble
from loader.planning.packing import pack_rows, START
from tests.loader.conftest import LENGTHS
from tests.loader.ids import flat_ids
from tests.loader.conftest import token_ids as _ids

def _packed(data, seq_len=6, keys="default", **options):
    packing = loader.Packing("ids", seq_len=seq_len, tokenize=lambda v: np.asarray(v).reshape(-1), keys=keys)
    return loader.load(data, packing=packing, **{"batch_size": 2, "seed": 0, **options})


def test_first_fit_layout_is_fixed():
    rows = pack_rows(np.array(LENGTHS[:5]), np.arange(5), seq_len=6)
    assert rows == [[(0, 0, 5)], [(1, 0, 3), (2, 6, 3)], [(2, 0, 6)], [(3, 0, 2), (4, 0, 4)]]
    row = assemble(rows[1:2], {1: _ids(1), 2: _ids(2)}, seq_len=6)
    assert row["tokens"].tolist() == [[100, 101, 102, 206, 207, 208]]
    assert row["targets"].tolist() == [[101, 102, 103, 207, 208, 209]]
    assert row["segment_ids"].tolist() == [[1, 1, 1, 2, 2, 2]]
    assert row["positions"].tolist() == [[0, 1, 2, 0, 1, 2]]


def test_packed_batches_are_fixed_for_a_seed(token_data):
    batches = _packed(token_data, shuffle=False, num_epochs=1)
    assert len(batches) == 5 and batches.plan.efficiency() == pytest.approx(55 / 60)  # 10 rows
    first = next(iter(batches))
    assert first["tokens"].tolist() == [[0, 1, 2, 3, 4, 506], [100, 101, 102, 206, 207, 208]]  # 506: 5's last piece
    assert first["segment_ids"].tolist() == [[1, 1, 1, 1, 1, 2], [1, 1, 1, 2, 2, 2]]
    shuffled = [b["tokens"][:, 0].tolist() for b in _packed(token_data, num_epochs=1)]
    assert shuffled == SHUFFLED_FIRST_TOKENS


# The first token of each row with seed 0, pinned from one run: a change of order or layout fails here.
SHUFFLED_FIRST_TOKENS = [[700, 400], [200, 206], [1100, 900], [800, 0], [500, 1000]]


def test_a_packed_batch_that_raised_comes_next_when_the_caller_asks_again(token_data):
    """As for a plain loader (test_load.py): the caller that catches the error and asks again gets the batch that
    failed, then the rest, and the state counts what it was handed."""
    expected = [b["tokens"].tolist() for b in itertools.islice(_packed(token_data), 14)]
    armed = []

    def tokenize(value):
        ids = np.asarray(value).reshape(-1)
        if armed and ids[0] == 500:  # example 5, once, after the token counts were taken
            armed.clear()
            raise OSError("transient error")
        return ids

    packing = loader.Packing("ids", seq_len=6, tokenize=tokenize)
    it = iter(loader.load(token_data, batch_size=2, seed=0, packing=packing))
    got, errors = [next(it)["tokens"].tolist()], []
    armed.append(True)
    while len(got) < 14:
        try:
            got.append(next(it)["tokens"].tolist())
        except Exception as e:  # noqa: BLE001 - what a retrying caller catches
            errors.append((str(e), it.get_state()["next_batch"]))
    assert len(errors) == 1 and "transient error" in errors[0][0] and 1 <= errors[0][1] < 14
    assert got == expected and it.get_state()["next_batch"] == 14
    it.close()


def test_resume_mid_epoch_is_exact(token_data):
    batches = _packed(token_data, num_epochs=3)
    it = iter(batches)
    seen = [next(it) for _ in range(7)]
    state = it.get_state()
    rest = [next(it) for _ in range(4)]
    again = iter(_packed(token_data, num_epochs=3))
    again.set_state(state)
    for a, b in zip(rest, [next(again) for _ in range(4)]):
        assert all(np.array_equal(a[k], b[k]) for k in a)
    assert state["next_batch"] == 7 and len(seen) == 7
    with pytest.raises(ValueError, match="cannot restore the packed loader's state: seed: saved 0, now 1; restore "
                                         "with the same dataset and options"):
        iter(_packed(token_data, num_epochs=3, seed=1)).set_state(state)
    retokenised = loader.Packing("ids", seq_len=6, tokenize=lambda v: np.asarray(v).reshape(-1), cache_key="v2")
    with pytest.raises(ValueError, match=r"counts: saved '[^']+', now '[^']+' \(the documents' token counts "
                                         r"differ: the data was tokenised again, by another tokenizer, or is another "
                                         r"dataset\)"):
        iter(loader.load(token_data, packing=retokenised, batch_size=2, seed=0, num_epochs=3)).set_state(state)


@pytest.mark.parametrize("hosts", [2, 4])
def test_hosts_together_get_the_global_batches(token_data, hosts):
    whole = [b for b in _packed(token_data, batch_size=4, num_epochs=2)]
    parts = [list(_packed(token_data, batch_size=4, num_epochs=2, shard_index=i, shard_count=hosts))
             for i in range(hosts)]
    assert len(whole) >= 4 and all(len(p) == len(whole) for p in parts)
    for k, batch in enumerate(whole):
        for key in batch:
            assert np.array_equal(np.concatenate([p[k][key] for p in parts]), batch[key])


def test_every_target_is_packed_once_per_epoch(token_data):
    seen = []
    for batch in _packed(token_data, batch_size=1, num_epochs=1):
        seen += batch["targets"][batch["segment_ids"] > 0].tolist()
    assert sorted(seen) == sorted(t for i in range(len(LENGTHS)) for t in _ids(i)[1:].tolist())


def _plan(counts, batch_size=4, block=None, **options):
    from loader.planning.packing import Layout, PackedPlan

    counts = np.asarray(counts)
    layout = Layout(lambda r: counts[r], len(counts), options.pop("seq_len", 32), options.pop("fit", "first"),
                    options.pop("seed", 0), options.pop("shuffle", True), block)
    return PackedPlan(layout, batch_size, **options)


def _batches(plan, n):
    """The first n batches' rows, walking from the start."""
    out, at = [], START
    for _ in range(n):
        rows, at = plan.batch_at(at)
        out.append([block.row(r) for block, r in rows])
    return out


def test_blocks_are_packed_alone_and_batches_cross_them():
    """With blocks of 4 documents, each block's rows are its own (no piece of block 1 in a row of block 0) and a
    batch takes rows from two blocks; the whole layout is pinned."""
    plan = _plan([x + 1 for x in LENGTHS], batch_size=3, block=4, seq_len=6, shuffle=False, num_epochs=1)
    rows = [row for batch in _batches(plan, plan.num_batches) for row in batch]
    assert rows == [[(0, 0, 5)], [(1, 0, 3), (2, 6, 3)], [(2, 0, 6)], [(3, 0, 2)],  # block 0 (documents 0-3)
                    [(4, 0, 4), (5, 6, 1), (6, 0, 1)], [(5, 0, 6)], [(7, 0, 6)],  # block 1
                    [(8, 0, 6)], [(8, 6, 2), (9, 0, 2)]]  # block 2's first rows; its last two rows fill no batch
    assert plan.num_batches == 3  # 4 + 3 + 4 rows


def test_best_fit_is_pinned_and_pads_less_than_first_fit():
    lengths = np.array([5, 8, 2, 5])  # the 2 goes where it fits tightest, leaving room for the last 5
    assert pack_rows(lengths, np.arange(4), seq_len=10, fit="best") == [[(0, 0, 5), (3, 0, 5)], [(1, 0, 8), (2, 0, 2)]]
    assert pack_rows(lengths, np.arange(4), seq_len=10) == [[(0, 0, 5), (2, 0, 2)], [(1, 0, 8)], [(3, 0, 5)]]
    lengths = np.random.default_rng(0).integers(1, 900, 200_000)
    first, best = (_plan(lengths, seq_len=1024, fit=f, num_epochs=1).efficiency() for f in ("first", "best"))
    assert best > first > 0.9


def _reference_rows(targets, seq_len, window, best):
    """The packing rule, one piece at a time, as loader/planning/_pack.c's comment states it (the C code keeps a long
    document's full pieces as one run; this keeps every piece)."""
    rows, open_ = [], []  # open_: [row, free] of the newest `window` rows
    for doc, total in enumerate(targets):
        for start in range(0, total, seq_len):
            n = min(seq_len, total - start)
            fits = [o for o in open_ if o[1] >= n]
            chosen = (min(fits, key=lambda o: o[1]) if best else fits[0]) if fits else None
            if chosen is None:
                if len(open_) == window:
                    open_.pop(0)
                rows.append([])
                chosen = [len(rows) - 1, seq_len]
                open_.append(chosen)
            chosen[1] -= n
            rows[chosen[0]].append((doc, start, n))
    return rows


@pytest.mark.parametrize("fit", ["first", "best"])
def test_the_packer_follows_its_rule_piece_by_piece(fit):
    """Random blocks, long documents (runs of full rows) among short ones, small windows: the C packer's rows are
    the rule's, piece by piece."""
    rng = np.random.default_rng(7)
    for case in range(300):
        seq_len, window = int(rng.integers(1, 40)), int(rng.integers(1, 6))
        targets = rng.integers(0, 2 * seq_len, int(rng.integers(0, 60)))
        targets[rng.random(len(targets)) < 0.15] *= int(rng.integers(2, 12))
        expected = _reference_rows(targets.tolist(), seq_len, window, fit == "best")
        assert pack_rows(targets, np.arange(len(targets)), seq_len, fit, window) == expected, (case, seq_len, window)


def test_counts_of_billions_cost_no_memory_or_time():
    """A damaged or crafted count (4e9 targets at seq_len 1) lays out in bounded memory and time: a run of rows is
    one segment. The rows are still exact: row r of the run holds target r."""
    from loader.planning.packing import Layout

    counts = np.array([5, 2**32 - 1, 3] * 20_000, np.uint32)  # one block
    started = time.monotonic()
    layout = Layout(lambda r: counts[r], len(counts), 1, shuffle=False)
    block = layout.block(0, 0)
    assert time.monotonic() - started < 5 and block.records.nbytes < 8 * 4 * len(counts)
    assert block.rows == 20_000 * (4 + 2**32 - 2 + 2) == layout.epoch_rows(0)
    assert block.row(4 + 12345) == [(1, 12345, 1)] and block.row(4 + 2**32 - 3) == [(1, 2**32 - 3, 1)]
    assert block.row(4 + 2**32 - 2) == [(2, 0, 1)]


def test_the_first_batch_of_a_huge_corpus_lays_out_one_block(monkeypatch):
    """10M documents: the first batch reads the counts of one block (BLOCK documents), not the corpus."""
    asked = []
    counts = np.full(10_000_000, 40, np.uint32)

    def count(records):
        asked.append(len(records))
        return counts[records]

    from loader.planning.packing import Layout, PackedPlan, BLOCK

    plan = PackedPlan(Layout(count, len(counts), 1024), batch_size=8)
    rows, after = plan.batch_at(START)
    assert sum(asked) == BLOCK and len(rows) == 8 and after == (0, 0, 8)
    assert sum(n for r in rows for _, _, n in rows[0][0].row(rows[0][1])) > 1000


def test_resume_from_a_position_lays_out_nothing_before_it(token_data, monkeypatch):
    from loader.planning import packing

    whole = _packed(token_data, num_epochs=4)
    it = iter(whole)
    for _ in range(12):
        next(it)
    state = it.get_state()
    rest = [next(it)["tokens"].tolist() for _ in range(5)]
    assert state["position"][0] == 2  # epoch 2: 5 batches an epoch
    packed = []
    real = packing.pack_block
    monkeypatch.setattr(packing, "pack_block", lambda *a, **k: packed.append(1) or real(*a, **k))
    again = iter(_packed(token_data, num_epochs=4))
    again.set_state(state)
    assert [next(again)["tokens"].tolist() for _ in range(5)] == rest
    assert len(packed) == 2  # epochs 2 and 3, never 0 or 1


def test_a_state_saved_on_2_hosts_resumes_on_3(token_data):
    whole = [b["tokens"] for b in _packed(token_data, batch_size=6, num_epochs=6, seq_len=4)]
    twos = [iter(_packed(token_data, batch_size=6, num_epochs=6, seq_len=4, shard_index=i, shard_count=2))
            for i in range(2)]
    for _ in range(4):
        parts = [next(t)["tokens"] for t in twos]
    state = twos[0].get_state()
    assert state == twos[1].get_state() and np.array_equal(np.concatenate(parts), whole[3])
    threes = []
    for i in range(3):
        t = iter(_packed(token_data, batch_size=6, num_epochs=6, seq_len=4, shard_index=i, shard_count=3))
        t.set_state(state)
        threes.append(t)
    for k in range(4, len(whole)):
        assert np.array_equal(np.concatenate([next(t)["tokens"] for t in threes]), whole[k])
    assert len(whole) > 8


def test_maxtext_names(token_data):
    batch = next(iter(_packed(token_data, num_epochs=1, shuffle=False, keys="maxtext")))
    assert sorted(batch) == ["inputs", "inputs_position", "inputs_segmentation", "targets", "targets_position",
                             "targets_segmentation"]
    assert batch["inputs"].tolist() == [[0, 1, 2, 3, 4, 506], [100, 101, 102, 206, 207, 208]]
    assert np.array_equal(batch["inputs_segmentation"], batch["targets_segmentation"])


def test_counts_are_cached_by_cache_key(token_data, tmp_path, monkeypatch):
    monkeypatch.setenv("LOADER_INDEX_DIR", str(tmp_path))
    calls = []

    def tokenize(v):
        calls.append(1)
        return np.asarray(v).reshape(-1)

    def packed():
        packing = loader.Packing("ids", seq_len=6, tokenize=tokenize, cache_key="reshape-v1")
        return loader.load(token_data, packing=packing, batch_size=2, num_epochs=1, seed=0)

    first = [b["tokens"].tolist() for b in packed()]
    counted = len(calls)  # a counting pass (every record) and the batches' records
    calls.clear()
    again = [b["tokens"].tolist() for b in packed()]
    assert again == first and counted - len(calls) == len(LENGTHS)  # the second run has no counting pass
    assert len(list(tmp_path.glob("*.counts"))) == 1


def test_slices_count_and_cache_their_own_records(token_data, tmp_path, monkeypatch):
    """Two slices of one length under one cache_key: each packs its own documents (its counts cached apart)."""
    monkeypatch.setenv("LOADER_INDEX_DIR", str(tmp_path))
    for split, documents in (("[:6]", range(6)), ("[6:]", range(6, 12))):
        for _ in range(2):  # counted, then from the cache
            packing = loader.Packing("ids", seq_len=6, tokenize=flat_ids, cache_key="reshape-v1")
            rows = np.concatenate([b["tokens"] for b in loader.load(token_data, split=split, packing=packing,
                                                                     batch_size=1, num_epochs=1, seed=0)])
            ids = set(rows[rows > 0].tolist())  # (0 pads; it is also document 0's first id)
            assert {t // 100 for t in ids} == set(documents), split  # every document of the slice, no other's
            assert ids <= {int(t) for i in documents for t in _ids(i)}, split
    assert len(list(tmp_path.glob("*.counts"))) == 2


def test_counts_that_disagree_with_the_records_are_an_error_naming_the_record(token_data, tmp_path, monkeypatch):
    monkeypatch.setenv("LOADER_INDEX_DIR", str(tmp_path))
    packing = loader.Packing("ids", seq_len=6, tokenize=lambda v: np.asarray(v).reshape(-1), cache_key="k")
    list(loader.load(token_data, packing=packing, batch_size=2, num_epochs=1))
    (cached,) = tmp_path.glob("*.counts")
    cached.write_bytes(np.full(len(LENGTHS), 3, "<u4").tobytes())  # every document "3 tokens"
    with pytest.raises(ValueError, match=r"record \d+ has \d+ token ids but its token count says 3; the counts are "
                                         r"stale or damaged: the token counts were cached under the same "
                                         r"Packing.cache_key by another tokenizer: change the cache_key"):
        list(loader.load(token_data, packing=packing, batch_size=2, num_epochs=1))


def test_each_feature_packs_by_its_own_counts_under_one_cache_key(tmp_path, monkeypatch):
    """Two features of one dataset packed under the same cache_key: each is counted (and cached) as itself, and a
    state saved packing one does not restore onto the other."""
    from array_record.python.array_record_module import ArrayRecordWriter
    from dataset_format import example_proto

    monkeypatch.setenv("LOADER_INDEX_DIR", str(tmp_path / "index"))
    writer = ArrayRecordWriter(str(tmp_path / "two-0.array_record"), "group_size:1")
    for i in range(10):
        writer.write(example_proto.encode_example({"long": np.arange(i + 3), "short": np.arange(2)}))
    writer.close()

    def packed(feature):
        return loader.load(str(tmp_path / "two-0.array_record"), batch_size=2, seed=0,
                           packing=loader.Packing(feature, seq_len=8, tokenize=flat_ids, cache_key="same"))

    long = iter(packed("long"))
    next(long)
    state = long.get_state()
    long.close()
    short = packed("short")
    assert short.counts(np.arange(10)).tolist() == [2] * 10  # its own 2 ids a record (not the long feature's)
    assert len(list((tmp_path / "index").glob("*.counts"))) == 2
    with pytest.raises(ValueError, match=r"feature: saved 'long', now 'short'"):
        iter(short).set_state(state)


def test_a_packed_mixture_over_many_blocks_is_pinned_and_resumes(token_data, monkeypatch):
    """Blocks of 4 documents: each component's row stream crosses blocks and epochs; the rows are pinned, and a
    state taken mid-way resumes to the same batches."""
    from loader.planning import packing

    monkeypatch.setattr(packing, "BLOCK", 4)

    def mixed():
        return loader.load({"a": token_data, "b": token_data}, weights={"a": 2, "b": 1}, batch_size=3, seed=0,
                           packing=loader.Packing("ids", seq_len=6, tokenize=lambda v: np.asarray(v).reshape(-1)))

    it = iter(mixed())
    first = [(b["tokens"][:, 0].tolist(), b["component"].tolist()) for b in (next(it) for _ in range(3))]
    assert first == PINNED_MIXTURE
    state = it.get_state()
    rest = [next(it)["tokens"].tolist() for _ in range(6)]  # past the first epoch of both components
    again = iter(mixed())
    again.set_state(state)
    assert [next(again)["tokens"].tolist() for _ in range(6)] == rest


def test_a_packed_mixture_resumes_without_laying_out_the_blocks_before_its_state(token_data, monkeypatch):
    """Blocks of 2 documents, 6 an epoch: after 40 batches (several epochs of each component) the state holds each
    component's block; a resumed loader lays out only blocks from there on, and gives the same batches."""
    from loader.planning import packing

    monkeypatch.setattr(packing, "BLOCK", 2)

    def mixed():
        return loader.load({"a": token_data, "b": token_data}, weights={"a": 2, "b": 1}, batch_size=3, seed=0,
                           packing=loader.Packing("ids", seq_len=6, tokenize=lambda v: np.asarray(v).reshape(-1)))

    it = iter(mixed())
    for _ in range(40):
        next(it)
    state = it.get_state()
    assert state["anchors"] == PINNED_ANCHORS
    rest = [next(it)["tokens"].tolist() for _ in range(5)]
    laid_out = []
    real = packing.Layout.rows_in
    monkeypatch.setattr(packing.Layout, "rows_in", lambda self, e, b: laid_out.append(e * self.blocks + b) or
                        real(self, e, b))
    again = iter(mixed())
    again.set_state(state)
    assert [next(again)["tokens"].tolist() for _ in range(5)] == rest
    assert laid_out and min(laid_out) >= min(block for block, _ in state["anchors"].values())


# Each component's (stream block, its first row) after 40 batches, pinned from one run.
PINNED_ANCHORS = {"a": [40, 79], "b": [20, 39]}


# (first token of each row, component of each row) of the first 3 batches, pinned from one run.
PINNED_MIXTURE = [([100, 200, 0], [0, 0, 1]), ([1100, 300, 500], [0, 0, 1]), ([0, 1000, 300], [0, 0, 1])]


class KillOnce:
    """A tokenize function that SIGKILLs the worker process it runs in at record `target`, once (a marker file says
    it did), or every time with `always`."""

    def __init__(self, marker: str, target: int, always: bool = False):
        self.marker, self.target, self.always, self.owner = marker, target, always, os.getpid()

    def __call__(self, value) -> np.ndarray:
        ids = np.asarray(value).reshape(-1)
        if os.getpid() != self.owner and len(ids) and ids[0] == self.target * 100 and \
                (self.always or not os.path.exists(self.marker)):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return ids


def test_a_packing_worker_killed_is_replaced_and_the_batches_are_the_same(token_data, tmp_path):
    def packed(tokenize, workers=2):
        return loader.load(token_data, batch_size=2, num_epochs=3, seed=0, worker_count=workers,
                           packing=loader.Packing("ids", seq_len=6, tokenize=tokenize))

    alone = [b["tokens"].tolist() for b in packed(flat_ids, workers=0)]
    killed = [b["tokens"].tolist() for b in packed(KillOnce(str(tmp_path / "killed"), target=7))]
    assert (tmp_path / "killed").exists() and killed == alone
    # (in the counting pass, the first to tokenise)
    with pytest.raises(ValueError, match=r"a loader worker ended 3 times while computing the token counts of records "
                                         r"0-11 \(.*train-00001-of-00002\.array_record: records? [^)]*\) \(the last: "
                                         r"signal SIGKILL\): a record there crashes the decoder or map function"):
        list(packed(KillOnce(str(tmp_path / "always"), target=7, always=True), workers=1))


def test_worker_processes_give_the_same_packed_batches_and_resume(token_data):
    def packed(workers):
        return loader.load(token_data, batch_size=2, num_epochs=3, seed=0, worker_count=workers,
                           packing=loader.Packing("ids", seq_len=6, tokenize=flat_ids))

    alone = [b["tokens"].tolist() for b in packed(0)]
    it = iter(packed(2))
    with_workers = [next(it)["tokens"].tolist() for _ in range(7)]
    state = it.get_state()
    again = iter(packed(2))
    again.resize_workers(1)
    again.set_state(state)
    assert again.worker_setting() == "1 worker process"  # a count given before set_state() holds after it
    assert with_workers + [b["tokens"].tolist() for b in again] == alone
    # The work travels with cloudpickle: a lambda as the tokenize function too.
    assert [b["tokens"].tolist() for b in _packed(token_data, worker_count=2, num_epochs=3)] == alone


@pytest.mark.timeout(180)
def test_auto_workers_pack_the_batches_of_threads_plain_and_mixed(token_data, monkeypatch):
    """The packed loaders run on the common executors: worker_count="auto" moves from threads here to worker processes
    (windows of 20 ms, idle cores taken as unknown so a waiting caller always gets more) and the batches stay those
    of threads; the iterator says where it computes and what each stage cost."""
    from loader.executors import tuned, tuning

    monkeypatch.setattr(tuning, "WINDOW_SECONDS", 0.02)
    monkeypatch.setattr(tuning, "WINDOW_GROUPS", 2)
    monkeypatch.setattr(tuning, "HOLD_SECONDS", 0.2)
    monkeypatch.setattr(tuned, "idle_core_seconds", lambda *args: None)
    packing = loader.Packing("ids", seq_len=6, tokenize=flat_ids)
    for source, options in ((token_data, {}), ({"a": token_data, "b": token_data},
                                                                {"weights": {"a": 2, "b": 1}})):
        def load(workers):
            return iter(loader.load(source, batch_size=2, seed=0, worker_count=workers, packing=packing, **options))

        it, got = load("auto"), []
        history = it._host.groups.tuner.history
        deadline = time.monotonic() + 60
        while not any(m.setting.processes for m in history) and time.monotonic() < deadline:  # until processes ran
            got.append(next(it)["tokens"].tolist())
        assert any(m.setting.processes for m in history), history
        got += [next(it)["tokens"].tolist() for _ in range(20)]
        threads = load(0)
        assert got == [next(threads)["tokens"].tolist() for _ in range(len(got))]
        threads.close()
        assert it.stage_times().records > 0 and it.stage_times().cpu["map"] > 0  # tokenising, in the "map" stage
        assert it.worker_setting() != "closed"
        it.close()
        assert it.worker_setting() == "closed"


def test_packing_refuses_map_fn_and_an_endless_drop_remainder_false_each_with_its_reason(token_data):
    packing = loader.Packing("ids", seq_len=6, tokenize=flat_ids)
    with pytest.raises(ValueError, match=r"^packing= reads one feature and tokenises it in Packing.tokenize: it takes "
                                         r"no map_fn= or random_map_fn=$"):
        loader.load(token_data, batch_size=2, packing=packing, map_fn=lambda r: r)
    with pytest.raises(ValueError, match=r"^drop_remainder=False keeps each epoch's last, short batch, and an endless "
                                         r"loader \(num_epochs=None\) has no last batch: set num_epochs"):
        loader.load(token_data, batch_size=2, packing=packing, drop_remainder=False)
    with pytest.raises(ValueError, match=r"^a packed mixture is endless .* leave drop_remainder=True$"):
        loader.load({"a": token_data, "b": token_data}, batch_size=2, packing=packing, drop_remainder=False)


@pytest.mark.parametrize("hosts", [1, 4])
def test_drop_remainder_false_keeps_each_epochs_last_short_batch_split_over_hosts(token_data, hosts):
    """10 rows an epoch in batches of 4: 4, 4, 2 each epoch, every target of the epoch in its 3 batches; host i of 4
    takes its row of each full batch and rows [i, i+1) of the short one (hosts 2 and 3 none). Resume before the short
    batch gives it."""
    parts = [list(_packed(token_data, batch_size=4, num_epochs=2, shuffle=False, drop_remainder=False,
                          shard_index=i, shard_count=hosts)) for i in range(hosts)]
    whole = [{k: np.concatenate([p[b][k] for p in parts]) for k in parts[0][b]} for b in range(len(parts[0]))]
    assert [len(b["tokens"]) for b in whole] == [4, 4, 2, 4, 4, 2]
    if hosts == 4:
        assert [len(parts[i][2]["tokens"]) for i in range(4)] == [1, 1, 0, 0]
    targets = np.concatenate([b["targets"][b["segment_ids"] > 0] for b in whole[:3]])
    assert sorted(targets.tolist()) == sorted(t for i in range(len(LENGTHS)) for t in _ids(i)[1:].tolist())
    for a, b in zip(whole[:3], whole[3:]):  # (not shuffled: each epoch's rows alike)
        assert all(np.array_equal(a[k], b[k]) for k in a)
    it = iter(_packed(token_data, batch_size=4, num_epochs=2, shuffle=False, drop_remainder=False))
    next(it), next(it)
    state = it.get_state()
    again = iter(_packed(token_data, batch_size=4, num_epochs=2, shuffle=False, drop_remainder=False))
    again.set_state(state)
    assert np.array_equal(next(again)["tokens"], whole[2]["tokens"])
    with pytest.raises(ValueError, match="drop_remainder: saved False, now True"):
        iter(_packed(token_data, batch_size=4, num_epochs=2, shuffle=False)).set_state(state)
    dropped = _packed(token_data, batch_size=4, num_epochs=2, shuffle=False)
    assert len(dropped) == 4 and "drop_remainder" in iter(dropped).get_state()


def test_a_resume_with_another_batch_size_continues_the_rows_where_they_stopped(token_data):
    """The rows do not depend on the batch size: 2 batches of 2, then batches of 3 from that state, are the rows of
    batches of 1 in order (within the epoch; its last rows that fill no batch of 3 passed over)."""
    rows = [b["tokens"][0].tolist() for b in _packed(token_data, batch_size=1, num_epochs=1)]
    it = iter(_packed(token_data, batch_size=2, num_epochs=1))
    got = [r.tolist() for _ in range(2) for r in next(it)["tokens"]]
    state = it.get_state()
    wider = iter(_packed(token_data, batch_size=3, num_epochs=1))
    wider.set_state(state)
    got += [r.tolist() for b in wider for r in b["tokens"]]
    assert len(rows) == 10 and got == rows[:4 + 6]


def test_a_packed_state_restores_onto_a_copy_elsewhere_and_not_onto_the_corpus_tokenised_again(
        pretokenized, web_with_eos, tmp_path):
    """A staged copy (loader.stage; or a gs:// corpus, then its local copy) is the same corpus: the state restored
    only at its old paths, refused as "tokenised again". The same texts converted again with --add-eos lay out other
    rows: the state restored onto them silently, skipping and repeating documents. A state saved before (its counts
    named by their paths) restores at the same paths."""
    import hashlib

    def load(path):
        return loader.load(path, batch_size=2, seed=0, packing=loader.Packing(seq_len=8))

    it = iter(load(pretokenized["web"]))
    next(it), next(it)
    state, want = it.get_state(), next(it)
    it.close()
    copy = iter(load(loader.stage(pretokenized["web"], str(tmp_path / "staged")).directory))
    copy.set_state(state)
    np.testing.assert_array_equal(next(copy)["tokens"], want["tokens"])
    copy.close()
    again = iter(load(web_with_eos))
    with pytest.raises(ValueError, match=r"^cannot restore the packed loader's state: counts: saved 'files:\w+', now "
                                         r"'files:\w+' \(the documents' token counts differ: the data was tokenised "
                                         r"again, by another tokenizer, or is another dataset\)"):
        again.set_state(state)
    again.close()
    paths = loader.resolve(pretokenized["web"]).paths
    older = {**state, "counts": "files:" + hashlib.sha256("\n".join(paths).encode()).hexdigest()[:16]}
    restored = iter(load(pretokenized["web"]))
    restored.set_state(older)
    np.testing.assert_array_equal(next(restored)["tokens"], want["tokens"])
    restored.close()


def test_a_batch_size_an_epoch_cannot_fill_is_the_same_error_for_len_iteration_and_load():
    """Epochs of a shuffled corpus pack into rows a few apart (seed 4: 72, 71, 72 rows): batch_size=72 fits epoch 0
    and not epoch 1. len() counted epoch 1 as no batches while iterating raised there, mid-run; now len() raises as
    iterating does, and a one-block corpus that cannot fill epoch 0 is refused when the plan is made."""
    counts = np.random.default_rng(0).integers(0, 40, 60)
    short = (r"epoch 1 packs into 71 rows of 16 tokens, fewer than batch_size=72: lower batch_size or seq_len, or add "
             r"data")
    plan = _plan(counts, batch_size=72, seq_len=16, seed=4, num_epochs=3)
    with pytest.raises(ValueError, match=short):
        plan.num_batches
    assert len(_batches(plan, 1)) == 1
    with pytest.raises(ValueError, match=short):
        _batches(plan, 2)
    assert _plan(counts, batch_size=71, seq_len=16, seed=4, num_epochs=3).num_batches == 3
    with pytest.raises(ValueError, match=r"epoch 0 packs into 72 rows of 16 tokens, fewer than batch_size=73"):
        _plan(counts, batch_size=73, seq_len=16, seed=4, num_epochs=None)


def _float_ids(v):
    return np.asarray(v, np.float64).reshape(-1) + 0.5


def _huge_ids(v):
    return np.asarray(v).reshape(-1) + 2**31


def _two_rows(v):
    return np.stack([np.asarray(v).reshape(-1)] * 2)


def test_tokenize_giving_what_is_not_ids_is_named_with_the_record(token_data):
    """Float ids were truncated, ids of 2^31 or more wrapped negative in the int32 rows, and a 2-D array failed in
    NumPy ("could not broadcast ...") naming no record: each is an error naming the function, the record and what it
    must give."""
    must = r"it must give one document's token ids, a 1-D array of integers from 0 to 2147483647"
    for fn, gave in ((_float_ids, "float64 values"), (_huge_ids, r"ids from 2147483648 to \d+"),
                     (_two_rows, r"shape \(2, \d+\)")):
        packing = loader.Packing("ids", seq_len=6, tokenize=fn, cache_key=fn.__name__)
        with pytest.raises(ValueError, match=rf"record \d+: {fn.__name__} gave {gave}; {must}"):
            next(iter(loader.load(token_data, batch_size=2, seed=0, packing=packing)))
