"""A hand-written training loop on the strategy API (what `python -m trainer` builds on).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 .venv/bin/python docs/custom_loop.py DATA_DIR

DATA_DIR: a directory converted by `python -m pipelines convert` holding tf.train.Examples with
`image` (64 ints) and `label` (an int), e.g. demo_out/array_record/custom/train (made by `bash scripts/demo.sh`, or
alone by `python -m pipelines make-demo --output demo_out/tfrecord` and `python -m pipelines convert --input
'demo_out/tfrecord/digits-train.tfrecord-*' --output demo_out/array_record/custom/train`).
"""

import sys

import jax
import jax.numpy as jnp
import optax

import loader
import trainer
from trainer.models import MLP, images_to_float


def main(data_dir: str, steps: int = 50) -> float:
    strategy = trainer.make_strategy("mirrored")
    print(f"num_replicas_in_sync={strategy.num_replicas_in_sync}")
    model, tx = MLP(num_classes=10), optax.adam(1e-3)
    with strategy.scope():
        assert trainer.get_strategy() is strategy
        params = strategy.replicate(model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))["params"])
        opt_state = strategy.replicate(tx.init(params))

        def train_step(params, opt_state, batch):
            def loss_fn(p):
                logits = model.apply({"params": p}, images_to_float(batch["image"]))
                per_example = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
                return per_example.mean(), per_example

            (_, per_example), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, per_example

        batches = loader.load(data_dir, batch_size=8 * strategy.num_replicas_in_sync, seed=0)
        for step, batch in zip(range(steps), strategy.experimental_distribute_dataset(batches)):
            params, opt_state, per_example = strategy.run(train_step, args=(params, opt_state, batch))
            loss = strategy.reduce("mean", per_example)
            if step % 10 == 0:
                print(f"step {step} loss {float(loss):.4f}")
    return float(loss)


if __name__ == "__main__":
    main(sys.argv[1])
