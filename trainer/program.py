"""What one training run computes, apart from how it is distributed: the task, the model, the optimizer, the
gradient of a batch, and evaluation over `eval_data`.

The synchronous loop (trainer/train.py), the parameter-server workers (trainer/parameter_server.py) and the
sidecar evaluator (trainer/evaluator.py) build the same Program from the same config, so a checkpoint one writes
the others read.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import loader
from loader.executors.padding import MASK_KEY
from trainer import data_checks, models, optim, sources, tasks
from trainer.config import TrainConfig
from trainer.sources import Source, Sources

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Program:
    config: TrainConfig
    task: Any
    model: Any
    sample: dict[str, np.ndarray]  # one record as the task sees it, a batch of one: shapes the model
    data: Sources | None  # the run's sources, resolved once (None: a program that reads no data, e.g. a benchmark's)

    @classmethod
    def build(cls, config: TrainConfig, data: Sources | None = None) -> Program:
        """The run's setup, in one direction: its sources resolved (each one's metadata read once), the task made for
        the shaping source's metadata, its first record read, the model made. The sidecar evaluator (mode=evaluate)
        is shaped by eval_data. `data`: the run's sources when they are resolved already."""
        data = sources.resolve(config) if data is None else data
        task = tasks.make(config, data.shaping.specs)
        try:
            sample = sources.first_record(data.shaping, task)
        except tasks.RecordRangeError:  # one record's labels: the whole data's range names the right fix (over every
            data_checks.check_ranges(task, config, (data.shaping,) + tuple(  # source: they may disagree)
                s for s in data.train + data.eval if s is not data.shaping))
            raise
        model = models.make(config.model, {**task.model_kwargs(), **config.model_size})
        return cls(config, task, model, sample, data)

    def check_data(self) -> None:
        """Before anything is compiled: eval_data holds records (the training data's first record is read already),
        every source has the task's features, and the task's `ranged_features` (a classification's labels) over
        every record of the training data and of eval_data: one line naming the source, the range and the fix
        (trainer/data_checks.py)."""
        data_checks.check_records(self.config, self.data.eval, "eval_data")
        shaping = self.data.shaping  # (its first record is read already)
        for key, group in (("data", self.data.train), ("eval_data", self.data.eval)):
            data_checks.check_features(self.task, self.config, [s for s in group if s is not shaping], key)
        data_checks.check_ranges(self.task, self.config, self.data.train + self.data.eval)

    # --- parameters, model state and optimizer ------------------------------------------------
    def init_variables(self) -> dict[str, Any]:
        """The model's variables: "params", and any state collections (a BatchNorm's "batch_stats"). On a CPU,
        initialised as one compiled program (ResNet-18: 6.1 s against 8.6 s op by op, the same values); on an
        accelerator op by op, where compiling the one program costs more than it saves (the 104M-parameter LM of
        docs/training.md on an NVIDIA H200: 41.7 s to initialise as one program, with or without the compiler's
        autotuning, against under 11 s op by op)."""
        options = {"train": False} if self.takes_train else {}  # (Dropout then needs no stream to initialise)
        init = functools.partial(self.model.init, **options)
        if jax.default_backend() == "cpu":
            init = jax.jit(init)
        return dict(init(jax.random.key(self.config.seed), self.task.inputs(self.sample)))

    def check_outputs(self, variables: dict[str, Any]) -> None:
        """The model's outputs for the first record, by shape only (nothing runs), against what the task takes (a
        task's `check_outputs`, where it has one): a model whose last layer does not fit the task is one line before
        anything compiles, not a NaN loss or an error inside the optimizer."""
        check = getattr(self.task, "check_outputs", None)
        if check is None:
            return
        params, model_state = variables["params"], {k: v for k, v in variables.items() if k != "params"}
        shapes = jax.eval_shape(lambda p, s: self.outputs(p, self.sample, s), params, model_state)
        batch = len(next(iter(self.sample.values())))
        check(shapes, batch, f"model={self.config.model}")

    def init_params(self) -> Any:
        return self.init_variables()["params"]

    def abstract_params(self) -> Any:
        """The parameters' shapes and dtypes, without computing them (what a checkpoint restore needs)."""
        return jax.eval_shape(self.init_params)

    def abstract_model_state(self) -> dict[str, Any]:
        """The shapes and dtypes of the model's state collections ({} for a model without state)."""
        return {k: v for k, v in jax.eval_shape(self.init_variables).items() if k != "params"}

    @functools.cached_property
    def has_state(self) -> bool:
        """Whether the model keeps state besides its parameters (BatchNorm statistics). Such a model takes
        `train=` (batch statistics, updated, when True; the running averages when False)."""
        return bool(self.abstract_model_state())

    def optimizer(self) -> optax.GradientTransformation:
        return optim.make(self.config)

    def load_train(self, **kwargs):
        """The training batches (loader.load), with the task's features or packing."""
        c = self.config
        augment = getattr(self.task, "augment", None)
        task_args = ({"packing": self.task.packing} if c.packing else
                     {"features": self.task.features, "random_map_fn": augment} if augment is not None else
                     {"features": self.task.features, "map_fn": tasks.preprocess(self.task)})
        options = dict(batch_size=c.batch_size, seed=c.seed, worker_count=self.data_workers(),
                       check_hashes=c.check_hashes, max_record_bytes=c.max_record_bytes,
                       ray_address=c.data_ray_address, cache_bytes=c.data_cache_bytes, cache_dir=c.data_cache_dir,
                       ray_resources={c.data_ray_resource: 1} if c.data_ray_resource else None, **task_args)
        train = self.data.train  # resolved once (trainer/sources.py), each with its split
        if isinstance(c.data_source, dict):
            return loader.load({s.name: s.resolved for s in train}, weights=c.data_weights, **{**options, **kwargs})
        return loader.load(train[0].resolved, **{**options, **kwargs})

    def data_workers(self) -> int | str:
        """`data_workers`, or by default "auto" where the devices are accelerators (the host's cores feed them) and 0
        (threads here) on a CPU, whose cores train."""
        if self.config.data_workers is not None:
            return self.config.data_workers
        backend = jax.default_backend()
        chosen = "auto" if backend != "cpu" else 0
        log.info("data_workers=%s: the default on a host whose devices are %s (%s)", chosen, backend,
                 "the loader tunes its workers as it runs" if chosen == "auto" else "threads here; the cores train")
        return chosen

    # --- the step's math ---------------------------------------------------------------------
    def compute(self, tree: Any) -> Any:
        """The floating-point leaves in the compute dtype (identity for float32)."""
        if self.config.dtype == "float32":
            return tree
        target = jnp.dtype(self.config.dtype)
        return jax.tree.map(lambda x: x.astype(target) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    @functools.cached_property
    def takes_train(self) -> bool:
        """Whether the model's __call__ takes `train` (flax's convention: Dropout and BatchNorm follow it)."""
        try:
            return "train" in inspect.signature(type(self.model).__call__).parameters
        except (TypeError, ValueError):
            return False

    def _apply(self, params, model_state, batch, train: bool, rng=None):
        """(float32 outputs, model state after the batch). A model whose __call__ takes `train` gets train=True in a
        training step (with `rng` as its "dropout" stream: Dropout is on) and train=False in evaluation; BatchNorm
        normalises by the batch's statistics and updates its averages when training (over the global batch: the
        step is one jitted program over every device), by the averages otherwise."""
        variables = {"params": self.compute(params), **(model_state or {})}
        inputs = self.compute(self.task.inputs(batch))
        if model_state and not self.takes_train:
            raise ValueError(f"model={self.config.model} keeps state ({', '.join(model_state)}: BatchNorm statistics) "
                             "but its __call__ takes no `train` argument: name its flag train (train=True while "
                             "training, as flax's examples do)")
        options = {"train": train} if self.takes_train else {}
        if train and rng is not None:
            options["rngs"] = {"dropout": rng}
        if model_state and train:
            outputs, new_state = self.model.apply(variables, inputs, mutable=list(model_state), **options)
            model_state = jax.tree.map(lambda new, old: new.astype(old.dtype), dict(new_state), model_state)
        else:
            outputs = self.model.apply(variables, inputs, **options)
        return jax.tree.map(lambda o: o.astype(jnp.float32), outputs), model_state

    def outputs(self, params, batch, model_state=None):
        """The model's outputs for evaluation (BatchNorm by its running averages)."""
        return self._apply(params, model_state, batch, train=False)[0]

    def loss_sums(self, params, batch, model_state=None, rng=None):
        """(sum of the losses, (sum of the weights, model state after the batch)) of a training batch; `rng`: the
        model's dropout stream for it."""
        outputs, model_state = self._apply(params, model_state, batch, train=True, rng=rng)
        losses = getattr(self.task, "training_losses", self.task.losses)(outputs, batch)
        return losses.sum(), (tasks.weights(self.task, batch).sum(), model_state)

    def step_rng(self, step, *more):
        """The model's dropout stream for training step `step` (and `more`: e.g. a worker's index): from seed=,
        so a resumed run draws what an uninterrupted one would."""
        rng = jax.random.fold_in(jax.random.key(self.config.seed), step)
        for value in more:
            rng = jax.random.fold_in(rng, value)
        return rng

    def gradients(self, params, batch, model_state=None, rng=None):
        """(mean loss, gradient of the mean, model state after the batch) over the batch; with grad_accum_steps=k
        in k micro-batches (rows i, i+k, ...: every device keeps a share of each; the model state goes through
        them in turn; micro-batch i draws its dropout from `rng` folded with i). Traced inside a jitted step."""
        grad_sums = jax.value_and_grad(self.loss_sums, has_aux=True)
        k = self.config.grad_accum_steps
        if k == 1:
            (loss_sum, (weight, model_state)), grads = grad_sums(params, batch, model_state, rng)
        else:
            micro = jax.tree.map(lambda x: x.reshape((x.shape[0] // k, k) + x.shape[1:]).swapaxes(0, 1), batch)

            def accumulate(carry, item):
                sums, state = carry
                i, mb = item
                (l, (w, state)), g = grad_sums(params, mb, state, None if rng is None else jax.random.fold_in(rng, i))
                return (jax.tree.map(jnp.add, sums, (g, l, w)), state), None

            zeros = (jax.tree.map(jnp.zeros_like, params), jnp.zeros(()), jnp.zeros(()))
            ((grads, loss_sum, weight), model_state), _ = jax.lax.scan(accumulate, (zeros, model_state),
                                                                        (jnp.arange(k), micro))
        return loss_sum / weight, jax.tree.map(lambda g: g / weight, grads), model_state

    # --- evaluation --------------------------------------------------------------------------
    @functools.cached_property
    def eval_step(self):
        """The jit-compiled eval step, made once per Program (a new closure per eval would recompile each time):
        weighted sums of the task's losses and metrics over a batch, and of the weights (0 for padding rows)."""
        task = self.task

        @jax.jit
        def eval_step(params, model_state, batch, real):
            outputs = self.outputs(params, batch, model_state)
            sums = {name: jnp.sum(values * real) for name, values in task.metrics(outputs, batch).items()}
            sums["loss"] = jnp.sum(task.losses(outputs, batch) * real)
            return sums, jnp.sum(tasks.weights(task, batch) * real), jnp.sum(real)

        return eval_step

    def evaluate(self, strategy, params, model_state=None, stop: Callable[[], bool] | None = None) -> dict[str, float]:
        """The task's metrics and loss over one pass of eval_data (each process its rows; short batches padded
        and masked): {"eval_<metric>": mean, "eval_loss": mean, "eval_examples": count}. For a mixture of eval
        components, each one's too ("eval_<name>_loss", ...), and the overall means over all their examples.
        `stop`: asked before each batch; True leaves the evaluation off (EvaluationStopped)."""
        params = strategy.on_devices(params)
        model_state = strategy.on_devices(model_state) if model_state else {}
        evaluation = self.data.eval
        if evaluation[0].name is None:
            return _means(*self._eval_sums(strategy, params, model_state, evaluation[0], stop))
        out, totals, weight, examples = {}, {}, 0.0, 0.0
        for source in evaluation:
            sums, w, n = self._eval_sums(strategy, params, model_state, source, stop)
            out.update({f"eval_{source.name}_{k[len('eval_'):]}": v for k, v in _means(sums, w, n).items()})
            totals = {k: totals.get(k, 0.0) + v for k, v in sums.items()}
            weight, examples = weight + w, examples + n
        return {**_means(totals, weight, examples), **out}

    @functools.cached_property
    def _eval_loaders(self) -> dict:
        return {}

    def _eval_loader(self, source: Source):
        """`source`'s evaluation batches, one loader for the run (each pass iterates it from its start): its records'
        token counts and packed layout are made once, not at every evaluation."""
        key = (source.name, source.path, source.split)
        if key not in self._eval_loaders:
            config, task = self.config, self.task
            task_args = ({"packing": task.packing} if config.packing else
                         {"features": task.features, "map_fn": tasks.preprocess(task)})
            self._eval_loaders[key] = source.load(batch_size=config.batch_size, shuffle=False,
                                                  num_epochs=1, drop_remainder=False, pad_remainder=True, **task_args)
        return self._eval_loaders[key]

    def _eval_sums(self, strategy, params, model_state, source: Source,
                   stop: Callable[[], bool] | None = None) -> tuple[dict[str, float], float, float]:
        """(summed metrics, summed weights, examples) over one pass of `source` (its first eval_steps batches; the
        last one short, padded with rows of weight 0). With packing, its rows packed as training's are, so every token
        of every document is scored, and the examples are rows."""
        totals: dict[str, float] = {}
        weight = examples = 0.0
        it = iter(self._eval_loader(source))
        for batch in itertools.islice(it, self.config.eval_steps):
            if stop is not None and stop():
                it.close()
                raise EvaluationStopped
            weights = batch.pop(MASK_KEY).astype(np.float32)  # (the loader pads the last batch: pad_remainder)
            batch = {k: np.asarray(v) for k, v in batch.items()}
            sums, w, n = self.eval_step(params, model_state, strategy.distribute(batch), strategy.distribute(weights))
            for name, value in sums.items():
                totals[name] = totals.get(name, 0.0) + float(value)
            weight, examples = weight + float(w), examples + float(n)
        it.close()  # (eval_steps may stop it early: its read-ahead stops now)
        return totals, weight, examples


class EvaluationStopped(Exception):
    """An evaluation left off because its `stop` said so (a SIGTERM: the checkpoint comes first)."""


def _means(totals: dict[str, float], weight: float, examples: float) -> dict[str, float]:
    return {**{f"eval_{name}": value / weight for name, value in sorted(totals.items())},
            "eval_examples": int(examples)}
