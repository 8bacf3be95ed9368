"""What every executor with workers does alike: groups handed out in order, a window of groups computed ahead that
slides with each hand-out, workers that die replaced and their groups computed again (each alone in a worker, so a
record that kills every worker that reads it is found and named), and the worker count changed while iterating.

An executor's workers (local processes, Ray actors, this process's threads) subclass `Worker`; its iterator
subclasses `Scheduled` and says how to start a worker, send it a group, wait for what happened and stop it. A group
is `fn(args(g))`: `args(g)`, the plan's part, runs here when the group is sent (kept until it is handed out, so a
group computed again gets the same); `fn`, the work, runs in the worker.
"""

from __future__ import annotations

import abc
import collections
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

MAX_DEATHS = 3  # a group that this many of its workers died computing is an error, not retried again


class Worker:
    def __init__(self, number: int):
        self.number = number  # 1, 2, ... in the order started (replacements included): names it in logs
        self.groups: set[int] = set()  # sent, not yet answered
        self.alone = False  # computing a group a worker died with: nothing else is sent here until it answers
        self.retiring = False  # the worker count went down: nothing more is sent; stopped once idle
        self.ready = True  # it started (a local process: once it said so; one that ends before failed to start)
        self.placed = True  # it can take groups (a Ray actor: once the cluster placed it; one may never be)

    @property
    def isolated(self) -> bool:
        """Whether a group that ended a worker may be computed here again (not in the caller's own process)."""
        return True

    def label(self) -> str:
        return f"worker {self.number}"


# What `Scheduled._wait` reports: a worker's answer, or a worker's end.
Result = collections.namedtuple("Result", "worker group ok value")
Died = collections.namedtuple("Died", "worker how with_node", defaults=(False,))  # with_node: its machine was lost


class Scheduled(abc.ABC):
    """fn(0), ..., fn(num_groups - 1) in order, computed by `count` workers, `per_worker` groups each at once. The
    window of groups not yet handed out holds (count + 1) * per_worker: every worker busy, and a worker's worth done
    ahead, so a worker that finishes while the caller is slow gets its next group at once."""

    def __init__(self, num_groups: int, count: int, per_worker: int, describe: Callable[[int], str],
                 args: Callable[[int], Any] | None = None):
        self._n = num_groups
        self._argfn = args
        self._args: dict[int, Any] = {}  # args of the groups sent and not yet handed out
        self._per_worker = per_worker
        self._describe = describe
        self._started = 0
        self._workers: list[Worker] = []
        self._new = 0  # the next group never sent
        self._again: collections.deque[int] = collections.deque()  # groups a worker died with, to compute again
        self._resend: collections.deque[int] = collections.deque()  # groups of a worker that never started
        self._failed_starts = 0
        self._deaths: collections.Counter = collections.Counter()
        self._done: dict[int, tuple[bool, Any]] = {}
        self._next = 0  # the next group to hand out
        self._handed_at: float | None = None  # when the caller took the last group
        self._closed = False
        if count:  # 0: the subclass starts its workers itself
            self.resize(count)

    # --- what an executor says ---------------------------------------------------------------
    @abc.abstractmethod
    def _start(self, number: int) -> Worker:
        """Starts worker `number`."""

    @abc.abstractmethod
    def _send(self, worker: Worker, group: int, arg: Any) -> None:
        """Has `worker` compute `group`: fn(arg)."""

    @abc.abstractmethod
    def _wait(self, timeout: float | None = None) -> list:
        """What happened, a list of Result and Died: blocks until something did (timeout=None), or returns what has
        by now (timeout=0; maybe nothing)."""

    @abc.abstractmethod
    def _stop(self, worker: Worker) -> None:
        """Ends `worker` (it may have ended already)."""

    def _stopped_all(self) -> None:
        """After close: anything the executor keeps beside its workers."""

    # --- the schedule -------------------------------------------------------------------------
    @property
    def worker_count(self) -> int:
        return sum(not w.retiring for w in self._workers)

    def resize(self, count: int) -> None:
        """Workers from now on: more start at once; fewer stop taking groups, and stop once their groups are done.
        The groups, and so the batches, stay the same."""
        if count < 1:
            raise ValueError(f"a worker count must be >= 1 (got {count})")
        active = sorted((w for w in self._workers if not w.retiring), key=lambda w: not w.placed)  # (stable)
        for w in active[count:]:  # those still waiting to be placed retire first
            w.retiring = True
        for _ in range(count - len(active)):
            self._started += 1
            self._workers.append(self._start(self._started))
        self._retire_idle()

    def __iter__(self):
        return self

    def __next__(self):
        if self._closed or self._next >= self._n:
            raise StopIteration
        asked = time.perf_counter()
        try:
            self._take(self._wait(0))  # what finished while the caller was away frees room for more
            while self._next not in self._done:
                self._take(self._wait())
        except BaseException:
            self.close()
            raise
        ok, value = self._done.pop(self._next)
        self._args.pop(self._next, None)
        self._next += 1
        if not ok:
            self.close()
            raise value
        self.poll()  # the window moved on by one group: it is sent now, not once the window has run dry
        handed = time.perf_counter()
        busy = asked - self._handed_at if self._handed_at is not None else 0.0
        self._handed_at = handed
        self._handed(self._next - 1, value, handed - asked, busy)
        return value

    def poll(self) -> None:
        """Takes what the workers finished and sends groups to those with room, without blocking: the caller calls
        it between groups (every batch), so a worker that finished gets its next group within a batch's time."""
        if self._closed:
            return
        try:
            self._take(self._wait(0))
        except BaseException:
            self.close()
            raise

    def _take(self, events: list) -> None:
        """Books what happened (answers, workers' ends), then sends groups to the workers with room."""
        if self._closed:  # close() from another thread while this one waited: its workers ended, none is restarted
            raise ValueError("this loader iterator was closed while a batch was awaited (close() from another "
                             "thread); set_state() (or a new iter()) starts reading again")
        for event in events:
            if isinstance(event, Died):
                self._replace(event.worker, event.how, event.with_node)
            elif event.worker in self._workers:
                event.worker.groups.discard(event.group)
                event.worker.alone = False
                self._done[event.group] = (event.ok, event.value)
        self._retire_idle()
        self._dispatch()

    def _handed(self, group: int, value: Any, wait: float, busy: float) -> None:
        """After group `group` is handed to the caller, who waited `wait` s for it, `busy` s after it took the one
        before (a tuner measures here)."""

    def _dispatch(self) -> None:
        """Sends groups to workers with room: again-groups each alone to an idle worker first, then new groups
        within the window."""
        active = [w for w in self._workers if not w.retiring and w.placed]
        while self._resend:  # never begun: any worker with room
            room = [w for w in active if not w.alone and len(w.groups) < self._per_worker]
            if not room:
                return
            g = self._resend.popleft()
            room[0].groups.add(g)
            self._send(room[0], g, self._arg(g))
        while self._again:
            idle = [w for w in active if not w.groups and w.isolated]
            if not idle:
                return  # nothing new either: an again-group waits for the first idle worker
            g = self._again.popleft()
            idle[0].groups.add(g)
            idle[0].alone = True
            self._send(idle[0], g, self._arg(g))
        window = (len(active) + 1) * self._per_worker  # every worker busy, and a worker's worth done ahead
        while self._new < min(self._n, self._next + window):
            room = [w for w in active if not w.alone and len(w.groups) < self._per_worker]
            if not room:
                return
            worker = min(room, key=lambda w: len(w.groups))
            worker.groups.add(self._new)
            self._send(worker, self._new, self._arg(self._new))
            self._new += 1

    def _arg(self, g: int) -> Any:
        """What group g's worker is sent: args(g), made once (a group computed again gets the same), or g."""
        if self._argfn is None:
            return g
        if g not in self._args:
            self._args[g] = self._argfn(g)
        return self._args[g]

    def _retire_idle(self) -> None:
        for w in [w for w in self._workers if w.retiring and not w.groups]:
            self._workers.remove(w)
            self._stop(w)

    def _replace(self, worker: Worker, how: str, with_node: bool = False) -> None:
        if worker not in self._workers:
            return
        self._stop(worker)
        lost = sorted(worker.groups)
        if not worker.ready and not with_node:  # it ended before it began any group: not their fault
            self._failed_starts += 1
            self._resend.extend(lost)
            self._workers.remove(worker)
            if self._failed_starts >= MAX_DEATHS:
                self._cannot_start(how)  # raises, or starts no process again
                return
            if not worker.retiring:
                self._started += 1
                self._workers.append(self._start(self._started))
                self._replaced(worker, self._workers[-1])
            log.warning("loader %s ended before it started (%s); starting another", worker.label(), how)
            return
        if not with_node:  # a machine lost is not its groups' fault (a record that crashes the decoder ends a process)
            self._blame(lost, how)
        index = self._workers.index(worker)
        if worker.retiring:
            self._workers.pop(index)
        else:
            self._started += 1
            self._workers[index] = self._start(self._started)
            self._replaced(worker, self._workers[index])
        (self._resend if with_node else self._again).extend(lost)  # (again: each alone, to find a record to blame)
        log.warning("loader %s ended%s (%s) with %d group(s) in progress; %s", worker.label(),
                    " with its node" if with_node else "", how, len(lost),
                    "another computes them again" if lost else "started another")

    def _blame(self, groups: list[int], how: str) -> None:
        """A worker died computing `groups`: MAX_DEATHS such deaths of one group are an error."""
        for g in groups:
            self._deaths[g] += 1
            if self._deaths[g] >= MAX_DEATHS:
                raise ValueError(f"a loader worker ended {self._deaths[g]} times while computing "
                                 f"{self._describe(g)} (the last: {how}): a record there crashes the decoder or map "
                                 "function, or needs more memory than the worker has; run with worker_count=0 to see "
                                 "the error, or give the workers more memory")

    def _replaced(self, worker: Worker, new: Worker) -> None:
        """`new` was started in place of `worker`, which ended (an executor that tracks its workers overrides this)."""

    def _cannot_start(self, how: str) -> None:
        """MAX_DEATHS workers ended before they started: an error (an executor that can go on without them
        overrides this)."""
        raise ValueError(f"loader worker processes end before they start ({self._failed_starts} of them, the last: "
                         f"{how}; its error is printed above): a script that starts them (worker_count=) must guard "
                         "its top level with `if __name__ == \"__main__\":` (each worker is spawned and imports the "
                         "script again), and the decoder and map functions must be importable there; or run with "
                         "worker_count=0")

    def close(self) -> None:
        """Stops every worker (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            self._stop(w)
        self._done.clear()
        self._args.clear()
        self._stopped_all()

    def __del__(self):
        if not getattr(self, "_closed", True):
            self.close()
