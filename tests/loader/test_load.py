"""`loader.load` on data converted by the real pipeline."""

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import loader
from tests.conftest import REPO, write_tfrecord_shards
from tests.loader.conftest import SHARD_SIZES

FIRST_TWO_BATCHES_SEED_0 = [
    [b"2:47", b"2:9", b"0:10", b"2:52", b"3:21", b"0:34", b"2:36", b"4:51"],
    [b"3:41", b"4:43", b"2:10", b"2:19", b"2:12", b"2:97", b"3:39", b"2:59"],
]


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


def test_fixed_expected_order_for_seed_0(converted):
    # Pinned: a change to shuffling, sharding or reading order fails here loudly.
    it = iter(loader.load(str(converted), batch_size=8, seed=0, decode=None))
    assert _take(it, 2) == FIRST_TWO_BATCHES_SEED_0
    again = iter(loader.load(str(converted), batch_size=8, seed=0, decode=None))
    assert _take(again, 2) == FIRST_TWO_BATCHES_SEED_0
    other = iter(loader.load(str(converted), batch_size=8, seed=1, decode=None))
    assert next(other) != FIRST_TWO_BATCHES_SEED_0[0]


def test_each_epoch_holds_every_record_once_across_all_shards(converted, all_records):
    n = len(all_records)
    batches = list(loader.load(str(converted), batch_size=1, seed=7, num_epochs=3, decode=None))
    stream = [r for b in batches for r in b]
    assert len(stream) == 3 * n == 3 * sum(SHARD_SIZES)
    epochs = [stream[i * n:(i + 1) * n] for i in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == sorted(all_records)
    assert epochs[0] != epochs[1] != epochs[2]
    # Global, not per-shard: the first 20 records already come from several shards.
    assert len({r.split(b":")[0] for r in epochs[0][:20]}) >= 3


def test_no_shuffle_reads_in_manifest_order(converted, all_records):
    batches = list(loader.load(str(converted), batch_size=10, shuffle=False, num_epochs=1, drop_remainder=False,
                               decode=None))
    assert [r for b in batches for r in b] == all_records
    assert [len(b) for b in batches][-2:] == [10, 7]


@pytest.mark.parametrize("hosts", [2, 4])
def test_hosts_concatenate_to_the_single_host_batches(converted, hosts):
    single = _take(iter(loader.load(str(converted), batch_size=8, seed=3, decode=None)), 40)
    per_host = [_take(iter(loader.load(str(converted), batch_size=8, seed=3, decode=None, shard_index=h,
                                       shard_count=hosts)), 40) for h in range(hosts)]
    for k in range(40):
        assert [r for h in range(hosts) for r in per_host[h][k]] == single[k]
        assert all(len(per_host[h][k]) == 8 // hosts for h in range(hosts))


def test_resume_is_exact_and_state_is_small_json(converted):
    it = iter(loader.load(str(converted), batch_size=8, seed=2, decode=None))
    _take(it, 5)
    state = it.get_state()
    assert len(json.dumps(state)) < 300
    expected = _take(it, 50)  # crosses an epoch boundary (257 records = 32 batches of 8)
    resumed = iter(loader.load(str(converted), batch_size=8, seed=2, decode=None))
    resumed.set_state(json.loads(json.dumps(state)))
    assert _take(resumed, 50) == expected


def test_a_resume_with_another_batch_size_continues_the_stream_where_it_stopped(converted, caplog):
    """5 batches of 8 (40 records), then batches of 12 from where they stopped, then (restored again, on 2 hosts)
    batches of 4: the records are the stream batches of 1 give, none skipped or read twice; len() and the end of a
    bounded run follow the new size; a state of the new size restores as any other."""
    stream = [r for b in loader.load(str(converted), batch_size=1, seed=2, decode=None, num_epochs=2) for r in b]
    it = iter(loader.load(str(converted), batch_size=8, seed=2, decode=None, num_epochs=2))
    got = [r for b in _take(it, 5) for r in b]
    state = it.get_state()
    assert "origin" not in state  # (an ordinary state, as before)
    wider = iter(loader.load(str(converted), batch_size=12, seed=2, decode=None, num_epochs=2))
    with caplog.at_level("INFO", logger="loader.planning.state"):
        wider.set_state(json.loads(json.dumps(state)))
    assert "restoring a state saved with batch_size=8 with batch_size=12: batch 5 and after continue" in caplog.text
    batches = _take(wider, 20)
    assert all(len(b) == 12 for b in batches)
    got += [r for b in batches for r in b]
    state = wider.get_state()
    assert state["origin"] == 40 - 5 * 12 and state["next_batch"] == 25
    hosts = []
    for h in range(2):
        narrow = iter(loader.load(str(converted), batch_size=4, seed=2, decode=None, num_epochs=2, shard_index=h,
                                  shard_count=2))
        narrow.set_state(state)
        hosts.append([b for b in narrow])
    got += [r for b0, b1 in zip(*hosts) for r in b0 + b1]
    assert got == stream[:len(got)] and len(got) == len(stream) - len(stream) % 4  # (the rest: no full batch of 4)
    again = iter(loader.load(str(converted), batch_size=12, seed=2, decode=None, num_epochs=2))
    again.set_state(state)  # (the same size: the saved segment goes on)
    assert next(again) == stream[40 + 20 * 12:40 + 21 * 12]


def test_cache_bytes_on_a_local_dataset_is_said_to_cache_nothing(converted, caplog):
    with caplog.at_level("WARNING", logger="loader.pipeline"):
        loader.load(str(converted), batch_size=8, decode=None, cache_bytes=1 << 20)
    assert f"cache_bytes=1048576 caches chunks read from gs://, and {converted} is local: nothing is cached" in \
        caplog.text


def test_a_restored_or_new_iterator_reuses_the_open_shards(converted, monkeypatch):
    """A loader opens each shard once, however often it restarts (its files stay open under the process limit)."""
    import loader.fetch.reader

    opened = []
    real = loader.fetch.reader.BatchReader._open
    monkeypatch.setattr(loader.fetch.reader.BatchReader, "_open",
                        lambda self, shard: opened.append(self._paths[shard]) or real(self, shard))
    ds = loader.load(str(converted), batch_size=8, seed=2, decode=None)
    it = iter(ds)
    first = _take(it, 40)  # more than an epoch: every non-empty shard is read
    it.set_state({**it.get_state(), "next_batch": 3})
    assert _take(it, 37) == first[3:]
    assert _take(iter(ds), 40) == first
    assert sorted(opened) == sorted(p for p in map(str, converted.glob("*.array_record*")) if "00001" not in p)


def test_resume_with_another_host_count_and_worker_processes(converted):
    it = iter(loader.load(str(converted), batch_size=8, seed=4, decode=None))
    _take(it, 3)
    state = it.get_state()
    expected = _take(it, 6)
    hosts = []
    for h in range(2):
        resumed = iter(loader.load(str(converted), batch_size=8, seed=4, decode=None, shard_index=h, shard_count=2,
                                   worker_count=2))
        resumed.set_state(state)
        hosts.append(_take(resumed, 6))
    assert [hosts[0][k] + hosts[1][k] for k in range(6)] == expected


def test_resume_in_a_fresh_process(converted, tmp_path):
    it = iter(loader.load(str(converted), batch_size=4, seed=9, decode=None))
    _take(it, 7)
    (tmp_path / "state.json").write_text(json.dumps(it.get_state()))
    expected = [[r.decode() for r in b] for b in _take(it, 10)]
    code = ("import json, sys, loader\n"
            "it = iter(loader.load(sys.argv[1], batch_size=4, seed=9, decode=None))\n"
            "it.set_state(json.load(open(sys.argv[2])))\n"
            "print(json.dumps([[r.decode() for r in next(it)] for _ in range(10)]))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(converted), str(tmp_path / "state.json")], cwd=REPO,
                          capture_output=True, text=True, check=True, timeout=120)
    assert json.loads(proc.stdout) == expected


def test_close_stops_reading_and_set_state_resumes(converted):
    it = iter(loader.load(str(converted), batch_size=8, seed=5, decode=None, worker_count=1))
    expected = _take(it, 6)
    it.close()
    with pytest.raises(ValueError, match="closed; set_state"):
        next(it)
    it.set_state({**it.get_state(), "next_batch": 2})
    assert _take(it, 4) == expected[2:]


def test_a_script_with_worker_processes_exits_cleanly(converted, tmp_path):
    """grain's iterators stop their workers again when collected, which printed tracebacks at exit once the
    interpreter had torn its modules down; open loader iterators are closed at exit, before that."""
    script = tmp_path / "train.py"
    script.write_text("import sys, loader\n"
                      "if __name__ == '__main__':\n"  # worker processes are spawned: the guard is needed
                      "    it = iter(loader.load(sys.argv[1], batch_size=8, decode=None, worker_count=2))\n"
                      "    print(len(next(it)), len(next(it)))\n")
    proc = subprocess.run([sys.executable, str(script), str(converted)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["8", "8"], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr[-2000:]


def test_restoring_a_state_from_other_options_is_refused(converted):
    state = iter(loader.load(str(converted), batch_size=8, seed=2, decode=None)).get_state()
    it = iter(loader.load(str(converted), batch_size=8, seed=3, decode=None))
    with pytest.raises(ValueError, match="seed: saved 2, now 3"):
        it.set_state(state)
    with pytest.raises(ValueError, match=r"this is not a loader state \(\['step'\]\)$"):
        it.set_state({"step": 10})  # a training state handed over by mistake


def test_a_state_restores_onto_its_own_dataset_wherever_it_lies_and_no_other(converted, tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    from loader.format.source import resolve

    it = iter(loader.load(str(converted), batch_size=8, seed=2, decode=None))
    _take(it, 3)
    state = it.get_state()
    expected = _take(it, 4)
    # which records of which shards, named by file (not directory) and record count: a fixed digest
    assert state["dataset"] == "5 shards, 257 records, sha256:040547b6594cc64a" == resolve(str(converted)).identity
    copy = shutil.copytree(converted, tmp_path / "moved")  # the same dataset elsewhere (as a copy to gs:// would be)
    moved = iter(loader.load(str(copy), batch_size=8, seed=2, decode=None))
    moved.set_state(state)
    assert _take(moved, 4) == expected
    other = tmp_path / "other"  # as many records, in other shards
    other.mkdir()
    writer = ArrayRecordWriter(str(other / "all.array_record"), "group_size:1")
    for i in range(257):
        writer.write(b"%d" % i)
    writer.close()
    stranger = iter(loader.load(str(other / "*.array_record"), batch_size=8, seed=2, decode=None))
    with pytest.raises(ValueError, match=r"cannot restore loader state: dataset: saved '5 shards, 257 records, "
                                         r"sha256:040547b6594cc64a', now '1 shard, 257 records, sha256:[0-9a-f]{16}'; "
                                         r"restore with the same dataset and options$"):
        stranger.set_state(state)
    older = {k: v for k, v in state.items() if k != "dataset"}  # saved before states named their dataset
    stranger.set_state(older)
    assert len(next(stranger)) == 8


def test_map_fn_and_example_decoding(tmp_path, caplog):
    from dataset_format import example_proto
    from pipelines import ConvertConfig, run_conversion

    records = [example_proto.encode_example({"x": [i, i + 1, i + 2], "y": i % 3, "name": f"r{i}".encode()})
               for i in range(30)]
    write_tfrecord_shards(tmp_path / "in", [records[:11], records[11:]])
    run_conversion(ConvertConfig(input=str(tmp_path / "in" / "*"), output=str(tmp_path / "out")),
                   ["--direct_num_workers=1"])
    batch = next(iter(loader.load(str(tmp_path / "out"), batch_size=6, shuffle=False,
                                  map_fn=lambda ex: {**ex, "x2": ex["x"] * 2})))
    assert batch["x"].dtype == np.int64 and batch["x"].shape == (6, 3)
    np.testing.assert_array_equal(batch["y"], [0, 1, 2, 0, 1, 2])
    np.testing.assert_array_equal(batch["x2"][1], [2, 4, 6])
    assert batch["name"] == [b"r0", b"r1", b"r2", b"r3", b"r4", b"r5"]

    # a misspelt features= name is named as one at load(), from the manifest's features (not as a record that does
    # not decode, at the first batch)
    with pytest.raises(ValueError) as e:
        loader.load(str(tmp_path / "out"), batch_size=6, shuffle=False, features=["x", "nmae"])
    assert str(e.value) == (f"features=['x', 'nmae']: {tmp_path / 'out'}'s records have no 'nmae'; they have "
                            "['name', 'x', 'y'] (did you mean name?)")
    # an image op's input left out of features=: named with the op, at load()
    with pytest.raises(ValueError) as e:
        loader.load(str(tmp_path / "out"), batch_size=6, features=["y"], map_fn=loader.images.CenterCrop("name", 4))
    assert str(e.value) == ("features=['y'] leaves out 'name', which CenterCrop(...) reads: add it to features= (it "
                            "names the records' features the loader decodes and hands the map function; the batch "
                            "holds what the map function returns)")
    # without the manifest's statistics (a glob of bare files elsewhere), the first batch still names it
    for p in (tmp_path / "out").glob("*.array_record"):
        shutil.copy(p, tmp_path / p.name)
    with pytest.raises(ValueError) as e:
        next(iter(loader.load(str(tmp_path / "train-*.array_record"), batch_size=6, shuffle=False,
                              features=["x", "nmae"])))
    assert str(e.value) == (f"{tmp_path / 'train-00000-of-00002.array_record'}: record 0: no feature 'nmae' "
                            "in this record; its features are ['name', 'x', 'y']: check the names in features= (and "
                            "the features the map_fn's image ops read)")
    # a batch larger than the 30 records over the epochs asked for: no batch at all, said at once
    with pytest.raises(ValueError, match=rf"^batch_size=64 is more than the 30 records of {re.escape(str(tmp_path))}"
                                         r"/out over num_epochs=2: no batch would be made; lower batch_size, raise "
                                         r"num_epochs, or pass drop_remainder=False$"):
        loader.load(str(tmp_path / "out"), batch_size=64, num_epochs=2)
    with caplog.at_level("WARNING", logger="loader.pipeline"):  # one short batch, each record once: nothing to warn
        assert len(loader.load(str(tmp_path / "out"), batch_size=64, num_epochs=1, drop_remainder=False)) == 1
    assert "more than the 30 records" not in caplog.text
    assert len(loader.load(str(tmp_path / "out"), batch_size=64, num_epochs=2, drop_remainder=False)) == 1
    assert "batch_size=64 is more than the 30 records" in caplog.text and "holds records more than once" in caplog.text
    # an image op given to the other hook: said at load(), not as a TypeError at the first batch
    with pytest.raises(ValueError, match=r"^map_fn=RandomResizedCrop\(\.\.\.\) takes \(record, rng\): pass it as "
                                         r"random_map_fn="):
        loader.load(str(tmp_path / "out"), batch_size=6, map_fn=loader.images.RandomResizedCrop("x"))
    with pytest.raises(ValueError, match=r"^random_map_fn=CenterCrop\(\.\.\.\) takes \(record\) only: pass it as "
                                         r"map_fn="):
        loader.load(str(tmp_path / "out"), batch_size=6, random_map_fn=loader.images.CenterCrop("x"))

    def one(record):
        return record

    @functools.wraps(one)  # a wrapper that adds the rng: its own arguments count, not the wrapped function's
    def with_rng(record, rng):
        return one(record)

    loader.load(str(tmp_path / "out"), batch_size=6, random_map_fn=with_rng)


def test_group_decoding_gives_the_batches_of_record_by_record_decoding(tmp_path, monkeypatch):
    """Runs of batches in a read group decode in one call (NumPy parse) and are cut into batches; the same
    epoch decoded record by record (map_fn forces that path), with groups of one batch or many, and runs of
    one group or several per group, gives equal batches."""
    import loader.pipeline
    from dataset_format import example_proto
    from pipelines import ConvertConfig, run_conversion
    from tests.conftest import write_tfrecord_shards

    records = [example_proto.encode_example({"x": [i, 300 * i], "y": i, "name": f"r{i}".encode()})
               for i in range(50)]
    write_tfrecord_shards(tmp_path / "in", [records[:17], records[17:]])
    run_conversion(ConvertConfig(input=str(tmp_path / "in" / "*"), output=str(tmp_path / "out")),
                   ["--direct_num_workers=1"])
    out = str(tmp_path / "out")
    options = dict(batch_size=8, seed=3, num_epochs=1, drop_remainder=False)
    slow = list(loader.load(out, map_fn=lambda ex: ex, **options))
    for records_per_read, decode_records in ((8, 4096), (1000, 4096), (1000, 16), (1000, 1)):
        monkeypatch.setattr(loader.pipeline, "DECODE_RECORDS", decode_records)
        fast = list(loader.load(out, records_per_read=records_per_read, **options))
        assert len(fast) == len(slow) == 7
        for a, b in zip(fast, slow):
            assert a.keys() == b.keys() and a["name"] == b["name"]
            for key in ("x", "y"):
                assert a[key].dtype == b[key].dtype == np.int64
                np.testing.assert_array_equal(a[key], b[key])
    assert slow[0]["y"].tolist() == [int(name[1:]) for name in slow[0]["name"]]


def test_record_that_does_not_decode_is_named(converted):
    it = iter(loader.load(str(converted), batch_size=4, shuffle=False, decode="example"))
    with pytest.raises(ValueError, match=r"train-00000-of-00005.array_record: record 0 does not decode"):
        next(it)


def test_bad_sources_are_named(converted, tmp_path):
    with pytest.raises(FileNotFoundError, match="no files match"):
        loader.load(str(tmp_path / "nothing-*.array_record"), batch_size=4)
    with pytest.raises(FileNotFoundError, match=re.escape(f"no files match '{converted.parent / 'otu'}'; check the "
                                                          f"path and the glob; did you mean {converted}?")):
        loader.load(str(converted.parent / "otu"), batch_size=4)  # a misspelt dataset directory
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has neither manifest.json nor dataset_info.json") as empty:
        loader.load(str(tmp_path / "empty"), batch_size=4)
    assert "datasets below it" not in str(empty.value)
    (tmp_path / "raw").mkdir()  # TFRecord shards not converted yet: the line says to convert them
    for name in ("train.tfrecord-00001-of-00002", "train.tfrecord-00000-of-00002"):
        (tmp_path / "raw" / name).write_bytes(b"")
    with pytest.raises(FileNotFoundError) as raw:
        loader.load(str(tmp_path / "raw"), batch_size=4)
    assert str(raw.value).endswith(f"; it holds TFRecord files (train.tfrecord-00000-of-00002, ...): convert them "
                                   f"first: python -m pipelines convert --input {tmp_path / 'raw'} --output OUT")
    for name in ("test.tfrecord-00000-of-00001",):  # two splits side by side: a directory each
        (tmp_path / "raw" / name).write_bytes(b"")
    with pytest.raises(FileNotFoundError) as splits:
        loader.load(str(tmp_path / "raw"), batch_size=4)
    assert str(splits.value).endswith(f"; it holds TFRecord files of 2 kinds (test.tfrecord-*, train.tfrecord-*): "
                                      f"convert each to its own directory first, e.g. python -m pipelines convert "
                                      f"--input '{tmp_path / 'raw'}/test.tfrecord-*' --output OUT/test")
    (tmp_path / "imagenet").mkdir()  # ImageNet's names carry no tfrecord token: found by their first frame, and the
    for i in range(2):               # command takes a glob of them
        write_tfrecord_shards(tmp_path / "imagenet", [[b"x"]], pattern=f"train-0000{i}-of-00002")
    with pytest.raises(FileNotFoundError) as imagenet:
        loader.load(str(tmp_path / "imagenet"), batch_size=4)
    assert str(imagenet.value).endswith(f"; it holds TFRecord files (train-00000-of-00002, ...): convert them first: "
                                        f"python -m pipelines convert --input '{tmp_path / 'imagenet'}/train-*' "
                                        "--output OUT")
    for split in ("train", "test"):  # the parent of converted datasets: the error names them
        (tmp_path / "parent" / "custom" / split).mkdir(parents=True)
        manifest = (converted / "manifest.json").read_bytes()
        (tmp_path / "parent" / "custom" / split / "manifest.json").write_bytes(manifest)
    parent = tmp_path / "parent" / "custom"
    with pytest.raises(FileNotFoundError, match=re.escape(f"datasets below it: {parent}/test, {parent}/train (pass "
                                                          "one of those)")):
        loader.load(str(tmp_path / "parent"), batch_size=4)

    broken = tmp_path / "broken"
    shutil.copytree(converted, broken)
    os.remove(broken / "train-00003-of-00005.array_record")
    with pytest.raises(FileNotFoundError, match="train-00003-of-00005.array_record is listed in manifest.json but missing"):
        loader.load(str(broken), batch_size=4)
    (broken / "train-00003-of-00005.array_record").write_bytes(b"not an array record file")
    with pytest.raises(ValueError, match="train-00003-of-00005.array_record is 24 bytes but manifest.json says"):
        loader.load(str(broken), batch_size=4)
    os.remove(broken / "train-00003-of-00005.array_record")
    (broken / "train-00003-of-00005.array_record").mkdir()
    with pytest.raises(OSError, match="train-00003-of-00005.array_record: Is a directory; a shard must be a readable"):
        loader.load(str(broken), batch_size=4)

    with pytest.raises(ValueError, match=re.escape(f"'{converted}/*' matches {converted}/manifest.json, the dataset's "
                                                   f"metadata, not an ArrayRecord shard: pass the directory itself "
                                                   f"({converted})")):
        loader.load(f"{converted}/*", batch_size=4)  # a glob over a converted directory
    from pipelines import tfrecord

    for name in ("train.tfrecord-00001-of-00002", "train.tfrecord-00000-of-00002"):
        with open(tmp_path / "raw" / name, "wb") as f:
            tfrecord.write_records(f, [b"a record"] * 3)
    with pytest.raises(ValueError, match=re.escape(f"'{tmp_path}/raw/train.tfrecord-*' matches TFRecord files, not "
                                                   f"ArrayRecord: convert them first (python -m pipelines convert "
                                                   f"--input '{tmp_path}/raw/train.tfrecord-*' --output DIR)")):
        loader.load(f"{tmp_path}/raw/train.tfrecord-*", batch_size=4)  # the glob, not its first file

    (tmp_path / "junk.array_record").write_bytes(b"\0" * 100)
    with pytest.raises(ValueError, match="junk.array_record is not a whole ArrayRecord file"):
        loader.load(str(tmp_path / "junk.array_record"), batch_size=4)
    with pytest.raises(TypeError, match=r"unknown options \['shufle'\] \(did you mean shuffle\?\)"):
        loader.load(str(converted), batch_size=4, shufle=False)


def test_corrupt_shard_with_the_right_size_fails_naming_the_shard(rotten_copy):
    it = iter(loader.load(str(rotten_copy), batch_size=101, shuffle=False, num_epochs=1, decode=None))
    with pytest.raises(OSError, match=r"train-00002-of-00005.array_record.*corrupt"):
        list(it)


def test_batch_decoding_equals_record_by_record_decoding():
    from loader.decoding.decode import ExampleDecoder, collate
    from dataset_format.example_proto import encode_example

    decoder = ExampleDecoder()
    uniform = [encode_example({"x": [i, i + 1], "f": float(i) / 2, "s": b"a" * i, "y": i}) for i in range(1, 6)]
    fast, slow = decoder.decode_batch(uniform), collate([decoder(r) for r in uniform])
    assert fast.keys() == slow.keys()
    for key in slow:
        if isinstance(slow[key], list):
            assert fast[key] == slow[key]
        else:
            assert fast[key].dtype == slow[key].dtype and fast[key].shape == slow[key].shape
            np.testing.assert_array_equal(fast[key], slow[key])
    ragged = [encode_example({"x": list(range(i))}) for i in range(1, 4)]
    assert decoder.decode_batch(ragged) is None  # falls back to per-record decoding
    mixed = [encode_example({"a": 1}), encode_example({"b": 1})]
    assert decoder.decode_batch(mixed) is None
    kinds = [encode_example({"a": [1, 2]}), encode_example({"a": [1.5, 2.5]})]  # same key and width, other kind
    assert decoder.decode_batch(kinds) is None


def test_more_threads_than_prefetch_reads_ahead_for_each_thread(converted, caplog):
    """grain warns, and idles threads, when fewer reads are buffered than threads run."""
    with caplog.at_level("WARNING"):
        batches = _take(iter(loader.load(str(converted), batch_size=8, decode=None, num_threads=3, prefetch=1)), 4)
    assert len(batches) == 4
    assert not [r for r in caplog.records if "prefetch_buffer_size" in r.getMessage()]


def test_a_feature_that_some_records_lack_is_named_not_dropped():
    """The batch took the first record's features: a feature it lacked vanished from the batch, and one a later
    record lacked was a bare KeyError."""
    from dataset_format.example_proto import encode_example
    from loader.decoding.decode import ExampleDecoder, collate

    decoder = ExampleDecoder()
    records = [encode_example({"label": i, **({"scores": [0.5] * i} if i % 2 else {})}) for i in range(4)]
    for batch in (records, records[1:]):  # the first record without it, then with it
        with pytest.raises(ValueError, match=r"^feature 'scores' is in 2 of this batch's \d records: a feature that "
                                             r"some records lack cannot be batched; leave it out with features="):
            collate([decoder(r) for r in batch])


def test_sequence_examples_are_refused_by_the_example_decoder_not_cut_to_their_context():
    from dataset_format.example_proto import encode_example
    from loader.decoding.decode import ExampleDecoder, is_sequence_example

    context = encode_example({"id": b"doc", "length": 3})  # a SequenceExample with empty feature_lists: these bytes
    feature_lists = b"\x0a\x08\x0a\x06frames"  # (a FeatureLists message: one map entry, its key only)
    sequence = context + b"\x12" + bytes([len(feature_lists)]) + feature_lists
    assert [is_sequence_example(r) for r in (context, sequence)] == [False, True]
    # hostile bytes: a cut varint, a length past the end, a giant length, another wire type: no, without reading on
    assert not any(is_sequence_example(r) for r in (b"\x0a", b"\x0a\xff", b"\x0a\x7f", b"\x0a\xff\xff\xff\xff\xff\xff"
                                                    b"\xff\xff\xff\x01", b"\x08\x01\x12\x00", b""))
    refused = r"^these records are tf.train.SequenceExample \(they have feature_lists\).*pass decode= a function"
    decoder = ExampleDecoder()
    assert decoder(context)["length"] == 3
    with pytest.raises(ValueError, match=refused):
        decoder(sequence)
    with pytest.raises(ValueError, match=refused):
        ExampleDecoder().decode_batch([context, context, sequence])


def test_a_list_features_rank_does_not_depend_on_the_batch(tmp_path, capsys):
    """A multi-label feature holding one value in some records: those records gave a scalar, so a batch of them came
    as [B] and a mixed batch as a list of scalars and arrays. The manifest's lengths keep it an array in every record;
    features that hold one value in every record stay scalars."""
    from dataset_format import example_proto
    from pipelines import ConvertConfig, run_conversion
    from tests.conftest import write_tfrecord_shards

    labels = [[3], [4], [1, 2], [5], [6, 7, 8], [9], [0], [2]]  # one value, except records 2 and 4
    records = [example_proto.encode_example({"labels": v, "tag": [f"t{i}".encode()] * len(v), "id": i})
               for i, v in enumerate(labels)]
    write_tfrecord_shards(tmp_path / "in", [records[:4], records[4:]])
    assert run_conversion(ConvertConfig(input=str(tmp_path / "in" / "*"), output=str(tmp_path / "out")),
                          ["--direct_num_workers=1"]).ok
    out = str(tmp_path / "out")
    for options in ({}, {"map_fn": lambda ex: ex}):  # decoded a batch at a time, and record by record
        batches = list(loader.load(out, batch_size=2, shuffle=False, num_epochs=1, **options))
        assert [b["id"].tolist() for b in batches] == [[0, 1], [2, 3], [4, 5], [6, 7]]
        first, mixed = batches[0], batches[1]
        assert first["labels"].shape == (2, 1) and first["labels"].tolist() == [[3], [4]]  # not [3, 4]
        assert first["tag"].shape == (2, 1) and first["tag"].tolist() == [[b"t0"], [b"t1"]]
        assert isinstance(mixed["labels"], list) and [v.tolist() for v in mixed["labels"]] == [[1, 2], [5]]
        assert batches[3]["labels"].tolist() == [[0], [2]]
        assert batches[0]["id"].shape == (2,)  # one value in every record: a scalar each
    mixed = next(iter(loader.load({"a": out, "b": out}, weights={"a": 1, "b": 1}, batch_size=4, seed=0)))
    rows = mixed["labels"] if isinstance(mixed["labels"], list) else list(mixed["labels"])
    assert all(np.asarray(r).ndim == 1 for r in rows), mixed["labels"]  # in a mixture too: never a scalar
    from loader.cli import main

    assert main(["inspect", out]) == 0
    text = capsys.readouterr().out
    assert ("  id: int64 0..7 (every record)\n"
            "  labels: int64 0..9 (every record, 1-3 values a record)\n"
            "  tag: bytes present (every record, 1-3 values a record)\n") in text, text
    assert "  labels: int64[1]  e.g. [3]" in text, text  # record 0, decoded as the loader does


def test_a_text_file_is_named_as_text_not_as_a_damaged_arrayrecord(tmp_path):
    (tmp_path / "web.jsonl").write_text('{"text": "The cat sat on the mat."}\n' * 5000)
    with pytest.raises(ValueError) as e:
        loader.load(str(tmp_path / "web.jsonl"), batch_size=2)
    assert str(e.value).startswith(f"{tmp_path / 'web.jsonl'} is not an ArrayRecord file: it begins with text "
                                   "('{\"text\": \"Th'...); write the data as TFRecord files of tf.train.Example "
                                   "records, convert them (python -m pipelines convert"), str(e.value)


class FailOnce:
    """A map_fn that raises once, on the record `target` (a marker file says it has: worker processes start afresh)."""

    def __init__(self, target: bytes, marker: str):
        self.target, self.marker = target, marker

    def __call__(self, record: bytes) -> dict:
        if record == self.target and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            raise OSError(f"transient error on {record!r}")
        return {"r": np.frombuffer(record.ljust(8), np.uint8)}


class _SlowRecord:
    def __call__(self, record: bytes) -> dict:
        time.sleep(0.002)
        return {"r": np.frombuffer(record.ljust(8), np.uint8)}


def test_a_ctrl_c_caught_during_next_leaves_the_rest_to_read(converted):
    """A Ctrl-C while next() waited for the worker processes, caught by the caller (a notebook cell, a REPL): the
    executor closed on it, and iterating again gave no batch and no error, the epoch silently cut short. The batch it
    interrupted comes next, then the rest."""
    import signal
    import threading

    options = dict(batch_size=4, seed=0, decode=None, records_per_read=8, worker_count=1, num_epochs=1,
                   map_fn=_SlowRecord())
    expected = [[bytes(r).rstrip() for r in b["r"]] for b in loader.load(str(converted), **options)]
    it = iter(loader.load(str(converted), **options))
    got = [[bytes(r).rstrip() for r in next(it)["r"]] for _ in range(3)]
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            while True:
                got.append([bytes(r).rstrip() for r in next(it)["r"]])
    finally:
        signal.signal(signal.SIGINT, previous)
    got += [[bytes(r).rstrip() for r in b["r"]] for b in it]
    assert got == expected and len(expected) > 10
    it.close()


@pytest.mark.parametrize("worker_count", [0, 1])
def test_a_batch_that_raised_comes_next_when_the_caller_asks_again(converted, tmp_path, worker_count):
    """A caller that catches an error from next() and asks again gets the batch that failed, then the rest in order,
    and get_state() counts what it was handed (the executors had moved past the group, or ended an endless loader)."""
    options = dict(batch_size=4, seed=0, decode=None, records_per_read=40, worker_count=worker_count)
    expected = [[bytes(r).rstrip() for r in b["r"]] for b in _take(iter(loader.load(
        str(converted), map_fn=FailOnce(b"", ""), **options)), 20)]
    it = iter(loader.load(str(converted), map_fn=FailOnce(expected[17][2], str(tmp_path / "failed")), **options))
    got, errors = [], []
    while len(got) < 20:
        try:
            got.append([bytes(r).rstrip() for r in next(it)["r"]])
        except ValueError as e:  # the read group holding batch 17 failed, as a whole
            errors.append((str(e), it.get_state()["next_batch"]))
    assert len(errors) == 1 and errors[0][1] <= 17
    assert re.search(r"record \d+: FailOnce failed \(OSError: transient error", errors[0][0])
    assert got == expected and it.get_state()["next_batch"] == 20
    it.close()


def _none_for_one(record):
    return None if record == b"2:7" else {"r": np.frombuffer(record.ljust(8), np.uint8)}


def test_a_map_fn_that_returns_none_is_named_with_the_record(converted):
    """It was an AttributeError from the collation ('NoneType' object has no attribute ...), naming neither the
    function nor the record."""
    with pytest.raises(ValueError, match=r"record \d+: _none_for_one returned None; it must return the mapped record"):
        list(loader.load(str(converted), batch_size=4, seed=0, decode=None, num_epochs=1, map_fn=_none_for_one))


def _float_for_one(record):
    pixels = np.frombuffer(record.ljust(8), np.uint8)
    return {"r": pixels.astype(np.float32) if record == b"2:7" else pixels, "n": np.int64(len(record))}


def _rank_for_one(record):
    return np.frombuffer(record.ljust(8), np.uint8).reshape((2, 4) if record == b"3:3" else (8,))


def test_a_map_fn_giving_one_record_another_dtype_or_rank_is_named(converted):
    """One float32 record among uint8 ones made the batch float64 without a word; one of another rank made it a list
    of arrays. Either is one line naming the function, the feature and both records; strings of other widths and
    same-rank arrays of other lengths (ragged lists) still batch as before."""
    float_for_one = (r"train-00002-of-00005\.array_record: record 7: _float_for_one gave feature 'r' as float32 of "
                     r"rank 1, where for .*record \d+ \(and \d+ more of this batch\) it gave uint8 of rank 1: a batch "
                     r"stacks its records, so a map function must give every record one dtype and rank; convert it "
                     r"\(e\.g\. np\.asarray\(value, np\.uint8\)\)")
    with pytest.raises(ValueError, match=float_for_one):
        list(loader.load(str(converted), batch_size=8, seed=0, decode=None, num_epochs=1, map_fn=_float_for_one))
    with pytest.raises(ValueError, match=r"_rank_for_one gave its output as uint8 of rank 2, where for .* \(and 6 more "
                                         r"of this batch\) it gave uint8 of rank 1"):
        list(loader.load(str(converted), batch_size=8, seed=0, decode=None, num_epochs=1, map_fn=_rank_for_one))
    strings_and_ragged = lambda r: {"s": np.array(r.rstrip()), "v": np.frombuffer(r.rstrip(), np.uint8)}  # noqa: E731
    batch = next(iter(loader.load(str(converted), batch_size=8, seed=0, decode=None, num_epochs=1,
                                  map_fn=strings_and_ragged)))
    assert batch["s"].dtype.kind == "S" and isinstance(batch["v"], list) and len(batch["v"]) == 8


def test_a_batch_waited_for_too_long_is_logged_with_where_to_look(converted, monkeypatch, caplog):
    """A map function that does not return left the run silent: after STALL_SECONDS of waiting for one batch a line
    says so, and what to look at; again at each doubling, never for a batch that came."""
    from loader.executors import handout

    monkeypatch.setattr(handout, "STALL_SECONDS", 0.3)
    monkeypatch.setattr(handout, "STALL_POLL", 0.05)
    said = lambda: [r.getMessage() for r in caplog.records if r.name == handout.__name__]  # noqa: E731
    started = time.monotonic()

    def hangs_once(record):
        while record == b"3:5" and not said() and time.monotonic() - started < 15:
            time.sleep(0.02)
        return {"r": np.frombuffer(record.ljust(8), np.uint8)}

    with caplog.at_level("WARNING", logger=handout.__name__):
        batches = list(loader.load(str(converted), batch_size=8, seed=0, decode=None, num_epochs=1, worker_count=0,
                                   map_fn=hangs_once))
    assert len(batches) == 32 and len(said()) == 1, said()
    assert re.fullmatch(r"waiting \d+ s for batch \d+: no batch came\. A map function that does not return, a read "
                        r"that hangs \(a gs:// link\), or workers without CPU; `py-spy dump --pid \d+` \(and its "
                        r"worker processes'\) shows where", said()[0]), said()
