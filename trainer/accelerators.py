"""What the trainer knows of accelerators: the check at start for one the operating system shows but JAX does not
use, and each common chip's bf16 peak, the denominator of the MFU in the log.

`pip install ".[train]"` installs JAX's CPU build; on a GPU or TPU VM the trainer would then run on the CPU, slowly
and without a word. The `[gpu]` and `[tpu]` extras install JAX's CUDA 12 and TPU builds.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil

log = logging.getLogger(__name__)


def visible_accelerator(dev: str = "/dev") -> tuple[str, str] | None:
    """(kind, evidence) for an accelerator the OS shows: an NVIDIA GPU (/dev/nvidia0..., or nvidia-smi on PATH) or
    a TPU (/dev/accel*, or /dev/vfio/N as on TPU v5 and later). None when there is none."""
    gpus = sorted(glob.glob(os.path.join(dev, "nvidia[0-9]*")))
    if gpus:
        return "gpu", gpus[0]
    if dev == "/dev" and shutil.which("nvidia-smi"):
        return "gpu", shutil.which("nvidia-smi")
    tpus = sorted(glob.glob(os.path.join(dev, "accel[0-9]*"))) or sorted(
        p for p in glob.glob(os.path.join(dev, "vfio", "[0-9]*")))
    if tpus:
        return "tpu", tpus[0]
    return None


def unused_accelerator_warning(backend: str, dev: str = "/dev") -> str | None:
    """The one-line warning when JAX's `backend` is the CPU but the OS shows an accelerator, else None."""
    if backend != "cpu" or os.environ.get("JAX_PLATFORMS", "").strip() == "cpu":  # (the CPU asked for by name)
        return None
    found = visible_accelerator(dev)
    if found is None:
        return None
    kind, evidence = found
    name = {"gpu": "an NVIDIA GPU", "tpu": "a TPU"}[kind]
    return (f"{name} is visible ({evidence}) but JAX uses only the CPU: this install has JAX's CPU build; "
            f"install the {kind} extra, pip install \".[{kind}]\" (or set JAX_PLATFORMS=cpu to use the CPU on "
            "purpose)")


def warn_if_unused() -> None:
    import jax

    message = unused_accelerator_warning(jax.default_backend())
    if message:
        log.warning(message)


# Dense (not sparse) bf16 matrix-multiply peak of one chip, TFLOP/s, from the vendors' data sheets, by a part of JAX's
# `device.device_kind` ("NVIDIA H100 80GB HBM3", "TPU v5 lite", ...): the first entry the kind contains wins, so the
# more specific names come first. A TPU v4 or v5p chip is one JAX device (megacore).
BF16_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("TPU v4", 275.0),
    ("TPU v5 lite", 197.0), ("TPU v5e", 197.0),
    ("TPU v5p", 459.0), ("TPU v5", 459.0),
    ("TPU v6 lite", 918.0), ("TPU v6e", 918.0),
    ("A100", 312.0),
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0),
    ("H200", 989.0),
    ("B200", 2250.0),
)


def bf16_peak_flops(device_kind: str) -> float | None:
    """One chip's dense bf16 peak in FLOP/s, for a JAX device_kind in BF16_PEAK_TFLOPS; None for any other (the
    CPU, chips not in the table): the trainer then reports no MFU."""
    for name, tflops in BF16_PEAK_TFLOPS:
        if name.lower() in device_kind.lower():
            return tflops * 1e12
    return None
