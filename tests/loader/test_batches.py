import numpy as np
import pytest

from loader.batches import BatchPlan


def _global_batches(n_hosts, *, num_batches, **kw):
    plans = [BatchPlan(shard_index=h, shard_count=n_hosts, **kw) for h in range(n_hosts)]
    return [np.concatenate([p.host_indices(k) for p in plans]) for k in range(num_batches)]


def test_host_count_invariance():
    kw = dict(num_records=103, batch_size=8, seed=5)
    one = _global_batches(1, num_batches=40, **kw)
    for n in (2, 4, 8):
        assert all(np.array_equal(a, b) for a, b in zip(one, _global_batches(n, num_batches=40, **kw)))


def test_each_epoch_is_a_permutation_and_epochs_differ():
    plan = BatchPlan(num_records=50, batch_size=10, seed=1, num_epochs=3)
    assert plan.num_batches == 15
    stream = np.concatenate([plan.host_indices(k) for k in range(plan.num_batches)])
    epochs = stream.reshape(3, 50)
    for e in epochs:
        assert sorted(e.tolist()) == list(range(50))
    assert not np.array_equal(epochs[0], epochs[1])


def test_batches_span_epoch_boundaries_and_remainders():
    plan = BatchPlan(num_records=10, batch_size=4, shuffle=False, num_epochs=2, drop_remainder=False)
    assert [plan.host_indices(k).tolist() for k in range(plan.num_batches)] == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1], [2, 3, 4, 5], [6, 7, 8, 9]]
    dropped = BatchPlan(num_records=10, batch_size=4, shuffle=False, num_epochs=1)
    assert dropped.num_batches == 2
    kept = BatchPlan(num_records=10, batch_size=4, shuffle=False, num_epochs=1, drop_remainder=False)
    assert kept.host_indices(2).tolist() == [8, 9]


def test_bad_plans_are_named():
    with pytest.raises(ValueError, match="batch_size=10 does not split evenly over shard_count=4"):
        BatchPlan(num_records=10, batch_size=10, shard_index=0, shard_count=4)
    with pytest.raises(ValueError, match="shard_index must be in"):
        BatchPlan(num_records=10, batch_size=4, shard_index=2, shard_count=2)
    with pytest.raises(ValueError, match="num_epochs must be"):
        BatchPlan(num_records=10, batch_size=4, num_epochs=0)
