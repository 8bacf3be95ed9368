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
        self._tb = _tensorboard(tensorboard_dir or storage.join(directory, "tensorboard"), start)

    def _kept_until(self, start: int) -> list[str]:
        """The records up to step `start` (the file rewritten without the later ones); on gs:// they are kept to
        rewrite the object with each new record."""
        text = storage.read_text(self.path)
        if text is None:
            return []
        lines = [line for line in text.splitlines() if line.strip()]
        records = _parsed(self.path, lines)
        kept = [line for line, record in zip(lines, records)
                if isinstance(record, dict) and record.get("step", 0) <= start]
        later = sum(isinstance(r, dict) and r.get("step", 0) > start for r in records)
        if later:
            log.info("%s: dropped %d record(s) after step %d (logged before the restart, repeated now)", self.path,
                     later, start)
        # (a last line without its newline, a write cut before it: the next record would be appended to it)
        if len(kept) < len(lines) or (text and not text.endswith("\n")):
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
    """The records of DIR/metrics.jsonl ([] when there is none); a line that is not a whole record (cut short) is
    left out, with a warning."""
    path = storage.join(directory, NAME)
    lines = [line for line in (storage.read_text(path) or "").splitlines() if line.strip()]
    return [r for r in _parsed(path, lines) if isinstance(r, dict)]


def _parsed(path: str, lines: list[str]) -> list:
    """Each line's record, or None for a line that is not one (warned of)."""
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except ValueError:  # a line cut short (a crash, a full disk, a lost host as it wrote): not a record
            records.append(None)
            log.warning("%s: line %d is not a whole JSON record (%r...): dropped; the run goes on", path, number,
                        line[:60])
    return records


def _tensorboard(directory: str, start: int):
    """A TensorBoard writer that first drops the events of steps after `start` (logged before a restart, repeated
    now; a stop's own row), as metrics.jsonl drops its records."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:  # optional: metrics.jsonl has everything
        log.warning("tensorboardX is not installed: no TensorBoard scalars (metrics.jsonl is still written)")
        return None
    return SummaryWriter(directory, purge_step=start + 1)
