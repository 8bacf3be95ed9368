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
    """flax's MultiHeadDotProductAttention's parameters (query, key, value: [dim, heads, dim / heads]; out: [heads,
    dim / heads, dim]; the same initialisers), in two steps: the projections, and the output after an attention."""

    heads: int
    dim: int

    def setup(self):
        head = (self.heads, self.dim // self.heads)
        self.query, self.key, self.value = (nn.DenseGeneral(head, axis=-1) for _ in range(3))
        self.out = nn.DenseGeneral(self.dim, axis=(-2, -1))

    def project(self, x):
        return self.query(x), self.key(x), self.value(x)

    def __call__(self, context):
        return self.out(context)


class DecoderBlock(nn.Module):
    """A pre-norm decoder block: causal self-attention within segments (trainer/attention.py, by `attention`), then a
    GELU MLP of mlp_ratio * dim, each added to its input.

    The backward pass recomputes the block's elementwise steps from their inputs instead of keeping what they
    compute: the LayerNorms (a float32 centred, squared and scaled copy of the input each) and GELU (its tanh form:
    four tensors of the MLP's width), and so also their outputs, which the next matrix multiply's weight gradient
    needs. That costs a few elementwise passes, nothing next to the block's matrix multiplies: a block keeps 11
    tensors of its width a token for the backward pass (tests/trainer/test_attention.py counts them), flax's block
    kept about 38 besides its attention's scores. The matrix multiplies' outputs are named for
    remat policies (`jax.ad_checkpoint.checkpoint_name`, MaxText's names): query_proj, key_proj, value_proj, context
    (the attention's output), out_proj, mlpwi, mlpwo. The parameters are those of flax's MultiHeadDotProductAttention
    block, under the same names."""

    heads: int
    dim: int
    mlp_ratio: int = 4
    attention: str = "auto"  # trainer/attention.py's auto, cudnn, splash, blockwise or dense

    def setup(self):
        # attribute names = the parameter tree's names (what compact auto-naming gave flax's block)
        self.LayerNorm_0, self.LayerNorm_1 = nn.LayerNorm(), nn.LayerNorm()
        self.MultiHeadDotProductAttention_0 = SelfAttention(self.heads, self.dim)
        self.Dense_0 = nn.Dense(self.dim)  # the MLP's second layer
        self.Dense_1 = nn.Dense(self.mlp_ratio * self.dim)  # its first

    def __call__(self, x, segment_ids):
        attention_names = ("query_proj", "key_proj", "value_proj")
        q, k, v = nn.remat(_normed_projections, policy=jax.checkpoint_policies.save_only_these_names(
            *attention_names))(self, x)
        q, k, v = (checkpoint_name(a, n) for a, n in zip((q, k, v), attention_names))  # seen by an outer remat too
        kind = attention.resolve(self.attention, q.shape, q.dtype)
        context = checkpoint_name(attention.attend(q, k, v, segment_ids, kind), "context")
        x = x + checkpoint_name(self.MultiHeadDotProductAttention_0(context), "out_proj")
        mlp = nn.remat(_normed_mlp, policy=jax.checkpoint_policies.save_only_these_names("mlpwi"))
        return x + checkpoint_name(mlp(self, x), "mlpwo")


def _normed_projections(block: DecoderBlock, x):
    return block.MultiHeadDotProductAttention_0.project(block.LayerNorm_0(x))


def _normed_mlp(block: DecoderBlock, x):
    h = checkpoint_name(block.Dense_1(block.LayerNorm_1(x)), "mlpwi")
    return block.Dense_0(nn.gelu(h))


def remat_policy(name: str):
    """MaxText's `remat_policy` names -> what jax.checkpoint keeps of a block for the backward pass (the rest is
    recomputed there). "none" is no remat at all (everything kept)."""
    names = {"save_qkv_proj": ("query_proj", "key_proj", "value_proj"),
             "save_out_proj": ("out_proj",),
             "save_dot_except_mlp": ("query_proj", "key_proj", "value_proj", "out_proj"),
             "save_dot_except_mlpwi": ("query_proj", "key_proj", "value_proj", "out_proj", "mlpwo"),
             "save_dot_with_context_except_mlp": ("query_proj", "key_proj", "value_proj", "context", "out_proj")}
    policies = jax.checkpoint_policies
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

    Sized by the config keys of the same names (`width= depth= heads= mlp_ratio=`, validated in trainer/config.py):
    `depth` pre-norm blocks of `heads`-head attention over `width` features and a GELU MLP of
    `mlp_ratio * width`; learned position embeddings for `max_len` positions; an output layer of its own (not
    tied to the token embedding). `attention=` picks the attention's implementation (trainer/attention.py: auto,
    cudnn, splash, blockwise, dense), `remat=` what the backward pass recomputes of each block instead of keeping it
    (`remat_policy`, MaxText's names; each block recomputes its LayerNorms and GELU whatever the policy:
    DecoderBlock), `use_iota_embed=` whether the embeddings are looked up or one-hot matrix multiplies. None of them
    changes the parameters, which have the names and initial values of the blocks of flax's
    MultiHeadDotProductAttention this model had before.
    """

    vocab_size: int
    max_len: int
    width: int = 128
    depth: int = 2
    heads: int = 4
    mlp_ratio: int = 4
    attention: str = "auto"
    remat: str = "none"
    use_iota_embed: bool = False

    @nn.compact
    def __call__(self, inputs):
        if isinstance(inputs, dict):
            tokens, segments, positions = inputs["tokens"], inputs["segment_ids"], inputs["positions"]
        else:
            tokens = inputs
            segments = jnp.ones_like(tokens)
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)
        embed_tokens, embed_positions = nn.Embed(self.vocab_size, self.width), nn.Embed(self.max_len, self.width)
        if self.use_iota_embed:
            x = _one_hot_rows(embed_tokens, tokens) + _one_hot_rows(embed_positions, positions)
        else:
            x = embed_tokens(tokens) + embed_positions(positions)
        block = DecoderBlock
        if self.remat != "none":
            block = nn.remat(DecoderBlock, policy=remat_policy(self.remat))
        for i in range(self.depth):  # named as flax named them, so checkpoints of earlier versions still restore
            x = block(self.heads, self.width, self.mlp_ratio, self.attention, name=f"TransformerBlock_{i}")(
                x, segments)
        return nn.Dense(self.vocab_size)(nn.LayerNorm()(x))

    def flops_per_token(self) -> int:
        """Training FLOPs per token (forward and backward) at max_len: 6 per weight of each matrix multiply (the
        projections, the MLP, the output layer; not the embedding lookups, norms or biases) plus 12 * depth *
        max_len * width for the attention's two S x S products (PaLM's count, arXiv:2204.02311 appendix B; causal
        kernels skip about half of that work, which the count does not credit)."""
        w = self.width
        matmul = self.depth * (4 + 2 * self.mlp_ratio) * w * w + w * self.vocab_size
        return 6 * matmul + 12 * self.depth * self.max_len * w


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
    """uint8/int pixels -> float32 in [0, 1], shaped NHWC (a flat square image becomes s x s x 1)."""
    x = jnp.asarray(images, jnp.float32) / 255.0
    if x.ndim == 2:
        side = int(round(x.shape[1] ** 0.5))
        x = x.reshape((x.shape[0], side, side, 1)) if side * side == x.shape[1] else x
    elif x.ndim == 3:
        x = x[..., None]
    return x
