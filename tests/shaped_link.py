"""A shaped link to the GCS emulator, for benchmarks: `python tests/shaped_link.py UPSTREAM` (prints its port; serves
until its stdin closes, i.e. its owner is gone).

An HTTP/1.1 server on 127.0.0.1 in front of the emulator at UPSTREAM: asyncio's transports and a few lines of request
parsing, one event loop (~50 us of CPU a request; aiohttp's server spent ~200 us and a threaded Python server ~600 us,
and on a small host the link's CPU, not the reader's, then set the pace). It answers media reads
(`GET .../o/NAME?alt=media`, or the XML API's `GET /BUCKET/NAME`; whole or ranged: `a-b`, `a-`, the suffix `-n`;
416 past the end; with Last-Modified, ETag and x-goog-generation as Cloud Storage sends them) of the objects it
was given from their local copies, each answer held `latency` seconds before its first byte and its body sent in
pieces that share `bandwidth` bytes/s with every other answer (a token bucket 5 ms of the link deep, as a router's
shaper has: over any time T, at most bandwidth x (T + 5 ms) bytes); everything else it forwards to the emulator as
is.

Control, as JSON: POST /__link/config {"latency", "bandwidth", "files": {"bucket/object": local path, or [local
path, the object's generation in the emulator] (its x-goog-generation; else one from the copy's mtime)}};
POST /__link/reset clears the counts; GET /__link/stats gives {"bytes_out" (media bytes sent), "gets" (GET requests),
"active" (requests being answered), "cpu" (this process's CPU seconds)}.
"""

from __future__ import annotations

import asyncio
import email.utils
import http.client
import json
import os
import re
import sys
import threading
import time
import urllib.parse

_MEDIA = re.compile(r"(?:/download)?/storage/v1/b/([^/]+)/o/(.+)")
_PIECE = 256 << 10
_BURST = 0.005  # seconds of the link's bandwidth sent at once when the link has been idle (a token bucket's depth)
_HOP = {"transfer-encoding", "connection", "content-length", "host", "keep-alive"}
_REASONS = {200: "OK", 206: "Partial Content", 400: "Bad Request", 404: "Not Found", 416: "Range Not Satisfiable",
            501: "Not Implemented"}


class Link:
    """What the link knows: its shaping, its objects, its counts. Each connection is a _Connection."""

    def __init__(self, upstream: str):
        self.upstream = urllib.parse.urlsplit(upstream)
        self.latency, self.bandwidth, self._link_free = 0.0, None, 0.0
        self.files: dict[tuple[str, str], str] = {}
        self.generations: dict[str, int] = {}  # local path -> the generation its answers name
        self.bytes_out = self.gets = self.active = 0

    def control(self, path: str, body: bytes) -> dict:
        if path == "/__link/config":
            config = json.loads(body)
            self.latency = config.get("latency", self.latency)
            self.bandwidth = config.get("bandwidth", self.bandwidth)
            for key, local in config.get("files", {}).items():
                bucket, _, name = key.partition("/")
                if isinstance(local, list):
                    self.generations[local[0]] = local[1]
                    local = local[0]
                self.files[bucket, name] = local
        elif path == "/__link/reset":
            self.bytes_out = self.gets = 0
        return {"bytes_out": self.bytes_out, "gets": self.gets, "active": self.active, "cpu": time.process_time()}

    def local(self, target: str) -> str | None:
        """The local copy a media read asks for: the JSON API's `.../b/BUCKET/o/NAME?alt=media`, or the XML API's
        `/BUCKET/NAME` (what obstore asks)."""
        split = urllib.parse.urlsplit(target)
        match = _MEDIA.fullmatch(split.path)
        if match:
            if "media" not in urllib.parse.parse_qs(split.query).get("alt", []):
                return None
            return self.files.get((match[1], urllib.parse.unquote(match[2])))
        bucket, _, name = split.path.lstrip("/").partition("/")
        return self.files.get((bucket, urllib.parse.unquote(name)))

    async def pace(self, size: int) -> None:
        """Waits for the link to carry `size` more bytes: the pieces of every answer share it, in the order they ask
        for it, through a token bucket holding _BURST seconds of the link (time a late wake-up lost is made up: else
        every late wake-up idled the link, and a link capped at 1,000 MB/s carried ~300)."""
        if self.bandwidth:
            now = time.monotonic()
            self._link_free = max(self._link_free, now - _BURST) + size / self.bandwidth
            if self._link_free > now:
                await asyncio.sleep(self._link_free - now)

    def forward(self, method: str, target: str, headers: dict[str, str], body: bytes) -> tuple[int, list, bytes]:
        """The emulator's answer to a request (in a thread: metadata and uploads are few)."""
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=60)
        try:
            conn.request(method, target, body=body or None,
                         headers={k: v for k, v in headers.items() if k not in _HOP})
            answer = conn.getresponse()
            return answer.status, [(k, v) for k, v in answer.getheaders() if k.lower() not in _HOP], answer.read()
        finally:
            conn.close()


class _Connection(asyncio.Protocol):
    """One client connection: requests read and answered one at a time, in order."""

    def __init__(self, link: Link):
        self.link = link
        self.buffer = bytearray()
        self.busy = False
        self.transport: asyncio.Transport | None = None
        self._writable: asyncio.Future | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.transport = None
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.busy:
            self._next()

    def _next(self) -> None:
        at = self.buffer.find(b"\r\n\r\n")
        if at < 0:
            if len(self.buffer) > 1 << 20:
                self.transport.close()
            return
        lines = bytes(self.buffer[:at]).decode("latin-1").split("\r\n")
        method, target, version = (lines[0].split(" ") + ["", ""])[:3]
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if "chunked" in headers.get("transfer-encoding", ""):
            self._write_answer(501, {}, b"chunked requests are not read here", close=True)
            return
        length = int(headers.get("content-length") or 0)
        if len(self.buffer) < at + 4 + length:
            return  # the body is still coming
        body = bytes(self.buffer[at + 4:at + 4 + length])
        del self.buffer[:at + 4 + length]
        close = headers.get("connection", "").lower() == "close" or version == "HTTP/1.0"
        self.busy = True
        asyncio.get_running_loop().create_task(self._answer(method, target, headers, body, close))

    async def _answer(self, method: str, target: str, headers: dict, body: bytes, close: bool) -> None:
        started = time.monotonic()
        link = self.link
        control = target.startswith("/__link/")
        link.active += not control  # the counts' own requests are not counted
        try:
            if control:
                self._write_answer(200, {"Content-Type": "application/json"},
                                   json.dumps(link.control(target.split("?")[0], body)).encode(), close)
                return
            if method == "GET":
                link.gets += 1
                local = link.local(target)
                if local is not None:
                    await self._serve(local, headers.get("range"), started, close)
                    return
            status, answer_headers, answer = await asyncio.to_thread(link.forward, method, target, headers, body)
            self._write_answer(status, dict(answer_headers), answer, close)
        except ConnectionError:  # the client took what it needed and hung up
            if self.transport is not None:
                self.transport.abort()
        finally:
            link.active -= not control
            self.busy = False
            if self.transport is not None and not self.transport.is_closing() and self.buffer:
                self._next()

    def _write_head(self, status: int, headers: dict, length: int, close: bool) -> None:
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Answer')}", f"Content-Length: {length}",
                 *(f"{k}: {v}" for k, v in headers.items()), *(["Connection: close"] if close else [])]
        self.transport.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))

    def _write_answer(self, status: int, headers: dict, body: bytes, close: bool) -> None:
        if self.transport is None:
            return
        self._write_head(status, headers, len(body), close)
        self.transport.write(body)
        if close:
            self.transport.close()

    async def _serve(self, path: str, asked: str | None, started: float, close: bool) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            begin, end, status = 0, size, 200
            if asked:
                match = re.fullmatch(r"bytes=(\d*)-(\d*)", asked.strip())
                if not match or not (match[1] or match[2]):
                    return self._write_answer(400, {}, f"bad Range {asked!r}".encode(), close)
                if match[1]:
                    begin = int(match[1])
                    end = min(size, int(match[2]) + 1) if match[2] else size
                else:
                    begin = max(0, size - int(match[2]))
                if begin >= size:
                    return self._write_answer(416, {"Content-Range": f"bytes */{size}"}, b"", close)
                status = 206
            await asyncio.sleep(max(0.0, started + self.link.latency - time.monotonic()))
            if self.transport is None:
                raise ConnectionResetError("the client hung up")
            stat = os.fstat(fd)  # what Cloud Storage sends with media (obstore requires Last-Modified and ETag)
            headers = {"Content-Type": "application/octet-stream", "ETag": f'"{stat.st_size}-{stat.st_mtime_ns}"',
                       "Last-Modified": email.utils.formatdate(stat.st_mtime, usegmt=True),
                       "x-goog-generation": str(self.link.generations.get(path, stat.st_mtime_ns // 1000))}
            if status == 206:
                headers["Content-Range"] = f"bytes {begin}-{end - 1}/{size}"
            self._write_head(status, headers, end - begin, close)
            while begin < end:
                piece = os.pread(fd, min(_PIECE, end - begin), begin)
                if not piece:
                    raise ConnectionResetError(f"{path} is shorter than it was")
                await self.link.pace(len(piece))
                if self.transport is None or self.transport.is_closing():  # (asyncio logs each write after that)
                    raise ConnectionResetError("the client hung up")
                self.transport.write(piece)
                self.link.bytes_out += len(piece)
                begin += len(piece)
                if self._writable is not None:  # the client reads slower than the link sends: wait for it
                    await self._writable
                    self._writable = None
            if close and self.transport is not None:
                self.transport.close()
        finally:
            os.close(fd)


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: python tests/shaped_link.py UPSTREAM")
    link = Link(argv[0])
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(loop.create_server(lambda: _Connection(link), "127.0.0.1", 0, backlog=1024))
    print(server.sockets[0].getsockname()[1], flush=True)
    threading.Thread(target=lambda: (sys.stdin.read(), loop.call_soon_threadsafe(loop.stop)), daemon=True).start()
    loop.run_forever()
    server.close()


if __name__ == "__main__":
    main(sys.argv[1:])
