"""Causal self-attention over packed rows, without holding [batch, heads, seq, seq] scores.

`attend(q, k, v, segment_ids, kind)`: q [B, S, H, D], k and v [B, S, K, D] (flax's layout), segment_ids [B, S] ->
[B, S, H, D]. A token attends to the positions up to its own that share its segment id (packing gives each document of
a row its own id; padding, id 0, attends only to padding), so packed documents never see each other. K may divide H
(grouped-query attention): query head h reads key/value head h // (H / K), as in jax.nn.dot_product_attention,
Splash and MaxText. The implementations:

- `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN's fused flash attention (NVIDIA GPUs, bf16 or
  fp16, a head dim cuDNN takes). Causal by its mask type (it skips the blocks above the diagonal); the segments as a
  [B, 1, S, S] boolean mask, which JAX hands cuDNN as an additive bias shared by every head.
- `splash`: Splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`), TPU's fused flash attention, as
  MaxText runs it on TPU: the causal mask and the segment ids are the kernel's own (blocks wholly masked are
  skipped), one kernel a row (vmapped over the batch), the queries scaled by 1/sqrt(d) before it. Rows of a multiple
  of 128 positions.
- `blockwise`: flash attention in plain JAX, for the CPU and every case the fused kernels do not take. Queries and
  keys go in blocks of `block` positions; each query block folds in its key blocks up to the diagonal with an online
  softmax (running max and sum), so no more than [B, H, block, block] scores exist at a time. The forward pass keeps
  the output and each row's log-sum-exp; the backward pass recomputes each block's scores from them
  (FlashAttention-2's scheme, arXiv:2307.08691, section 3.1). Memory grows with S, not S².
- `dense`: flax's `dot_product_attention` with a [B, 1, S, S] mask: [B, H, S, S] scores and probabilities, kept for
  the backward pass in each layer; the anchor of benchmarks/lm_memory_bench.py.

`resolve("auto", ...)` picks cuDNN on a GPU and Splash on a TPU where a compile of it at the step's shapes succeeds
and its outputs and gradients on packed rows match blockwise attention's, else blockwise, and logs the choice once
per shape. `implementation="xla"` runs the fused kinds' stand-ins, which XLA computes on any backend (cuDNN's call
through jax.nn.dot_product_attention's XLA path, Splash's Pallas kernel interpreted): the tests check both on the
CPU.
"""

from __future__ import annotations

import functools
import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

log = logging.getLogger(__name__)

KINDS = ("auto", "cudnn", "splash", "blockwise", "dense")
FUSED = {"gpu": "cudnn", "tpu": "splash"}  # the fused kernel `auto` tries on each platform
BLOCK = 256  # positions per block: [B, H, 256, 256] float32 scores at a time
_MASKED = -1e30  # a finite "minus infinity": exp() of it is 0, and a row of it never gives inf - inf


def attend(q, k, v, segment_ids, kind: str = "blockwise", *, block: int = BLOCK, implementation: str = "native"):
    """Causal attention within segments by `kind` (cudnn, splash, blockwise or dense; resolve "auto" first).
    `implementation`: "native" runs the fused kinds' kernels, "xla" their stand-ins (see the module doc)."""
    if kind == "blockwise":
        return blockwise(q, k, v, segment_ids, block=block)
    if kind in FUSED.values():
        return _kernel(kind)(q, k, v, segment_ids, implementation=implementation)
    if kind == "dense":
        return nn.dot_product_attention(q, *_repeat_heads(k, v, q.shape[2]), mask=causal_segment_mask(segment_ids))
    raise ValueError(f"attention={kind!r} is not one of {', '.join(KINDS[1:])}")


def _repeat_heads(k, v, heads: int):
    """k and v [B, S, K, D] with each head repeated heads / K times: key/value head h // (heads / K) at head h."""
    if k.shape[2] == heads:
        return k, v
    if heads % k.shape[2]:
        raise ValueError(f"{k.shape[2]} key/value heads do not divide {heads} query heads")
    return tuple(jnp.repeat(x, heads // k.shape[2], axis=2) for x in (k, v))


def causal_segment_mask(segment_ids):
    """[B, 1, S, S] booleans: query i may attend to key j (j <= i, same segment)."""
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    n = segment_ids.shape[-1]
    return (same & (jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]))[:, None]


def fused(q, k, v, segment_ids, *, implementation: str = "native"):
    """jax.nn.dot_product_attention with the causal mask type and the segments as a mask (see the module doc)."""
    same = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=same, is_causal=True,
                                        implementation="cudnn" if implementation == "native" else implementation)


def splash(q, k, v, segment_ids, *, implementation: str = "native"):
    """Splash attention over [B, S, H, D] (see the module doc); S a multiple of 128."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    _, s, h, d = q.shape
    block = next((b for b in (512, 256, 128) if s % b == 0), None)
    if block is None:
        raise ValueError(f"Splash attention takes rows of a multiple of 128 positions, and these have {s}")
    sizes = sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                          block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    kernel = sa.make_splash_mha(sa.MultiHeadMask([sa.CausalMask((s, s))] * h), block_sizes=sizes, head_shards=1,
                                q_seq_shards=1, interpret=implementation == "xla")
    heads_first = (0, 2, 1, 3)  # the kernel's [H, S, D] a row
    q = (q * d ** -0.5).astype(q.dtype)  # the kernel does not scale its scores
    segments = sa.SegmentIds(q=segment_ids, kv=segment_ids)
    out = jax.vmap(kernel)(*(x.transpose(heads_first) for x in (q, k, v)), segment_ids=segments)
    return out.transpose(heads_first)


def _kernel(kind: str):
    """The function of a fused kind (looked up when called: the tests stand a faulty kernel in for one)."""
    return fused if kind == "cudnn" else splash


# --- blockwise (flash) attention ----------------------------------------------------------------------------------
def blockwise(q, k, v, segment_ids, *, block: int = BLOCK):
    """Flash attention in JAX (see the module doc); S need not be a multiple of `block` (the rows are padded with a
    segment of their own, then cut). Grouped keys and values stay grouped: each is read by its run of query heads,
    never copied to them."""
    b, s, h, d = q.shape
    kv = k.shape[2]
    if h % kv:
        raise ValueError(f"{kv} key/value heads do not divide {h} query heads")
    block = min(block, s)
    pad = -s % block
    if pad:
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        q, k, v = (jnp.pad(x, widths) for x in (q, k, v))
        segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)), constant_values=-1)  # attends only to itself
    # inside, [B, K, S, D] keys and values and [B, K, G, S, D] queries (G = H / K: the query heads of one key/value
    # head; [B, H, S, D] without groups, which XLA:CPU computes faster than G = 1): every product a batched matrix
    # multiply over B and K
    heads_first = (0, 2, 1, 3)
    grouped = q.transpose(heads_first) if kv == h else q.reshape(b, s + pad, kv, h // kv, d).transpose(0, 2, 3, 1, 4)
    out = _flash(grouped, k.transpose(heads_first), v.transpose(heads_first), segment_ids.astype(jnp.int32), block)
    out = out.transpose(heads_first) if kv == h else out.transpose(0, 3, 1, 2, 4).reshape(b, s + pad, h, d)
    return out[:, :s] if pad else out


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, segment_ids, block):
    return _forward(q, k, v, segment_ids, block)[0]


def _slice(x, i, block, axis=-2):
    """Block i of `block` positions along `axis` (default: a query's, key's or value's positions)."""
    return lax.dynamic_slice_in_dim(x, i * block, block, axis=axis % x.ndim)


def _update(x, part, i, block, axis=-2):
    return lax.dynamic_update_slice_in_dim(x, part, i * block, axis=axis % x.ndim)


def _masked_scores(q_blk, k_blk, seg_q, seg_k, i, j, block):
    """[B, K, (G,) bq, bk] float32 scaled scores of a query block i against a key block j, and where they count."""
    scores = jnp.einsum("bk...qd,bkjd->bk...qj", q_blk, k_blk, preferred_element_type=jnp.float32)
    scores = scores * (q_blk.shape[-1] ** -0.5)
    pos = jnp.arange(block)
    causal = (i * block + pos)[:, None] >= (j * block + pos)[None, :]
    mask = (seg_q[:, :, None] == seg_k[:, None, :]) & causal
    return scores, mask.reshape(mask.shape[:1] + (1,) * (scores.ndim - 3) + mask.shape[1:])


def _forward(q, k, v, segment_ids, block):
    *rows, s, d = q.shape  # B, K(, G)
    n = s // block

    def query_block(i, carry):
        out, lse = carry
        q_i, seg_i = _slice(q, i, block), _slice(segment_ids, i, block, axis=1)

        def key_block(j, acc):
            m, l, o = acc
            scores, mask = _masked_scores(q_i, _slice(k, j, block), seg_i, _slice(segment_ids, j, block, axis=1),
                                          i, j, block)
            m_new = jnp.maximum(m, jnp.where(mask, scores, _MASKED).max(-1))
            p = jnp.where(mask, jnp.exp(scores - m_new[..., None]), 0.0)
            rescale = jnp.exp(m - m_new)
            pv = jnp.einsum("bk...qj,bkjd->bk...qd", p.astype(v.dtype), _slice(v, j, block),
                            preferred_element_type=jnp.float32)
            return m_new, l * rescale + p.sum(-1), o * rescale[..., None] + pv

        shape = (*rows, block)
        init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
                jnp.zeros((*shape, d), jnp.float32))
        m, l, o = lax.fori_loop(0, i + 1, key_block, init)  # key blocks up to the diagonal: causal
        out = _update(out, (o / l[..., None]).astype(q.dtype), i, block)
        lse = _update(lse, m + jnp.log(l), i, block, axis=-1)
        return out, lse

    return lax.fori_loop(0, n, query_block, (jnp.zeros_like(q), jnp.zeros((*rows, s), jnp.float32)))


def _flash_fwd(q, k, v, segment_ids, block):
    out, lse = _forward(q, k, v, segment_ids, block)
    return out, (q, k, v, segment_ids, out, lse)


def _flash_bwd(block, residuals, d_out):
    q, k, v, segment_ids, out, lse = residuals
    n = q.shape[-2] // block
    scale = q.shape[-1] ** -0.5
    # D_i = rowsum(dO_i * O_i): the softmax's backward term, one per query row
    delta = jnp.einsum("...qd,...qd->...q", d_out.astype(jnp.float32), out.astype(jnp.float32))

    def key_block(j, grads):
        dq, dk, dv = grads
        k_j, v_j, seg_j = _slice(k, j, block), _slice(v, j, block), _slice(segment_ids, j, block, axis=1)

        def query_block(i, acc):
            dq, dk_j, dv_j = acc
            q_i, do_i = _slice(q, i, block), _slice(d_out, i, block)
            scores, mask = _masked_scores(q_i, k_j, _slice(segment_ids, i, block, axis=1), seg_j, i, j, block)
            p = jnp.where(mask, jnp.exp(scores - _slice(lse, i, block, axis=-1)[..., None]), 0.0)
            # a key/value head's gradients sum over its query heads (G) as over its queries
            dv_j = dv_j + jnp.einsum("bk...qj,bk...qd->bkjd", p.astype(d_out.dtype), do_i,
                                     preferred_element_type=jnp.float32)
            dp = jnp.einsum("bk...qd,bkjd->bk...qj", do_i, v_j, preferred_element_type=jnp.float32)
            ds = p * (dp - _slice(delta, i, block, axis=-1)[..., None]) * scale
            dq_i = jnp.einsum("bk...qj,bkjd->bk...qd", ds.astype(k.dtype), k_j, preferred_element_type=jnp.float32)
            dq = _update(dq, _slice(dq, i, block) + dq_i, i, block)
            dk_j = dk_j + jnp.einsum("bk...qj,bk...qd->bkjd", ds.astype(q.dtype), q_i,
                                     preferred_element_type=jnp.float32)
            return dq, dk_j, dv_j

        zeros = jnp.zeros(k_j.shape, jnp.float32)
        dq, dk_j, dv_j = lax.fori_loop(j, n, query_block, (dq, zeros, zeros))  # query blocks from the diagonal on
        return dq, _update(dk, dk_j, j, block), _update(dv, dv_j, j, block)

    zeros = [jnp.zeros(x.shape, jnp.float32) for x in (q, k, v)]
    dq, dk, dv = lax.fori_loop(0, n, key_block, tuple(zeros))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_flash.defvjp(_flash_fwd, _flash_bwd)


# --- choosing ---------------------------------------------------------------------------------------------------
_CHOSEN: dict = {}


_NAMES = {"cudnn": ("cuDNN", "NVIDIA GPUs"), "splash": ("Splash", "TPUs")}  # a fused kind's name, and where it runs


def resolve(kind: str, q_shape: tuple, dtype, platform: str | None = None, *, implementation: str = "native",
            kv_heads: int | None = None) -> str:
    """The implementation `kind` names; for "auto": the platform's fused kernel (cuDNN on a GPU, Splash on a TPU)
    when a compile of its forward and backward pass at these shapes succeeds (cuDNN: bf16/fp16, a head dim it
    takes; Splash: rows of a multiple of 128) and its outputs and gradients on two packed rows match blockwise
    attention's, else blockwise. The choice is logged once per shape. `implementation`: "xla" chooses with the fused
    kinds' stand-ins (the tests, on the CPU). `kv_heads`: the keys' and values' heads (None: the queries')."""
    platform = platform or jax.default_backend()
    if kind in _NAMES and FUSED.get(platform) != kind:
        raise ValueError(f"attention={kind} runs on {_NAMES[kind][1]}, and this backend is {platform}; use "
                         "attention=auto (the fused kernel where one runs, else blockwise) or attention=blockwise")
    if kind != "auto":
        return kind
    kv_heads = kv_heads or q_shape[2]
    key = (tuple(q_shape), kv_heads, jnp.dtype(dtype).name, platform, implementation)
    if key not in _CHOSEN:
        _CHOSEN[key], why = _auto(q_shape, kv_heads, jnp.dtype(dtype), platform, implementation)
        grouped = f" ({kv_heads} key/value heads)" if kv_heads != q_shape[2] else ""
        log.info("attention: %s for queries %s%s %s (%s)", _CHOSEN[key], "x".join(map(str, q_shape)), grouped,
                 jnp.dtype(dtype).name, why)
    return _CHOSEN[key]


def _auto(q_shape, kv_heads, dtype, platform, implementation) -> tuple[str, str]:
    kind = FUSED.get(platform)
    if kind is None:
        return "blockwise", (f"the fused kernels run on NVIDIA GPUs (cuDNN) and TPUs (Splash); this backend is "
                             f"{platform}")
    name = _NAMES[kind][0]
    if kind == "cudnn" and dtype not in (jnp.bfloat16, jnp.float16):
        return "blockwise", (f"cuDNN's fused attention takes bf16/fp16 and these queries are {dtype.name} "
                             "(dtype=bfloat16)")
    b, s, h, d = q_shape
    query, kv = jax.ShapeDtypeStruct(q_shape, dtype), jax.ShapeDtypeStruct((b, s, kv_heads, d), dtype)
    seg = jax.ShapeDtypeStruct((b, s), jnp.int32)

    def loss(q, k, v, segment_ids):
        return attend(q, k, v, segment_ids, kind, implementation=implementation).astype(jnp.float32).sum()

    try:
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(query, kv, kv, seg).compile()
    except Exception as e:  # noqa: BLE001 - any refusal (JAX's checks, the kernel's, XLA's) means: not here
        return "blockwise", f"{name} refused these shapes: {type(e).__name__}: {_first_line(e)}"
    try:
        error = _agreement(kind, min(s, CHECK_POSITIONS), h, d, dtype, implementation, kv_heads)
    except Exception as e:  # noqa: BLE001 - it compiled but did not run here: not here either
        return "blockwise", f"{name} compiled but its agreement check failed: {type(e).__name__}: {_first_line(e)}"
    if not error <= AGREEMENT:
        return "blockwise", (f"{name}'s outputs or gradients on packed rows differ from blockwise attention's by "
                             f"{error:.3f} (relative; at most {AGREEMENT} expected in {dtype.name}): this {name} does "
                             f"not apply the packed documents' mask as asked")
    note = unused_mask_gradient(jax.__version__) if kind == "cudnn" else None
    if note:
        log.warning("attention: %s", note)
    return kind, f"{name} fused attention compiled at these shapes; it matches blockwise attention ({error:.4f})"


def unused_mask_gradient(version: str) -> str | None:
    """What a jax older than 0.11.1 costs the cudnn kind (None from 0.11.1 on): its backward pass computes and
    writes a gradient of the documents' mask, [B, H, S, S], that nothing uses (jax-ml/jax#34685)."""
    release = tuple(int(part) for part in version.split(".")[:3] if part.isdigit())
    if release >= (0, 11, 1):
        return None
    return (f"jax {version}'s cuDNN attention also computes a [batch, heads, seq, seq] gradient of the packed "
            "documents' mask in every backward pass, which nothing uses (jax-ml/jax#34685, fixed in jax 0.11.1): "
            "upgrade jax for a faster step with less memory")


AGREEMENT = 0.05  # the relative error cuDNN may show against blockwise attention in float32 (bf16 gives ~0.004)
CHECK_POSITIONS = 2048  # the agreement check's rows are at most this long (its arrays: 2 x 2048 x heads x dim)


def _first_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else ""


@functools.lru_cache(maxsize=None)
def _agreement(kind: str, s: int, h: int, d: int, dtype, implementation: str,
               kv_heads: int | None = None) -> float:
    """The largest relative error (L2) of a fused kind's output and gradients, in `dtype`, against blockwise
    attention's in float32, on random inputs over check_segments(s); once per (positions, heads, head dim, dtype,
    key/value heads): the step's batch and the model's init batch differ, and the check need not run again."""
    return _relative_error(kind, s, h, d, dtype, implementation, kv_heads or h)


def check_segments(s: int) -> np.ndarray:
    """Two packed rows of `s` positions for the agreement check: documents of uneven lengths that cross block edges,
    the second row ending in padding (id 0)."""
    cuts = [(0, 1), (s * 3 // 10, 2), (s * 11 // 20, 3), (s * 4 // 5, 4)]
    rows = np.zeros((2, s), np.int32)
    for start, doc in cuts:
        rows[0, start:] = doc
    rows[1, : s * 2 // 3] = 1
    rows[1, s * 2 // 3: s - s // 8] = 2  # then padding
    return rows


def _relative_error(kind: str, s: int, h: int, d: int, dtype, implementation: str, kv_heads: int) -> float:
    """(see _agreement) resolve() runs as the model is traced: the check's programs are compiled ahead of time and
    run on NumPy inputs, so they run now instead of joining the model's trace (Splash's Pallas kernel cannot be
    traced under jax.ensure_compile_time_eval)."""
    rng = np.random.default_rng(0)
    q, weights = (rng.standard_normal((2, s, h, d), np.float32) for _ in range(2))
    k, v = (rng.standard_normal((2, s, kv_heads, d), np.float32) for _ in range(2))
    segments = check_segments(s)

    def outputs(fn, dt):
        def loss(q, k, v, segments):
            out = fn(q, k, v, segments)
            return jnp.sum(out.astype(jnp.float32) * weights), out
        args = (*(x.astype(dt) for x in (q, k, v)), segments)
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)).lower(*args).compile()
        (_, out), grads = step(*args)
        return [np.asarray(x, np.float32) for x in (out, *grads)]

    got = outputs(functools.partial(_kernel(kind), implementation=implementation), dtype)
    want = outputs(blockwise, jnp.float32)
    return max(float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30)) for g, w in zip(got, want))
