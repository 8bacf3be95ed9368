"""Models for image classification, each a few lines of config away: `model=mlp` or `model=cnn`."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp


class MLP(nn.Module):
    num_classes: int
    hidden: tuple[int, ...] = (256, 128)

    @nn.compact
    def __call__(self, x):
        x = x.reshape((x.shape[0], -1))
        for width in self.hidden:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.num_classes)(x)


class CNN(nn.Module):
    """Two 3x3 conv layers and a dense head (the Flax MNIST example's shape, sized for small images)."""

    num_classes: int
    features: tuple[int, ...] = (32, 64)

    @nn.compact
    def __call__(self, x):
        for f in self.features:
            x = nn.relu(nn.Conv(f, kernel_size=(3, 3))(x))
            if min(x.shape[1:3]) >= 4:
                x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(128)(x))
        return nn.Dense(self.num_classes)(x)


MODELS = {"mlp": MLP, "cnn": CNN}


def make(name: str, num_classes: int) -> nn.Module:
    if name not in MODELS:
        raise ValueError(f"model={name!r} is not one of {sorted(MODELS)}")
    return MODELS[name](num_classes=num_classes)


def images_to_float(images):
    """uint8/int pixels -> float32 in [0, 1], shaped NHWC (a flat square image becomes s x s x 1)."""
    x = jnp.asarray(images, jnp.float32) / 255.0
    if x.ndim == 2:
        side = int(round(x.shape[1] ** 0.5))
        x = x.reshape((x.shape[0], side, side, 1)) if side * side == x.shape[1] else x
    elif x.ndim == 3:
        x = x[..., None]
    return x
