"""Batch-size ramp-up: the global batch grows from `batch_size_start` by `batch_size_increment` to `batch_size` over
the first `rampup_samples` examples, as MaxText's `enable_rampup_batch_size` and NeMo's `rampup_batch_size` do:

    batch_size=512 batch_size_start=128 batch_size_increment=128 rampup_samples=300000

Each of the (512 - 128) / 128 = 3 smaller sizes trains on an equal share of `rampup_samples` (100,000 examples):
ceil(share / size) steps of it, then the next size (MaxText's RampupBatchManager counts the same way); `batch_size`
from then on. The plan here is which size each step takes; the loader gives the batches (a state of one size
restores with another and reads on from where it stopped, so every example is still read once an epoch), and the
trainer compiles its step once per size.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Ramp:
    """The global batch size of each step: stage i's size from step `stages[i][0]` on (steps count from 1)."""

    stages: tuple[tuple[int, int], ...]  # (first step, global batch size), the last one's size held to the end

    @classmethod
    def of(cls, config) -> Ramp | None:
        """The ramp `config` asks for (None without batch_size_start); its values were checked by TrainConfig."""
        start, increment, end = config.batch_size_start, config.batch_size_increment, config.batch_size
        if not start:
            return None
        share = config.rampup_samples / ((end - start) // increment)  # examples at each smaller size
        stages, step = [], 1
        for size in range(start, end, increment):
            stages.append((step, size))
            step += math.ceil(share / size)
        stages.append((step, end))
        return cls(tuple(stages))

    def batch_size(self, step: int) -> int:
        """The global batch size step `step` trains on."""
        size = self.stages[0][1]
        for first, stage_size in self.stages:
            if first > step:
                break
            size = stage_size
        return size

    def examples(self, steps: int) -> int:
        """The examples (rows) steps 1..`steps` take together."""
        ends = [first for first, _ in self.stages[1:]] + [steps + 1]
        return sum(size * max(0, min(end, steps + 1) - first) for (first, size), end in zip(self.stages, ends))

    def sizes(self) -> list[int]:
        return [size for _, size in self.stages]

    def describe(self) -> str:
        """'128 for steps 1-782, 256 for steps 783-1173, 384 for steps 1174-1434, 512 from step 1435'."""
        parts = [f"{size} for steps {first}-{after - 1}"
                 for (first, size), (after, _) in zip(self.stages, self.stages[1:])]
        first, size = self.stages[-1]
        return ", ".join(parts + [f"{size} from step {first}"])
