"""Keras 3 on the JAX backend, data parallel over all devices, fed by `loader.load`.

    KERAS_BACKEND=jax XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        .venv/bin/python docs/keras_example.py demo_out/array_record/custom/train demo_out/array_record/custom/test

(demo_out/ is made by `bash scripts/demo.sh`, or alone by `python -m pipelines make-demo --output demo_out/tfrecord`
and, for each of train and test, `python -m pipelines convert --input 'demo_out/tfrecord/digits-train.tfrecord-*'
--output demo_out/array_record/custom/train`.)

The loader yields host batches ({"image": uint8/int [B, 64], "label": int [B]}); Keras's DataParallel
distribution splits each over the devices, as MultiWorkerMirroredStrategy users expect from tf.keras.
"""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")  # before keras is imported; a script's own choice, not a library's

import keras  # noqa: E402

import loader  # noqa: E402


def xy(batches):
    for batch in batches:
        yield batch["image"].reshape(len(batch["label"]), -1).astype("float32"), batch["label"]


def main(train_dir: str, test_dir: str, epochs: int = 3, steps_per_epoch: int = 100) -> float:
    distribution = keras.distribution.DataParallel(devices=keras.distribution.list_devices())
    keras.distribution.set_distribution(distribution)
    print(f"keras DataParallel over {distribution.device_mesh.devices.size} devices")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Rescaling(1 / 255),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(optimizer=keras.optimizers.Adam(2e-3), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    train = loader.load(train_dir, batch_size=64, seed=0)
    # (shuffle=False: the loader shuffles; Keras cannot shuffle a generator, and warns when asked to)
    model.fit(xy(train), epochs=epochs, steps_per_epoch=steps_per_epoch, verbose=2, shuffle=False)
    kernel = model.layers[1].kernel.value  # the variables' layout chosen by the distribution
    print(f"kernel sharding: {kernel.sharding.spec}, on {len(kernel.sharding.device_set)} devices")
    test = loader.load(test_dir, batch_size=64, shuffle=False, num_epochs=1)  # drops the last partial batch
    _, accuracy = model.evaluate(xy(test), steps=len(test), verbose=2)
    print(f"keras eval accuracy {accuracy:.4f} on {len(test) * 64} test images")
    return accuracy


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
