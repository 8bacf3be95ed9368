"""`train_and_evaluate(config)`: the training loop, in named phases.

setup (strategy, data, model, optimizer; the state placed on the devices) -> restore (latest checkpoint, loader
state included) -> compile (the step, ahead of time, for the first batch's shapes) -> loop (step; every log_every:
metrics; every eval_every: eval; every checkpoint_every or on SIGTERM: checkpoint) -> summary. Metrics go to
WORKDIR/metrics.jsonl, TensorBoard (WORKDIR/tensorboard) and the console.

Device memory is taken in that order, and streamed batches take no more of it than batches held in memory: the
loader hands over host arrays, and this thread places each batch right after the previous step is dispatched. A
step's temporaries are allocated as one block while it is dispatched; a batch placed by another thread at that moment
lands after the block, stays there when the block is freed, and splits the free memory in two halves, each of which
can be too small for the next step's block (a GPU out of memory at the first steps with a step that needs half the
memory). Here nothing else is placed while a step is dispatched, and the compile's own scratch memory is gone
before the first batch arrives.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import itertools
import json
import logging
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from trainer import accelerators, checkpoints, compile_cache, job, optim, remat, sources, tasks
from trainer.rampup import Ramp
from trainer.checkpoints import checkpoint_manager, config_record, finished_run
from trainer import strategy as strategies
from trainer.config import SIZED_MODELS, TrainConfig
from trainer.metrics import MetricsWriter
from trainer.program import EvaluationStopped, Program
from trainer import preemption as preemptions
from trainer.preemption import PreemptionNotice
from trainer.profiling import StepProfile
from trainer.throughput import Throughput

log = logging.getLogger(__name__)


class NonFiniteLoss(FloatingPointError):
    pass


def _on_multi_host_tpu() -> bool:
    """True on a TPU VM that is one host of several (checked without starting a JAX backend)."""
    return "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")


# The checkpoint's loader-state key for `pending` (_train_and_evaluate's)
PENDING = "losses_since_row"


def itstime(step: int, every: int, last_step: int) -> bool:
    """Periodic work (big_vision's helper): every `every` steps, and at the last step."""
    return step % every == 0 or step == last_step


def train_and_evaluate(config: TrainConfig) -> dict[str, Any]:
    with compile_cache.enabled(config.compilation_cache, config.workdir), contextlib.ExitStack() as held:
        return _train_and_evaluate(config, held)


def _train_and_evaluate(config: TrainConfig, held: contextlib.ExitStack) -> dict[str, Any]:
    """The run; `held`: what it holds until it returns (the workdir's lease)."""
    # --- setup ------------------------------------------------------------------------------
    if config.strategy == "multi_worker" and not jax.distributed.is_initialized():
        strategies.initialize_multi_worker(config.coordinator_address, config.num_processes, config.process_id,
                                           config.join_timeout)
    if config.strategy == "tpu" and _on_multi_host_tpu() and not jax.distributed.is_initialized():
        strategies.join(config.join_timeout)  # a multi-host TPU slice: JAX finds the cluster from the TPU metadata
    accelerators.warn_if_unused()  # (after jax.distributed.initialize: it must come before JAX picks a backend)
    job.check_settings(config)  # several processes: one job's, or one line naming what differs (trainer/job.py)
    job.check_shared(config.workdir)  # (made here, on every process)
    held.enter_context(job.alone_in(config.workdir))  # one run a workdir
    writing: collections.deque = collections.deque()  # (step, time) of each checkpoint being written in the background

    def committed() -> None:
        """orbax's thread, as a checkpoint is committed: the line that says so."""
        step, taken = writing.popleft()
        log.info("step %d: checkpoint written (%.1f s in the background)", step, time.perf_counter() - taken)

    mngr = checkpoint_manager(config, on_written=committed if config.async_checkpointing else None)
    it = None  # the loader's iterator, once started
    try:  # an error before the loop closes what is open (the loop's own `finally` closes them after)
        done = finished_run(config, mngr)
        if done is not None:
            mngr.close()
            return done
        # several processes: each reads the same data, or one line naming what each sees (trainer/job.py)
        data = job.same_data(lambda: sources.resolve(config), sources.shards_seen)
        with job.together("setup"):  # an error here on one process stops every process, none waits for it
            strategy = strategies.make(config.strategy, device=config.device)
            chief = jax.process_index() == 0  # writes metrics and TensorBoard; all processes take part in checkpoints
            replicas = strategy.num_replicas_in_sync
            if config.batch_size % replicas:
                raise ValueError(f"batch_size={config.batch_size} does not split over num_replicas_in_sync={replicas}; "
                                 f"use a multiple of {replicas}")
            log.info("strategy=%s num_replicas_in_sync=%d mesh=%s devices=%s process=%d/%d", strategy.name, replicas,
                     dict(strategy.mesh.shape), [str(d) for d in strategy.mesh.devices.flat], jax.process_index(),
                     jax.process_count())
            ramp = Ramp.of(config)
            if ramp is not None:
                uneven = [size for size in ramp.sizes() if size % replicas]
                if uneven:
                    raise ValueError(f"the ramp-up's batch size {uneven[0]} does not split over num_replicas_in_sync="
                                     f"{replicas}; choose batch_size_start and batch_size_increment as multiples of "
                                     f"{replicas}")
                log.info("batch-size ramp-up over %s examples: %s", f"{config.rampup_samples:,}", ramp.describe())
            first_step = (mngr.latest_step() or 0) + 1
            batch_size = ramp.batch_size(first_step) if ramp is not None else config.batch_size  # this step's

            program = Program.build(config, data)
            program.check_data()  # the labels' range over every record, before anything compiles
            # host arrays: this thread places them (the module's docstring says why)
            batches = program.load_train(batch_size=batch_size)
            _log_epochs(program, ramp)
            if mngr.latest_step() is not None:  # another model's checkpoint: one line now, by shapes, before the init
                checkpoints.check_restorable(mngr, mngr.latest_step(), {"params": program.abstract_params()}, config)
            log.info("model=%s: initialising its parameters", config.model)
            t = time.perf_counter()
            variables = program.init_variables()
            log.info("model=%s: initialised in %.1f s", config.model, time.perf_counter() - t)
            program.check_outputs(variables)  # a last layer that does not fit the task: one line, before compiling
            params = variables.pop("params")
            tx = program.optimizer()
            state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
            if variables:  # the model's state (BatchNorm statistics): checkpointed with the parameters
                state["model_state"] = variables
        state_sharding = strategy.param_sharding(state)
        state = jax.device_put(state, state_sharding)
        n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
        log.info("task=%s features=%s model=%s parameters=%s%s", config.task, list(program.task.features), config.model,
                 f"{n_params:,}", f" ({config.model_settings})" if config.model_settings else "")
        decayed = f" (on {config.weight_decay_on})" if config.weight_decay else ""
        moments = (f" adam_b1={config.adam_b1:g} adam_b2={config.adam_b2:g} adam_eps={config.adam_eps:g}"
                   if config.optimizer in ("adam", "adamw") else "")
        log.info("optimizer=%s learning_rate=%g schedule=%s warmup_steps=%d weight_decay=%g%s grad_clip=%g "
                 "grad_accum_steps=%d dtype=%s%s", config.optimizer, config.learning_rate, config.schedule,
                 config.warmup_steps, config.weight_decay, decayed, config.grad_clip, config.grad_accum_steps,
                 config.dtype, moments)

        untrained = optim.untrained_steps(config)
        if untrained:
            log.warning("%s", untrained)

        def jit_step(program: Program):
            return jax.jit(make_train_step(program, tx, strategy),
                           in_shardings=(state_sharding, strategy.batch_sharding),
                           out_shardings=(state_sharding, strategy.replicated, strategy.replicated),
                           donate_argnums=(0,))

        # --- restore ----------------------------------------------------------------------------
        it = iter(batches)
        start = 0
        # The losses of the steps since the last row every run of these settings writes (at a multiple of log_every
        # or eval_every), kept in each checkpoint: a run resumed between two such rows writes the next one as a run
        # without stops does, its loss the mean of the whole period, not of the steps since the restart.
        pending: list[float] = []
        if mngr.latest_step() is not None:
            start = mngr.latest_step()
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
            restored = checkpoints.restore(mngr, start, abstract, config)
            state = restored["state"]
            pending = [float(x) for x in restored["data"].pop(PENDING, [])]
            checkpoints.restore_loader(it, mngr, start, restored["data"], config)
            log.info("resumed from step %d (loader at batch %d)", start, restored["data"]["next_batch"])

        # --- compile ------------------------------------------------------------------------------
        steps_by_size: dict[int, jax.stages.Compiled] = {}  # the step compiled for each global batch size
        # in_memory_batches: the loader's state before the cached batches, which every checkpoint records (a resume
        # caches the same batches and cycles on from where the run was; the state after them would cache others)
        cache_origin = it.get_state() if config.in_memory_batches else None
        first = next(it)  # this host's rows, still in host memory
        tasks.check(program.task, first)  # data the task cannot train on: one line before compiling, not a silent run
        stepping = program  # the program whose step is compiled (remat=auto: the policy chosen)
        if config.model in SIZED_MODELS and config.remat == "auto":  # the fastest that fits (trainer/remat.py)
            # (a ramp-up: chosen at its last, largest batch, so that every size fits)
            widest = first if batch_size == config.batch_size else _resized(first, config.batch_size)

            def compile_with(policy: str) -> jax.stages.Compiled:
                with_policy = dataclasses.replace(program, model=program.model.clone(remat=policy))
                return compile_step(jit_step(with_policy), state, widest, strategy.batch_sharding)

            batch_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(widest)) // jax.local_device_count()
            policy, steps_by_size[config.batch_size] = remat.choose(compile_with, batch_bytes, remat.free_bytes())
            stepping = dataclasses.replace(program, model=program.model.clone(remat=policy))

        def step_for(size: int, host_batch: dict) -> jax.stages.Compiled:
            if size not in steps_by_size:
                steps_by_size[size] = compile_step(jit_step(stepping), state, host_batch, strategy.batch_sharding)
            return steps_by_size[size]

        train_step = step_for(batch_size, first)
        throughput = Throughput.of(program, strategy)

        if config.in_memory_batches:
            cached = [first, *(next(it) for _ in range(config.in_memory_batches - 1))]
            cached = [strategy.distribute(batch) for batch in cached]
            jax.block_until_ready(cached)
            log.info("in_memory_batches=%d: cycling batches held on the devices (no input cost; for measuring the "
                     "input-bound limit)", len(cached))
            fetch = itertools.islice(itertools.cycle(cached), start % len(cached), None).__next__
        else:
            ahead = [first]

            def fetch():
                """The next batch, placed on the devices by this thread: between steps' dispatches, never during one."""
                return strategy.distribute(ahead.pop() if ahead else next(it))

        def resize(size: int) -> None:
            """A ramp-up's next size: the loader's state restored onto batches of `size`, which read on from where the
            last batch ended; its step compiled (before any of its batches is on the devices)."""
            nonlocal it, train_step
            saved = it.get_state()
            it.close()
            it = iter(program.load_train(batch_size=size))
            it.set_state(saved)
            ahead.append(next(it))
            train_step = step_for(size, ahead[0])

        def save(step: int, *, wait: bool) -> bool:
            """Checkpoints `step`; true when it is written on return. With async_checkpointing the loop waits only for
            the arrays to reach host memory (and for the previous checkpoint to be written), unless `wait`."""
            if config.async_checkpointing:
                writing.append((step, time.perf_counter()))
            data = json.loads(json.dumps(cache_origin or it.get_state()))  # (a copy: orbax may serialize it later)
            since_row = pending + np.asarray(jax.device_get(losses), dtype=np.float64).tolist()  # (steps finished)
            if since_row:
                data[PENDING] = since_row
            with checkpoints.writes(mngr):  # (also the failure of the previous checkpoint's writing)
                mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        data=ocp.args.JsonSave(data), config=config_record(config)),
                          force=True)
                if wait or not config.async_checkpointing:
                    mngr.wait_until_finished()
                    return True
            return False

        profile = StepProfile(config.workdir, start + 1 + config.profile_skip, config.profile_steps, chief)
        preemption = PreemptionNotice()  # SIGTERM, to any process: all save at one step and stop
        # (rows after the last one a run without stops writes: its stop rows, and any after the checkpoint)
        metrics = MetricsWriter(config.workdir, start - len(pending)) if chief else None
    except BaseException:
        if it is not None:
            it.close()  # the loader's read-ahead threads and worker processes
        mngr.close()
        raise

    # --- loop -------------------------------------------------------------------------------
    log.info("training steps %d to %d", start + 1, config.steps)
    # Python's full collections scan every object the imports and the setup made (millions with JAX, TF and orbax):
    # one in the loop pauses it for ~0.1 s and more, and a device waits. Collect now, then leave those objects out
    # of every later collection (gc.freeze); the loop's own garbage is collected as before.
    gc.collect()
    gc.freeze()
    losses: list = []
    tokens: list = []
    examples = 0  # in the steps since the last log line
    period_start, data_wait, host_wait, longest_wait, last = time.perf_counter(), 0.0, 0.0, 0.0, {}
    checkpoint_wait = 0.0  # the loop's time held by checkpoints, all of the run
    try:
        for step in range(start + 1, config.steps + 1):
            if ramp is not None and ramp.batch_size(step) != batch_size:
                jax.block_until_ready(state)  # (nothing runs on the devices while a compiler may autotune there)
                t = time.perf_counter()
                batch_size = ramp.batch_size(step)
                resize(batch_size)
                period_start += time.perf_counter() - t  # the rates are the steps', not the compile's
                log.info("step %d: batch_size=%d from here (the ramp-up), its step ready in %.1f s", step, batch_size,
                         time.perf_counter() - t)
            t = time.perf_counter()
            batch = fetch()
            waited = time.perf_counter() - t
            host_wait += waited  # all time blocked on input, also while step - 1 still runs
            if not losses or losses[-1].is_ready():  # no step running: the devices may have idled this long
                data_wait += waited
                longest_wait = max(longest_wait, waited)
            profile.before(step)
            state, loss, real_tokens = train_step(state, batch)
            profile.after(step, loss)
            if losses:
                # At most two steps in flight. Unbounded asynchronous dispatch of collective programs
                # hangs XLA:CPU's in-process all-reduce (reproduced with 8 simulated devices after ~300
                # queued steps); on accelerators one step of lookahead is all the overlap needed.
                losses[-1].block_until_ready()
            losses.append(loss)
            tokens.append(real_tokens)
            examples += batch_size
            stop = preemption.reached(step)
            evaluating = bool(config.eval_data) and itstime(step, config.eval_every, config.steps)
            if itstime(step, config.log_every, config.steps) or stop or evaluating:  # (an eval step is a row too)
                values = np.asarray(jax.device_get(losses), dtype=np.float64)  # waits for the steps
                period = np.concatenate([np.asarray(pending, dtype=np.float64), values])  # (the rates: this run's)
                bad = np.flatnonzero(~np.isfinite(period))
                if bad.size:
                    raise NonFiniteLoss(f"loss is {period[bad[0]]} at step {step - len(period) + 1 + bad[0]}; "
                                        "lower learning_rate or check the data")
                elapsed = time.perf_counter() - period_start
                # a row every run of these settings writes ends the period; a stop's, or the last step's, does not (a
                # run extended by a larger steps= writes the rows of one that had it from the start)
                ends = step % config.log_every == 0 or (evaluating and step % config.eval_every == 0)
                pending = [] if ends else period.tolist()
                last = {"step": step, "loss": float(period.mean()),
                        "examples_per_sec": examples / elapsed,
                        "examples_per_sec_per_device": examples / elapsed / replicas,
                        "step_time_s": elapsed / len(values), "data_wait_fraction": data_wait / elapsed,
                        "data_wait_longest_s": longest_wait, "host_wait_fraction": host_wait / elapsed,
                        "learning_rate": optim.rate_at(config, step - 1),  # the step's own
                        **throughput.rates(examples, jax.device_get(tokens), elapsed), **_component_rows(it),
                        **({"batch_size": batch_size} if ramp is not None else {})}
                if evaluating and not stop:  # (stopping: the checkpoint first; a preemption's grace is ~30 s)
                    try:
                        last.update(program.evaluate(strategy, state["params"], state.get("model_state"),
                                                     stop=preemption.requested))
                    except EvaluationStopped:
                        log.warning("%s during the evaluation at step %d: left off, the checkpoint first",
                                    preemption.reason, step)
                        stop = True
                if metrics:
                    metrics.write(last)
                evals = "".join(f"{k} {v:.4f} " for k, v in last.items()
                                if k.startswith("eval_") and not k.endswith("_examples"))  # (counts: metrics.jsonl)
                log.info("step %d/%d loss %.4f %s%.0f ex/s %sdata-wait %.1f%% (longest %.2f s)%s", step, config.steps,
                         last["loss"], evals, last["examples_per_sec"], throughput.describe(last),
                         100 * last["data_wait_fraction"], longest_wait,
                         optim.described(config, last["learning_rate"]))
                losses, tokens, examples = [], [], 0
                period_start, data_wait, host_wait, longest_wait = time.perf_counter(), 0.0, 0.0, 0.0
            if itstime(step, config.checkpoint_every, config.steps) or stop:
                jax.block_until_ready(state)  # the step in flight finishes first: its time stays in the rates
                t = time.perf_counter()
                written = save(step, wait=stop)  # (stopping: written before the process exits)
                saving = time.perf_counter() - t
                checkpoint_wait += saving
                period_start += saving  # the rates are the steps', not the save's
                log.info("step %d: checkpoint %s in %.1f s%s", step, "saved" if written else "taken", saving,
                         "" if written else " (being written in the background)")
            if stop:
                log.warning("%s: saved a checkpoint at step %d; exiting (the same command resumes from it)",
                            preemption.reason, step)
                return {**last, "preempted": True, "stopped_by": preemption.reason, "final_step": step,
                        "checkpoint_wait_s": checkpoint_wait}
        t = time.perf_counter()
        with checkpoints.writes(mngr):
            mngr.wait_until_finished()  # the last checkpoint is written before the run reports its end
        checkpoint_wait += time.perf_counter() - t
    finally:
        gc.unfreeze()  # (a notebook or test that trains again collects as before)
        it.close()  # stops the loader's read-ahead (threads, worker processes) before the evaluation
        profile.stop()
        preemption.close()
        if metrics:
            metrics.close()
        checkpoints.close(mngr)
    # --- summary ----------------------------------------------------------------------------
    final = final_evaluation(last, config, lambda: program.evaluate(strategy, state["params"],
                                                                    state.get("model_state")))
    return {**last, **final, "preempted": False, "final_step": config.steps, "checkpoint_wait_s": checkpoint_wait}


def final_evaluation(last: dict, config: TrainConfig, evaluate) -> dict:
    """The summary's evaluation: the last step's own (the loop evaluates at the last step), else `evaluate()`."""
    if not config.eval_data:
        return {}
    if last.get("step") == config.steps and any(k.startswith("eval_") for k in last):
        return {}  # (in `last` already)
    return evaluate()


def make_train_step(program: Program, tx: optax.GradientTransformation, strategy: strategies.Strategy):
    """The training step, before jit: (state, batch) -> (new state, mean loss, the batch's real tokens (the task's
    `tokens`; 0 for a task without them))."""
    count = getattr(program.task, "tokens", None)

    def train_step(state, batch):
        state = strategy.on_devices(state)  # central_storage: from host memory; out_shardings put it back
        loss, grads, model_state = program.gradients(state["params"], batch, state.get("model_state"),
                                                     program.step_rng(state["step"]))
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new = {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
               "step": state["step"] + 1}
        if model_state:
            new["model_state"] = model_state
        real = jnp.asarray(count(batch), jnp.float32) if count is not None else jnp.zeros((), jnp.float32)
        return new, loss, real

    return train_step


def compile_step(step, state, host_batch: dict, sharding) -> jax.stages.Compiled:
    """`step` (jitted) compiled ahead of time for `state` and global batches shaped like this process's `host_batch`,
    before any batch is on the devices (a GPU compiler's autotuning takes and frees scratch device memory: nothing
    may be placed meanwhile); logs XLA's account of the device memory the step needs."""
    def global_shape(x):
        x = np.asarray(x)
        return jax.ShapeDtypeStruct((x.shape[0] * jax.process_count(), *x.shape[1:]),
                                    jax.dtypes.canonicalize_dtype(x.dtype), sharding=sharding)

    t = time.perf_counter()
    with preemptions.held_during(), compile_cache.Lookups() as lookups:  # (a SIGTERM raised in it: a segfault)
        compiled = step.lower(state, jax.tree.map(global_shape, host_batch)).compile()
    memory = compiled.memory_analysis()
    if memory is not None:
        log.info("step %s in %.1f s; per device: %s of temporaries, %s of arguments (state and batch), %s of "
                 "outputs not written over the arguments (XLA's memory analysis)",
                 "read from the compilation cache" if lookups.hits else "compiled", time.perf_counter() - t,
                 remat.size(memory.temp_size_in_bytes), remat.size(memory.argument_size_in_bytes),
                 remat.size(memory.output_size_in_bytes - memory.alias_size_in_bytes))
    return compiled


def _log_epochs(program: Program, ramp: Ramp | None) -> None:
    """For packed rows of a pre-tokenized corpus (whose manifest counts its tokens): how much of it the run reads, the
    figure an LM run is sized by."""
    config, train = program.config, program.data.train
    if not config.packing or len(train) != 1 or not train[0].resolved.token_count:
        return
    source = train[0].resolved
    tokens = source.token_count * len(source) / sum(source.records_in_files)  # (a slice: its share, ~)
    rows = ramp.examples(config.steps) if ramp is not None else config.steps * config.batch_size
    log.info("data: %s tokens in %s documents; %d steps read %s rows of %d tokens, ~%.2f epochs of it", f"{tokens:,.0f}",
             f"{len(source):,}", config.steps, f"{rows:,}", config.seq_len, rows * config.seq_len / tokens)


def _resized(host_batch: dict, global_size: int) -> dict:
    """Zeros shaped like `host_batch` with this process's rows of a global batch of `global_size` (to compile for)."""
    rows = global_size // jax.process_count()
    return {k: np.zeros((rows, *np.shape(v)[1:]), np.asarray(v).dtype) for k, v in host_batch.items()}


def _component_rows(it) -> dict[str, int]:
    """A mixture's rows taken from each component so far ("rows_<name>"), from the loader's state."""
    state = it.get_state() if hasattr(it, "get_state") else {}
    return {f"rows_{name}": c["rows"] for name, c in state.get("mixture", {}).get("components", {}).items()}
