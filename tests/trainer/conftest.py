import subprocess
import sys
from pathlib import Path

import pytest

from pipelines import ConvertConfig, run_conversion
from pipelines.demo import write_digits_tfrecords
from tests.conftest import REPO


def convert_splits(root: Path, name: str) -> dict[str, Path]:
    """Converts the demo shards `root/tfrecord/{name}-{split}.tfrecord-*` of each split: {'train': dir, 'test': dir}."""
    out = {}
    for split in ("train", "test"):
        out[split] = root / split
        run_conversion(ConvertConfig(input=str(root / "tfrecord" / f"{name}-{split}.tfrecord-*"), output=str(out[split])),
                       ["--direct_num_workers=1"])
    return out


@pytest.fixture(scope="session")
def digits(tmp_path_factory):
    """The digits demo converted by the real pipeline: {'train': dir, 'test': dir}."""
    root = tmp_path_factory.mktemp("digits")
    write_digits_tfrecords(str(root / "tfrecord"), num_shards=2)
    return convert_splits(root, "digits")


def run_trainer(*overrides: str, devices: int = 1, timeout: int = 300, popen: bool = False,
                extra_env: dict | None = None):
    """`python -m trainer key=value ...` in a fresh process with `devices` simulated CPU devices."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", **(extra_env or {})}
    cmd = [sys.executable, "-m", "trainer", *overrides]
    if popen:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def rich_tfds(tmp_path_factory):
    """A TFDS dataset built by TFDS with Image, ClassLabel, Text, Tensor and Sequence features
    (tests/fixtures/rich_digits), converted by the real pipeline: the converted directory."""
    root = tmp_path_factory.mktemp("rich")
    subprocess.run([str(Path(sys.executable).with_name("tfds")), "build", "tests/fixtures/rich_digits", "--data_dir",
                    str(root / "tfds"), "--file_format=tfrecord", "--num_shards", "2"],
                   cwd=REPO, check=True, capture_output=True, timeout=300)
    out = root / "converted"
    run_conversion(ConvertConfig(input=str(root / "tfds" / "rich_digits" / "1.0.0"), output=str(out)),
                   ["--direct_num_workers=1"])
    return out
