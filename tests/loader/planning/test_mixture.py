"""Mixtures: stratified component counts, each component's exact permutation across its epochs, host-count
invariance, exact resume with and without worker processes, weights changed (and a component added) mid-run."""

import collections
import logging
import re

import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordWriter

import loader
from dataset_format import example_proto
from loader.planning.mixture import MixturePlan, integer_weights, quota_schedule

SIZES = {"web": 1000, "code": 300, "tiny": 10, "big": 100_000}


def write_component(path, name: str, count: int) -> str:
    """`count` tf.Examples {"id": i, "name": name} in two ArrayRecord shards; returns their glob."""
    path.mkdir(parents=True, exist_ok=True)
    for shard, part in enumerate(np.array_split(np.arange(count), 2)):
        writer = ArrayRecordWriter(str(path / f"{name}-{shard}.array_record"), "group_size:1")
        for i in part:
            writer.write(example_proto.encode_example({"id": int(i), "name": name.encode()}))
        writer.close()
    return str(path / f"{name}-*.array_record")


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpora")
    return {name: write_component(root / name, name, n) for name, n in SIZES.items()}


def mix(corpora, names, weights, **options):
    return loader.load({n: corpora[n] for n in names}, weights=dict(zip(names, weights)), **options)


def rows(batch, names) -> list[tuple[str, int]]:
    """(component, record id) per row; the row's record says which component it came from, too."""
    out = [(names[c], int(i)) for c, i in zip(batch["component"], batch["id"])]
    assert [n for n, _ in out] == [bytes(v).decode() for v in batch["name"]]
    return out


# -- the schedule --------------------------------------------------------------------------------------------------

def test_weights_become_small_integers_and_bad_weights_are_one_line():
    assert integer_weights({"a": 0.7, "b": 0.3}) == {"a": 7, "b": 3}
    assert integer_weights({"a": 0.5, "b": 0.3, "c": 0.2}) == {"a": 5, "b": 3, "c": 2}
    assert integer_weights({"a": 1, "b": 1, "c": 1}) == {"a": 1, "b": 1, "c": 1}
    assert integer_weights({"a": 0.6, "b": 0.25, "c": 0.15}) == {"a": 12, "b": 5, "c": 3}
    assert integer_weights({"a": 0, "b": 5}) == {"a": 0, "b": 1}
    assert sum(integer_weights({"a": 0.123456, "b": 0.5, "c": 0.376544}).values()) == 2000  # to 1 part in 10,000
    with pytest.raises(ValueError, match=r"^weights\['b'\] = -0.1 is negative; weights must be >= 0$"):
        integer_weights({"a": 1, "b": -0.1})
    with pytest.raises(ValueError, match=r"^all weights are 0 .*give at least one component a positive weight$"):
        integer_weights({"a": 0, "b": 0.0})
    with pytest.raises(ValueError, match=r"weights\['a'\] = nan is not a number"):
        integer_weights({"a": float("nan")})
    assert integer_weights({"a": np.int64(3), "b": np.float32(1.0)}) == {"a": 3, "b": 1}  # were "not a number"
    with pytest.raises(ValueError, match=r"^weights\['a'\] = 1e-09 is under 1 part in [\d,]+ of the total \(1\): the "
                                         r"schedule would give 'a' no rows"):  # it was rounded to 0 silently
        integer_weights({"a": 1e-9, "b": 1})
    for kw, said in ((dict(seed=None), "seed must be an integer (got seed=None)"),  # a TypeError in a sort
                     (dict(shuffle="no"), "shuffle must be True or False (got shuffle='no')"),  # shuffled
                     (dict(weights=[0.7, 0.3]), "weights= takes a dict of a weight per component, {name: weight}")):
        with pytest.raises(ValueError, match=re.escape(said)):
            loader.LoaderConfig(batch_size=4, **kw)


def test_a_small_weight_rounded_by_more_than_1_percent_of_itself_is_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="loader.planning.mixture"):
        assert integer_weights({"a": 0.7, "b": 0.3}) == {"a": 7, "b": 3}
        assert integer_weights({"a": 0.123456, "b": 0.876544}) == {"a": 247, "b": 1753}  # within 1% of each
        assert not caplog.records
        assert integer_weights({"a": 0.99985, "b": 0.00015}) == {"a": 9999, "b": 1}
    assert [r.getMessage() for r in caplog.records] == [
        "mixture weights are kept to 1 part in 10,000: 'b' asked for 0.0150% of the rows and gets 0.0100%"]


@pytest.mark.parametrize("weights, first", [
    ((7, 3), [[6, 2], [5, 3], [6, 2], [6, 2], [5, 3]]),  # the schedule's period: a a b a a b a a a b
    ((5, 3, 2), [[4, 3, 1], [4, 2, 2], [4, 2, 2], [4, 3, 1], [4, 2, 2]]),  # a b a c a b a b a c
])
def test_every_prefix_of_1000_batches_is_within_one_row_of_the_weights(weights, first):
    plan = MixturePlan(tuple("abc"[:len(weights)]), (50,) * len(weights), weights, batch_size=8)
    per_batch = [np.bincount(plan.components_at(p), minlength=len(weights))
                 for p in plan.host_positions_range(0, 1000)]
    assert [c.tolist() for c in per_batch[:5]] == first
    cumulative = np.cumsum(per_batch, axis=0)
    exact = np.arange(1, 1001)[:, None] * 8 * np.asarray(weights) / sum(weights)
    assert np.abs(cumulative - exact).max() < 1
    assert [plan.counts_at(k) for k in (0, 1, 1000)] == [(0,) * len(weights), tuple(first[0]),
                                                          tuple(8000 * w // sum(weights) for w in weights)]


def test_the_quota_schedule_is_within_one_row_for_random_weights():
    rng = np.random.default_rng(0)
    for _ in range(50):
        weights = tuple(int(w) for w in rng.integers(0, 40, size=rng.integers(2, 7)))
        if not sum(weights):
            continue
        schedule = quota_schedule(weights)
        prefix = np.cumsum(np.eye(len(weights), dtype=int)[schedule], axis=0)
        exact = np.arange(1, len(schedule) + 1)[:, None] * np.asarray(weights) / sum(weights)
        assert np.abs(prefix - exact).max() < 1, weights
        assert prefix[-1].tolist() == list(weights)


# -- through the loader ------------------------------------------------------------------------------------------

# Pinned: a change to the schedule, the per-component keys or the permutation fails here loudly.
FIRST_BATCH_SEED_0 = [("web", 23), ("web", 7), ("code", 55), ("web", 984), ("web", 531), ("code", 40),
                      ("web", 305), ("web", 101)]


def test_a_mixture_yields_fixed_rows_labelled_with_their_component(corpora):
    batches = mix(corpora, ["web", "code"], [0.7, 0.3], batch_size=8, seed=0)
    assert batches.components == ("web", "code")
    assert rows(next(iter(batches)), batches.components) == FIRST_BATCH_SEED_0


def test_each_component_walks_its_own_exact_permutation_epoch_after_epoch(corpora):
    """10 records mixed with 100,000: the tiny one repeats ~100 times while the big one passes one epoch boundary;
    every epoch of each holds each record exactly once, and the two orders are unrelated."""
    names = ["tiny", "big"]
    batches = mix(corpora, names, [0.01, 0.99], batch_size=1024, seed=3)
    seen = collections.defaultdict(list)
    it = iter(batches)
    for _ in range(100):
        for name, i in rows(next(it), names):
            seen[name].append(i)
    tiny, big = np.asarray(seen["tiny"]), np.asarray(seen["big"])
    assert len(tiny) == 1024 and len(big) == 100 * 1024 - 1024  # 1% of 102,400 rows exactly
    assert len(big) > SIZES["big"]  # into its second epoch
    for epoch in range(len(tiny) // 10):
        assert sorted(tiny[epoch * 10:(epoch + 1) * 10]) == list(range(10))
    assert sorted(big[:SIZES["big"]]) == list(range(SIZES["big"]))
    assert len(set(big[SIZES["big"]:])) == len(big) - SIZES["big"]  # the second epoch repeats nothing so far
    assert tiny[:10].tolist() != tiny[10:20].tolist()  # each epoch its own order


@pytest.mark.parametrize("hosts", [2, 4])
def test_hosts_together_yield_the_global_batches(corpora, hosts):
    names = ["web", "code", "tiny"]
    whole = [rows(b, names) for b, _ in zip(mix(corpora, names, [0.5, 0.3, 0.2], batch_size=16, seed=1), range(30))]
    parts = [[rows(b, names) for b, _ in zip(mix(corpora, names, [0.5, 0.3, 0.2], batch_size=16, seed=1,
                                                shard_index=h, shard_count=hosts), range(30))]
             for h in range(hosts)]
    assert [sum((p[k] for p in parts), []) for k in range(30)] == whole


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_is_bitwise(corpora, workers):
    names = ["web", "code", "tiny"]
    options = dict(batch_size=32, seed=2, worker_count=workers)
    it = iter(mix(corpora, names, [0.5, 0.3, 0.2], **options))
    reference = [rows(next(it), names) for _ in range(20)]
    it.close()
    it = iter(mix(corpora, names, [0.5, 0.3, 0.2], **options))
    for _ in range(7):
        next(it)
    state = it.get_state()
    it.close()
    assert state["mixture"]["components"]["code"]["rows"] == 67  # 224 rows: 22 periods (66), then a b a c
    resumed = iter(mix(corpora, names, [0.5, 0.3, 0.2], **options))
    resumed.set_state(state)
    assert [rows(next(resumed), names) for _ in range(13)] == reference[7:]
    resumed.close()


def stream(name: str, count: int, seed: int) -> list[int]:
    """Component `name`'s first `count` records in a mixture with `seed`, by itself (its own permutation)."""
    plan = MixturePlan((name,), (SIZES[name],), (1,), batch_size=1, seed=seed)
    return [int(i) for i in plan.indices_at(np.arange(count))]


@pytest.mark.parametrize("then_batch", [20, 30])
def test_changing_weights_and_adding_a_component_continue_every_component(corpora, then_batch, caplog):
    """Run 1 (web 0.7, code 0.3) stops after 10 batches; run 2 restores its state with web 0.2, code 0.5 and a new
    component tiny 0.3 (and batches of 30 instead of 20). Each component's records over both runs are its own stream,
    none skipped or repeated; after the change every prefix follows the new weights within one row."""
    first = iter(mix(corpora, ["web", "code"], [0.7, 0.3], batch_size=20, seed=4))
    before = [rows(next(first), ["web", "code"]) for _ in range(10)]
    state = first.get_state()
    first.close()
    names = ["web", "code", "tiny"]
    second = iter(mix(corpora, names, [0.2, 0.5, 0.3], batch_size=then_batch, seed=4))
    with caplog.at_level(logging.INFO, logger="loader.planning.mixture"):
        second.set_state(state)
    assert ("restoring a mixture's state saved with weights {'web': 7, 'code': 3} (as integers) under {'web': 2, "
            "'code': 5, 'tiny': 3}: from batch 10 each component's rows follow the new weights, going on from the web "
            "140, code 60, tiny 0 rows each had given") in caplog.text, caplog.text  # (it was silent)
    after = [rows(next(second), names) for _ in range(40)]
    new_state = second.get_state()
    second.close()
    per = collections.defaultdict(list)
    for batch in before + after:
        for name, i in batch:
            per[name].append(i)
    for name in names:
        assert per[name] == stream(name, len(per[name]), seed=4), name
    counts = np.cumsum([[sum(n == c for n, _ in b) for c in names] for b in after], axis=0)
    assert all(len(b) == then_batch for b in after)
    exact = np.arange(1, 41)[:, None] * then_batch * np.asarray([0.2, 0.5, 0.3])
    assert np.abs(counts - exact).max() < 1
    assert new_state["mixture"]["start_batch"] == 10
    assert {n: c["rows"] for n, c in new_state["mixture"]["components"].items()} == \
        {n: len(per[n]) for n in names}


def test_a_state_restored_with_its_components_reordered_or_other_num_epochs_says_so(corpora, caplog):
    """The components listed in another order: each goes on exactly, but the rows interleave anew (a warning says
    the batches differ from an uninterrupted run's); other num_epochs: the same batches, the end elsewhere (said)."""
    it = iter(mix(corpora, ["web", "code"], [0.5, 0.5], batch_size=10, seed=5, num_epochs={"code": 2}))
    before = [rows(next(it), ["web", "code"]) for _ in range(4)]
    state = it.get_state()
    uninterrupted = [rows(next(it), ["web", "code"]) for _ in range(4)]
    it.close()
    assert state["mixture"]["components"]["code"]["num_epochs"] == 2
    same = iter(mix(corpora, ["web", "code"], [0.5, 0.5], batch_size=10, seed=5, num_epochs={"code": 3}))
    with caplog.at_level(logging.INFO, logger="loader.planning.mixture"):
        same.set_state(state)
    assert [rows(next(same), ["web", "code"]) for _ in range(4)] == uninterrupted
    same.close()
    assert ("restoring a mixture's state saved with other num_epochs (code 2 -> 3): the mix goes on as saved and "
            "ends when a component's new num_epochs runs out") in caplog.text
    caplog.clear()
    swapped = iter(mix(corpora, ["code", "web"], [0.5, 0.5], batch_size=10, seed=5, num_epochs={"code": 2}))
    with caplog.at_level(logging.INFO, logger="loader.planning.mixture"):
        swapped.set_state(state)
    after = [rows(next(swapped), ["code", "web"]) for _ in range(4)]
    swapped.close()
    assert ("restoring a mixture's state saved with its components in the order ['web', 'code'] under ['code', "
            "'web']: each component's rows go on where they stopped, but the batches from batch 4 differ from an "
            "uninterrupted run's; list the components as saved to continue it exactly") in caplog.text
    for name in ("web", "code"):  # each component's own stream, none skipped or repeated
        seen = [i for batch in before + after for n, i in batch if n == name]
        assert seen == stream(name, len(seen), seed=5), name


def test_a_component_left_out_and_brought_back_continues_where_it_stopped(corpora):
    it = iter(mix(corpora, ["web", "code"], [0.5, 0.5], batch_size=10, seed=5))
    code = [i for _ in range(4) for n, i in rows(next(it), ["web", "code"]) if n == "code"]
    state = it.get_state()
    it.close()
    only_web = iter(mix(corpora, ["web"], [1], batch_size=10, seed=5))
    only_web.set_state(state)
    next(only_web)
    state = only_web.get_state()
    only_web.close()
    assert state["mixture"]["dormant"] == {"code": 20}
    back = iter(mix(corpora, ["web", "code"], [0.5, 0.5], batch_size=10, seed=5))
    back.set_state(state)
    code += [i for _ in range(4) for n, i in rows(next(back), ["web", "code"]) if n == "code"]
    back.close()
    assert code == stream("code", 40, seed=5)


def test_num_epochs_per_component_ends_the_mix(corpora):
    batches = mix(corpora, ["tiny", "web"], [0.5, 0.5], batch_size=4, seed=0, num_epochs={"tiny": 2})
    assert len(batches) == 10  # tiny's 20 rows run out after 40 rows of the mix
    seen = [r for b in batches for r in rows(b, ["tiny", "web"])]
    assert sorted(i for n, i in seen if n == "tiny") == sorted(list(range(10)) * 2)
    for weights, epochs in (([0.5, 0.5], {"tiny": None}), ([0, 1], {"tiny": 1})):  # bounding nothing drawn: endless
        with pytest.raises(TypeError, match=r"^this mixture is endless: num_epochs=\{'tiny': (None|1)\} bounds none"):
            len(mix(corpora, ["tiny", "web"], weights, batch_size=4, seed=0, num_epochs=epochs))


def test_bad_mixtures_are_one_line_each(corpora, tmp_path):
    two = {"web": corpora["web"], "code": corpora["code"]}
    cases = [
        (dict(), r"^a mixture of \['web', 'code'\] needs weights=, e\.g\. weights=\{'web': 1, 'code': 1\}$"),
        (dict(weights={"web": 1}), r"^weights do not match the mixture's components \['web', 'code'\]: no weight "
                                   r"for \['code'\]$"),
        (dict(weights={"web": 1, "code": 1, "books": 1}), r"weights for unknown \['books'\]$"),
        (dict(weights={"web": 1, "code": -2}), r"^weights\['code'\] = -2 is negative"),
        (dict(weights={"web": 0, "code": 0}), r"^all weights are 0"),
        (dict(weights={"web": 1, "code": 1}, num_epochs={"books": 1}), r"num_epochs names \['books'\]"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            loader.load(two, batch_size=4, **options)
    with pytest.raises(ValueError, match=r"^weights= is for a mixture"):
        loader.load(corpora["web"], batch_size=4, weights={"web": 1})
    empty = tmp_path / "empty-0.array_record"
    ArrayRecordWriter(str(empty), "group_size:1").close()
    with pytest.raises(ValueError, match=rf"^mixture component 'void': {re.escape(str(tmp_path))} has no records "
                                         r"\(1 shard\(s\), all empty\)"):
        loader.load({"web": corpora["web"], "void": str(empty)}, batch_size=4, weights={"web": 1, "void": 1})
    with pytest.raises(FileNotFoundError, match=r"^mixture component 'gone': no files match"):
        loader.load({"web": corpora["web"], "gone": str(tmp_path / "nothing-*")}, batch_size=4,
                    weights={"web": 1, "gone": 1})


@pytest.mark.parametrize("index, count, message", [
    (2, 2, r"^shard_index must be in \[0, shard_count\) \(got shard_index=2, shard_count=2\): hosts are numbered "
           r"from 0"),
    (-1, 2, r"^shard_index must be in \[0, shard_count\) \(got shard_index=-1, shard_count=2\)"),
    (0, 0, r"^shard_count must be the number of hosts, >= 1 \(got shard_count=0\)$"),
    (0, -1, r"^shard_count must be the number of hosts, >= 1 \(got shard_count=-1\)$"),
    (0.0, 2, r"^shard_index must be in \[0, shard_count\) \(got shard_index=0\.0, "),
])
def test_a_host_outside_the_host_count_is_refused(corpora, packed_corpora, index, count, message):
    """A mixture's or a packed loader's host 2 of 2 read host 0's rows of the next batch (hosts overlapping, a share
    of every batch never read); shard_count=-1 gave empty batches for ever, 0 a ZeroDivisionError."""
    two = {"web": corpora["web"], "code": corpora["code"]}
    for load in (lambda: loader.load(two, weights={"web": 1, "code": 1}, batch_size=4, shard_index=index,
                                     shard_count=count),
                 lambda: packed(packed_corpora, list(PACKED), [1, 1, 1], shard_index=index, shard_count=count),
                 lambda: loader.load(packed_corpora["long"], batch_size=8, shard_index=index, shard_count=count,
                                     packing=loader.Packing("text", SEQ, key_tokens))):
        with pytest.raises(ValueError, match=message):
            load()


def test_a_mixture_that_would_make_no_batch_is_refused(corpora):
    """It yielded nothing without a word (len() 0) where one source is refused."""
    with pytest.raises(ValueError, match=r"^batch_size=64 is more than the 40 rows the mixture gives before component "
                                         r"'tiny' ends it \(num_epochs=\{'tiny': 2\}\): no batch would be made; lower "
                                         r"batch_size, raise num_epochs, or pass drop_remainder=False$"):
        mix(corpora, ["tiny", "web"], [0.5, 0.5], batch_size=64, num_epochs={"tiny": 2})
    with pytest.raises(ValueError, match=r"rows the mixture gives before component 'tiny' ends it \(num_epochs=1\)"):
        mix(corpora, ["tiny", "web"], [0.5, 0.5], batch_size=64, num_epochs=1)
    assert len(mix(corpora, ["tiny", "web"], [0.5, 0.5], batch_size=64, num_epochs=1, drop_remainder=False)) == 1


def test_numpy_weights_of_any_float_type_are_weights(corpora):
    """np.float32 weights failed in Fraction with "argument should be a string or a Rational instance"."""
    for dtype in (np.float16, np.float32, np.float64, np.int32):
        weights = dict(zip(["web", "code"], np.array([3, 1], dtype)))
        assert integer_weights(weights) == {"web": 3, "code": 1}
    assert integer_weights(dict(zip(["web", "code"], np.array([0.7, 0.3], np.float32)))) == {"web": 7, "code": 3}


def test_features_a_component_lacks_are_refused_at_load(token_data, photos):
    """They passed load() (the mixture's records hold the union of its components' features) and failed at the first
    batch, naming a record but not the component."""
    with pytest.raises(ValueError, match=r"^mixture component 'photos': features=\['ids'\]: .*'s records have no "
                                         r"'ids'; they have \['image/class/label', "):
        loader.load({"tokens": token_data, "photos": str(photos)}, weights={"tokens": 1, "photos": 1}, batch_size=4,
                    features=["ids"])


def test_a_state_of_another_kind_is_refused(corpora):
    it = iter(loader.load(corpora["web"], batch_size=4))
    next(it)
    state = it.get_state()
    it.close()
    mixed = iter(mix(corpora, ["web", "code"], [1, 1], batch_size=4))
    with pytest.raises(ValueError, match="^cannot restore this mixture from a state saved by a loader of one source: "
                                         r"restore it into the loader that saved it \(the same sources, as a mixture "
                                         r"or not, and packing= or not\)$"):
        mixed.set_state(state)
    mixed.close()
    it = iter(mix(corpora, ["web", "code"], [1, 1], batch_size=4, seed=1))
    next(it)
    state = it.get_state()
    it.close()
    other = iter(mix(corpora, ["web", "code"], [1, 1], batch_size=4, seed=2))
    with pytest.raises(ValueError, match=r"cannot restore the mixture's state: seed: saved 1, now 2"):
        other.set_state(state)
    other.close()


def test_a_component_restores_only_onto_its_own_dataset(corpora, tmp_path):
    it = iter(mix(corpora, ["web", "code"], [1, 1], batch_size=4))
    next(it)
    state = it.get_state()
    it.close()
    assert state["mixture"]["components"]["web"]["dataset"] == "2 shards, 1,000 records, sha256:99ae645d3ed51a89"
    other = write_component(tmp_path, "news", SIZES["web"])  # as many records as web, in other shards
    swapped = iter(loader.load({"web": other, "code": corpora["code"]}, weights={"web": 1, "code": 1}, batch_size=4))
    with pytest.raises(ValueError, match=r"cannot restore the mixture's state: dataset of component 'web': saved '2 "
                                         r"shards, 1,000 records, sha256:99ae645d3ed51a89', now '2 shards, 1,000 "
                                         r"records, sha256:[0-9a-f]{16}'; restore with the same datasets"):
        swapped.set_state(state)
    for c in state["mixture"]["components"].values():  # a state saved before components named their dataset
        del c["dataset"]
    swapped.set_state(state)
    assert len(next(swapped)["id"]) == 4
    swapped.close()


def test_random_map_fn_draws_depend_on_the_record_not_the_mix(corpora):
    def draw(example, rng):
        return {**example, "draw": rng.integers(1 << 30)}

    def draws(names, weights):
        it = iter(mix(corpora, names, weights, batch_size=16, seed=6, random_map_fn=draw))
        out = {}
        for _ in range(5):
            batch = next(it)
            out.update({(names[c], int(i)): int(d) for c, i, d in zip(batch["component"], batch["id"], batch["draw"])})
        it.close()
        return out

    a, b = draws(["web", "code"], [0.5, 0.5]), draws(["code", "web", "tiny"], [0.2, 0.2, 0.6])
    common = set(a) & set(b)
    assert len(common) >= 10 and all(a[k] == b[k] for k in common)


# -- packed mixtures -----------------------------------------------------------------------------------------------

PACKED = {"long": 60, "short": 200, "tiny": 10}  # examples per component
SEQ = 32


def text_of(c: int, i: int) -> bytes:
    """Example i of component c: 'c:i:' then a run of x's, 3 to 60 tokens in all."""
    return f"{c}:{i}:".encode() + b"x" * ((i * 7 + c) % 50 + (40 if c == 0 else 0))


def key_tokens(value) -> np.ndarray:
    """Token t of an example is key * 1000 + t, its key c * 10000 + i read from the text: a row's tokens say which
    example and which of its tokens they are."""
    text = bytes(value[0]) if isinstance(value, np.ndarray) else bytes(value)
    c, i, _ = text.split(b":", 2)
    return (int(c) * 10_000 + int(i)) * 1000 + np.arange(len(text), dtype=np.int64)


@pytest.fixture(scope="module")
def packed_corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed")
    paths = {}
    for c, (name, count) in enumerate(PACKED.items()):
        (root / name).mkdir()
        writer = ArrayRecordWriter(str(root / name / f"{name}-0.array_record"), "group_size:1")
        for i in range(count):
            writer.write(example_proto.encode_example({"text": text_of(c, i)}))
        writer.close()
        paths[name] = str(root / name / f"{name}-*.array_record")
    return paths


def packed(paths, names, weights, **options):
    return loader.load({n: paths[n] for n in names}, weights=dict(zip(names, weights)),
                       packing=loader.Packing("text", SEQ, key_tokens), **{"batch_size": 8, "seed": 7, **options})


def rows_of(batch) -> list[tuple[int, tuple]]:
    """(component, the row's tokens) per row."""
    return [(int(c), tuple(t[s > 0].tolist())) for c, t, s in zip(batch["component"], batch["tokens"],
                                                                    batch["segment_ids"])]


def test_a_packed_mixture_draws_rows_by_weight_from_each_components_own_packing(packed_corpora):
    names = list(PACKED)
    it = iter(packed(packed_corpora, names, [0.5, 0.3, 0.2]))
    batches = [next(it) for _ in range(40)]
    it.close()
    assert [np.bincount(b["component"], minlength=3).tolist() for b in batches[:3]] == [[4, 3, 1], [4, 2, 2], [4, 2, 2]]
    seen = collections.Counter()
    for batch in batches:
        for c, tokens in rows_of(batch):
            keys = {t // 1000 for t in tokens}
            assert {k // 10_000 for k in keys} == {names.index(names[c])}  # a row holds its own component's examples
            seen.update((t // 1000 % 10_000, t % 1000) for t in tokens if t // 10_000_000 == 2)
    tiny = collections.Counter(seen)  # component 2 (tiny): each of its tokens as often as any other, +-1 epoch
    counts = list(tiny.values())
    assert len({i for i, _ in tiny}) == 10 and max(counts) - min(counts) <= 1 and max(counts) >= 3


def test_packed_mixture_batches_are_host_invariant_and_resume_bitwise(packed_corpora):
    names = list(PACKED)
    whole = [rows_of(b) for b, _ in zip(packed(packed_corpora, names, [0.5, 0.3, 0.2]), range(12))]
    halves = [[rows_of(b) for b, _ in zip(packed(packed_corpora, names, [0.5, 0.3, 0.2], shard_index=h,
                                                 shard_count=2), range(12))] for h in range(2)]
    assert [halves[0][k] + halves[1][k] for k in range(12)] == whole
    it = iter(packed(packed_corpora, names, [0.5, 0.3, 0.2]))
    for _ in range(5):
        next(it)
    state = it.get_state()
    it.close()
    resumed = iter(packed(packed_corpora, names, [0.5, 0.3, 0.2]))
    resumed.set_state(state)
    assert [rows_of(next(resumed)) for _ in range(7)] == whole[5:]
    resumed.close()


@pytest.mark.parametrize("then_batch", [8, 12])
def test_new_weights_continue_each_packed_components_stream(packed_corpora, then_batch):
    """Rows of each component over a run under (0.5, 0.5) and its continuation under (0.1, 0.9) plus a new component
    (and batches of 12 rows instead of 8) are that component's own stream of packed rows (the rows of a mixture of it
    alone)."""
    first = iter(packed(packed_corpora, ["long", "short"], [0.5, 0.5]))
    got = collections.defaultdict(list)
    for _ in range(6):
        for c, tokens in rows_of(next(first)):
            got[["long", "short"][c]].append(tokens)
    state = first.get_state()
    first.close()
    names = ["long", "short", "tiny"]
    second = iter(packed(packed_corpora, names, [0.1, 0.6, 0.3], batch_size=then_batch))
    second.set_state(state)
    for _ in range(10):
        batch = next(second)
        assert len(batch["tokens"]) == then_batch
        for c, tokens in rows_of(batch):
            got[names[c]].append(tokens)
    second.close()
    for name in names:
        alone = iter(packed(packed_corpora, [name], [1]))
        stream = []
        while len(stream) < len(got[name]):
            stream += [tokens for _, tokens in rows_of(next(alone))]
        alone.close()
        assert got[name] == stream[:len(got[name])], name


def test_a_pretokenized_packed_mixture_resumes_with_a_component_added_or_left_out(pretokenized):
    """The state of a mixture of pre-tokenized corpora (each packs from its own .counts) restores onto a mixture with a
    component added, and onto one with a component left out: each component's rows continue its own stream."""
    def mix(names, weights):
        return loader.load({n: pretokenized[n] for n in names}, weights=dict(zip(names, weights)), batch_size=4,
                           seed=3, packing=loader.Packing(seq_len=16))

    def tokens_by_component(it, names, batches):
        got = collections.defaultdict(list)
        for _ in range(batches):
            batch = next(it)
            for c, row in zip(batch["component"], batch["tokens"]):
                got[names[c]].append(row.tolist())
        return got

    first = iter(mix(["web", "code"], [1, 1]))
    before = tokens_by_component(first, ["web", "code"], 3)
    state = first.get_state()
    first.close()
    for names, weights in ((["web", "code", "books"], [1, 1, 1]), (["web"], [1])):
        resumed = iter(mix(names, weights))
        resumed.set_state(state)
        after = tokens_by_component(resumed, names, 3)
        resumed.close()
        for name in names:
            alone = iter(mix([name], [1]))
            wanted = before.get(name, []) + after[name]
            stream = []
            while len(stream) < len(wanted):
                stream += next(alone)["tokens"].tolist()
            alone.close()
            assert wanted == stream[:len(wanted)], (names, name)
    older = {**state, "packing": {**state["packing"], "counts": "files:e929226301b62b0e"}}  # as saved before
    restored = iter(mix(["web", "code"], [1, 1]))
    restored.set_state(older)
    restored.close()
    longer = iter(loader.load({"web": pretokenized["web"]}, weights={"web": 1}, batch_size=4, seed=3,
                              packing=loader.Packing(seq_len=32)))
    with pytest.raises(ValueError, match=r"^cannot restore the packed mixture's state: seq_len: saved 16, now 32; "
                                         r"restore with the same packing options \(the components and weights may "
                                         r"change\)$"):
        longer.set_state(state)
    longer.close()


def one_token_for_9(value) -> np.ndarray:
    """key_tokens, but one token (no target: nothing to pack) for the examples of component 9."""
    tokens = key_tokens(value)
    return tokens[:1] if tokens[0] // 10_000_000 == 9 else tokens


def test_a_weight_0_component_with_nothing_to_pack_leaves_the_state_alone(packed_corpora, tmp_path):
    """A component of weight 0 gives no rows; the state laid out its first block anyway, and one with nothing to
    pack raised "has no tokens to pack" at the first get_state (the trainer's first log line)."""
    (tmp_path / "ones").mkdir()
    writer = ArrayRecordWriter(str(tmp_path / "ones" / "ones-0.array_record"), "group_size:1")
    for i in range(3):
        writer.write(example_proto.encode_example({"text": text_of(9, i)}))
    writer.close()

    def load():
        return loader.load({"long": packed_corpora["long"], "ones": str(tmp_path / "ones" / "ones-0.array_record")},
                           weights={"long": 1, "ones": 0}, packing=loader.Packing("text", SEQ, one_token_for_9),
                           batch_size=8, seed=7)

    it = iter(load())
    next(it)
    state = it.get_state()
    assert state["anchors"]["ones"] == [0, 0] and state["mixture"]["components"]["ones"]["rows"] == 0
    then = next(it)
    it.close()
    resumed = iter(load())
    resumed.set_state(state)
    assert rows_of(next(resumed)) == rows_of(then)
    resumed.close()


def test_a_packed_mixtures_state_refuses_a_component_tokenised_again(pretokenized, web_with_eos):
    """Each component's rows are laid out by its token counts: a component converted again (here with --add-eos)
    took the saved anchors onto another layout, silently. Its state names the tokenisation; a state saved before
    (without it) restores as it did."""
    def mix(web):
        return loader.load({"web": web, "code": pretokenized["code"]}, weights={"web": 1, "code": 1}, batch_size=4,
                           seed=3, packing=loader.Packing(seq_len=16))

    it = iter(mix(pretokenized["web"]))
    next(it), next(it)
    state = it.get_state()
    it.close()
    assert re.fullmatch(r"sha256:\w{16}, [\d,]+ token ids", state["mixture"]["components"]["web"]["tokens"])
    again = iter(mix(web_with_eos))
    with pytest.raises(ValueError, match=r"^cannot restore the mixture's state: tokens of component 'web': saved "
                                         r"'sha256:\w+, [\d,]+ token ids', now 'sha256:\w+, [\d,]+ token ids'"):
        again.set_state(state)
    older = {**state, "mixture": {**state["mixture"], "components": {
        n: {k: v for k, v in c.items() if k != "tokens"} for n, c in state["mixture"]["components"].items()}}}
    again.set_state(older)
    again.close()


def test_a_packed_mixture_is_endless(packed_corpora):
    with pytest.raises(ValueError, match=r"^a packed mixture is endless .*leave num_epochs unset"):
        packed(packed_corpora, ["long", "short"], [1, 1], num_epochs=1)
    with pytest.raises(TypeError, match="endless"):
        len(packed(packed_corpora, ["long", "short"], [1, 1]))


def test_a_tfds_dataset_and_a_tfrecord_corpus_mix_each_decoded_as_its_own(tfds_digits_array_record, tmp_path):
    """TFDS digits (PNG images, decoded through its features.json) beside tf.Examples of the same feature names (64
    int64 pixels): each record decodes as its own component's; a mix of them was refused."""
    from pipelines import ConvertConfig, run_conversion
    from tests.conftest import write_tfrecord_shards

    examples = [example_proto.encode_example({"image": np.full(64, 100 + i), "label": [i % 10]}) for i in range(40)]
    write_tfrecord_shards(tmp_path / "raw", [examples])
    run_conversion(ConvertConfig(input=str(tmp_path / "raw" / "*.tfrecord"), output=str(tmp_path / "ex")),
                   ["--direct_num_workers=1"])
    sources = {"tfds": str(tfds_digits_array_record), "ex": str(tmp_path / "ex")}
    mixed = loader.load(sources, weights={"tfds": 1, "ex": 1}, batch_size=4, features=["image"], seed=0)
    # rows that cannot stack are one line naming the feature and the components (they came out as a list, and
    # training failed in NumPy: "setting an array element with a sequence")
    with pytest.raises(ValueError, match=r"^feature 'image' is uint8 of rank 3 in the mixture's component 'tfds' and "
                                         r"int64 of rank 1 in 'ex': rows of one batch must stack; make them one dtype "
                                         r"and rank \(a map_fn converting one"):
        next(iter(mixed))
    as_tfds = loader.load(sources, weights={"tfds": 1, "ex": 1}, batch_size=4, features=["image"], seed=0,
                          map_fn=_as_tfds_image)
    it = iter(as_tfds)
    seen = {0: 0, 1: 0}
    for _ in range(6):
        batch = next(it)
        assert batch["image"].dtype == np.uint8 and batch["image"].shape == (4, 8, 8, 1)
        for image, component in zip(batch["image"], batch["component"].tolist()):
            seen[component] += 1
            if component == 1:  # decoded as a tf.Example (64 int64 pixels from 100), then mapped
                assert (image >= 100).all()
    assert seen == {0: 12, 1: 12}


def _as_tfds_image(record: dict) -> dict:
    """A tf.Example's 64 int64 pixels as the TFDS digits' uint8 [8, 8, 1] (the TFDS records pass as they are)."""
    return {"image": np.asarray(record["image"]).astype(np.uint8).reshape(8, 8, 1)}


def test_a_mixture_whose_components_name_features_differently_is_one_line(tmp_path):
    """It was "feature 'pixels' is in 2 of this batch's 4 records ... leave it out with features=", naming no
    component, where features= cannot help."""
    from pipelines import ConvertConfig, run_conversion
    from tests.conftest import write_tfrecord_shards

    for name, key in (("a", "image"), ("b", "pixels")):
        write_tfrecord_shards(tmp_path / f"raw-{name}", [[example_proto.encode_example({key: [i], "label": [i % 2]})
                                                         for i in range(20)]])
        run_conversion(ConvertConfig(input=str(tmp_path / f"raw-{name}" / "*.tfrecord"), output=str(tmp_path / name)),
                       ["--direct_num_workers=1"])
    mixed = loader.load({"a": str(tmp_path / "a"), "b": str(tmp_path / "b")}, weights={"a": 1, "b": 1}, batch_size=4,
                        seed=0)
    with pytest.raises(ValueError, match=r"^the mixture's components give different features: 'a' has \['image'\] "
                                         r"that 'b' has not, and 'b' has \['pixels'\] that 'a' has not; rows of one "
                                         r"batch need the same features"):
        next(iter(mixed))


def test_a_state_goes_only_to_the_kind_of_loader_that_saved_it(corpora, packed_corpora):
    """A packed mixture's state given to a packed loader of one source listed eight keys "saved None" and said the
    data was tokenised again; given to a mixture, "this is not a loader state"."""
    it = iter(packed(packed_corpora, list(PACKED), [1, 1, 1]))
    next(it)
    state = it.get_state()
    it.close()
    single = iter(loader.load(packed_corpora["long"], batch_size=8, seed=7,
                              packing=loader.Packing("text", SEQ, key_tokens)))
    next(single)
    single_state = single.get_state()
    plain = iter(mix(corpora, ["web", "code"], [1, 1], batch_size=4))
    for target, saved, message in (
            (single, state, "cannot restore this packed loader from a state saved by a packed mixture: "),
            (plain, state, "cannot restore this mixture from a state saved by a packed mixture: "),
            (iter(packed(packed_corpora, list(PACKED), [1, 1, 1])), single_state,
             "cannot restore this packed mixture from a state saved by a packed loader of one source: ")):
        with pytest.raises(ValueError, match="^" + re.escape(message + "restore it into the loader that saved it (the "
                                                             "same sources, as a mixture or not, and packing= or not)")
                           + "$"):
            target.set_state(saved)
        target.close()
