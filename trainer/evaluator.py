"""The sidecar evaluator (tf's `SidecarEvaluator`): `python -m trainer mode=evaluate ...`, or a TF_CONFIG task of
type "evaluator".

It watches WORKDIR/checkpoints (orbax's checkpoints_iterator), restores each new checkpoint's parameters only, runs
the task's evaluation over `eval_data` and appends `{"step", "eval_loss", "eval_<metric>", "eval_examples"}` to
WORKDIR/eval/metrics.jsonl and TensorBoard (WORKDIR/eval). It stops after evaluating step `steps`, or after
`eval_timeout` seconds without a new checkpoint. It never joins the training cluster: it only reads files, so it
can run anywhere the checkpoints are visible, and a restarted evaluator goes on after the last step it recorded. One
evaluator a workdir: it holds WORKDIR/eval's lease (trainer/job.py), and a second one stops with a line naming it.

The trainer keeps max_to_keep checkpoints: one deleted between being listed and being read is skipped with a log
line, not fatal (the next one is evaluated).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from dataset_format import storage
from trainer import accelerators, compile_cache, job, metrics as metrics_lib, preemption, strategy as strategies
from trainer.config import TrainConfig
from trainer.program import Program

log = logging.getLogger(__name__)

_LOCAL_STRATEGIES = ("default", "one_device", "mirrored", "central_storage")


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
    # The evaluator's own devices: the training strategy where it is a local one, else all local devices.
    strategy = strategies.make(config.strategy if config.strategy in _LOCAL_STRATEGIES else "mirrored",
                               device=config.device)
    checkpoints = config.checkpoint_dir
    eval_dir = storage.join(config.workdir, "eval")
    done = [r["step"] for r in metrics_lib.read(eval_dir)]
    last = max(done, default=0)
    if last >= config.steps:
        log.info("evaluator: step %d is already evaluated (%s); nothing to do", last, eval_dir)
        return {"checkpoints_evaluated": 0, "checkpoints_skipped": 0, "final_step": last}
    on_devices = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=strategy.replicated)  # noqa: E731
    abstract = {"params": jax.tree.map(on_devices, program.abstract_params())}
    if program.has_state:
        abstract["model_state"] = jax.tree.map(on_devices, program.abstract_model_state())
    log.info("evaluator: watching %s for checkpoints after step %d, until step %d (eval_timeout=%gs); results in %s",
             checkpoints, last, config.steps, config.eval_timeout, eval_dir)
    storage.makedirs(checkpoints)  # the trainer may not have started yet
    writer = metrics_lib.MetricsWriter(eval_dir, last, tensorboard_dir=eval_dir)
    record: dict[str, Any] = {}
    evaluated = skipped = 0
    try:
        for step in ocp.checkpoint_utils.checkpoints_iterator(checkpoints, timeout=int(config.eval_timeout)):
            if step <= last:
                continue
            restored = restore_params(checkpoints, step, abstract)
            if restored is None:
                skipped += 1
                continue
            record = {"step": step, **program.evaluate(strategy, restored["params"], restored.get("model_state"))}
            writer.write(record)
            evaluated, last = evaluated + 1, step
            log.info("evaluator: step %d %s", step,
                     " ".join(f"{k} {v:.4f}" for k, v in record.items() if k.startswith("eval_") and k != "eval_examples"))
            if step >= config.steps:
                break
        else:
            log.warning("evaluator: no new checkpoint for %gs; stopping after step %d", config.eval_timeout, last)
    finally:
        writer.close()
    return {**record, "checkpoints_evaluated": evaluated, "checkpoints_skipped": skipped, "final_step": last}


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
    except Exception:  # noqa: BLE001 - whatever the storage layer raised, it only matters if the files are still there
        if storage.exists(storage.join(path, "_METADATA")) if storage.is_remote(path) else os.path.exists(path):
            raise
        log.warning("evaluator: checkpoint %d was deleted (max_to_keep) before it could be read; skipped", step)
        return None
