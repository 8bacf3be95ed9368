"""The LM training step's device memory, dense attention (the anchor) against blockwise, from XLA's own account.

The trainer's own step (trainer/train.py's make_train_step: forward, backward, Adam update) for model=transformer_lm
packed rows, lowered and compiled for each attention at each seq_len, never run: `compiled.memory_analysis()` gives
the temporaries (what the step allocates besides its arguments and outputs). "dense" is flax's
MultiHeadDotProductAttention with a [B, 1, S, S] mask, which materialises [B, H, S, S] scores and probabilities per
layer; "blockwise" is trainer/attention.py's flash attention. Also, per remat policy: the bytes jax.vjp keeps for the
backward pass (XLA:CPU's memory analysis does not show remat, its pipeline undoes the recomputation).

    python benchmarks/lm_memory_bench.py                       # width 1024, depth 8, heads 16, batch 64, bf16
    python benchmarks/lm_memory_bench.py --seq-lens 1024 --batch-size 8
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build(seq_len: int, attention: str, args, remat: str = "none"):
    """(jitted train step, abstract state, abstract batch, program) for the configuration, shapes only."""
    import jax
    import jax.numpy as jnp

    from trainer import models, strategy as strategies
    from trainer.config import TrainConfig
    from trainer.program import Program
    from trainer.tasks import LanguageModel
    from trainer.train import make_train_step

    config = TrainConfig(data="synthetic", workdir="unused", task="lm", model="transformer_lm", packing=True,
                         seq_len=seq_len, width=args.width, depth=args.depth, heads=args.heads,
                         batch_size=args.batch_size, dtype=args.dtype, attention=attention, remat=remat)
    task = LanguageModel("tokens", seq_len, args.vocab_size, byte_level=False, pretokenized=True)
    model = models.make(config.model, {**task.model_kwargs(), **config.model_size})
    sample = {k: jnp.zeros((1, seq_len), jnp.int32) for k in ("tokens", "targets", "segment_ids", "positions")}
    program = Program(config, task, model, sample, None)
    strategy = strategies.make("default")
    tx = program.optimizer()

    def init():
        params = program.init_params()
        return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}

    state = jax.eval_shape(init)
    sharding = strategy.param_sharding(state)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, sharding)
    batch = {k: jax.ShapeDtypeStruct((args.batch_size, seq_len), jnp.int32, sharding=strategy.batch_sharding)
             for k in sample}
    step = jax.jit(make_train_step(program, tx, strategy), donate_argnums=(0,))
    return step, state, batch, program


def temporaries(seq_len: int, attention: str, args) -> dict:
    step, state, batch, _ = build(seq_len, attention, args)
    t = time.perf_counter()
    memory = step.lower(state, batch).compile().memory_analysis()
    return {"temp": memory.temp_size_in_bytes, "arguments": memory.argument_size_in_bytes,
            "compile_s": time.perf_counter() - t}


def kept_for_backward(seq_len: int, remat: str, args) -> int:
    """Bytes of the residuals jax.vjp keeps from the forward pass for the backward pass (shapes only)."""
    import jax

    _, state, batch, program = build(seq_len, "blockwise", args, remat)
    params = state["params"]
    residuals = jax.eval_shape(lambda p, b: jax.vjp(lambda p: program.loss_sums(p, b)[0], p)[1], params, batch)
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(residuals))


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--remat", nargs="*", default=["none", "save_dot_except_mlp", "save_qkv_proj", "minimal", "full"],
                   help="remat policies whose kept-for-backward bytes to report, at the first seq_len")
    args = p.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({platform.machine()}, {os.cpu_count()} cores); "
          f"width {args.width} depth {args.depth} heads {args.heads} batch {args.batch_size} vocab {args.vocab_size} "
          f"{args.dtype}, Adam", flush=True)
    rows = {}
    print("| seq_len | attention | temporaries GiB | arguments GiB | compile s |\n| ---: | --- | ---: | ---: | ---: |")
    for seq_len in args.seq_lens:
        for attention in ("dense", "blockwise"):
            rows[seq_len, attention] = r = temporaries(seq_len, attention, args)
            print(f"| {seq_len} | {attention} | {gib(r['temp'])} | {gib(r['arguments'])} | {r['compile_s']:.0f} |",
                  flush=True)
    print()
    for seq_len in args.seq_lens:
        print(f"seq_len {seq_len}: dense / blockwise temporaries {rows[seq_len, 'dense']['temp'] / rows[seq_len, 'blockwise']['temp']:.1f}x")
    first, *others = args.seq_lens
    for seq_len in others:
        for attention in ("dense", "blockwise"):
            growth = rows[seq_len, attention]["temp"] / rows[first, attention]["temp"]
            print(f"{attention}: temporaries at seq_len {seq_len} / at {first}: {growth:.1f}x (sequence "
                  f"{seq_len / first:.0f}x)")
    if args.remat:
        print(f"\nkept for the backward pass (jax.vjp's residuals), blockwise, seq_len {first}:")
        base = kept_for_backward(first, "none", args)
        print(f"  remat=none: {gib(base)} GiB", flush=True)
        for remat in (r for r in args.remat if r != "none"):
            kept = kept_for_backward(first, remat, args)
            print(f"  remat={remat}: {gib(kept)} GiB ({kept / base:.2f}x of none)", flush=True)


if __name__ == "__main__":
    main()
