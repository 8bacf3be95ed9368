"""dataset_format.storage on local disk and on gs:// (the GCS emulator), with faults injected in front of it
(`faulty_gcs`, tests/emulator.py's FaultFront): the real google-cloud-storage client, its real retries.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest

from dataset_format import storage


def test_local_round_trip_listing_and_globs(tmp_path):
    d = str(tmp_path / "data")
    storage.write_text(storage.join(d, "a.json"), "{}")
    storage.write_bytes(storage.join(d, "sub/b.bin"), b"xyz")
    assert storage.read_text(storage.join(d, "a.json")) == "{}"
    assert storage.read_bytes(storage.join(d, "missing")) is None
    assert storage.list_sizes(d) == {"a.json": 2}
    assert storage.list_sizes(str(tmp_path / "nothing")) == {}
    assert [storage.names_something(p) for p in (d, storage.join(d, "a.json"), str(tmp_path / "nothing"))] == [
        True, True, False]
    assert storage.glob(str(tmp_path / "data" / "*")) == [storage.join(d, "a.json"), storage.join(d, "sub")]
    assert [p.name for p in tmp_path.rglob(".tmp-*")] == []


def test_a_local_exclusive_create_is_seen_whole_or_not_at_all(tmp_path):
    path = str(tmp_path / "lease.json")
    data = os.urandom(1 << 23)  # 8 MiB: writing it takes long enough for a reader to look in the middle
    seen, done = [], threading.Event()

    def read():
        while not done.is_set():
            got = storage.read_bytes(path)
            if got is not None:
                seen.append(len(got))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(10):
            assert storage.create(path, data)
            assert not storage.create(path, b"second")
            time.sleep(0.01)  # the reader sees it whole
            os.unlink(path)
    finally:
        done.set()
        reader.join()
    assert seen and set(seen) == {len(data)}
    assert [p.name for p in tmp_path.iterdir()] == []  # no temporary left behind


def test_gcs_round_trip_listing_globs_and_download(tmp_path, gcs_bucket):
    bucket, client = gcs_bucket
    root = f"gs://{bucket}/ds"
    for name in ("train-0.ar", "train-1.ar", "test-0.ar", "sub/deeper.ar"):
        storage.write_bytes(f"{root}/{name}", name.encode())
    local = tmp_path / "big.bin"
    local.write_bytes(bytes(range(256)) * 40_000)  # 10 MB: a resumable upload
    storage.upload(str(local), f"{root}/big.bin")

    assert storage.list_sizes(root) == {"train-0.ar": 10, "train-1.ar": 10, "test-0.ar": 9,
                                        "big.bin": 10_240_000}
    assert storage.glob(f"{root}/train-*.ar") == [f"{root}/train-0.ar", f"{root}/train-1.ar"]
    assert storage.glob(f"{root}/*.ar") == [f"{root}/test-0.ar", f"{root}/train-0.ar", f"{root}/train-1.ar"]
    assert storage.glob(f"{root}/**.ar") == [f"{root}/sub/deeper.ar", f"{root}/test-0.ar", f"{root}/train-0.ar",
                                             f"{root}/train-1.ar"]
    assert storage.glob(f"{root}/train-?.ar") == [f"{root}/train-0.ar", f"{root}/train-1.ar"]
    assert storage.exists(f"{root}/test-0.ar") and not storage.exists(f"{root}/nothing")
    named = [storage.names_something(p) for p in (root, f"{root}/", f"{root}/sub", f"{root}/test-0.ar",
                                                  f"{root}/su", f"{root}/nothing", f"gs://{bucket}")]
    assert named == [True, True, True, True, False, False, True]  # a directory is a prefix; "su" is no directory
    assert storage.read_bytes(f"{root}/nothing") is None
    assert storage.download(f"{root}/big.bin", str(tmp_path / "copy.bin")) == 10_240_000
    assert (tmp_path / "copy.bin").read_bytes() == local.read_bytes()
    with pytest.raises(OSError, match=r"copied 9 bytes of gs://.*/ds/test-0.ar, expected 10"):
        storage.download(f"{root}/test-0.ar", str(tmp_path / "t.ar"), expected_size=10)
    assert not (tmp_path / "t.ar").exists() and [p.name for p in tmp_path.glob(".tmp-*")] == []
    storage.delete(f"{root}/test-0.ar")
    assert sorted(b.name for b in client.list_blobs(bucket)) == [
        "ds/big.bin", "ds/sub/deeper.ar", "ds/train-0.ar", "ds/train-1.ar"]


@pytest.mark.parametrize("status", [429, 500, 503])
def test_transient_errors_are_retried_with_backoff(faulty_gcs, status, caplog):
    bucket, front = faulty_gcs
    storage.write_text(f"gs://{bucket}/m.json", "manifest")
    front.fail_next(status, times=2, where="/m.json")

    with caplog.at_level(logging.WARNING, logger="dataset_format.storage"):
        assert storage.read_text(f"gs://{bucket}/m.json") == "manifest"

    assert [s for s, _ in front.failed] == [status, status]
    assert len([r for r in caplog.records if "retrying" in r.getMessage()]) == 1  # once a request and kind
    front.fail_next(status, times=2, where="/o?")  # a listing, too
    assert storage.list_sizes(f"gs://{bucket}") == {"m.json": 8}
    front.fail_next(503, times=1, where="uploadType")  # and an upload
    storage.write_text(f"gs://{bucket}/n.json", "again")
    assert storage.read_text(f"gs://{bucket}/n.json") == "again"


@pytest.mark.parametrize("fault", [503, 0])
def test_a_range_read_cut_off_or_refused_is_retried_and_exact(faulty_gcs, fault, caplog):
    """The loader's ranged reads (`read_range`): a 503, or an answer whose body stops halfway (the connection
    dropped), is retried, and the bytes returned are exactly the range's."""
    bucket, front = faulty_gcs
    data = bytes(range(256)) * 400
    storage.write_bytes(f"gs://{bucket}/shard", data)
    front.fail_next(fault, times=2, where="/shard?")
    with caplog.at_level(logging.WARNING, logger="dataset_format.storage"):
        assert storage.read_range(f"gs://{bucket}/shard", 1000, 90_000) == data[1000:90_000]
    assert [s for s, _ in front.failed] == [fault, fault]
    assert len([r for r in caplog.records if "retrying" in r.getMessage()]) == 1  # once a request and kind
    with pytest.raises(OSError, match="shorter than its index says"):
        storage.read_range(f"gs://{bucket}/shard", len(data) - 10, len(data) + 10)
    assert storage.read_range(f"gs://{bucket}/shard", len(data) + 5, len(data) + 10, exact=False) == b""


def test_a_range_past_the_end_answered_416_is_no_bytes(faulty_gcs):
    """Cloud Storage answers a range that starts past an object's end (any range of an empty object) with 416, where
    the emulator answers no bytes: the first 12 bytes of an empty TFRecord shard (a converter's sniff) are none."""
    bucket, front = faulty_gcs
    storage.write_bytes(f"gs://{bucket}/empty.tfrecord", b"")
    front.fail_next(416, where="/empty.tfrecord?")
    assert storage.read_range(f"gs://{bucket}/empty.tfrecord", 0, 12, exact=False) == b""
    assert [s for s, _ in front.failed] == [416]
    front.fail_next(416, where="/empty.tfrecord?")
    with pytest.raises(OSError, match="read 0 bytes at 0, expected 12"):
        storage.read_range(f"gs://{bucket}/empty.tfrecord", 0, 12)


def test_403_is_one_line_naming_bucket_and_object(faulty_gcs):
    bucket, front = faulty_gcs
    front.fail_next(403, where="m.json")
    with pytest.raises(PermissionError) as e:
        storage.read_text(f"gs://{bucket}/data/m.json")
    assert str(e.value).startswith(f"gs://{bucket}/data/m.json: permission denied (403) on bucket {bucket!r}, "
                                   "object 'data/m.json'; grant this account access")
    assert len(front.failed) == 1  # not retried


def test_a_missing_bucket_is_named_with_the_fix(gcs_emulator):
    path = "gs://no-such-bucket-here/ds/manifest.json"
    for call in (lambda: storage.read_text(path), lambda: storage.list_sizes("gs://no-such-bucket-here/ds"),
                 lambda: storage.glob("gs://no-such-bucket-here/ds/*.ar")):
        with pytest.raises(FileNotFoundError, match=r"bucket 'no-such-bucket-here' does not exist \(404\); check the "
                                                    r"bucket name, or create it \(gcloud storage buckets create"):
            call()


def test_other_schemes_are_refused_by_name():
    with pytest.raises(ValueError, match=r"'s3://b/x': only local paths and gs:// are supported"):
        storage.read_bytes("s3://b/x")


@pytest.mark.parametrize("path, bucket", [("gs://b/x", "b"), ("gs://My-Bucket/x", "My-Bucket"), ("gs://-a-/x", "-a-")])
def test_a_name_that_is_no_bucket_name_is_one_line(path, bucket):
    """Checked before any request (`verify` of gs://b/... ended in the client library's traceback)."""
    with pytest.raises(ValueError) as e:
        storage.exists(path)
    assert str(e.value) == (f"{path!r}: {bucket!r} is not a Cloud Storage bucket name (3-63 lower-case letters, "
                            "digits, '-', '_' and '.', beginning and ending with a letter or digit); check the path")
    assert storage.split_gcs("gs://my-bucket.example_1/a/b") == ("my-bucket.example_1", "a/b")


def test_no_credentials_is_one_line_naming_the_fix(tmp_path, monkeypatch, capsys):
    """google-auth's DefaultCredentialsError is no OSError: every command ended in its traceback."""
    from loader.cli import main
    from tests.pipelines.test_verify import _without_credentials

    _without_credentials(monkeypatch, tmp_path)
    with pytest.raises(PermissionError, match=r"^gs:// paths need Google Cloud credentials, and none were found: run "
                                              r"`gcloud auth application-default login`, or set "
                                              r"GOOGLE_APPLICATION_CREDENTIALS"):
        storage.list_sizes("gs://some-bucket/ds")
    assert main(["inspect", "gs://some-bucket/ds"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: gs:// paths need Google Cloud "
                                                                       "credentials")
