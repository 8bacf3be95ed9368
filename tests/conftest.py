"""Shared fixtures: real data on disk, a real GCS emulator, real subprocesses."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

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


def run_cli(*args: str, env: dict | None = None, check: bool = False) -> subprocess.CompletedProcess:
    """Runs `python -m pipelines ARGS` in a fresh interpreter, as a user would."""
    proc = subprocess.run([sys.executable, "-m", "pipelines", *args], capture_output=True, text=True,
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
    return _tfds_build_digits(tmp_path_factory.mktemp("tfds"), "tfrecord")


@pytest.fixture(scope="session")
def tfds_digits_array_record(tmp_path_factory) -> Path:
    """The digits TFDS dataset as TFDS itself writes ArrayRecord (`--file_format=array_record`)."""
    return _tfds_build_digits(tmp_path_factory.mktemp("tfds-ar"), "array_record")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory):
    """A local GCS emulator (gcp-storage-emulator) and the environment clients need to use it.

    Sets the variables in this process (for Beam's GCS filesystem and google-cloud-storage)
    and returns them for subprocesses. The C++ client inside array_record reads
    CLOUD_STORAGE_EMULATOR_ENDPOINT.
    """
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    exe = Path(sys.executable).with_name("gcp-storage-emulator")
    proc = subprocess.Popen([str(exe), "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    config_dir = tmp_path_factory.mktemp("gcloud")
    creds = config_dir / "credentials.json"
    creds.write_text(json.dumps({"type": "authorized_user", "client_id": "test", "client_secret": "test",
                                 "refresh_token": "test", "token": "test-token",
                                 "expiry": "2099-01-01T00:00:00Z"}))
    env = {"STORAGE_EMULATOR_HOST": endpoint, "CLOUD_STORAGE_EMULATOR_ENDPOINT": endpoint,
           "NO_GCE_CHECK": "true", "GOOGLE_CLOUD_PROJECT": "test", "CLOUDSDK_CONFIG": str(config_dir),
           "GOOGLE_APPLICATION_CREDENTIALS": str(creds)}
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            break
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError(f"gcp-storage-emulator did not start on {endpoint}")
            time.sleep(0.2)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def gcs_bucket(gcs_emulator):
    """A fresh, empty bucket in the emulator; yields (bucket name, google.cloud.storage.Client)."""
    from google.cloud import storage

    client = storage.Client(project="test")
    name = f"bucket-{time.monotonic_ns()}"
    client.create_bucket(name)
    return name, client
