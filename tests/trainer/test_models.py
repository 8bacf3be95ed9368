"""model=transformer_lm sized by width=, depth=, heads=, mlp_ratio=: the parameters the keys give, counted against
a formula written out here, and a bad size as one line naming it, before anything is compiled."""

import math
import re
from pathlib import Path

import jax
import numpy as np
import jax.numpy as jnp
import pytest

from trainer import TrainConfig, models
from trainer.models import TransformerLM
from trainer.program import Program
from tests.conftest import REPO
from tests.trainer.conftest import trainer_here
from tests.trainer.test_lm import stdlib_text  # noqa: F401 - the fixture


def lm_parameters(vocab: int, seq_len: int, width: int, depth: int, mlp_ratio: int) -> int:
    """TransformerLM's parameter count, term by term."""
    d, hidden = width, mlp_ratio * width
    embeddings = vocab * d + seq_len * d  # tokens, positions
    attention = 4 * (d * d + d)  # query, key, value, output: kernel + bias each
    mlp = (d * hidden + hidden) + (hidden * d + d)
    norms = 2 * (2 * d)  # two LayerNorms, scale + bias
    output = 2 * d + (d * vocab + vocab)  # the final LayerNorm and the untied output layer
    return embeddings + depth * (attention + mlp + norms) + output


def count(params) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))


@pytest.mark.parametrize("size, expected", [
    ({}, 495_874),  # the defaults: width=128 depth=2 heads=4 mlp_ratio=4
    ({"width": 32, "depth": 1, "heads": 2, "mlp_ratio": 2}, 33_570),
    ({"width": 48, "depth": 3, "heads": 6, "mlp_ratio": 3}, 108_258),
])
def test_the_size_keys_build_the_lm_they_name(stdlib_text, size, expected):  # noqa: F811
    config = TrainConfig(data=str(stdlib_text["train"]), workdir="w", task="lm", model="transformer_lm", **size)
    program = Program.build(config)  # byte-level text: a vocabulary of 258, seq_len 256
    model = program.model
    assert (model.width, model.depth, model.heads, model.mlp_ratio) == (config.width, config.depth, config.heads,
                                                                       config.mlp_ratio)
    n = count(program.abstract_params())
    assert n == expected == lm_parameters(258, 256, config.width, config.depth, config.mlp_ratio)


def test_the_documented_presets_have_the_documented_counts():
    """docs/training.md's "Sizing the LM" presets, counted from the model itself (shapes only, nothing allocated)."""
    text = (Path(REPO) / "docs" / "training.md").read_text()
    presets = re.findall(r"\| `width=(\d+) depth=(\d+) heads=(\d+) mlp_ratio=(\d+)` \| ([\d,]+) \|", text)
    assert len(presets) == 2, presets
    for width, depth, heads, mlp_ratio, documented in presets:
        model = TransformerLM(vocab_size=32_000, max_len=1024, width=int(width), depth=int(depth), heads=int(heads),
                              mlp_ratio=int(mlp_ratio))
        shapes = jax.eval_shape(lambda m=model: m.init(jax.random.key(0), jnp.zeros((1, 1024), jnp.int32)))
        n = count(shapes["params"])
        assert n == int(documented.replace(",", "")) == lm_parameters(32_000, 1024, int(width), int(depth),
                                                                        int(mlp_ratio))


@pytest.mark.parametrize("overrides, message", [
    ({"width": 0}, "width must be >= 1 (got width=0); the default is width=128"),
    ({"depth": 0}, "depth must be >= 1 (got depth=0); the default is depth=2"),
    ({"heads": 0}, "heads must be >= 1 (got heads=0); the default is heads=4"),
    ({"mlp_ratio": -1}, "mlp_ratio must be >= 1 (got mlp_ratio=-1); the default is mlp_ratio=4"),
    ({"width": 100, "heads": 8}, "width=100 is not divisible by heads=8 (each head gets width / heads features); use "
                                 "heads=5 or width=104"),
    ({"model": "cnn", "depth": 6}, "depth=6 sizes model=transformer_lm; model='cnn' does not take it: drop depth="),
])
def test_a_bad_size_is_one_line_naming_the_key(overrides, message):
    with pytest.raises(ValueError) as e:
        TrainConfig(data="x", workdir="w", task="lm", **{"model": "transformer_lm", **overrides})
    assert str(e.value) == message


def test_a_bad_size_stops_the_trainer_before_it_reads_data(tmp_path):
    proc = trainer_here("data=/nonexistent", f"workdir={tmp_path}", "task=lm", "model=transformer_lm", "width=96",
                        "heads=5")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == ("error: width=96 is not divisible by heads=5 (each head gets "
                                                    "width / heads features); use heads=4 or width=100")


def test_the_default_model_is_the_tasks():
    """task=lm with no model= took model=cnn, and failed on the LM's arguments."""
    assert TrainConfig(data="x", workdir="w").model == "cnn"
    lm = TrainConfig.from_args(["data=x", "workdir=w", "task=lm", "width=64", "heads=4"])
    assert lm.model == "transformer_lm" and lm.model_size["width"] == 64
    assert TrainConfig(data="x", workdir="w", task="lm", model="my_pkg.nets:LM").model == "my_pkg.nets:LM"


def test_a_model_that_does_not_fit_the_task_names_the_built_in_ones_that_do():
    """task=lm with model=cnn: the line says which built-in model takes an LM's arguments."""
    with pytest.raises(ValueError) as e:
        models.make("cnn", {"vocab_size": 512, "max_len": 128})
    assert str(e.value) == ("model='cnn' does not take the task's arguments ['max_len', 'vocab_size'] (CNN.__init__() "
                            "got an unexpected keyword argument 'vocab_size'); the built-in models that take them: "
                            "transformer_lm (model=transformer_lm)")
    with pytest.raises(ValueError, match=r"the built-in models that take them: mlp, cnn, transformer, resnet18, "
                                         r"resnet50 \(model=mlp\)$"):
        models.make("transformer_lm", {"num_classes": 10})


def test_accelerators_initialise_op_by_op_to_the_values_of_the_compiled_initialisation(stdlib_text, monkeypatch):  # noqa: F811
    """A CPU initialises as one compiled program, an accelerator op by op (trainer/program.py says why): the same
    parameters either way, so a seed means the same model on every backend."""
    config = TrainConfig(data=str(stdlib_text["train"]), workdir="unused", task="lm", seq_len=32, width=32, depth=2, heads=2,
                         seed=5)
    compiled = Program.build(config).init_variables()["params"]
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    op_by_op = Program.build(config).init_variables()["params"]
    assert count(compiled) == count(op_by_op) > 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), compiled, op_by_op)


def test_iota_embeddings_are_the_lookups_and_their_gradient_is_no_scatter():
    """use_iota_embed=true (MaxText's): the same parameters, the same rows exactly, the same gradients; the backward
    pass multiplies matrices where the lookup's scatter-adds every token's gradient into the tables."""
    kwargs = dict(vocab_size=61, max_len=40, width=16, depth=1, heads=2, attention="blockwise")
    looked_up, one_hot = TransformerLM(**kwargs), TransformerLM(**kwargs, use_iota_embed=True)
    tokens = jax.random.randint(jax.random.key(1), (3, 40), 0, 61)
    batch = {"tokens": tokens, "segment_ids": jnp.ones_like(tokens),
             "positions": jnp.broadcast_to(jnp.arange(40) % 17, tokens.shape)}
    params = looked_up.init(jax.random.key(0), batch)
    assert jax.tree.map(np.shape, one_hot.init(jax.random.key(0), batch)) == jax.tree.map(np.shape, params)
    bf16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    np.testing.assert_array_equal(looked_up.apply(bf16, batch), one_hot.apply(bf16, batch))

    def grads(model):
        return jax.grad(lambda p: model.apply(p, batch).sum())

    for got, want in zip(jax.tree.leaves(grads(one_hot)(params)), jax.tree.leaves(grads(looked_up)(params))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert "scatter-add" in str(jax.make_jaxpr(grads(looked_up))(params))
    assert "scatter-add" not in str(jax.make_jaxpr(grads(one_hot))(params))
    config = TrainConfig.from_args(["data=d", "workdir=w", "task=lm", "use_iota_embed=true"])
    assert config.model_size["use_iota_embed"] is True
    with pytest.raises(ValueError, match="use_iota_embed=True is for model=transformer_lm; model='cnn'"):
        TrainConfig.from_args(["data=d", "workdir=w", "model=cnn", "use_iota_embed=true"])
