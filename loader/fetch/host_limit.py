"""How many requests go to one host at once: the gs:// reads' connections (loader/fetch/remote.py).

A host's limit starts at START, doubles with each round of answers on connections the server keeps open, up to the
reader's most (128 in flight); a host whose answers close their connections (HTTP/1.0 without keep-alive, or
`Connection: close`: every request is then a new connection) is held to CLOSING; a new connection that fails before
its answer (a server whose accept queue is full resets, or never completes, the connections past it) halves it. So
a small server (the stock GCS emulator serves one connection at a time, with an accept queue of 5) is not flooded
with new connections, and Cloud Storage gets the reader's most within a few round trips.

    limit = HostLimit(most=128)
    await limit.enter(); ...; limit.answered(kept=True); limit.leave()
"""

from __future__ import annotations

import asyncio
import collections

START = 16  # a host's limit at first
CLOSING = 16  # ... and at most, for a host whose answers close their connections


class HostLimit:
    """One host's limit and the requests waiting for a place (used from one event loop). A waiter that is woken has
    its place taken for it."""

    def __init__(self, most: int):
        self.most = most
        self.limit = min(START, most)
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
        """An answer came; `kept`: the server keeps its connection open for the next request."""
        if not kept:
            self.closing = True
            self.limit = min(self.limit, CLOSING)
        elif not self.closing and self.limit < self.most:
            self.kept += 1
            if self.kept >= self.limit:
                self.limit, self.kept = min(self.most, 2 * self.limit), 0
                self._wake()

    def refused(self) -> None:
        """A new connection failed before its answer: fewer at once."""
        self.limit, self.kept = max(1, self.limit // 2), 0
