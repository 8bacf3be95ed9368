import numpy as np
import pytest

from loader.planning.batches import BatchPlan


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


def _read_forward(positions: np.ndarray, records: np.ndarray, epoch: int = 1000, horizon: int = 3) -> np.ndarray:
    """The next position of each record in this host's own stream read forward, within `horizon` epochs."""
    from loader.planning.batches import NEVER

    expected, seen = np.full(len(positions), NEVER), {}
    for t in range(len(positions) - 1, -1, -1):
        later = seen.get(int(records[t]))
        if later is not None and later // epoch - positions[t] // epoch <= horizon:
            expected[t] = later
        seen[int(records[t])] = int(positions[t])
    return expected


@pytest.mark.parametrize("shuffle", [True, False])
def test_next_reads_are_this_hosts_next_read_of_each_record(shuffle):
    """Against the host's own stream read forward: the next position of the same record, within the horizon."""
    from loader.planning.batches import NEVER

    for host in range(4):
        plan = BatchPlan(1000, 40, seed=1, shuffle=shuffle, num_epochs=6, shard_index=host, shard_count=4)
        positions = np.concatenate(plan.host_positions_range(0, plan.num_batches))
        records = plan.indices_at(positions)
        assert np.array_equal(plan.next_reads(positions, records, horizon=3), _read_forward(positions, records))
    endless = BatchPlan(1000, 40, seed=1, shuffle=shuffle, num_epochs=None, shard_index=1, shard_count=4)
    bounded = BatchPlan(1000, 40, seed=1, shuffle=shuffle, num_epochs=9, shard_index=1, shard_count=4)
    positions = np.concatenate(endless.host_positions_range(0, 25))  # epoch 0: its next reads lie in epochs 1-3
    records = endless.indices_at(positions)
    assert np.array_equal(endless.next_reads(positions, records, 3), bounded.next_reads(positions, records, 3))
    plan = BatchPlan(10, 4, seed=0, num_epochs=4, shard_index=0, shard_count=2)
    positions = np.concatenate(plan.host_positions_range(0, 2))
    assert plan.indices_at(positions).tolist() == [7, 4, 5, 3]  # host 0's rows: positions p with p % 4 in {0, 1}
    # epoch 1 is [7, 0, 1, 6, 2, 5, 3, 8, 4, 9], epoch 2 [8, 1, 5, 3, 9, 0, 7, 2, 6, 4]: 4 comes back to host 0 at 29
    # (20 + 9), 3 at 16 (10 + 6); 7 (at 10 and 26) and 5 (at 15 and 22) go to host 1
    assert plan.next_reads(positions, plan.indices_at(positions), 2).tolist() == [NEVER, 29, NEVER, 16]


def test_a_plan_continued_in_another_batch_size_reads_the_stream_on_from_where_it_stopped():
    """Batches 0-2 of 4 (positions 0-11), then batches of 6 from batch 3 on: positions 12-17 and the short 18-19,
    each record once an epoch; the same on 2 hosts; the same batch size back is the plain plan."""
    first = BatchPlan(num_records=10, batch_size=4, shuffle=False, num_epochs=2, drop_remainder=False)
    then = BatchPlan(num_records=10, batch_size=6, shuffle=False, num_epochs=2, drop_remainder=False).continued(3, 12)
    assert (then.start_batch, then.origin, then.num_batches) == (3, -6, 5)
    assert [then.host_indices(k).tolist() for k in range(3, 5)] == [[2, 3, 4, 5, 6, 7], [8, 9]]
    stream = [first.host_indices(k) for k in range(3)] + [then.host_indices(k) for k in range(3, 5)]
    assert np.concatenate(stream).tolist() == list(range(10)) * 2
    with pytest.raises(IndexError, match="batch 2 comes before this plan's segment, which starts at batch 3"):
        then.host_indices(2)
    hosts = [BatchPlan(1000, 40, seed=1, num_epochs=3, shard_index=h, shard_count=4).continued(7, 333)
             for h in range(4)]
    whole = BatchPlan(1000, 40, seed=1, num_epochs=3).continued(7, 333)
    assert whole.num_batches == 7 + (3000 - 333) // 40
    for k in (7, 8, whole.num_batches - 1):
        assert np.concatenate([h.host_indices(k) for h in hosts]).tolist() == whole.host_indices(k).tolist()
    assert whole.host_indices(7).tolist() == BatchPlan(1000, 40, seed=1).indices_at(np.arange(333, 373)).tolist()
    assert BatchPlan(10, 4).continued(3, 12) == BatchPlan(10, 4)
    with pytest.raises(ValueError, match="puts batch 3 at record -2 of the stream, before its start: it is not a state"):
        BatchPlan(10, 4).continued(3, -2)


@pytest.mark.parametrize("shuffle", [True, False])
def test_next_reads_of_a_continued_plan_are_this_hosts_next_read(shuffle):
    for host in range(4):
        plan = BatchPlan(1000, 40, seed=1, shuffle=shuffle, num_epochs=6, shard_index=host,
                         shard_count=4).continued(11, 333)
        positions = np.concatenate(plan.host_positions_range(11, plan.num_batches))
        records = plan.indices_at(positions)
        assert np.array_equal(plan.next_reads(positions, records, horizon=3), _read_forward(positions, records))
