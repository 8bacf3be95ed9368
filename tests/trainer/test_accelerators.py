"""The warning for an accelerator the OS shows but JAX does not use, and the extras that install JAX for one."""

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from trainer import accelerators


def _dev(tmp_path, *names):
    for name in names:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    return str(tmp_path)


def test_a_gpu_seen_by_the_os_but_not_by_jax_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    dev = _dev(tmp_path, "nvidia0", "nvidiactl")
    message = accelerators.unused_accelerator_warning("cpu", dev)
    assert message == (f"an NVIDIA GPU is visible ({dev}/nvidia0) but JAX uses only the CPU: this install has JAX's "
                       "CPU build; install the gpu extra, pip install \".[gpu]\" (or set JAX_PLATFORMS=cpu to use "
                       "the CPU on purpose)")
    assert accelerators.unused_accelerator_warning("gpu", dev) is None  # JAX uses it: nothing to say
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert accelerators.unused_accelerator_warning("cpu", dev) is None  # the CPU by name


@pytest.mark.parametrize("names", [("accel0",), ("vfio/0", "vfio/vfio")])
def test_a_tpu_seen_by_the_os_but_not_by_jax_names_the_extra(tmp_path, monkeypatch, names):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    message = accelerators.unused_accelerator_warning("cpu", _dev(tmp_path, *names))
    assert message.startswith("a TPU is visible (") and 'pip install ".[tpu]"' in message


def test_no_accelerator_no_warning(tmp_path, monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    assert accelerators.unused_accelerator_warning("cpu", _dev(tmp_path, "null", "nvidiactl", "vfio/vfio")) is None


@pytest.mark.slow
@pytest.mark.parametrize("extra", ["gpu", "tpu"])
def test_the_accelerator_extras_resolve(extra, tmp_path):
    """`pip install --dry-run ".[gpu]"` / `".[tpu]"` resolve from the package registry (they need its index)."""
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--report", str(tmp_path / "report.json"), f".[{extra}]"], cwd=REPO, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    names = {item["metadata"]["name"].lower() for item in json.loads((tmp_path / "report.json").read_text())["install"]}
    assert {"jax", "jaxlib", "grain", "flax"} <= names
    assert ("jax-cuda12-plugin" in names) if extra == "gpu" else ("libtpu" in names), sorted(names)


@pytest.mark.parametrize("kind, tflops", [
    ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H200", 989), ("NVIDIA A100-SXM4-80GB", 312),
    ("NVIDIA B200", 2250), ("TPU v4", 275), ("TPU v5 lite", 197), ("TPU v5p", 459), ("TPU v5", 459),
    ("TPU v6 lite", 918), ("cpu", None), ("NVIDIA GeForce RTX 4090", None),
])
def test_the_bf16_peak_of_each_common_chip(kind, tflops):
    peak = accelerators.bf16_peak_flops(kind)
    assert peak == (None if tflops is None else tflops * 1e12)


def test_tokens_per_second_and_mfu_from_a_period_of_steps():
    from trainer.throughput import Throughput

    h200 = Throughput(replicas=2, counts_tokens=True, row_tokens=1024, flops_per_token=711_000_000,
                      peak_flops=989e12)
    rates = h200.rates(rows=10 * 64, real_tokens=[60_000.0] * 10, elapsed=2.0)  # 10 steps of 64 rows
    assert rates["tokens_per_sec"] == 300_000 and rates["tokens_per_sec_per_device"] == 150_000
    assert rates["mfu"] == pytest.approx(10 * 64 * 1024 * 711e6 / 2.0 / (2 * 989e12))  # every position computed
    assert Throughput.describe(rates) == "300,000 tokens/s MFU 11.8% "
    cpu = Throughput(replicas=1, counts_tokens=True, row_tokens=1024, flops_per_token=1000, peak_flops=None)
    assert cpu.rates(1, [512.0], 1.0) == {"tokens_per_sec": 512.0, "tokens_per_sec_per_device": 512.0}
    assert Throughput.describe(cpu.rates(1, [512.0], 1.0)) == "512 tokens/s "
    assert Throughput(replicas=8, counts_tokens=False).rates(5, [0.0] * 5, 1.0) == {}  # images: examples/s only
