"""Read groups in local worker processes that heal: a worker that dies (the OOM killer, a crash in a decoder, a
SIGKILL) is replaced and the groups it held are computed again, so the batches are those of an undisturbed run.

Each worker is a spawned process (fork would copy JAX's threads) that gets the group function once, pickled with
cloudpickle, and computes up to `per_worker` groups at once on as many threads; results come back in the order they
finish, and this process hands them out in group order. At most `(count + 1) * per_worker` groups are computed ahead
of the caller (their results wait here until taken).

A result's NumPy arrays travel out of band (pickle protocol 5): the worker copies them into one file in /dev/shm and
sends the rest through its pipe; this process maps the file, removes its name at once and hands out arrays that
view the mapping (no copy; the memory goes with the last array). Small results, and results when /dev/shm lacks
room, go through the pipe. Files a dead worker left are removed when it is replaced, when the iterator closes, and
by the workers themselves when their owner dies; files of an owner killed with its workers, by the next iterator
that starts workers on the host.

Replacing workers, computing groups again and naming a group that kills its workers: loader/executors/schedule.py.
Workers end with their owner (loader/executors/workers.py `exit_with_owner`) and when the iterator is closed.
"""

from __future__ import annotations

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

import numpy as np

from loader.executors import transport
from loader.executors.schedule import Died, Result, Scheduled, Worker
from loader.executors.workers import exit_with_owner

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Processes:
    count: int  # worker processes
    per_worker: int = 2  # groups each worker computes at once (on as many threads)
    describe: Callable[[int], str] = str  # what a group holds, for errors ("batches 4-7: shard ..., records ...")

    def map(self, fn: Callable[[Any], Any], num_groups: int, args: Callable[[int], Any] | None = None) -> _Groups:
        return _Groups(fn, num_groups, self, args)


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
            # copied by NumPy, which lets go of the GIL (a slice assignment to the mmap held it: a group of 64 MB
            # kept the worker's other threads, its gs:// event loop among them, waiting ~30 ms)
            target = np.frombuffer(mapped, dtype=np.uint8)
            places, at = [], 0
            for v in views:
                target[at:at + v.nbytes] = np.frombuffer(v, dtype=np.uint8)
                places.append((at, v.nbytes))
                at += v.nbytes
            del target  # the mmap closes only once no array holds it
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


def _sweep_orphans() -> None:
    """Removes /dev/shm result files whose owner process is gone: left when the owner and its workers were killed
    together (SIGKILL to the process group, a container's OOM kill), so no one was left to remove them."""
    for path in glob.glob(os.path.join(SHM, "loader-*-*")):
        owner = os.path.basename(path).split("-")[1]
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            try:
                os.unlink(path)
            except OSError:
                pass


READY = "ready"  # a worker's first message: it started and holds the group function


def _serve(conn, payload: bytes, owner: int, threads: int, prefix: str) -> None:
    """A worker: computes the groups it is sent, `threads` at once, and sends back (group, ok, result or error).
    A terminal's Ctrl-C, which reaches the workers too, is its owner's to handle (the owner stops them): each worker
    printed a KeyboardInterrupt traceback of its own beside the owner's."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    lock, making = threading.Lock(), threading.Condition()
    serials = itertools.count()
    files = {"making": 0, "stopped": False}  # results being written to /dev/shm; whether no more may be

    def stop_making_files() -> None:
        """No result file is made from now on, and those being made are finished: then a sweep removes them all (a
        group thread inside _pack made its file after the sweep, and the owner that would have taken it was gone:
        up to 200 MB a file stayed in /dev/shm, which is memory)."""
        with making:
            files["stopped"] = True
            making.wait_for(lambda: not files["making"], timeout=10)

    def owner_gone() -> None:
        stop_making_files()
        _sweep(f"{prefix}-*")

    exit_with_owner(owner, before_exit=owner_gone)
    fn = pickle.loads(payload)
    conn.send(READY)

    def run(g: int, arg: Any) -> None:
        try:
            value = transport.compact(fn(arg))
            with making:
                if files["stopped"]:
                    return
                files["making"] += 1
            try:
                message = (g, True, _pack(value, prefix, next(serials)))
            finally:
                with making:
                    files["making"] -= 1
                    making.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the owner, which raises it where the batch is taken
            message = (g, False, _portable(e))
        with lock:
            conn.send(message)

    pool = ThreadPoolExecutor(threads, thread_name_prefix="group")
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):  # the owner's end of the pipe closed: it died (its stop() kills this process)
            owner_gone()
            break
        if job is None:
            break
        pool.submit(run, *job)
    os._exit(0)  # without waiting for groups in progress: their results are no longer wanted


def _portable(error: BaseException) -> BaseException:
    """`error`, or one of its type and message where it does not pickle (its chain is lost either way)."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any failure to round-trip
        return RuntimeError(f"{type(error).__name__}: {error}")


class _Process(Worker):
    def __init__(self, payload: bytes, threads: int, number: int, prefix: str):
        super().__init__(number)
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, payload, os.getpid(), threads, prefix), daemon=True,
                                       name=f"loader-worker-{number}")
        self.process.start()
        child.close()
        self.ready = False  # until its first message

    def label(self) -> str:
        return f"worker {self.number} (pid {self.process.pid})"

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


class _Groups(Scheduled):
    """The groups of one iterator, in order, from local worker processes."""

    def __init__(self, fn: Callable[[Any], Any], num_groups: int, spec: Processes,
                 args: Callable[[int], Any] | None = None):
        import cloudpickle  # grain's own workers pickle with it: lambdas and local functions travel

        try:
            self._payload = cloudpickle.dumps(fn)
        except Exception as e:  # noqa: BLE001 - whatever does not pickle, named
            raise ValueError(f"worker_count={spec.count} sends the reader, decoder and map (or tokenize) functions to "
                             f"worker processes, and they do not pickle ({type(e).__name__}: {e}); use worker_count=0, "
                             "or functions and objects that pickle") from None
        _sweep_orphans()
        self._prefix = f"loader-{os.getpid()}-{uuid.uuid4().hex[:12]}"  # this iterator's /dev/shm files
        self._threads = spec.per_worker
        super().__init__(num_groups, spec.count, spec.per_worker, spec.describe, args)

    def _start(self, number: int) -> _Process:
        return _Process(self._payload, self._threads, number, self._prefix)

    def _send(self, worker: _Process, group: int, arg: Any) -> None:
        worker.conn.send((group, arg))

    def _wait(self, timeout: float | None = None) -> list:
        handles = {h: w for w in self._workers for h in self._handles(w)}
        events = []
        ready = multiprocessing.connection.wait(list(handles), timeout)
        for worker in {id(handles[h]): handles[h] for h in ready}.values():
            events += self._events(worker)
        return events

    def _handles(self, worker: _Process) -> tuple:
        """What becomes ready when `worker` has something to say: its pipe, and its end."""
        return worker.conn, worker.process.sentinel

    def _events(self, worker: _Process) -> list:
        """What `worker` sent, and its end if it ended."""
        events = []
        try:
            while worker.conn.poll():  # results it sent before it ended count
                message = worker.conn.recv()
                if message == READY:
                    worker.ready = True
                    self._failed_starts = 0  # (those that end before they start: counted in a row)
                    continue
                g, ok, value = message
                events.append(Result(worker, g, ok, transport.expand(_unpack(value)) if ok else value))
        except (EOFError, OSError, pickle.UnpicklingError):
            pass
        if not worker.process.is_alive() or worker.conn.closed:
            events.append(Died(worker, worker.how_it_ended()))
        return events

    def _stop(self, worker: _Process) -> None:
        worker.stop()
        _sweep(f"{self._prefix}-{worker.process.pid}-*")  # a result it wrote and never sent

    def _stopped_all(self) -> None:
        _sweep(f"{self._prefix}-*")
