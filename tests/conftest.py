"""Shared fixtures: real data on disk, a real GCS emulator, real subprocesses."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import emulator

REPO = Path(__file__).resolve().parents[1]


def write_tfrecord_shards(directory: Path, shard_records: list[list[bytes]], pattern: str = "train-{i:05d}-of-{n:05d}.tfrecord") -> list[Path]:
    """Writes one TFRecord file per list of records; returns the paths in order."""
    from pipelines import tfrecord

    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, records in enumerate(shard_records):
        path = directory / pattern.format(i=i, n=len(shard_records))
        with open(path, "wb") as f:
            tfrecord.write_records(f, records)
        paths.append(path)
    return paths


def synthetic_records(shard: int, count: int, size: int = 100) -> list[bytes]:
    """Distinct, recognisable records: b'<shard>:<index>:' padded to `size`."""
    return [f"{shard}:{i}:".encode().ljust(size, b"x") for i in range(count)]


def file_permissions_apply() -> list[str]:
    """A command prefix under which file permissions apply to this user: none for a plain user; for root (as in
    containers), setpriv dropping CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, so that a chmod 000 file cannot be read."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv (util-linux): file permissions cannot be made to apply")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]


def run_cli(*args: str, env: dict | None = None, check: bool = False,
            prefix: list[str] = ()) -> subprocess.CompletedProcess:
    """Runs `python -m pipelines ARGS` in a fresh interpreter, as a user would (after `prefix`, a command such
    as file_permissions_apply())."""
    proc = subprocess.run([*prefix, sys.executable, "-m", "pipelines", *args], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, **(env or {})}, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def _tfds_build_digits(data_dir: Path, file_format: str) -> Path:
    subprocess.run([str(Path(sys.executable).with_name("tfds")), "build", "pipelines/datasets/digits",
                    "--data_dir", str(data_dir), f"--file_format={file_format}", "--num_shards", "3"],
                   cwd=REPO, check=True, capture_output=True, timeout=300)
    return data_dir / "digits" / "1.0.0"


@pytest.fixture(scope="session")
def tfds_digits(tmp_path_factory) -> Path:
    """The digits TFDS dataset built with `tfds build --file_format=tfrecord --num_shards 3`."""
    return built_once(tmp_path_factory, "tfds", lambda d: _tfds_build_digits(d, "tfrecord"))


@pytest.fixture(scope="session")
def tfds_digits_array_record(tmp_path_factory) -> Path:
    """The digits TFDS dataset as TFDS itself writes ArrayRecord (`--file_format=array_record`)."""
    return built_once(tmp_path_factory, "tfds-ar", lambda d: _tfds_build_digits(d, "array_record"))


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory):
    """A local GCS emulator (gcp-storage-emulator) and the environment clients need to use it (tests/emulator.py):
    set in this process, and returned for subprocesses."""
    with emulator.running(tmp_path_factory.mktemp("gcloud")) as env:
        yield env


@pytest.fixture
def faulty_gcs(gcs_bucket, gcs_emulator, monkeypatch):
    """(bucket, front): the bucket reached through a front that answers chosen requests with chosen statuses
    (tests/emulator.py FaultFront); STORAGE_EMULATOR_HOST points at it here, and in `gcs_emulator` for subprocesses."""
    bucket, _ = gcs_bucket
    with emulator.fault_front(gcs_emulator["STORAGE_EMULATOR_HOST"]) as front:
        url = f"http://127.0.0.1:{front.server_address[1]}"
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
        monkeypatch.setitem(gcs_emulator, "STORAGE_EMULATOR_HOST", url)
        yield bucket, front


@pytest.fixture
def gcs_bucket(gcs_emulator):
    """A fresh, empty bucket in the emulator; yields (bucket name, google.cloud.storage.Client)."""
    from google.cloud import storage

    client = storage.Client(project="test")
    name = f"bucket-{time.monotonic_ns()}"
    client.create_bucket(name)
    return name, client


def built_once(tmp_path_factory, name: str, build):
    """build(directory), a fixture's data, once for the whole run: under pytest-xdist the first worker to ask builds
    it in the run's directory that every worker shares, and the others wait and take what it returned (paths, or a
    dict of them), instead of each converting the same data again. Tests read such data, never change it (one that
    changes it works on a copy)."""
    import json

    from filelock import FileLock

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return build(tmp_path_factory.mktemp(name))
    shared = tmp_path_factory.getbasetemp().parent / "built-once"
    shared.mkdir(exist_ok=True)
    with FileLock(str(shared / f"{name}.lock")):
        done = shared / f"{name}.json"
        if done.exists():
            return _from_json(json.loads(done.read_text()))
        directory = shared / name
        shutil.rmtree(directory, ignore_errors=True)  # (a build that failed in another worker)
        directory.mkdir()
        value = build(directory)
        done.write_text(json.dumps(_to_json(value)))
        return value


def _to_json(value):
    if isinstance(value, Path):
        return {"path": str(value)}
    if isinstance(value, dict):
        return {"dict": {k: _to_json(v) for k, v in value.items()}}
    assert isinstance(value, str), value
    return value


def _from_json(value):
    if isinstance(value, dict):
        return Path(value["path"]) if "path" in value else {k: _from_json(v) for k, v in value["dict"].items()}
    return value


COMPILATION_CACHE_ENV = "TESTS_JAX_COMPILATION_CACHE"


@pytest.fixture(scope="session", autouse=True)
def shared_compilation_cache(tmp_path_factory):
    """One JAX compilation cache for the whole run (every xdist worker's), in its temporary directory: a program many
    tests run (the digits' init and step) compiles once. The `python -m trainer` processes of
    tests/trainer/conftest.py run_trainer get it as JAX_COMPILATION_CACHE_DIR; this process, where the tests imported
    JAX, as its setting (trainer/compile_cache.py keeps it for compilation_cache=auto; a test of the compiles
    themselves sets it back to None)."""
    base = tmp_path_factory.getbasetemp()
    directory = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "jax-compilation-cache"
    directory.mkdir(exist_ok=True)
    os.environ[COMPILATION_CACHE_ENV] = str(directory)
    jax = sys.modules.get("jax")
    before = jax.config.jax_compilation_cache_dir if jax is not None else None
    if jax is not None:
        jax.config.update("jax_compilation_cache_dir", str(directory))
    yield directory
    if jax is not None:
        jax.config.update("jax_compilation_cache_dir", before)
    os.environ.pop(COMPILATION_CACHE_ENV, None)


@pytest.fixture(scope="session", autouse=True)
def loader_index_dir(tmp_path_factory):
    """The loader's index cache (loader/format/index.py) in a temporary directory, for this process and its children."""
    directory = tmp_path_factory.mktemp("loader-index")
    previous = os.environ.get("LOADER_INDEX_DIR")
    os.environ["LOADER_INDEX_DIR"] = str(directory)
    yield directory
    if previous is None:
        os.environ.pop("LOADER_INDEX_DIR", None)
    else:
        os.environ["LOADER_INDEX_DIR"] = previous
