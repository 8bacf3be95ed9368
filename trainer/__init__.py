"""JAX training against the loader, with tf.distribute-style strategies on jax.sharding.

    python -m trainer data=out/train eval_data=out/test model=cnn strategy=mirrored steps=500 workdir=/tmp/run
"""

from trainer.config import TrainConfig
from trainer.strategy import Strategy, get_strategy, make as make_strategy
from trainer.train import train_and_evaluate

__all__ = ["Strategy", "TrainConfig", "get_strategy", "make_strategy", "train_and_evaluate"]
