"""Executors: where the loader's read groups are computed, apart from what they hold.

A read group (loader/pipeline.py `_ReadGroup`) is a pure function of its index: the plan (seed, epoch, host) says
which records it reads and which random numbers each record's `random_map_fn` gets. So any process can compute any
group, and a group computed twice is the same group: an executor may retry, move or spread groups as it likes, and
the batches stay those of the plan.

Every executor has one method,

    executor.map(fn, num_groups) -> iterator of fn(0), fn(1), ..., fn(num_groups - 1), in order, with .close()

computing ahead of the caller within a bounded buffer (backpressure: nothing is computed further ahead than it),
and stopping whatever it started when closed:

- `threads.Threads`: this process's threads (grain's `to_iter_dataset`): no workers.
- `processes.Processes`: local worker processes; one that dies is replaced and its groups recomputed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol


class GroupIterator(Iterator):
    """The groups in order; `close()` stops the executor's work for this iterator (idempotent)."""

    def close(self) -> None: ...


class Executor(Protocol):
    def map(self, fn: Callable[[int], Any], num_groups: int) -> GroupIterator:
        """fn(0), ..., fn(num_groups - 1) in order, computed ahead within the executor's buffer."""
