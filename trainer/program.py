"""What one training run computes, apart from how it is distributed: the task, the model, the optimizer, the
gradient of a batch, and evaluation over `eval_data`.

The synchronous loop (trainer/train.py), the parameter-server workers (trainer/parameter_server.py) and the
sidecar evaluator (trainer/evaluator.py) build the same Program from the same config, so a checkpoint one writes
the others read.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import loader
from loader.decode import collate
from dataset_format import storage, tfds_info
from trainer import models, optim, tasks
from trainer.config import TrainConfig

log = logging.getLogger(__name__)


def source_split(path: str, default: str | None) -> str | None:
    """TFDS sources (local or gs://) need a split; others must not get one."""
    return default if storage.exists(storage.join(path, tfds_info.INFO_NAME)) else None


@dataclasses.dataclass
class Program:
    config: TrainConfig
    task: Any
    model: Any
    sample: dict[str, np.ndarray]  # one record as the task sees it, a batch of one: shapes the model
    train_split: str | None

    @classmethod
    def build(cls, config: TrainConfig, data: str | None = None) -> Program:
        """The task and model of `config`, shaped by the first record of `data` (default: config.data; the
        evaluator passes eval_data)."""
        data = data or config.data
        split = config.split if data == config.data else None
        split = split or source_split(data, "train" if data == config.data else "test")
        task = tasks.make(config, _feature_specs(data))
        if config.packing and not hasattr(task, "packing"):
            raise ValueError(f"packing=true needs a task that packs token sequences (task=lm); task={config.task!r} "
                             "does not")
        model = models.make(config.model, task.model_kwargs())
        return cls(config, task, model, _sample(data, split, task), split)

    # --- parameters and optimizer --------------------------------------------------------------
    def init_params(self) -> Any:
        return self.model.init(jax.random.key(self.config.seed), self.task.inputs(self.sample))["params"]

    def abstract_params(self) -> Any:
        """The parameters' shapes and dtypes, without computing them (what a checkpoint restore needs)."""
        return jax.eval_shape(self.init_params)

    def optimizer(self) -> optax.GradientTransformation:
        return optim.make(self.config)

    def load_train(self, **kwargs):
        """The training batches (loader.load), with the task's features or packing."""
        c = self.config
        task_args = ({"packing": self.task.packing} if c.packing else
                     {"features": self.task.features, "map_fn": getattr(self.task, "preprocess", None)})
        options = dict(batch_size=c.batch_size, seed=c.seed, split=self.train_split, worker_count=c.data_workers,
                       **task_args)
        return loader.load(c.data, **{**options, **kwargs})

    # --- the step's math ---------------------------------------------------------------------
    def compute(self, tree: Any) -> Any:
        """The floating-point leaves in the compute dtype (identity for float32)."""
        if self.config.dtype == "float32":
            return tree
        target = jnp.dtype(self.config.dtype)
        return jax.tree.map(lambda x: x.astype(target) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    def outputs(self, params, batch):
        outputs = self.model.apply({"params": self.compute(params)}, self.compute(self.task.inputs(batch)))
        return jax.tree.map(lambda o: o.astype(jnp.float32), outputs)

    def loss_sums(self, params, batch):
        """(sum of the losses, sum of the weights) of a batch."""
        return self.task.losses(self.outputs(params, batch), batch).sum(), tasks.weights(self.task, batch).sum()

    def gradients(self, params, batch):
        """(mean loss, gradient of the mean) over the batch; with grad_accum_steps=k in k micro-batches (rows i,
        i+k, ...: every device keeps a share of each). Traced inside a jitted step."""
        grad_sums = jax.value_and_grad(self.loss_sums, has_aux=True)
        k = self.config.grad_accum_steps
        if k == 1:
            (loss_sum, weight), grads = grad_sums(params, batch)
        else:
            micro = jax.tree.map(lambda x: x.reshape((x.shape[0] // k, k) + x.shape[1:]).swapaxes(0, 1), batch)

            def accumulate(carry, mb):
                (l, w), g = grad_sums(params, mb)
                return jax.tree.map(jnp.add, carry, (g, l, w)), None

            zeros = (jax.tree.map(jnp.zeros_like, params), jnp.zeros(()), jnp.zeros(()))
            (grads, loss_sum, weight), _ = jax.lax.scan(accumulate, zeros, micro)
        return loss_sum / weight, jax.tree.map(lambda g: g / weight, grads)

    # --- evaluation --------------------------------------------------------------------------
    @functools.cached_property
    def eval_step(self):
        """The jit-compiled eval step, made once per Program (a new closure per eval would recompile each time):
        weighted sums of the task's losses and metrics over a batch, and of the weights (0 for padding rows)."""
        task = self.task

        @jax.jit
        def eval_step(params, batch, real):
            outputs = self.outputs(params, batch)
            sums = {name: jnp.sum(values * real) for name, values in task.metrics(outputs, batch).items()}
            sums["loss"] = jnp.sum(task.losses(outputs, batch) * real)
            return sums, jnp.sum(tasks.weights(task, batch) * real), jnp.sum(real)

        return eval_step

    def evaluate(self, strategy, params) -> dict[str, float]:
        """The task's metrics and loss over one pass of eval_data (each process its rows; short batches padded
        and masked): {"eval_<metric>": mean, "eval_loss": mean, "eval_examples": count}."""
        config, task = self.config, self.task
        params = strategy.on_devices(params)
        batches = loader.load(config.eval_data, batch_size=config.batch_size, shuffle=False, num_epochs=1,
                              drop_remainder=False, split=source_split(config.eval_data, "test"),
                              features=task.features, map_fn=getattr(task, "preprocess", None))
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
            sums, w, n = self.eval_step(params, strategy.distribute(batch), strategy.distribute(weights))
            for name, value in sums.items():
                totals[name] = totals.get(name, 0.0) + float(value)
            weight, examples = weight + float(w), examples + float(n)
        return {**{f"eval_{name}": value / weight for name, value in sorted(totals.items())},
                "eval_examples": int(examples)}


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
