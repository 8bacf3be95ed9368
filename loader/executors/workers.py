"""Worker processes that never outlive their owner: the watchdog every worker runs (the loader's worker processes,
loader/executors/processes.py)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

# A worker process checks this often (seconds) whether the process that started it is still alive.
OWNER_POLL_SECONDS = 0.5


def exit_with_owner(owner: int, before_exit: Callable[[], None] | None = None) -> None:
    """Run in each worker process as it starts: a daemon thread ends the worker when `owner` (the process that made the
    loader) is gone, even when it died without cleaning up (SIGKILL, the OOM killer), so orphaned workers never hold
    memory (and their share of the host's index and page cache) past their owner. The worker's parent changes when its
    owner dies (it is re-parented to init or a subreaper). `before_exit` runs first, e.g. to remove files only the
    owner would have removed."""

    def watch():
        while os.getppid() == owner:
            time.sleep(OWNER_POLL_SECONDS)
        if before_exit is not None:
            try:
                before_exit()
            finally:
                os._exit(1)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-owner", daemon=True).start()
