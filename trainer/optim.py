"""The optimizer the config names: optax by name, a warmup + decay schedule, weight decay and global-norm clipping.

    optimizer=adamw learning_rate=3e-4 schedule=cosine warmup_steps=100 weight_decay=0.01 grad_clip=1.0

- `optimizer`: adam, adamw (decoupled weight decay), sgd (with `momentum`, `nesterov`, weight decay added to the
  gradient), adafactor (factored second moments, MaxText's and T5's memory-light choice). Adam's `adam_b1`, `adam_b2` and
  `adam_eps` by MaxText's names (optax's defaults; LLM pretraining commonly takes adam_b2=0.95).
- `schedule`: constant, cosine or linear decay from `learning_rate` to `learning_rate * end_lr_fraction` at the
  last step (`learning_rate_schedule_steps`, by default `steps`; held there after it), after `warmup_steps` of linear
  warmup from 0.
- `weight_decay_on`: all (every parameter, optax's and MaxText's way) or matrices (parameters of two or more
  dimensions: kernels and embeddings; not biases, norm scales or batch-norm offsets: nanoGPT's, Hugging Face's and
  big_vision's way). The optimizer state holds the same arrays either way, but not the same structure: a resume with
  the other setting is one line naming the one its checkpoint was written with.
- `grad_clip`: the global norm gradients are clipped to first (0: off).
Gradient accumulation and mixed precision are the training step's (trainer/train.py), not the optimizer's.
"""

from __future__ import annotations

import jax
import optax


def schedule(config) -> optax.Schedule | float:
    """The learning rate at each update step (a plain float when constant: the optimizer state then has no step
    count, as before schedules existed, so older checkpoints still restore)."""
    peak, warmup = config.learning_rate, config.warmup_steps
    if config.schedule == "constant" and not warmup:
        return peak
    end = peak * config.end_lr_fraction
    decay_steps = max(1, config.schedule_steps - warmup)
    if config.schedule == "constant":
        main = optax.constant_schedule(peak)
    elif config.schedule == "cosine":
        main = optax.cosine_decay_schedule(peak, decay_steps, alpha=config.end_lr_fraction)
    else:
        main = optax.linear_schedule(peak, end, decay_steps)
    if not warmup:
        return main
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), main], [warmup])


def rate_at(config, step: int) -> float:
    """The learning rate of the update after `step` updates (the optimizer's count)."""
    rate = schedule(config)
    return float(rate) if isinstance(rate, (int, float)) else float(rate(step))


def untrained_steps(config) -> str | None:
    """A warning when steps past the schedule's end train at learning rate 0 (a decay to end_lr_fraction=0 that ends
    before `steps`, learning_rate_schedule_steps set below it): they would not change the model."""
    end = config.schedule_steps
    if config.schedule == "constant" or config.end_lr_fraction or config.steps <= end:
        return None
    return (f"steps {end + 1}-{config.steps} train at learning rate 0: the {config.schedule} schedule ends at step "
            f"{end} (learning_rate_schedule_steps={end}) with end_lr_fraction=0; set end_lr_fraction > 0 to train on "
            f"at a fraction of the peak, or learning_rate_schedule_steps={config.steps} to decay over them all")


def described(config, rate: float) -> str:
    """" lr X" for a log line when the learning rate moves (a schedule or warmup), else ""."""
    return f" lr {rate:.3g}" if config.schedule != "constant" or config.warmup_steps > 0 else ""


def matrices(params):
    """True for each parameter of two or more dimensions (weight_decay_on=matrices decays those alone)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make(config) -> optax.GradientTransformation:
    """The optimizer of `config` (see module doc); its values were checked by TrainConfig."""
    lr = schedule(config)
    mask = matrices if config.weight_decay_on == "matrices" else None
    moments = {"b1": config.adam_b1, "b2": config.adam_b2, "eps": config.adam_eps}
    if config.optimizer == "adam":
        tx = optax.adam(lr, **moments)
    elif config.optimizer == "adamw":
        tx = optax.adamw(lr, **moments, weight_decay=config.weight_decay, mask=mask)
    elif config.optimizer == "sgd":
        tx = optax.chain(optax.add_decayed_weights(config.weight_decay, mask=mask),
                         optax.sgd(lr, momentum=config.momentum or None, nesterov=config.nesterov))
    else:
        tx = optax.adafactor(lr, weight_decay_rate=config.weight_decay or None, weight_decay_mask=mask)
    if config.grad_clip:
        tx = optax.chain(optax.clip_by_global_norm(config.grad_clip), tx)
    return tx
