"""strategy=central_storage: parameters and optimizer state in host memory (pinned_host), the step on all devices,
numerically mirrored; checkpoints keep the placement."""

import json
import subprocess
import sys

import numpy as np

from tests.conftest import REPO
from tests.trainer.conftest import run_trainer

_PLACEMENT = """
import sys
import jax, numpy as np, optax, orbax.checkpoint as ocp
import trainer
central = trainer.make_strategy("central_storage")
params = {"w": np.arange(6, dtype=np.float32).reshape(3, 2), "b": np.zeros(2, np.float32)}
state = central.replicate({"params": params, "opt_state": optax.adam(1e-3).init(params)})
kinds = lambda tree: sorted({leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree)})
assert kinds(state) == ["pinned_host"], kinds(state)
with ocp.CheckpointManager(sys.argv[1]) as mngr:
    mngr.save(1, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    restored = mngr.restore(1, args=ocp.args.StandardRestore(abstract))
assert kinds(restored) == ["pinned_host"], kinds(restored)
assert restored["params"]["w"].sharding.device_set == set(jax.devices())
np.testing.assert_array_equal(np.asarray(restored["params"]["w"]), params["w"])
print("ok")
"""


def test_replicate_and_checkpoint_keep_parameters_in_host_memory(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _PLACEMENT, str(tmp_path / "ckpt")], cwd=REPO, capture_output=True,
                          text=True, timeout=180, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO),
                                                       "JAX_PLATFORMS": "cpu",
                                                       "XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


def _losses(workdir):
    return [json.loads(line)["loss"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_trains_like_mirrored_on_four_devices_and_resumes(digits, tmp_path):
    common = (f"data={digits['train']}", f"eval_data={digits['test']}", "model=mlp", "batch_size=32",
              "learning_rate=0.003", "num_classes=10", "log_every=1", "eval_every=20", "checkpoint_every=10")
    mirrored = run_trainer(*common, "steps=20", f"workdir={tmp_path / 'mirrored'}", "strategy=mirrored", devices=4)
    assert mirrored.returncode == 0, mirrored.stderr[-3000:]
    # central_storage in two runs: 10 steps, then a resume from the step-10 checkpoint to 20
    for steps in (10, 20):
        central = run_trainer(*common, f"steps={steps}", f"workdir={tmp_path / 'central'}",
                              "strategy=central_storage", devices=4)
        assert central.returncode == 0, central.stderr[-3000:]
    assert "strategy=central_storage num_replicas_in_sync=4" in central.stderr
    assert "resumed from step 10" in central.stderr
    assert len(_losses(tmp_path / "central")) == 20
    np.testing.assert_allclose(_losses(tmp_path / "central"), _losses(tmp_path / "mirrored"), atol=1e-3)
    final = json.loads(central.stdout)["summary"]
    assert abs(final["eval_accuracy"] - json.loads(mirrored.stdout)["summary"]["eval_accuracy"]) < 1e-3
