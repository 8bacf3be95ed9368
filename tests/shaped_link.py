"""A shaped link to the GCS emulator, for benchmarks: `python tests/shaped_link.py UPSTREAM` (prints its port; serves
until its stdin closes, i.e. its owner is gone).

An HTTP server on 127.0.0.1 (aiohttp, one event loop: ~0.1 ms of CPU a request, where a threaded Python server spent
~0.6 ms and set the pace on a small host) in front of the emulator at UPSTREAM. It answers media reads
(`GET .../o/NAME?alt=media`, whole or ranged: `a-b`, `a-`, the suffix `-n`; 416 past the end) of the objects it
was given from their local copies, each answer held `latency` seconds before its first byte and its body sent in
pieces that share `bandwidth` bytes/s with every other answer (a token bucket 5 ms of the link deep, as a router's
shaper has: over any time T, at most bandwidth x (T + 5 ms) bytes); everything else it forwards to the emulator as
is.

Control, as JSON: POST /__link/config {"latency", "bandwidth", "files": {"bucket/object": local path}};
POST /__link/reset clears the counts; GET /__link/stats gives {"bytes_out" (media bytes sent), "gets" (GET requests),
"active" (requests being answered), "cpu" (this process's CPU seconds)}.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import threading
import time
import urllib.parse

_MEDIA = re.compile(r"(?:/download)?/storage/v1/b/([^/]+)/o/(.+)")
_PIECE = 256 << 10
_BURST = 0.005  # seconds of the link's bandwidth sent at once when the link has been idle (a token bucket's depth)
_HOP = {"transfer-encoding", "connection", "content-length", "content-encoding", "host", "keep-alive"}


class Link:
    def __init__(self, upstream: str):
        self.upstream = upstream.rstrip("/")
        self.latency, self.bandwidth, self._link_free = 0.0, None, 0.0
        self.files: dict[tuple[str, str], str] = {}
        self.bytes_out = self.gets = self.active = 0
        self._session = None

    async def handle(self, request):
        from aiohttp import web

        started = time.monotonic()
        if request.path.startswith("/__link/"):
            return web.json_response(self._control(request.path, await request.read()))
        self.active += 1
        try:
            if request.method == "GET":
                self.gets += 1
                local = self._local(request.raw_path)
                if local is not None:
                    return await self._serve(request, local, started)
            return await self._forward(request)
        finally:
            self.active -= 1

    def _control(self, path: str, body: bytes) -> dict:
        if path == "/__link/config":
            config = json.loads(body)
            self.latency = config.get("latency", self.latency)
            self.bandwidth = config.get("bandwidth", self.bandwidth)
            for key, local in config.get("files", {}).items():
                bucket, _, name = key.partition("/")
                self.files[bucket, name] = local
        elif path == "/__link/reset":
            self.bytes_out = self.gets = 0
        return {"bytes_out": self.bytes_out, "gets": self.gets, "active": self.active, "cpu": time.process_time()}

    def _local(self, raw_path: str) -> str | None:
        split = urllib.parse.urlsplit(raw_path)
        match = _MEDIA.fullmatch(split.path)
        if not match or "media" not in urllib.parse.parse_qs(split.query).get("alt", []):
            return None
        return self.files.get((match[1], urllib.parse.unquote(match[2])))

    async def _serve(self, request, path: str, started: float):
        from aiohttp import web

        with open(path, "rb") as f:
            size = f.seek(0, 2)
            begin, end, status = 0, size, 200
            asked = request.headers.get("Range")
            if asked:
                match = re.fullmatch(r"bytes=(\d*)-(\d*)", asked.strip())
                if not match or not (match[1] or match[2]):
                    return web.Response(status=400, text=f"bad Range {asked!r}")
                if match[1]:
                    begin = int(match[1])
                    end = min(size, int(match[2]) + 1) if match[2] else size
                else:
                    begin = max(0, size - int(match[2]))
                if begin >= size:
                    return web.Response(status=416, headers={"Content-Range": f"bytes */{size}"})
                status = 206
            await asyncio.sleep(max(0.0, started + self.latency - time.monotonic()))
            headers = {"Content-Length": str(end - begin), "Content-Type": "application/octet-stream"}
            if status == 206:
                headers["Content-Range"] = f"bytes {begin}-{end - 1}/{size}"
            response = web.StreamResponse(status=status, headers=headers)
            await response.prepare(request)
            f.seek(begin)
            try:
                while begin < end:
                    piece = f.read(min(_PIECE, end - begin))
                    if self.bandwidth:  # the pieces of every answer share the link, in the order they ask for it
                        # a token bucket holding _BURST seconds of the link: time this loop was late is made up
                        # (else every late wake-up idled the link, and a link capped at 1,000 MB/s carried ~300)
                        now = time.monotonic()
                        self._link_free = max(self._link_free, now - _BURST) + len(piece) / self.bandwidth
                        if self._link_free > now:
                            await asyncio.sleep(self._link_free - now)
                    await response.write(piece)
                    self.bytes_out += len(piece)
                    begin += len(piece)
                await response.write_eof()
            except (ConnectionError, asyncio.CancelledError):  # the client took what it needed and hung up
                pass
            return response

    async def _forward(self, request):
        import aiohttp
        from aiohttp import web

        if self._session is None:
            self._session = aiohttp.ClientSession(auto_decompress=False)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with self._session.request(request.method, self.upstream + request.raw_path, headers=headers,
                                         data=await request.read()) as answer:
            body = await answer.read()
            return web.Response(status=answer.status, body=body,
                                headers={k: v for k, v in answer.headers.items() if k.lower() not in _HOP})


def main(argv: list[str]) -> None:
    from aiohttp import web

    if len(argv) != 1:
        sys.exit("usage: python tests/shaped_link.py UPSTREAM")
    link = Link(argv[0])
    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/{tail:.*}", link.handle)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, access_log=None)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
    loop.run_until_complete(site.start())
    print(site._server.sockets[0].getsockname()[1], flush=True)
    threading.Thread(target=lambda: (sys.stdin.read(), loop.call_soon_threadsafe(loop.stop)), daemon=True).start()
    loop.run_forever()
    loop.run_until_complete(runner.cleanup())  # its connections closed, their handlers ended
    if link._session is not None:
        loop.run_until_complete(link._session.close())


if __name__ == "__main__":
    main(sys.argv[1:])
