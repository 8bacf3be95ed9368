"""Distribution strategies in the shape tf.distribute users know, built on `jax.sharding`.

    strategy = trainer.strategy.make("mirrored")           # all local devices, data parallel
    with strategy.scope():
        params = strategy.replicate(init_params)           # replicated on the mesh
        for batch in strategy.experimental_distribute_dataset(batches):   # global jax.Arrays
            params, loss = strategy.run(train_step, args=(params, batch))
            print(strategy.reduce("mean", loss))

Every strategy is a mesh plus two shardings: parameters (`P()`, replicated; or sharded on an
`fsdp` axis) and batches (`P(axis)`, split over the data axis). `run` is `jax.jit` with those
shardings; XLA inserts the all-reduce of the gradients (mirrored matches one device to ~1e-5 over 20 steps:
tests/trainer/test_train.py).
central_storage is mirrored with the parameters (and optimizer state) kept in host memory (`pinned_host`):
the step brings them to the devices (`on_devices`), all-reduces the gradients there, updates, and its
out_shardings put the new state back in host memory, as tf's CentralStorageStrategy keeps variables on the CPU.
The asynchronous parameter_server strategy is not a mesh: see trainer/parameter_server.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
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
    param_memory_kind: str | None = None  # central_storage: "pinned_host" (None: the devices' default memory)

    @property
    def num_replicas_in_sync(self) -> int:
        return int(self.mesh.devices.size)

    @property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(self.data_axis))

    @property
    def replicated(self) -> NamedSharding:
        """Replicated on the devices (step outputs such as the loss, evaluation inputs)."""
        return NamedSharding(self.mesh, P())

    def param_sharding(self, params: Any) -> Any:
        """Where each parameter leaf lives (a pytree matching `params`); in host memory for central_storage."""
        if self.param_memory_kind:
            host = NamedSharding(self.mesh, P(), memory_kind=self.param_memory_kind)
            return jax.tree.map(lambda _: host, params)
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

    def on_devices(self, tree: Any) -> Any:
        """The parameters where the computation runs: for central_storage a copy from host memory to the devices
        (inside a jitted step, XLA's transfer; outside, a device_put); the tree itself for the others."""
        if not self.param_memory_kind:
            return tree
        return jax.device_put(tree, jax.tree.map(lambda _: self.replicated, tree))

    def distribute(self, batch: Any) -> Any:
        """This process's rows of a batch -> global jax.Arrays split over the data axis."""
        from loader.executors.device import to_global_arrays

        return to_global_arrays(batch, self.batch_sharding)

    def experimental_distribute_dataset(self, batches: Iterable) -> Iterator:
        """Like tf's: each host batch becomes a global batch of jax.Arrays on the mesh."""
        for batch in batches:
            yield self.distribute(batch)

    def distribute_datasets_from_function(self, dataset_fn: Callable[[InputContext], Iterable]) -> Iterator:
        """Like tf's: `dataset_fn(input_context)` is called once in each process and returns that process's
        batches (its share of the rows: `input_context.get_per_replica_batch_size(global_batch)` per replica);
        each becomes a global batch of jax.Arrays on the mesh."""
        context = InputContext(num_input_pipelines=jax.process_count(), input_pipeline_id=jax.process_index(),
                               num_replicas_in_sync=self.num_replicas_in_sync)
        return self.experimental_distribute_dataset(dataset_fn(context))

    def experimental_local_results(self, value: Any) -> tuple:
        """The values this process's replicas hold, one per local device in mesh order (tf's per-replica
        results): a replicated array gives n copies, a batch-split one its n slices. Pytrees map leafwise."""
        devices = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]

        def pieces(leaf):
            if not isinstance(leaf, jax.Array):
                return [leaf] * len(devices)
            by_device = {s.device: s.data for s in leaf.addressable_shards}
            return [by_device[d] for d in devices]

        leaves, treedef = jax.tree.flatten(value)
        per_leaf = [pieces(leaf) for leaf in leaves]
        return tuple(jax.tree.unflatten(treedef, [p[i] for p in per_leaf]) for i in range(len(devices)))

    def run(self, fn: Callable, args: tuple = (), *, donate_argnums: tuple = ()) -> Any:
        """Runs `fn(*args)` as one jit-compiled program over the mesh (compiled once per `fn`). central_storage:
        arguments in host memory are brought to the devices first; put updated parameters back with
        `replicate` (`python -m trainer` does it in the step's out_shardings)."""
        compiled = _jit_cache.get(fn)
        if compiled is None:
            compiled = _jit_cache[fn] = jax.jit(fn, donate_argnums=donate_argnums)
        if self.param_memory_kind:
            args = jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind("device"))
                                if isinstance(x, jax.Array) and x.sharding.memory_kind == self.param_memory_kind
                                else x, args)
        return compiled(*args)

    def reduce(self, op: str, value: Any) -> Any:
        """'sum' or 'mean' over the leading (per-example / per-replica) axis, like tf's reduce."""
        if op not in ("sum", "mean"):
            raise ValueError(f"reduce op={op!r} is not 'sum' or 'mean'")
        reducer = jax.numpy.sum if op == "sum" else jax.numpy.mean
        return jax.tree.map(lambda v: reducer(v, axis=0) if np.ndim(v) else v, value)


_jit_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # fn -> its jit, dropped with fn


@dataclasses.dataclass(frozen=True)
class InputContext:
    """What `distribute_datasets_from_function` tells each process's dataset_fn (tf.distribute.InputContext)."""

    num_input_pipelines: int = 1  # processes reading input
    input_pipeline_id: int = 0  # this process's index among them
    num_replicas_in_sync: int = 1

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(f"global batch size {global_batch_size} does not split over num_replicas_in_sync="
                             f"{self.num_replicas_in_sync}; use a multiple of {self.num_replicas_in_sync}")
        return global_batch_size // self.num_replicas_in_sync


def get_strategy() -> Strategy:
    """The strategy of the innermost `scope()`, else the default strategy (one device, nothing special)."""
    return getattr(_current, "strategy", None) or make("default")


def make(name: str, *, device: str | None = None) -> Strategy:
    """default | one_device | mirrored | central_storage | fsdp | multi_worker (call `initialize_multi_worker`
    first) | tpu. (parameter_server runs on Ray actors, not a mesh: trainer/parameter_server.py.)"""
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
    if name in ("mirrored", "fsdp", "central_storage"):
        local = jax.local_devices()
        if jax.process_count() > 1:
            raise ValueError(f"strategy={name!r} is for one process, but {jax.process_count()} processes are "
                             "running; use strategy=multi_worker")
        if name == "central_storage":
            kinds = {m.kind for m in local[0].addressable_memories()}
            if "pinned_host" not in kinds:
                raise ValueError(f"strategy='central_storage' keeps parameters in host memory (pinned_host), which "
                                 f"the {local[0].platform} backend does not offer (its memories: {sorted(kinds)}); "
                                 "use strategy=mirrored")
            return Strategy(name, _mesh(local), param_memory_kind="pinned_host")
        return Strategy(name, _mesh(local), shard_params=(name == "fsdp"))
    if name == "parameter_server":
        raise ValueError("strategy='parameter_server' trains on Ray actors, not a device mesh: run it with "
                         "`python -m trainer strategy=parameter_server` (trainer/parameter_server.py)")
    raise ValueError(f"strategy={name!r} is not one of default, one_device, mirrored, central_storage, fsdp, "
                     "multi_worker, tpu")


JOIN_TIMEOUT_S = 300.0  # jax.distributed's default: how long a process waits for the others to join
JOIN_PROGRESS_S = 30.0  # how often a waiting process says it still waits


def initialize_multi_worker(coordinator_address: str | None = None, num_processes: int | None = None,
                            process_id: int | None = None, join_timeout: float = JOIN_TIMEOUT_S) -> None:
    """Starts jax.distributed: from explicit flags, else a tf.distribute TF_CONFIG, else JAX's auto-detection.

    TF_CONFIG (MultiWorkerMirroredStrategy's): {"cluster": {"chief": [...], "worker": ["host0:port", ...]},
    "task": {"type": "worker", "index": i}}; the chief and the workers are the processes, chief first, and the
    first one's address is the coordinator (trainer/cluster.py).
    """
    from trainer import cluster

    spec = cluster.from_env() if coordinator_address is None else None
    if coordinator_address is not None and os.environ.get("TF_CONFIG", "").strip():
        logging.getLogger(__name__).warning("coordinator_address=%s given: the job is the one it names, and TF_CONFIG "
                                            "is not read", coordinator_address)
    if spec is not None:
        coordinator_address, num_processes, process_id = spec.multi_worker()
    if coordinator_address is not None and (num_processes is None or process_id is None):
        raise ValueError("multi_worker with coordinator_address needs num_processes and process_id too")
    if coordinator_address is not None:
        logging.getLogger(__name__).info(
            "joining a job of %d processes as process %d, coordinator %s: each waits up to %.0f s for all of them to "
            "join (started with the same coordinator_address and num_processes, and process_id 0 to %d, once each)",
            num_processes, process_id, coordinator_address, join_timeout, num_processes - 1)
    try:
        join(join_timeout, coordinator_address=coordinator_address, num_processes=num_processes,
             process_id=process_id)
    except ValueError as e:
        if coordinator_address is not None or "coordinator_address" not in str(e):
            raise
        raise ValueError("strategy=multi_worker found no cluster to join: pass coordinator_address=HOST:PORT (process "
                         "0's) num_processes=N process_id=I to every process, or set TF_CONFIG, or launch on a cluster "
                         "JAX finds by itself (TPU VMs, Slurm, GKE, ...); on one host use strategy=mirrored") from None


def join(timeout: float, **cluster) -> None:
    """jax.distributed.initialize(**cluster), saying every JOIN_PROGRESS_S seconds that it still waits for the job's
    other processes. A job that has not formed after `timeout` seconds ends this process (exit 1) with a last line
    saying why: JAX's own timeout, given a little more, aborts it with a C++ stack and no cause. A SIGTERM or Ctrl-C
    meanwhile ends it at once (143, 130): the main thread waits in C++, where no Python handler runs, so the watching
    thread reads them from the signal module's wakeup file descriptor (written by whichever thread takes them)."""
    import select
    import signal
    import sys
    import time

    joined = threading.Event()
    begun = time.monotonic()
    log = logging.getLogger(__name__)
    stops = {int(signal.SIGTERM): ("stopped by SIGTERM", 143), int(signal.SIGINT): ("interrupted", 130)}
    woken, wake = os.pipe()
    os.set_blocking(wake, False)
    kept = signal.set_wakeup_fd(wake) if threading.current_thread() is threading.main_thread() else None

    def end(line: str, code: int) -> None:
        logging.shutdown()
        print(line, file=sys.stderr, flush=True)
        os._exit(code)

    def watch():
        try:
            waiting()
        finally:
            os.close(woken)

    def waiting():
        said = begun
        while not joined.is_set():
            left = begun + timeout - time.monotonic()
            if left <= 0:
                end(f"error: the job's processes did not all join within {timeout:.0f} s (join_timeout=): one was not "
                    "started, cannot reach process 0's coordinator_address, or has another coordinator_address or "
                    "num_processes; start every process, process_id 0 to num_processes - 1 once each, with the same "
                    "coordinator_address and num_processes", 1)
            if select.select([woken], [], [], min(0.5, left))[0] and not joined.is_set():
                for number in os.read(woken, 64):
                    if number in stops:
                        what, code = stops[number]
                        end(f"{what} while joining the job, before anything ran (nothing saved; the same command "
                            "starts it again)", code)
            if time.monotonic() - said >= JOIN_PROGRESS_S and not joined.is_set():
                said = time.monotonic()
                log.info("still waiting for the job's other processes to join (%.0f s of %.0f)", said - begun, timeout)

    threading.Thread(target=watch, daemon=True, name="join-watch").start()
    try:
        jax.distributed.initialize(**cluster, initialization_timeout=int(timeout) + 60)
    finally:
        joined.set()
        if kept is not None:
            signal.set_wakeup_fd(kept)
        os.close(wake)  # (the watching thread ends within 0.5 s; its end of the pipe with it)


def _find_device(spec: str | None, devices: list) -> Any:
    if spec is None:
        return devices[0]
    for d in devices:
        if spec in (str(d.id), f"{d.platform}:{d.id}", str(d)):
            return d
    raise ValueError(f"device={spec!r} not found; the devices are {[f'{d.platform}:{d.id}' for d in devices]}")


def _mesh(devices: list) -> Mesh:
    return Mesh(np.array(devices), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
