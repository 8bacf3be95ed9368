"""dataset_format.lease: a holder known dead is taken over at once; one on another host is watched (wait=True) until
it beats (refused), lapses or ends (taken)."""

import json
import logging
import os
import re
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from dataset_format.lease import LEASE_NAME, Lease, LeaseHeld, dead


def _write(directory, host: str, pid: int, heartbeat_age: float, started_age: float = 600) -> None:
    now = time.time()
    (directory / LEASE_NAME).write_text(json.dumps({"host": host, "pid": pid, "started": now - started_age,
                                                    "heartbeat": now - heartbeat_age}))


def _holder(directory) -> dict:
    return json.loads((directory / LEASE_NAME).read_text())


def _held(holder: str) -> str:
    return f"held by {holder}"


def test_a_lease_from_another_host_whose_heartbeat_lapses_is_taken_over_after_the_wait(tmp_path, caplog):
    _write(tmp_path, "tpu-host-3", 4242, heartbeat_age=4)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="dataset_format.lease"), Lease(str(tmp_path), held=_held, wait=True,
                                                                                  ttl=6):
        took = time.monotonic() - started
        assert _holder(tmp_path)["pid"] == os.getpid()
    assert 1.5 < took < 10, took
    assert not (tmp_path / LEASE_NAME).exists()
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith(f"{tmp_path} is held by host 'tpu-host-3' pid 4242, since ")
    assert re.search(r"waiting up to \d s for that run's next heartbeat, to tell a live run \(refused\) from "
                     r"one whose host was lost \(taken over\)$", messages[0]), messages[0]  # (6 s less its age)
    assert messages[1].startswith(f"taking over the lease of {tmp_path} from host 'tpu-host-3' pid 4242")
    assert messages[1].endswith(": no heartbeat for over 6 s")


def test_a_lease_from_another_host_that_beats_is_refused_at_its_beat(tmp_path):
    _write(tmp_path, "tpu-host-3", 4242, heartbeat_age=1)
    stop = threading.Event()

    def beats():  # the live holder's heartbeats, every 0.3 s (whenever the wait reads its first, a later one comes)
        while not stop.wait(0.3):
            _write(tmp_path, "tpu-host-3", 4242, 0)

    beat = threading.Thread(target=beats, daemon=True)
    beat.start()
    started = time.monotonic()
    try:
        with pytest.raises(LeaseHeld, match=r"^held by host 'tpu-host-3' pid 4242, since .*, last heartbeat \d s ago$"):
            with Lease(str(tmp_path), held=_held, wait=True, ttl=60):
                pass
    finally:
        stop.set()
        beat.join()
    assert time.monotonic() - started < 5
    assert _holder(tmp_path)["host"] == "tpu-host-3"  # left as it was


def test_a_lease_whose_run_ends_during_the_wait_is_taken_anew(tmp_path, caplog):
    _write(tmp_path, "tpu-host-3", 4242, heartbeat_age=1)
    threading.Timer(0.5, (tmp_path / LEASE_NAME).unlink).start()
    with caplog.at_level(logging.WARNING, logger="dataset_format.lease"), Lease(str(tmp_path), held=_held, wait=True,
                                                                                  ttl=60):
        assert _holder(tmp_path)["pid"] == os.getpid()
    assert not any("taking over" in r.getMessage() for r in caplog.records)


def test_a_live_process_on_this_host_is_refused_at_once_even_with_the_wait(tmp_path):
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.1)
        _write(tmp_path, socket.gethostname(), sleeper.pid, heartbeat_age=1, started_age=0)
        started = time.monotonic()
        with pytest.raises(LeaseHeld, match=f"pid {sleeper.pid},"):
            with Lease(str(tmp_path), held=_held, wait=True, ttl=60):
                pass
        assert time.monotonic() - started < 1
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_dead_or_reused_pid_on_this_host_is_known_dead():
    host, now = socket.gethostname(), time.time()
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert dead({"host": host, "pid": gone.pid, "started": now, "heartbeat": now}, 120) == "its process is gone"
    # a restarted container's process with its predecessor's pid; a process younger than the lease, with its pid
    assert dead({"host": host, "pid": os.getpid(), "started": now, "heartbeat": now}, 120) == (
        "its process is gone (this process has its pid now)")
    assert dead({"host": host, "pid": os.getppid(), "started": now - 10**6, "heartbeat": now}, 120) == (
        f"its process is gone (pid {os.getppid()} is another process, started after the lease)")
    assert dead({"host": host, "pid": os.getppid(), "started": now, "heartbeat": now}, 120) is None
    zombie = subprocess.Popen(["sleep", "30"])
    zombie.kill()
    deadline = time.monotonic() + 10  # until it is dead, not reaped (no wait() yet)
    while Path(f"/proc/{zombie.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        assert dead({"host": host, "pid": zombie.pid, "started": now, "heartbeat": now}, 120) == (
            "its process is gone (it has exited; its parent has not reaped it)")
    finally:
        zombie.wait()
    assert dead({"host": "elsewhere", "pid": 1, "started": now, "heartbeat": now - 121}, 120) == (
        "no heartbeat for over 120 s")


def test_a_suspended_holder_on_this_host_is_not_taken_over_and_the_fix_is_named(tmp_path):
    """A run stopped by Ctrl-Z beats no more but lives: taken over, it would write beside the new run once resumed."""
    import signal

    holder = subprocess.Popen(["sleep", "60"])
    try:
        time.sleep(0.2)
        os.kill(holder.pid, signal.SIGSTOP)
        while Path(f"/proc/{holder.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
            time.sleep(0.01)
        _write(tmp_path, socket.gethostname(), holder.pid, heartbeat_age=1000, started_age=-5)  # (started after it)
        with pytest.raises(LeaseHeld, match=rf"held by host '.*' pid {holder.pid}, since .*, last heartbeat 100\d s "
                                            rf"ago, suspended \(stopped by Ctrl-Z or SIGSTOP\): resume it \(`fg` in its "
                                            rf"shell, or kill -CONT {holder.pid}\) or end it$"):
            Lease(str(tmp_path), held=_held).__enter__()
    finally:
        holder.kill()
        holder.wait()


def test_a_run_whose_lease_was_taken_over_leaves_it_to_the_new_holder(tmp_path):
    with Lease(str(tmp_path), held=_held):
        _write(tmp_path, "another-host", 4242, heartbeat_age=0)  # taken over while this run was stopped, say
    assert _holder(tmp_path)["host"] == "another-host"  # not deleted by the run that lost it


RACER = """
import sys, time
from dataset_format.lease import Lease, LeaseHeld
start = float(sys.argv[2])
time.sleep(max(0.0, start - time.time()))
try:
    with Lease(sys.argv[1], held=lambda holder: "held by " + holder):
        print("took it", flush=True)
        time.sleep(4.0)  # (held until every racer has tried, however late it started)
except LeaseHeld as e:
    print("refused:", e, flush=True)
"""


def test_runs_that_take_over_a_dead_lease_at_the_same_moment_get_one_holder(tmp_path):
    """A local takeover replaced the lease unconditionally: two runs started together after a crash both read the
    dead holder's lease, both wrote their own, and both ran (each learnt it ~40 s later, at its next heartbeat)."""
    from tests.conftest import REPO

    gone = subprocess.Popen(["true"])
    gone.wait()
    for attempt in range(2):
        _write(tmp_path, socket.gethostname(), gone.pid, heartbeat_age=5)
        start = time.time() + 3.0  # (the 6 interpreters' imports done by then)
        racers = [subprocess.Popen([os.sys.executable, "-c", RACER, str(tmp_path), str(start)], cwd=REPO,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                   env={**os.environ, "PYTHONPATH": str(REPO)}) for _ in range(6)]
        said = sorted(p.communicate(timeout=60)[0].strip() for p in racers)
        assert said.count("took it") == 1, said
        assert all(s.startswith("refused: held by host") or s == "refused: held by another run, which took it over "
                   "a moment ago" for s in said if s != "took it"), said


@pytest.mark.gcs
def test_a_gs_heartbeat_whose_answer_was_lost_keeps_the_lease(faulty_gcs, caplog):
    """A heartbeat is a conditional write (the generation written last). Applied, its answer lost, the client's retry
    meets a 412 (the generation moved: by this write), and the run stopped renewing its lease as if another had taken
    it: after `ttl` a run on another host would take a live run's output over. A 412 now reads the lease back: still
    this run's, it beats on. (The emulator does not enforce the generation: the front answers the retry 412, as
    Cloud Storage does.)"""
    from dataset_format import storage

    bucket, front = faulty_gcs
    directory, ttl = f"gs://{bucket}/out", 3.0
    with caplog.at_level(logging.WARNING, logger="dataset_format.lease"):
        with Lease(directory, held=_held, ttl=ttl):
            front.fail_next(0, where="ifGenerationMatch=")  # applied, its answer cut: the client retries
            front.fail_next(412, where="ifGenerationMatch=")  # the retry
            time.sleep(2.5 * ttl)
            lease = json.loads(storage.read_text(f"{directory}/{LEASE_NAME}"))
            assert not front.faults  # (both faults were met)
            assert time.time() - lease["heartbeat"] < ttl / 3 + 1.0  # it beat after them
            assert dead({**lease, "host": "another-host"}, ttl) is None
        assert storage.read_text(f"{directory}/{LEASE_NAME}") is None  # given back at the end
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
