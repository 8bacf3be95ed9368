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
