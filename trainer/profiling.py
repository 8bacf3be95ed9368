"""A device profile of a few training steps (`profile_steps=`): XLA's own account of where a step's time goes, each
kernel and its time, for TensorBoard's profile plugin or XProf, as MaxText's `profiler=xplane` writes it.

The trace starts after `profile_skip` steps of this run (the first steps still autotune and fill the input pipeline's
buffers) and stops once the traced steps have finished on the devices, so it holds whole steps only.
"""

from __future__ import annotations

import logging

import jax

from dataset_format import storage

log = logging.getLogger(__name__)


class StepProfile:
    """Traces steps `first` .. `first + steps - 1` into WORKDIR/profile (nothing when steps is 0)."""

    def __init__(self, workdir: str, first: int, steps: int, chief: bool = True):
        self.directory = storage.absolute(storage.join(workdir, "profile"))
        self.first, self.last = first, first + steps - 1
        self.enabled = steps > 0 and chief
        self.tracing = False

    def before(self, step: int) -> None:
        """Called before step `step` is dispatched."""
        if self.enabled and step == self.first:
            jax.profiler.start_trace(self.directory)
            self.tracing = True

    def after(self, step: int, outputs) -> None:
        """Called once step `step` is dispatched, with what it returned: the trace stops when the last traced step
        has finished on the devices."""
        if self.tracing and step >= self.last:
            jax.block_until_ready(outputs)
            self.stop()
            log.info("profile of steps %d to %d written to %s (view it with TensorBoard's profile plugin or XProf: "
                     "tensorboard --logdir %s)", self.first, step, self.directory, self.directory)

    def stop(self) -> None:
        """Ends a trace still running (a run that stops before its last traced step)."""
        if self.tracing:
            self.tracing = False
            jax.profiler.stop_trace()
