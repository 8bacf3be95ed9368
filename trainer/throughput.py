"""Tokens/s and MFU in the training loop's log lines and metrics rows.

A task with `tokens(batch)` (task=lm: the real tokens of a batch, padding left out) gets `tokens_per_sec` and
`tokens_per_sec_per_device`; when the model also has `flops_per_token()` (model=transformer_lm) and the devices' bf16
peak is known (trainer/accelerators.py: TPU v4-v6e, A100, H100, H200, B200; not the CPU), `mfu`: the model's
training FLOPs over every position the steps computed (rows x seq_len, padding included: the work done) per second,
over the peak of all devices. Other tasks (images) report examples/s and examples/s per device only.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from trainer import accelerators

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Throughput:
    replicas: int  # devices the step runs on
    counts_tokens: bool  # the task says how many real tokens a batch has
    row_tokens: int = 0  # positions a row (an example) computes: seq_len
    flops_per_token: int | None = None  # the model's training FLOPs per position
    peak_flops: float | None = None  # one device's dense bf16 peak, FLOP/s

    @classmethod
    def of(cls, program: Any, strategy: Any) -> Throughput:
        """What `program`'s task and model and `strategy`'s devices allow; logs the MFU's terms once."""
        config = program.config
        replicas = strategy.num_replicas_in_sync
        if not hasattr(program.task, "tokens"):
            return cls(replicas, counts_tokens=False)
        flops = program.model.flops_per_token() if hasattr(program.model, "flops_per_token") else None
        kind = next(iter(strategy.mesh.devices.flat)).device_kind
        peak = accelerators.bf16_peak_flops(kind)
        if flops is None:
            log.info("model=%s has no flops_per_token(): tokens/s without MFU", config.model)
        elif peak is None:
            log.info("no bf16 peak known for %r (trainer/accelerators.py): tokens/s without MFU", kind)
        else:
            log.info("MFU: %s training FLOPs a token, against %d x %s at %.0f bf16 TFLOP/s", f"{flops:,}", replicas,
                     kind, peak / 1e12)
        return cls(replicas, True, config.seq_len, flops, peak)

    def rates(self, rows: int, real_tokens: Any, elapsed: float) -> dict[str, float]:
        """The metrics of steps of `rows` rows in all that took `elapsed` seconds, whose real token counts are
        `real_tokens`."""
        if not self.counts_tokens:
            return {}
        per_sec = float(np.sum(real_tokens)) / elapsed
        out = {"tokens_per_sec": per_sec, "tokens_per_sec_per_device": per_sec / self.replicas}
        if self.flops_per_token is not None and self.peak_flops is not None:
            out["mfu"] = rows * self.row_tokens * self.flops_per_token / elapsed / (self.peak_flops * self.replicas)
        return out

    @staticmethod
    def describe(row: dict) -> str:
        """The log line's part: "396,112 tokens/s MFU 36.1% " (empty without tokens)."""
        text = f"{row['tokens_per_sec']:,.0f} tokens/s " if "tokens_per_sec" in row else ""
        return text + (f"MFU {100 * row['mfu']:.1f}% " if "mfu" in row else "")
