"""Console logging a person can read.

Beam's local runner forwards every worker-process log record as one line of proto text
(`severity: INFO timestamp {...} message: "..." log_location: "..."`) and logs its own
harness chatter at INFO. This shows our own messages, unwrapped, and Beam's warnings.
"""

from __future__ import annotations

import logging
import os
import re

_FORWARDED = re.compile(r'message: "(?P<msg>(?:[^"\\]|\\.)*)".*?log_location: "(?P<loc>[^"]*)"', re.S)
_OURS = ("/dataset_format/", "/pipelines/", "/loader/", "/trainer/")


class _WorkerRecords(logging.Filter):
    """Keeps forwarded worker records that come from our packages, as their plain message."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        match = _FORWARDED.search(text)
        if not match:
            return record.levelno >= logging.WARNING
        if not any(part in match["loc"] for part in _OURS) and record.levelno < logging.ERROR:
            return False
        record.name = "worker"
        record.msg = match["msg"].encode().decode("unicode_escape")
        record.args = ()
        return True


class _NotInterrupts(logging.Filter):
    """Drops Beam's ERROR record (and its traceback) of a DoFn stopped by Ctrl-C or SIGTERM: the command says in one
    line what was kept and how to go on."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (isinstance(error, KeyboardInterrupt) or record.getMessage().startswith("KeyboardInterrupt"))


def setup(level: str | None = None) -> None:
    """Our packages log at `level` (default $LOGLEVEL or INFO); everything else at WARNING."""
    level = level or os.environ.get("LOGLEVEL", "INFO")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", force=True)  # force: absl/JAX may have configured logging already
    for name in ("dataset_format", "pipelines", "loader", "trainer"):
        logging.getLogger(name).setLevel(level)
    common = logging.getLogger("apache_beam.runners.common")
    if not any(isinstance(f, _NotInterrupts) for f in common.filters):
        common.addFilter(_NotInterrupts())
    forwarded = logging.getLogger("apache_beam.runners.portability.local_job_service")
    forwarded.setLevel(level)
    forwarded.addFilter(_WorkerRecords())
