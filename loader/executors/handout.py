"""The caller's side of an executor: its groups' batches handed out one by one, what computing them cost (stage by
stage, loader/executors/stages.py), and the workers' controls, for every loader (plain, mixture, packed)."""

from __future__ import annotations

import atexit
import collections
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator

import numpy as np

from loader.executors.stages import StageTimes


log = logging.getLogger(__name__)

# A batch the caller has waited this long for gets a log line, and again at each doubling: a map function that does not
# return, a read that hangs, workers without CPU would otherwise leave a run silent. One thread a process looks at the
# waiting iterators every STALL_POLL seconds.
STALL_SECONDS = 60.0
STALL_POLL = 1.0
_WAITING: weakref.WeakSet = weakref.WeakSet()
_watcher: tuple[int, threading.Thread] | None = None  # (its process, the thread)
_watcher_lock = threading.Lock()


def _watch(iterator) -> None:
    """Has the stall watcher look at `iterator` (while its `_waiting_since` is set), started once a process."""
    global _watcher
    _WAITING.add(iterator)
    if _watcher is None or _watcher[0] != os.getpid():
        with _watcher_lock:
            if _watcher is None or _watcher[0] != os.getpid():
                thread = threading.Thread(target=_watch_stalls, name="loader-stall-watch", daemon=True)
                thread.start()
                _watcher = (os.getpid(), thread)


def _watch_stalls() -> None:
    while True:
        time.sleep(STALL_POLL)
        now = time.monotonic()
        for iterator in list(_WAITING):
            since = iterator.__dict__.get("_waiting_since")
            if since is None:
                continue
            told_since, next_at = iterator.__dict__.get("_stall_told", (None, 0.0))
            if told_since != since:
                next_at = STALL_SECONDS
            if now - since >= next_at:
                iterator.__dict__["_stall_told"] = (since, 2 * next_at)
                batch = iterator.__dict__.get("_next", iterator.__dict__.get("_consumed", "?"))
                log.warning("waiting %.0f s for batch %s: no batch came. A map function that does not return, a read "
                            "that hangs (a gs:// link), or workers without CPU; `py-spy dump --pid %d` (and its worker "
                            "processes') shows where", now - since, batch, os.getpid())


class End:
    """A group past the last one: a plan whose end is found as it goes (a packed loader's) maps its groups past the end
    to END, and the iterator stops at the first. (grain's threads drop None results, so None cannot say it.)"""

    def __reduce__(self):
        return "END"  # unpickled as this module's END


END = End()


class HostBatches:
    """Hands out, one by one, the batches of the groups the executor yields (up to END, if it comes)."""

    def __init__(self, groups: Iterator):
        self.groups = groups
        self._pending: collections.deque = collections.deque()
        self.times = StageTimes()

    def next(self):
        if self.groups is None:
            raise ValueError("this loader iterator was closed; set_state() (or a new iter()) starts reading again")
        if not self._pending:
            cpu, wall = time.thread_time(), time.perf_counter()
            group = next(self.groups)  # StopIteration at the end
            if group is END:
                raise StopIteration
            self._pending.extend(group.batches)
            self.times.add(group, time.thread_time() - cpu, time.perf_counter() - wall)
        elif hasattr(self.groups, "poll"):  # workers: take what they finished, send them more (schedule.py)
            self.groups.poll()
        return self._pending.popleft()

    def close(self) -> None:
        """Stops the executor's threads or worker processes. grain's iterators close again when collected, which
        fails once the interpreter has torn its modules down: drop them now, while it has not."""
        self._pending.clear()
        if self.groups is not None:
            self.groups.close()
            self.groups = None


class WorkerControls:
    """What an iterator over `self._host` (a HostBatches) says of its workers and lets the caller change."""

    _host: HostBatches | None
    _loader: object  # its loader: `config.worker_count`
    _ray: bool = False  # its workers are Ray actors
    _failed: bool = False  # the last batch asked for raised
    _resized: int | None = None  # resize_workers()'s count: every (re)start after it starts this many
    _waiting_since: float | None = None  # when the caller asked for the batch it waits for (the stall watcher's)
    _taking: threading.Lock  # one batch at a time (made by the iterator's __init__): two threads' calls interleaved
    #                          on the workers' pipes, and hung

    def _worker_count(self) -> int | str:
        """The workers a (re)start (set_state(), a batch that raised) makes: resize_workers()'s count once called,
        else the loader's worker_count."""
        return self._loader.config.worker_count if self._resized is None else self._resized

    def _handed(self, take, restart):
        """take()'s batch. A batch that raised is computed again by the next call, after `restart()` (an iterator from
        the batch not handed out), never skipped: the executors move past a group that raised (grain's threads) or stop
        (worker processes), so a caller that catches an error and asks again would otherwise get later batches, or
        none, and a state that no longer says which it had."""
        with self._taking:
            if self._failed:
                self._failed = False
                restart()
            elif getattr(self._host, "groups", None) is None:
                return take()  # closed by the caller: says so until set_state()
            self._waiting_since = time.monotonic()
            _watch(self)
            try:
                return take()
            except StopIteration:
                raise
            except BaseException:  # (a Ctrl-C caught by the caller too, as a notebook does: the executor closed on it)
                self._failed = True
                self.close()
                raise
            finally:
                self._waiting_since = None

    def stage_times(self, reset: bool = False) -> StageTimes:
        """What the groups handed out so far cost, stage by stage (loader/executors/stages.py); `.report()` says which
        stage bounds the rate. Counted from the last (re)start (iter(), set_state()), or the last call with reset=True,
        which starts new totals."""
        times = self._host.times
        if reset:
            self._host.times = StageTimes()
        return times

    def worker_setting(self) -> str:
        """Where groups are computed now: "threads here", "2 worker processes", ... (worker_count="auto" changes
        it as it measures); "closed" once the iterator is (until set_state)."""
        groups = getattr(self._host, "groups", None)
        if groups is None:
            return "closed"
        if hasattr(groups, "setting"):
            return str(groups.setting())
        if not hasattr(groups, "worker_count"):
            return "threads here"
        n = groups.worker_count
        if self._ray:
            return f"{n} Ray actor{'s' if n != 1 else ''}"
        return f"{n} worker process{'es' if n != 1 else ''}"

    def resize_workers(self, count: int) -> None:
        """With worker_count= (local processes or Ray actors): `count` workers from now on (more start at once; fewer
        stop taking groups and stop once theirs are done), after a set_state() too. The batches stay the same. With
        worker_count="auto": `count` worker processes from now on, tuned no more. On a closed iterator: from its
        set_state() on."""
        if self._loader.config.worker_count == 0:
            raise ValueError("resize_workers() needs a loader with worker_count >= 1 or 'auto' (this one reads on "
                             "threads: worker_count=0)")
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
            raise ValueError(f"resize_workers() takes a worker count >= 1 (got {count!r}); to read on this process's "
                             "threads, make the loader with worker_count=0")
        self._resized = int(count)
        groups = getattr(self._host, "groups", None)
        if groups is not None:
            groups.resize(self._resized)


_OPEN_ITERATORS: weakref.WeakSet = weakref.WeakSet()


def close_at_exit(iterator) -> None:
    """Closes `iterator` at exit if it is still open, before the interpreter tears its modules down (grain's threads
    and the worker processes, stopped later by garbage collection, print tracebacks then)."""
    if not _OPEN_ITERATORS:
        atexit.unregister(_close_open_iterators)  # registered once however often the set empties and refills
        atexit.register(_close_open_iterators)
    _OPEN_ITERATORS.add(iterator)


def _close_open_iterators() -> None:
    for iterator in list(_OPEN_ITERATORS):
        iterator.close()
