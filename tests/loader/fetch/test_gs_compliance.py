"""The loader's gs:// reads (loader/fetch/remote.py: aiohttp's client, the loader's bounds and host limits) against real
servers that answer as servers do: the stock GCS emulator (HTTP/1.0), and a Cloud Storage media endpoint
with one quirk each, plain or behind a real forward proxy over TLS. Every case: the exact bytes, or one error naming
the object, the range and the cause; within a bounded time; at most one log line per object and cause."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dataset_format import storage
from loader.fetch import remote
from tests.conftest import REPO

DATA = os.urandom(300_000)
RANGES = [(i * 997, i * 997 + 1500) for i in range(200)]  # overlapping, unaligned: 200 requests in flight


class QuirkyGCS:
    """A Cloud Storage media endpoint (`GET /download/storage/v1/b/B/o/NAME?alt=media` with a Range) on 127.0.0.1 that
    serves DATA under any name, with `quirk`:

    close-some   every second answer says `Connection: close` and closes its connection
    idle-close   a connection idle for 0.2 s is closed by the server
    chunked      answers with `Transfer-Encoding: chunked`
    429, 503     the first `times` answers are that status with `Retry-After: 1`
    ignore-range every answer is a 200 with the whole object
    huge-200     every answer is a 200 with a 64 MB object (DATA, then zeros)
    long-206     every answer is a 206 one byte longer than its range
    short        the first `times` answers send half their body and close (times=-1: every answer)
    short-close  likewise, with no Content-Length: a body read to the connection's close (HTTP/1.0, some proxies)
    wrong-range  the first `times` answers are a 206 whose Content-Range starts 7 bytes late (times=-1: every one)

    HTTP/1.1 with keep-alive; over TLS with `tls=(cert, key)`."""

    def __init__(self, quirk: str = "", times: int = 0, tls: tuple[str, str] | None = None):
        self.quirk, self.left, self.tls = quirk, times, tls
        self.answers = self.connections = self.sent_mb = 0
        self.lock = threading.Lock()

    def __enter__(self):
        started = threading.Event()

        def run():
            self.loop = asyncio.new_event_loop()
            context = None
            if self.tls:
                import ssl

                context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                context.load_cert_chain(*self.tls)
            self.server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=context))
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        started.wait(10)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self._shut(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _shut(self):
        self.server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _fault(self) -> bool:
        """Whether this answer is one of the first `times` (or every one, times=-1)."""
        with self.lock:
            self.answers += 1
            if self.left == -1:
                return True
            if self.left > 0:
                self.left -= 1
                return True
            return False

    async def _serve(self, reader, writer):
        self.connections += 1
        try:
            while True:
                try:
                    timeout = 0.2 if self.quirk == "idle-close" else None
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
                except (asyncio.TimeoutError, asyncio.IncompleteReadError):
                    return
                first, last = map(int, re.search(rb"Range: bytes=(\d+)-(\d+)", head).groups())
                body = DATA[first:last + 1]
                close = False
                fault = self._fault() if self.quirk in ("429", "503", "short", "short-close", "wrong-range") else False
                if self.quirk in ("429", "503") and fault:
                    writer.write(f"HTTP/1.1 {self.quirk} X\r\nRetry-After: 1\r\nContent-Length: 4\r\n\r\nbusy".encode())
                elif self.quirk == "ignore-range":
                    writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: {len(DATA)}\r\n\r\n".encode() + DATA)
                elif self.quirk == "huge-200":
                    writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: {64 << 20}\r\n\r\n".encode() + DATA)
                    for _ in range(((64 << 20) - len(DATA)) // (1 << 20)):  # as long as the client reads
                        writer.write(bytes(1 << 20))
                        await writer.drain()
                        self.sent_mb += 1
                    writer.write(bytes((64 << 20) - len(DATA) - ((64 << 20) - len(DATA)) // (1 << 20) * (1 << 20)))
                elif self.quirk == "long-206":
                    body = DATA[first:last + 2]
                    writer.write(f"HTTP/1.1 206 X\r\nContent-Range: bytes {first}-{first + len(body) - 1}/{len(DATA)}"
                                 f"\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
                elif self.quirk == "short-close":
                    writer.write(f"HTTP/1.1 206 X\r\nContent-Range: bytes {first}-{last}/{len(DATA)}\r\nConnection: "
                                 "close\r\n\r\n".encode() + (body[:len(body) // 2] if fault else body))
                    close = True
                elif self.quirk == "chunked":
                    writer.write(f"HTTP/1.1 206 X\r\nContent-Range: bytes {first}-{first + len(body) - 1}/{len(DATA)}\r\n"
                                 f"Transfer-Encoding: chunked\r\n\r\n{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
                else:
                    shift = 7 if self.quirk == "wrong-range" and fault else 0
                    close = self.quirk == "short" and fault
                    if self.quirk == "close-some":
                        with self.lock:
                            self.answers += 1
                            close = self.answers % 2 == 0
                    head_out = (f"HTTP/1.1 206 X\r\nContent-Range: bytes {first + shift}-{first + shift + len(body) - 1}/"
                                f"{len(DATA)}\r\nContent-Length: {len(body)}\r\n" + ("Connection: close\r\n" if close else "")
                                + "\r\n").encode()
                    writer.write(head_out + (body[:len(body) // 2] if self.quirk == "short" and fault else body))
                await writer.drain()
                if close:
                    return
        except ConnectionError:
            pass
        finally:
            writer.close()


@pytest.fixture
def endpoint(gcs_emulator, monkeypatch):
    """Points this process's gs:// reads at a server: endpoint(url) -> a fresh object path there. Retries give up
    after 4 s (not 120), so an answer that never comes right ends the test in a bounded time."""
    monkeypatch.setattr(storage, "RETRY_SECONDS", 4.0)

    def point(url: str) -> str:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
        return f"gs://bucket-{time.monotonic_ns()}/shard-00000"
    return point


def _read(path: str, caplog, ranges=RANGES) -> tuple[list[bytes], float, list[str]]:
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="loader.fetch.remote"):
        got = remote.fetch([(path, s, e) for s, e in ranges])
    return got, time.monotonic() - started, [r.getMessage() for r in caplog.records if r.name == "loader.fetch.remote"]


@pytest.mark.gcs
def test_the_stock_emulator(tmp_path_factory, caplog):
    """HTTP/1.0 answers without keep-alive (a connection a request), one connection served at a time, an accept
    queue of 5."""
    from google.cloud import storage as gcs

    from tests import emulator

    with emulator.running(tmp_path_factory.mktemp("stock"), stock=True):
        client = gcs.Client(project="test")
        bucket = f"stock-{time.monotonic_ns()}"
        client.create_bucket(bucket)
        client.bucket(bucket).blob("shard").upload_from_string(DATA)
        got, took, lines = _read(f"gs://{bucket}/shard", caplog)
    assert got == [DATA[s:e] for s, e in RANGES] and took < 20 and lines == [], (took, lines)


@pytest.mark.gcs
@pytest.mark.parametrize("quirk", ["close-some", "idle-close", "ignore-range", "huge-200"])
def test_answers_that_need_no_retry(endpoint, caplog, quirk):
    ranges = RANGES[:8] if quirk == "huge-200" else RANGES
    with QuirkyGCS(quirk) as server:
        path = endpoint(server.url)
        got, took, lines = _read(path, caplog, ranges)
        if quirk == "idle-close":  # the pool's idle connections are closed by now: reopened once each, not retried
            time.sleep(0.5)
            again, _, lines = _read(path, caplog, RANGES[:20])
            assert again == [DATA[s:e] for s, e in RANGES[:20]]
    assert got == [DATA[s:e] for s, e in ranges] and took < 10 and lines == [], (took, lines)
    if quirk == "huge-200":  # each answer read only as far as its range, then its connection dropped
        assert server.sent_mb < 8 * 32, server.sent_mb


@pytest.mark.gcs
def test_chunked_answers(endpoint, caplog):
    with QuirkyGCS("chunked") as server:
        got, took, lines = _read(endpoint(server.url), caplog)
    assert got == [DATA[s:e] for s, e in RANGES] and took < 10 and lines == [], (took, lines)


@pytest.mark.gcs
@pytest.mark.parametrize("quirk, cause", [("429", "HTTP 429"), ("503", "HTTP 503"), ("short", "ClientPayloadError"),
                                          ("short-close", "ProtocolError"), ("wrong-range", "ProtocolError")])
def test_transient_faults_are_retried_with_one_line(endpoint, caplog, quirk, cause):
    with QuirkyGCS(quirk, times=30) as server:
        path = endpoint(server.url)
        got, took, lines = _read(path, caplog)
    assert got == [DATA[s:e] for s, e in RANGES]
    assert len(lines) == 1 and f"{path}: {cause}" in lines[0] and "retrying" in lines[0], lines
    if quirk in ("429", "503"):  # Retry-After: 1 is honoured (the first backoff would be 0.25 s)
        assert 1.0 <= took < 10
    else:
        assert took < 10


@pytest.mark.gcs
@pytest.mark.parametrize("quirk, cause", [("short", r"ClientPayloadError: Response payload is not completed: .*"
                                                    r"received 750 of 1500 bytes"),
                                          ("wrong-range", r"ProtocolError: a 206 with Content-Range 'bytes 7-1506/300000' "
                                                          r"to a range that starts at byte 0"),
                                          ("long-206", r"ProtocolError: a 206 of 1501 bytes to a range of 1500")])
def test_a_fault_that_never_clears_is_one_error_naming_the_object_the_range_and_the_cause(endpoint, caplog, quirk,
                                                                                         cause):
    with QuirkyGCS(quirk, times=-1) as server:
        path = endpoint(server.url)
        started = time.monotonic()
        with pytest.raises(OSError, match=re.escape(path) + r": reading bytes 0-1499 failed for 4 s \(" + cause):
            with caplog.at_level(logging.INFO, logger="loader.fetch.remote"):
                remote.fetch([(path, 0, 1500)])
    lines = [r.getMessage() for r in caplog.records if r.name == "loader.fetch.remote"]
    assert time.monotonic() - started < 10 and len(lines) == 1, lines


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and its key."""
    d = tmp_path_factory.mktemp("tls")
    cert, key = str(d / "cert.pem"), str(d / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days",
                    "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"], check=True,
                   capture_output=True)
    return cert, key


@pytest.fixture
def forward_proxy(tmp_path):
    """proxy.py, a real forward proxy, on 127.0.0.1: (its URL, its log file)."""
    from tests.emulator import free_port

    port, log = free_port(), tmp_path / "proxy.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "proxy", "--hostname", "127.0.0.1", "--port", str(port),
                                 "--num-workers", "1", "--num-acceptors", "1"], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}", log
    finally:
        proc.terminate()
        proc.wait(10)


_FETCH = """
import hashlib, logging, sys
logging.basicConfig(level=logging.INFO)
from loader.fetch import remote
ranges = [(i * 997, i * 997 + 1500) for i in range(200)]
got = remote.fetch([(sys.argv[1], s, e) for s, e in ranges])
print(hashlib.sha256(b"".join(got)).hexdigest())
"""


@pytest.mark.gcs
def test_through_a_forward_proxy_named_by_https_proxy(gcs_emulator, tls, forward_proxy):
    """In a fresh process, as a user runs it: the environment names the proxy and the CA to trust before anything
    makes a TLS context."""
    import hashlib

    proxy, log = forward_proxy
    with QuirkyGCS(tls=tls) as server:
        env = {**os.environ, **gcs_emulator, "STORAGE_EMULATOR_HOST": server.url, "HTTPS_PROXY": proxy,
               "SSL_CERT_FILE": tls[0], "PYTHONPATH": str(REPO)}
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", _FETCH, f"gs://bucket-{time.monotonic_ns()}/shard-00000"],
                              env=env, capture_output=True, text=True, timeout=60)
        took = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == hashlib.sha256(b"".join(DATA[s:e] for s, e in RANGES)).hexdigest()
    assert "loader.fetch.remote" not in proc.stderr and took < 30, (took, proc.stderr[-2000:])  # nothing retried
    port = server.url.rsplit(":", 1)[1]
    assert re.search(rf"CONNECT 127\.0\.0\.1:{port}", Path(log).read_text()), Path(log).read_text()[-2000:]
    assert server.connections >= 1
