"""The shaped link the gs:// benchmarks read through (tests/shaped_link.py): ranges answered right, each answer held
its latency, and the bandwidth shared among answers and never exceeded by more than the token bucket's depth."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parent / "shaped_link.py"


@pytest.fixture
def link():
    # no emulator behind it: only the objects it is given are read, and nothing is forwarded
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "http://127.0.0.1:9"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        yield f"http://127.0.0.1:{int(proc.stdout.readline())}"
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def _call(url: str, what: str, payload: dict | None = None) -> dict:
    data = None if payload is None else json.dumps(payload).encode()
    with urllib.request.urlopen(urllib.request.Request(f"{url}/__link/{what}", data=data), timeout=30) as answer:
        return json.loads(answer.read())


def _get(url: str, byte_range: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(f"{url}/download/storage/v1/b/bench/o/data%2Fobject?alt=media",
                                     headers={"Range": byte_range} if byte_range else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as e:
        return e.code, b""


def test_the_link_answers_ranges_of_its_objects(link, tmp_path):
    data = np.random.default_rng(0).bytes(100_000)
    (tmp_path / "object").write_bytes(data)
    _call(link, "config", {"files": {"bench/data/object": str(tmp_path / "object")}})
    assert _get(link) == (200, data)
    assert _get(link, "bytes=10-19") == (206, data[10:20])
    assert _get(link, "bytes=99990-") == (206, data[99990:])
    assert _get(link, "bytes=-5") == (206, data[-5:])
    assert _get(link, "bytes=99995-200000") == (206, data[99995:])
    assert _get(link, "bytes=100000-") == (416, b"")
    stats = _call(link, "stats")
    assert (stats["gets"], stats["bytes_out"]) == (6, 100_000 + 10 + 10 + 5 + 5)


def test_answers_share_the_bandwidth_and_wait_out_the_latency(link, tmp_path):
    size, parts, bandwidth, latency = 4_000_000, 4, 20e6, 0.05
    data = np.random.default_rng(1).bytes(size)
    (tmp_path / "object").write_bytes(data)
    _call(link, "config", {"files": {"bench/data/object": str(tmp_path / "object")}, "latency": latency,
                           "bandwidth": bandwidth})
    part = size // parts
    got: dict[int, bytes] = {}

    def read(i: int) -> None:
        got[i] = _get(link, f"bytes={i * part}-{(i + 1) * part - 1}")[1]

    started = time.monotonic()
    threads = [threading.Thread(target=read, args=(i,)) for i in range(parts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.monotonic() - started
    assert b"".join(got[i] for i in range(parts)) == data
    # 4 MB at 20 MB/s: 0.2 s less the bucket's 5 ms, after the 50 ms every answer waits first
    assert seconds >= latency + size / bandwidth - 0.005 - 0.01
    assert seconds < 5  # generous: a loaded host is slow, but a link that stalls is a failure
    assert _call(link, "stats")["bytes_out"] == size
