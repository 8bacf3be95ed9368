"""The sidecar evaluator (tf's `SidecarEvaluator`): `python -m trainer mode=evaluate ...`, or a TF_CONFIG task of
type "evaluator".

It watches WORKDIR/checkpoints (as tf's checkpoints_iterator: the newest finished checkpoint, each time there is a
newer one; orbax's copies each checkpoint into the trainer's directory first, which a read-only mount refuses),
restores each new checkpoint's parameters only, runs the task's evaluation over `eval_data` and appends `{"step",
"eval_loss", "eval_<metric>", "eval_examples"}` to WORKDIR/eval/metrics.jsonl and TensorBoard (WORKDIR/eval). It
stops after evaluating step `steps` where it is given, else the last step of the training run that wrote the
checkpoint (its `steps`, saved beside it), or after `eval_timeout` seconds without a new checkpoint. It never joins
the training cluster: it only reads files, so it can run anywhere the checkpoints are visible, and a restarted
evaluator goes on after the last step it recorded. One evaluator a workdir: it holds WORKDIR/eval's lease
(trainer/job.py), and a second one stops with a line naming it. A checkpoint of a model with other settings than
its own (the training run's are saved beside each checkpoint) stops it with one line naming them.

The trainer keeps max_to_keep checkpoints: one deleted between being listed and being read (or while it is read) is
skipped with a log line, not fatal (the next one is evaluated).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import jax
import orbax.checkpoint as ocp

from dataset_format import storage
from trainer import accelerators, checkpoints as checkpoints_lib, compile_cache, job, metrics as metrics_lib
from trainer import preemption, strategy as strategies
from trainer.config import LAYOUT_KEYS, TrainConfig
from trainer.program import Program

log = logging.getLogger(__name__)

_LOCAL_STRATEGIES = ("default", "one_device", "mirrored", "central_storage")
_DEFAULT_STEPS = next(f.default for f in dataclasses.fields(TrainConfig) if f.name == "steps")


def evaluate_checkpoints(config: TrainConfig) -> dict[str, Any]:
    if not config.eval_data:
        raise ValueError("mode=evaluate needs eval_data= (the data each checkpoint is evaluated on)")
    eval_dir = storage.join(config.workdir, "eval")
    # a cache of its own (WORKDIR/eval/compilation_cache with auto): the trainer may be writing the same programs
    try:
        with job.evaluating_alone(eval_dir), compile_cache.enabled(config.compilation_cache, eval_dir):
            return _evaluate_checkpoints(config)
    except preemption.Terminated:  # (python -m trainer's: its lease given back, its metrics closed)
        raise preemption.Terminated(f"stopped by SIGTERM (the same command goes on after the last step in "
                                    f"{storage.join(eval_dir, metrics_lib.NAME)})") from None


def _evaluate_checkpoints(config: TrainConfig) -> dict[str, Any]:
    accelerators.warn_if_unused()
    config = dataclasses.replace(config, mode="evaluate")  # (eval_data shapes the model; data= is not read)
    program = Program.build(config)
    strategy = _strategy(config)
    checkpoints = config.checkpoint_dir
    eval_dir = storage.join(config.workdir, "eval")
    done = [r["step"] for r in metrics_lib.read(eval_dir)]
    last = max(done, default=0)
    # steps= given: the last step to wait for; left at its default, the training run's own last step (its steps=,
    # saved beside each checkpoint): the default stopped an evaluator at step 1000 of a longer run, exit 0
    limit = None if config.steps == _DEFAULT_STEPS else config.steps
    if limit is not None and last >= limit:
        log.info("evaluator: step %d is already evaluated (%s); nothing to do", last, eval_dir)
        return {"checkpoints_evaluated": 0, "checkpoints_skipped": 0, "final_step": last}
    on_devices = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=strategy.replicated)  # noqa: E731
    abstract = {"params": jax.tree.map(on_devices, program.abstract_params())}
    if program.has_state:
        abstract["model_state"] = jax.tree.map(on_devices, program.abstract_model_state())
    log.info("evaluator: watching %s for checkpoints after step %d, until %s (eval_timeout=%gs); results in %s",
             checkpoints, last, f"step {limit}" if limit is not None else "the training run's last step",
             config.eval_timeout, eval_dir)
    writer = metrics_lib.MetricsWriter(eval_dir, last, tensorboard_dir=eval_dir)
    record: dict[str, Any] = {}
    evaluated = skipped = 0
    try:
        for step in new_checkpoints(checkpoints, last, config.eval_timeout):
            if step <= last:
                continue
            written = _written(checkpoints, step)
            _check_model(written, step, config)
            restored = restore_params(checkpoints, step, abstract)
            if restored is None:
                skipped += 1
                continue
            record = {"step": step, **program.evaluate(strategy, restored["params"], restored.get("model_state"))}
            writer.write(record)
            evaluated, last = evaluated + 1, step
            log.info("evaluator: step %d %s", step,
                     " ".join(f"{k} {v:.4f}" for k, v in record.items()
                              if k.startswith("eval_") and not k.endswith("_examples")))
            if limit is not None and step >= limit:
                break
            final = written.get("steps") if isinstance(written.get("steps"), int) else None
            if final is not None and step >= final:
                log.info("evaluator: step %d is the last of the training run that wrote it (its steps=%d); stopping",
                         step, final)
                break
        else:
            if not evaluated and not done and not storage.names_something(checkpoints):  # (a workdir= misspelt: it
                raise ValueError(f"no checkpoint in {checkpoints} after eval_timeout={config.eval_timeout:g}s: the "
                                 "directory does not exist; check workdir= (the training run's)")  # exited 0)
            log.warning("evaluator: no new checkpoint for %gs; stopping after step %d", config.eval_timeout, last)
    finally:
        writer.close()
    return {**record, "checkpoints_evaluated": evaluated, "checkpoints_skipped": skipped, "final_step": last}


def _strategy(config: TrainConfig) -> strategies.Strategy:
    """The evaluator's own devices: the training strategy where it is a local one, else all local devices, or one
    where the batch does not split over them (a parameter-server worker's batch_size is its own)."""
    if config.strategy in _LOCAL_STRATEGIES:
        strategy = strategies.make(config.strategy, device=config.device)
        replicas = strategy.num_replicas_in_sync
        if config.batch_size % replicas:
            raise ValueError(f"batch_size={config.batch_size} does not split over the evaluator's "
                             f"num_replicas_in_sync={replicas} (strategy={config.strategy}); use a multiple of "
                             f"{replicas}, or strategy=default (one device)")
        return strategy
    strategy = strategies.make("mirrored")
    if config.batch_size % strategy.num_replicas_in_sync:
        log.info("evaluator: batch_size=%d does not split over this host's %d devices: evaluating on one",
                 config.batch_size, strategy.num_replicas_in_sync)
        return strategies.make("default")
    return strategy


def new_checkpoints(directory: str, after: int, timeout: float, poll: float = 1.0) -> Iterator[int]:
    """The newest finished checkpoint's step, each time there is one newer than the last (those written meanwhile
    are passed over, as tf's checkpoints_iterator does); ends once `timeout` seconds pass without one. It only lists
    the directory: orbax's iterator first copies each checkpoint whole into DIR/_SNAPSHOTS, which fails where the
    evaluator may only read, fills the trainer's storage, and was not read from anyway."""
    last, since = after, time.monotonic()
    while True:
        listed = checkpoints_lib.finished_steps(directory)
        steps = [s for s in listed if s > last]
        if steps:
            last = max(steps)
            yield last
            since = time.monotonic()
            continue
        left = timeout - (time.monotonic() - since)
        if left <= 0:
            return
        time.sleep(min(poll, left))


def restore_params(checkpoints: str, step: int, abstract: dict) -> dict | None:
    """{"params": ..., and "model_state" when `abstract` has it} of checkpoint `step` (a partial restore: no
    optimizer state is read), or None when the checkpoint was deleted (max_to_keep) before or while it was read."""
    path = storage.join(storage.join(checkpoints, str(step)), "state")
    try:
        with ocp.PyTreeCheckpointer() as checkpointer:
            restored = checkpointer.restore(path, args=ocp.args.PyTreeRestore(
                item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
                partial_restore=True))
        return restored
    except Exception as e:  # noqa: BLE001 - whatever the storage layer raised, it only matters if the files are there
        there = storage.exists(storage.join(path, "_METADATA")) if storage.is_remote(path) else os.path.exists(path)
        if there and not _being_deleted(checkpoints, step):
            raise checkpoints_lib.unreadable(checkpoints, step, e) from e
        log.warning("evaluator: checkpoint %d was deleted (max_to_keep) before it could be read; skipped", step)
        return None


def _written(checkpoints: str, step: int) -> dict:
    """The settings of the training run that wrote checkpoint `step` (saved beside it), or {}."""
    import json

    try:
        text = storage.read_text(storage.join(storage.join(storage.join(checkpoints, str(step)), "config"), "metadata"))
        written = json.loads(text) if text else {}
    except Exception:  # noqa: BLE001 - deleted meanwhile, or not ours: `steps=` and eval_timeout stop the evaluator
        return {}
    return written if isinstance(written, dict) else {}


# The settings that make the model's function: a checkpoint evaluated under others (a partial restore loads the arrays
# both models have) gave wrong numbers without a word, or orbax's advice on shapes, which is not the fix.
MODEL_KEYS = ("task", "model", "width", "depth", "heads", "mlp_ratio", *LAYOUT_KEYS, "vocab_size", "num_classes",
              "image_size")


def _check_model(written: dict, step: int, config: TrainConfig) -> None:
    changed = checkpoints_lib.settings_otherwise(written, config, MODEL_KEYS)
    if changed:
        raise ValueError(f"checkpoint {step} in {config.checkpoint_dir} is of a model with {' '.join(changed)} (the "
                         f"training run's settings): evaluate with those, as this command computes another model")


def _being_deleted(checkpoints: str, step: int) -> bool:
    """Whether the trainer is deleting checkpoint `step`: MAX_TO_KEEP newer ones are finished (a deletion removes
    the files inside a checkpoint before its directory, object by object on gs://)."""
    try:
        newer = [s for s in checkpoints_lib.finished_steps(checkpoints) if s > step]
    except Exception:  # noqa: BLE001 - the listing failed too: the read's own error is the one to see
        return False
    return len(newer) >= checkpoints_lib.MAX_TO_KEEP
