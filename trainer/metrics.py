"""Where a run's numbers go: DIR/metrics.jsonl (one JSON record per line), TensorBoard (DIR/tensorboard when
tensorboardX is installed) and nothing else. The training loops write WORKDIR, the evaluator WORKDIR/eval."""

from __future__ import annotations

import json
import logging
import math
import os

log = logging.getLogger(__name__)


class MetricsWriter:
    """Appends records `{"step": n, ...}`; reopened after a restart at step `start`, it first drops the records
    of later steps (logged before the restart, repeated now)."""

    def __init__(self, directory: str, start: int = 0, *, tensorboard_dir: str | None = None):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, "metrics.jsonl")
        self._truncate_after(start)
        self._file = open(self.path, "a")
        self._tb = _tensorboard(tensorboard_dir or os.path.join(directory, "tensorboard"))

    def _truncate_after(self, start: int) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            lines = f.read().splitlines()
        kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= start]
        if len(kept) < len(lines):
            log.info("%s: dropped %d record(s) after step %d (logged before the restart, repeated now)", self.path,
                     len(lines) - len(kept), start)
            with open(self.path + ".tmp", "w") as f:
                f.writelines(line + "\n" for line in kept)
            os.replace(self.path + ".tmp", self.path)

    def write(self, record: dict) -> None:
        self._file.write(json.dumps({k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                                     for k, v in record.items()}) + "\n")
        self._file.flush()
        if self._tb:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])
            self._tb.flush()

    def close(self) -> None:
        self._file.close()
        if self._tb:
            self._tb.close()


def read(directory: str) -> list[dict]:
    """The records of DIR/metrics.jsonl ([] when there is none)."""
    path = os.path.join(directory, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _tensorboard(directory: str):
    try:
        from tensorboardX import SummaryWriter
    except ImportError:  # optional: metrics.jsonl has everything
        log.warning("tensorboardX is not installed: no TensorBoard scalars (metrics.jsonl is still written)")
        return None
    return SummaryWriter(directory)
