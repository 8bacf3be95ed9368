"""Models, each a few lines of config away: `model=mlp`, `model=cnn`, `model=resnet18` / `model=resnet50` (image
classification; the ResNets keep BatchNorm statistics, which the trainer carries and checkpoints),
`model=transformer` (sequence classification; an image is read as a sequence of rows) or `model=transformer_lm`
(a decoder-only causal language model, `task=lm`)."""

from __future__ import annotations

import inspect
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from trainer import attention, imports
from trainer.config import REMATS


class MLP(nn.Module):
    num_classes: int
    hidden: tuple[int, ...] = (256, 128)

    @nn.compact
    def __call__(self, x):
        x = x.reshape((x.shape[0], -1))
        for width in self.hidden:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.num_classes)(x)


class CNN(nn.Module):
    """Two 3x3 conv layers and a dense head (the Flax MNIST example's shape, sized for small images)."""

    num_classes: int
    features: tuple[int, ...] = (32, 64)

    @nn.compact
    def __call__(self, x):
        for f in self.features:
            x = nn.relu(nn.Conv(f, kernel_size=(3, 3))(x))
            if min(x.shape[1:3]) >= 4:
                x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(128)(x))
        return nn.Dense(self.num_classes)(x)


class TransformerBlock(nn.Module):
    heads: int
    dim: int
    mlp_ratio: int = 4  # the MLP's hidden width is mlp_ratio * dim

    @nn.compact
    def __call__(self, x, mask=None):
        y = nn.MultiHeadDotProductAttention(num_heads=self.heads, qkv_features=self.dim)(nn.LayerNorm()(x), mask=mask)
        x = x + y
        y = nn.Dense(self.dim)(nn.gelu(nn.Dense(self.mlp_ratio * self.dim)(nn.LayerNorm()(x))))
        return x + y


class SelfAttention(nn.Module):
    """flax's MultiHeadDotProductAttention's parameters (query, key, value: [dim, heads, head_dim]; out: [heads,
    head_dim, dim]; the same initialisers), in two steps: the projections, and the output after an attention. With
    `kv_heads` below `heads` the key and value have kv_heads heads, each shared by heads / kv_heads query heads
    (grouped-query attention; one: multi-query); `head_dim` is dim / heads unless given."""

    heads: int
    dim: int
    kv_heads: int | None = None
    head_dim: int | None = None

    def setup(self):
        head_dim = self.head_dim or self.dim // self.heads
        self.query = nn.DenseGeneral((self.heads, head_dim), axis=-1)
        self.key, self.value = (nn.DenseGeneral((self.kv_heads or self.heads, head_dim), axis=-1) for _ in range(2))
        self.out = nn.DenseGeneral(self.dim, axis=(-2, -1))

    def project(self, x):
        return self.query(x), self.key(x), self.value(x)

    def __call__(self, context):
        return self.out(context)


NORMS = {"layernorm": nn.LayerNorm, "rmsnorm": nn.RMSNorm}  # normalization= -> the norm (its parameters' name too)


class DecoderBlock(nn.Module):
    """A pre-norm decoder block: causal self-attention within segments (trainer/attention.py, by `attention`), then an
    MLP of mlp_dim (gated when `mlp_activations` names two), each added to its input.

    With `recompute` (remat=elementwise, and under every block-level remat policy) the backward pass recomputes the
    block's elementwise steps from their inputs instead of keeping what they compute: the norms (a float32 centred,
    squared and scaled copy of the input each), the rotary embedding and the MLP's activations (GELU's tanh form:
    four tensors of the MLP's width), and so also their outputs, which the next matrix multiply's weight gradient
    needs. A block then keeps 11 tensors of its width a token for the backward pass (tests/trainer/test_attention.py
    counts them), flax's block kept about 38 besides its attention's scores; the price is a few elementwise passes
    (the 104M model of docs/benchmarks.md on an H200: 41-42% MFU, against 44-45% keeping them at 1.8x the
    temporaries). The matrix multiplies' outputs are named for remat policies (`jax.ad_checkpoint.checkpoint_name`,
    MaxText's names): query_proj, key_proj, value_proj (after the rotary embedding, which is what the attention
    reads), context (the attention's output), out_proj, mlpwi (each of a gated MLP's two), mlpwo. With the defaults
    the parameters are those of flax's MultiHeadDotProductAttention block, under the same names; RMSNorms are
    RMSNorm_0 and RMSNorm_1, a gated MLP's second input layer Dense_2."""

    heads: int
    dim: int
    mlp_ratio: int = 4
    attention: str = "auto"  # trainer/attention.py's auto, cudnn, splash, blockwise or dense
    kv_heads: int | None = None  # key/value heads (None: heads)
    head_dim: int | None = None  # features a head (None: dim / heads)
    mlp_dim: int | None = None  # the MLP's hidden units (None: mlp_ratio * dim)
    mlp_activations: str = "gelu"  # one activation, or two (comma-separated) whose outputs multiply: a gated MLP
    normalization: str = "layernorm"  # or rmsnorm
    normalization_layer_epsilon: float = 1e-6
    rope_max_timescale: float | None = None  # rotary embeddings of the queries and keys at this timescale; None: none
    recompute: bool = True  # the backward pass recomputes the norms, the rotary embedding and the activations

    def setup(self):
        # attribute names = the parameter tree's names (what compact auto-naming gave flax's block)
        eps = self.normalization_layer_epsilon
        if self.normalization == "rmsnorm":
            self.RMSNorm_0, self.RMSNorm_1 = nn.RMSNorm(epsilon=eps), nn.RMSNorm(epsilon=eps)
        else:
            self.LayerNorm_0, self.LayerNorm_1 = nn.LayerNorm(epsilon=eps), nn.LayerNorm(epsilon=eps)
        self.MultiHeadDotProductAttention_0 = SelfAttention(self.heads, self.dim, self.kv_heads, self.head_dim)
        hidden = self.mlp_dim or self.mlp_ratio * self.dim
        self.Dense_0 = nn.Dense(self.dim)  # the MLP's second layer
        self.Dense_1 = nn.Dense(hidden)  # its first
        if len(self.mlp_activations.split(",")) == 2:
            self.Dense_2 = nn.Dense(hidden)  # a gated MLP's second first layer

    def norm(self, i: int, x):
        return getattr(self, f"{NORMS[self.normalization].__name__}_{i}")(x)

    def __call__(self, x, segment_ids, positions):
        attention_names = ("query_proj", "key_proj", "value_proj")
        projections, mlp = _normed_projections, _normed_mlp
        if self.recompute:  # keep the matrix multiplies' outputs only
            projections = nn.remat(projections, policy=jax.checkpoint_policies.save_only_these_names(*attention_names))
            mlp = nn.remat(mlp, policy=jax.checkpoint_policies.save_only_these_names("mlpwi"))
        q, k, v = projections(self, x, positions)
        q, k, v = (checkpoint_name(a, n) for a, n in zip((q, k, v), attention_names))  # seen by an outer remat too
        kind = attention.resolve(self.attention, q.shape, q.dtype, kv_heads=k.shape[2])
        context = checkpoint_name(attention.attend(q, k, v, segment_ids, kind), "context")
        x = x + checkpoint_name(self.MultiHeadDotProductAttention_0(context), "out_proj")
        return x + checkpoint_name(mlp(self, x), "mlpwo")


def _normed_projections(block: DecoderBlock, x, positions):
    q, k, v = block.MultiHeadDotProductAttention_0.project(block.norm(0, x))
    if block.rope_max_timescale is not None:
        q, k = (rotary_embedding(a, positions, block.rope_max_timescale) for a in (q, k))
    return q, k, v


ACTIVATIONS = {"gelu": nn.gelu, "silu": nn.silu, "swish": nn.silu, "relu": nn.relu, "linear": lambda x: x}


def _normed_mlp(block: DecoderBlock, x):
    x = block.norm(1, x)
    first, *gate = block.mlp_activations.split(",")
    h = ACTIVATIONS[first](checkpoint_name(block.Dense_1(x), "mlpwi"))
    if gate:  # MaxText's mlp_activations=[silu, linear]: SwiGLU (arXiv:2002.05202)
        h = h * ACTIVATIONS[gate[0]](checkpoint_name(block.Dense_2(x), "mlpwi"))
    return block.Dense_0(h)


def rotary_embedding(x, positions, max_timescale: float):
    """x [B, S, H, D] with each position's features rotated by angles proportional to the position (RoFormer,
    arXiv:2104.09864): feature i of the first half pairs with feature i of the second (MaxText's and Llama's layout)
    and turns by position / max_timescale^(2i / D). A query's product with a key then depends on their positions'
    difference only, so a document packed mid-row (its positions restarting at 0) is computed as it is alone."""
    d = x.shape[-1]
    timescale = max_timescale ** (2 * jnp.arange(d // 2, dtype=jnp.float32) / d)
    angles = positions.astype(jnp.float32)[..., None, None] / timescale  # [B, S, 1, D / 2]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(x.dtype)


def remat_policy(name: str):
    """MaxText's `remat_policy` names -> what jax.checkpoint keeps of a block for the backward pass (the rest is
    recomputed there). "none" (everything kept) and "elementwise" (DecoderBlock's recompute) have no block-level
    policy: None."""
    names = {"save_qkv_proj": ("query_proj", "key_proj", "value_proj"),
             "save_out_proj": ("out_proj",),
             "save_dot_except_mlp": ("query_proj", "key_proj", "value_proj", "out_proj"),
             "save_dot_except_mlpwi": ("query_proj", "key_proj", "value_proj", "out_proj", "mlpwo"),
             "save_dot_with_context_except_mlp": ("query_proj", "key_proj", "value_proj", "context", "out_proj")}
    policies = jax.checkpoint_policies
    if name in ("none", "elementwise"):
        return None
    if name == "full":
        return policies.nothing_saveable
    if name == "minimal":
        return policies.checkpoint_dots_with_no_batch_dims
    if name == "minimal_with_context":
        return policies.save_from_both_policies(policies.checkpoint_dots_with_no_batch_dims,
                                                policies.save_only_these_names("context"))
    if name in names:
        return policies.save_only_these_names(*names[name])
    raise ValueError(f"remat={name!r} is not one of {', '.join(REMATS)}")


class Transformer(nn.Module):
    """A small pre-norm Transformer encoder for sequence classification.

    Input [batch, length, features] (an image [B, H, W, C] is read as H tokens of W*C features, the classic
    "image rows as a sequence" task); learned position embeddings; mean-pooled tokens -> classes.
    """

    num_classes: int
    dim: int = 64
    depth: int = 2
    heads: int = 4

    @nn.compact
    def __call__(self, x):
        if x.ndim == 4:
            x = x.reshape((x.shape[0], x.shape[1], -1))
        x = nn.Dense(self.dim)(x)
        x = x + self.param("position", nn.initializers.normal(0.02), (1, x.shape[1], self.dim))
        for _ in range(self.depth):
            x = TransformerBlock(self.heads, self.dim)(x)
        return nn.Dense(self.num_classes)(nn.LayerNorm()(x).mean(axis=1))


class TransformerLM(nn.Module):
    """A decoder-only causal Transformer: tokens [B, L] -> next-token logits [B, L, vocab_size].

    Takes the LM task's inputs, {"tokens", "segment_ids", "positions"} (or bare tokens): a position attends to
    earlier positions of its own segment only, so examples packed into one row never see each other, and
    positions restart at each segment.

    Sized by the config keys of the same names (validated in trainer/config.py): `depth` pre-norm blocks of
    `heads`-head attention over `width` features and an MLP of `mlp_ratio * width` (or `mlp_dim`) hidden units; an
    output layer of its own (unless `logits_via_embedding`). The defaults are GPT-2's layout: learned position
    embeddings for `max_len` positions, LayerNorms, a GELU MLP, every head with its own keys and values. Llama's is
    `position_embedding="rope"` (rotary embeddings of the queries and keys, no position table),
    `normalization="rmsnorm"`, `mlp_activations="silu,linear"` (SwiGLU) and `num_kv_heads` below `heads`
    (grouped-query attention); `head_dim` sets the features a head apart from width / heads; `logits_via_embedding`
    ties the output layer to the token embedding (its table transposed, no bias; divided by sqrt(width) unless
    `normalize_embedding_logits=False`); `logits_dot_in_fp32` computes the logits' dot product in float32 whatever
    the compute dtype. MaxText's names, all.

    `attention=` picks the attention's implementation (trainer/attention.py: auto, cudnn, splash, blockwise, dense),
    `remat=` what the backward pass recomputes of each block instead of keeping it: none, elementwise (the norms and
    activations: DecoderBlock's recompute), or a block-level policy by MaxText's names (`remat_policy`; the block
    recomputes its norms and activations under each); auto is the trainer's choice by memory (trainer/remat.py), and
    elementwise for a model built outside it. `use_iota_embed=` whether the embeddings are looked up or one-hot
    matrix multiplies (auto: `embed_by_matmul`). None of these three changes the parameters, which with the default
    layout have the names and initial values of the blocks of flax's MultiHeadDotProductAttention this model had
    before.
    """

    vocab_size: int
    max_len: int
    width: int = 128
    depth: int = 2
    heads: int = 4
    mlp_ratio: int = 4
    attention: str = "auto"
    remat: str = "elementwise"
    use_iota_embed: bool | str = "auto"
    num_kv_heads: int | None = None
    head_dim: int | None = None
    mlp_dim: int | None = None
    mlp_activations: str = "gelu"
    normalization: str = "layernorm"
    normalization_layer_epsilon: float = 1e-6
    position_embedding: str = "learned"
    rope_max_timescale: float = 10_000.0
    logits_via_embedding: bool = False
    normalize_embedding_logits: bool = True
    logits_dot_in_fp32: bool = False

    @nn.compact
    def __call__(self, inputs):
        if isinstance(inputs, dict):
            tokens, segments, positions = inputs["tokens"], inputs["segment_ids"], inputs["positions"]
        else:
            tokens = inputs
            segments = jnp.ones_like(tokens)
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)
        token_table = nn.Embed(self.vocab_size, self.width)
        tables = [(token_table, tokens)]
        rope = self.position_embedding == "rope"
        if not rope:
            tables.append((nn.Embed(self.max_len, self.width), positions))
        x = sum(_one_hot_rows(table, ids) if self._by_matmul(table) else table(ids) for table, ids in tables)
        remat = "elementwise" if self.remat == "auto" else self.remat
        block, policy = DecoderBlock, remat_policy(remat)
        if policy is not None:
            block = nn.remat(DecoderBlock, policy=policy)
        for i in range(self.depth):  # named as flax named them, so checkpoints of earlier versions still restore
            x = block(self.heads, self.width, self.mlp_ratio, self.attention, self.num_kv_heads, self.head_dim,
                      self.mlp_dim, self.mlp_activations, self.normalization, self.normalization_layer_epsilon,
                      self.rope_max_timescale if rope else None, remat != "none",
                      name=f"TransformerBlock_{i}")(x, segments, positions)
        x = NORMS[self.normalization](epsilon=self.normalization_layer_epsilon)(x)
        wide = jnp.float32 if self.logits_dot_in_fp32 else None  # the logits' dot product in float32 (MaxText's)
        if not self.logits_via_embedding:
            return nn.Dense(self.vocab_size, dtype=wide)(x)
        if wide is None:
            logits = token_table.attend(x)  # x @ the table's transpose: tied embeddings
        else:
            logits = jnp.dot(x.astype(wide), token_table.embedding.astype(wide).T)
        return logits / jnp.sqrt(x.shape[-1]).astype(logits.dtype) if self.normalize_embedding_logits else logits

    def flops_per_token(self) -> int:
        """Training FLOPs per token (forward and backward) at max_len: 6 per weight of each matrix multiply (the
        projections, the MLP, the output layer; not the embedding lookups, norms or biases) plus 12 * depth *
        max_len * heads * head_dim for the attention's two S x S products (PaLM's count, arXiv:2204.02311 appendix
        B; causal kernels skip about half of that work, which the count does not credit)."""
        w = self.width
        head_dim = self.head_dim or w // self.heads
        queries, keys = self.heads * head_dim, (self.num_kv_heads or self.heads) * head_dim
        hidden = self.mlp_dim or self.mlp_ratio * w
        gates = len(self.mlp_activations.split(","))
        block = 2 * w * queries + 2 * w * keys + (gates + 1) * w * hidden  # q and out; k and v; the MLP
        return 6 * (self.depth * block + w * self.vocab_size) + 12 * self.depth * self.max_len * queries

    def _by_matmul(self, table: nn.Embed) -> bool:
        if self.use_iota_embed == "auto":
            return embed_by_matmul(table.num_embeddings)
        return bool(self.use_iota_embed)


ONE_HOT_ROWS = 4096  # use_iota_embed=auto: the largest table looked up by a one-hot matrix multiply on a GPU or TPU


def embed_by_matmul(rows: int, platform: str | None = None) -> bool:
    """use_iota_embed=auto: whether a table of `rows` is read by a one-hot matrix multiply on this platform. Where the
    two differ is the backward pass: a lookup's gradient scatter-adds every token's row into the table, which a GPU
    does with atomic adds that collide the more the fewer rows there are; the one-hot matrix multiply costs
    4 * rows * width FLOPs a token forward and backward instead, which grows with the rows. On an NVIDIA H200 (the
    104M model of docs/benchmarks.md: 65,536 tokens a step, tables of 1,024 rows) the two scatter-adds took 8.7% of
    the step, and the matrix multiplies took MFU from 41.7% to 43.9%; the crossing from that profile is ~11,000 rows,
    so 4,096 leaves a margin. TPUs gather and scatter slowly too (MaxText and flaxformer multiply there). A CPU's
    scatter-add is cheap: lookups."""
    return (platform or jax.default_backend()) in ("gpu", "tpu") and rows <= ONE_HOT_ROWS


def _one_hot_rows(embed: nn.Embed, ids):
    """embed(ids) as a one-hot matrix multiply (MaxText's use_iota_embed): the same rows, exactly (one 1 in each
    one-hot row), and a gradient that is a matrix multiply too, where a lookup's is a scatter-add of every id's
    gradient into the table (many ids per row when the table is small: a vocabulary of 1,024 and 65,536 tokens)."""
    return jax.nn.one_hot(ids, embed.num_embeddings, dtype=embed.embedding.dtype) @ embed.embedding


class ResNetBlock(nn.Module):
    """Two 3x3 convolutions (ResNet-18/34)."""

    filters: int
    strides: int = 1

    @nn.compact
    def __call__(self, x, norm):
        residual = x
        y = nn.relu(norm()(nn.Conv(self.filters, (3, 3), self.strides, use_bias=False)(x)))
        y = norm(scale_init=nn.initializers.zeros)(nn.Conv(self.filters, (3, 3), use_bias=False)(y))
        if residual.shape != y.shape:
            residual = norm()(nn.Conv(self.filters, (1, 1), self.strides, use_bias=False)(residual))
        return nn.relu(residual + y)


class BottleneckBlock(nn.Module):
    """1x1, 3x3 (strided: ResNet v1.5), 1x1 x4 convolutions (ResNet-50/101/152)."""

    filters: int
    strides: int = 1

    @nn.compact
    def __call__(self, x, norm):
        residual = x
        y = nn.relu(norm()(nn.Conv(self.filters, (1, 1), use_bias=False)(x)))
        y = nn.relu(norm()(nn.Conv(self.filters, (3, 3), self.strides, use_bias=False)(y)))
        y = norm(scale_init=nn.initializers.zeros)(nn.Conv(self.filters * 4, (1, 1), use_bias=False)(y))
        if residual.shape != y.shape:
            residual = norm()(nn.Conv(self.filters * 4, (1, 1), self.strides, use_bias=False)(residual))
        return nn.relu(residual + y)


class ResNet(nn.Module):
    """ResNet v1.5 as in the Flax ImageNet example and big_vision: a 7x7/2 stem and 3x3/2 max-pool, four stages
    (64, 128, 256, 512 filters, stride 2 from the second), global average pooling, a dense head. BatchNorm keeps
    its statistics in the "batch_stats" collection: the trainer updates them over each global batch (under every
    synchronous strategy the step is one program over all devices, so the statistics are the global batch's),
    checkpoints them with the parameters and evaluates with them (`train=False`). The last BatchNorm of each
    residual branch starts at zero scale, so each block starts as the identity."""

    num_classes: int
    stage_sizes: tuple[int, ...] = (2, 2, 2, 2)
    block: type[nn.Module] = ResNetBlock
    num_filters: int = 64

    @nn.compact
    def __call__(self, x, train: bool = True):
        def norm(**kwargs):
            return nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5, **kwargs)

        x = nn.Conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False, name="stem")(x)
        x = nn.relu(norm(name="stem_norm")(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for stage, blocks in enumerate(self.stage_sizes):
            for b in range(blocks):
                strides = 2 if stage > 0 and b == 0 else 1
                x = self.block(self.num_filters * 2 ** stage, strides)(x, norm)
        x = x.mean(axis=(1, 2))
        return nn.Dense(self.num_classes, name="head")(x)


def resnet18(num_classes: int) -> ResNet:
    return ResNet(num_classes, (2, 2, 2, 2), ResNetBlock)


def resnet50(num_classes: int) -> ResNet:
    return ResNet(num_classes, (3, 4, 6, 3), BottleneckBlock)


MODELS = {"mlp": MLP, "cnn": CNN, "transformer": Transformer, "transformer_lm": TransformerLM,
          "resnet18": resnet18, "resnet50": resnet50}


def make(spec: str, kwargs: dict[str, Any]) -> nn.Module:
    """The model `spec` names (a built-in, or `package.module:attr`: a flax.linen.Module class, or a function
    returning a Module instance), built with the task's keyword arguments (classification: num_classes)."""
    factory = imports.resolve(spec, MODELS, "model")
    if isinstance(factory, nn.Module):
        raise ValueError(f"model={spec!r} is a Module instance; name its class, or a function returning one")
    if not callable(factory):
        raise ValueError(f"model={spec!r} is a {type(factory).__name__}, not a flax.linen.Module class or a function")
    try:
        model = factory(**kwargs)
    except TypeError as e:
        fitting = [name for name, built_in in MODELS.items() if _takes(built_in, kwargs)]
        hint = f"; the built-in models that take them: {', '.join(fitting)} (model={fitting[0]})" if fitting else ""
        raise ValueError(f"model={spec!r} does not take the task's arguments {sorted(kwargs)} ({e}){hint}") from e
    if not isinstance(model, nn.Module):
        raise ValueError(f"model={spec!r} returned a {type(model).__name__}, not a flax.linen.Module")
    return model


def _takes(factory, kwargs: dict) -> bool:
    """Whether `factory` can be called with exactly these keyword arguments (its other parameters have defaults)."""
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError:
        return False
    return True


def images_to_float(images):
    """uint8/int pixels -> float32 in [0, 1] (float features are taken as they are, only cast), shaped NHWC (a flat
    square image becomes s x s x 1)."""
    x = jnp.asarray(images)
    x = x.astype(jnp.float32) / 255.0 if jnp.issubdtype(x.dtype, jnp.integer) else x.astype(jnp.float32)
    if x.ndim == 2:
        side = int(round(x.shape[1] ** 0.5))
        x = x.reshape((x.shape[0], side, side, 1)) if side * side == x.shape[1] else x
    elif x.ndim == 3:
        x = x[..., None]
    return x
