"""Read groups in local worker processes that heal: a worker that dies (the OOM killer, a crash in a decoder, a
SIGKILL) is replaced and the groups it held are computed again, so the batches are those of an undisturbed run.

Each worker is a spawned process (fork would copy JAX's threads) that gets the group function once, pickled with
cloudpickle, and computes up to `per_worker` groups at once on as many threads; results come back through its pipe
in the order they finish, and this process hands them out in group order. At most `count * per_worker` groups are
computed ahead of the caller (their results wait here until taken).

A group whose worker died is computed again alone in a worker (nothing else is sent there meanwhile), so a record
that kills every worker that reads it is found: after MAX_DEATHS deaths with the same group the iterator raises a
ValueError naming the group's shards and records, instead of replacing workers forever. Workers end with their
owner (loader/workers.py `exit_with_owner`) and when the iterator is closed.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from loader.workers import exit_with_owner

log = logging.getLogger(__name__)

MAX_DEATHS = 3  # a group that this many of its workers died computing is an error, not retried again


@dataclasses.dataclass(frozen=True)
class Processes:
    count: int  # worker processes
    per_worker: int = 2  # groups each worker computes at once (on as many threads)
    describe: Callable[[int], str] = str  # what a group holds, for errors ("batches 4-7: shard ..., records ...")

    def map(self, fn: Callable[[int], Any], num_groups: int) -> _Groups:
        return _Groups(fn, num_groups, self)


def _serve(conn, payload: bytes, owner: int, threads: int) -> None:
    """A worker: computes the groups it is sent, `threads` at once, and sends back (group, ok, result or error)."""
    exit_with_owner(owner)
    fn = pickle.loads(payload)
    lock = threading.Lock()

    def run(g: int) -> None:
        try:
            message = (g, True, fn(g))
        except BaseException as e:  # noqa: BLE001 - handed to the owner, which raises it where the batch is taken
            message = (g, False, _portable(e))
        with lock:
            conn.send(message)

    pool = ThreadPoolExecutor(threads, thread_name_prefix="group")
    while True:
        try:
            g = conn.recv()
        except (EOFError, OSError):
            break
        if g is None:
            break
        pool.submit(run, g)
    os._exit(0)  # without waiting for groups in progress: their results are no longer wanted


def _portable(error: BaseException) -> BaseException:
    """`error`, or one of its type and message where it does not pickle (its chain is lost either way)."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any failure to round-trip
        return RuntimeError(f"{type(error).__name__}: {error}")


class _Worker:
    def __init__(self, payload: bytes, threads: int, number: int):
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, payload, os.getpid(), threads), daemon=True,
                                       name=f"loader-worker-{number}")
        self.process.start()
        child.close()
        self.number = number
        self.groups: set[int] = set()  # sent, not yet answered
        self.alone = False  # computing a group a worker died with: nothing else is sent here until it answers

    def how_it_ended(self) -> str:
        self.process.join(timeout=1)
        code = self.process.exitcode
        if code is None:
            return "its pipe closed"
        if code < 0:
            try:
                return f"signal {signal.Signals(-code).name}"
            except ValueError:
                return f"signal {-code}"
        return f"exit code {code}"

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class _Groups:
    """The groups of one iterator, in order."""

    def __init__(self, fn: Callable[[int], Any], num_groups: int, spec: Processes):
        import cloudpickle  # grain's own workers pickle with it: lambdas and local functions travel

        try:
            self._payload = cloudpickle.dumps(fn)
        except Exception as e:  # noqa: BLE001 - whatever does not pickle, named
            raise ValueError(f"worker_count={spec.count} sends the reader, decoder and map functions to worker "
                             f"processes, and they do not pickle ({type(e).__name__}: {e}); use worker_count=0, "
                             "or functions and objects that pickle") from None
        self._spec = spec
        self._n = num_groups
        self._window = spec.count * spec.per_worker
        self._started = 0  # workers started, replacements included (names them in logs)
        self._workers = [self._start() for _ in range(spec.count)]
        self._new = 0  # the next group never sent
        self._again: collections.deque[int] = collections.deque()  # groups a worker died with, to compute again
        self._deaths: collections.Counter = collections.Counter()
        self._done: dict[int, tuple[bool, Any]] = {}
        self._next = 0  # the next group to hand out
        self._closed = False

    def _start(self) -> _Worker:
        self._started += 1
        return _Worker(self._payload, self._spec.per_worker, self._started)

    def __iter__(self):
        return self

    def __next__(self):
        if self._closed or self._next >= self._n:
            raise StopIteration
        try:
            while self._next not in self._done:
                self._send()
                self._receive()
        except BaseException:
            self.close()
            raise
        ok, value = self._done.pop(self._next)
        self._next += 1
        if not ok:
            self.close()
            raise value
        return value

    def _send(self) -> None:
        """Sends groups to workers with room: again-groups each alone to an idle worker first, then new groups
        within the window."""
        while self._again:
            idle = [w for w in self._workers if not w.groups]
            if not idle:
                return  # nothing new either: an again-group waits for the first idle worker
            g = self._again.popleft()
            idle[0].groups.add(g)
            idle[0].alone = True
            idle[0].conn.send(g)
        while self._new < min(self._n, self._next + self._window):
            room = [w for w in self._workers if not w.alone and len(w.groups) < self._spec.per_worker]
            if not room:
                return
            worker = min(room, key=lambda w: len(w.groups))
            worker.groups.add(self._new)
            worker.conn.send(self._new)
            self._new += 1

    def _receive(self) -> None:
        """Waits for a result or a worker's end, and takes what came."""
        handles = {}
        for w in self._workers:
            handles[w.conn] = handles[w.process.sentinel] = w
        for worker in {id(handles[h]): handles[h] for h in multiprocessing.connection.wait(list(handles))}.values():
            try:
                while worker.conn.poll():  # results it sent before it ended count
                    g, ok, value = worker.conn.recv()
                    worker.groups.discard(g)
                    worker.alone = False
                    self._done[g] = (ok, value)
            except (EOFError, OSError, pickle.UnpicklingError):
                pass
            if not worker.process.is_alive() or worker.conn.closed:
                self._replace(worker)

    def _replace(self, worker: _Worker) -> None:
        how = worker.how_it_ended()
        worker.stop()
        lost = sorted(worker.groups)
        for g in lost:
            self._deaths[g] += 1
            if self._deaths[g] >= MAX_DEATHS:
                raise ValueError(f"a loader worker process ended {self._deaths[g]} times while computing "
                                 f"{self._spec.describe(g)} (the last: {how}): a record there crashes the decoder "
                                 "or map function, or needs more memory than the worker has; run with worker_count=0 "
                                 "to see the error, or give the host more memory")
        self._workers[self._workers.index(worker)] = self._start()
        self._again.extend(lost)
        log.warning("loader worker %d (pid %s) ended (%s) with %d group(s) in progress; started another, which "
                    "computes them again", worker.number, worker.process.pid, how, len(lost))

    def close(self) -> None:
        """Stops every worker (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            w.stop()
        self._done.clear()

    def __del__(self):
        if not getattr(self, "_closed", True):
            self.close()
