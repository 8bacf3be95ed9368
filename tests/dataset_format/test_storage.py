"""dataset_format.storage on local disk and on gs:// (the GCS emulator), with faults injected in front of it.

`faulty_gcs` is a small HTTP front on 127.0.0.1 that forwards to the emulator and answers the next requests whose
path contains a given text with a given status instead: the real google-cloud-storage client, its real retries.
"""

from __future__ import annotations

import http.client
import http.server
import logging
import threading
import urllib.parse

import pytest

from dataset_format import storage


class _Front(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, upstream: str):
        super().__init__(("127.0.0.1", 0), _Forward)
        self.upstream = urllib.parse.urlsplit(upstream)
        self.faults: list[tuple[str, int]] = []  # (text in the path, status), consumed in order
        self.failed: list[tuple[int, str]] = []
        self.lock = threading.Lock()

    def fail_next(self, status: int, times: int = 1, where: str = "") -> None:
        with self.lock:
            self.faults += [(where, status)] * times


class _Forward(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _handle(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        server: _Front = self.server
        with server.lock:
            fault = next((f for f in server.faults if f[0] in self.path), None)
            if fault:
                server.faults.remove(fault)
                server.failed.append((fault[1], f"{self.command} {self.path}"))
        if fault:
            payload = b'{"error": {"code": %d, "message": "injected"}}' % fault[1]
            self.send_response(fault[1])
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        conn = http.client.HTTPConnection(server.upstream.hostname, server.upstream.port, timeout=30)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
        conn.request(self.command, self.path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
        self.send_response(response.status)
        for key, value in response.getheaders():
            if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        conn.close()

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _handle


@pytest.fixture
def faulty_gcs(gcs_bucket, gcs_emulator, monkeypatch):
    """(bucket, front): the bucket reached through a front that injects statuses on demand."""
    bucket, _ = gcs_bucket
    front = _Front(gcs_emulator["STORAGE_EMULATOR_HOST"])
    thread = threading.Thread(target=front.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{front.server_address[1]}")
    yield bucket, front
    front.shutdown()
    front.server_close()


def test_local_round_trip_listing_and_globs(tmp_path):
    d = str(tmp_path / "data")
    storage.write_text(storage.join(d, "a.json"), "{}")
    storage.write_bytes(storage.join(d, "sub/b.bin"), b"xyz")
    assert storage.read_text(storage.join(d, "a.json")) == "{}"
    assert storage.read_bytes(storage.join(d, "missing")) is None
    assert storage.list_sizes(d) == {"a.json": 2}
    assert storage.list_sizes(str(tmp_path / "nothing")) == {}
    assert storage.glob(str(tmp_path / "data" / "*")) == [storage.join(d, "a.json"), storage.join(d, "sub")]
    assert [p.name for p in tmp_path.rglob(".tmp-*")] == []


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
    assert len([r for r in caplog.records if "retrying" in r.getMessage()]) == 2
    front.fail_next(status, times=2, where="/o?")  # a listing, too
    assert storage.list_sizes(f"gs://{bucket}") == {"m.json": 8}
    front.fail_next(503, times=1, where="uploadType")  # and an upload
    storage.write_text(f"gs://{bucket}/n.json", "again")
    assert storage.read_text(f"gs://{bucket}/n.json") == "again"


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
