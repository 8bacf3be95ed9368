"""loader/fetch/remote.py: many gs:// ranges at once, through the emulator behind tests/emulator.py's FaultFront."""

import logging

import pytest

from dataset_format import storage
from loader.fetch import remote

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
    with caplog.at_level(logging.WARNING, logger="loader.fetch.remote"):
        assert remote.fetch([(path, 1000, 90_000), (path, 0, 10)]) == [data[1000:90_000], data[:10]]
    assert [s for s, _ in front.failed] == [fault, fault]
    assert len([r for r in caplog.records if "retrying" in r.getMessage()]) == 1  # one line an object and cause


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


def test_a_failed_reads_other_ranges_stop_retrying(shard):
    """A read whose range got a 404 failed at once, but its other ranges, answered 503, went on retrying for up to
    2 minutes, holding the process's request workers and its host's slots from the reads after it."""
    import time

    path, _, front = shard
    slow = path.replace("/shard", "/slow")
    storage.write_bytes(slow, b"x" * 100)
    front.fail_next(503, times=50, where="/ds%2Fslow")
    front.fail_next(404, times=1, where="/ds%2Fshard")
    front.seen.clear()
    with pytest.raises(FileNotFoundError):
        remote.fetch([(slow, 0, 10), (path, 0, 10)])
    time.sleep(3.0)  # retries at 0.25, 0.75, 1.75 s and on, were it still retrying
    assert len([1 for m, where, _ in front.seen if m == "GET" and "slow" in where]) <= 2, front.seen


def test_a_body_gives_views_of_its_pieces_and_copies_across_them():
    pieces = [b"abcde", b"", b"fgh", b"ijklmnop"]
    body = remote.Body(pieces)
    whole = b"".join(pieces)
    assert len(body) == 16 and bytes(body) == whole
    inside = body.view(5, 8)  # all of piece 2 (the empty piece is dropped)
    assert isinstance(inside, memoryview) and inside.obj is pieces[2] and bytes(inside) == b"fgh"
    assert bytes(body.view(9, 12)) == b"jkl" and body.view(9, 12).obj is pieces[3]
    for begin, end in [(3, 7), (0, 16), (4, 9), (2, 15), (7, 8), (8, 8), (16, 16), (0, 0)]:
        assert bytes(body.view(begin, end)) == whole[begin:end], (begin, end)
    for begin, end in [(-1, 3), (3, 2), (0, 17), (17, 17)]:
        with pytest.raises(ValueError, match="of a body of 16"):
            body.view(begin, end)
    assert len(remote.Body([])) == 0 and bytes(remote.Body([])) == b""


def test_a_range_that_arrives_in_many_pieces_is_read_exactly(faulty_gcs):
    bucket, _ = faulty_gcs
    data = bytes(range(251)) * 6000  # 1.5 MB: more than one read of the connection (256 KiB)
    path = f"gs://{bucket}/ds/large"
    storage.write_bytes(path, data)
    [body] = remote.fetch_bodies([(path, 7, len(data) - 5)])
    assert len(body) == len(data) - 12
    for begin, end in [(0, 1), (0, len(body)), (262_130, 262_160), (12_345, 987_654), (len(body) - 3, len(body))]:
        assert bytes(body.view(begin, end)) == data[7 + begin:7 + end]


def test_reads_are_served_in_the_order_they_ask(shard, monkeypatch):
    """A read asked first has its ranges fetched first, not interleaved with a read asked after it: its batches
    come sooner (and a cache filled by whole reads keeps whole read groups)."""
    import threading
    import time

    path, data, front = shard
    monkeypatch.setattr(remote, "IN_FLIGHT", 1)
    loop = remote._Loop()  # one request in flight: the order they are fetched in is the order they are served in
    first = [(path, 1000 + 10 * i, 1010 + 10 * i) for i in range(20)]
    second = [(path, 5000 + 10 * i, 5010 + 10 * i) for i in range(20)]
    front.seen.clear()
    got = {}
    a = threading.Thread(target=lambda: got.setdefault("first", loop.run(
        [(storage.media_url(p), p, s, e, None) for p, s, e in first])))
    a.start()
    deadline = time.monotonic() + 30
    while not any(m == "GET" for m, _, _ in front.seen) and time.monotonic() < deadline:
        time.sleep(0.001)
    got["second"] = loop.run([(storage.media_url(p), p, s, e, None) for p, s, e in second])
    a.join()
    assert [bytes(b) for b in got["first"]] == [data[s:e] for _, s, e in first]
    assert [bytes(b) for b in got["second"]] == [data[s:e] for _, s, e in second]
    asked = [r for m, _, r in front.seen if m == "GET"]
    assert asked == [f"bytes={s}-{e - 1}" for _, s, e in first + second]


def test_a_read_with_a_failing_range_fails_and_the_next_read_succeeds(shard):
    path, data, front = shard
    front.fail_next(404, times=1, where="/ds%2Fshard")
    with pytest.raises(FileNotFoundError, match="no such object"):
        remote.fetch([(path, 0, 10), (path, 10, 20), (path, 20, 30)])
    assert remote.fetch([(path, 0, 10), (path, 10, 20)]) == [data[:10], data[10:20]]
