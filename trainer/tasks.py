"""Tasks: what the trainer reads from the data, what the model is built with, and what it optimises and reports.

`task=classification` is built in; `task=package.module:attr` names your own: `attr(config, specs)` must return an
object with the members of `Task` below (`specs`: the data's TFDS feature metadata, `{}` for plain Examples):

    @dataclasses.dataclass(frozen=True)
    class Regression:
        features = ("vec", "target")
        def model_kwargs(self): return {"num_classes": 1}          # the model's constructor arguments
        def inputs(self, batch): return batch["vec"]               # in the jitted step: the model's input
        def losses(self, outputs, batch): return (outputs[:, 0] - batch["target"]) ** 2   # per example, [B]
        def metrics(self, outputs, batch): return {"abs_error": jnp.abs(outputs[:, 0] - batch["target"])}

    def make(config, specs): return Regression()                   # task=my_pkg.tasks:make

Only the features a task names are decoded, collated and placed on the devices: a dataset's other features (text,
ragged lists, other images) are never touched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import optax

from trainer import imports
from trainer.config import TrainConfig
from trainer.models import images_to_float


@runtime_checkable
class Task(Protocol):
    features: Sequence[str]  # the data features the task reads

    def model_kwargs(self) -> dict[str, Any]:
        """Keyword arguments the model is built with (`model=` names a class or a function taking them)."""

    def inputs(self, batch: dict[str, jax.Array]) -> Any:
        """The model's input, computed inside the jitted step from the task's features."""

    def losses(self, outputs: jax.Array, batch: dict[str, jax.Array]) -> jax.Array:
        """Per-example losses, shape [batch]; training minimises their mean, eval reports it as eval_loss."""

    def metrics(self, outputs: jax.Array, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """Per-example values, shape [batch] each; eval reports their mean over the eval data as eval_<name>."""


@dataclasses.dataclass(frozen=True)
class Classification:
    """Softmax cross-entropy over `label_key` from `image_key`; reports accuracy."""

    image_key: str
    label_key: str
    num_classes: int

    @classmethod
    def from_config(cls, config: TrainConfig, specs: dict[str, dict]) -> Classification:
        for key in (config.image_key, config.label_key):
            if specs and key not in specs:
                raise ValueError(f"task reads feature {key!r}, which the data does not have; its features are "
                                 f"{sorted(specs)} (set image_key= / label_key=)")
        labelled = specs.get(config.label_key, {}).get("num_classes")
        if config.num_classes is not None and labelled is not None and config.num_classes != labelled:
            raise ValueError(f"num_classes={config.num_classes} but the data's ClassLabel {config.label_key!r} has "
                             f"{labelled} classes; leave num_classes unset to use the data's")
        num_classes = config.num_classes or labelled
        if num_classes is None:
            raise ValueError(f"the data has no ClassLabel metadata for {config.label_key!r} (not a TFDS dataset, or "
                             "another feature type): pass num_classes=N")
        return cls(config.image_key, config.label_key, num_classes)

    @property
    def features(self) -> tuple[str, ...]:
        return (self.image_key, self.label_key)

    def model_kwargs(self) -> dict[str, Any]:
        return {"num_classes": self.num_classes}

    def inputs(self, batch):
        return images_to_float(batch[self.image_key])

    def losses(self, outputs, batch):
        return optax.softmax_cross_entropy_with_integer_labels(outputs, batch[self.label_key].astype(jnp.int32))

    def metrics(self, outputs, batch):
        return {"accuracy": (jnp.argmax(outputs, -1) == batch[self.label_key]).astype(jnp.float32)}


TASKS = {"classification": Classification.from_config}
_MEMBERS = ("features", "model_kwargs", "inputs", "losses", "metrics")


def make(config: TrainConfig, specs: dict[str, dict]) -> Task:
    """The task `config.task` names, built for data whose TFDS feature metadata is `specs`."""
    factory = imports.resolve(config.task, TASKS, "task")
    if not callable(factory):
        raise ValueError(f"task={config.task!r} is a {type(factory).__name__}, not a class or function")
    try:
        task = factory(config, specs)
    except TypeError as e:
        raise ValueError(f"task={config.task!r} cannot be called as {config.task.rpartition(':')[2]}(config, specs) "
                         f"({e}); see trainer/tasks.py") from e
    missing = [m for m in _MEMBERS if not hasattr(task, m)]
    if missing:
        raise ValueError(f"task={config.task!r} returned a {type(task).__name__} without {missing}; a task has "
                         f"{list(_MEMBERS)} (see trainer/tasks.py)")
    if isinstance(task.features, str) or not task.features:
        raise ValueError(f"task={config.task!r}: features must be a non-empty list of feature names "
                         f"(got {task.features!r})")
    return task
