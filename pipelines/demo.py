"""The demo dataset: scikit-learn's handwritten digits (1,797 8x8 images, 10 classes).

The data ships inside scikit-learn's wheel, so nothing is downloaded. The same split and
encoding serve the custom-TFRecord writer here and the TFDS builder in
`pipelines/datasets/digits` (pixels scaled from 0..16 to 0..255, uint8).
"""

from __future__ import annotations

import os

import numpy as np

from dataset_format import example_proto
from pipelines import tfrecord

TEST_FRACTION = 0.2
SPLIT_SEED = 0


def digits_splits() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{'train': (images uint8 [N,8,8], labels int64 [N]), 'test': ...}, a fixed random split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.round(digits.images * (255 / 16)).astype(np.uint8)
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(labels))
    n_test = int(len(labels) * TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    return {"train": (images[train], labels[train]), "test": (images[test], labels[test])}


def write_digits_tfrecords(output_dir: str, *, num_shards: int = 4) -> list[str]:
    """Writes `digits-{split}.tfrecord-XXXXX-of-YYYYY` shards of tf.train.Example.

    Features: `image` (64 int64 pixel values, row-major 8x8) and `label` (one int64).
    Records are split into contiguous runs, in order, one run per shard.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards} must be >= 1")
    os.makedirs(output_dir, exist_ok=True)
    written = []
    for split, (images, labels) in digits_splits().items():
        for shard, index in enumerate(np.array_split(np.arange(len(labels)), num_shards)):
            path = os.path.join(output_dir, f"digits-{split}.tfrecord-{shard:05d}-of-{num_shards:05d}")
            with open(path, "wb") as f:
                tfrecord.write_records(f, (example_proto.encode_example(
                    {"image": images[i].reshape(-1), "label": labels[i]}) for i in index))
            written.append(path)
    return written
