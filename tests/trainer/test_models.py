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
from trainer.models import TransformerLM, embed_by_matmul
from trainer.program import Program
from tests.conftest import REPO
from tests.trainer.conftest import run_unoptimised, trainer_here
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
    tied = re.search(r"`logits_via_embedding=true normalize_embedding_logits=false`, ([\d,]+) \|", text)
    gpt2 = TransformerLM(vocab_size=32_000, max_len=1024, width=768, depth=12, heads=12, logits_via_embedding=True)
    shapes = jax.eval_shape(lambda: gpt2.init(jax.random.key(0), jnp.zeros((1, 1024), jnp.int32)))
    assert count(shapes["params"]) == int(tied.group(1).replace(",", "")) == 135_026_432 - 768 * 32_000 - 32_000


@pytest.mark.parametrize("overrides, message", [
    ({"width": 0}, "width must be >= 1 (got width=0); the default is width=128"),
    ({"depth": 0}, "depth must be >= 1 (got depth=0); the default is depth=2"),
    ({"heads": 0}, "heads must be >= 1 (got heads=0); the default is heads=4"),
    ({"mlp_ratio": -1}, "mlp_ratio must be >= 1 (got mlp_ratio=-1); the default is mlp_ratio=4"),
    ({"width": 100, "heads": 8}, "width=100 is not divisible by heads=8 (each head gets width / heads features); use "
                                 "heads=5 or width=104, or set head_dim="),
    ({"num_kv_heads": 3}, "num_kv_heads=3 does not divide heads=4 (each key/value head serves heads / num_kv_heads "
                          "query heads); use one of 1, 2, 4"),
    ({"num_kv_heads": 0}, "num_kv_heads must be >= 1 (got num_kv_heads=0); the default is unset"),
    ({"mlp_activations": "tanh"}, "mlp_activations='tanh' is not one or two of gelu, silu, swish, relu, linear (e.g. "
                                  "mlp_activations=gelu, or silu,linear for SwiGLU)"),
    ({"mlp_activations": "silu,linear,gelu"}, "mlp_activations='silu,linear,gelu' is not one or two of gelu, silu, "
                                              "swish, relu, linear (e.g. mlp_activations=gelu, or silu,linear for "
                                              "SwiGLU)"),
    ({"position_embedding": "alibi"}, "position_embedding='alibi' is not one of learned, rope"),
    ({"normalization": "batchnorm"}, "normalization='batchnorm' is not one of layernorm, rmsnorm"),
    ({"position_embedding": "rope", "width": 36, "heads": 4}, "position_embedding=rope turns pairs of a head's "
                                                              "features, and heads have 9 (an odd number): set "
                                                              "head_dim= to an even number"),
    ({"model": "cnn", "num_kv_heads": 2}, "num_kv_heads=2 is for model=transformer_lm; model='cnn' does not take "
                                          "it: drop num_kv_heads="),
    ({"rope_max_timescale": 500000.0}, "rope_max_timescale=500000 is for position_embedding=rope, and this model's "
                                       "is learned: add position_embedding=rope, or drop rope_max_timescale="),
    ({"normalization_layer_epsilon": 0.0}, "normalization_layer_epsilon must be in (0, 1) (got "
                                           "normalization_layer_epsilon=0.0); the default is 1e-06"),
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
                                                    "width / heads features); use heads=4 or width=100, or set "
                                                    "head_dim=")


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
    params = run_unoptimised(looked_up.init, jax.random.key(0), batch)
    assert jax.tree.map(np.shape, jax.eval_shape(one_hot.init, jax.random.key(0), batch)) == \
        jax.tree.map(np.shape, params)
    bf16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    np.testing.assert_array_equal(run_unoptimised(looked_up.apply, bf16, batch),
                                  run_unoptimised(one_hot.apply, bf16, batch))

    def grads(model):
        return jax.grad(lambda p: model.apply(p, batch).sum())

    for got, want in zip(jax.tree.leaves(run_unoptimised(grads(one_hot), params)),
                         jax.tree.leaves(run_unoptimised(grads(looked_up), params))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert "scatter-add" in str(jax.make_jaxpr(grads(looked_up))(params))
    assert "scatter-add" not in str(jax.make_jaxpr(grads(one_hot))(params))
    config = TrainConfig.from_args(["data=d", "workdir=w", "task=lm", "use_iota_embed=true"])
    assert config.model_size["use_iota_embed"] is True
    with pytest.raises(ValueError, match="use_iota_embed=true is for model=transformer_lm; model='cnn'"):
        TrainConfig.from_args(["data=d", "workdir=w", "model=cnn", "use_iota_embed=true"])


def test_iota_embeddings_by_default_for_small_tables_on_accelerators_only():
    """use_iota_embed=auto: one-hot matrix multiplies for tables of up to 4,096 rows on a GPU or TPU, lookups on a CPU
    and for larger tables; the config takes auto, true and false, and names them for anything else."""
    assert [embed_by_matmul(rows, "gpu") for rows in (1024, 4096, 4097, 32_000)] == [True, True, False, False]
    assert embed_by_matmul(1024, "tpu") and not embed_by_matmul(1024, "cpu")
    tokens = jnp.arange(40).reshape(2, 20) % 61
    auto = TransformerLM(vocab_size=61, max_len=20, width=16, depth=1, heads=2, attention="blockwise")
    params = auto.init(jax.random.key(0), tokens)
    grads = jax.make_jaxpr(jax.grad(lambda p: auto.apply(p, tokens).sum()))(params)
    assert "scatter-add" in str(grads)  # this CPU: lookups
    assert TrainConfig.from_args(["data=d", "workdir=w", "task=lm"]).model_size["use_iota_embed"] == "auto"
    assert TrainConfig.from_args(["data=d", "workdir=w", "task=lm", "use_iota_embed=false"]).use_iota_embed is False
    with pytest.raises(ValueError, match="use_iota_embed='sometimes' is not one of auto, true, false"):
        TrainConfig.from_args(["data=d", "workdir=w", "task=lm", "use_iota_embed=sometimes"])


# --- the layout keys: Llama's (grouped-query attention, head_dim, rope, rmsnorm, a gated MLP) -------------------------
LLAMA = {"num_kv_heads": 2, "head_dim": 12, "mlp_dim": 40, "mlp_activations": "silu,linear",
         "normalization": "rmsnorm", "position_embedding": "rope"}


def llama_parameters(vocab: int, width: int, depth: int, heads: int, kv_heads: int, head_dim: int, mlp_dim: int) -> int:
    """TransformerLM's parameter count with Llama's layout, term by term: no position table; queries of heads x
    head_dim, keys and values of kv_heads x head_dim; a gated MLP (two input layers); RMSNorms (a scale each)."""
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = (width * q + q) + 2 * (width * kv + kv) + (q * width + width)
    mlp = 2 * (width * mlp_dim + mlp_dim) + (mlp_dim * width + width)
    return vocab * width + depth * (attention + mlp + 2 * width) + width + (width * vocab + vocab)


def test_the_layout_keys_build_the_lm_they_name(stdlib_text):  # noqa: F811
    config = TrainConfig(data=str(stdlib_text["train"]), workdir="w", task="lm", width=32, depth=2, heads=4, **LLAMA)
    params = Program.build(config).abstract_params()
    assert count(params) == 34_306 == llama_parameters(258, 32, 2, 4, 2, 12, 40)
    block = params["TransformerBlock_1"]
    attention = block["MultiHeadDotProductAttention_0"]
    assert [attention[name]["kernel"].shape for name in ("query", "key", "value", "out")] == [
        (32, 4, 12), (32, 2, 12), (32, 2, 12), (4, 12, 32)]
    assert sorted(block) == ["Dense_0", "Dense_1", "Dense_2", "MultiHeadDotProductAttention_0", "RMSNorm_0",
                             "RMSNorm_1"]
    assert sorted(params) == ["Dense_0", "Embed_0", "RMSNorm_0", "TransformerBlock_0", "TransformerBlock_1"]


@pytest.mark.parametrize("normalize", [pytest.param(True, marks=pytest.mark.slow), False])
def test_tied_logits_are_the_token_tables_transpose_and_train_it_from_both_ends(normalize):
    """logits_via_embedding: the logits are what an untied model computes with the token table's transpose (divided
    by sqrt(width) under normalize_embedding_logits) as its output layer, and the table's gradient is that model's
    embedding gradient plus its output kernel's, transposed."""
    sizes = dict(vocab_size=50, max_len=16, width=32, depth=1, heads=4, attention="dense")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 50, (2, 16)))
    tied = TransformerLM(**sizes, logits_via_embedding=True, normalize_embedding_logits=normalize)
    untied = TransformerLM(**sizes)
    params = tied.init(jax.random.key(0), tokens)["params"]
    scale = math.sqrt(32) if normalize else 1.0
    table = params["Embed_0"]["embedding"]
    as_untied = {**params, "Dense_0": {"kernel": table.T / scale, "bias": jnp.zeros(50)}}
    np.testing.assert_allclose(tied.apply({"params": params}, tokens), untied.apply({"params": as_untied}, tokens),
                               rtol=1e-5, atol=1e-5)

    def loss(model, p):
        return jnp.mean(jax.nn.log_softmax(model.apply({"params": p}, tokens))[..., 0])

    tied_grad = jax.grad(lambda p: loss(tied, p))(params)["Embed_0"]["embedding"]
    untied_grads = jax.grad(lambda p: loss(untied, p))(as_untied)
    np.testing.assert_allclose(tied_grad, untied_grads["Embed_0"]["embedding"] + untied_grads["Dense_0"]["kernel"].T
                               / scale, rtol=1e-4, atol=1e-6)
    assert count(params) == count(untied.init(jax.random.key(0), tokens)["params"]) - (32 * 50 + 50)  # no kernel, bias
    assert tied.flops_per_token() == untied.flops_per_token()  # the logits' matrix multiply is still done


@pytest.mark.parametrize("tied", [False, True])
def test_logits_dot_in_fp32_multiplies_the_bfloat16_model_in_float32(tied):
    """With bf16 parameters (the trainer's dtype=bfloat16) the logits' dot product is a float32 one: float32 logits that
    bf16 cannot hold, within bf16's rounding of the bf16 dot's (which alone rounds each logit to bf16)."""
    sizes = dict(vocab_size=64, max_len=16, width=64, depth=1, heads=4, attention="dense", logits_via_embedding=tied)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 16)))
    params = TransformerLM(**sizes).init(jax.random.key(0), tokens)["params"]
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    narrow = TransformerLM(**sizes).apply({"params": params}, tokens)
    wide = TransformerLM(**sizes, logits_dot_in_fp32=True).apply({"params": params}, tokens)
    assert narrow.dtype == jnp.bfloat16 and wide.dtype == jnp.float32
    held = np.asarray(wide.astype(jnp.bfloat16).astype(jnp.float32))
    assert np.mean(held != np.asarray(wide)) > 0.9  # not a bf16 product cast up
    np.testing.assert_allclose(np.asarray(narrow, np.float32), np.asarray(wide), rtol=2e-2, atol=2e-2)
    config = TrainConfig(data="x", workdir="w", task="lm", logits_dot_in_fp32=True)
    assert config.model_size["logits_dot_in_fp32"] is True


def test_a_resume_without_tied_embeddings_names_them(stdlib_text, tmp_path):  # noqa: F811
    from trainer import train

    common = dict(data=str(stdlib_text["train"]), workdir=str(tmp_path), task="lm", seq_len=32, batch_size=4,
                  width=32, heads=2, depth=1, checkpoint_every=2)
    assert train.train_and_evaluate(TrainConfig(steps=2, logits_via_embedding=True, **common))["final_step"] == 2
    with pytest.raises(ValueError, match=r"holds step 2 of a model other than this one \(params\['Dense_0'\]\['bias'\] "
                                         r"is absent there .*: resume with logits_via_embedding=true \(what it was "
                                         r"written with\)"):
        train.train_and_evaluate(TrainConfig(steps=4, **common))


def test_a_resume_with_the_same_shapes_and_another_layout_says_so(stdlib_text, tmp_path, caplog):  # noqa: F811
    from trainer import train

    common = dict(data=str(stdlib_text["train"]), workdir=str(tmp_path), task="lm", seq_len=32, batch_size=4,
                  width=32, heads=2, depth=1, checkpoint_every=2, logits_via_embedding=True)
    train.train_and_evaluate(TrainConfig(steps=2, **common))
    with caplog.at_level("WARNING", logger="trainer.checkpoints"):
        assert train.train_and_evaluate(TrainConfig(steps=3, normalize_embedding_logits=False, **common))[
            "final_step"] == 3
    assert ("resuming step 2, written with normalize_embedding_logits=true: the model computes otherwise from here on "
            "(resume with those to continue the same model)") in caplog.text


def test_normalize_embedding_logits_is_for_tied_embeddings():
    with pytest.raises(ValueError, match="normalize_embedding_logits=false is for logits_via_embedding=true"):
        TrainConfig(data="x", workdir="w", task="lm", normalize_embedding_logits=False)
    tied = TrainConfig(data="x", workdir="w", task="lm", logits_via_embedding=True, normalize_embedding_logits=False)
    assert tied.model_size["logits_via_embedding"] is True and tied.model_size["normalize_embedding_logits"] is False


def test_a_config_file_may_list_the_mlp_activations_as_maxtext_does(tmp_path):
    path = tmp_path / "run.json"
    path.write_text('{"task": "lm", "mlp_activations": ["silu", "linear"]}')
    config = TrainConfig.from_args(["data=x", "workdir=w"], str(path))
    assert config.mlp_activations == "silu,linear" and config.model_size["mlp_activations"] == "silu,linear"
    assert TrainConfig(data="x", workdir="w", task="lm", width=40, heads=3, head_dim=16).model_size["head_dim"] == 16


@pytest.mark.parametrize("layout", [{}, LLAMA], ids=["gpt2", "llama"])
def test_flops_per_token_is_six_per_weight_of_each_matrix_multiply_and_the_attention(layout):
    """Counted from the model's own kernels (every Dense and DenseGeneral: the embeddings are lookups, not
    multiplies), plus 12 x depth x seq_len x (heads x head_dim) for the attention's two S x S products."""
    model = TransformerLM(vocab_size=300, max_len=64, width=32, depth=3, heads=4, **layout)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 64), jnp.int32)))["params"]
    kernels = sum(math.prod(x.shape) for path, x in jax.tree_util.tree_leaves_with_path(shapes)
                  if path[-1].key == "kernel")
    query_features = 4 * layout.get("head_dim", 32 // 4)
    assert model.flops_per_token() == 6 * kernels + 12 * 3 * 64 * query_features
    # the figure docs/training.md gives for the 104M model of the GPU measurements
    measured = TransformerLM(vocab_size=1024, max_len=1024, width=1024, depth=8, heads=16)
    assert measured.flops_per_token() == 710_934_528  # "711M"


def test_rotary_embeddings_turn_feature_pairs_by_the_position_so_only_offsets_count():
    x = np.zeros((1, 2, 1, 4), np.float32)
    x[..., 0] = 1.0  # feature 0 pairs with feature 2 (the second half's first), and turns 1 radian a position
    turned = np.asarray(models.rotary_embedding(jnp.asarray(x), np.array([[0, 1]]), 10_000.0))
    np.testing.assert_allclose(turned[0, :, 0], [[1, 0, 0, 0], [np.cos(1), 0, np.sin(1), 0]], atol=1e-6)

    rng = np.random.default_rng(5)
    q, k = (rng.normal(size=(1, 9, 2, 16)).astype(np.float32) for _ in range(2))

    def scores(positions):
        rq, rk = (models.rotary_embedding(jnp.asarray(a), positions, 10_000.0) for a in (q, k))
        return np.einsum("bqhd,bkhd->bhqk", rq, rk)

    positions = np.arange(9)[None]
    np.testing.assert_allclose(scores(positions), scores(positions + 1000), rtol=1e-3, atol=1e-3)
    plain = np.einsum("bqhd,bkhd->bhqk", q, k)
    assert np.abs(scores(positions) - plain).max() > 1  # the offsets do count: the check can fail
    np.testing.assert_allclose(np.linalg.norm(models.rotary_embedding(jnp.asarray(q), positions, 1e4), axis=-1),
                               np.linalg.norm(q, axis=-1), rtol=1e-5)  # a rotation


@pytest.mark.parametrize("position_embedding", ["learned", "rope"])
def test_a_packed_document_is_computed_as_it_is_alone_and_rope_ignores_where_it_starts(position_embedding):
    model = TransformerLM(vocab_size=50, max_len=24, width=32, depth=2, heads=4, num_kv_heads=2,
                          position_embedding=position_embedding, attention="blockwise")
    tokens = np.array([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 0, 0]])
    packed = {"tokens": tokens, "segment_ids": np.array([[1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 0, 0]]),
              "positions": np.array([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 0]])}
    params = model.init(jax.random.key(0), packed)
    alone = {"tokens": tokens[:, 4:10], "segment_ids": np.ones((1, 6), np.int32), "positions": np.arange(6)[None]}
    logits = np.asarray(model.apply(params, packed))
    np.testing.assert_allclose(logits[0, 4:10], np.asarray(model.apply(params, alone))[0], atol=1e-5)
    later = {**alone, "positions": alone["positions"] + 7}  # the same document, numbered from 7
    moved = np.abs(np.asarray(model.apply(params, later)) - np.asarray(model.apply(params, alone))).max()
    assert moved < 1e-4 if position_embedding == "rope" else moved > 1e-3  # a learned table sees where it starts


def test_a_gated_mlp_multiplies_its_activated_input_layer_by_its_linear_one():
    """mlp_activations=silu,linear (SwiGLU) with RMSNorm, written out: (silu(n W1 + b1) * (n W2 + b2)) W0 + b0 over
    n = x / rms(x) * scale."""
    block = models.DecoderBlock(heads=2, dim=8, mlp_dim=12, mlp_activations="swish,linear", normalization="rmsnorm",
                                normalization_layer_epsilon=0.5, attention="blockwise")  # swish: silu's other name
    x = np.random.default_rng(2).normal(size=(2, 5, 8)).astype(np.float32)
    ones = np.ones((2, 5), np.int32)
    variables = block.init(jax.random.key(0), x, ones, ones)
    got = block.apply(variables, x, method=models._normed_mlp)
    p = variables["params"]
    n = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 0.5) * np.asarray(p["RMSNorm_1"]["scale"])

    def dense(name, a):
        return a @ np.asarray(p[name]["kernel"]) + np.asarray(p[name]["bias"])

    a = dense("Dense_1", n)
    want = dense("Dense_0", a / (1 + np.exp(-a)) * dense("Dense_2", n))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_the_documented_llama_layout_run_has_the_documented_count():
    """docs/training.md's "Llama's layout" command, its model keys read from the page, counted from the model."""
    text = (Path(REPO) / "docs" / "training.md").read_text()
    section = text[text.index("### Llama's layout"):]
    command = section[section.index("python -m trainer"):section.index("```", section.index("python -m trainer"))]
    keys = dict(item.split("=", 1) for item in command.replace("\\\n", " ").split() if "=" in item)
    layout = {k: (int(v) if v.isdigit() else v) for k, v in keys.items()
              if k in ("width", "depth", "heads", *LLAMA)}
    assert set(layout) == {"width", "depth", "heads", *LLAMA} - {"head_dim"}, layout
    model = TransformerLM(vocab_size=1024, max_len=int(keys["seq_len"]), **layout)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
    documented = re.search(r"Over a 1,024-token vocabulary the run above\s+has ([\d,]+) parameters", section)
    assert count(shapes) == int(documented.group(1).replace(",", "")) == llama_parameters(
        1024, layout["width"], layout["depth"], layout["heads"], layout["num_kv_heads"],
        layout["width"] // layout["heads"], layout["mlp_dim"])


def test_maxtexts_names_for_the_trainers_keys_are_named_with_ours():
    with pytest.raises(ValueError) as e:
        TrainConfig.from_args(["data=x", "workdir=w", "task=lm", "base_emb_dim=1024", "base_num_kv_heads=4"])
    assert str(e.value) == ("unknown config key(s) ['base_emb_dim', 'base_num_kv_heads']; MaxText's names: base_emb_dim "
                            "is width here; base_num_kv_heads is num_kv_heads here (python -m trainer --help lists "
                            "every key)")
    with pytest.raises(ValueError, match=r"did you mean mlp_dim\?"):  # not MaxText's: the closest of ours
        TrainConfig.from_args(["data=x", "workdir=w", "task=lm", "mlp_dims=64"])
    with pytest.raises(ValueError) as e:  # MaxText's settings covered otherwise: what covers them
        TrainConfig.from_args(["data=x", "workdir=w", "opt_type=adamw", "weight_dtype=float32", "grain_worker_count=4"])
    assert str(e.value) == ("unknown config key(s) ['grain_worker_count', 'opt_type', 'weight_dtype']; MaxText's "
                            "names: grain_worker_count: data_workers=; opt_type: optimizer= (adamw, adam, sgd, "
                            "adafactor); weight_dtype: the parameters are float32 here; dtype= sets the step's compute "
                            "dtype (python -m trainer --help lists every key)")
    with pytest.raises(ValueError) as e:  # a MaxText name beside a misspelt one of ours: both named
        TrainConfig.from_args(["data=x", "workdir=w", "run_name=a", "log_period=5", "stepz=3"])
    assert str(e.value) == ("unknown config key(s) ['log_period', 'run_name', 'stepz']; MaxText's names: log_period is "
                            "log_every here; run_name: workdir= is the run's own directory (MaxText's "
                            "base_output_directory/run_name): a workdir holding a checkpoint resumes it; did you mean "
                            "steps? (python -m trainer --help lists every key)")
    with pytest.raises(ValueError, match=r"^attention='flash' is not one of auto, cudnn, splash, blockwise, dense "
                                         r"\(MaxText's attention=flash is attention=auto \(cuDNN on a GPU"):
        TrainConfig.from_args(["data=x", "workdir=w", "task=lm", "attention=flash"])


def test_a_config_file_in_yaml_as_maxtext_writes_them(tmp_path):
    path = tmp_path / "run.yml"
    path.write_text("# a MaxText-style config\ntask: lm\nsteps: 50\nlearning_rate: 3.0e-4\n"
                    "mlp_activations: [silu, linear]\ndata: {web: out/web, code: out/code}\n"
                    "weights: {web: 3, code: 1}\nworkdir: runs/lm\n")
    config = TrainConfig.from_args(["steps=60"], str(path))
    assert (config.steps, config.learning_rate, config.mlp_activations) == (60, 3e-4, "silu,linear")
    assert config.data_source == {"web": "out/web", "code": "out/code"} and config.data_weights == {"web": 3, "code": 1}
    (tmp_path / "bad.yaml").write_text("steps: [1\n")
    with pytest.raises(ValueError, match=r"^--config .*bad.yaml is not YAML: .* at line 2, column 1"):
        TrainConfig.from_args([], str(tmp_path / "bad.yaml"))
    (tmp_path / "slice.yml").write_text("task: lm\nsplit: [:99%]\n")  # the docs' slice, unquoted
    with pytest.raises(ValueError, match=r"^--config .*slice.yml is not YAML: expected the node content, but found ':' "
                                         r"at line 2, column 9 \(split: \[:99%\]\); quote a split's slice, "
                                         r"split: \"\[:99%\]\" \(YAML reads \[ as a list\)$"):
        TrainConfig.from_args([], str(tmp_path / "slice.yml"))
    (tmp_path / "list.yml").write_text("- steps\n")
    with pytest.raises(ValueError, match=r"holds a list; it must be a mapping of keys"):
        TrainConfig.from_args([], str(tmp_path / "list.yml"))


def test_images_to_float_scales_pixels_and_keeps_float_features():
    """uint8/int pixels become [0, 1]; a float feature (a vector, an image stored as floats) was divided by 255 too,
    so features in [0, 1] trained as [0, 1/255]. It is only cast."""
    from trainer.models import images_to_float

    pixels = np.array([[0, 51, 255, 102]], np.uint8)
    np.testing.assert_allclose(images_to_float(pixels), np.array([0, 0.2, 1, 0.4]).reshape(1, 2, 2, 1), rtol=1e-6)
    np.testing.assert_allclose(images_to_float(pixels.astype(np.int64)), images_to_float(pixels))
    floats = np.array([[0.25, -3.0, 7.5]], np.float64)
    got = images_to_float(floats)
    assert got.dtype == np.float32 and got.tolist() == [[0.25, -3.0, 7.5]]
