"""The optimizer, schedule, accumulation and precision keys: exact schedules, real optax, real training runs."""

import json
import re

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


def test_a_schedule_spans_learning_rate_schedule_steps_then_holds_its_end():
    cosine = _config(learning_rate=1.0, schedule="cosine", end_lr_fraction=0.1, steps=200,
                     learning_rate_schedule_steps=100)
    assert [round(optim.rate_at(cosine, s), 4) for s in (0, 50, 100, 150, 199)] == [1.0, 0.55, 0.1, 0.1, 0.1]
    assert [optim.rate_at(_config(learning_rate=2.0, schedule="linear"), s) for s in (0, 50)] == [2.0, 1.0]
    with pytest.raises(ValueError, match=r"warmup_steps=100 must be below learning_rate_schedule_steps=100"):
        _config(schedule="cosine", warmup_steps=100, steps=200, learning_rate_schedule_steps=100)


def test_raising_steps_under_a_decaying_schedule_is_said_and_learning_rate_schedule_steps_keeps_it(digits, tmp_path,
                                                                                                  caplog):
    """A finished 6-step cosine run resumed with steps=10 stretches the decay: the rate jumps back up, and the resume
    says so, with the setting that keeps the written schedule; with it the rate stays at the schedule's end."""
    import shutil

    from trainer import train

    common = dict(data=str(digits["train"]), model="mlp", num_classes=10, batch_size=32, log_every=1,
                  checkpoint_every=100, learning_rate=0.01, schedule="cosine", end_lr_fraction=0.1)
    train.train_and_evaluate(TrainConfig(workdir=str(tmp_path / "a"), steps=6, **common))
    rates = [json.loads(line)["learning_rate"] for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [round(r, 6) for r in rates] == [0.01, 0.009397, 0.00775, 0.0055, 0.00325, 0.001603]  # the step's own
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    with caplog.at_level("WARNING"):
        train.train_and_evaluate(TrainConfig(workdir=str(tmp_path / "a"), steps=10, **common))
    assert ("resuming step 6, written with steps=6: the learning rate there is now 0.00411 where that run had 0.001; "
            "to keep its cosine schedule and train on at its end rate after step 6, pass "
            "learning_rate_schedule_steps=6") in caplog.text
    caplog.clear()
    with caplog.at_level("INFO"):
        train.train_and_evaluate(TrainConfig(workdir=str(tmp_path / "b"), steps=10, learning_rate_schedule_steps=6,
                                             **common))
    assert "learning rate there is now" not in caplog.text
    assert re.search(r"step 10/10 loss [\d.]+ .*\(longest [\d.]+ s\) lr 0\.001$", caplog.text, re.M), caplog.text
    rates = [json.loads(line)["learning_rate"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [round(r, 6) for r in rates[6:]] == [0.001] * 4


def test_steps_past_a_schedule_that_ends_at_zero_are_said_and_not_advised():
    """A decay to end_lr_fraction=0 that ends before `steps` trains the rest at learning rate 0: a warning at the
    start, and the advice on raising steps= does not offer to keep such a schedule."""
    from trainer.checkpoints import _keeping

    idle = _config(schedule="cosine", steps=250, learning_rate_schedule_steps=200)
    assert optim.untrained_steps(idle) == (
        "steps 201-250 train at learning rate 0: the cosine schedule ends at step 200 (learning_rate_schedule_steps="
        "200) with end_lr_fraction=0; set end_lr_fraction > 0 to train on at a fraction of the peak, or "
        "learning_rate_schedule_steps=250 to decay over them all")
    assert optim.rate_at(idle, 220) == 0.0
    for fine in (_config(schedule="cosine", steps=250), _config(schedule="constant", steps=250),
                 _config(schedule="linear", steps=250, learning_rate_schedule_steps=200, end_lr_fraction=0.1)):
        assert optim.untrained_steps(fine) is None
    assert _keeping(_config(schedule="linear", steps=200)) == (
        "its linear schedule ends at learning rate 0 at step 200 (end_lr_fraction=0), so keeping it "
        "(learning_rate_schedule_steps=200) would leave the steps after it untrained: let the decay stretch to the new "
        "steps, or set end_lr_fraction > 0 with it")


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


@pytest.mark.parametrize("name", ["adamw", "sgd", "adafactor"])
def test_weight_decay_on_matrices_leaves_vectors_alone(name):
    params = {"dense": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(3)}, "norm": {"scale": jnp.ones(2)}}
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, states = {}, {}
    for on in ("all", "matrices"):
        tx = optim.make(_config(optimizer=name, learning_rate=0.1, weight_decay=0.5, weight_decay_on=on,
                                **({"momentum": 0.0} if name == "sgd" else {})))
        states[on] = tx.init(params)
        updates[on], _ = tx.update(zero, states[on], params)  # no gradient: the update is the decay alone
    moved = {on: {jax.tree_util.keystr(path): bool(jnp.any(v != 0))
                  for path, v in jax.tree_util.tree_flatten_with_path(u)[0]} for on, u in updates.items()}
    assert moved["all"] == {"['dense']['bias']": True, "['dense']['kernel']": True, "['norm']['scale']": True}
    assert moved["matrices"] == {"['dense']['bias']": False, "['dense']['kernel']": True, "['norm']['scale']": False}
    if name != "adafactor":  # -learning_rate * weight_decay * parameter
        np.testing.assert_allclose(updates["matrices"]["dense"]["kernel"], np.full((2, 2), -0.05), rtol=1e-6)
    # the mask holds no arrays: the optimizer state has the same ones either way
    assert [x.shape for x in jax.tree.leaves(states["all"])] == [x.shape for x in jax.tree.leaves(states["matrices"])]


def test_a_resume_with_the_other_weight_decay_on_names_it(digits, tmp_path):
    from trainer import train

    common = dict(data=str(digits["train"]), workdir=str(tmp_path), model="mlp", num_classes=10, batch_size=32,
                  checkpoint_every=2, optimizer="adamw", weight_decay=0.1)
    assert train.train_and_evaluate(TrainConfig(steps=2, **common))["final_step"] == 2
    with pytest.raises(ValueError, match="holds step 2 of a training state other than this run's .*: resume with "
                                         "weight_decay_on=all \\(what it was written with\\)"):
        train.train_and_evaluate(TrainConfig(steps=4, weight_decay_on="matrices", **common))


def test_a_resume_with_another_optimizer_names_it_once(digits, tmp_path):
    """It said "resume with optimizer=adam optimizer=adam": a key that shapes the parameters and the optimizer's."""
    from trainer import train

    common = dict(data=str(digits["train"]), workdir=str(tmp_path), model="mlp", num_classes=10, batch_size=32,
                  checkpoint_every=2)
    assert train.train_and_evaluate(TrainConfig(steps=2, **common))["final_step"] == 2
    with pytest.raises(ValueError, match="holds step 2 of a training state other than this run's .*: resume with "
                                         "optimizer=adam \\(what it was written with\\)"):
        train.train_and_evaluate(TrainConfig(steps=4, optimizer="sgd", **common))


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adams_moments_are_optaxs_with_the_given_rates(name):
    """adam_b1, adam_b2, adam_eps reach optax: ten updates equal optax's own with those rates (and differ from the
    defaults' by more than rounding)."""
    rates = dict(b1=0.8, b2=0.95, eps=1e-6)
    extra = {"weight_decay": 0.1} if name == "adamw" else {}
    ours = optim.make(_config(optimizer=name, learning_rate=0.01, adam_b1=0.8, adam_b2=0.95, adam_eps=1e-6, **extra))
    reference = getattr(optax, name)(0.01, **rates, **extra)
    defaults = optim.make(_config(optimizer=name, learning_rate=0.01, **extra))
    params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)}
    runs = []
    for tx in (ours, reference, defaults):
        p, state = params, tx.init(params)
        for step in range(10):
            grads = {"w": jnp.sin(p["w"] * (step + 1))}
            updates, state = tx.update(grads, state, p)
            p = optax.apply_updates(p, updates)
        runs.append(np.asarray(p["w"]))
    np.testing.assert_allclose(runs[0], runs[1], rtol=1e-6)
    assert np.abs(runs[0] - runs[2]).max() > 1e-4


def test_nesterov_momentum_looks_ahead_along_the_velocity():
    """sgd with nesterov=true: velocity v = momentum * v + g, the update -lr * (g + momentum * v) (Sutskever et al.'s
    form, optax's); by hand for two gradients, against plain momentum's -lr * v."""
    params = {"w": jnp.zeros(2)}
    grads = [{"w": jnp.array([1.0, -2.0])}, {"w": jnp.array([0.5, 1.0])}]
    updates = {}
    for nesterov in (True, False):
        tx = optim.make(_config(optimizer="sgd", learning_rate=0.1, momentum=0.9, nesterov=nesterov))
        state, updates[nesterov] = tx.init(params), []
        for g in grads:
            u, state = tx.update(g, state, params)
            updates[nesterov].append(np.asarray(u["w"]))
    v1 = np.array([1.0, -2.0])
    v2 = 0.9 * v1 + np.array([0.5, 1.0])
    np.testing.assert_allclose(updates[True], [-0.1 * (np.array([1.0, -2.0]) + 0.9 * v1),
                                               -0.1 * (np.array([0.5, 1.0]) + 0.9 * v2)], rtol=1e-6)
    np.testing.assert_allclose(updates[False], [-0.1 * v1, -0.1 * v2], rtol=1e-6)


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
    ({"weight_decay_on": "kernels"}, "weight_decay_on='kernels' is not one of all, matrices"),
    ({"adam_b2": 1.0}, "(got adam_b2=1.0); the default is 0.999"),  # "must be in [0, 1)"
    ({"adam_eps": 0.0}, "adam_eps must be > 0 (got adam_eps=0.0); the default is 1e-08"),
    ({"optimizer": "sgd", "adam_b2": 0.95}, "adam_b2=0.95 is for optimizer=adam or adamw, and this run's is sgd: drop "
                                            "adam_b2= or pass optimizer=adamw"),
    ({"optimizer": "adamw", "weight_decay_on": "matrices"}, "weight_decay_on=matrices chooses what weight_decay "
                                                            "decays, and weight_decay is 0: set weight_decay="),
    ({"optimizer": "adamw", "nesterov": True}, "nesterov=true is sgd's Nesterov momentum, and this run has "
                                               "optimizer=adamw: pass optimizer=sgd with momentum > 0, or drop "
                                               "nesterov="),
    ({"optimizer": "sgd", "momentum": 0.0, "nesterov": True}, "optimizer=sgd momentum=0: pass optimizer=sgd"),
    ({"label_smoothing": 1.0}, "label_smoothing must be in [0, 1) (got label_smoothing=1.0); 0.1 is the usual value"),
    ({"task": "lm", "label_smoothing": 0.1}, "label_smoothing=0.1 is for task=classification, and this run's is "
                                             "task=lm: drop label_smoothing="),
])
def test_bad_optimizer_keys_name_the_value(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
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
