"""loader.DataSource against grain's ArrayRecordDataSource on the same converted shards: record for record, and
through MaxText's grain pipeline (shuffle, map, first-fit packing, batch, worker processes)."""

import hashlib
import pickle
import threading
from pathlib import Path

import grain
import numpy as np
import pytest

import loader

SEQ_LEN, ROWS = 16, 4


@pytest.fixture(scope="module")
def sources(converted):
    """(ours, grain's) over the converted shards."""
    ours = loader.DataSource(str(converted))
    return ours, grain.sources.ArrayRecordDataSource(list(ours.paths))


def test_records_are_grains_record_for_record(sources, all_records):
    ours, theirs = sources
    n = len(all_records)
    assert len(ours) == len(theirs) == n
    rng = np.random.default_rng(0)
    # the last record, both sides of the empty shard (36 | 37), random order, duplicates
    indices = [n - 1, 0, 36, 37, n - 1, 36, *rng.integers(0, n, 64).tolist(), 5, 5]
    expected = [all_records[i] for i in indices]
    assert [theirs[i] for i in indices] == expected
    assert ours.__getitems__(indices) == expected
    assert ours.__getitems__(np.array(indices, dtype=np.int32)) == expected
    assert [ours[i] for i in indices] == expected
    assert ours[np.int64(n - 1)] == all_records[-1]
    assert ours.__getitems__([]) == []
    assert list(grain.MapDataset.source(ours)) == all_records
    # grain's batched reads (its batch pushdown) reach the source's `_getitems`
    assert grain.MapDataset.source(ours)._getitems(indices) == expected


def test_an_index_out_of_range_names_it_and_the_length(sources):
    ours, theirs = sources
    n = len(theirs)
    for bad in (n, -1, 10**12):
        with pytest.raises(IndexError, match=rf"index {bad} is out of range for '.*', which holds {n} records"):
            ours[bad]
    with pytest.raises(IndexError, match=rf"index {n} is out of range .* {n} records"):
        ours.__getitems__([0, 3, n, 4])
    with pytest.raises(TypeError):
        ours[1.0]
    assert f"records={n}, shards=5" in repr(ours)
    tail = loader.DataSource(ours._name, split="[90%:]")  # a slice: the message says which records it holds
    with pytest.raises(IndexError, match=rf"for '.*' split=\[90%:\], which holds {len(tail)} records"):
        tail[len(tail)]
    assert pickle.loads(pickle.dumps(tail))._split == "[90%:]"


def test_a_pickled_copy_maps_the_same_index_and_reads_the_same_records(sources, all_records, tmp_path,
                                                                        monkeypatch):
    ours, theirs = sources
    blob = pickle.dumps(ours)
    assert len(blob) < 2 * len(pickle.dumps(theirs))  # paths and options, as grain's own source: no per-record data
    assert repr(pickle.loads(blob)) == repr(ours)  # grain's DataLoader checks repr(source) when it restores
    elsewhere = tmp_path / "other-index-dir"
    monkeypatch.setenv("LOADER_INDEX_DIR", str(elsewhere))
    copy = pickle.loads(blob)
    order = np.random.default_rng(1).permutation(len(all_records))
    results = [None] * 4

    def read(t: int) -> None:  # four threads race to open the copy's reader
        results[t] = copy.__getitems__(order[t::4])

    threads = [threading.Thread(target=read, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for t in range(4):
        assert results[t] == [all_records[i] for i in order[t::4]]
    assert not elsewhere.exists()  # the copy used the index file the original built, not a new one


def decode(record: bytes) -> dict:
    """A record's bytes as tokens (the converted records are short texts, b'<shard>:<index>')."""
    tokens = np.frombuffer(record, dtype=np.uint8).astype(np.int32)
    return {"inputs": tokens, "targets": tokens}


def maxtext_pipeline(source, workers: int = 0, threads: int = 0):
    """The shape of MaxText's grain pipeline (input_pipeline/_grain_data_processing.py): `workers` processes, or
    grain's thread form of the same prefetch (`threads`: each reads the slice a worker would, interleaved alike)."""
    ds = grain.MapDataset.source(source).shuffle(seed=0).map(decode).to_iter_dataset()
    ds = grain.experimental.FirstFitPackIterDataset(ds, length_struct={"inputs": SEQ_LEN, "targets": SEQ_LEN},
                                                    num_packing_bins=ROWS)
    ds = ds.batch(ROWS)
    if workers:
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    if threads:
        ds = grain.experimental.multithread_prefetch(ds, num_threads=threads, buffer_size=1)
    return ds


def run(ds) -> list[dict]:
    it = iter(ds)
    try:
        return list(it)
    finally:
        if hasattr(it, "close"):
            it.close()


def texts(batch: dict, row: int) -> list[str]:
    """The records packed into one row, as text."""
    tokens, segments = batch["inputs"][row], batch["inputs_segment_ids"][row]
    return [bytes(tokens[segments == s].astype(np.uint8)).decode() for s in np.unique(segments[segments > 0])]


def digest(batches: list[dict]) -> str:
    h = hashlib.sha256()
    for batch in batches:
        for key in sorted(batch):
            h.update(key.encode() + np.ascontiguousarray(batch[key]).tobytes())
    return h.hexdigest()[:16]


def assert_same(ours: list[dict], theirs: list[dict]) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert sorted(a) == sorted(b)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_maxtexts_pipeline_gives_grains_batches(sources, all_records):
    ours, theirs = sources
    batches = run(maxtext_pipeline(ours))
    assert_same(batches, run(maxtext_pipeline(theirs)))
    assert batches[0]["inputs"].shape == (ROWS, SEQ_LEN)
    assert sorted(t for b in batches for row in range(len(b["inputs"])) for t in texts(b, row)) == \
        sorted(r.decode() for r in all_records)
    # pinned: a change of order (ours, grain's shuffle or packer) fails here
    assert [texts(batches[0], row) for row in range(ROWS)] == [
        ["2:25", "2:98", "4:41", "3:49"], ["2:97", "2:96", "0:10", "2:99"], ["3:11", "2:32", "2:58", "0:9"],
        ["4:52", "0:13", "3:32", "4:44"]]
    assert (len(batches), digest(batches)) == (17, "d273a9c424d33ab0")


def test_maxtexts_pipeline_with_worker_processes_gives_grains_batches(sources):
    from absl import flags

    if not flags.FLAGS.is_parsed():  # grain's workers read absl flags; MaxText parses them in absl.app.run
        flags.FLAGS.mark_as_parsed()
    ours, theirs = sources
    batches = run(maxtext_pipeline(ours, workers=2))  # each worker unpickles the source and opens it
    # grain's source through grain's thread form of mp_prefetch: the same slices and interleaving, without the
    # ~5 s it takes two processes to start on 2 cores
    assert_same(batches, run(maxtext_pipeline(theirs, threads=2)))
    # each worker packs its own slice of the shuffled records; grain interleaves the workers' batches
    assert [texts(batches[0], row) for row in range(ROWS)] == [
        ["3:17", "4:1", "2:48", "3:52"], ["2:97", "0:10", "3:11", "2:58"], ["2:25", "4:41", "4:52", "3:32"],
        ["2:34", "2:78", "2:33", "2:23"]]
    assert (len(batches), digest(batches)) == (17, "62d3e8d617870d7e")


def test_a_script_with_grains_worker_processes_over_it_exits_cleanly(converted, tmp_path):
    """grain's mp_prefetch iterator held in a function (a main()) is collected before the interpreter tears its
    modules down, so the script exits without grain's 'Exception ignored' tracebacks (docs/loading.md)."""
    import subprocess
    import sys

    from tests.conftest import REPO

    script = tmp_path / "train.py"
    script.write_text("import sys\nimport absl.flags, grain, loader\n\n"
                      "def main():\n"
                      "    absl.flags.FLAGS.mark_as_parsed()\n"
                      "    ds = grain.MapDataset.source(loader.DataSource(sys.argv[1])).to_iter_dataset().batch(4)\n"
                      "    it = iter(ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2)))\n"
                      "    print(len(next(it)))\n\n"
                      "if __name__ == '__main__':\n"  # (the workers are spawned: the guard is needed)
                      "    main()\n")
    proc = subprocess.run([sys.executable, str(script), str(converted)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["4"], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr[-2000:]


# array_record's own ArrayRecordDataSource test cases (python/array_record_data_source_test.py), on the two shards of
# digits grain ships with its tests: construction from a list of paths and from one path, the context manager.
GRAIN_DIGITS = [Path(grain.__file__).parent / "_src" / "python" / "testdata" / f"digits.array_record-0000{i}-of-00002"
                for i in range(2)]
DIGITS = [str(d).encode() for d in range(10)]


def test_a_list_of_paths_numbers_their_records_in_that_order():
    ar = loader.DataSource(GRAIN_DIGITS)
    assert len(ar) == 10
    assert list(ar) == DIGITS  # iterates
    assert ar.paths == tuple(map(str, GRAIN_DIGITS))
    assert len(loader.DataSource([str(GRAIN_DIGITS[1]), str(GRAIN_DIGITS[0])])) == 10
    assert loader.DataSource(GRAIN_DIGITS[::-1])[0] == loader.DataSource(GRAIN_DIGITS)[5]


@pytest.mark.parametrize("indices", [[0, 1, 2, 3, 4], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0], [3, 0, 5, 9, 2, 1, 4, 7, 8, 6]])
def test_as_a_context_manager_it_reads_then_closes_its_files(indices):
    with loader.DataSource(GRAIN_DIGITS) as ar:
        assert [ar[i] for i in indices] == [DIGITS[i] for i in indices]
        assert ar.__getitems__(indices) == [DIGITS[i] for i in indices]
        assert ar._reader is not None
    assert ar._reader is None  # closed; a later read opens them again
    assert ar[indices[0]] == DIGITS[indices[0]]


def test_a_single_path():
    with loader.DataSource(GRAIN_DIGITS[0]) as ar:
        assert [ar[i] for i in range(5)] == DIGITS[:5]


def test_an_empty_sequence_is_a_value_error():
    with pytest.raises(ValueError, match="no ArrayRecord files given"):
        with loader.DataSource([]):
            pass


def test_what_grains_pipelines_call_on_a_source():
    """grain 0.2.18 reads a source record by record, batched or not (docs/maxtext.md says so): if a later grain asks
    for batches, this fails and the page should say that `__getitems__` serves them."""
    import collections

    calls = collections.Counter()

    class Counted(loader.DataSource):
        def __getitem__(self, i):
            calls["__getitem__"] += 1
            return super().__getitem__(i)

        def __getitems__(self, indices):
            calls["__getitems__"] += 1
            return super().__getitems__(indices)

        _getitems = __getitems__

    source = Counted(GRAIN_DIGITS)
    for pipeline in (grain.MapDataset.source(source).shuffle(seed=0).map(bytes).batch(5),
                     grain.MapDataset.source(source).shuffle(seed=0).to_iter_dataset().batch(5)):
        calls.clear()
        assert sorted(r for batch in pipeline for r in batch) == DIGITS
        assert calls == {"__getitem__": 10}
