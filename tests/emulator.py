"""A local GCS emulator (gcp-storage-emulator) and the environment its clients need: for the tests' fixture and for
benchmarks that measure against gs:// (benchmarks/plan_bench.py --gcs)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(config_dir: Path):
    """Starts the emulator, sets its client environment in this process (Beam's GCS filesystem and
    google-cloud-storage read it; the C++ client inside array_record reads CLOUD_STORAGE_EMULATOR_ENDPOINT) and
    yields it for subprocesses; restores the environment and stops the emulator after."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    exe = Path(sys.executable).with_name("gcp-storage-emulator")
    proc = subprocess.Popen([str(exe), "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
