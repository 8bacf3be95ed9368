import pickle

import numpy as np

from loader.executors import transport
from loader.executors.stages import Group


def _group(batches):
    return Group(batches, sum(map(len, batches)) if isinstance(batches, list) else 0, {"read": 0.5})


def test_raw_batches_leave_a_worker_as_arrays_and_come_back_as_they_were():
    """Raw batches cross from worker processes as NumPy arrays (shared memory), not lists of bytes."""
    batches = [[b"ab", b"", b"c"], [], [b"defg"]]  # an empty record, and an empty host share of a batch
    packed = transport.compact(_group(batches))
    data = packed.batches
    assert isinstance(data, transport.PackedRecords)
    assert all(isinstance(a, np.ndarray) and not a.dtype.hasobject for a in (data.data, data.ends, data.counts))
    assert data.data.tobytes() == b"abcdefg" and data.ends.tolist() == [2, 2, 3, 7] and data.counts.tolist() == [3, 0, 1]
    assert packed.cpu["read"] == 0.5 and packed.cpu["pack"] >= 0  # the packing's time is the "pack" stage
    back = transport.expand(pickle.loads(pickle.dumps(packed, protocol=5)))
    assert back.batches == batches and back.records == 4


def test_anything_else_travels_as_it_is():
    decoded = _group([{"label": np.arange(3)}])
    for value in (decoded, _group([[], []]), None, np.arange(4), {"counts": [1, 2]}):
        assert transport.compact(value) is value
        assert transport.expand(value) is value
