"""loader/http1.py: range GETs against a server that answers what each test scripts, hostile answers included: each
is the exact bytes asked for or a clear error, within the timeout, never more than the bounds hold."""

from __future__ import annotations

import asyncio
import http.server
import random
import threading
import time

import pytest

from loader import http1, remote

DATA = bytes(range(256)) * 64  # the object: 16 KiB


def _answer(status: int, body: bytes, *headers: str) -> bytes:
    lines = [f"HTTP/1.1 {status} X", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _range(start: int, end: int) -> bytes:
    return _answer(206, DATA[start:end], f"Content-Length: {end - start}", f"Content-Range: bytes {start}-{end - 1}/"
                   f"{len(DATA)}")


class Server:
    """Answers each request with the next of `answers` (bytes, or a function of the request's head), then closes the
    connection when `close` is set; counts connections and requests."""

    def __init__(self, answers, close: bool = False):
        self.answers, self.close, self.connections, self.requests = list(answers), close, 0, []

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/b/o?alt=media"
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def _serve(self, reader, writer):
        self.connections += 1
        try:
            while self.answers:
                head = await reader.readuntil(b"\r\n\r\n")
                self.requests.append(head.decode())
                answer = self.answers.pop(0)
                writer.write(answer(head) if callable(answer) else answer)
                await writer.drain()
                if self.close:
                    break
            else:
                await reader.read()  # hold the connection until the client goes
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def _get(answers, start=100, end=1100, close=False, timeout=5.0, times=1):
    async def main():
        async with Server(answers, close) as server:
            pool = http1.Pool(timeout=timeout)
            try:
                results = [(await pool.get(server.url, start, end, {"Authorization": "Bearer t"}))[:2]
                           for _ in range(times)]
            finally:
                pool.close()
            return results, server
    return asyncio.run(asyncio.wait_for(main(), 30))


def test_ranges_come_back_exact_over_one_kept_connection():
    (first, second), server = _get([_range(100, 1100), _range(100, 1100)], times=2)
    assert first == second == (206, [DATA[100:1100]])
    assert server.connections == 1
    assert server.requests[0].startswith("GET /b/o?alt=media HTTP/1.1\r\n")
    assert "Range: bytes=100-1099\r\n" in server.requests[0] and "Authorization: Bearer t\r\n" in server.requests[0]


def test_a_shorter_object_an_empty_answer_and_a_whole_object_cut_to_the_range():
    [(status, pieces)], _ = _get([_range(100, 500)])  # the object ends sooner
    assert (status, b"".join(pieces)) == (206, DATA[100:500])
    [(status, pieces)], _ = _get([_answer(416, b"", "Content-Length: 0")])
    assert (status, pieces) == (416, [])
    big = DATA * 300  # ~5 MB: a server that ignores the range is read only as far as the range, then hung up on
    [(status, pieces)], server = _get([_answer(200, big, f"Content-Length: {len(big)}")], 70_000, 70_100)
    assert (status, b"".join(pieces)) == (200, big[70_000:70_100])
    [(status, pieces)], _ = _get([_answer(200, DATA, f"Content-Length: {len(DATA)}")], len(DATA) + 5, len(DATA) + 9)
    assert (status, pieces) == (200, [])


def test_retry_after_in_seconds_is_read_and_anything_else_ignored():
    async def main(*headers):
        async with Server([_answer(503, b"busy", "Content-Length: 4", *headers)]) as server:
            pool = http1.Pool(timeout=5)
            try:
                return await pool.get(server.url, 0, 10, {})
            finally:
                pool.close()
    assert asyncio.run(main("Retry-After: 7")) == (503, [b"busy"], 7.0)
    for header in ("Retry-After: Wed, 21 Oct 2026 07:28:00 GMT", "Retry-After: -1", "Retry-After: 9999999999"):
        assert asyncio.run(main(header)).retry_after is None


def test_an_error_body_is_kept_to_its_bound():
    [(status, pieces)], _ = _get([_answer(503, b"x" * (1 << 20), f"Content-Length: {1 << 20}")])
    assert status == 503 and len(b"".join(pieces)) == http1.MAX_ERROR_BODY
    [(status, pieces)], _ = _get([_answer(404, b'{"error": 404}', "Content-Length: 14")])
    assert (status, b"".join(pieces)) == (404, b'{"error": 404}')


@pytest.mark.parametrize("answer, words", [
    (_answer(206, DATA[100:1101], "Content-Length: 1001", "Content-Range: bytes 100-1100/16384"), "a 206 of 1001"),
    (_answer(206, DATA[0:1000], "Content-Length: 1000", "Content-Range: bytes 0-999/16384"), "starts at byte 100"),
    (_answer(206, DATA[100:1100], "Content-Length: 1000"), "Content-Range None"),
    (_answer(206, b"", "Content-Length: -5"), "bad Content-Length"),
    (_answer(206, b"", "Content-Length: 99999999999999999999"), "bad Content-Length"),
    (_answer(206, b"", "Content-Length: 10", "Content-Length: 11"), "bad Content-Length"),
    (_answer(206, b"", "Content-Length: 1e3"), "bad Content-Length"),
    (_range(100, 1100) + b"extra", "past the end"),
    (_answer(416, b"", "Content-Length: 0") + b"HTTP/1.1 200", "past the end"),
    (b"SMTP ready\r\n\r\n", "not an HTTP/1.1 status line"),
    (b"HTTP/1.1 2000 X\r\n\r\n", "not an HTTP/1.1 status line"),
    (_answer(100, b""), "informational"),
    (_answer(206, b"", " Content-Length: 3"), "without a name"),
    (_answer(206, b"", "no colon here"), "without a name"),
    (b"HTTP/1.1 206 X\r\n" + b"X-Pad: " + b"a" * (http1.MAX_HEAD + 10) + b"\r\n\r\n", "head longer than"),
    (b"HTTP/1.1 206 X\r\n" + b"X-Pad: a\r\n" * 20_000, "head longer than"),
])
def test_a_hostile_answer_is_a_protocol_error(answer, words):
    with pytest.raises(http1.ProtocolError, match=words):
        _get([answer])


@pytest.mark.parametrize("answer", [
    _answer(206, b"3e8\r\n", "Transfer-Encoding: chunked"),
    _answer(206, DATA[100:1100], "Content-Range: bytes 100-1099/16384"),  # framed by the close
])
def test_answers_framed_otherwise_are_unsupported(answer):
    with pytest.raises(http1.Unsupported):
        _get([answer])


def test_a_body_cut_short_and_a_server_that_never_answers_are_errors():
    with pytest.raises(http1.ProtocolError, match="bytes of the body still to come"):
        _get([_range(100, 1100)[:-10]], close=True)
    with pytest.raises(http1.ProtocolError, match="in the middle of the answer's head"):
        _get([b"HTTP/1.1 206 X\r\nContent-Le"], close=True)
    with pytest.raises(TimeoutError, match="no complete answer in 0.3 s"):
        _get([lambda head: b""], timeout=0.3)


def test_a_kept_connection_the_server_closed_is_opened_again_once():
    (first, second), server = _get([_range(100, 1100), _range(100, 1100)], close=True, times=2)
    assert first == second == (206, [DATA[100:1100]]) and server.connections == 2

    async def main():  # the pool holds only the connection in use
        async with Server([_range(100, 1100)] * 5, close=True) as server:
            pool = http1.Pool(timeout=5)
            for _ in range(5):
                assert (await pool.get(server.url, 100, 1100, {}))[:2] == (206, [DATA[100:1100]])
            assert len(pool._open) == 1 and server.connections == 5
            pool.close()
    asyncio.run(asyncio.wait_for(main(), 30))
    with pytest.raises(ConnectionResetError, match="closed the connection before answering"):
        _get([lambda head: b""], close=True)  # a new connection closed unanswered is not asked again


def test_header_values_with_line_breaks_are_refused():
    async def main():
        with pytest.raises(ValueError, match="line break"):
            await http1.Pool().get("http://127.0.0.1:9/o", 0, 1, {"Authorization": "a\r\nX-Evil: 1"})
    asyncio.run(main())


def test_damaged_heads_and_cut_answers_give_the_exact_bytes_or_an_error():
    """300 answers whose head is damaged (bytes changed, cut, repeated) and whose body may be cut short: each read
    gives exactly the range (framing holds: the body is never misread) or raises one of the client's errors, within
    its timeout. (A changed body byte is for riegeli's hashes to find, not HTTP.)"""
    good = _range(100, 1100)
    head_end = good.index(b"\r\n\r\n") + 4
    rng = random.Random(0)
    outcomes = {"exact": 0, "error": 0}
    for _ in range(300):
        head = bytearray(good[:head_end])
        for _ in range(rng.randint(0, 3)):
            kind, at = rng.randrange(3), rng.randrange(len(head))
            if kind == 0:
                head[at] = rng.randrange(256)
            elif kind == 1:
                del head[at:at + rng.randint(1, 20)]
            else:
                head[at:at] = head[max(0, at - 20):at]
        body = good[head_end:]
        if rng.random() < 0.3:
            body = body[:rng.randrange(len(body))]
        try:
            [(status, pieces)], _ = _get([bytes(head) + body], close=True, timeout=1.0)
        except (http1.ProtocolError, http1.Unsupported, ConnectionError, TimeoutError):
            outcomes["error"] += 1
            continue
        got = b"".join(pieces)
        if status == 206:
            assert got == DATA[100:1100]
            outcomes["exact"] += 1
        else:  # a status the damage changed: the caller decides on it; the body is within its bounds
            assert len(got) <= 1000
            outcomes["error"] += 1
    assert outcomes["error"] > 50 and outcomes["exact"] > 50, outcomes


def test_the_loader_reads_a_chunked_answer_through_aiohttp(gcs_emulator):
    """An answer http1 does not read is asked again through aiohttp's session, transparently, and the endpoint's
    later requests go to aiohttp at once."""
    chunked = (b"HTTP/1.1 206 X\r\nTransfer-Encoding: chunked\r\nContent-Range: bytes 100-1099/16384\r\n\r\n"
               + b"%x\r\n" % 1000 + DATA[100:1100] + b"\r\n0\r\n\r\n")

    async def serve():
        async with Server([chunked, chunked, chunked], close=True) as server:
            loop = remote._Loop()
            got = await asyncio.to_thread(loop.run, [(server.url, "gs://b/o", 100, 1100)])
            asked = len(server.requests)
            got += await asyncio.to_thread(loop.run, [(server.url, "gs://b/o", 100, 1100)])
            return got, server, asked
    got, server, asked = asyncio.run(asyncio.wait_for(serve(), 60))
    assert [bytes(body) for body in got] == [DATA[100:1100]] * 2
    assert asked == 2 and "aiohttp" not in server.requests[0] and "aiohttp" in server.requests[1]
    assert len(server.requests) == 3 and "aiohttp" in server.requests[2]  # the endpoint's next request: aiohttp's


@pytest.mark.parametrize("first_line, headers, connections", [
    ("HTTP/1.0 206 X", [], 3),  # HTTP/1.0 without keep-alive: a connection a request
    ("HTTP/1.1 206 X", ["Connection: close"], 3),
    ("HTTP/1.0 206 X", ["Connection: keep-alive"], 1),
    ("HTTP/1.1 206 X", [], 1),
])
def test_a_connection_is_kept_only_as_rfc_9112_allows(first_line, headers, connections):
    answer = ("\r\n".join([first_line, "Content-Length: 1000", "Content-Range: bytes 100-1099/16384", *headers])
              + "\r\n\r\n").encode() + DATA[100:1100]
    results, server = _get([answer] * 3, times=3)  # the server keeps every connection open: the client decides
    assert results == [(206, [DATA[100:1100]])] * 3
    assert server.connections == connections


class _SmallServer(http.server.HTTPServer):
    """Python's own HTTP/1.0 server as the stock GCS emulator runs it: one connection at a time, an accept queue of
    5, every connection closed after its answer; it counts the connections open at once."""

    request_queue_size = 5

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Ranges)
        self.open = self.most_open = 0


class _Ranges(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        first, last = map(int, self.headers["Range"].removeprefix("bytes=").split("-"))
        body = DATA[first:last + 1]
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {first}-{first + len(body) - 1}/{len(DATA)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_a_server_that_closes_every_connection_is_not_flooded_with_new_ones():
    """128 requests in flight to a one-connection-at-a-time HTTP/1.0 server: opened all at once, most connections
    waited past its accept queue (SYNs dropped, resent after 1, 3, 7 ... s) and timed out or were reset."""
    server = _SmallServer()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/b/o?alt=media"
    ranges = [(i * 50, i * 50 + 100) for i in range(256)]

    async def main():
        pool = http1.Pool(timeout=20, max_connections=128)
        try:
            got = [a[:2] for a in await asyncio.gather(*[pool.get(url, start, end, {}) for start, end in ranges])]
            return got, pool._hosts[("http", "127.0.0.1", server.server_address[1])].limit
        finally:
            pool.close()
    try:
        started = time.monotonic()
        got, limit = asyncio.run(asyncio.wait_for(main(), 60))
        took = time.monotonic() - started
    finally:
        server.shutdown()
        server.server_close()
    assert got == [(206, [DATA[start:end]]) for start, end in ranges]
    assert limit <= http1.CLOSING_CONNECTIONS and took < 15, (limit, took)


def test_a_hosts_limit_grows_with_kept_connections_and_halves_when_a_new_one_fails():
    host = http1._Host(128)
    assert host.limit == http1.START_CONNECTIONS == 16
    seen = []
    for _ in range(16 + 32 + 64 + 10):
        host.answered(kept=True)
        seen.append(host.limit)
    assert [seen[15], seen[16 + 31], seen[16 + 32 + 63], seen[-1]] == [32, 64, 128, 128]
    host.refused()
    host.refused()
    assert host.limit == 32
    host.answered(kept=False)  # its answers close their connections: at most CLOSING_CONNECTIONS, and no growth
    for _ in range(100):
        host.answered(kept=True)
    assert host.limit == http1.CLOSING_CONNECTIONS
    for _ in range(10):
        host.refused()
    assert host.limit == 1
