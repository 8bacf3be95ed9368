"""The optimizer, schedule, accumulation and precision keys: exact schedules, real optax, real training runs."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from trainer import TrainConfig, optim
from tests.trainer.conftest import run_trainer


def _config(**overrides):
    return TrainConfig(data="x", workdir="w", **{"steps": 100, **overrides})


def test_warmup_then_cosine_and_linear_schedules():
    cosine = optim.schedule(_config(learning_rate=1.0, schedule="cosine", warmup_steps=10, end_lr_fraction=0.1))
    assert [round(float(cosine(s)), 4) for s in (0, 5, 10, 55, 100)] == [0.0, 0.5, 1.0, 0.55, 0.1]
    linear = optim.schedule(_config(learning_rate=2.0, schedule="linear"))
    assert [float(linear(s)) for s in (0, 50, 100)] == [2.0, 1.0, 0.0]
    assert optim.schedule(_config(learning_rate=0.5)) == 0.5  # constant: a float, as before schedules


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd", "adafactor"])
def test_each_optimizer_minimises_a_quadratic(name):
    tx = optim.make(_config(optimizer=name, learning_rate=0.1, weight_decay=0.0 if name == "adam" else 1e-4,
                            grad_clip=10.0))
    params = {"w": jnp.zeros((4, 3))}
    state = tx.init(params)
    target = jnp.arange(12.0).reshape(4, 3) / 12

    @jax.jit
    def step(params, state):
        grads = jax.grad(lambda p: jnp.sum((p["w"] - target) ** 2))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(300):
        params, state = step(params, state)
    assert float(jnp.abs(params["w"] - target).max()) < 0.05


def test_clipping_bounds_the_update():
    tx = optim.make(_config(optimizer="sgd", momentum=0.0, learning_rate=1.0, grad_clip=0.5))
    params = {"w": jnp.zeros(4)}
    updates, _ = tx.update({"w": jnp.full((4,), 10.0)}, tx.init(params), params)
    assert float(jnp.linalg.norm(updates["w"])) == pytest.approx(0.5)


@pytest.mark.parametrize("overrides, message", [
    ({"optimizer": "lion"}, "optimizer='lion' is not one of adam, adamw, sgd, adafactor"),
    ({"optimizer": "adam", "weight_decay": 0.1}, "optimizer=adam has no weight decay; use optimizer=adamw"),
    ({"warmup_steps": 100}, "warmup_steps=100 must be below steps=100"),
    ({"grad_accum_steps": 3, "batch_size": 32}, "grad_accum_steps=3 must be >= 1 and divide batch_size=32"),
    ({"dtype": "float16"}, "dtype='float16' is not one of float32, bfloat16"),
])
def test_bad_optimizer_keys_name_the_value(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _config(**overrides)


def _losses(workdir):
    return [json.loads(line)["loss"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # ~27-36 s: three training runs in subprocesses
def test_accumulating_micro_batches_matches_the_whole_batch_and_bf16_trains(digits, tmp_path):
    """grad_accum_steps=4 over 8 devices takes the same steps as whole batches; bfloat16 compute stays close and its
    checkpointed parameters stay float32."""
    common = (f"data={digits['train']}", "model=mlp", "num_classes=10", "steps=12", "batch_size=32", "log_every=1",
              "checkpoint_every=12", "optimizer=adamw", "weight_decay=0.01", "schedule=cosine", "warmup_steps=2",
              "grad_clip=1.0", "learning_rate=0.003", "strategy=mirrored")
    whole = run_trainer(*common, f"workdir={tmp_path / 'whole'}", devices=8)
    micro = run_trainer(*common, "grad_accum_steps=4", f"workdir={tmp_path / 'micro'}", devices=8)
    half = run_trainer(*common, "dtype=bfloat16", f"workdir={tmp_path / 'bf16'}", devices=8)
    for proc in (whole, micro, half):
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "optimizer=adamw learning_rate=0.003 schedule=cosine warmup_steps=2" in whole.stderr
    a, b, c = _losses(tmp_path / "whole"), _losses(tmp_path / "micro"), _losses(tmp_path / "bf16")
    assert len(a) == len(b) == len(c) == 12 and a[-1] < a[0]
    np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(a, c, atol=0.05)  # bf16 has 8 bits of mantissa
    assert max(abs(x - y) for x, y in zip(a, c)) > 0  # and it did compute in bf16
    import orbax.checkpoint as ocp

    saved = ocp.StandardCheckpointer().metadata(tmp_path / "bf16" / "checkpoints" / "12" / "state").item_metadata
    assert {str(leaf.dtype) for leaf in jax.tree.leaves(saved["params"])} == {"float32"}
