"""SIGTERM in python -m trainer's own process: before the steps it unwinds the setup (Terminated), during them it is
the preemption notice's (a checkpoint, then a stop), after them it is logged while the run ends as it was ending."""

import logging
import os
import signal
import time

import pytest

from trainer import preemption


def _sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)  # (the handler runs in the main thread between two bytecodes)


def test_a_sigterm_unwinds_the_setup_once_then_is_the_notices_then_the_ends(caplog):
    kept = signal.getsignal(signal.SIGTERM)
    try:
        preemption.stop_on_sigterm_before_the_steps()
        with pytest.raises(preemption.Terminated):
            _sigterm()
        _sigterm()  # a second one while the setup unwinds: the same notice, not another raise
        preemption.stop_on_sigterm_before_the_steps()
        notice = preemption.PreemptionNotice()
        assert not notice.reached(1)
        _sigterm()
        assert notice.reached(2)
        notice.close()
        with caplog.at_level(logging.WARNING, logger="trainer.preemption"):
            _sigterm()  # after the steps: logged, the run ends as it was ending
        assert [r.getMessage() for r in caplog.records] == [
            "SIGTERM: the run is ending; it stops once its last checkpoint is written"]
    finally:
        signal.signal(signal.SIGTERM, kept)


def test_a_sigterm_during_the_compile_is_raised_once_it_returns():
    """A SIGTERM while XLA compiled the step raised Terminated inside C++'s callback into Python, and the process died
    of a segmentation fault (exit 139, not the 143 a scheduler requeues)."""
    kept = signal.getsignal(signal.SIGTERM)
    try:
        preemption.stop_on_sigterm_before_the_steps()
        went_on = []
        with pytest.raises(preemption.Terminated):
            with preemption.held_during():
                _sigterm()
                went_on.append("the compile returned")
        assert went_on == ["the compile returned"]
        _sigterm()  # the same notice: not raised again
        preemption.stop_on_sigterm_before_the_steps()
        with preemption.held_during():  # none came: nothing raised
            pass
    finally:
        signal.signal(signal.SIGTERM, kept)


def test_a_run_sent_sigterm_while_its_step_compiles_exits_143(digits, tmp_path):
    import subprocess
    import sys

    from tests.conftest import REPO

    log = tmp_path / "err.txt"
    env = {**os.environ, "PYTHONPATH": str(REPO), "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
           "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "trainer", f"data={digits['train']}", "model=mlp",
                                 "num_classes=10", "batch_size=32", "steps=100000", f"workdir={tmp_path / 'run'}"],
                                cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 120
        while "optimizer=" not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(0.5)  # the step compiles
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 143, log.read_text()[-3000:]
    finally:
        proc.kill()
    assert log.read_text().strip().splitlines()[-1].startswith("stopped by SIGTERM")


def test_a_sigterm_during_an_evaluation_leaves_it_off_and_saves_at_once(digits, tmp_path, monkeypatch):
    """The notice was read only after each training step: a SIGTERM early in an in-loop evaluation waited for all of
    it (44 s of a 265-batch one), past a preemption's ~30 s of grace. The evaluation now leaves off at its next batch,
    and the checkpoint is written."""
    import json

    from tests.trainer.conftest import train_here
    from trainer.program import Program

    step, calls = Program.eval_step, []

    def counted(self):
        inner = step.__get__(self)

        def eval_step(*args):
            calls.append(1)
            if len(calls) == 3:  # the third batch of the evaluation at step 4
                _sigterm()
            return inner(*args)
        return eval_step

    monkeypatch.setattr(Program, "eval_step", property(counted))
    proc = train_here(f"data={digits['train']}", f"eval_data={digits['test']}", f"workdir={tmp_path}", "model=mlp",
                      "num_classes=10", "batch_size=8", "steps=20", "log_every=4", "eval_every=4",
                      "checkpoint_every=100")
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert len(calls) == 3  # (of the evaluation's 45 batches)
    assert "SIGTERM during the evaluation at step 4: left off, the checkpoint first" in proc.stderr
    assert "SIGTERM: saved a checkpoint at step 4" in proc.stderr
    assert os.listdir(tmp_path / "checkpoints") == ["4"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4] and "eval_loss" not in rows[0]
