import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelines import ConvertConfig, run_conversion
from pipelines.demo import write_digits_tfrecords
from tests.conftest import COMPILATION_CACHE_ENV, REPO, built_once


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
    def build(root):
        write_digits_tfrecords(str(root / "tfrecord"), num_shards=2)
        return convert_splits(root, "digits")

    return built_once(tmp_path_factory, "digits", build)


@pytest.fixture(scope="session")
def one_based(tmp_path_factory):
    """The digits as ImageNet ships its labels: 1-based (1..10) in shards named `train-00000-of-00002` and
    `validation-00000-of-00001`, the top label rare (one training record, the last), converted by the real
    pipeline: {'train': dir, 'validation': dir}."""
    return built_once(tmp_path_factory, "one_based", _one_based)


def _one_based(root: Path) -> dict[str, Path]:
    import numpy as np

    from dataset_format.example_proto import encode_example
    from pipelines.demo import digits_splits
    from tests.conftest import write_tfrecord_shards

    out = {}
    for split, (images, labels) in digits_splits().items():
        name = "train" if split == "train" else "validation"
        labels = labels + 1
        order = np.arange(len(labels))
        if name == "train":
            order = np.concatenate([np.flatnonzero(labels != 10), np.flatnonzero(labels == 10)[:1]])
        records = [encode_example({"image": images[i].reshape(-1), "label": labels[i]}) for i in order]
        shards = np.array_split(np.arange(len(records)), 2 if name == "train" else 1)
        write_tfrecord_shards(root / "raw", [[records[i] for i in shard] for shard in shards],
                              pattern=name + "-{i:05d}-of-{n:05d}")
        out[name] = root / name
        assert run_conversion(ConvertConfig(input=str(root / "raw" / f"{name}-*"), output=str(out[name])),
                              ["--direct_num_workers=1"]).ok
    return out


def run_trainer(*overrides: str, devices: int = 1, timeout: int = 300, popen: bool = False,
                extra_env: dict | None = None):
    """`python -m trainer key=value ...` in a fresh process with `devices` simulated CPU devices, its compiled programs
    in the run's shared cache (tests/conftest.py; `extra_env={"JAX_COMPILATION_CACHE_DIR": ""}`: the workdir's)."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
           "JAX_COMPILATION_CACHE_DIR": os.environ.get(COMPILATION_CACHE_ENV, ""), **(extra_env or {})}
    cmd = [sys.executable, "-m", "trainer", *overrides]
    if popen:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def finish(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """The outputs of `run_trainer(popen=True)` processes that run together, read side by side: one read after
    another, a process whose output fills its pipe (64 KiB; a TF_CONFIG chief relays its Ray nodes' logs) stops
    while the test waits for another that waits for it. All are killed once they end or `timeout` passes (none
    outlives the test); those still running then are named with their output's tails."""
    import threading

    chunks: list[list[str]] = [[] for _ in procs]
    readers = [threading.Thread(target=chunks[i].extend, args=(p.stdout,), daemon=True) for i, p in enumerate(procs)]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    late: list[int] = []
    try:
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        late = [i for i, p in enumerate(procs) if p.poll() is None]
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for reader in readers:
            reader.join(timeout=10)
    outputs = ["".join(c) for c in chunks]
    assert not late, "\n".join(f"process {i} still ran after {timeout}s: ...{outputs[i][-2000:]}" for i in late)
    return outputs


def trainer_here(*overrides: str, path: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m trainer key=value ...` in this process (trainer/__main__.py's main), for runs that end before
    training starts (a bad setting or bad data: exit 2): the same status and output in a fraction of a second, where
    a fresh process pays ~8 s of imports; its log goes to pytest's capture (caplog). `path`: prepended to sys.path
    while it runs (a user's own modules)."""
    return _main_here(overrides, path, logged=False)


def train_here(*overrides: str, path: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m trainer key=value ...` run to its end in this process (one device), its log at INFO in `stderr` as
    the command writes it: the same status and output as run_trainer(...) without a process's ~5 s of imports and
    compiles. For runs whose test does not need a process of their own (a signal, a kill, several devices, a clean
    environment). `path`: as trainer_here's."""
    return _main_here(overrides, path, logged=True)


def _main_here(overrides: tuple[str, ...], path: Path | None, logged: bool) -> subprocess.CompletedProcess:
    import contextlib
    import io
    from unittest import mock

    from dataset_format import logs
    from trainer.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    loggers = [logging.getLogger(name) for name in ("", "dataset_format", "pipelines", "loader", "trainer")]
    levels = [logger.level for logger in loggers]
    with contextlib.ExitStack() as stack:
        if not logged:
            stack.enter_context(mock.patch.object(logs, "setup", lambda *a, **k: None))  # keeps pytest's log capture
        # No root handlers while it runs (logs.setup puts its own there, on this stderr): an earlier test's in-process
        # CLI may have left one on a stream that is closed now ("--- Logging error ---"); without logs.setup, warnings
        # go to logging's last resort, this stderr, as in a process.
        stack.enter_context(mock.patch.object(logging.getLogger(), "handlers", []))
        stack.enter_context(mock.patch.dict(os.environ, {"TF_CONFIG": ""}))
        if path is not None:
            stack.enter_context(mock.patch.object(sys, "path", [str(path), *sys.path]))
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        try:
            code = main(list(overrides))
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)
    return subprocess.CompletedProcess(["python", "-m", "trainer", *overrides], code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="session")
def rich_tfds(tmp_path_factory):
    """A TFDS dataset built by TFDS with Image, ClassLabel, Text, Tensor and Sequence features
    (tests/fixtures/rich_digits), converted by the real pipeline: the converted directory."""
    return built_once(tmp_path_factory, "rich", _rich_tfds)


def _rich_tfds(root: Path) -> Path:
    subprocess.run([str(Path(sys.executable).with_name("tfds")), "build", "tests/fixtures/rich_digits", "--data_dir",
                    str(root / "tfds"), "--file_format=tfrecord", "--num_shards", "2"],
                   cwd=REPO, check=True, capture_output=True, timeout=300)
    out = root / "converted"
    run_conversion(ConvertConfig(input=str(root / "tfds" / "rich_digits" / "1.0.0"), output=str(out)),
                   ["--direct_num_workers=1"])
    return out


def run_unoptimised(fn, *args):
    """fn(*args), compiled without LLVM's optimisations (xla_backend_optimization_level=0): the same maths to ~1e-7,
    in a quarter of the compile time (~2 s against ~8 s for a small LM's gradients on a CPU), and far faster than
    running it op by op. For tests of what a model computes, not how fast."""
    import jax

    return jax.jit(fn).lower(*args).compile({"xla_backend_optimization_level": 0})(*args)
