"""Executors: where the loader's groups are computed, apart from what they hold.

A group (a plain loader's read group, loader/pipeline.py `_ReadGroup`; a packed loader's batch, loader/packed.py
`Assembler`) is a pure function of what the plan says it holds: which records, which random numbers each record's
`random_map_fn` gets, which pieces of which documents go in which row. So any process can compute any group, and a
group computed twice is the same group: an executor may retry, move or spread groups as it likes, and the batches
stay those of the plan.

Every executor has one method,

    executor.map(fn, num_groups, args=None) -> iterator of fn(args(0)), fn(args(1)), ..., in order, with .close()

computing ahead of the caller within a bounded buffer (backpressure: nothing is computed further ahead than it),
and stopping whatever it started when closed. `args(g)` (default: g itself) is the plan's part of group g, made in
this process; `fn` is the work, run wherever the executor runs it. Results travel between processes through
`transport` (raw records packed into arrays); the caller takes them through `handout.HostBatches`.

- `threads.Threads`: this process's threads (grain's `to_iter_dataset`): no workers.
- `processes.Processes`: local worker processes; one that dies is replaced and its groups recomputed.
- `ray_actors.RayActors`: Ray actors anywhere in a Ray cluster, healed the same way.
- `tuned.Tuned` (worker_count="auto"): threads here, or as many worker processes as the caller's demand needs.

`make` chooses one from the loader's options. Also here: `schedule` (the sliding window every process-based
executor shares), `workers` (the watchdog that ends a worker with its owner), `stages` (each group's stage times) and
`device` (placing batches on devices ahead of the step).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

log = logging.getLogger(__name__)
_TOLD: set[int] = set()  # worker counts warned of in this process (a loader makes an executor each epoch)


class GroupIterator(Iterator):
    """The groups in order; `close()` stops the executor's work for this iterator (idempotent)."""

    def close(self) -> None: ...


class Executor(Protocol):
    def map(self, fn: Callable[[Any], Any], num_groups: int, args: Callable[[int], Any] | None = None
            ) -> GroupIterator:
        """fn(args(0)), ..., fn(args(num_groups - 1)) in order, computed ahead within the executor's buffer."""


def make(worker_count: int | str, *, num_threads: int, prefetch: int, ray_address: str | None = None,
         ray_resources: Mapping[str, float] | None = None, describe: Callable[[int], str] = str) -> Executor:
    """The executor for the loader's options (LoaderConfig validates them): `worker_count` worker processes (0:
    this process's `num_threads` threads, `prefetch` groups ahead; "auto": tuned), on a Ray cluster with
    `ray_address`. A worker computes max(num_threads, prefetch) groups at once."""
    per_worker = max(num_threads, prefetch)
    if worker_count == "auto":
        from loader.executors.tuned import Tuned

        return Tuned(per_worker, describe)
    if ray_address is not None:
        from loader.executors.ray_actors import RayActors

        return RayActors(ray_address, worker_count, per_worker, ray_resources, describe)
    if worker_count:
        from loader.executors.processes import Processes
        from loader.executors.tuned import loader_cores

        cores = loader_cores()
        if worker_count > cores and worker_count not in _TOLD:
            _TOLD.add(worker_count)
            log.warning("worker_count=%d: %d worker processes for %d cores; each decodes on a core of its own, so "
                        "those past the cores add memory, not speed (worker_count='auto' starts what the step's "
                        "demand needs)", worker_count, worker_count, cores)
        return Processes(worker_count, per_worker=per_worker, describe=describe)
    from loader.executors.threads import Threads

    # Groups read ahead: 0 reads on demand; otherwise at least one per thread (fewer would idle threads).
    return Threads(num_threads, max(prefetch, num_threads) if prefetch else 0)
