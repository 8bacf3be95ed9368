"""JAX training against the loader, with tf.distribute-style strategies on jax.sharding.

    python -m trainer data=out/train eval_data=out/test model=cnn strategy=mirrored steps=500 workdir=/tmp/run

The names below are imported when first used, so that `python -m trainer` on an install without JAX (the base, or
`.[convert]`) says which extra to install instead of failing as the package is imported.
"""

import importlib

_EXPORTS = {"Strategy": ("trainer.strategy", "Strategy"), "TrainConfig": ("trainer.config", "TrainConfig"),
            "get_strategy": ("trainer.strategy", "get_strategy"), "make_strategy": ("trainer.strategy", "make"),
            "train_and_evaluate": ("trainer.train", "train_and_evaluate")}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'trainer' has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value
