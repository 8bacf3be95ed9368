"""Your own model, trained by `python -m trainer` without editing the project: name it as `module:attr`.

    PYTHONPATH=docs .venv/bin/python -m trainer data=demo_out/array_record/custom/train \
        eval_data=demo_out/array_record/custom/test num_classes=10 model=own_model:ResidualMLP steps=300 workdir=/tmp/own

(demo_out/ is made by `bash scripts/demo.sh`, or alone by `python -m pipelines make-demo --output demo_out/tfrecord`
and, for each of train and test, `python -m pipelines convert --input 'demo_out/tfrecord/digits-train.tfrecord-*'
--output demo_out/array_record/custom/train`.)

`model=` takes a `flax.linen.Module` class or a function returning a Module instance; the trainer builds it with
the task's keyword arguments (`task=classification`: `num_classes`; `task=lm`: `vocab_size` and `max_len`) and
calls it on the task's inputs (classification: images as float32 in [0, 1], NHWC). It returns one array: the task's
logits (classification: [batch, num_classes]; lm: [batch, length, vocab_size]), checked by shape before anything
compiles. A `__call__` that takes `train` (flax's convention) gets train=True in training steps, with a "dropout"
stream drawn from seed= and the step (so `nn.Dropout(rate, deterministic=not train)` works and a resumed run draws
the same masks), and train=False in evaluation; a model with BatchNorm must take it. Settings of your own (a width)
go in a function: `def small(num_classes): return ResidualMLP(num_classes, width=64)`, then `model=own_model:small`.
tests/trainer/test_docs.py runs the command above on the digits demo data.
"""

import flax.linen as nn


class ResidualMLP(nn.Module):
    """Flattened pixels -> residual blocks of (LayerNorm, Dense, GELU, Dense) -> class logits."""

    num_classes: int
    width: int = 128
    blocks: int = 2

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.width)(x.reshape((x.shape[0], -1)))
        for _ in range(self.blocks):
            y = nn.Dense(self.width)(nn.gelu(nn.Dense(2 * self.width)(nn.LayerNorm()(x))))
            x = x + y
        return nn.Dense(self.num_classes)(nn.LayerNorm()(x))


def small(num_classes: int) -> nn.Module:
    """A function works too: `model=own_model:small`."""
    return ResidualMLP(num_classes=num_classes, width=64, blocks=1)
