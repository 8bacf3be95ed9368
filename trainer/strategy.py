"""Distribution strategies in the shape tf.distribute users know, built on `jax.sharding`.

    strategy = trainer.strategy.make("mirrored")           # all local devices, data parallel
    with strategy.scope():
        params = strategy.replicate(init_params)           # replicated on the mesh
        for batch in strategy.experimental_distribute_dataset(batches):   # global jax.Arrays
            params, loss = strategy.run(train_step, args=(params, batch))
            print(strategy.reduce("mean", loss))

Every strategy is a mesh plus two shardings: parameters (`P()`, replicated; or sharded on an
`fsdp` axis) and batches (`P(axis)`, split over the data axis). `run` is `jax.jit` with those
shardings; XLA inserts the all-reduce of the gradients (FIELD-NOTES: mirrored matches one device to ~1e-5).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

_current = threading.local()


@dataclasses.dataclass
class Strategy:
    """A mesh, the axis batches are split on, and how parameters are laid out."""

    name: str
    mesh: Mesh
    data_axis: str = "data"
    shard_params: bool = False  # fsdp: the largest divisible dimension of each parameter on the data axis

    @property
    def num_replicas_in_sync(self) -> int:
        return int(self.mesh.devices.size)

    @property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(self.data_axis))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def param_sharding(self, params: Any) -> Any:
        """The sharding of each parameter leaf (a pytree matching `params`)."""
        if not self.shard_params:
            return jax.tree.map(lambda _: self.replicated, params)
        n = self.num_replicas_in_sync

        def spec(leaf):
            shape = np.shape(leaf)
            dims = [d for d in np.argsort(shape)[::-1] if shape[d] % n == 0 and shape[d] >= n]
            if not dims:
                return self.replicated
            axes = [None] * len(shape)
            axes[dims[0]] = self.data_axis
            return NamedSharding(self.mesh, P(*axes))

        return jax.tree.map(spec, params)

    @contextlib.contextmanager
    def scope(self):
        """Makes this the strategy `get_strategy()` returns, like `tf.distribute.Strategy.scope()`."""
        previous = getattr(_current, "strategy", None)
        _current.strategy = self
        try:
            yield self
        finally:
            _current.strategy = previous

    def replicate(self, tree: Any) -> Any:
        """Places a pytree of host values (e.g. initial parameters) per `param_sharding`."""
        return jax.device_put(tree, self.param_sharding(tree))

    def distribute(self, batch: Any) -> Any:
        """This process's rows of a batch -> global jax.Arrays split over the data axis."""
        from loader.device import to_global_arrays

        return to_global_arrays(batch, self.batch_sharding)

    def experimental_distribute_dataset(self, batches: Iterable) -> Iterator:
        """Like tf's: each host batch becomes a global batch of jax.Arrays on the mesh."""
        for batch in batches:
            yield self.distribute(batch)

    def run(self, fn: Callable, args: tuple = (), *, donate_argnums: tuple = ()) -> Any:
        """Runs `fn(*args)` as one jit-compiled program over the mesh (compiled once per `fn`)."""
        compiled = _jit_cache.get(fn)
        if compiled is None:
            compiled = _jit_cache[fn] = jax.jit(fn, donate_argnums=donate_argnums)
        return compiled(*args)

    def reduce(self, op: str, value: Any) -> Any:
        """'sum' or 'mean' over the leading (per-example / per-replica) axis, like tf's reduce."""
        if op not in ("sum", "mean"):
            raise ValueError(f"reduce op={op!r} is not 'sum' or 'mean'")
        reducer = jax.numpy.sum if op == "sum" else jax.numpy.mean
        return jax.tree.map(lambda v: reducer(v, axis=0) if np.ndim(v) else v, value)


_jit_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # fn -> its jit, dropped with fn


def get_strategy() -> Strategy:
    """The strategy of the innermost `scope()`, else the default strategy (one device, nothing special)."""
    return getattr(_current, "strategy", None) or make("default")


def make(name: str, *, device: str | None = None) -> Strategy:
    """default | one_device | mirrored | fsdp | multi_worker (call `initialize_multi_worker` first) | tpu."""
    if name == "tpu":
        found = sorted({d.platform for d in jax.devices()})
        if found != ["tpu"]:
            raise ValueError(f"strategy='tpu' needs TPU devices, but found {jax.device_count()} device(s) of "
                             f"platform {', '.join(found)}; use strategy=mirrored here")
        return Strategy(name, _mesh(jax.devices()))  # every core of the slice (all hosts), data parallel
    if name == "multi_worker":
        if not jax.distributed.is_initialized():
            raise ValueError("strategy='multi_worker' needs jax.distributed: call "
                             "trainer.strategy.initialize_multi_worker() before using JAX")
        return Strategy(name, _mesh(jax.devices()))  # every device of every process, batch split over all
    devices = jax.devices()
    if name == "default":
        return Strategy(name, _mesh(devices[:1]))
    if name == "one_device":
        return Strategy(name, _mesh([_find_device(device, devices)]))
    if name in ("mirrored", "fsdp"):
        local = jax.local_devices()
        if jax.process_count() > 1:
            raise ValueError(f"strategy={name!r} is for one process, but {jax.process_count()} processes are "
                             "running; use strategy=multi_worker")
        return Strategy(name, _mesh(local), shard_params=(name == "fsdp"))
    raise ValueError(f"strategy={name!r} is not one of default, one_device, mirrored, fsdp")


def initialize_multi_worker(coordinator_address: str | None = None, num_processes: int | None = None,
                            process_id: int | None = None) -> None:
    """Starts jax.distributed: from explicit flags, else a tf.distribute TF_CONFIG, else JAX's auto-detection.

    TF_CONFIG (MultiWorkerMirroredStrategy's): {"cluster": {"worker": ["host0:port", ...]},
    "task": {"type": "worker", "index": i}}; worker 0's address becomes the coordinator.
    """
    if coordinator_address is None and os.environ.get("TF_CONFIG"):
        coordinator_address, num_processes, process_id = _from_tf_config(os.environ["TF_CONFIG"])
    if coordinator_address is not None and (num_processes is None or process_id is None):
        raise ValueError("multi_worker with coordinator_address needs num_processes and process_id too")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)


def _from_tf_config(text: str) -> tuple[str, int, int]:
    try:
        spec = json.loads(text)
        workers = spec["cluster"]["worker"]
        task = spec["task"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"TF_CONFIG is not a tf.distribute cluster spec ({e}): expected "
                         '{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": i}}') from e
    if task.get("type") not in ("worker", "chief"):
        raise ValueError(f"TF_CONFIG task type {task.get('type')!r} is not 'worker'; parameter servers are not "
                         "supported (use one process per worker)")
    if "chief" in spec["cluster"]:
        workers = list(spec["cluster"]["chief"]) + list(workers)
        index = 0 if task["type"] == "chief" else int(task["index"]) + 1
    else:
        index = int(task["index"])
    return workers[0], len(workers), index


def _find_device(spec: str | None, devices: list) -> Any:
    if spec is None:
        return devices[0]
    for d in devices:
        if spec in (str(d.id), f"{d.platform}:{d.id}", str(d)):
            return d
    raise ValueError(f"device={spec!r} not found; the devices are {[f'{d.platform}:{d.id}' for d in devices]}")


def _mesh(devices: list) -> Mesh:
    return Mesh(np.array(devices), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
