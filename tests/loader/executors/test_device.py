"""Device prefetch on 8 simulated CPU devices (a fresh process: the device count is fixed at JAX start)."""

import json
import subprocess
import sys

from tests.conftest import REPO

_SCRIPT = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import loader
mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
sharding = NamedSharding(mesh, P("data"))
kw = dict(batch_size=16, seed=3, shuffle=True)
host = iter(loader.load(sys.argv[1], **kw))
dev = iter(loader.load(sys.argv[1], sharding=sharding, device_prefetch=2, **kw))
out = {"ok": True}
for k in range(5):
    h, d = next(host), next(dev)
    assert isinstance(d["x"], jax.Array) and d["x"].sharding == sharding, type(d["x"])
    assert len(d["x"].addressable_shards) == 8 and d["x"].addressable_shards[0].data.shape == (2, 3)
    np.testing.assert_array_equal(np.asarray(d["x"]), h["x"])
state = dev.get_state()  # 5 consumed, more already on the devices
assert state["next_batch"] == 5, state
expected = [np.asarray(next(dev)["y"]).tolist() for _ in range(3)]
again = iter(loader.load(sys.argv[1], sharding=sharding, **kw))
again.set_state(state)
assert [np.asarray(next(again)["y"]).tolist() for _ in range(3)] == expected
raw = iter(loader.load(sys.argv[1], sharding=sharding, decode=None, **kw))
try:
    next(raw)
    out["ok"] = False
except TypeError as e:
    out["raw_error"] = str(e)
errors = {}
for name, options in {"short": dict(num_epochs=1, drop_remainder=False), "indivisible": dict(batch_size=20),
                      "hosts": dict(shard_index=1, shard_count=2)}.items():
    try:
        loader.load(sys.argv[1], sharding=sharding, **{**kw, **options})
    except ValueError as e:
        errors[name] = str(e)
out["errors"] = errors
# an eval pass: 100 records in batches of 16, the last padded (its 4 rows marked), each record once
padded = list(loader.load(sys.argv[1], sharding=sharding, batch_size=16, shuffle=False, num_epochs=1,
                          drop_remainder=False, pad_remainder=True))
out["shapes"] = sorted({tuple(b["y"].shape) for b in padded})
out["real"] = [int(np.asarray(b["_mask"]).sum()) for b in padded]
out["ids"] = sorted(int(v) for b in padded for v in np.asarray(b["y"])[np.asarray(b["_mask"])])
from loader.executors.device import to_global_arrays
try:
    to_global_arrays({"x": np.zeros((8,)), "name": [b"a"] * 8}, sharding)
except TypeError as e:
    out["list_error"] = str(e)
print(json.dumps(out))
"""


def test_batches_arrive_as_sharded_global_arrays_and_resume_exactly(tmp_path):
    from dataset_format import example_proto
    from pipelines import ConvertConfig, run_conversion
    from tests.conftest import write_tfrecord_shards

    records = [example_proto.encode_example({"x": [i, -i, 2 * i], "y": i}) for i in range(100)]
    write_tfrecord_shards(tmp_path / "in", [records[:40], records[40:]])
    run_conversion(ConvertConfig(input=str(tmp_path / "in" / "*"), output=str(tmp_path / "out")),
                   ["--direct_num_workers=1"])
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path / "out")], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ok"]
    assert "decode to fixed-shape arrays" in out["raw_error"]
    # what placing needs is said at load(): the last batch's 4 rows, a batch that does not split over 8 devices, a
    # host count that is not JAX's
    assert out["errors"] == {
        "short": "drop_remainder=False with sharding= gives a last batch of 4 rows, which the 8 devices (and 1 host(s)) "
                 "cannot split evenly: pass pad_remainder=True (the batch padded with zeros, `_mask` marking its real "
                 "rows), or keep drop_remainder=True",
        "indivisible": "batch_size=20 does not split over the 8 devices sharding= lays a batch's first axis over; use a "
                       "multiple of 8",
        "hosts": "sharding= makes each batch a global array of every process's rows, and shard_count=2 says 2 hosts "
                 "where JAX has 1 processes: leave shard_index and shard_count unset with sharding="}
    assert out["shapes"] == [[16]] and out["real"] == [16] * 6 + [4] and out["ids"] == list(range(100))
    assert out["list_error"] == ("device placement needs arrays, and feature(s) ['name'] hold lists (bytes, or values "
                                 "of varying length): leave them out with features=['x'], or make them fixed-shape "
                                 "arrays in map_fn=, or drop sharding=")
