"""remat=auto: what the backward pass of model=transformer_lm recomputes, chosen by the compiled step's memory.

Keeping everything for the backward pass is fastest; recomputing trades compute for memory. On a GPU or TPU the
trainer compiles the step with `none` (keep everything), then `elementwise` (recompute the blocks' norms and
activations), then `full` (recompute each block), and trains with the first whose step fits the devices' free memory
(XLA's memory analysis of the compiled step against what the devices report free, less a tenth for the allocator's
fragments and the batches placed ahead). The 104M model of docs/benchmarks.md on an NVIDIA H200 at batch 64: `none`
needs 21.2 GiB of temporaries and runs at 45-47% MFU; `elementwise` 12.0 GiB at 41-42%. At batch 256 `none` needs
84.4 GiB: it fits an H200's default memory, not an H100's, where `elementwise` (47.3 GiB) does.

A backend whose devices do not report their memory (the CPU) gets `elementwise`, with one compile: XLA:CPU's pipeline
schedules the recomputation back into the forward pass, so there the choice moves neither memory nor time much.
Every process of a multi-host run chooses alike: each compiles the same programs and they share the least free
memory among them.
"""

from __future__ import annotations

import logging
from typing import Callable

import jax
import numpy as np

log = logging.getLogger(__name__)

ORDER = ("none", "elementwise", "full")  # fastest first
HEADROOM = 0.9  # the share of the free memory a step may need


def free_bytes() -> int | None:
    """The least free memory among this run's devices (bytes_limit - bytes_in_use, with the state already placed),
    or None where the devices do not report it."""
    stats = [device.memory_stats() for device in jax.local_devices()]
    if not all(s and "bytes_limit" in s for s in stats):
        return None
    free = min(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
    if jax.process_count() > 1:  # the same choice on every host: the least free memory of all
        from jax.experimental import multihost_utils
        free = int(np.min(multihost_utils.process_allgather(np.int64(free))))
    return free


def needed_bytes(compiled: jax.stages.Compiled, batch_bytes: int) -> int | None:
    """What a compiled step needs beyond its state, per device: its temporaries, the outputs that do not overwrite
    its arguments, and the batch (None where XLA gives no memory analysis)."""
    memory = compiled.memory_analysis()
    if memory is None:
        return None
    outputs = max(0, memory.output_size_in_bytes - memory.alias_size_in_bytes)
    return memory.temp_size_in_bytes + outputs + batch_bytes


def choose(compile_with: Callable[[str], jax.stages.Compiled], batch_bytes: int,
           free: int | None) -> tuple[str, jax.stages.Compiled]:
    """(policy, compiled step): the first of ORDER whose step fits HEADROOM of `free` bytes, the last of them if none
    does (its out-of-memory error then names the fix), `elementwise` where `free` is None. `compile_with(policy)`
    compiles the step with that policy."""
    if free is None:
        log.info("remat=auto: elementwise (this backend's devices do not report their memory: the blocks' norms and "
                 "activations are recomputed, their matrix multiplies' outputs kept)")
        return "elementwise", compile_with("elementwise")
    refused = []
    for policy in ORDER:
        compiled = compile_with(policy)
        need = needed_bytes(compiled, batch_bytes)
        if need is None or need <= HEADROOM * free:
            fits = "XLA gives no memory analysis" if need is None else \
                f"its step needs {size(need)} of the {size(free)} free on each device"
            slower = f"; {', '.join(refused)}, more than {round(100 * HEADROOM)}% of it" if refused else ""
            log.info("remat=auto: %s (%s%s)", policy, fits, slower)
            return policy, compiled
        refused.append(f"{policy} would need {size(need)}")
    log.warning("remat=auto: %s, though no policy's step fits %d%% of the %s free on each device (%s): if the step "
                "runs out of memory, lower batch_size or seq_len", ORDER[-1], round(100 * HEADROOM), size(free),
                ", ".join(refused))
    return ORDER[-1], compiled


def size(n: int) -> str:
    """Bytes of device memory as the log gives them: GiB with two decimals, MiB under one GiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
