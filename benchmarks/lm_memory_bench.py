"""The LM training step's device memory, from XLA's own account: the LM of another revision (the anchor) against ours.

Each configuration's training step (forward, backward, Adam update: what trainer/train.py's step computes) is lowered
and compiled in a process of its own, never run; `compiled.memory_analysis()` gives its temporaries (what the step
allocates besides its arguments and outputs). The anchor is the project as it was at `--previous` (a git worktree of
it; default: the revision whose LM used flax's MultiHeadDotProductAttention with a [B, 1, S, S] mask, materialising
[B, H, S, S] scores and probabilities per layer); ours is this checkout's, with each `--attentions` kind. With
`--remat`, per remat policy: ours' temporaries and the bytes jax.vjp keeps from the forward pass for the backward
(shapes only).

On the CPU the step is compiled with XLA:CPU's memory-minimising scheduler
(`--xla_cpu_enable_concurrency_optimized_scheduler=false`), as GPU and TPU compilers schedule with memory in view:
XLA:CPU's default orders work for parallelism and moves recomputation forward, which undoes remat and what the
model recomputes in its backward pass. `--cpu-scheduler default` measures with XLA:CPU's default instead.

    python benchmarks/lm_memory_bench.py                       # width 1024, depth 8, heads 16, batch 64, bf16
    python benchmarks/lm_memory_bench.py --seq-lens 1024 --batch-size 8 --remat
    python benchmarks/lm_memory_bench.py --num-kv-heads 4 --previous repeated-kv --attentions blockwise
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import revision  # benchmarks/revision.py

_CHILD = r"""
import dataclasses, json, sys, time
import jax, jax.numpy as jnp, optax
from trainer import models
from trainer.config import TrainConfig
from trainer.program import Program
from trainer.tasks import LanguageModel

spec = json.loads(sys.argv[1])
fields = {f.name for f in dataclasses.fields(TrainConfig)}
options = {k: spec[k] for k in ("attention", "remat", "num_kv_heads") if spec.get(k) is not None}
unknown = sorted(set(options) - fields)
if unknown:
    sys.exit(f"this revision's TrainConfig has no {unknown}")
S, B = spec["seq_len"], spec["batch_size"]
config = TrainConfig(data="synthetic", workdir="unused", task="lm", model="transformer_lm", packing=True, seq_len=S,
                     width=spec["width"], depth=spec["depth"], heads=spec["heads"], batch_size=B, dtype=spec["dtype"],
                     **options)
task = LanguageModel("tokens", S, spec["vocab_size"], byte_level=False, pretokenized=True)
model = models.make(config.model, {**task.model_kwargs(), **config.model_size})
keys = ("tokens", "targets", "segment_ids", "positions")
program = Program(config, task, model, {k: jnp.zeros((1, S), jnp.int32) for k in keys}, None)
tx = program.optimizer()

def init():
    params = program.init_params()
    return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}

state = jax.eval_shape(init)
batch = {k: jax.ShapeDtypeStruct((B, S), jnp.int32) for k in keys}
if spec["measure"] == "kept":
    residuals = jax.eval_shape(lambda p, b: jax.vjp(lambda p: program.loss_sums(p, b)[0], p)[1], state["params"],
                               batch)
    print(json.dumps({"kept": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(residuals))}))
    sys.exit(0)

def step(state, batch):
    loss, grads, _ = program.gradients(state["params"], batch)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
            "step": state["step"] + 1}, loss

t = time.perf_counter()
memory = jax.jit(step, donate_argnums=(0,)).lower(state, batch).compile().memory_analysis()
print(json.dumps({"temp": memory.temp_size_in_bytes, "arguments": memory.argument_size_in_bytes,
                  "compile_s": time.perf_counter() - t, "device": jax.devices()[0].device_kind}))
"""


# Anchors by name: the revision whose LM used flax's attention with a [B, 1, S, S] mask; the last whose blockwise
# attention repeated grouped keys and values to the query heads.
ANCHORS = {"flax-attention": "5c575e8", "repeated-kv": "5dfdf33"}


def measure(code: Path, spec: dict, env: dict) -> dict:
    """Runs _CHILD with the project at `code` first on the path (its trainer, and the loader it was written for)."""
    path = os.pathsep.join(dict.fromkeys([str(code), str(REPO)]))
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], cwd=code, capture_output=True, text=True,
                          env={**env, "PYTHONPATH": path})
    if proc.returncode:
        raise SystemExit(f"{spec}: {proc.stderr.strip().splitlines()[-1]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--num-kv-heads", type=int, default=None,
                   help="grouped-query attention: key/value heads (default: one per query head)")
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--previous", default="flax-attention",
                   help=f"the anchor: this git revision's trainer/, or one named: {', '.join(ANCHORS)} ('' for none)")
    p.add_argument("--attentions", nargs="+", default=["blockwise", "dense"], help="ours: attention= kinds")
    p.add_argument("--remat", nargs="*", default=None,
                   help="also the bytes kept for the backward pass per remat policy (no names: a usual set)")
    p.add_argument("--cpu-scheduler", choices=["memory", "default"], default="memory")
    args = p.parse_args()
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    if args.cpu_scheduler == "memory":
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_enable_concurrency_optimized_scheduler=false").strip()
    size = {"width": args.width, "depth": args.depth, "heads": args.heads, "batch_size": args.batch_size,
            "vocab_size": args.vocab_size, "dtype": args.dtype, "num_kv_heads": args.num_kv_heads}
    with tempfile.TemporaryDirectory() as tmp:
        previous = Path(tmp) / "previous"
        try:
            codes = {}
            if args.previous:
                rev = ANCHORS.get(args.previous, args.previous)
                codes[f"previous ({args.previous})"] = (revision.checkout(rev, previous), None)
            for kind in args.attentions:
                codes[f"ours, attention={kind}"] = (REPO, kind)
            rows = {}
            grouped = f" ({args.num_kv_heads} key/value heads)" if args.num_kv_heads else ""
            print(f"{platform.machine()}, {os.cpu_count()} cores; width {args.width} depth {args.depth} "
                  f"heads {args.heads}{grouped} batch {args.batch_size} vocab {args.vocab_size} {args.dtype}, Adam; "
                  f"XLA:CPU scheduler: {args.cpu_scheduler}\n")
            print("| seq_len | step | temporaries GiB | arguments GiB | compile s |\n"
                  "| ---: | --- | ---: | ---: | ---: |")
            for seq_len in args.seq_lens:
                for name, (code, kind) in codes.items():
                    spec = {**size, "seq_len": seq_len, "attention": kind, "measure": "memory"}
                    rows[seq_len, name] = r = measure(code, spec, env)
                    print(f"| {seq_len} | {name} | {gib(r['temp'])} | {gib(r['arguments'])} | {r['compile_s']:.0f} |",
                          flush=True)
        finally:
            if previous.exists():
                revision.remove(previous)  # (the worktree's registration in the repository too)
    anchor = next(iter(codes))
    print()
    for seq_len in args.seq_lens:
        for name in list(codes)[1:]:
            print(f"seq_len {seq_len}: {anchor} / {name}: temporaries "
                  f"{rows[seq_len, anchor]['temp'] / rows[seq_len, name]['temp']:.1f}x")
    first, *others = args.seq_lens
    for seq_len in others:
        for name in codes:
            growth = rows[seq_len, name]["temp"] / rows[first, name]["temp"]
            print(f"{name}: temporaries at seq_len {seq_len} / at {first}: {growth:.1f}x (the sequence "
                  f"{seq_len / first:.0f}x)")
    if args.remat is not None:
        from trainer.config import REMATS

        policies = args.remat or list(REMATS)
        print(f"\nremat, ours, attention=blockwise, seq_len {first}: the step's temporaries, and what jax.vjp keeps "
              "from the forward pass for the backward (its residuals)\n")
        print("| remat | temporaries GiB | kept GiB |\n| --- | ---: | ---: |")
        for remat in dict.fromkeys(["none", *policies]):
            spec = {**size, "seq_len": first, "attention": "blockwise", "remat": remat}
            temp = measure(REPO, {**spec, "measure": "memory"}, env)["temp"]
            kept = measure(REPO, {**spec, "measure": "kept"}, env)["kept"]
            print(f"| {remat} | {gib(temp)} | {gib(kept)} |", flush=True)

if __name__ == "__main__":
    main()
