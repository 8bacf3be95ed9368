"""BatchReader: records at global indices, in order, by either read path (one list call, or record by record)."""

import threading

import numpy as np
import pytest

from loader.reader import BatchReader
import loader.reader
from loader.source import resolve

# (SEEK_BELOW, SEEK_PER_FILE, SMALL_SHARD_BYTES): the test shards are tiny, so by default they are all "small"
PATHS = {"list calls": (0, 10**9, 0), "record by record": (10**9, 10**9, 0),
         "small shards: list calls through a whole-file buffer": (10**9, 10**9, 1 << 30)}


@pytest.fixture(params=sorted(PATHS))
def read_path(request, monkeypatch):
    below, per_file, small = PATHS[request.param]
    monkeypatch.setattr(loader.reader, "SEEK_BELOW", below)
    monkeypatch.setattr(loader.reader, "SEEK_PER_FILE", per_file)
    monkeypatch.setattr(loader.reader, "SMALL_SHARD_BYTES", small)
    return request.param


def test_records_come_back_in_the_asked_order_on_either_path(converted, all_records, read_path):
    reader = BatchReader(resolve(str(converted)))
    indices = np.random.default_rng(0).integers(0, len(all_records), size=300)  # unordered, with repeats
    assert reader(indices) == [all_records[i] for i in indices]
    assert reader(np.array([256, 0, 37, 36, 37])) == [b"4:54", b"0:0", b"2:0", b"0:36", b"2:0"]
    assert reader(np.array([], dtype=np.int64)) == []


def test_list_share_picks_the_path_by_run_length(converted, monkeypatch):
    assert BatchReader(resolve(str(converted))).list_share(1) == 1.0  # small shards: always list calls
    monkeypatch.setattr(loader.reader, "SMALL_SHARD_BYTES", 0)
    reader = BatchReader(resolve(str(converted)))  # shards of 37, 0, 101, 64, 55 records
    assert reader.list_share(257) == 0.0  # runs of ~1 record per shard record: all shorter than SEEK_BELOW (256)
    # a group of 4 * 257: runs of ~4 per shard record, 404 and 256 from the 101- and 64-record shards
    assert reader.list_share(4 * 257) == pytest.approx((101 + 64) / 257)
    assert reader.list_share(7 * 257) == 1.0  # 259 from the 37-record shard
    monkeypatch.setattr(loader.reader, "WHOLE_FILE_BYTES", 0)  # by default the reader's own read group
    assert BatchReader(resolve(str(converted)), group_records=4 * 257).list_share() == pytest.approx((101 + 64) / 257)


def test_threads_share_one_reader_per_shard_on_both_paths(converted, all_records, monkeypatch):
    """Four threads read at once through one BatchReader; runs of >= 20 records take list calls, shorter
    ones seek, so list calls and seek + read pairs hit the same shard's reader concurrently. (CPython 3.11
    switches threads only between loop iterations, never between a seek and its read, so this cannot catch
    a missing seek lock; it catches readers opened per thread, and wrong records.)"""
    monkeypatch.setattr(loader.reader, "SEEK_BELOW", 20)
    monkeypatch.setattr(loader.reader, "SEEK_PER_FILE", 10**9)
    monkeypatch.setattr(loader.reader, "SMALL_SHARD_BYTES", 0)
    opened = []
    real = loader.reader.ArrayRecordReader
    monkeypatch.setattr(loader.reader, "ArrayRecordReader", lambda path, options: opened.append(path) or
                        real(path, options))
    reader = BatchReader(resolve(str(converted)))
    wrong, failures = [], []

    def work(seed):
        try:
            rng = np.random.default_rng(seed)
            for _ in range(30):
                indices = rng.integers(0, len(all_records), size=int(rng.integers(5, 400)))
                if reader(indices) != [all_records[i] for i in indices]:
                    wrong.append(seed)
        except Exception as e:  # noqa: BLE001 - reported below
            failures.append(e)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures and not wrong
    assert sorted(opened) == sorted(str(p) for p in resolve(str(converted)).paths if "00001" not in p)  # 0 records


def test_corrupt_records_are_named_on_either_path(rotten_copy, read_path):
    reader = BatchReader(resolve(str(rotten_copy)))
    with pytest.raises(OSError, match=r"train-00002-of-00005.array_record: cannot read records 0\.\.100.*corrupt"):
        reader(np.arange(37, 37 + 101))


def test_remote_shards_always_take_list_calls(gcs_bucket, converted):
    """gs:// shards: each record is a range request; a list call issues them from ArrayRecord's pool."""
    bucket, client = gcs_bucket
    for f in converted.iterdir():
        if f.is_file():  # the dataset; not the converter's own .shards/ records
            client.bucket(bucket).blob(f"ds/{f.name}").upload_from_filename(str(f))
    remote = resolve(f"gs://{bucket}/ds")
    reader = BatchReader(remote)
    assert reader.list_share(1) == 1.0
    assert reader(np.array([256, 0, 37])) == [b"4:54", b"0:0", b"2:0"]


@pytest.mark.parametrize("shards, records, record_bytes, whole", [
    (1000, 100, 1966, True),  # 197 KB files: small, always
    (500, 1000, 1179, True),  # 1.2 MB files, 66 records a group each: ~17 KB copied per record
    (1000, 1000, 1179, False),  # 33 a group each: ~34 KB per record
    (1000, 3000, 1135, False),  # 3.4 MB files, 33 a group each: ~97 KB per record
    (8, 125_000, 1099, False),  # 137 MB files: larger than any whole-file buffer
])
def test_whole_file_buffers_where_a_group_copies_little_per_record(shards, records, record_bytes, whole):
    """The rule behind the measured cases in docs/benchmarks.md (groups of 32,768 records)."""
    lengths = np.full(shards, records)
    sizes = lengths * record_bytes
    assert loader.reader._whole_file(lengths, sizes, 32768, shards * records).tolist() == [whole] * shards
    small = records * record_bytes <= loader.reader.SMALL_SHARD_BYTES  # without a group size: small shards only
    assert loader.reader._whole_file(lengths, sizes, None, shards * records).tolist() == [small] * shards
