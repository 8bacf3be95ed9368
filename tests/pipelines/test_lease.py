"""One writer per output: a second conversion fails fast naming the first; a dead holder's lease is taken over."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, run_cli, synthetic_records, write_tfrecord_shards

SLOW_COMMITS = '''
import os
import time
from pipelines import commits
_write = commits.write

def write(*args, **kwargs):  # held until the test releases it (at most 120 s): the run outlives the second's refusal
    deadline = time.monotonic() + 120
    while not os.path.exists(os.environ["RELEASE"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    _write(*args, **kwargs)

commits.write = write
'''


def _lease(host: str, pid: int, heartbeat_age: float) -> str:
    now = time.time()
    return json.dumps({"host": host, "pid": pid, "started": now - 600, "heartbeat": now - heartbeat_age})


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_second_run_fails_fast_naming_the_first_which_completes(tmp_path):
    write_tfrecord_shards(tmp_path / "in", [synthetic_records(i, 100) for i in range(2)])
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SLOW_COMMITS)
    args = ["convert", "--input", str(tmp_path / "in" / "*"), "--output", str(tmp_path / "out"),
            "--direct_num_workers=1"]
    first = subprocess.Popen([sys.executable, "-m", "pipelines", *args], cwd=REPO, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO)]),
                                  "RELEASE": str(tmp_path / "release")})
    deadline = time.monotonic() + 60
    while not (tmp_path / "out" / ".lease.json").exists():
        assert time.monotonic() < deadline and first.poll() is None, first.communicate()
        time.sleep(0.1)

    started = time.monotonic()
    second = run_cli(*args)
    assert time.monotonic() - started < 30 and first.poll() is None  # refused while the first still runs
    assert second.returncode == 2 and "Traceback" not in second.stderr
    assert (f"error: {tmp_path / 'out'} is being converted by another run (host {socket.gethostname()!r} pid "
            f"{first.pid}, since ") in second.stderr
    assert "pass --break-lock if that run is dead" in second.stderr

    (tmp_path / "release").touch()
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err[-2000:]
    assert "converted 2 shard(s) (200 records" in out and not (tmp_path / "out" / ".lease.json").exists()
    assert "2 shards, 200 records, 0 problem(s)" in run_cli("verify", "--output", str(tmp_path / "out"), "--deep",
                                                          check=True).stdout


@pytest.mark.parametrize("holder, heartbeat_age, flags, taken_over", [
    ("this-host-dead-pid", 1, [], "its process is gone"),
    ("other-host", 1, [], None),
    ("other-host", 3600, [], "no heartbeat for over 120 s"),
    ("other-host", 1, ["--break-lock"], "--break-lock"),
])
def test_a_lease_is_taken_over_only_from_a_dead_holder(tmp_path, holder, heartbeat_age, flags, taken_over):
    write_tfrecord_shards(tmp_path / "in", [synthetic_records(0, 10)])
    (tmp_path / "out").mkdir()
    host, pid = (socket.gethostname(), _dead_pid()) if holder == "this-host-dead-pid" else ("build-7", 4242)
    (tmp_path / "out" / ".lease.json").write_text(_lease(host, pid, heartbeat_age))

    proc = run_cli("convert", "--input", str(tmp_path / "in" / "*"), "--output", str(tmp_path / "out"), *flags)

    if taken_over is None:
        assert proc.returncode == 2 and "is being converted by another run (host 'build-7' pid 4242" in proc.stderr
        assert not (tmp_path / "out" / "manifest.json").exists()
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"taking over the lease of {tmp_path / 'out'} from host {host!r} pid {pid}" in proc.stderr
        assert taken_over in proc.stderr and not (tmp_path / "out" / ".lease.json").exists()


@pytest.mark.gcs
def test_the_lease_on_gcs(tmp_path, gcs_bucket, gcs_emulator):
    bucket, client = gcs_bucket
    write_tfrecord_shards(tmp_path / "in", [synthetic_records(0, 10)])
    output = f"gs://{bucket}/out"
    args = ["convert", "--input", str(tmp_path / "in" / "*"), "--output", output]
    client.bucket(bucket).blob("out/.lease.json").upload_from_string(_lease("build-7", 4242, 1))

    held = run_cli(*args, env=gcs_emulator)
    assert held.returncode == 2 and f"error: {output} is being converted by another run (host 'build-7'" in held.stderr

    client.bucket(bucket).blob("out/.lease.json").upload_from_string(_lease("build-7", 4242, 3600))
    expired = run_cli(*args, env=gcs_emulator)
    assert expired.returncode == 0 and "no heartbeat for over 120 s" in expired.stderr
    assert "out/.lease.json" not in {b.name for b in client.list_blobs(bucket)}  # released at the end

    client.bucket(bucket).blob("out/.lease.json").upload_from_string(_lease("build-7", 4242, 1))
    broken = run_cli(*args, "--break-lock", "--force", env=gcs_emulator)
    assert broken.returncode == 0 and "converted 1 shard(s)" in broken.stdout
