"""Where a run's numbers go: DIR/metrics.jsonl (one JSON record per line), TensorBoard (DIR/tensorboard when
tensorboardX is installed) and nothing else. The training loops write WORKDIR, the evaluator WORKDIR/eval. DIR may
be gs://: Cloud Storage has no appends, so there the file is rewritten whole at each record (one small object write
a `log_every`; readers see every record up to the last, never a torn line)."""

from __future__ import annotations

import json
import logging
import math
import os

from dataset_format import storage

log = logging.getLogger(__name__)

NAME = "metrics.jsonl"


class MetricsWriter:
    """Appends records `{"step": n, ...}`; reopened after a restart at step `start`, it first drops the records
    of later steps (logged before the restart, repeated now)."""

    def __init__(self, directory: str, start: int = 0, *, tensorboard_dir: str | None = None):
        storage.makedirs(directory)
        self.path = storage.join(directory, NAME)
        self._remote = storage.is_remote(self.path)
        self._lines = self._kept_until(start)
        self._file = None if self._remote else open(self.path, "a")
        self._tb = _tensorboard(tensorboard_dir or storage.join(directory, "tensorboard"))

    def _kept_until(self, start: int) -> list[str]:
        """The records up to step `start` (the file rewritten without the later ones); on gs:// they are kept to
        rewrite the object with each new record."""
        text = storage.read_text(self.path)
        if text is None:
            return []
        lines = [line for line in text.splitlines() if line.strip()]
        kept, torn = [], 0
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except ValueError:  # a line cut short (a crash, a full disk, a lost host as it wrote): not a record
                torn += 1
                log.warning("%s: line %d is not a whole JSON record (%r...): dropped; the run goes on", self.path,
                            number, line[:60])
                continue
            if isinstance(record, dict) and record.get("step", 0) <= start:
                kept.append(line)
        if len(kept) < len(lines):
            log.info("%s: dropped %d record(s) after step %d (logged before the restart, repeated now)", self.path,
                     len(lines) - len(kept) - torn, start)
            if self._remote:
                storage.write_text(self.path, "".join(line + "\n" for line in kept))
            else:
                with open(self.path + ".tmp", "w") as f:
                    f.writelines(line + "\n" for line in kept)
                os.replace(self.path + ".tmp", self.path)
        return kept if self._remote else []

    def write(self, record: dict) -> None:
        line = json.dumps({k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in record.items()})
        if self._remote:
            self._lines.append(line)
            storage.write_text(self.path, "".join(x + "\n" for x in self._lines))
        else:
            self._file.write(line + "\n")
            self._file.flush()
        if self._tb:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])
            self._tb.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb:
            self._tb.close()


def read(directory: str) -> list[dict]:
    """The records of DIR/metrics.jsonl ([] when there is none)."""
    text = storage.read_text(storage.join(directory, NAME))
    return [json.loads(line) for line in (text or "").splitlines() if line.strip()]


def _tensorboard(directory: str):
    try:
        from tensorboardX import SummaryWriter
    except ImportError:  # optional: metrics.jsonl has everything
        log.warning("tensorboardX is not installed: no TensorBoard scalars (metrics.jsonl is still written)")
        return None
    return SummaryWriter(directory)
