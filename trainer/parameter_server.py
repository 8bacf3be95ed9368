"""strategy=parameter_server: asynchronous data-parallel training on Ray, tf's ParameterServerStrategy with its
ClusterCoordinator.

    python -m trainer strategy=parameter_server num_workers=2 num_ps=1 data=... eval_data=... workdir=...

- `num_ps` ParameterServer actors hold the variables, split by `partition` (tf's MinSizePartitioner: a variable
  of at least 2 x ps_min_shard_bytes is cut along its first axis into up to num_ps shards of at least that size;
  shards and whole variables are placed round-robin). Each applies the optax update to its part as gradients
  arrive (one at a time: an actor runs its calls in order) and counts its updates (its version).
- `num_workers` Worker actors each read their own deterministic shard of the data (`loader.load(...,
  shard_index=i, shard_count=num_workers)`, `batch_size` rows per step) and run one jitted gradient step per
  scheduled step: pull the parameters from every ps, compute the gradient (clipped to grad_clip), push each ps its
  part. Staleness, the updates other workers applied between a worker's pull and its push, goes to metrics.jsonl.
- The coordinator (this process) schedules steps with ClusterCoordinator's semantics: `schedule` queues a step,
  an idle worker takes it, `join` waits for everything queued. At-least-once: a step whose worker died is queued
  again and runs on another worker; the dead worker is replaced, resuming its loader from its last finished step.
  At each checkpoint (and eval) step it joins, then saves with orbax: the parameters (whole, as the synchronous
  trainer saves them, so the evaluator and `StandardRestore` read them the same way), each ps's optimizer state
  and each worker's loader state. A rerun resumes from the latest checkpoint (same num_ps and num_workers).

The Ray cluster: a local one (ray.init on this machine, `num_workers` + `num_ps` actors), an existing one
(`ray_address=`), or one built from TF_CONFIG: the chief starts the head at its own address and coordinates; each
worker and ps task joins it as a node offering a "worker" or "ps" resource (`serve_node`), so the actors land on
their tasks' machines. Token authentication stays on (RAY_AUTH_MODE=token): every task needs the same token
(RAY_AUTH_TOKEN, or the file RAY_AUTH_TOKEN_PATH; `ray get-auth-token --generate` makes one). Ports: the head's
GCS port (the chief's TF_CONFIG port), and on every node Ray's node-manager, object-manager and worker ports
(docs/parameter_server.md lists them; RAY_START_ARGS passes the `ray start` flags that pin them).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from loader.executors import ray_actors
from trainer.config import TrainConfig

log = logging.getLogger(__name__)


# --- the partitioner ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Shard:
    """Rows [start, stop) of variable `name` (its first axis; a scalar is one whole shard), held by ps `ps`."""

    name: str
    ps: int
    start: int
    stop: int
    shape: tuple[int, ...]  # the shard's own shape


def partition(shapes: dict[str, tuple[tuple[int, ...], Any]], num_ps: int, min_shard_bytes: int) -> list[Shard]:
    """tf.distribute's MinSizePartitioner, then round-robin placement: {name: (shape, dtype)} -> the shards.

    A variable of B bytes is cut along its first axis into min(num_ps, B // min_shard_bytes, rows) shards (at
    least 1), as even as np.array_split makes them; every shard (a whole variable is one) goes to the next ps in
    turn, so large variables are spread over the ps tasks and small ones dealt out among them."""
    shards, turn = [], 0
    for name, (shape, dtype) in shapes.items():
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        rows = shape[0] if shape else 1
        count = max(1, min(num_ps, nbytes // min_shard_bytes, rows)) if shape else 1
        bounds = np.cumsum([0] + [len(a) for a in np.array_split(np.arange(rows), count)])
        for start, stop in zip(bounds[:-1], bounds[1:]):
            piece = (int(stop - start), *shape[1:]) if shape else ()
            shards.append(Shard(name, turn % num_ps, int(start), int(stop), piece))
            turn += 1
    return shards


def _flat(tree) -> dict[str, Any]:
    """{"['Dense_0']['kernel']": leaf, ...}: the variables by their path, in tree order (works inside jit too)."""
    import jax

    return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def split(flat: dict[str, np.ndarray], shards: list[Shard], num_ps: int) -> list[dict[str, np.ndarray]]:
    """A flat tree of whole variables -> each ps's part ({"name[start:stop]": rows})."""
    parts: list[dict] = [{} for _ in range(num_ps)]
    for s in shards:
        value = flat[s.name]
        parts[s.ps][_key(s)] = value[s.start:s.stop] if value.ndim else value
    return parts


def assemble(parts: list[dict[str, np.ndarray]], shards: list[Shard]) -> dict[str, np.ndarray]:
    """Each ps's part -> the flat tree of whole variables (`split`'s inverse)."""
    pieces = collections.defaultdict(list)
    for s in shards:
        pieces[s.name].append(parts[s.ps][_key(s)])
    return {name: (np.concatenate(p) if p[0].ndim else p[0]) for name, p in pieces.items()}


def _key(s: Shard) -> str:
    return f"{s.name}[{s.start}:{s.stop}]"


def _ps_optimizer(config: TrainConfig):
    """The optimizer a ps applies to its part: the config's, without clipping (a worker clips the whole gradient
    before splitting it; a global norm cannot be computed from one part)."""
    from trainer import optim

    if config.optimizer == "adafactor":
        raise ValueError("strategy=parameter_server updates each ps's part of a variable on its own, and adafactor's "
                         "factored moments span whole variables; use optimizer=adam, adamw or sgd")
    return optim.make(dataclasses.replace(config, grad_clip=0.0))


# --- the actors (plain classes; ray.remote wraps them where the cluster is known) ------------------------------
class ParameterServer:
    """One ps task: its part of the variables, their optimizer state, and its version (updates applied)."""

    def __init__(self, config: TrainConfig, index: int):
        import jax

        self.index = index
        self._tx = _ps_optimizer(config)
        self._update = jax.jit(self._apply)
        self.values: dict[str, np.ndarray] = {}
        self.opt_state = None
        self.version = 0

    def pid(self) -> int:
        return os.getpid()

    def _apply(self, values, opt_state, grads):
        import optax

        updates, opt_state = self._tx.update(grads, opt_state, values)
        return optax.apply_updates(values, updates), opt_state

    def load(self, values: dict, opt_state=None, version: int = 0) -> int:
        import jax

        self.values = {k: np.asarray(v) for k, v in values.items()}
        self.opt_state = self._tx.init(self.values) if opt_state is None else jax.tree.map(np.asarray, opt_state)
        self.version = version
        return os.getpid()

    def pull(self) -> tuple[int, dict]:
        return self.version, self.values

    def push(self, grads: dict, pulled_version: int) -> int:
        """Applies one worker's gradient; returns its staleness (updates applied since that worker pulled)."""
        import jax

        staleness = self.version - pulled_version
        values, opt_state = self._update(self.values, self.opt_state, grads)
        self.values, self.opt_state = jax.tree.map(np.asarray, (values, opt_state))
        self.version += 1
        return staleness

    def state(self) -> tuple[dict, Any, int]:
        return self.values, self.opt_state, self.version


class ParameterServerLost(RuntimeError):
    """A ps died: the updates it applied since the last checkpoint died with it."""


def _from_servers(refs: list) -> list:
    """The results of one call to each ps, in ps order; a dead ps is ParameterServerLost naming it."""
    import ray

    results = []
    for i, ref in enumerate(refs):
        try:
            results.append(ray.get(ref))
        except ray_actors.deaths(ray) as e:
            pid = re.search(r"\bpid: (\d+)", str(e))
            raise ParameterServerLost(f"ps {i}{f' (pid {pid[1]})' if pid else ''} died ({type(e).__name__})") from None
    return results


class Worker:
    """One worker task: its loader shard and a jitted gradient step against the parameters it pulls."""

    def __init__(self, config: TrainConfig, index: int, servers: list, shards: list[Shard],
                 loader_state: dict | None = None):
        import jax
        import optax

        from dataset_format import logs
        from trainer.program import Program

        logs.setup()
        self.index, self.servers, self.shards = index, servers, shards
        program = Program.build(config)
        self._treedef = jax.tree.structure(program.abstract_params())
        n = config.num_workers
        self._batches = iter(program.load_train(batch_size=config.batch_size * n, shard_index=index, shard_count=n))
        if loader_state is not None:
            self._batches.set_state(loader_state)
        self._task, self._checked = program.task, False
        clip = optax.clip_by_global_norm(config.grad_clip) if config.grad_clip else None

        def gradients(flat, batch, step):
            params = jax.tree.unflatten(self._treedef, [flat[k] for k in self._names])
            loss, grads, _ = program.gradients(params, batch, rng=program.step_rng(step, index))
            if clip is not None:
                grads, _ = clip.update(grads, clip.init(grads))
            return loss, _flat(grads)

        self._names = [s.name for s in shards if s.start == 0]  # variables in tree order
        self._gradients = jax.jit(gradients)

    def pid(self) -> int:
        return os.getpid()

    def step(self, step_id: int) -> dict:
        import ray

        pulled = _from_servers([ps.pull.remote() for ps in self.servers])
        versions = [v for v, _ in pulled]
        flat = assemble([values for _, values in pulled], self.shards)
        batch = next(self._batches)
        if not self._checked:  # data the task cannot train on: one line before its first step, not a silent run
            from trainer import tasks

            tasks.check(self._task, batch)
            self._checked = True
        loss, grads = self._gradients(flat, batch, step_id)
        parts = split({k: np.asarray(v) for k, v in grads.items()}, self.shards, len(self.servers))
        staleness = _from_servers([ps.push.remote(part, v) for ps, part, v in zip(self.servers, parts, versions)])
        return {"step": step_id, "worker": self.index, "loss": float(loss), "staleness": max(staleness),
                "loader": self._batches.get_state()}

    def close(self) -> None:
        self._batches.close()


# --- the coordinator ------------------------------------------------------------------------------------------
MAX_CONSECUTIVE_FAILURES = 3  # a worker that dies this often without finishing a step stops the run
STALL_SECONDS = 60  # a wait this long for a worker the cluster has not placed is logged


class Coordinator:
    """ClusterCoordinator's scheduling: `schedule(step)` queues a step, idle workers take queued steps in order,
    `results()` waits for the next finished ones, `join()` yields them until all are done. A step whose worker died
    is queued again (at-least-once) and the worker is replaced by `make_worker(index, loader_state)`, from the loader
    state of its last finished step. A replacement takes steps once the cluster has placed it (its pid answers):
    one whose node is lost may never be placed (TF_CONFIG's nodes offer one "worker" each), and the placed workers
    run the steps meanwhile; a wait for unplaced workers is logged, not silent."""

    def __init__(self, make_worker, loader_states: list[dict | None]):
        self._make_worker = make_worker
        self.loader_states = list(loader_states)
        self.workers = [make_worker(i, state) for i, state in enumerate(self.loader_states)]
        self.replaced = 0
        self._failures = [0] * len(self.workers)  # deaths since each worker's last finished step
        self._queue: collections.deque = collections.deque()
        self._inflight: dict = {}  # ObjectRef -> (worker index, step id)
        self._placing: dict = {}  # a worker's pid() call -> (worker index, since), until it answers
        self._placed = [False] * len(self.workers)
        self._told: set[int] = set()  # workers said to wait to be placed (_tell_unplaced)
        self._stopping = False
        for w in range(len(self.workers)):
            self._placing[self.workers[w].pid.remote()] = (w, time.monotonic())
        while self._placing:  # all of them, before the first step
            self._take(self._ready(list(self._placing)))

    def schedule(self, step_id: int) -> None:
        self._queue.append(step_id)
        self._dispatch()

    @property
    def pending(self) -> int:
        return len(self._queue) + len(self._inflight)

    def _dispatch(self) -> None:
        busy = {w for w, _ in self._inflight.values()}
        for w in range(len(self.workers)):
            if not self._queue:
                return
            if w not in busy and self._placed[w]:
                step_id = self._queue.popleft()
                self._inflight[self.workers[w].step.remote(step_id)] = (w, step_id)

    def _ready(self, refs: list) -> list:
        """The refs that are ready: at least one, waited for (a line every STALL_SECONDS of it while a worker waits
        to be placed)."""
        import ray

        return ray_actors.ready_refs(ray, refs, block=True, stall=STALL_SECONDS,
                                     stalled=lambda: self._tell_unplaced(stalled=True))

    def _tell_unplaced(self, stalled: bool = False) -> None:
        """A line for the workers waiting STALL_SECONDS to be placed: once each while the others run the steps, and
        at every stall (`stalled`: nothing happened for STALL_SECONDS)."""
        now = time.monotonic()
        late = sorted(w for w, since in self._placing.values()
                      if now - since >= STALL_SECONDS and (stalled or w not in self._told))
        if not late:
            return
        self._told.update(late)
        placed = sum(self._placed)
        many = len(late) > 1
        log.warning("%s %s %s not placed after %gs: the cluster has no room for %s (where the nodes offer a 'worker' "
                    "resource, as TF_CONFIG's do, each worker needs one free: a lost node's worker waits until a node "
                    "offering it joins; ray status shows what is free); %s", "workers" if many else "worker",
                    ", ".join(map(str, late)), "are" if many else "is", STALL_SECONDS, "them" if many else "it",
                    f"the {placed} placed worker(s) run the steps meanwhile" if placed else "no step runs meanwhile")

    def results(self) -> list[dict]:
        """Blocks until at least one step finished or failed, or a worker was placed; returns the finished ones."""
        done = self._take(self._ready([*self._inflight, *self._placing]))
        self._tell_unplaced()
        self._dispatch()
        return done

    def _take(self, ready: list) -> list[dict]:
        import ray

        done = []
        for ref in [r for r in ready if r in self._placing]:
            w, _ = self._placing.pop(ref)
            try:
                pid = ray.get(ref)
            except ray_actors.deaths(ray) as e:
                if getattr(e, "actor_init_failed", False):  # its __init__ raised (the data, the settings): not retried
                    raise RuntimeError(f"worker {w} could not start: {e}") from None
                self._died(w, None, e)
                continue
            self._placed[w] = True
            log.info("worker %d: pid %d", w, pid)
        for ref in [r for r in ready if r in self._inflight]:
            w, step_id = self._inflight.pop(ref)
            try:
                result = ray.get(ref)
            except ray.exceptions.RayTaskError as e:
                # bad data or settings, or a ps gone: the cause, as one line, not a retry
                if isinstance(e.cause, (ValueError, ParameterServerLost)):
                    raise e.cause from None
                raise
            except ray_actors.deaths(ray) as e:
                self._died(w, step_id, e)
                continue
            self._failures[w] = 0
            self.loader_states[w] = result["loader"]
            done.append(result)
        return done

    def _died(self, w: int, step_id: int | None, e: BaseException) -> None:
        """Worker `w` died running `step_id` (None: before it started): the step is queued again, the worker
        replaced."""
        during = f"during step {step_id}" if step_id is not None else "before it started"
        if self._stopping:  # its step is not run again; its loader state is its last finished step's
            log.warning("worker %d died %s while the run stops (%s)", w, during, type(e).__name__)
            return
        self._failures[w] += 1
        if self._failures[w] >= MAX_CONSECUTIVE_FAILURES:
            raise RuntimeError(f"worker {w} died {self._failures[w]} times in a row without finishing a step "
                               f"(last: {e}); see its log under Ray's session directory") from e
        log.warning("worker %d died %s (%s); %sthe worker replaced, its loader resuming after its last finished step",
                    w, during, type(e).__name__, "the step is queued again and " if step_id is not None else "")
        if step_id is not None:
            self._queue.appendleft(step_id)
        for ref in [r for r, (i, _) in self._placing.items() if i == w]:
            del self._placing[ref]
        # Not waited for: it takes steps once placed, and the others go on meanwhile.
        self.workers[w] = self._make_worker(w, self.loader_states[w])
        self._placed[w] = False
        self._told.discard(w)
        self._placing[self.workers[w].pid.remote()] = (w, time.monotonic())
        self.replaced += 1
        log.info("worker %d: replaced", w)

    def join(self):
        """Yields each step's result as it finishes, until nothing is queued or running."""
        while self.pending:
            yield from self.results()

    def drain(self):
        """A stop: drops the queued steps and yields the results of those running now. A worker that dies meanwhile
        is neither replaced nor given its step again."""
        self._queue.clear()
        self._stopping = True
        while self._inflight:
            yield from self.results()


# --- the run ----------------------------------------------------------------------------------------------------
def train(config: TrainConfig, spec=None) -> dict[str, Any]:
    """The coordinator's run (see module doc): returns the summary `python -m trainer` prints."""
    _auth_on(local=spec is None and not config.ray_address)  # before Ray is imported: it reads them at import
    # The workers' log lines as they come: Ray's deduplication holds back lines that several workers print alike
    # and prints them at shutdown, after the run's last line.
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if spec is not None:  # TF_CONFIG's tasks size the job
        _, num_workers, num_ps = spec.parameter_server()
        config = dataclasses.replace(config, num_workers=num_workers, num_ps=max(num_ps, 1))
    import jax
    import orbax.checkpoint as ocp
    import ray

    from trainer import checkpoints, optim, strategy as strategies
    from trainer.metrics import MetricsWriter
    from trainer.program import Program
    from trainer.checkpoints import check_restorable, checkpoint_manager, config_record, finished_run
    from trainer.preemption import PreemptionNotice
    from trainer.train import NonFiniteLoss, final_evaluation, itstime

    tx = _ps_optimizer(config)  # refuses adafactor before anything starts
    with contextlib.closing(checkpoint_manager(config)) as mngr:
        done = finished_run(config, mngr)
    if done is not None:
        return done
    program = Program.build(config)
    program.check_data()  # the labels' range over every record, before the workers start
    if program.has_state:
        raise ValueError(f"model={config.model!r} keeps state besides its parameters (BatchNorm statistics), which "
                         "asynchronous parameter-server training does not carry; use a synchronous strategy "
                         "(mirrored, fsdp, multi_worker, ...) or a model without BatchNorm")
    flat = {k: np.asarray(v) for k, v in _flat(program.init_params()).items()}
    treedef = jax.tree.structure(program.abstract_params())
    shards = partition({k: (v.shape, v.dtype) for k, v in flat.items()}, config.num_ps, config.ps_min_shard_bytes)
    head = None
    try:
        head = _connect(config, spec)
        remote_ps = ray.remote(ParameterServer).options(**_placement("ps"))
        servers = [remote_ps.remote(config, i) for i in range(config.num_ps)]
        for i, pid in enumerate(_from_servers([ps.pid.remote() for ps in servers])):  # (waits for them to start)
            held = [s for s in shards if s.ps == i]
            log.info("ps %d (pid %d) holds %d shard(s), %s parameters: %s", i, pid, len(held),
                     f"{sum(int(np.prod(s.shape)) for s in held):,}",
                     ", ".join(f"{s.name}{list(s.shape)}" for s in held[:6]) + (" ..." if len(held) > 6 else ""))

        # restore, or start from the initial parameters
        mngr = checkpoint_manager(config)
        parts = split(flat, shards, config.num_ps)
        start, loader_states, versions = 0, [None] * config.num_workers, [0] * config.num_ps
        opt_states = [None] * config.num_ps
        if mngr.latest_step() is not None:
            start = mngr.latest_step()
            abstract = {"params": program.abstract_params(),
                        "opt_state": [jax.eval_shape(tx.init, part) for part in parts],
                        "step": jax.ShapeDtypeStruct((), np.int32)}
            abstract = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), abstract)
            data = mngr.restore(start, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]
            if (data["num_ps"], data["num_workers"]) != (config.num_ps, config.num_workers):
                raise ValueError(f"the checkpoint at step {start} was written with num_ps={data['num_ps']} "
                                 f"num_workers={data['num_workers']}; resume with those (each worker's loader "
                                 "position and each ps's optimizer state belong to that layout)")
            check_restorable(mngr, start, abstract, config)
            restored = mngr.restore(start, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
            parts = split({k: np.asarray(v) for k, v in _flat(restored["state"]["params"]).items()}, shards,
                          config.num_ps)
            opt_states, loader_states, versions = restored["state"]["opt_state"], data["workers"], data["versions"]
            log.info("resumed from step %d (ps versions %s)", start, versions)
        _from_servers([ps.load.remote(parts[i], opt_states[i], versions[i]) for i, ps in enumerate(servers)])

        remote_worker = ray.remote(Worker).options(**_placement("worker"))
        coordinator = Coordinator(lambda i, state: remote_worker.remote(config, i, servers, shards, state),
                                  loader_states)
        log.info("strategy=parameter_server num_workers=%d num_ps=%d steps %d..%d", config.num_workers,
                 config.num_ps, start + 1, config.steps)

        def pull_params():
            pulled = _from_servers([ps.state.remote() for ps in servers])
            flat_now = assemble([values for values, _, _ in pulled], shards)
            params = jax.tree.unflatten(treedef, [flat_now[k] for k in flat])
            return params, [o for _, o, _ in pulled], [v for _, _, v in pulled]

        def save(step):
            params, opts, vers = pull_params()
            with checkpoints.writes(mngr):
                mngr.save(step, args=ocp.args.Composite(
                    state=ocp.args.StandardSave({"params": params, "opt_state": opts,
                                                 "step": np.asarray(step, np.int32)}),
                    data=ocp.args.JsonSave({"workers": coordinator.loader_states, "versions": vers,
                                            "num_ps": config.num_ps, "num_workers": config.num_workers}),
                    config=config_record(config)), force=True)
                mngr.wait_until_finished()

        evaluator = strategies.make("default")
        metrics = MetricsWriter(config.workdir, start)
        done = scheduled = start
        period, period_start, last = [], time.perf_counter(), {}

        def report(record):
            metrics.write(record)
            log.info("step %d/%d loss %.4f %sstaleness mean %.2f max %d, %.0f ex/s%s", record["step"], config.steps,
                     record["loss"], "".join(f"{k} {v:.4f} " for k, v in record.items()
                                             if k.startswith("eval_") and k != "eval_examples"),
                     record["staleness_mean"], record["staleness_max"], record["examples_per_sec"],
                     optim.described(config, record["learning_rate"]))

        def finished(result):
            nonlocal done
            done += 1
            period.append(result)
            if not np.isfinite(result["loss"]):
                raise NonFiniteLoss(f"loss is {result['loss']} at step {result['step']} (worker "
                                    f"{result['worker']}); lower learning_rate or check the data")

        # SIGTERM or Ctrl-C: the steps running finish, the run saves and stops (the synchronous trainer's exits).
        preemption = PreemptionNotice()
        saved = start
        try:
            while done < config.steps:
                # the next step at which everything must have finished: a checkpoint, an eval, the last step
                sync = next(s for s in range(done + 1, config.steps + 1)
                            if s == config.steps or s % config.checkpoint_every == 0
                            or (config.eval_data and s % config.eval_every == 0))
                while scheduled < sync:
                    scheduled += 1
                    coordinator.schedule(scheduled)
                for result in coordinator.join():
                    finished(result)
                    if preemption.reached(done):
                        break
                    if done < sync and done % config.log_every == 0:
                        last = _record(config, done, period, period_start, coordinator)
                        report(last)
                        period, period_start = [], time.perf_counter()
                stop = preemption.reached(done)
                if stop:
                    for result in coordinator.drain():
                        finished(result)
                last = _record(config, done, period, period_start, coordinator)
                if config.eval_data and itstime(done, config.eval_every, config.steps) and not stop:
                    last.update(program.evaluate(evaluator, pull_params()[0]))
                report(last)
                period, period_start = [], time.perf_counter()
                if itstime(done, config.checkpoint_every, config.steps) or stop:
                    save(done)
                    saved = done
                if stop:
                    log.warning("%s: saved a checkpoint at step %d; exiting (the same command resumes from it)",
                                preemption.reason, done)
                    return {**last, "workers_replaced": coordinator.replaced, "preempted": True,
                            "stopped_by": preemption.reason, "final_step": done}
        except ParameterServerLost as e:
            where = f"the checkpoint at step {saved}" if saved else "step 0 (no checkpoint was saved yet)"
            raise ParameterServerLost(f"{e}: the updates it applied since the last checkpoint died with it, so the run "
                                      f"stops, as tf's does; the same command resumes from {where}") from None
        finally:
            preemption.close()
            metrics.close()
            checkpoints.close(mngr)
        final = final_evaluation(last, config, lambda: program.evaluate(evaluator, pull_params()[0]))
        return {**last, **final, "workers_replaced": coordinator.replaced, "preempted": False,
                "final_step": config.steps}
    finally:
        try:
            ray.shutdown()
        finally:
            if head is not None:  # the head we started for TF_CONFIG's tasks: its nodes leave when it is gone
                _stop_head(head)


# The chief's Ray head runs under this watch, in a session of its own: when the chief's end of the pipe on its stdin
# closes (the chief ended, however: SIGKILL too), the watch ends the head's process group, and the worker and ps
# tasks leave once they notice the head is gone.
_HEAD_WATCH = """
import os, signal, subprocess, sys, threading
head = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL)
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's SIGTERM is for the head: this waits for it to stop
def owner_gone():
    sys.stdin.buffer.read()
    os.killpg(0, signal.SIGTERM)
threading.Thread(target=owner_gone, daemon=True).start()
code = head.wait()
try:  # as `ray stop` does: a later ray.init() on this machine would take the gone head's address for a cluster's
    from ray._common.utils import get_ray_address_file
    path = get_ray_address_file(None)
    port = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--port="))
    with open(path) as f:
        if f.read().strip().rpartition(":")[2] == port:
            os.remove(path)
except Exception:
    pass
sys.exit(code)
"""


def _start_head(head: str) -> subprocess.Popen:
    """`ray start --head --block` at `head` (HOST:PORT), under _HEAD_WATCH; refused where something already answers
    there (a head an earlier chief left: it would be joined, and nobody would stop it)."""
    host, _, port = head.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError:
        pass
    else:
        raise ValueError(f"something already answers at {head}, the chief's address in TF_CONFIG (a Ray head an "
                         "earlier run left?): stop it (ray stop, on this machine) and run again")
    command = [_ray_cli(), "start", "--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false",
               "--disable-usage-stats", "--block", *_extra_start_args()]
    return subprocess.Popen([sys.executable, "-c", _HEAD_WATCH, *command], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _stop_head(head: subprocess.Popen) -> None:
    try:
        os.killpg(head.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    head.wait(timeout=120)
    head.stdin.close()


def _record(config, done, period, period_start, coordinator) -> dict:
    """The metrics of the steps finished since the last record."""
    from trainer import optim

    elapsed = time.perf_counter() - period_start
    staleness = [r["staleness"] for r in period]
    return {"step": done, "loss": float(np.mean([r["loss"] for r in period])),
            "staleness_mean": float(np.mean(staleness)), "staleness_max": int(max(staleness)),
            "examples_per_sec": len(period) * config.batch_size / elapsed, "steps_per_sec": len(period) / elapsed,
            "workers_replaced": coordinator.replaced,
            "learning_rate": optim.rate_at(config, done - 1)}  # each ps's last update (its done-th)


# --- the Ray cluster ------------------------------------------------------------------------------------------
def _auth_on(local: bool) -> None:
    """Token authentication on (RAY_AUTH_MODE=token). A local cluster gets a fresh random token for this run (in
    RAY_AUTH_TOKEN, which Ray's processes inherit); a multi-machine one needs the same token on every task."""
    if "ray" in sys.modules:
        raise RuntimeError("set Ray's authentication environment before importing ray (it reads it at import)")
    mode = os.environ.get("RAY_AUTH_MODE", "token")
    if mode.lower() != "token":
        raise ValueError(f"RAY_AUTH_MODE={mode!r}: strategy=parameter_server keeps Ray's token authentication on "
                         "(anyone who reaches an open Ray port can run code); unset RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "token"
    if local:
        if not os.environ.get("RAY_AUTH_TOKEN"):
            import secrets

            os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
        return
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    if not os.environ.get("RAY_AUTH_TOKEN") and not os.path.exists(path):
        raise ValueError("a multi-machine Ray cluster needs the same authentication token on every task: set "
                         "RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH to a file holding it) everywhere; "
                         "`ray get-auth-token --generate` makes one")


def _placement(role: str) -> dict:
    """Actor options: on a cluster whose nodes offer "worker"/"ps" resources (TF_CONFIG, or the local one we
    start), one unit of the role's resource; else no CPU reservation (a user's cluster without them)."""
    import ray

    if ray.cluster_resources().get(role, 0) >= 1:
        return {"num_cpus": 0, "resources": {role: 1}, "max_restarts": 0}
    return {"num_cpus": 0, "max_restarts": 0}


def _connect(config: TrainConfig, spec) -> subprocess.Popen | None:
    """Starts or joins the Ray cluster; returns the head process when this (the TF_CONFIG chief) started one."""
    import ray

    head_proc = None
    if spec is not None:  # TF_CONFIG: this is the chief; start the head at its address, wait for the tasks
        head, num_workers, num_ps = spec.parameter_server()
        head_proc = _start_head(head)
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    ray_actors.init(ray, address=head, logging_level=logging.WARNING)
                    break
                except (ConnectionError, RuntimeError):
                    if head_proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"could not start the Ray head at {head} (`ray start --head` exit "
                                           f"{head_proc.poll()}); is the port free?") from None
                    time.sleep(1)
            log.info("ray head started at %s", head)
            _wait_for_nodes({"worker": num_workers, "ps": num_ps}, 600, "TF_CONFIG's tasks",
                            lambda have: "are the worker and ps tasks running with the same TF_CONFIG and token?")
        except BaseException:  # (a Ctrl-C while the tasks join, too): the head goes with this run
            ray.shutdown()
            _stop_head(head_proc)
            raise
    elif config.ray_address:
        ray_actors.check_reachable(config.ray_address)
        ray_actors.init(ray, address=config.ray_address, logging_level=logging.WARNING)
        _wait_for_roles(config)
    else:  # one machine: a local cluster offering the actors' resources
        ray_actors.init(ray, address="local", num_cpus=os.cpu_count(), include_dashboard=False,
                        logging_level=logging.WARNING, resources={"worker": config.num_workers, "ps": config.num_ps})
    log.info("ray cluster: %s", {k: v for k, v in ray.cluster_resources().items() if not k.startswith("node:")})
    return head_proc


def _wait_for_nodes(wanted: dict[str, int], timeout: float, joining: str, fix: Callable[[dict], str]) -> None:
    """Until the cluster offers `wanted` units of each resource: a line when what it has changes (and every 30 s);
    after `timeout` seconds, an error ending with `fix(what it offers then)`. `joining`: who is awaited, for the
    log."""
    import ray

    deadline = time.monotonic() + timeout
    said, said_at = None, -math.inf
    while True:
        have = ray.cluster_resources()
        if all(have.get(k, 0) >= n for k, n in wanted.items()):
            return
        offered = {k: have.get(k, 0) for k in wanted}
        if time.monotonic() > deadline:
            raise TimeoutError(f"the Ray cluster offers {offered} after {timeout:.0f} s, not the {wanted} this run "
                               f"needs: {fix(have)}")
        if offered != said or time.monotonic() - said_at >= 30:
            log.info("waiting for %s to join the Ray cluster: it offers %s of %s", joining, offered, wanted)
            said, said_at = offered, time.monotonic()
        time.sleep(1)


SETTING = {"worker": "num_workers", "ps": "num_ps"}  # the setting that counts each role's actors


def _wait_for_roles(config: TrainConfig) -> None:
    """A cluster of the user's (ray_address=) whose nodes offer "worker" or "ps" resources places each actor of that
    role on a unit of it (_placement): it must offer num_workers / num_ps of them, or an actor would wait for one
    without a word. Nodes may still be joining: they are waited for (join_timeout), with a line saying so."""
    import ray

    have = ray.cluster_resources()
    wanted = {role: n for role, n in (("worker", config.num_workers), ("ps", config.num_ps)) if have.get(role, 0) >= 1}

    def fix(have: dict) -> str:
        short = {role: n for role, n in wanted.items() if have.get(role, 0) < n}
        start = " and ".join(f"`ray start --address={config.ray_address} --resources='{{\"{role}\": 1}}'` on "
                             f"{n - int(have.get(role, 0))} more machine(s)" for role, n in short.items())
        fewer = " ".join(f"{SETTING[role]}={int(have.get(role, 0))}" for role in short)
        return f"run {start}, or pass {fewer} (each actor of a role takes one unit of its resource)"

    _wait_for_nodes(wanted, config.join_timeout, "nodes offering the actors' resources", fix)


def serve_node(config: TrainConfig, spec) -> dict[str, Any]:
    """A TF_CONFIG worker or ps task: joins the chief's Ray cluster as a node offering one unit of its role and
    serves until the cluster ends (the chief stops it after training)."""
    _auth_on(local=False)
    head, _, _ = spec.parameter_server()
    role = "ps" if spec.task_type == "ps" else "worker"
    deadline = time.monotonic() + 600
    while True:  # the chief may not have started the head yet
        proc = subprocess.run([_ray_cli(), "start", f"--address={head}", "--num-cpus=1",
                               f"--resources={{\"{role}\": 1}}", "--disable-usage-stats", "--block",
                               *_extra_start_args()],
                              capture_output=True, text=True)
        if proc.returncode == 0 or time.monotonic() > deadline:
            break
        if "Unable to connect" not in proc.stderr + proc.stdout and "timed out" not in proc.stderr + proc.stdout:
            break
        log.info("%s %d: the Ray head at %s is not up yet; retrying", spec.task_type, spec.task_index, head)
        time.sleep(3)
    log.info("%s %d: left the Ray cluster at %s (its head is gone: the run ended; `ray start` exit %d)",
             spec.task_type, spec.task_index, head, proc.returncode)
    return {"role": spec.task_type, "index": spec.task_index, "head": head, "ray_exit": proc.returncode}


def _extra_start_args() -> list[str]:
    """RAY_START_ARGS: more `ray start` flags for the nodes we start, e.g. pinned ports for a firewall
    ("--node-manager-port=6380 --object-manager-port=6381 --min-worker-port=10002 --max-worker-port=10100")."""
    import shlex

    return shlex.split(os.environ.get("RAY_START_ARGS", ""))


def _ray_cli() -> str:
    return os.path.join(os.path.dirname(sys.executable), "ray")
