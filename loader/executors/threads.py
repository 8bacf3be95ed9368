"""Read groups on this process's threads: grain's `MapDataset.range(n).map(fn).to_iter_dataset(ReadOptions)`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import grain


@dataclasses.dataclass(frozen=True)
class Threads:
    num_threads: int  # groups computed at once
    prefetch: int  # groups computed ahead of the caller (0: on demand, on the caller's thread)

    def map(self, fn: Callable[[Any], Any], num_groups: int, args: Callable[[int], Any] | None = None):
        work = fn if args is None else (lambda g: fn(args(g)))  # args: thread-safe, called in any order
        return iter(grain.MapDataset.range(num_groups).map(work).to_iter_dataset(
            grain.ReadOptions(num_threads=self.num_threads, prefetch_buffer_size=self.prefetch)))
