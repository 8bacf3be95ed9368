"""A bounded memory cache of chunks that keeps what this host reads again soonest: for multi-host jobs on gs://.

Every epoch reads each record once, in a new permutation, and host i of n reads its rows of each global batch
(loader/planning/batches.py). On one host, a record read now is read again next epoch, so the first chunks read, kept
(the fixed set, loader/fetch/chunk_cache.py `FirstRead`), serve cache / dataset of every later epoch, the most any cache
can. On n hosts, a record this host reads now is read by this host again only every ~n epochs; a fixed set spends its
room on records other hosts read next. The loader's plan is a pure function of the seed, so the next read of each record
on this host is known (`BatchPlan.next_reads`: the inverse permutation of the next epochs), and this cache keeps the
chunks whose next read comes soonest, evicting the one read furthest ahead: Belady's policy, the optimal one, within the
epochs the plan is read ahead (benchmarks/cache_policy_bench.py).

    cache = PlannedCache(capacity=8 << 30)
    cache.get(key)                                 # bytes, or None
    cache.keep(keys, next_reads, chunks, now)      # after a read: each chunk's next read on this host
"""

from __future__ import annotations

import heapq
import threading

import numpy as np

NEVER = np.iinfo(np.int64).max  # not read again on this host within the plan's horizon


class PlannedCache:
    """At most `capacity` bytes of chunks, keyed by anything hashable, kept by their next read. Thread-safe."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: dict = {}  # key -> (bytes, next read)
        self._furthest: list = []  # (-next read, key): eviction order; stale items skipped
        self._soonest: list = []  # (next read, key): entries whose next read has passed go first
        self._size = 0
        self._lock = threading.Lock()

    def get(self, key) -> bytes | None:
        entry = self._entries.get(key)
        return entry[0] if entry is not None else None

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size(self) -> int:
        return self._size

    def keep(self, keys: list, next_reads: np.ndarray, chunks: list, now: int) -> None:
        """After a read at stream position `now`: chunk i (`keys[i]`, its bytes `chunks[i]`) is next read at
        `next_reads[i]` (NEVER: not within the horizon). Kept chunks get their new next read (or leave); the others
        come in while there is room, or in place of one read later than they are."""
        with self._lock:
            self._forget_past(now)
            for key, due, data in zip(keys, np.asarray(next_reads).tolist(), chunks):
                if key in self._entries:
                    if due == NEVER:
                        self._remove(key)
                    else:
                        self._entries[key] = (self._entries[key][0], due)
                        self._push(key, due)
                    continue
                if due == NEVER or len(data) > self.capacity:
                    continue
                while self._size + len(data) > self.capacity:
                    furthest = self._peek_furthest()
                    if furthest is None or furthest[0] <= due:
                        break
                    self._remove(furthest[1])
                if self._size + len(data) <= self.capacity:
                    self._entries[key] = (bytes(data), due)
                    self._size += len(data)
                    self._push(key, due)
            if len(self._furthest) > 4 * len(self._entries) + 1024:  # stale heap items: rebuilt
                self._furthest = [(-due, key) for key, (_, due) in self._entries.items()]
                self._soonest = [(due, key) for key, (_, due) in self._entries.items()]
                heapq.heapify(self._furthest)
                heapq.heapify(self._soonest)

    def _push(self, key, due: int) -> None:
        heapq.heappush(self._furthest, (-due, key))
        heapq.heappush(self._soonest, (due, key))

    def _current(self, key, due: int) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry[1] == due

    def _peek_furthest(self):
        while self._furthest:
            due, key = -self._furthest[0][0], self._furthest[0][1]
            if self._current(key, due):
                return due, key
            heapq.heappop(self._furthest)
        return None

    def _forget_past(self, now: int) -> None:
        """Entries whose next read came before `now` without a hit (another process of the host read it): out."""
        while self._soonest and self._soonest[0][0] < now:
            due, key = heapq.heappop(self._soonest)
            if self._current(key, due):
                self._remove(key)

    def _remove(self, key) -> None:
        data, _ = self._entries.pop(key)
        self._size -= len(data)


class PlannedChunks:
    """The reader's view of a PlannedCache (loader/fetch/chunk_cache.py's interface): at most `capacity` bytes of chunks
    in memory, kept by their next read on this host."""

    checked = False

    def __init__(self, capacity: int):
        self.cache = PlannedCache(capacity)

    def lookup(self, read) -> list:
        return [self.cache.get(chunk) for chunk in read.chunks]

    def store(self, read, data: list, indices: list[int]) -> None:
        """Every chunk of the read is offered (those kept get their new next read), not only those downloaded."""
        due = np.full(len(read.chunks), -1 if read.plan is not None else NEVER, dtype=np.int64)
        if read.plan is not None:  # a chunk read twice in this read: it comes back after the later read
            np.maximum.at(due, read.chunk_of, read.plan[0])
        self.cache.keep(read.chunks, due, data, read.plan[1] if read.plan is not None else 0)
