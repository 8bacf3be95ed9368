"""Placing batches on devices ahead of time.

JAX's transfers are asynchronous: `jax.make_array_from_process_local_data` returns at once and the
copy proceeds in the background. Keeping `depth` batches in flight (Flax's prefetch_to_device
pattern) means the step that needs batch k finds it already on its devices, while k+1.. copy.
Each process passes its own rows; the result is the global batch as one `jax.Array` per feature,
laid out by `sharding` (e.g. NamedSharding(mesh, P("data"))).
"""

from __future__ import annotations

import atexit
import weakref
from typing import Any


def to_global_arrays(batch: Any, sharding) -> Any:
    """This process's rows of a batch -> global jax.Arrays with `sharding` (one per leaf)."""
    import jax
    import numpy as np

    def put(leaf):
        if isinstance(leaf, list):
            raise TypeError("device placement needs arrays, and this batch holds a list (raw bytes or ragged "
                            "features); decode to fixed-shape arrays (decode= or map_fn=) or drop sharding=")
        return jax.make_array_from_process_local_data(sharding, np.asarray(leaf))

    if isinstance(batch, dict):
        lists = [k for k, v in batch.items() if isinstance(v, list)]
        if lists:
            arrays = [k for k in batch if k not in lists]
            raise TypeError(f"device placement needs arrays, and feature(s) {lists} hold lists (bytes, or values of "
                            f"varying length): leave them out with features={arrays}, or make them fixed-shape arrays "
                            "in map_fn=, or drop sharding=")

    return jax.tree.map(put, batch, is_leaf=lambda x: isinstance(x, list))


_LIVE: weakref.WeakSet = weakref.WeakSet()
_AT_EXIT = {"registered": False}


def _stop_all_at_exit() -> None:
    """Stops prefetch threads before the interpreter finalizes. A daemon thread still inside JAX's or
    ArrayRecord's C++ code when Python tears down is killed by a forced unwind, which aborts the whole
    process ("terminate called ... FATAL: exception not rethrown") after it has done its work."""
    for prefetcher in list(_LIVE):
        prefetcher.close()


class DevicePrefetcher:
    """Keeps `depth` batches placed on devices ahead of the consumer, from a background thread.

    Device placement then costs the training thread nothing: `get()` pops a batch that is
    already (being) copied. `next_host_batch` raises StopIteration at the end; errors reach the
    consumer on its next `get()`. Holds no reference to its owner, so `close()` from the owner's
    `__del__` stops the thread; at interpreter exit, live threads are stopped and joined.
    """

    def __init__(self, next_host_batch, sharding, depth: int):
        import queue
        import threading

        if not _AT_EXIT["registered"]:
            atexit.register(_stop_all_at_exit)
            _AT_EXIT["registered"] = True
        _LIVE.add(self)

        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._run, args=(next_host_batch, sharding), daemon=True,
                                        name="loader-device-prefetch")
        self._thread.start()

    def _run(self, next_host_batch, sharding) -> None:
        try:
            while not self._stop.is_set():
                self._put(("batch", to_global_arrays(next_host_batch(), sharding)))
        except StopIteration:
            self._put(("end", None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            self._put(("error", e))

    def _put(self, item) -> None:
        import queue

        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def get(self):
        if self._done:
            raise StopIteration
        kind, value = self._queue.get()
        if kind == "batch":
            return value
        self._done = True
        if kind == "end":
            raise StopIteration
        raise value

    def close(self) -> None:
        """Stops the thread after its current batch and waits (up to 5 s) for it to end."""
        self._stop.set()
        self._thread.join(timeout=5)
