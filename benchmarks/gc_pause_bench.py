"""How long one of Python's full garbage collections pauses the training loop: over everything the trainer's imports
and setup made (the anchor, what a collection in the loop cost before) against the same after the trainer's
`gc.collect(); gc.freeze()` before its loop (trainer/train.py: the setup's objects left out of later collections).

The setup here is what `python -m trainer task=lm model=transformer_lm` makes before its loop, on the CPU: the
trainer's imports (JAX, Flax, optax, orbax, the loader), a transformer_lm's parameters and Adam's state, its training
step compiled. A full collection runs whenever enough objects have survived the younger generations; in a loop that
keeps at most two steps in flight, a pause longer than a step leaves the device waiting.

    .venv/bin/python benchmarks/gc_pause_bench.py            # width 512, depth 6
Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def full_collection_ms(repeats: int) -> float:
    """The median time of a full collection (generation 2), in ms."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def setup(width: int, depth: int, seq_len: int):
    """The trainer's setup, as its loop starts: imports, an LM's state, its compiled step (kept alive)."""
    import jax
    import jax.numpy as jnp
    import optax
    import orbax.checkpoint  # noqa: F401 - imported by the trainer

    import loader  # noqa: F401 - imported by the trainer
    from trainer import models

    model = models.TransformerLM(vocab_size=1024, max_len=seq_len, width=width, depth=depth, heads=8,
                                 attention="blockwise")
    tokens = jnp.zeros((2, seq_len), jnp.int32)
    params = model.init(jax.random.key(0), tokens)["params"]
    tx = optax.adam(1e-3)
    state = {"params": params, "opt": tx.init(params)}

    def step(state, tokens):
        grads = jax.grad(lambda p: model.apply({"params": p}, tokens).astype(jnp.float32).mean())(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}

    compiled = jax.jit(step).lower(state, tokens).compile()
    return state, compiled


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    kept = setup(args.width, args.depth, args.seq_len)  # noqa: F841 - alive while the collections run
    tracked = len(gc.get_objects())
    anchor = full_collection_ms(args.repeats)
    gc.collect()
    gc.freeze()
    ours = full_collection_ms(args.repeats)
    gc.unfreeze()
    print(f"{platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}; transformer_lm width "
          f"{args.width} depth {args.depth}: {tracked:,} objects tracked by the collector after the setup")
    print(f"a full collection: {anchor:.1f} ms over the setup's objects (the anchor) -> {ours:.3f} ms with them "
          "frozen (ours: what is left to scan is what the loop made since)")


if __name__ == "__main__":
    main()
