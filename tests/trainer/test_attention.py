"""trainer/attention.py against softmax(QK^T / sqrt(d)) V written out here, on packed rows: several documents a row,
documents across block edges, padding; outputs and gradients. The cuDNN path's arguments are checked on the CPU
through jax.nn.dot_product_attention(implementation="xla"), which takes the same ones. Memory: XLA's own account of
a compiled training step, blockwise against dense."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer import attention
from trainer.config import REMATS, TrainConfig
from trainer.models import TransformerLM, remat_policy
from tests.trainer.conftest import run_unoptimised


def reference(q, k, v, segment_ids):
    """softmax(QK^T / sqrt(d) masked) V in float32: j <= i and the same segment."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    s = q.shape[1]
    allowed = (segment_ids[:, None, :, None] == segment_ids[:, None, None, :]) & np.tril(np.ones((s, s), bool))
    scores = np.where(allowed, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


def packed_rows(rng, batch: int, length: int, documents: int, padding: int) -> np.ndarray:
    """Segment ids 1..documents in contiguous runs of random lengths, then `padding` zeros."""
    rows = np.zeros((batch, length), np.int32)
    for b in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, length - padding), documents - 1, replace=False))
        rows[b, :length - padding] = np.searchsorted(cuts, np.arange(length - padding), side="right") + 1
    return rows


@pytest.fixture
def rows():
    rng = np.random.default_rng(7)
    b, s, h, d = 3, 80, 2, 16
    q, k, v = (rng.normal(size=(b, s, h, d)).astype(np.float32) for _ in range(3))
    segments = packed_rows(rng, b, s, documents=5, padding=6)
    # documents cross the 16- and 32-position block edges, in every row
    assert all(any(row[e - 1] == row[e] > 0 for e in range(16, s, 16)) for row in segments)
    return q, k, v, segments


CASES = [("blockwise", {"block": 16}), ("blockwise", {"block": 32}), ("blockwise", {"block": 128}),
         ("cudnn", {"implementation": "xla"}), ("dense", {})]


@pytest.mark.parametrize("kind, options", CASES, ids=lambda c: str(c))
def test_each_kind_is_the_reference_softmax_and_its_gradient(rows, kind, options):
    q, k, v, segments = rows
    out = attention.attend(q, k, v, segments, kind, **options)
    np.testing.assert_allclose(out, reference(q, k, v, segments), atol=2e-6)

    weights = np.random.default_rng(1).normal(size=q.shape).astype(np.float32)  # a loss that weighs every output

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * weights)

    ours = jax.grad(loss(lambda *a: attention.attend(*a, segments, kind, **options)), argnums=(0, 1, 2))(q, k, v)
    expected = jax.grad(loss(lambda *a: _jax_reference(*a, segments)), argnums=(0, 1, 2))(q, k, v)
    for got, want in zip(ours, expected):
        np.testing.assert_allclose(got, want, atol=2e-5)


def _jax_reference(q, k, v, segment_ids):
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    scores = jnp.where(attention.causal_segment_mask(jnp.asarray(segment_ids)), scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)


@pytest.fixture(scope="module")
def grouped_rows():
    """Four query heads over one or two key/value heads, on packed rows."""
    rng = np.random.default_rng(11)
    b, s, h, d = 2, 48, 4, 8
    q = rng.normal(size=(b, s, h, d)).astype(np.float32)
    k, v = (rng.normal(size=(b, s, 2, d)).astype(np.float32) for _ in range(2))
    return q, k, v, packed_rows(rng, b, s, documents=4, padding=3)


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("kind, options", [("blockwise", {"block": 16}), ("cudnn", {"implementation": "xla"}),
                                           ("dense", {})], ids=lambda c: str(c))
def test_grouped_key_value_heads_are_each_shared_by_their_run_of_query_heads(grouped_rows, kind, options, kv_heads):
    """Grouped-query attention: query head h reads key/value head h // (heads / kv_heads) in every kind (cuDNN's
    stand-in is JAX's own grouping), outputs and gradients."""
    q, k, v, segments = grouped_rows
    k, v = k[:, :, :kv_heads], v[:, :, :kv_heads]
    group = q.shape[2] // kv_heads
    out = attention.attend(q, k, v, segments, kind, **options)
    np.testing.assert_allclose(out, reference(q, np.repeat(k, group, 2), np.repeat(v, group, 2), segments),
                               atol=2e-6)
    weights = np.random.default_rng(1).normal(size=q.shape).astype(np.float32)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * weights)

    ours = jax.grad(loss(lambda *a: attention.attend(*a, segments, kind, **options)), argnums=(0, 1, 2))(q, k, v)
    expected = jax.grad(loss(lambda q, k, v: _jax_reference(q, jnp.repeat(k, group, 2), jnp.repeat(v, group, 2),
                                                            segments)), argnums=(0, 1, 2))(q, k, v)
    for got, want in zip(ours, expected):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=2e-5)
    if kv_heads == 2:  # the second key/value head moves the last two query heads' outputs only
        changed = v.copy()
        changed[:, :, 1] += 10.0
        moved = np.abs(np.asarray(attention.attend(q, k, changed, segments, kind, **options) - out)).max(axis=(0, 1, 3))
        assert (moved[:2] < 1e-5).all() and (moved[2:] > 1).all(), moved


def test_blockwise_keeps_grouped_keys_and_values_at_their_own_heads():
    """What the backward pass keeps of grouped-query attention: keys and values of 1 head, not copied to the 8 query
    heads (which would keep 2 x 7 more heads' [B, S, D] arrays)."""
    b, s, h, d = 2, 256, 8, 32
    q = jax.ShapeDtypeStruct((b, s, h, d), jnp.float32)
    segments = jnp.ones((b, s), jnp.int32)

    def kept(kv_heads: int) -> int:
        k = jax.ShapeDtypeStruct((b, s, kv_heads, d), jnp.float32)
        residuals = jax.eval_shape(lambda q, k, v: jax.vjp(lambda q, k, v: attention.blockwise(q, k, v, segments),
                                                           q, k, v)[1], q, k, k)
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(residuals))

    one_head = b * s * d * 4
    assert kept(8) - kept(1) == 2 * 7 * one_head, (kept(8), kept(1))
    assert kept(1) < 3.5 * h * one_head  # queries, output (8 heads each), keys, values (1 each), one float a row


def test_a_document_never_sees_another_and_padding_only_padding(rows):
    q, k, v, segments = rows
    changed = v.copy()
    changed[segments == 3] += 10.0  # another document's values...
    before = attention.attend(q, k, v, segments, "blockwise", block=16)
    after = attention.attend(q, k, changed, segments, "blockwise", block=16)
    others = segments != 3
    np.testing.assert_allclose(np.asarray(before)[others], np.asarray(after)[others], atol=1e-6)
    assert np.abs(np.asarray(before - after)[~others]).min() > 1  # ...move its own outputs: the check can fail


@pytest.mark.parametrize("kind, options", [("blockwise", {"block": 32}), ("cudnn", {"implementation": "xla"})])
def test_bfloat16_inputs_stay_within_bfloat16_of_the_reference(rows, kind, options):
    q, k, v, segments = rows
    out = attention.attend(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), segments, kind, **options)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), reference(q, k, v, segments), atol=0.05)


def test_auto_is_blockwise_off_the_gpu_and_cudnn_needs_a_gpu(caplog):
    caplog.set_level(logging.INFO, "trainer.attention")
    assert attention.resolve("auto", (2, 64, 4, 32), jnp.bfloat16, platform="cpu") == "blockwise"
    assert "the fused kernels run on NVIDIA GPUs (cuDNN) and TPUs (Splash); this backend is cpu" in caplog.text
    assert attention.resolve("dense", (2, 64, 4, 32), jnp.float32, platform="cpu") == "dense"
    with pytest.raises(ValueError, match="attention=cudnn runs on NVIDIA GPUs, and this backend is cpu; use "
                                         r"attention=auto \(the fused kernel where one runs, else blockwise\)"):
        attention.resolve("cudnn", (2, 64, 4, 32), jnp.bfloat16, platform="cpu")
    with pytest.raises(ValueError, match="attention=splash runs on TPUs, and this backend is gpu"):
        attention.resolve("splash", (2, 128, 4, 32), jnp.bfloat16, platform="gpu")


def test_auto_on_a_gpu_falls_back_when_cudnn_refuses(caplog):
    """Float32 queries never reach cuDNN; bf16 ones go through a compile of cuDNN's forward and backward pass at the
    step's shapes, which fails here (no cuDNN on this CPU backend): blockwise, the reason logged once."""
    caplog.set_level(logging.INFO, "trainer.attention")
    assert attention.resolve("auto", (2, 64, 4, 32), jnp.float32, platform="gpu") == "blockwise"
    assert "takes bf16/fp16 and these queries are float32" in caplog.text
    assert attention.resolve("auto", (2, 64, 4, 40), jnp.bfloat16, platform="gpu") == "blockwise"
    assert "cuDNN refused these shapes" in caplog.text
    caplog.clear()
    assert attention.resolve("auto", (2, 64, 4, 40), jnp.bfloat16, platform="gpu") == "blockwise"
    assert caplog.text == ""  # once per shape


def test_auto_on_a_gpu_takes_cudnn_when_it_compiles_and_matches_blockwise(caplog):
    """The choosing as on a GPU, with jax.nn.dot_product_attention's XLA implementation standing in for cuDNN: it
    compiles at the step's shapes and its outputs and gradients match blockwise attention's on packed rows."""
    caplog.set_level(logging.INFO, "trainer.attention")
    chosen = []

    @jax.jit
    def step(q):  # chosen as the model is traced, as in the training step (the check's own arrays are concrete)
        chosen.append(attention.resolve("auto", q.shape, q.dtype, platform="gpu", implementation="xla"))
        return q

    step(jnp.zeros((2, 96, 2, 16), jnp.bfloat16))
    assert chosen == ["cudnn"]
    assert "cudnn for queries 2x96x2x16 bfloat16 (cuDNN fused attention compiled at these shapes; it matches " \
           "blockwise attention (0.00" in caplog.text
    assert attention.resolve("auto", (2, 96, 4, 16), jnp.bfloat16, platform="gpu", implementation="xla",
                             kv_heads=2) == "cudnn"
    assert "cudnn for queries 2x96x4x16 (2 key/value heads) bfloat16 (cuDNN fused attention compiled" in caplog.text
    note = attention.unused_mask_gradient(jax.__version__)  # this jax's own cost of the cudnn kind, if any
    assert (note in caplog.text) if note else ("jax-ml/jax#34685" not in caplog.text)


def test_a_jax_before_0_11_1_is_told_its_cudnn_attention_computes_an_unused_mask_gradient():
    for old in ("0.10.2", "0.11.0", "0.9.0.1"):
        assert attention.unused_mask_gradient(old) == (
            f"jax {old}'s cuDNN attention also computes a [batch, heads, seq, seq] gradient of the packed documents' "
            "mask in every backward pass, which nothing uses (jax-ml/jax#34685, fixed in jax 0.11.1): upgrade jax "
            "for a faster step with less memory")
    for fixed in ("0.11.1", "0.11.2", "0.12.0", "1.0.0"):
        assert attention.unused_mask_gradient(fixed) is None


def test_auto_on_a_gpu_refuses_a_fused_kernel_that_lets_documents_see_each_other(monkeypatch, caplog):
    """A fused kernel that compiles but drops the packed documents' mask (only causal) is caught by the agreement
    check, not trained with."""
    def unmasked(q, k, v, segment_ids, *, implementation):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)

    monkeypatch.setattr(attention, "fused", unmasked)
    caplog.set_level(logging.INFO, "trainer.attention")
    assert attention.resolve("auto", (2, 112, 2, 16), jnp.bfloat16, platform="gpu", implementation="xla") == "blockwise"
    assert "cuDNN's outputs or gradients on packed rows differ from blockwise attention's by 0." in caplog.text
    assert "(relative; at most 0.05 expected in bfloat16): this cuDNN does not apply the packed documents' mask" \
           in caplog.text


@pytest.fixture(scope="module")
def long_rows():
    """Rows of 256 positions (Splash takes multiples of 128): five documents a row across the 128-position block
    edge, padding at the end."""
    rng = np.random.default_rng(3)
    b, s, h, d = 2, 256, 2, 32
    q, k, v = (rng.normal(size=(b, s, h, d)).astype(np.float32) for _ in range(3))
    segments = packed_rows(rng, b, s, documents=5, padding=20)
    assert all(row[127] == row[128] > 0 for row in segments) or all(row[127] != row[128] for row in segments)
    return q, k, v, segments


def test_splash_is_the_reference_softmax_and_its_gradient(long_rows):
    """Splash's Pallas kernel, interpreted on the CPU (implementation="xla"): the causal mask and the segment ids
    are the kernel's own, so this checks what a TPU runs, but for the TPU's compiler."""
    q, k, v, segments = long_rows
    out = attention.attend(q, k, v, segments, "splash", implementation="xla")
    np.testing.assert_allclose(out, reference(q, k, v, segments), atol=2e-6)
    weights = np.random.default_rng(1).normal(size=q.shape).astype(np.float32)

    def loss(kind, **options):
        return lambda q, k, v: jnp.sum(attention.attend(q, k, v, segments, kind, **options) * weights)

    got = jax.grad(loss("splash", implementation="xla"), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss("dense"), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=2e-5)
    with pytest.raises(ValueError, match="Splash attention takes rows of a multiple of 128 positions, and these have "
                                         "80"):
        attention.splash(q[:, :80], k[:, :80], v[:, :80], segments[:, :80], implementation="xla")


def test_splash_takes_grouped_key_value_heads(long_rows):
    """The kernel's own grouped path (one key/value head for the two query heads here), interpreted."""
    q, k, v, segments = long_rows
    k, v = k[:, :, :1], v[:, :, :1]
    out = attention.attend(q, k, v, segments, "splash", implementation="xla")
    np.testing.assert_allclose(out, reference(q, np.repeat(k, 2, 2), np.repeat(v, 2, 2), segments), atol=2e-6)


def test_auto_on_a_tpu_takes_splash_when_it_compiles_and_matches_blockwise(caplog):
    """The choosing as on a TPU, the kernel interpreted: Splash where its rows fit, blockwise where they do not."""
    caplog.set_level(logging.INFO, "trainer.attention")
    assert attention.resolve("auto", (2, 256, 2, 32), jnp.float32, platform="tpu", implementation="xla") == "splash"
    assert "splash for queries 2x256x2x32 float32 (Splash fused attention compiled at these shapes; it matches " \
           "blockwise attention (0.00" in caplog.text
    assert attention.resolve("auto", (2, 200, 2, 32), jnp.float32, platform="tpu", implementation="xla") == "blockwise"
    assert "Splash refused these shapes: ValueError: Splash attention takes rows of a multiple of 128 positions, and " \
           "these have 200" in caplog.text
    assert "jax-ml/jax#34685" not in caplog.text  # cuDNN's note only


def test_the_agreement_check_rows_have_documents_across_block_edges_and_padding():
    np.testing.assert_array_equal(attention.check_segments(20), [
        [1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 4, 4, 4, 4],
        [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 0, 0]])
    rows = attention.check_segments(1024)
    edges = range(attention.BLOCK, 1024, attention.BLOCK)
    assert all(any(row[e - 1] == row[e] > 0 for e in edges) for row in rows)
    assert (rows[1, -128:] == 0).all() and (rows[0] > 0).all()


# --- the LM: remat, memory ----------------------------------------------------------------------------------------
def _lm_batch(b=2, s=40, vocab=61):
    rng = np.random.default_rng(3)
    segments = packed_rows(rng, b, s, documents=3, padding=5)
    positions = np.zeros_like(segments)
    for row, seg in zip(positions, segments):
        for doc in np.unique(seg):
            row[seg == doc] = np.arange((seg == doc).sum())
    return {"tokens": rng.integers(1, vocab, (b, s)).astype(np.int32), "segment_ids": segments,
            "positions": positions}


def test_every_remat_policy_gives_the_loss_and_gradients_of_none():
    batch = _lm_batch()

    def make(remat, kind="blockwise"):
        return TransformerLM(vocab_size=61, max_len=40, width=16, depth=1, heads=2, attention=kind, remat=remat)

    params = run_unoptimised(make("none").init, jax.random.key(0), batch)  # (the same parameters under any remat)

    def loss_and_grads(remat, kind="blockwise"):
        model = make(remat, kind)

        def loss(p):
            logits = model.apply(p, batch)
            return -jnp.mean(jax.nn.log_softmax(logits)[..., 0] * (batch["segment_ids"] > 0))

        return run_unoptimised(jax.value_and_grad(loss), params)

    base_loss, base_grads = loss_and_grads("none")
    assert float(base_loss) == pytest.approx(3.14845, abs=1e-4)  # pinned: a change of the model shows here
    assert float(loss_and_grads("none", "dense")[0]) == pytest.approx(float(base_loss), abs=1e-5)
    for remat in REMATS[1:]:
        loss, grads = loss_and_grads(remat)
        assert float(loss) == pytest.approx(float(base_loss), abs=1e-6), remat
        for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(base_grads)):
            np.testing.assert_allclose(got, want, atol=1e-6, err_msg=remat)
    with pytest.raises(ValueError, match="remat='sometimes' is not one of none, elementwise, full, minimal"):
        remat_policy("sometimes")


@pytest.mark.slow  # ~25 s; each policy (test_every_remat_policy...), attention and the layout have default tests
def test_llamas_layout_gives_the_same_loss_and_gradients_under_remat_and_with_each_attention():
    """Grouped keys and values, rope, RMSNorm and a gated MLP through the remat policies (the projections' names
    after the rotary embedding, both of the MLP's input layers under mlpwi) and the attention kinds."""
    batch = _lm_batch()
    layout = {"num_kv_heads": 1, "mlp_activations": "silu,linear", "normalization": "rmsnorm",
              "position_embedding": "rope"}

    def make(remat, kind="blockwise"):
        return TransformerLM(vocab_size=61, max_len=40, width=16, depth=2, heads=2, attention=kind, remat=remat,
                             **layout)

    params = run_unoptimised(make("none").init, jax.random.key(0), batch)

    def loss_and_grads(remat, kind="blockwise"):
        model = make(remat, kind)

        def loss(p):
            return -jnp.mean(jax.nn.log_softmax(model.apply(p, batch))[..., 0] * (batch["segment_ids"] > 0))

        return run_unoptimised(jax.value_and_grad(loss), params)

    base_loss, base_grads = loss_and_grads("none")
    for remat, kind in (("none", "dense"), ("full", "blockwise"), ("save_qkv_proj", "blockwise"),
                        ("save_dot_except_mlpwi", "blockwise"), ("minimal", "dense")):
        loss, grads = loss_and_grads(remat, kind)
        assert float(loss) == pytest.approx(float(base_loss), abs=1e-5), (remat, kind)
        for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(base_grads)):
            np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"{remat} {kind}")


def _lm_step(seq_len: int, attention_kind: str, remat: str = "none"):
    """(loss function, abstract parameters, abstract batch) of a small LM: shapes only, nothing computed."""
    model = TransformerLM(vocab_size=256, max_len=seq_len, width=64, depth=2, heads=4, attention=attention_kind,
                          remat=remat)
    tokens = jax.ShapeDtypeStruct((8, seq_len), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, seq_len), jnp.int32)))

    def loss(p, batch):
        return model.apply(p, batch).astype(jnp.float32).mean()

    return loss, params, {"tokens": tokens, "segment_ids": tokens, "positions": tokens}


def _step_temp_bytes(seq_len: int, attention_kind: str) -> int:
    """XLA's temporaries for the gradient of an LM's loss (compiled, not run)."""
    loss, params, batch = _lm_step(seq_len, attention_kind)
    return jax.jit(jax.grad(loss)).lower(params, batch).compile().memory_analysis().temp_size_in_bytes


def test_blockwise_attention_memory_grows_with_the_sequence_not_its_square():
    dense = {s: _step_temp_bytes(s, "dense") for s in (512, 1024)}
    blockwise = {s: _step_temp_bytes(s, "blockwise") for s in (512, 1024)}
    assert dense[1024] / dense[512] > 3.0  # [B, H, S, S] kept per layer: quadratic
    assert blockwise[1024] / blockwise[512] < 2.2  # linear
    assert blockwise[1024] * 4 < dense[1024]


def test_remat_keeps_less_for_the_backward_pass():
    """What the backward pass keeps: the residuals of jax.vjp (XLA:CPU's memory analysis does not show remat: its
    pipeline undoes the recomputation; the GPU and TPU pipelines keep it)."""
    def kept(remat):
        loss, params, batch = _lm_step(256, "blockwise", remat)
        residuals = jax.eval_shape(lambda p, b: jax.vjp(lambda p: loss(p, b), p)[1], params, batch)
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(residuals))

    none, elementwise, full, qkv = kept("none"), kept("elementwise"), kept("full"), kept("save_qkv_proj")
    assert full < qkv < elementwise < none and full < 0.5 * none, (none, elementwise, qkv, full)


def test_the_config_refuses_unknown_attention_and_remat_and_keeps_them_to_the_lm():
    with pytest.raises(ValueError, match="attention='flash' is not one of auto, cudnn, splash, blockwise, dense"):
        TrainConfig(data="x", workdir="w", model="transformer_lm", attention="flash")
    with pytest.raises(ValueError, match="remat='all' is not one of auto, none, elementwise, full, minimal"):
        TrainConfig(data="x", workdir="w", model="transformer_lm", remat="all")
    with pytest.raises(ValueError) as e:
        TrainConfig(data="x", workdir="w", model="cnn", remat="full")
    assert str(e.value) == "remat=full is for model=transformer_lm; model='cnn' does not take it: drop remat="
    config = TrainConfig(data="x", workdir="w", model="transformer_lm", attention="dense", remat="minimal")
    assert config.model_size["attention"] == "dense" and config.model_size["remat"] == "minimal"


LLAMA_BLOCK = {"mlp_activations": "silu,linear", "normalization": "rmsnorm", "position_embedding": "rope"}


@pytest.mark.parametrize("remat, layout, expected", [("elementwise", {}, 11), ("elementwise", LLAMA_BLOCK, 15),
                                                     ("none", {}, 37), ("none", LLAMA_BLOCK, 37)],
                         ids=["gpt2", "llama", "gpt2-none", "llama-none"])
def test_a_block_keeps_its_matrix_multiplies_outputs_and_recomputes_the_rest(remat, layout, expected):
    """What each DecoderBlock keeps for the backward pass, in tensors of [B, S, width], with remat=elementwise (the
    model's default): its input and the MLP's input (1 + 1), q, k, v and the attention's output (4, the output
    counted twice: as the attention's and as `context`), the MLP's hidden layer (mlp_ratio = 4), a gated MLP's two
    (8); not the norms', the rotary embedding's or the activations' insides (they were 30 of flax's block). With
    remat=none it keeps those too: 37."""
    def kept(depth):
        model = TransformerLM(vocab_size=64, max_len=128, width=64, depth=depth, heads=4, attention="blockwise",
                              remat=remat, **layout)
        batch = {k: jax.ShapeDtypeStruct((2, 128), jnp.int32) for k in ("tokens", "segment_ids", "positions")}
        params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 128), jnp.int32)))
        residuals = jax.eval_shape(lambda p, b: jax.vjp(lambda p: model.apply(p, b).sum(), p)[1], params, batch)
        weights = jax.tree.leaves(params["params"]["TransformerBlock_0"])  # kept too: the backward pass uses them
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(residuals)), sum(x.size * 4 for x in weights)

    (two, weights), (three, _) = kept(2), kept(3)
    per_block = (three - two - weights) / (2 * 128 * 64 * 4)  # float32 [B, S, width] tensors
    assert expected <= per_block <= expected + 1, per_block  # + each row's log-sum-exp: heads / width of a tensor
