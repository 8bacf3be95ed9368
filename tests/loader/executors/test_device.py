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
