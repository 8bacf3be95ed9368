"""`worker_count="auto"`: read groups computed by this process's threads or by as many local worker processes as the
caller's demand needs (loader/executors/tuning.py chooses; this applies its choice).

All of it is one schedule (loader/executors/schedule.py): this process's threads are one more worker beside the
processes, so changing the setting changes only who gets the next groups. Nothing computed is thrown away, the
groups stay in order, a worker process that dies is replaced as with `worker_count=N`, and the batches are those of
any other setting. Threads here keep computing until the processes that replace them have started.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from loader.executors.processes import Processes, _Groups
from loader.executors.schedule import Result, Worker
from loader.executors.tuning import HERE, Setting, Tuner

log = logging.getLogger(__name__)


def loader_cores() -> int:
    """The cores this process may run on (its affinity: a container's or taskset's limit, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def idle_core_seconds(cores: set[int] | None = None) -> float | None:
    """Seconds the host's `cores` (default: this process's affinity) have been idle since boot, from /proc/stat (None
    where there is none): the cores nobody, the trainer included, is using."""
    try:
        cores = os.sched_getaffinity(0) if cores is None else cores
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except (OSError, AttributeError):
        return None
    ticks = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            fields = rest.split()
            ticks += int(fields[3]) + int(fields[4])  # idle, iowait
    return ticks / os.sysconf("SC_CLK_TCK")


@dataclasses.dataclass(frozen=True)
class Tuned:
    per_worker: int = 2  # groups each worker (this process's threads count as one) computes at once
    describe: Callable[[int], str] = str
    cores: int | None = None  # the cores the loader may use (default: loader_cores()): a worker process a core at most

    def map(self, fn: Callable[[Any], Any], num_groups: int, args: Callable[[int], Any] | None = None
            ) -> _TunedGroups:
        return _TunedGroups(fn, num_groups, self, args)


class _Here(Worker):
    """This process's threads as one worker: groups run on a thread pool; each answer is queued and a byte on a
    socket pair wakes the schedule's wait."""

    def __init__(self, fn: Callable[[Any], Any], threads: int, number: int):
        super().__init__(number)
        self._fn = fn
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="loader-group")
        self.answers: collections.deque = collections.deque()
        self.wake, self._bell = socket.socketpair()
        self.wake.setblocking(False)

    def label(self) -> str:
        return "this process's threads"

    @property
    def isolated(self) -> bool:
        return False  # a group that ended a worker process could end this one

    def submit(self, g: int, arg: Any) -> None:
        self.pool.submit(self._run, g, arg)

    def _run(self, g: int, arg: Any) -> None:
        try:
            answer = (g, True, self._fn(arg))
        except BaseException as e:  # noqa: BLE001 - raised where the batch is taken
            answer = (g, False, e)
        self.answers.append(answer)
        try:
            self._bell.send(b"\0")
        except OSError:  # stopped meanwhile: nobody wants the answer
            pass

    def take(self) -> list:
        try:
            while self.wake.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
        answers = []
        while self.answers:
            answers.append(self.answers.popleft())
        return answers

    def stop(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.wake.close()
        self._bell.close()


class _TunedGroups(_Groups):
    """The groups of one iterator, in order, from this process's threads or worker processes as the tuner says."""

    def __init__(self, fn: Callable[[Any], Any], num_groups: int, spec: Tuned,
                 args: Callable[[int], Any] | None = None):
        self._fn = fn
        self._starting: set[int] = set()  # ids of workers started for the new setting, not yet answered
        self._replacing = False  # _replace is replacing a worker of _starting
        self._rescuers: set[int] = set()  # ids of processes started for groups a worker died with (see _dispatch)
        self._no_processes = False  # worker processes could not start: threads here only
        self._outgoing: list = []  # workers the new setting drops once its own have started
        cores = spec.cores or loader_cores()
        idle = idle_core_seconds() is not None
        self.tuner = Tuner(max(1, cores - 1) if cores > 2 else cores, loader_cpu=self.cpu_seconds,
                           idle=idle_core_seconds if idle else None)
        self._tuning = True
        super().__init__(fn, num_groups, Processes(0, spec.per_worker, spec.describe), args)  # no workers yet
        self.apply(self.tuner.setting)

    # --- workers of two kinds ------------------------------------------------------------------
    def _send(self, worker, group: int, arg: Any) -> None:
        if isinstance(worker, _Here):
            worker.submit(group, arg)
        else:
            super()._send(worker, group, arg)

    def _handles(self, worker) -> tuple:
        return (worker.wake,) if isinstance(worker, _Here) else super()._handles(worker)

    def _events(self, worker) -> list:
        if isinstance(worker, _Here):
            return [Result(worker, g, ok, value) for g, ok, value in worker.take()]
        return super()._events(worker)

    def _wait(self, timeout: float | None = None) -> list:
        events = super()._wait(timeout)
        for e in events:
            if isinstance(e, Result):
                self._answered(e.worker)
        return events

    def _dispatch(self) -> None:
        """As Scheduled's, and a group that ended a worker process gets a worker process even when the setting has
        none (the next setting applied retires it)."""
        if self._again and not self._no_processes and not any(w.isolated and not w.retiring for w in self._workers):
            self._started += 1
            self._workers.append(self._start(self._started))
            self._rescuers.add(id(self._workers[-1]))
        super()._dispatch()
        if not self._again and self._rescuers:  # done: it retires once idle
            for w in self._workers:
                if id(w) in self._rescuers:
                    w.retiring = True
            self._rescuers.clear()

    def _stop(self, worker) -> None:
        if worker.isolated:
            super()._stop(worker)
        else:
            worker.stop()
        if self._replacing:  # the setting waits for the one started in its place (_replaced)
            self._starting.discard(id(worker))
        else:
            self._answered(worker)

    def _replace(self, worker, how: str, with_node: bool = False) -> None:
        self._replacing = id(worker) in self._starting
        try:
            super()._replace(worker, how, with_node)
        finally:
            if self._replacing and not self._starting:  # none started in its place
                self._started_all()
            self._replacing = False

    # --- the setting ---------------------------------------------------------------------------
    def setting(self) -> Setting:
        here = any(isinstance(w, _Here) and not w.retiring for w in self._workers)
        return Setting(here, sum(not isinstance(w, _Here) and not w.retiring for w in self._workers))

    def apply(self, setting: Setting) -> None:
        """Threads here on or off, and `setting.processes` worker processes (more start; fewer retire once idle).
        Workers dropped while new ones start (threads here, when processes replace them) keep computing until the new
        ones have answered: the caller is not left waiting on processes that are still importing."""
        if self._no_processes:
            setting = HERE
        self._outgoing = []  # a setting still starting is superseded: what it would drop is decided again here
        here = [w for w in self._workers if isinstance(w, _Here) and not w.retiring]
        processes = [w for w in self._workers if not isinstance(w, _Here) and not w.retiring]
        started = []
        if setting.here and not here:
            self._started += 1
            started.append(_Here(self._fn, self._threads, self._started))
        for _ in range(setting.processes - len(processes)):
            self._started += 1
            started.append(self._start(self._started))
        dropped = (here if not setting.here else []) + processes[setting.processes:]
        self._workers += started
        self._starting = {id(w) for w in started}
        if self._starting:
            self._outgoing = [w for w in dropped if isinstance(w, _Here)]
            dropped = [w for w in dropped if not isinstance(w, _Here)]
        for w in dropped:
            w.retiring = True
        self._retire_idle()
        if not self._starting:
            self._started_all()

    def _started_all(self) -> None:
        """The setting's new workers have all answered: what they replace stops taking groups; the tuner measures."""
        for w in self._outgoing:
            w.retiring = True
        self._outgoing = []
        self._retire_idle()
        self.tuner.ready(time.perf_counter())

    def resize(self, count: int) -> None:
        """`count` worker processes from now on, and no more tuning (this process only takes)."""
        if count < 1:
            raise ValueError(f"a worker count must be >= 1 (got {count})")
        self._tuning = False
        self.apply(Setting(False, count))

    def _answered(self, worker) -> None:
        if id(worker) in self._starting:
            self._starting.discard(id(worker))
            if not self._starting:
                self._started_all()

    def _replaced(self, worker, new) -> None:
        """A worker the new setting waits for ended: the setting waits for the one started in its place (else a
        measuring window opened before it answered and read low)."""
        if self._replacing:
            self._starting.add(id(new))

    def _cannot_start(self, how: str) -> None:
        """Worker processes cannot start here (an unguarded script, a function not importable in a worker): this
        process's threads compute everything, and the tuner tries no process again."""
        log.warning("loader worker processes end before they start (the last: %s; its error is printed above), so "
                    "worker_count='auto' reads on this process's threads only. A script that starts worker "
                    "processes must guard its top level with `if __name__ == \"__main__\":`", how)
        self._tuning = False
        self._no_processes = True
        self.apply(Setting(True, 0))
        self._resend.extend(self._again)  # groups a worker ended with: here, as no process can take them
        self._again.clear()

    def _handed(self, group: int, value: Any, wait: float, busy: float) -> None:
        if self._tuning:
            cpu = getattr(value, "cpu", None)
            change = self.tuner.taken(time.perf_counter(), getattr(value, "records", 1), wait, busy,
                                      sum(cpu.values()) if cpu else None)
            if change is not None:
                self.apply(change)

    def cpu_seconds(self) -> float:
        """CPU used so far by this process, its ended worker processes and those running."""
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system + sum(
            _process_cpu(w.process.pid) for w in self._workers if w.isolated)


def _process_cpu(pid: int) -> float:
    """A running process's CPU seconds (user and system), from /proc (0 where there is none)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

