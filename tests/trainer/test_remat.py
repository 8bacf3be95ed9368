"""remat=auto (trainer/remat.py): the fastest policy whose compiled step fits the devices' free memory.

XLA:CPU's memory analysis shows no policy's saving (its pipeline moves the recomputation forward), so the chooser's
own tests compile a small LM's gradient step at a batch per policy that orders their needs as a GPU's do (none >
elementwise > full: 21.2, 12.0 and less GiB for the 104M model on an H200); the trainer's tests check what it
compiles and trains with for a given free memory."""

import logging
import re

import jax
import jax.numpy as jnp
import pytest

from trainer import TrainConfig, remat
from trainer.models import TransformerLM

from tests.trainer.test_lm import _metrics, stdlib_text  # noqa: F401 (a fixture)


# a batch per policy: real compiled steps whose needs are ordered as the policies' are on a GPU
BATCH = {"none": 32, "elementwise": 16, "full": 8}



@pytest.fixture(autouse=True)
def compiled_here():
    """The run's shared compilation cache off (tests/conftest.py): these tests count the step's compiles."""
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    yield
    jax.config.update("jax_compilation_cache_dir", before)

@pytest.fixture(scope="module")
def compiles():
    """compile_with for remat.choose, and the policies it compiled, in order."""
    calls = []

    def compile_with(policy):
        calls.append(policy)
        tokens = jax.ShapeDtypeStruct((BATCH[policy], 128), jnp.int32)
        batch = {"tokens": tokens, "segment_ids": tokens, "positions": tokens}
        model = TransformerLM(vocab_size=256, max_len=128, width=64, depth=2, heads=4, attention="blockwise",
                              remat=policy)
        params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 128), jnp.int32)))
        return jax.jit(jax.grad(lambda p, b: model.apply(p, b).mean())).lower(params, batch).compile()

    needs = {policy: remat.needed_bytes(compile_with(policy), 0) for policy in remat.ORDER}
    calls.clear()
    return compile_with, calls, needs


def test_auto_takes_the_first_policy_whose_step_fits(compiles, caplog):
    compile_with, calls, needs = compiles
    assert needs["none"] > needs["elementwise"] > 0, needs
    for free, expected, compiled in ((10 * needs["none"], "none", ["none"]),
                                     (int(needs["elementwise"] / remat.HEADROOM) + 1, "elementwise",
                                      ["none", "elementwise"])):
        calls.clear()
        with caplog.at_level(logging.INFO, logger="trainer.remat"):
            policy, step = remat.choose(compile_with, 0, free)
        assert (policy, calls) == (expected, compiled)
        assert remat.needed_bytes(step, 0) == needs[expected]
    assert re.search(r"remat=auto: elementwise \(its step needs [\d.]+ MiB of the [\d.]+ MiB free on each device; "
                     r"none would need [\d.]+ MiB, more than 90% of it\)", caplog.text), caplog.text


def test_auto_without_room_for_any_takes_full_once_and_warns(compiles, caplog):
    compile_with, calls, needs = compiles
    calls.clear()
    with caplog.at_level(logging.INFO, logger="trainer.remat"):
        policy, step = remat.choose(compile_with, 0, 1)
    assert (policy, calls) == ("full", ["none", "elementwise", "full"])  # each compiled once
    assert remat.needed_bytes(step, 0) == needs["full"]
    assert caplog.records[-1].levelname == "WARNING"
    assert "if the step runs out of memory, lower batch_size or seq_len" in caplog.records[-1].getMessage()


def test_auto_where_devices_report_no_memory_compiles_elementwise_once(compiles, caplog):
    compile_with, calls, _ = compiles
    calls.clear()
    assert remat.free_bytes() is None  # this CPU's devices report no memory
    with caplog.at_level(logging.INFO, logger="trainer.remat"):
        assert remat.choose(compile_with, 0, None)[0] == "elementwise"
    assert calls == ["elementwise"]
    assert "remat=auto: elementwise (this backend's devices do not report their memory" in caplog.text


@pytest.mark.parametrize("free, policy, compiled", [(1 << 40, "none", 1),
                                                    pytest.param(1, "full", 3, marks=pytest.mark.slow)],
                         ids=["ample", "none"])  # (none: the order of compiles is the chooser's own tests')
def test_the_trainer_trains_with_the_policy_auto_chose(stdlib_text, tmp_path, monkeypatch, caplog,  # noqa: F811
                                                       free, policy, compiled):
    """The trainer's own compiles (its state and the first batch it trains on), told of devices with this much free
    memory: it compiles the policies in order until one fits, and trains."""
    from trainer import train

    monkeypatch.setattr(remat, "free_bytes", lambda: free)
    config = TrainConfig(data=str(stdlib_text["train"]), workdir=str(tmp_path), task="lm", seq_len=64, packing=True,
                         batch_size=8, steps=2, log_every=1, width=32, depth=1, heads=2, model="transformer_lm")
    with caplog.at_level(logging.INFO):
        train.train_and_evaluate(config)
    chosen = [r for r in caplog.records if r.name == "trainer.remat"]
    assert len(chosen) == 1 and chosen[0].getMessage().startswith(f"remat=auto: {policy}"), chosen
    assert sum("step compiled in" in r.getMessage() for r in caplog.records) == compiled
    assert [r["step"] for r in _metrics(tmp_path)] == [1, 2]
