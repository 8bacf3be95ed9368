"""Preemption notices (SIGTERM), and Ctrl-C: save a checkpoint and stop, at the same step on every process.

One process: a SIGTERM handler sets a flag that the loop reads after each step; so does a first Ctrl-C (SIGINT) on
the main thread, which then gives SIGINT back to Python: a second Ctrl-C stops at once, without a checkpoint. With
several processes a first Ctrl-C sends this process a SIGTERM, the notice below.
Several processes (`jax.distributed`): a scheduler may signal one host only, and a process that stops on
its own would leave the others waiting in the next collective. JAX's preemption service (on by default
with `jax.distributed`) catches SIGTERM in any process, tells the others through the coordination
service, and agrees on a step that all of them reach; `multihost_utils.reached_preemption_sync_point`,
called by every process at every step, is True there on all of them.

Before the steps (`python -m trainer`'s own process, from its start: reading the data's manifests, restoring a
checkpoint, initialising and compiling, or the sidecar evaluator's whole run): a SIGTERM raises `Terminated` in the
main thread, which unwinds the setup as a Ctrl-C does (the loader's workers, the lease, Ray) and ends the run with a
line saying so (its default action ended the process without a word and left the workdir's lease to lapse). After
the last step a SIGTERM is logged and the run ends as it was ending, its last checkpoint written.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator

log = logging.getLogger(__name__)


class Terminated(BaseException):
    """A SIGTERM before the training steps began (a BaseException, as KeyboardInterrupt: no `except Exception` of
    the setup's takes it for a failure of its own)."""


class _UntilTheSteps:
    """The SIGTERM handler of python -m trainer's process until PreemptionNotice takes over (see the module doc)."""

    def __init__(self):
        self.state = "setup"  # -> "stopping" (Terminated raised), or "steps" (PreemptionNotice took over)
        self.holding = False  # in C++ that calls back into Python (held_during): the notice waits for it to return
        self.held = False  # a notice came meanwhile

    def __call__(self, *_) -> None:
        if self.state == "setup" and self.holding:
            self.held = True
            return
        if self.state == "setup":
            self.state = "stopping"  # a second SIGTERM while the setup unwinds is the same notice
            raise Terminated()
        if self.state == "steps":  # restored by PreemptionNotice.close(): the run is ending
            log.warning("SIGTERM: the run is ending; it stops once its last checkpoint is written")


@contextlib.contextmanager
def held_during() -> Iterator[None]:
    """Around C++ code that calls back into Python (XLA's compile, its logging and cache lookups): a SIGTERM there
    raised Terminated inside the callback, and the process died of a segmentation fault (exit 139, not 143: a
    scheduler's requeue-on-143 did not restart it). The notice is raised once that code returns."""
    handler = signal.getsignal(signal.SIGTERM)
    if not isinstance(handler, _UntilTheSteps) or handler.state != "setup" or handler.holding:
        yield
        return
    handler.holding = True
    try:
        yield
    finally:
        handler.holding = False
    if handler.held:
        handler.held = False
        handler("held")


def stop_on_sigterm_before_the_steps() -> None:
    """From the start of python -m trainer's own process (main thread only): a SIGTERM before the steps raises
    Terminated."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _UntilTheSteps())


class PreemptionNotice:
    """`reached(step)` after each step: True when the run must save and stop now. `close()` at the end."""

    def __init__(self):
        import jax

        # Several processes: jax.distributed is up (the trainer initialises it for multi_worker), and with it the
        # preemption service (jax_enable_preemption_service, on by default).
        self._multi = jax.process_count() > 1
        self._flag = False
        self.reason = "SIGTERM"  # what asked the run to stop, for its last line
        self._previous = self._previous_int = None
        if not self._multi:
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        handler = self._previous if not self._multi else signal.getsignal(signal.SIGTERM)
        if isinstance(handler, _UntilTheSteps):  # the steps begin: a SIGTERM after them is this notice's, or the
            handler.state = "steps"  # end's (several processes: JAX's service holds SIGTERM from initialize on)
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous_int = signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigterm(self, *_) -> None:
        self._flag = True

    def _on_sigint(self, *_) -> None:
        self._flag, self.reason = True, "Ctrl-C"
        signal.signal(signal.SIGINT, self._previous_int)  # a second Ctrl-C: KeyboardInterrupt, at once
        self._previous_int = None
        if self._multi:  # the preemption service's own notice: every process saves at one agreed step
            os.kill(os.getpid(), signal.SIGTERM)
        log.warning("Ctrl-C: saving a checkpoint after this step, then stopping (Ctrl-C again stops at once, "
                    "without one)")

    def reached(self, step: int) -> bool:
        if self._multi:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self._flag

    def requested(self) -> bool:
        """Whether this process has been asked to stop, between steps (an evaluation leaves off for it). Several
        processes: False (they stop at one agreed step, and evaluate together until then)."""
        return not self._multi and self._flag

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
        if self._previous_int is not None:
            signal.signal(signal.SIGINT, self._previous_int)
            self._previous_int = None
