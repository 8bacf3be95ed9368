"""docs/keras_example.py: Keras 3 Model.fit on JAX under DataParallel, fed by the loader."""

import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow  # ~26 s on 2 cores: a docs example, Keras training in a subprocess
def test_keras_example_trains_data_parallel(digits):
    proc = subprocess.run([sys.executable, "docs/keras_example.py", str(digits["train"]), str(digits["test"])],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "KERAS_BACKEND": "jax",
                               "XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "keras DataParallel over 4 devices" in proc.stdout
    assert "on 4 devices" in proc.stdout  # variables replicated over the 4 devices
    accuracy = float(proc.stdout.strip().splitlines()[-1].split()[3])
    assert accuracy > 0.9, proc.stdout[-2000:]
    assert "shuffle=True was passed, but will be ignored" not in proc.stderr  # the loader shuffles
