"""Range GETs over HTTP/1.1 keep-alive connections, on asyncio's transports: the loader's gs:// requests.

aiohttp's client session runs its URL, header, cookie, tracing and timeout machinery on every request (~0.2 ms of
CPU); here the reader's whole process spends ~0.09 ms a request on 1 KB records, half what it spent through aiohttp
(benchmarks/gcs_read_bench.py, 2 cores). Only what a media download needs is
spoken: `GET` with a `Range`, answers framed by `Content-Length`, connections kept open between requests (HTTP or
HTTPS). An answer framed otherwise (chunked, or until the connection closes) is `Unsupported`, and loader/remote.py
asks aiohttp for it instead.

Everything in an answer is untrusted and bounded before use: the head is at most MAX_HEAD bytes and must parse; the
body is at most what was asked for (a 206 longer than its range, a `Content-Length` that is not a plain number, or
bytes past the body are a `ProtocolError`); a 200 (the server ignored the range) is cut to the range as it streams
and its connection closed, never held whole; an error's body is kept to MAX_ERROR_BODY bytes. A request that takes
longer than its timeout is a `TimeoutError`. A connection that was idle and is found closed when reused is opened
again once, at once (the server may close idle connections at any time).

A connection is kept for the next request only as RFC 9112 (section 9.3) allows: not after an HTTP/1.0 answer without
`Connection: keep-alive`, nor after `Connection: close`. Requests to one host take at most its limit of
connections at once, which starts at START_CONNECTIONS and doubles with each round of answers on connections kept
open, up to the pool's `max_connections`; a host whose answers close their connections (an HTTP/1.0 server: every
request is a new connection) is held to CLOSING_CONNECTIONS, and a new connection that fails before its answer (a
server whose accept queue is full resets, or never completes, the connections past it) halves the limit. So a small
server is not flooded with new connections, and Cloud Storage gets the pool's `max_connections` within a few
round trips.

    pool = Pool()
    status, pieces = await pool.get("https://host/path?alt=media", 0, 1024, {"Authorization": "Bearer ..."})
"""

from __future__ import annotations

import asyncio
import collections
import functools
import ssl
import urllib.parse
from typing import NamedTuple

MAX_HEAD = 64 << 10  # bytes of status line and headers
START_CONNECTIONS = 16  # a host's limit of connections at first
CLOSING_CONNECTIONS = 16  # ... and at most, for a host whose answers close their connections
MAX_ERROR_BODY = 64 << 10  # bytes of an error's body kept (for its message); the rest is not read
_USER_AGENT = "arrayrecord-platform-loader"


class ProtocolError(ConnectionError):
    """An answer that is not valid HTTP/1.1 or not what was asked for (a transient fault: the request is retried)."""


class Answer(NamedTuple):
    status: int
    pieces: list[bytes]
    retry_after: float | None = None  # seconds, from a Retry-After header of delay-seconds


class Unsupported(Exception):
    """An answer framed in a way this client does not read (chunked, or until close): ask another client."""


@functools.lru_cache(maxsize=256)
def _split(url: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, request target) of an http(s) URL."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r}: not an http(s) URL")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if any(c in target for c in "\r\n \t"):
        raise ValueError(f"{url!r}: a request target with spaces or line breaks")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.scheme, parts.hostname, port, target


class _Host:
    """A host's limit of connections at once (see the module doc), and the requests waiting for one. A waiter that is
    woken has its place taken for it."""

    def __init__(self, most: int):
        self.most = most
        self.limit = min(START_CONNECTIONS, most)
        self.busy = 0
        self.kept = 0  # answers on kept connections since the limit last grew
        self.closing = False  # its answers close their connections
        self.waiting: collections.deque[asyncio.Future] = collections.deque()

    async def enter(self) -> None:
        if self.busy < self.limit and not self.waiting:
            self.busy += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self.waiting.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():  # woken, then cancelled: give the place on
                self.leave()
            elif waiter in self.waiting:
                self.waiting.remove(waiter)
            raise

    def leave(self) -> None:
        self.busy -= 1
        self._wake()

    def _wake(self) -> None:
        while self.waiting and self.busy < self.limit:
            waiter = self.waiting.popleft()
            if not waiter.done():
                self.busy += 1
                waiter.set_result(None)

    def answered(self, kept: bool) -> None:
        if not kept:
            self.closing = True
            self.limit = min(self.limit, CLOSING_CONNECTIONS)
        elif not self.closing and self.limit < self.most:
            self.kept += 1
            if self.kept >= self.limit:
                self.limit, self.kept = min(self.most, 2 * self.limit), 0
                self._wake()

    def refused(self) -> None:
        """A new connection failed before its answer: fewer at once."""
        self.limit, self.kept = max(1, self.limit // 2), 0


class Pool:
    """Keep-alive connections to each (scheme, host, port), each carrying one request at a time; as many are opened
    as requests are in flight together, up to the host's limit (see the module doc). Used from one event loop."""

    def __init__(self, timeout: float = 120.0, max_connections: int = 128):
        self.timeout = timeout
        self.max_connections = max_connections
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._hosts: dict[tuple[str, str, int], _Host] = {}
        self._ssl: ssl.SSLContext | None = None

    async def get(self, url: str, start: int, end: int, headers: dict[str, str]) -> Answer:
        """GET bytes [start, end) (start < end) of `url`: (status, the body's pieces, Retry-After). 206: the range,
        or fewer bytes where the object ends sooner; 200: the server sent the whole object, cut here to the range;
        any other status: up to MAX_ERROR_BODY bytes of its body, and the seconds its Retry-After asks for (None:
        none, or not a number of seconds)."""
        scheme, host, port, target = _split(url)
        lines = [f"GET {target} HTTP/1.1", f"Host: {host}" if port in (80, 443) else f"Host: {host}:{port}",
                 f"Range: bytes={start}-{end - 1}", "Accept-Encoding: identity", f"User-Agent: {_USER_AGENT}"]
        for name, value in headers.items():
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
                raise ValueError(f"header {name!r}: a name or value with a line break")
            lines.append(f"{name}: {value}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        key = (scheme, host, port)
        limit = self._hosts.get(key)
        if limit is None:
            limit = self._hosts[key] = _Host(self.max_connections)
        await limit.enter()
        try:
            for attempt in (0, 1):
                conn, reused = None, False
                try:
                    conn, reused = await self._acquire(key)
                    status, pieces, keep, retry_after = await conn.request(head, start, end, self.timeout)
                except _ClosedIdle:
                    self._discard(conn)
                    if reused and attempt == 0:  # closed while idle, before any answer: open one and ask again
                        continue
                    limit.refused()
                    raise ConnectionResetError(f"{host}:{port} closed the connection before answering") from None
                except (OSError, asyncio.TimeoutError) as e:
                    if conn is not None:
                        self._discard(conn)
                    if not reused and not (conn is not None and conn.answered):  # a new connection, never answered
                        limit.refused()
                    raise e
                except BaseException:
                    if conn is not None:
                        self._discard(conn)
                    raise
                limit.answered(keep)
                if keep:
                    self._idle.setdefault(key, []).append(conn)
                else:
                    self._discard(conn)
                return Answer(status, pieces, retry_after)
            raise AssertionError("unreachable")
        finally:
            limit.leave()

    async def _acquire(self, key: tuple[str, str, int]) -> tuple[_Connection, bool]:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if conn.usable():
                return conn, True
            self._discard(conn)
        scheme, host, port = key
        loop = asyncio.get_running_loop()
        if scheme == "https" and self._ssl is None:
            self._ssl = _ssl_context()
        _, conn = await asyncio.wait_for(loop.create_connection(
            _Connection, host, port, ssl=self._ssl if scheme == "https" else None), self.timeout)
        self._open.add(conn)
        return conn, False

    def _discard(self, conn: _Connection) -> None:
        self._open.discard(conn)
        conn.close()

    def close(self) -> None:
        """Closes every connection (requests on them fail)."""
        for conn in list(self._open):
            conn.close()
        self._open.clear()
        self._idle.clear()


def _ssl_context() -> ssl.SSLContext:
    context = ssl.create_default_context()
    try:  # the bundle google-auth's requests transport trusts, where the system has none
        import certifi

        context.load_verify_locations(certifi.where())
    except (ImportError, OSError):
        pass
    return context


def _content_range(value: bytes | None) -> tuple[int, int] | None:
    """(first, last) byte of a `Content-Range: bytes first-last/size` (None: absent or malformed)."""
    if not value or not value.startswith(b"bytes "):
        return None
    first, dash, rest = value[6:].partition(b"-")
    last = rest.partition(b"/")[0]
    if not dash or not first.isdigit() or not last.isdigit() or len(first) > 18 or len(last) > 18:
        return None
    return int(first), int(last)


class _ClosedIdle(Exception):
    """The connection closed before a byte of the answer came (a kept connection the server had closed)."""


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection. States: idle (no request), waiting for the head, reading the body."""

    def __init__(self):
        self._transport: asyncio.Transport | None = None
        self._done: asyncio.Future | None = None
        self.answered = False  # a byte of an answer has come on it
        self._lost = False
        self._head = bytearray()
        self._timer: asyncio.TimerHandle | None = None

    # -- the request ------------------------------------------------------------------------------------------

    def usable(self) -> bool:
        return not self._lost and self._transport is not None and not self._transport.is_closing()

    def request(self, head: bytes, start: int, end: int, timeout: float) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        self._start, self._asked = start, end - start
        self._head.clear()
        self._status = 0
        self._pieces: list[bytes] = []
        self._left = -1  # body bytes still to come; -1: the head has not come yet
        self._skip = self._take = 0  # of a 200's body: bytes to pass over, then bytes to keep
        self._keep_alive = True
        self._retry_after: float | None = None
        self._any = False  # a byte of this answer came
        self._timer = loop.call_later(timeout, self._time_out, timeout)
        self._transport.write(head)
        return self._done

    def _time_out(self, timeout: float) -> None:
        self._fail(TimeoutError(f"no complete answer in {timeout:g} s"))

    def _finish(self) -> None:
        done, self._done = self._done, None
        self._timer.cancel()
        if not done.done():
            done.set_result((self._status, self._pieces, self._keep_alive, self._retry_after))

    def _fail(self, error: BaseException) -> None:
        done, self._done = self._done, None
        if self._timer is not None:
            self._timer.cancel()
        self.close()
        if done is not None and not done.done():
            done.set_exception(error)

    def close(self) -> None:
        self._lost = True
        if self._timer is not None:
            self._timer.cancel()
        if self._transport is not None:
            self._transport.abort()

    # -- asyncio's callbacks ----------------------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self._transport = transport

    def connection_lost(self, exc) -> None:
        self._lost = True
        if self._done is None:
            return
        if not self._any:
            self._fail(_ClosedIdle())
        elif self._left < 0:
            self._fail(ProtocolError("the connection closed in the middle of the answer's head"))
        else:
            self._fail(ProtocolError(f"the connection closed with {self._left} bytes of the body still to come"))

    def data_received(self, data: bytes) -> None:
        if self._done is None:  # bytes nobody asked for: the connection is out of step
            self.close()
            return
        self._any = self.answered = True
        try:
            if self._left < 0:
                data = self._read_head(data)
                if data is None:
                    return
            if data:
                self._read_body(data)
        except (ProtocolError, Unsupported) as e:
            self._fail(e)

    def _read_head(self, data: bytes) -> bytes | None:
        """Takes head bytes; returns the bytes after the head once it is whole (else None). The head usually comes
        whole in one piece with the body's first bytes: that piece is searched and sliced as it is, not copied into
        the head's buffer first."""
        if self._head:
            seen = len(self._head)
            self._head += data
            data, at = self._head, self._head.find(b"\r\n\r\n", max(0, seen - 3))
        else:
            at = data.find(b"\r\n\r\n")
        if at < 0:
            if not self._head:
                self._head += data
            if len(self._head) > MAX_HEAD:
                raise ProtocolError(f"an answer's head longer than {MAX_HEAD} bytes")
            return None
        if at > MAX_HEAD:
            raise ProtocolError(f"an answer's head longer than {MAX_HEAD} bytes")
        rest = bytes(data[at + 4:])
        self._parse_head(bytes(data[:at]))
        if self._left == 0:
            if rest:
                raise ProtocolError("bytes past the end of the answer")
            self._finish()
            return None
        if self._status == 200 and not self._take:  # nothing of the object is in the range: hang up
            self._hang_up()
            return None
        return rest

    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        status = lines[0].split(b" ", 2)
        if len(status) < 2 or status[0] not in (b"HTTP/1.1", b"HTTP/1.0") or len(status[1]) != 3 \
                or not status[1].isdigit():
            raise ProtocolError(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
        self._status = int(status[1])
        if 100 <= self._status < 200:
            raise ProtocolError(f"an unexpected informational answer ({self._status})")
        self._keep_alive = status[0] == b"HTTP/1.1"
        length = content_range = None
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or not name or name != name.strip():
                raise ProtocolError(f"a header line without a name: {line[:80]!r}")
            name, value = name.lower(), value.strip()
            if name == b"content-length":
                if not value.isdigit() or len(value) > 18 or (length is not None and int(value) != length):
                    raise ProtocolError(f"a bad Content-Length: {value[:40]!r}")
                length = int(value)
            elif name == b"transfer-encoding" and value.lower() != b"identity":
                raise Unsupported(f"Transfer-Encoding {value[:40]!r}")
            elif name == b"content-range":
                content_range = value
            elif name == b"retry-after" and value.isdigit() and len(value) <= 9:
                self._retry_after = float(value)
            elif name == b"connection":
                tokens = {t.strip() for t in value.lower().split(b",")}
                self._keep_alive = b"close" not in tokens and (self._keep_alive or b"keep-alive" in tokens)
        if length is None:
            if self._status in (204, 304):
                length = 0
            else:
                raise Unsupported("an answer without a Content-Length")
        if self._status == 206:
            if length > self._asked:
                raise ProtocolError(f"a 206 of {length} bytes to a range of {self._asked}")
            if _content_range(content_range) != (self._start, self._start + length - 1):
                raise ProtocolError(f"a 206 of {length} bytes with Content-Range {content_range!r} to a range that "
                                    f"starts at byte {self._start}")
        elif self._status == 200:  # the whole object: keep [start, end) of it as it passes
            self._skip = min(self._start, length)
            self._take = min(self._asked, length - self._skip)
        elif length > MAX_ERROR_BODY:  # an error's body: its start is enough; the connection goes
            self._keep_alive = False
            self._take = MAX_ERROR_BODY
        self._left = length
        if self._status != 200 and self._take == 0:
            self._take = length

    def _read_body(self, data: bytes) -> None:
        if len(data) > self._left:
            raise ProtocolError("bytes past the end of the answer's body")
        self._left -= len(data)
        if self._skip:
            if len(data) <= self._skip:
                self._skip -= len(data)
                data = b""
            else:
                data, self._skip = data[self._skip:], 0
        if data and self._take:
            piece = data if len(data) <= self._take else data[:self._take]
            self._take -= len(piece)
            self._pieces.append(piece)
        if self._left == 0:
            self._finish()
        elif not self._take and not self._skip and self._status != 206:  # all that is kept has come: hang up
            self._hang_up()

    def _hang_up(self) -> None:
        """Ends the request with what was kept and closes the connection (the rest of the body is not read)."""
        self._keep_alive = False
        done, self._done = self._done, None
        self._timer.cancel()
        self.close()
        done.set_result((self._status, self._pieces, False, self._retry_after))
