"""A model with BatchNorm small enough for the default test run (the ResNets' path, without their compile time)."""

import flax.linen as nn


class TinyBN(nn.Module):
    num_classes: int

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(8, (3, 3), (2, 2), use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
        return nn.Dense(self.num_classes)(x.mean(axis=(1, 2)))
