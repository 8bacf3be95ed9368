"""loader/remote.py: many gs:// ranges at once, through the emulator behind tests/emulator.py's FaultFront."""

import logging

import pytest

from dataset_format import storage
from loader import remote

pytestmark = pytest.mark.gcs


@pytest.fixture
def shard(faulty_gcs):
    bucket, front = faulty_gcs
    data = bytes(range(256)) * 400
    storage.write_bytes(f"gs://{bucket}/ds/shard", data)
    return f"gs://{bucket}/ds/shard", data, front


def test_ranges_come_back_in_order_and_exact(shard):
    path, data, front = shard
    ranges = [(path, s, s + n) for s, n in [(0, 10), (5000, 70_000), (100, 1), (len(data) - 7, 7), (300, 300)]]
    front.seen.clear()
    assert remote.fetch(ranges) == [data[s:e] for _, s, e in ranges]
    assert sorted(r for m, _, r in front.seen if m == "GET") == sorted(f"bytes={s}-{e - 1}" for _, s, e in ranges)
    assert remote.fetch([(path, len(data) - 3, len(data) + 5)]) == [data[-3:]]  # the object ends sooner
    assert remote.fetch([]) == []


@pytest.mark.parametrize("fault", [503, 429, 0])
def test_transient_answers_and_bodies_cut_off_are_retried(shard, fault, caplog):
    path, data, front = shard
    front.fail_next(fault, times=2, where="/ds%2Fshard")
    with caplog.at_level(logging.WARNING, logger="loader.remote"):
        assert remote.fetch([(path, 1000, 90_000), (path, 0, 10)]) == [data[1000:90_000], data[:10]]
    assert [s for s, _ in front.failed] == [fault, fault]
    assert len([r for r in caplog.records if "retrying" in r.getMessage()]) == 2


@pytest.mark.parametrize("status, error, words", [
    (403, PermissionError, "permission denied (403) on bucket"),
    (404, FileNotFoundError, "no such object 'ds/shard' in bucket"),
    (400, OSError, "answered 400 to a range read"),
])
def test_refusals_name_the_object_and_are_not_retried(shard, status, error, words):
    path, _, front = shard
    front.fail_next(status, times=1, where="/ds%2Fshard")
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")) as e:
        remote.fetch([(path, 0, 10)])
    assert path in str(e.value) and len(front.failed) == 1
