"""Fixtures of the conversion tests: a job to kill at a chosen point (tests/pipelines/test_resume.py)."""

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, synthetic_records, write_tfrecord_shards

SHARDS = 8

SITECUSTOMIZE = '''
import os, signal

_point = os.environ.get("ARCONV_KILL_AT", "")
_counter = os.environ.get("ARCONV_KILL_COUNTER", "")


def _die():
    os.killpg(os.getpgrp(), signal.SIGKILL)


if _point.startswith("interrupt:"):  # as on a terminal: a parent that ignores SIGINT (a test runner's worker) would
    signal.signal(signal.SIGINT, signal.default_int_handler)  # leave this process ignoring it too
os.environ.setdefault("ARCONV_LAUNCHER", str(os.getpid()))  # (the first process: its workers inherit it)
if _point.startswith(("commit:", "interrupt:", "terminate:")):  # killed, Ctrl-C or SIGTERM, after N commits
    from pipelines import commits
    _write = commits.write

    def write(*args, **kwargs):
        _write(*args, **kwargs)
        fd = os.open(_counter, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, b"x")
        os.close(fd)
        count = os.path.getsize(_counter)
        if count == int(_point.split(":")[1]):
            if _point.startswith("commit:"):
                _die()
            elif _point.startswith("interrupt:"):  # a terminal's Ctrl-C: to the command's process group (the test
                os.killpg(os.getpgrp(), signal.SIGINT)  # starts it in one of its own), worker processes and all
            else:  # to the launcher, as a stopped pod's: Beam's worker processes write the commits of `workers` > 1
                os.kill(int(os.environ["ARCONV_LAUNCHER"]), signal.SIGTERM)
        elif count > int(_point.split(":")[1]):  # the shards after it, slower than these small ones convert: the
            import time                           # signal is handled before the last one (it ran to the end, exit 0)

            time.sleep(1)

    commits.write = write
elif _point.startswith("replaced:"):  # killed after the Nth shard's file replaced the old one, before its record
    from pipelines import commits
    _write = commits.write

    def write(*args, **kwargs):
        fd = os.open(_counter, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, b"x")
        os.close(fd)
        if os.path.getsize(_counter) == int(_point.split(":")[1]):
            _die()
        _write(*args, **kwargs)

    commits.write = write
elif _point == "manifest":
    from dataset_format import storage
    _write_text = storage.write_text

    def write_text(path, text, **kwargs):
        if path.endswith("manifest.json"):
            _die()
        _write_text(path, text, **kwargs)

    storage.write_text = write_text
elif _point == "first-shard":
    from pipelines import shard
    _check = shard._check_count

    def check_count(*args, **kwargs):
        _die()

    shard._check_count = check_count
'''


@pytest.fixture
def job(tmp_path):
    write_tfrecord_shards(tmp_path / "in", [synthetic_records(i, 3000, size=200) for i in range(SHARDS)])
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return tmp_path


def killed_run(job, point: str, *flags: str) -> int:
    """`python -m pipelines convert` (with `flags`) in its own process group, killed at `point`; returns its exit
    status."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(job / "site"), str(REPO)]), "ARCONV_KILL_AT": point,
           "ARCONV_KILL_COUNTER": str(job / "counter")}
    proc = subprocess.run([sys.executable, "-m", "pipelines", "convert", "--input", str(job / "in" / "*.tfrecord"),
                           "--output", str(job / "out"), *flags], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300, start_new_session=True)
    return proc.returncode
