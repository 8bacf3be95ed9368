"""The run's checkpoints: where they are, whether a run is already finished, whether the latest one fits this run's
model, and the settings kept beside each.

Each checkpoint (orbax, under WORKDIR/checkpoints, the last 3 kept) holds `state` (parameters, optimizer state,
step), `data` (the loader's position) and `config` (the settings of the run that wrote it, read back only to say
which of them changed when a resumed run's model has other shapes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp

from dataset_format import storage
from trainer import optim
from trainer.config import LAYOUT_KEYS, TrainConfig, setting_text

log = logging.getLogger(__name__)


MAX_TO_KEEP = 3  # checkpoints kept: a step with this many finished ones after it is being deleted


def checkpoint_manager(config: TrainConfig, on_written: Callable[[], None] | None = None) -> ocp.CheckpointManager:
    """The run's checkpoints (config.checkpoint_dir), the last 3 kept; the parameter-server coordinator's too. Each
    holds `state` (arrays), `data` (the loader's position) and `config` (the settings of the run that wrote it).
    With `async_checkpointing`, `save` returns once the arrays are in host memory and orbax writes them in a thread
    of its own (a step's donated buffers are then free to reuse); the next save, `wait_until_finished` and `close`
    wait for it, and raise what went wrong in it. `on_written` is called (in orbax's thread) as each is committed."""
    options = ocp.CheckpointManagerOptions(max_to_keep=MAX_TO_KEEP,
                                           enable_async_checkpointing=config.async_checkpointing,
                                           async_options=ocp.AsyncOptions(post_finalization_callback=on_written))
    return ocp.CheckpointManager(config.checkpoint_dir, options=options,
                                 item_handlers={"state": ocp.StandardCheckpointHandler(),
                                                "data": ocp.JsonCheckpointHandler(),
                                                "config": ocp.JsonCheckpointHandler()})


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full disk, a bucket the job may not write): a failure of the run's
    storage, not a bad setting (exit 1, not 2)."""


@contextlib.contextmanager
def writes(mngr: ocp.CheckpointManager):
    """Around a call that writes checkpoints, or waits for one being written (save, wait_until_finished, close): its
    failure, orbax's or the storage's, is a CheckpointWriteError naming the directory and the fix."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - tensorstore's ValueError, an OSError, gcsfs's errors: all the storage's
        cause = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointWriteError(f"writing a checkpoint to {mngr.directory} failed: {cause}; make room there or "
                                   "let the job write it, then run again: it resumes from the last checkpoint "
                                   "written") from e


def close(mngr: ocp.CheckpointManager) -> None:
    """Closes `mngr`, which waits for a checkpoint still being written. Its failure raises, unless another error is
    already on its way out (called from a `finally`): that one is the run's cause, and this one is logged."""
    leaving = sys.exc_info()[1]
    try:
        with writes(mngr):
            mngr.close()
    except CheckpointWriteError as e:
        if leaving is None:
            raise
        log.error("%s", e)


# The settings that give the parameters their shapes: named when a checkpoint's shapes differ from this run's.
SHAPING_KEYS = ("task", "model", "width", "depth", "heads", "mlp_ratio", *LAYOUT_KEYS, "seq_len", "vocab_size",
                "tokenizer", "text_key", "num_classes", "image_size", "optimizer")


COMMIT_MARKER = "commit_success.txt"  # (orbax's: a gs:// checkpoint is finished once this object is in it)


def finished_steps(directory: str) -> list[int]:
    """The steps of the finished checkpoints in `directory`, listed afresh at each call. On gs:// from Cloud Storage
    itself: the file-system layer orbax lists through keeps the listings it has made, so an evaluator beside a running
    trainer saw only the checkpoints that were there at its first look."""
    if not storage.is_remote(directory):
        return sorted(ocp.utils.checkpoint_steps(directory)) if os.path.isdir(directory) else []
    named = sorted(int(n) for n in storage.entries(directory) if n.isdigit())
    return [s for s in named if storage.exists(storage.join(storage.join(directory, str(s)), COMMIT_MARKER))]


def config_record(config: TrainConfig) -> ocp.args.JsonSave:
    """The run's settings as saved beside each checkpoint (read back only to explain a mismatch)."""
    return ocp.args.JsonSave(json.loads(json.dumps(dataclasses.asdict(config), default=str)))


def check_restorable(mngr: ocp.CheckpointManager, step: int, abstract: Any, config: TrainConfig) -> None:
    """One line before any restore when the checkpoint at `step` holds parameters of other shapes than this run's
    model (orbax would fail inside the restore with its own advice, which is not the fix): the first array that
    differs, and the shaping settings the run that wrote it had otherwise."""
    try:
        stored = mngr.item_metadata(step)["state"]
    except Exception:  # noqa: BLE001 - no readable metadata: orbax's restore reports what is wrong
        return
    if stored is None:
        return
    ours = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(abstract.get("params", {}))}
    theirs = {jax.tree_util.keystr(p): x
              for p, x in jax.tree_util.tree_leaves_with_path(dict(stored).get("params", {}))}
    differs = [(k, getattr(theirs.get(k), "shape", None), getattr(ours.get(k), "shape", None))
               for k in sorted(ours.keys() | theirs.keys())
               if k not in ours or k not in theirs or tuple(ours[k].shape) != tuple(theirs[k].shape)]
    if not differs:
        return
    name, there, here = differs[0]
    what = (f"params{name} is {tuple(there) if there is not None else 'absent'} there and "
            f"{tuple(here) if here is not None else 'absent'} here")
    changed = _written_otherwise(mngr, step, config, SHAPING_KEYS)
    fix = (f"resume with {' '.join(changed)} (what it was written with)" if changed else
           "resume with the settings it was written with (model=, width=, depth=, heads=, seq_len=, vocab_size=, "
           "num_classes=, ...)")
    more = f", and {len(differs) - 1} more arrays differ" if len(differs) > 1 else ""
    raise ValueError(f"{config.checkpoint_dir} holds step {step} of a model other than this one ({what}{more}): "
                     f"{fix}, or pass another workdir= to start afresh")


# The settings that decide which batches the loader's state counts.
DATA_KEYS = ("data", "split", "batch_size", "seed", "packing", "seq_len")


def restore_loader(it, mngr: ocp.CheckpointManager, step: int, saved: dict, config: TrainConfig) -> None:
    """`it.set_state(saved)`; a state of other batches (another split, batch size, seed...) is one line naming the
    settings the run that wrote it had."""
    try:
        it.set_state(saved)
    except ValueError as e:
        changed = _written_otherwise(mngr, step, config, DATA_KEYS)
        if not changed:
            raise
        raise ValueError(f"{config.checkpoint_dir} holds step {step} of a run over other batches: resume with "
                         f"{' '.join(changed)} (what it was written with), or pass another workdir= to start afresh "
                         f"(the loader: {e})") from None


# The settings that give the optimizer's state its structure.
OPTIMIZER_KEYS = ("optimizer", "grad_clip", "weight_decay", "weight_decay_on", "schedule", "warmup_steps")


# The settings that give the learning rate at each step.
SCHEDULE_KEYS = ("learning_rate", "schedule", "warmup_steps", "end_lr_fraction", "steps",
                 "learning_rate_schedule_steps")


def check_schedule(written: dict, step: int, config: TrainConfig) -> None:
    """Warns when the learning rate after `step` is not the one the run that wrote the checkpoint there (its settings:
    `written`) had: above all steps= raised under a decaying schedule, which stretches the decay, so the rate jumps
    back up."""
    keys = {k: written[k] for k in SCHEDULE_KEYS if k in written and written[k] != getattr(config, k)}
    if not keys:
        return
    try:
        before = dataclasses.replace(config, **keys)
    except (TypeError, ValueError):  # (settings this version refuses: nothing to compare)
        return
    was, now = optim.rate_at(before, step), optim.rate_at(config, step)
    if abs(now - was) <= 1e-6 * max(abs(was), 1e-12):
        return
    keep = ""
    if "steps" in keys and config.learning_rate_schedule_steps is None and config.schedule != "constant":
        keep = "; " + _keeping(before)
    log.warning("resuming step %d, written with %s: the learning rate there is now %.3g where that run had %.3g%s",
                step, " ".join(f"{k}={setting_text(v)}" for k, v in keys.items()), now, was, keep)


def _keeping(config: TrainConfig) -> str:
    """How to raise steps= and keep the learning rates of `config`'s decaying schedule, for a message: its
    learning_rate_schedule_steps, unless the schedule ends at 0, where the steps after it would not train."""
    end = config.schedule_steps
    if config.end_lr_fraction == 0:
        return (f"its {config.schedule} schedule ends at learning rate 0 at step {end} (end_lr_fraction=0), so "
                f"keeping it (learning_rate_schedule_steps={end}) would leave the steps after it untrained: let the "
                "decay stretch to the new steps, or set end_lr_fraction > 0 with it")
    return (f"to keep its {config.schedule} schedule and train on at its end rate after step {end}, pass "
            f"learning_rate_schedule_steps={end}")


def _written(mngr: ocp.CheckpointManager, step: int) -> dict:
    """The settings of the run that wrote the checkpoint at `step` ({} for checkpoints written before they were)."""
    try:
        return mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"] or {}
    except Exception:  # noqa: BLE001 - checkpoints written before the settings were saved beside them
        return {}


def _written_otherwise(mngr: ocp.CheckpointManager, step: int, config: TrainConfig, keys: tuple[str, ...]) -> list[str]:
    """`KEY=VALUE` for each of `keys` that the run which wrote the checkpoint at `step` had otherwise."""
    return settings_otherwise(_written(mngr, step), config, keys)


def settings_otherwise(written: dict, config: TrainConfig, keys: tuple[str, ...]) -> list[str]:
    """`KEY=VALUE` for each of `keys` that the settings `written` have otherwise than `config`."""
    now = json.loads(json.dumps(dataclasses.asdict(config), default=str))
    return [f"{k}={setting_text(written[k])}" for k in keys if k in written and written[k] != now.get(k)]


def restore(mngr: ocp.CheckpointManager, step: int, abstract: Any, config: TrainConfig) -> dict[str, Any]:
    """The training state and loader state at `step`. A state whose structure is not this run's (an optimizer
    changed: its state holds other arrays) is one line naming the settings the run that wrote it had, not orbax's
    advice (partial_restore=True, which the trainer has no setting for)."""
    check_restorable(mngr, step, abstract, config)
    written = _written(mngr, step)  # (read once: on gs:// each read is requests)
    try:
        restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                               data=ocp.args.JsonRestore()))
    except Exception as e:  # noqa: BLE001 - orbax's, tensorstore's, json's, the storage's: any, named below
        if not (isinstance(e, ValueError) and "tree structures do not match" in str(e)):
            raise unreadable(config.checkpoint_dir, step, e, _steps(mngr)) from e
        changed = settings_otherwise(written, config, tuple(dict.fromkeys(SHAPING_KEYS + OPTIMIZER_KEYS)))
        fix = (f"resume with {' '.join(changed)} (what it was written with)" if changed else
               "resume with the settings it was written with (optimizer=, grad_clip=, ...)")
        raise ValueError(f"{config.checkpoint_dir} holds step {step} of a training state other than this run's (its "
                         f"optimizer state holds other arrays): {fix}, or pass another workdir= to start afresh") from None
    # (said once the state has restored: a resume that cannot restore gets its error alone, not advice before it)
    check_schedule(written, step, config)
    layout = settings_otherwise(written, config, LAYOUT_KEYS)
    if layout:  # the same shapes, another function: allowed (a longer rope wavelength to extend the context), said
        log.warning("resuming step %d, written with %s: the model computes otherwise from here on (resume with those "
                    "to continue the same model)", step, " ".join(layout))
    return restored


def _steps(mngr: ocp.CheckpointManager) -> list[int] | None:
    """The checkpoints there, or None when listing them fails too (the storage failing again: the line says less, not
    another error)."""
    try:
        return list(mngr.all_steps())
    except Exception:  # noqa: BLE001
        return None


class UnreadableCheckpoint(RuntimeError):
    """A checkpoint that could not be read: damaged, partly written, or its storage failing."""


def unreadable(directory: str, step: int, error: BaseException, steps: Any = "evaluator") -> UnreadableCheckpoint:
    """The error for checkpoint `step` in `directory` that could not be read: what failed, and the way on (its files
    and orbax's error named neither: a JSON error at exit 2, or pages of tensorstore's spec). `steps`: the
    checkpoints there, for a resume (None: a resume's whose listing failed too; "evaluator": an evaluator's, which goes
    on with the next one)."""
    first = (str(error).strip().splitlines() or [""])[0][:300]
    if steps == "evaluator":
        then = "run the evaluator again: it goes on with the next one"
    elif steps is None:
        then = "the run resumes from the latest checkpoint before it (or starts afresh where there is none)"
    else:
        before = [s for s in steps if s < step]
        then = f"the run resumes from step {max(before)}" if before else "the run starts afresh"
    target = storage.join(directory, str(step))
    return UnreadableCheckpoint(f"checkpoint {step} in {directory} cannot be read ({type(error).__name__}: {first}); "
                                f"if it is damaged or partly written, move it aside (e.g. to {target}.unreadable) and "
                                f"{then}; if its storage failed, run again")


def finished_run(config: TrainConfig, mngr: ocp.CheckpointManager) -> dict[str, Any] | None:
    """The summary of a run whose latest checkpoint is at `steps` or past it, after one line saying so; None when
    there is training to do. Nothing is built for it: no model, no data, no compile."""
    latest = mngr.latest_step()
    if latest is None or latest < config.steps:
        return None
    keep = (f" ({_keeping(config)})" if config.schedule != "constant" and
            config.learning_rate_schedule_steps is None else "")
    log.info("nothing to do: %s holds a checkpoint at step %d and steps=%d; raise steps=%s to train on from it, or "
             "pass another workdir=", config.checkpoint_dir, latest, config.steps, keep)
    return {"preempted": False, "final_step": latest, "already_finished": True}
