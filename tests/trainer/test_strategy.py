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
