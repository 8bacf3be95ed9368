"""`train_and_evaluate(config)`: the training loop, in named phases.

setup (strategy, data, model, optimizer) -> restore (latest checkpoint, loader state included) ->
loop (step; every log_every: metrics; every eval_every: eval; every checkpoint_every or on SIGTERM:
checkpoint) -> summary. Metrics go to WORKDIR/metrics.jsonl, TensorBoard (WORKDIR/tensorboard) and
the console.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import loader
from loader.decode import collate
from dataset_format import storage, tfds_info
from trainer import models, optim, strategy as strategies, tasks
from trainer.config import TrainConfig
from trainer.preemption import PreemptionNotice

log = logging.getLogger(__name__)


class NonFiniteLoss(FloatingPointError):
    pass


def _on_multi_host_tpu() -> bool:
    """True on a TPU VM that is one host of several (checked without starting a JAX backend)."""
    return "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")


def itstime(step: int, every: int, last_step: int) -> bool:
    """Periodic work (big_vision's helper): every `every` steps, and at the last step."""
    return step % every == 0 or step == last_step


def _source_split(path: str, default: str | None) -> str | None:
    """TFDS sources (local or gs://) need a split; others must not get one."""
    return default if storage.exists(storage.join(path, tfds_info.INFO_NAME)) else None


def train_and_evaluate(config: TrainConfig) -> dict[str, Any]:
    # --- setup ------------------------------------------------------------------------------
    if config.strategy == "multi_worker" and not jax.distributed.is_initialized():
        strategies.initialize_multi_worker(config.coordinator_address, config.num_processes, config.process_id)
    if config.strategy == "tpu" and _on_multi_host_tpu() and not jax.distributed.is_initialized():
        jax.distributed.initialize()  # a multi-host TPU slice: JAX finds the cluster from the TPU metadata
    os.makedirs(config.workdir, exist_ok=True)
    strategy = strategies.make(config.strategy, device=config.device)
    chief = jax.process_index() == 0  # writes metrics and TensorBoard; all processes take part in checkpoints
    replicas = strategy.num_replicas_in_sync
    if config.batch_size % replicas:
        raise ValueError(f"batch_size={config.batch_size} does not split over num_replicas_in_sync={replicas}; "
                         f"use a multiple of {replicas}")
    log.info("strategy=%s num_replicas_in_sync=%d mesh=%s devices=%s process=%d/%d", strategy.name, replicas,
             dict(strategy.mesh.shape), [str(d) for d in strategy.mesh.devices.flat], jax.process_index(),
             jax.process_count())

    train_split = config.split or _source_split(config.data, "train")
    task = tasks.make(config, _feature_specs(config.data))
    sample = _sample(config.data, train_split, task)  # one record to shape the model, on every process
    if config.packing and not hasattr(task, "packing"):
        raise ValueError(f"packing=true needs a task that packs token sequences (task=lm); task={config.task!r} "
                         "does not")
    batches = loader.load(config.data, batch_size=config.batch_size, seed=config.seed, split=train_split,
                          sharding=strategy.batch_sharding, worker_count=config.data_workers,
                          **({"packing": task.packing} if config.packing else
                             {"features": task.features, "map_fn": getattr(task, "preprocess", None)}))
    model = models.make(config.model, task.model_kwargs())
    params = model.init(jax.random.key(config.seed), task.inputs(sample))["params"]
    tx = optim.make(config)
    state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    state_sharding = strategy.param_sharding(state)
    state = jax.device_put(state, state_sharding)
    n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
    log.info("task=%s features=%s model=%s parameters=%s", config.task, list(task.features), config.model,
             f"{n_params:,}")
    log.info("optimizer=%s learning_rate=%g schedule=%s warmup_steps=%d weight_decay=%g grad_clip=%g "
             "grad_accum_steps=%d dtype=%s", config.optimizer, config.learning_rate, config.schedule,
             config.warmup_steps, config.weight_decay, config.grad_clip, config.grad_accum_steps, config.dtype)

    compute = _caster(config.dtype)

    def loss_sums(p, batch):
        """(sum of the losses, sum of the weights) of a batch, the model run in the compute dtype."""
        outputs = model.apply({"params": compute(p)}, compute(task.inputs(batch)))
        outputs = jax.tree.map(lambda o: o.astype(jnp.float32), outputs)
        return task.losses(outputs, batch).sum(), tasks.weights(task, batch).sum()

    grad_sums = jax.value_and_grad(loss_sums, has_aux=True)

    def train_step(state, batch):
        k = config.grad_accum_steps
        if k == 1:
            (loss_sum, weight), grads = grad_sums(state["params"], batch)
        else:  # micro-batch i = rows i, i+k, ...: every device keeps a share of each
            micro = jax.tree.map(lambda x: x.reshape((x.shape[0] // k, k) + x.shape[1:]).swapaxes(0, 1), batch)

            def accumulate(carry, mb):
                (l, w), g = grad_sums(state["params"], mb)
                return jax.tree.map(jnp.add, carry, (g, l, w)), None

            zeros = (jax.tree.map(jnp.zeros_like, state["params"]), jnp.zeros(()), jnp.zeros(()))
            (grads, loss_sum, weight), _ = jax.lax.scan(accumulate, zeros, micro)
        grads = jax.tree.map(lambda g: g / weight, grads)  # the gradient of the mean over the whole batch
        loss = loss_sum / weight
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new = {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
               "step": state["step"] + 1}
        return new, loss

    eval_step = _make_eval_step(model, task, compute)
    train_step = jax.jit(train_step, in_shardings=(state_sharding, strategy.batch_sharding),
                         out_shardings=(state_sharding, strategy.replicated), donate_argnums=(0,))

    # --- restore ----------------------------------------------------------------------------
    mngr = ocp.CheckpointManager(os.path.abspath(os.path.join(config.workdir, "checkpoints")),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=3))
    it = iter(batches)
    start = 0
    if mngr.latest_step() is not None:
        start = mngr.latest_step()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        restored = mngr.restore(start, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                               data=ocp.args.JsonRestore()))
        state = restored["state"]
        it.set_state(restored["data"])
        log.info("resumed from step %d (loader at batch %d)", start, restored["data"]["next_batch"])

    if config.in_memory_batches:
        cached = [next(it) for _ in range(config.in_memory_batches)]
        jax.block_until_ready(cached)
        log.info("in_memory_batches=%d: cycling batches held on the devices (no input cost; for measuring the "
                 "input-bound limit)", len(cached))
        fetch = itertools.cycle(cached).__next__
    else:
        fetch = it.__next__

    def save(step: int) -> None:
        mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                data=ocp.args.JsonSave(it.get_state())), force=True)
        mngr.wait_until_finished()

    preemption = PreemptionNotice()  # SIGTERM, to any process: all save at one step and stop
    metrics_file = _open_metrics(os.path.join(config.workdir, "metrics.jsonl"), start) if chief else None
    writer = _tensorboard(config.workdir) if chief else None

    # --- loop -------------------------------------------------------------------------------
    losses: list = []
    period_start, data_wait, host_wait, last = time.perf_counter(), 0.0, 0.0, {}
    try:
        for step in range(start + 1, config.steps + 1):
            t = time.perf_counter()
            batch = fetch()
            waited = time.perf_counter() - t
            host_wait += waited  # all time blocked on input, also while step - 1 still runs
            if not losses or losses[-1].is_ready():  # no step running: the devices may have idled this long
                data_wait += waited
            state, loss = train_step(state, batch)
            if losses:
                # At most two steps in flight. Unbounded asynchronous dispatch of collective programs
                # hangs XLA:CPU's in-process all-reduce (reproduced with 8 simulated devices after ~300
                # queued steps); on accelerators one step of lookahead is all the overlap needed.
                losses[-1].block_until_ready()
            losses.append(loss)
            stop = preemption.reached(step)
            if itstime(step, config.log_every, config.steps) or stop:
                values = np.asarray(jax.device_get(losses), dtype=np.float64)  # waits for the steps
                bad = np.flatnonzero(~np.isfinite(values))
                if bad.size:
                    raise NonFiniteLoss(f"loss is {values[bad[0]]} at step {step - len(values) + 1 + bad[0]}; "
                                        "lower learning_rate or check the data")
                elapsed = time.perf_counter() - period_start
                last = {"step": step, "loss": float(values.mean()),
                        "examples_per_sec": len(values) * config.batch_size / elapsed,
                        "examples_per_sec_per_device": len(values) * config.batch_size / elapsed / replicas,
                        "step_time_s": elapsed / len(values), "data_wait_fraction": data_wait / elapsed,
                        "host_wait_fraction": host_wait / elapsed}
                if config.eval_data and itstime(step, config.eval_every, config.steps):
                    last.update(_evaluate(config, strategy, task, eval_step, state["params"]))
                if chief:
                    _write(metrics_file, writer, last)
                evals = "".join(f"{k} {v:.4f} " for k, v in last.items() if k.startswith("eval_") and k != "eval_examples")
                log.info("step %d/%d loss %.4f %s%.0f ex/s data-wait %.1f%%", step, config.steps, last["loss"], evals,
                         last["examples_per_sec"], 100 * last["data_wait_fraction"])
                losses, period_start, data_wait, host_wait = [], time.perf_counter(), 0.0, 0.0
            if itstime(step, config.checkpoint_every, config.steps) or stop:
                save(step)
            if stop:
                log.warning("SIGTERM: saved a checkpoint at step %d; exiting", step)
                return {**last, "preempted": True, "final_step": step}
    finally:
        it.close()  # stops the loader's read-ahead (threads, worker processes) before the evaluation
        preemption.close()
        if metrics_file:
            metrics_file.close()
        if writer:
            writer.close()
        mngr.close()
    # --- summary ----------------------------------------------------------------------------
    final = _evaluate(config, strategy, task, eval_step, state["params"]) if config.eval_data else {}
    return {**last, **final, "preempted": False, "final_step": config.steps}


def _feature_specs(data: str) -> dict[str, dict]:
    """The TFDS feature metadata (features.json) of a dataset directory; {} for other sources."""
    features = None if storage.has_glob(data) else tfds_info.read_features(data)
    return tfds_info.feature_specs(features) if features else {}


def _sample(data: str, split: str | None, task) -> dict[str, np.ndarray]:
    """The first record as the task sees it, a batch of one (all features are decoded once, to name them if one
    is missing)."""
    one = dict(batch_size=1, shuffle=False, split=split, shard_index=0, shard_count=1)
    record = next(iter(loader.load(data, **one)))
    missing = [f for f in task.features if f not in record]
    if missing:
        raise ValueError(f"task reads feature {missing[0]!r}, which {data} does not have; its features are "
                         f"{sorted(record)} (set image_key= / label_key= / text_key=, or the task's own keys)")
    if not hasattr(task, "preprocess"):
        return {f: record[f] for f in task.features}
    return collate([task.preprocess({f: record[f][0] for f in task.features})])


def _caster(dtype: str):
    """Casts the floating-point leaves of a tree to the compute dtype (identity for float32)."""
    if dtype == "float32":
        return lambda tree: tree
    target = jnp.dtype(dtype)
    return lambda tree: jax.tree.map(lambda x: x.astype(target) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _make_eval_step(model, task, compute):
    """The jit-compiled eval step, made once per run (a new closure per eval would recompile each time): weighted
    sums of the task's losses and metrics over a batch, and of the weights (0 for padding rows)."""

    @jax.jit
    def eval_step(params, batch, real):
        outputs = model.apply({"params": compute(params)}, compute(task.inputs(batch)))
        outputs = jax.tree.map(lambda o: o.astype(jnp.float32), outputs)
        sums = {name: jnp.sum(values * real) for name, values in task.metrics(outputs, batch).items()}
        sums["loss"] = jnp.sum(task.losses(outputs, batch) * real)
        return sums, jnp.sum(tasks.weights(task, batch) * real), jnp.sum(real)

    return eval_step


def _evaluate(config: TrainConfig, strategy, task, eval_step, params) -> dict[str, float]:
    """The task's metrics and loss over one pass of eval_data (each process its rows; short batches padded and
    masked): {"eval_<metric>": mean, "eval_loss": mean, "eval_examples": count}."""
    split = _source_split(config.eval_data, "test")
    batches = loader.load(config.eval_data, batch_size=config.batch_size, shuffle=False, num_epochs=1,
                          drop_remainder=False, split=split, features=task.features,
                          map_fn=getattr(task, "preprocess", None))
    per_process = config.batch_size // jax.process_count()
    totals: dict[str, float] = {}
    weight = examples = 0.0
    template = None
    for batch in batches:
        if len(batch) == 0:  # no rows for this process in the last batch: take part with an all-padding one
            if template is None:
                raise ValueError("eval_data has fewer records than processes x rows; lower batch_size")
            batch = {k: v[:0] for k, v in template.items()}
        batch = {k: np.asarray(v) for k, v in batch.items()}
        template = template or batch
        n = len(next(iter(batch.values())))
        pad = per_process - n
        weights = np.concatenate([np.ones(n, np.float32), np.zeros(pad, np.float32)])
        if pad:
            batch = {k: np.concatenate([v, np.zeros((pad, *v.shape[1:]), v.dtype)]) for k, v in batch.items()}
        sums, w, n = eval_step(params, strategy.distribute(batch), strategy.distribute(weights))
        for name, value in sums.items():
            totals[name] = totals.get(name, 0.0) + float(value)
        weight, examples = weight + float(w), examples + float(n)
    return {**{f"eval_{name}": value / weight for name, value in sorted(totals.items())},
            "eval_examples": int(examples)}


def _tensorboard(workdir: str):
    try:
        from tensorboardX import SummaryWriter
    except ImportError:  # optional: metrics.jsonl has everything
        log.warning("tensorboardX is not installed: no TensorBoard scalars (metrics.jsonl is still written)")
        return None
    return SummaryWriter(os.path.join(workdir, "tensorboard"))


def _open_metrics(path: str, start: int):
    """metrics.jsonl for appending, without the records of steps after `start` (the checkpoint resumed from):
    a run that stopped between a log and its next checkpoint logged steps that the resumed run repeats."""
    if os.path.exists(path):
        with open(path) as f:
            lines = f.read().splitlines()
        kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= start]
        if len(kept) < len(lines):
            log.info("metrics.jsonl: dropped %d record(s) after step %d (logged before the restart, repeated now)",
                     len(lines) - len(kept), start)
            with open(path + ".tmp", "w") as f:
                f.writelines(line + "\n" for line in kept)
            os.replace(path + ".tmp", path)
    return open(path, "a")


def _write(metrics_file, writer, record: dict) -> None:
    metrics_file.write(json.dumps({k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                                   for k, v in record.items()}) + "\n")
    metrics_file.flush()
    if writer:
        for key, value in record.items():
            if key != "step":
                writer.add_scalar(key, value, record["step"])
        writer.flush()
