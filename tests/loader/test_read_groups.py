"""The plain loader's read groups (loader/pipeline.py): how they ramp up from the start batch."""

import pytest

from loader.format.source import ShardedSource
from loader.pipeline import _ReadGroup, RAMP_GROWTH
from loader.planning.batches import BatchPlan


@pytest.mark.parametrize("num_epochs", [1, 3, None])
@pytest.mark.parametrize("start", [0, 1, 5, 20])
@pytest.mark.parametrize("max_batches", [1, 3, 8, 100])
def test_groups_cover_every_batch_once_ramping_up(num_epochs, start, max_batches):
    plan = BatchPlan(num_records=100, batch_size=4, num_epochs=num_epochs)
    source = ShardedSource(("unused",), (100,), "glob")
    group = _ReadGroup(plan, source, None, None, None, start, max_batches)  # schedule only: no reads
    limit = min(plan.num_batches, start + 200)
    covered, sizes, g = [], [], 0
    while group.first_batch(g) < limit:
        first, end = group.first_batch(g), group.first_batch(g + 1)
        covered.extend(range(first, min(end, limit)))
        sizes.append(end - first)
        g += 1
    assert covered == list(range(start, limit))
    ramp = [min(RAMP_GROWTH**i, max_batches) for i in range(len(sizes))]
    assert sizes[:-1] == ramp[:-1] and sizes[-1] <= ramp[-1]  # 1, 4, 16, ... capped; the last may be cut short
    if num_epochs is not None:  # num_groups() covers exactly the batches left
        assert group.first_batch(group.num_groups() - 1) < plan.num_batches == group.first_batch(group.num_groups())
