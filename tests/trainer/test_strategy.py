"""The strategy API: a hand-written loop (docs/custom_loop.py) on 4 simulated devices, and the default."""

import subprocess
import sys

from tests.conftest import REPO

_CHECKS = """
import sys
sys.path.insert(0, "docs")
import jax, numpy as np
import trainer
from custom_loop import main
default = trainer.get_strategy()
assert default.name == "default" and default.num_replicas_in_sync == 1
mirrored = trainer.make_strategy("mirrored")
assert mirrored.num_replicas_in_sync == 4
x = mirrored.distribute({"v": np.arange(8.0)})["v"]
assert len(x.addressable_shards) == 4 and x.addressable_shards[1].data.tolist() == [2.0, 3.0]
assert float(mirrored.reduce("sum", x)) == 28.0 and float(mirrored.reduce("mean", x)) == 3.5
try:
    trainer.make_strategy("one_device", device="cpu:9")
except ValueError as e:
    assert "device='cpu:9' not found" in str(e)
else:
    raise AssertionError("a missing device was accepted")
assert trainer.make_strategy("one_device", device="cpu:2").mesh.devices.flat[0].id == 2
# tf's per-replica views: a batch-split array gives each device's slice, a replicated one n copies
local = mirrored.experimental_local_results({"x": x, "total": mirrored.reduce("sum", x)})
assert [part["x"].tolist() for part in local] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]
assert [float(part["total"]) for part in local] == [28.0] * 4
contexts = []
def dataset_fn(context):
    contexts.append(context)
    rows = context.get_per_replica_batch_size(8) * context.num_replicas_in_sync // context.num_input_pipelines
    return ({"v": np.arange(rows, dtype=np.float32) + 10 * i} for i in range(2))
batches = list(mirrored.distribute_datasets_from_function(dataset_fn))
assert [(c.num_input_pipelines, c.input_pipeline_id, c.num_replicas_in_sync) for c in contexts] == [(1, 0, 4)]
assert [b["v"].shape for b in batches] == [(8,), (8,)] and batches[1]["v"].addressable_shards[3].data.tolist() == [16.0, 17.0]
try:
    contexts[0].get_per_replica_batch_size(6)
except ValueError as e:
    assert "global batch size 6 does not split over num_replicas_in_sync=4" in str(e)
else:
    raise AssertionError("an unsplittable batch was accepted")
# central_storage: parameters in host memory; run() brings them to the devices
central = trainer.make_strategy("central_storage")
placed = central.replicate({"w": np.ones((3, 2), np.float32), "b": np.zeros(2, np.float32)})
assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(placed)} == {"pinned_host"}
out = central.run(lambda p, v: (v[:, None] * p["w"][:1]).sum(), args=(placed, central.distribute({"v": np.arange(8.0)})["v"]))
assert float(out) == 56.0 and out.sharding.memory_kind == "device"
try:
    trainer.make_strategy("parameter_server")
except ValueError as e:
    assert "python -m trainer strategy=parameter_server" in str(e)
else:
    raise AssertionError("parameter_server made a mesh strategy")
first = main(sys.argv[1], steps=1)
last = main(sys.argv[1], steps=60)
assert last < first, (first, last)
print("ok")
"""


def test_strategy_api_and_custom_loop(digits):
    proc = subprocess.run([sys.executable, "-c", _CHECKS, str(digits["train"])], cwd=REPO, capture_output=True,
                          text=True, timeout=180, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO),
                                                       "XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok") and "num_replicas_in_sync=4" in proc.stdout
