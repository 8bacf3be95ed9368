"""trainer/job.py's workdir lease: one training run a workdir. (The checks between the processes of one job are in
test_multi_worker.py.)"""

import json
import re
import signal
import socket
import time

import pytest

from tests.trainer.conftest import run_trainer, train_here, trainer_here


@pytest.mark.timeout(300)
def test_a_second_run_on_a_workdir_in_use_stops_in_one_line_and_the_first_trains_on(digits, tmp_path):
    """A job launched twice, or two runs given one workdir: both wrote checkpoints and metrics there. Now the second
    stops at once, naming the first; the first trains on and releases the workdir when it stops."""
    workdir = tmp_path / "run"
    args = (f"data={digits['train']}", "model=mlp", "num_classes=10", "batch_size=32", "log_every=1",
            "checkpoint_every=100000", f"workdir={workdir}")
    first = run_trainer(*args, "steps=100000", popen=True)
    try:
        deadline = time.monotonic() + 200
        while not ((workdir / "metrics.jsonl").exists() and (workdir / "metrics.jsonl").read_text().count("\n") >= 2):
            assert time.monotonic() < deadline and first.poll() is None, first.communicate()[0][-3000:]
            time.sleep(0.1)
        import jax

        import trainer.train  # noqa: F401 - imported (and JAX started) before the clock: the refusal is what is timed

        jax.devices()
        started = time.monotonic()
        second = trainer_here(*args, "steps=5")
        assert time.monotonic() - started < 10
        assert second.returncode == 2 and second.stdout == "", second.stderr[-3000:]
        last = second.stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: workdir={workdir} is in use by another training run (host "
                               f"{socket.gethostname()!r} pid {first.pid}, since "), last
        assert last.endswith(" s ago); stop that run, or give this one another workdir (.lease.json there names the "
                             "run that holds it)"), last
        assert json.loads((workdir / ".lease.json").read_text())["pid"] == first.pid
        first.send_signal(signal.SIGTERM)
        out, _ = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 143, out[-3000:]
    assert not (workdir / ".lease.json").exists()
    stopped_at = int(re.search(r'"final_step": (\d+)', out)[1])
    resumed = train_here(*args, f"steps={stopped_at + 2}")
    assert resumed.returncode == 0 and "resumed from step" in resumed.stderr, resumed.stderr[-3000:]
    assert "taking over the lease" not in resumed.stderr
