"""Read groups on Ray actors, anywhere in a Ray cluster: preprocessing on CPU nodes beside the accelerator hosts.

    loader.load(src, batch_size=256, worker_count=16, ray_address="auto", ray_resources={"data_cpu": 1}, ...)

Each of `count` actors (1 CPU each, plus `resources`: a custom resource only CPU nodes offer places them there) gets
the group function once (through Ray's object store) and computes up to `per_worker` groups at once. An actor gets
groups once the cluster has placed it: those it cannot place (more actors than free CPUs, or a replacement for an
actor whose node was lost) wait, and the placed ones compute the batches meanwhile. Results come
back through the object store: a result's NumPy arrays are read in place, without a copy, on this host (they are
read-only). A group is a pure function of its index, so an actor that dies (its node preempted, the OOM killer) is
replaced and its groups are computed again, and the batches are those of the local loader (a death with its node
blames none of its groups, and the node's other actors, idle ones too, are replaced at once); the iterator's
`resize_workers(n)` adds or retires actors while iterating, with the same batches (loader/executors/schedule.py).

The actors are this process's: Ray ends them when it ends (they never outlive their owner), and `close()` kills
them. Ray is connected to on first use (`ray.init(address=...)`) and left connected.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

from loader.executors import transport
from loader.executors.schedule import Died, Result, Scheduled, Worker

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RayActors:
    address: str  # "auto", "host:port" or "ray://host:10001"
    count: int  # actors
    per_worker: int = 2  # groups each actor computes at once
    resources: Mapping[str, float] | None = None  # custom resources each actor needs, beside its CPU
    describe: Callable[[int], str] = str

    def map(self, fn: Callable[[Any], Any], num_groups: int, args: Callable[[int], Any] | None = None
            ) -> _ActorGroups:
        return _ActorGroups(fn, num_groups, self, args)


class _GroupActor:
    """One actor: computes groups of the function it was made with."""

    def __init__(self, fn: Callable[[Any], Any]):
        self._fn = fn

    def run(self, arg: Any) -> Any:
        return transport.compact(self._fn(arg))

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        """The Ray node this actor runs on: a death is the node's, not its groups', when that node is lost."""
        import ray

        return ray.get_runtime_context().get_node_id()


STALL_SECONDS = 60  # a wait this long for the actors is logged (an actor the cluster cannot place waits for ever)


def _stalled(waiting: int, resources) -> None:
    need = ", ".join(f"{k}: 1" if v == 1 else f"{k}: {v}" for k, v in {"CPU": 1, **dict(resources or {})}.items())
    log.warning("waited %ds for the loader's Ray actors (%d calls in progress); an actor the cluster cannot place "
                "waits until it can: each needs {%s} free (ray status shows what is), and an earlier loader's actors "
                "hold theirs until it is closed or collected", STALL_SECONDS, waiting, need)


def _connect(address: str):
    ray = _ray()
    if not ray.is_initialized():
        check_reachable(address)
        log.info("connecting to the Ray cluster at %s", address)
        try:
            init(ray, address=address, logging_level=logging.WARNING)
        except ConnectionError as e:
            if address != "auto":
                raise
            first = str(e).splitlines()[0]
            raise ValueError(f"no Ray cluster runs on this machine for address 'auto' to find ({first}): start one "
                             "here (ray start --head), join this machine to one (ray start "
                             "--address=HEAD:6379), or give the head's address") from None
    return ray


def deaths(ray) -> tuple[type, ...]:
    """What a call raises when its actor's process is gone: it died or was killed (RayActorError), Ray's memory
    monitor killed it (OutOfMemoryError: not a RayActorError), or its worker or node crashed."""
    errors = ray.exceptions
    return (errors.RayActorError, errors.OutOfMemoryError, errors.WorkerCrashedError, errors.NodeDiedError)


def ready_refs(ray, refs: list, *, block: bool, stall: float, stalled: Callable[[], None]) -> list:
    """The refs of `refs` that are ready now; with `block`, at least one, waited for, `stalled()` called after each
    `stall` seconds without one (a wait for an actor the cluster cannot place is said, not silent)."""
    ready: list = []
    while block and not ready:
        ready, _ = ray.wait(refs, num_returns=1, timeout=stall)
        if not ready:
            stalled()
    rest = [r for r in refs if r not in ready]
    return ready + (ray.wait(rest, num_returns=len(rest), timeout=0)[0] if rest else [])


def init(ray, **options) -> None:
    """ray.init(**options), keeping this process's own SIGTERM handler: Ray puts in its own (a sys.exit, and a C
    handler that dumps the stack and aborts), over the one `python -m trainer` ends a run with, in one line
    (trainer/preemption.py). A process without one of its own keeps Ray's."""
    import signal
    import threading

    main = threading.current_thread() is threading.main_thread()
    own = signal.getsignal(signal.SIGTERM) if main else None
    try:
        ray.init(**options)
    finally:
        if callable(own) and signal.getsignal(signal.SIGTERM) is not own:
            signal.signal(signal.SIGTERM, own)


def check_reachable(address: str, timeout: float = 10.0) -> None:
    """A ValueError at once where nothing answers at a HOST:PORT (or ray://HOST:PORT) address; Ray itself retries
    for about 14 minutes (20 attempts of ~42 s) before it says so."""
    target = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():  # "auto", "local": Ray's own
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        raise ValueError(f"no Ray cluster answers at {address} ({e.strerror or type(e).__name__}): start its head "
                         f"there (ray start --head --port={port}), or give the address `ray status` shows on the "
                         "head") from None


def _ray():
    try:
        import ray
    except ImportError:
        raise ValueError("ray_address= runs the loader's workers on a Ray cluster, and Ray is not installed: "
                         "pip install 'ray>=2.60'") from None
    return ray


class _Actor(Worker):
    def __init__(self, number: int, handle):
        super().__init__(number)
        self.handle = handle
        self.refs: dict = {}  # ObjectRef -> group
        self.placed = self.ready = False  # until its node() answers: the cluster placed it and it began
        self.node: str | None = None  # the Ray node it runs on, once placed
        self.since = time.monotonic()  # created (for the line about actors not placed)

    def label(self) -> str:
        return f"Ray actor {self.number}"


class _LostNodes:
    """Whether an actor died with its node (lost or preempted): then its groups are not to blame for its death (a
    record that crashes the decoder ends the actor's process, not its machine). The nodes are asked for once a
    `_wait`, and only when an actor died."""

    def __init__(self, ray):
        self._ray = ray
        self.dead: set[str] | None = None  # the nodes the cluster holds dead, once asked

    def __call__(self, worker: _Actor, error: BaseException) -> bool:
        if getattr(error, "preempted", False) or isinstance(error, self._ray.exceptions.NodeDiedError):
            return True
        if worker.node is None:
            return False
        if self.dead is None:
            try:
                self.dead = {n["NodeID"] for n in self._ray.nodes() if not n.get("Alive", True)}
            except Exception as e:  # noqa: BLE001 - the cluster's state unknown: the death is counted, as before
                log.debug("could not list the Ray cluster's nodes: %s", e)
                self.dead = set()
        return worker.node in self.dead

    def on_them(self, workers, died: set[int]) -> list:
        """The deaths of the other actors on the lost nodes. An idle actor's death is seen only once a group is sent
        to it: after a node of many idle actors is lost, one group went to each in turn."""
        if not self.dead:
            return []
        return [Died(w, "its node was lost", True) for w in workers
                if w.node in self.dead and id(w) not in died]


class _ActorGroups(Scheduled):
    """The groups of one iterator, in order, from Ray actors."""

    def __init__(self, fn: Callable[[Any], Any], num_groups: int, spec: RayActors,
                 args: Callable[[int], Any] | None = None):
        ray = _connect(spec.address)
        self._spec = spec
        self._class = ray.remote(_GroupActor).options(num_cpus=1, resources=dict(spec.resources or {}),
                                                       max_concurrency=spec.per_worker, max_restarts=0)
        try:
            self._fn = ray.put(fn)
        except Exception as e:  # noqa: BLE001 - whatever does not pickle, named
            raise ValueError(f"ray_address= sends the reader, decoder and map functions to Ray actors, and they do "
                             f"not pickle ({type(e).__name__}: {e}); use functions and objects that pickle") from None
        offered = ray.cluster_resources()
        unknown = sorted(k for k in (spec.resources or {}) if k not in offered)
        if unknown:  # a misspelt name waits for ever; an autoscaler may still add such a node
            log.warning("no node of the Ray cluster offers %s now (its resources: %s): the loader's actors wait until "
                        "one does; check the name against the nodes' `ray start --resources`", ", ".join(unknown),
                        ", ".join(sorted(k for k in offered if not k.startswith(("node:", "accelerator_type:")))))
        self._pending: dict = {}  # ObjectRef -> actor
        self._placing: dict = {}  # an actor's node() call -> the actor, until it answers
        self._told_unplaced = False
        super().__init__(num_groups, spec.count, spec.per_worker, spec.describe, args)

    def _start(self, number: int) -> _Actor:
        actor = _Actor(number, self._class.remote(self._fn))
        self._placing[actor.handle.node.remote()] = actor
        return actor

    def _send(self, worker: _Actor, group: int, arg: Any) -> None:
        ref = worker.handle.run.remote(arg)
        worker.refs[ref] = group
        self._pending[ref] = worker

    def _wait(self, timeout: float | None = None) -> list:
        ray = _ray()
        if timeout is not None and not self._pending and not self._placing:
            return []
        ready = ready_refs(ray, [*self._pending, *self._placing], block=timeout is None, stall=STALL_SECONDS,
                           stalled=lambda: _stalled(len(self._pending), self._spec.resources))
        events, died = [], set()
        lost = _LostNodes(ray)
        placements = [r for r in ready if r in self._placing]
        for ref in placements:
            worker = self._placing.pop(ref)
            try:
                worker.node = ray.get(ref)
                worker.placed = worker.ready = True
                self._failed_starts = 0  # (those that end before they start: counted in a row)
            except deaths(ray) as e:  # it ended before it began (its node lost; it did not start)
                died.add(id(worker))
                events.append(Died(worker, f"{type(e).__name__}: {str(e).splitlines()[0]}", lost(worker, e)))
        self._tell_unplaced()
        for ref in [r for r in ready if r not in placements]:
            worker = self._pending.pop(ref, None)
            if worker is None or id(worker) in died:
                continue
            group = worker.refs.pop(ref)
            try:
                events.append(Result(worker, group, True, transport.expand(ray.get(ref))))
            except deaths(ray) as e:
                worker.refs[ref] = group  # still its: computed again by another
                died.add(id(worker))
                events.append(Died(worker, f"{type(e).__name__}: {str(e).splitlines()[0]}", lost(worker, e)))
            except ray.exceptions.RayTaskError as e:  # the function raised: its own error, where the batch is taken
                events.append(Result(worker, group, False, e.cause if e.cause is not None else e))
        return events + lost.on_them(self._workers, died)

    def _tell_unplaced(self) -> None:
        """One line when actors have waited STALL_SECONDS to be placed while the others compute the batches."""
        if self._told_unplaced or not self._placing:
            return
        waiting = [w for w in self._placing.values() if time.monotonic() - w.since > STALL_SECONDS]
        placed = sum(w.placed for w in self._workers)
        if waiting and placed:  # (while none is placed, the wait for them is said: _stalled)
            self._told_unplaced = True
            need = ", ".join(f"{k}: {v:g}" for k, v in {"CPU": 1, **dict(self._spec.resources or {})}.items())
            log.warning("%d of the loader's Ray actors are not placed after %gs (each needs {%s} free; ray status "
                        "shows what is); the %d placed compute the batches meanwhile", len(waiting), STALL_SECONDS,
                        need, placed)

    def _cannot_start(self, how: str) -> None:
        why = ("Ray's memory monitor ends them (the node's memory is nearly full, RAY_memory_usage_threshold): free "
               "memory there, or give the actors nodes with more" if how.startswith("OutOfMemoryError") else
               "the reader, decoder and map functions must unpickle on the cluster's nodes (the same code and packages "
               "there as here: a shared image, or ray.init's runtime_env); Ray's log of the actor says why")
        raise ValueError(f"the loader's Ray actors end before they start ({self._failed_starts} of them, the last: "
                         f"{how}): {why}")

    def _stop(self, worker: _Actor) -> None:
        for ref in [r for r, w in self._placing.items() if w is worker]:
            del self._placing[ref]
        for ref in worker.refs:
            self._pending.pop(ref, None)
        try:
            _ray().kill(worker.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
