"""Read groups in local worker processes that heal: a worker that dies (the OOM killer, a crash in a decoder, a
SIGKILL) is replaced and the groups it held are computed again, so the batches are those of an undisturbed run.

Each worker is a spawned process (fork would copy JAX's threads) that gets the group function once, pickled with
cloudpickle, and computes up to `per_worker` groups at once on as many threads; results come back in the order they
finish, and this process hands them out in group order. At most `count * per_worker` groups are computed ahead of
the caller (their results wait here until taken).

A result's NumPy arrays travel out of band (pickle protocol 5): the worker copies them into one file in /dev/shm and
sends the rest through its pipe; this process maps the file, removes its name at once and hands out arrays that
view the mapping (no copy; the memory goes with the last array). Small results, and results when /dev/shm lacks
room, go through the pipe. Files a dead worker left are removed when it is replaced, when the iterator closes, and
by the workers themselves when their owner dies.

A group whose worker died is computed again alone in a worker (nothing else is sent there meanwhile), so a record
that kills every worker that reads it is found: after MAX_DEATHS deaths with the same group the iterator raises a
ValueError naming the group's shards and records, instead of replacing workers forever. Workers end with their
owner (loader/workers.py `exit_with_owner`) and when the iterator is closed.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import glob
import itertools
import logging
import mmap
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import uuid
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


SHM = "/dev/shm"
SHM_MIN_BYTES = 1 << 20  # results with fewer bytes of arrays go through the pipe


def _pack(value: Any, prefix: str, serial: int) -> tuple:
    """`value` for the pipe: ("pipe", pickle) or ("shm", pickle without its arrays, file name, [(offset, size)])."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    views = [b.raw() for b in buffers]
    size = sum(v.nbytes for v in views)
    if size < SHM_MIN_BYTES or not os.path.isdir(SHM) or _free(SHM) < 2 * size:
        return ("pipe", pickle.dumps(value, protocol=5))
    name = f"{prefix}-{os.getpid()}-{serial}"
    fd = os.open(os.path.join(SHM, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as mapped:
            places, at = [], 0
            for v in views:
                mapped[at:at + v.nbytes] = v
                places.append((at, v.nbytes))
                at += v.nbytes
    finally:
        os.close(fd)
    return ("shm", data, name, places)


def _unpack(packed: tuple) -> Any:
    if packed[0] == "pipe":
        return pickle.loads(packed[1])
    _, data, name, places = packed
    path = os.path.join(SHM, name)
    fd = os.open(path, os.O_RDWR)
    try:
        mapped = mmap.mmap(fd, places[-1][0] + places[-1][1])
    finally:
        os.close(fd)
        os.unlink(path)
    view = memoryview(mapped)
    return pickle.loads(data, buffers=[view[at:at + size] for at, size in places])


def _free(path: str) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def _sweep(pattern: str) -> None:
    """Removes the /dev/shm files matching `pattern` (results nobody will take)."""
    for path in glob.glob(os.path.join(SHM, pattern)):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _serve(conn, payload: bytes, owner: int, threads: int, prefix: str) -> None:
    """A worker: computes the groups it is sent, `threads` at once, and sends back (group, ok, result or error)."""
    exit_with_owner(owner, before_exit=functools.partial(_sweep, f"{prefix}-*"))
    fn = pickle.loads(payload)
    lock = threading.Lock()
    serials = itertools.count()

    def run(g: int) -> None:
        try:
            message = (g, True, _pack(fn(g), prefix, next(serials)))
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
    def __init__(self, payload: bytes, threads: int, number: int, prefix: str):
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, payload, os.getpid(), threads, prefix), daemon=True,
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
        self._prefix = f"loader-{os.getpid()}-{uuid.uuid4().hex[:12]}"  # this iterator's /dev/shm files
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
        return _Worker(self._payload, self._spec.per_worker, self._started, self._prefix)

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
                    self._done[g] = (ok, _unpack(value) if ok else value)
            except (EOFError, OSError, pickle.UnpicklingError):
                pass
            if not worker.process.is_alive() or worker.conn.closed:
                self._replace(worker)

    def _replace(self, worker: _Worker) -> None:
        how = worker.how_it_ended()
        worker.stop()
        _sweep(f"{self._prefix}-{worker.process.pid}-*")  # a result it wrote and never sent
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
        _sweep(f"{self._prefix}-*")

    def __del__(self):
        if not getattr(self, "_closed", True):
            self.close()
