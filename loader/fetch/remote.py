"""Many byte ranges of gs:// objects at once: the loader's remote reads.

`fetch([(path, start, end), ...])` returns each range's bytes, in order. Up to `IN_FLIGHT` requests of a process are
in flight together, on one asyncio event loop (a daemon thread of the process, started on first use), through
aiohttp's client (HTTP/1.1 keep-alive connections, reused as RFC 9112 allows; proxies from HTTPS_PROXY/HTTP_PROXY and
NO_PROXY; chunked answers), at most a host's limit at once (loader/fetch/host_limit.py: a small server is not flooded).
Requests are the JSON API's media downloads (`GET .../o/NAME?alt=media` with a `Range`), authorised with the
credentials the google-cloud-storage client uses (and refreshed as it refreshes them), to its endpoint
(STORAGE_EMULATOR_HOST included). aiohttp was measured beside the alternatives (benchmarks/gcs_client_bench.py:
obstore, tensorstore's kvstore, a client of our own): as fast as any on every link measured, at ~0.1-0.2 ms of CPU a
request.

Every answer is untrusted and bounded before it is kept: a 206 must start at the range's first byte (Content-Range)
and hold no more than the range; a 200 (the server ignored the range) is cut to the range as it streams and its
connection dropped, never held whole; an error's body is kept to MAX_ERROR_BODY bytes.

A range may name the object's generation (the one the loader listed, which its index and caches are keyed by): the
request asks for that generation (`&generation=G`: an object rewritten since is a 404 where the bucket keeps no old
versions, and the old bytes where it does), and an answer of another generation (its `x-goog-generation`) is
`storage.ObjectChanged`, never bytes of two versions in one job's reads.

What is transient (408, 429, 5xx, a dropped, reset or timed-out connection, a body cut short, an answer that breaks
the bounds) is retried with backoff (0.25 s doubling to 16 s, or as long as a Retry-After asks, for up to
`storage.RETRY_SECONDS`; one log line an object and cause), and the waits end when the interpreter exits. A 403 is
a `PermissionError` and a 404 a `FileNotFoundError`, naming the bucket and the object.

    remote.fetch([("gs://bucket/ds/train.array_record-00000-of-00008", 64, 1088)])  # [b"..."]
"""

from __future__ import annotations

import asyncio
import atexit
import bisect
import collections
import functools
import itertools
import logging
import os
import re
import threading
import time
from typing import NamedTuple

from dataset_format import storage
from loader.fetch.host_limit import HostLimit

log = logging.getLogger(__name__)

# Range requests in flight a process (they share one event loop and connection pool). At 50 ms a request, 128 read
# 1.4x (100 KB records) to 1.7x (1 KB) the records/s of 64; 256 added nothing on 2 cores (benchmarks/gcs_read_bench.py).
IN_FLIGHT = 128
_TRANSIENT = {408, 429, 500, 502, 503, 504}
MAX_RETRY_AFTER = 60.0  # seconds: a longer Retry-After is waited this long (the retries' deadline still holds)
_TIMEOUT_SECONDS = 120  # one request, connect to last byte
MAX_ERROR_BODY = 64 << 10  # bytes of an error's body kept (for its message); the rest is not read


class ProtocolError(ConnectionError):
    """An answer that is not what was asked for (a transient fault: the request is retried)."""


class Answer(NamedTuple):
    status: int
    pieces: list[bytes]
    retry_after: float | None = None  # seconds, from a Retry-After header of delay-seconds
    generation: int | None = None  # the object's, from x-goog-generation


def fetch(ranges: list[tuple], generations: list[int | None] | None = None) -> list[bytes]:
    """The bytes [start, end) of each (path, start, end), in order; fewer where an object ends sooner (416: none).
    `generations`: each range's object generation (None or 0: whatever the object holds now)."""
    return [bytes(body) for body in fetch_bodies(ranges, generations)]


def fetch_bodies(ranges: list[tuple], generations: list[int | None] | None = None) -> list[Body]:
    """As fetch(), each range's bytes as the pieces they arrived in (Body): the reader takes views of them."""
    if not ranges:
        return []
    generations = generations or [None] * len(ranges)
    return _Loop.for_process().run([(_pinned(storage.media_url(path), generation), path, start, end, generation or None)
                                    for (path, start, end), generation in zip(ranges, generations)])


def _pinned(url: str, generation: int | None) -> str:
    """`url` asking for the object's `generation` (none: as it is now)."""
    return f"{url}{'&' if '?' in url else '?'}generation={int(generation)}" if generation else url


class Body:
    """The bytes of one range as the pieces the connection delivered them in (up to 256 KiB each). Joining them
    copied every byte once more, into a fresh allocation (a fifth of the reader's busy samples on 100 KB records,
    benchmarks/gcs_read_bench.py under py-spy); view() hands out the bytes of a piece without a copy."""

    __slots__ = ("_pieces", "_starts")

    def __init__(self, pieces: list[bytes]):
        self._pieces = [piece for piece in pieces if piece]
        self._starts = [0, *itertools.accumulate(len(piece) for piece in self._pieces)]

    def __len__(self) -> int:
        return self._starts[-1]

    def __bytes__(self) -> bytes:
        return self._pieces[0] if len(self._pieces) == 1 else b"".join(self._pieces)

    def view(self, begin: int, end: int) -> memoryview | bytes:
        """Bytes [begin, end) (0 <= begin <= end <= len): a view of the piece that holds them all, else a copy."""
        if not 0 <= begin <= end <= len(self):
            raise ValueError(f"bytes {begin}..{end} of a body of {len(self)}")
        if begin == end:
            return b""
        first = bisect.bisect_right(self._starts, begin) - 1
        at = self._starts[first]
        if end <= self._starts[first + 1]:
            return memoryview(self._pieces[first])[begin - at:end - at]
        last = bisect.bisect_left(self._starts, end) - 1
        parts = [memoryview(piece) for piece in self._pieces[first:last + 1]]
        parts[-1] = parts[-1][:end - self._starts[last]]
        parts[0] = parts[0][begin - at:]
        return b"".join(parts)


class _Loop:
    """This process's event loop thread, aiohttp session and credentials."""

    _instance: _Loop | None = None
    _lock = threading.Lock()

    def __init__(self):
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self._credentials = storage.credentials()
        self._auth_lock = threading.Lock()
        self._session = None
        self._limits: dict[str, HostLimit] = {}  # endpoint (host:port) -> its limit of requests at once
        self._queue: asyncio.Queue | None = None  # (read, index of its range) for the workers, in order
        self._workers: list[asyncio.Task] = []
        threading.Thread(target=self.loop.run_forever, name="gcs-ranges", daemon=True).start()
        atexit.register(self._close)

    def _close(self) -> None:
        """At exit: the workers ended and the session closed on the loop (else asyncio and aiohttp log them as
        pending and unclosed, at every process's exit)."""
        if self._session is not None and self.pid == os.getpid() and self.loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self._shut(), self.loop).result(timeout=5)
            except Exception:  # noqa: BLE001 - exiting: a close that fails or hangs changes nothing
                pass

    async def _shut(self) -> None:
        for worker in self._workers:
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        await self._session.close()

    @classmethod
    def for_process(cls) -> _Loop:
        with cls._lock:  # a forked child makes its own (the parent's thread did not come with it)
            if cls._instance is None or cls._instance.pid != os.getpid():
                cls._instance = _Loop()
            return cls._instance

    def run(self, requests: list[tuple[str, str, int, int, int | None]]) -> list[Body]:
        """The bodies of (url, path, start, end, generation or None) requests."""
        headers = self._auth_headers()
        return asyncio.run_coroutine_threadsafe(self._all(requests, headers), self.loop).result()

    def _auth_headers(self) -> dict[str, str]:
        """The Authorization header, the token refreshed when it has expired (as the client's session does)."""
        headers: dict[str, str] = {}
        with self._auth_lock:
            if not getattr(self._credentials, "valid", True):
                import google.auth.transport.requests

                self._credentials.refresh(google.auth.transport.requests.Request())
            self._credentials.apply(headers)
        return headers

    async def _all(self, requests, headers) -> list[Body]:
        """The ranges' bodies, fetched by the loop's IN_FLIGHT workers in the order reads ask (first come, first
        served: a read group asked first is read first, not interleaved with the next, so its batches come sooner)."""
        import aiohttp

        if not requests:
            return []
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=IN_FLIGHT, ttl_dns_cache=300),
                timeout=aiohttp.ClientTimeout(total=_TIMEOUT_SECONDS), auto_decompress=False)
            self._queue = asyncio.Queue()
            # a task for each request in flight, living as long as the loop, not a task for each request (~25 us)
            self._workers = [self.loop.create_task(self._worker()) for _ in range(IN_FLIGHT)]
        read = _Read(requests, headers, self.loop.create_future())
        for i in range(len(requests)):
            self._queue.put_nowait((read, i))
        return await read.done

    async def _worker(self) -> None:
        while True:
            read, i = await self._queue.get()
            if read.done.done():  # another range of this read failed: its error is the read's
                continue
            url, path, start, end, generation = read.requests[i]
            try:
                body = await self._one(url, path, start, end, read.headers, generation, read.done)
            except Exception as e:  # noqa: BLE001 - handed to the read's caller, who raises it
                if not read.done.done():
                    read.done.set_exception(e)
                continue
            read.bodies[i] = body
            read.left -= 1
            if not read.left and not read.done.done():
                read.done.set_result(read.bodies)

    async def _one(self, url: str, path: str, start: int, end: int, headers: dict[str, str],
                   generation: int | None, failed: asyncio.Future) -> Body:
        """One range's body, retried while transient; given up (an empty body, never used) once `failed`, its read's
        future, is done: another range of the read failed, and the read's error is said (its other ranges waiting
        to retry for minutes held this process's workers and its host's slots from the reads after it)."""
        import aiohttp

        delay, deadline = 0.25, time.monotonic() + storage.RETRY_SECONDS
        while True:
            asked = None  # the wait a Retry-After asks for
            try:
                status, pieces, asked, answered = await self._get(url, start, end, headers)
            except (aiohttp.ClientError, OSError) as e:  # dropped, refused, timed out, cut short, malformed
                reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            else:
                if generation and answered and answered != generation and status in (200, 206, 416):
                    raise storage.ObjectChanged(path, generation, answered)
                if status in (200, 206):  # 200: the whole object (the server ignored the range), cut to it
                    return Body(pieces)
                if status == 416:  # the range starts past the end: the object is shorter
                    return Body([])
                if status == 404 and generation:  # that generation is gone: rewritten (or deleted) since listed
                    raise storage.ObjectChanged(path, generation, None)
                if status not in _TRANSIENT:
                    _raise_for(status, path, b"".join(pieces))
                reason = f"HTTP {status}"
            if failed.done():
                return Body([])
            if asked is not None:  # the server says when: as long as it asks, within the retries' time
                delay = max(delay, min(asked, MAX_RETRY_AFTER))
            if time.monotonic() + delay > deadline or storage.exiting():
                raise OSError(f"{path}: reading bytes {start}-{end - 1} failed for {storage.RETRY_SECONDS:.0f} s "
                              f"({reason}); check the network and the bucket")
            _log_retry(path, reason)
            waited = 0.0
            while waited < delay and not storage.exiting() and not failed.done():  # (ends when the interpreter
                # exits, or the read has failed)
                await asyncio.sleep(min(0.1, delay - waited))
                waited += 0.1
            delay = min(16.0, delay * 2)

    async def _get(self, url: str, start: int, end: int, headers: dict[str, str]) -> Answer:
        """(status, body pieces, Retry-After, generation) of a range GET, within its host's limit
        (loader/fetch/host_limit.py)."""
        import aiohttp

        endpoint = url.split("/", 3)[2]
        limit = self._limits.get(endpoint)
        if limit is None:
            limit = self._limits[endpoint] = HostLimit(IN_FLIGHT)
        await limit.enter()
        answered = False
        try:
            async with self._session.get(url, headers={**headers, "Range": f"bytes={start}-{end - 1}",
                                                       "Accept-Encoding": "identity"}, proxy=_proxy_for(url)) as r:
                answered = True
                pieces = await _bounded_body(r, start, end)
                retry_after = r.headers.get("Retry-After", "")
                generation = r.headers.get("x-goog-generation", "")
                connection = r.headers.get("Connection", "").lower()  # RFC 9112 9.3: does the server keep it?
                kept = "keep-alive" in connection if r.version < aiohttp.HttpVersion11 else "close" not in connection
            limit.answered(kept)
            return Answer(r.status, pieces, float(retry_after) if retry_after.isdigit() and len(retry_after) <= 9
                          else None, int(generation) if generation.isdigit() and len(generation) <= 19 else None)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError):
            if not answered:  # refused, reset or timed out before the answer's head: the host may be swamped
                limit.refused()
            raise
        finally:
            limit.leave()


async def _bounded_body(response, start: int, end: int) -> list[bytes]:
    """The pieces of an answer's body worth keeping, each length bounded before it is kept (see the module doc)."""
    asked = end - start
    promised = None  # a 206's bytes, from its Content-Range
    if response.status == 206:
        first, last = _content_range(response.headers.get("Content-Range"))
        if first != start:
            raise ProtocolError(f"a 206 with Content-Range {response.headers.get('Content-Range')!r} to a range "
                                f"that starts at byte {start}")
        if response.content_length is not None:
            if response.content_length > asked:
                raise ProtocolError(f"a 206 of {response.content_length} bytes to a range of {asked}")
            return [await response.read()]  # bounded by its Content-Length, which aiohttp holds it to
        skip, take, promised = 0, asked, last - first + 1 if last is not None and last >= first else None
    elif response.status == 200:  # the whole object: keep [start, end) of it as it passes
        skip, take = start, asked
    else:
        skip, take = 0, MAX_ERROR_BODY
    pieces: list[bytes] = []
    got = 0
    async for piece in response.content.iter_any():
        if skip:
            if len(piece) <= skip:
                skip -= len(piece)
                continue
            piece, skip = piece[skip:], 0
        if got + len(piece) > take:
            if response.status == 206:
                raise ProtocolError(f"a 206 longer than its range of {asked} bytes")
            pieces.append(piece[:take - got])
            got = take
            break
        pieces.append(piece)
        got += len(piece)
        if got == take and response.status != 206:
            break
    if got == take and response.status != 206 and not response.content.at_eof():
        response.close()  # the rest is not read: the connection goes with it
    if promised is not None and got < min(promised, asked):  # a body read to the connection's close, cut short
        raise ProtocolError(f"a 206 of {got} bytes where its Content-Range promised {promised}")
    return pieces


def _content_range(value: str | None) -> tuple[int | None, int | None]:
    """(first, last) byte of a `Content-Range: bytes first-last/size` ((None, None): absent or malformed)."""
    if not value or not value.startswith("bytes "):
        return None, None
    first, dash, rest = value[6:].partition("-")
    last = rest.partition("/")[0]
    if not dash or not first.isdigit() or not last.isdigit() or len(first) > 18 or len(last) > 18:
        return None, None
    return int(first), int(last)


_RETRIES_LOGGED: collections.OrderedDict = collections.OrderedDict()  # (object, cause) already logged: the newest


def _log_retry(path: str, reason: str) -> None:
    """One line for an object and a cause (the reason up to its first digit: "HTTP 503", "TimeoutError: no complete
    answer in"), however often its reads retry: a server that is down for a minute leaves one line an object, not
    one a request."""
    cause = (path, re.split(r"\d", reason, maxsplit=1)[0] if not reason.startswith("HTTP ") else reason)
    if cause in _RETRIES_LOGGED:
        _RETRIES_LOGGED.move_to_end(cause)
        return
    _RETRIES_LOGGED[cause] = True
    if len(_RETRIES_LOGGED) > 4096:
        _RETRIES_LOGGED.popitem(last=False)
    log.warning("Cloud Storage: %s: %s; retrying (for up to %.0f s; not logged again for this object and cause)",
                path, reason, storage.RETRY_SECONDS)


def _proxy_for(url: str) -> str | None:
    """The proxy HTTPS_PROXY / HTTP_PROXY name for `url`'s host, unless NO_PROXY exempts it (as google-cloud-storage's
    `requests` transport decides). Looked up once per endpoint: aiohttp's own lookup (`trust_env=True`) redoes it on
    every request, which tripled a request's CPU."""
    scheme, host = url.split("://", 1)
    return _proxy(scheme, host.split("/", 1)[0])


@functools.lru_cache(maxsize=16)
def _proxy(scheme: str, netloc: str) -> str | None:
    import urllib.request

    if urllib.request.proxy_bypass(netloc.rsplit(":", 1)[0]):
        return None
    return urllib.request.getproxies().get(scheme)


class _Read:
    """One call's ranges: what the workers fill, and the future its caller waits on."""

    __slots__ = ("requests", "headers", "done", "bodies", "left")

    def __init__(self, requests: list, headers: dict[str, str], done: asyncio.Future):
        self.requests, self.headers, self.done = requests, headers, done
        self.bodies: list[Body | None] = [None] * len(requests)
        self.left = len(requests)


def _raise_for(status: int, path: str, body: bytes) -> None:
    bucket, name = storage.split_gcs(path)
    if status in (401, 403):
        raise PermissionError(f"{path}: permission denied ({status}) on bucket {bucket!r}, object {name!r}; grant "
                              "this account access to the bucket (roles/storage.objectViewer to read) or check the "
                              "path")
    if status == 404:
        raise FileNotFoundError(f"{path}: no such object {name!r} in bucket {bucket!r} (404); was the dataset "
                                "rewritten or deleted while being read?")
    raise OSError(f"{path}: Cloud Storage answered {status} to a range read: {body[:200]!r}")
