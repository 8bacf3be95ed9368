"""The demo datasets, both of data that ships offline:

- digits: scikit-learn's handwritten digits (1,797 8x8 images, 10 classes), inside scikit-learn's wheel. The same
  split and encoding serve the custom-TFRecord writer here and the TFDS builder in `pipelines/datasets/digits`
  (pixels scaled from 0..16 to 0..255, uint8).
- text: the Python standard library's own sources (`*.py` under `sysconfig`'s stdlib path), in passages of whole
  lines, for a byte-level language model.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig

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


TEXT_TEST_FRACTION = 0.1


def stdlib_passages(*, max_bytes: int = 4 << 20, passage_bytes: int = 256) -> dict[str, list[bytes]]:
    """{'train': [passage, ...], 'test': [...]}: the stdlib's .py files in path order, cut into passages of whole
    lines of at most `passage_bytes` (a longer line is cut), up to `max_bytes` in all and past it until each split has
    a file. A file goes to 'test' when the first byte of the SHA-1 of its relative path is below TEXT_TEST_FRACTION *
    256, so the split is fixed."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(os.path.relpath(os.path.join(d, f), root) for d, subdirs, names in os.walk(root)
                   if "site-packages" not in d and "test" not in os.path.relpath(d, root).split(os.sep)
                   for f in names if f.endswith(".py"))
    splits: dict[str, list[bytes]] = {"train": [], "test": []}
    total = 0
    for rel in files:
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
        split = "test" if hashlib.sha1(rel.encode()).digest()[0] < TEXT_TEST_FRACTION * 256 else "train"
        passage = b""
        for line in data.splitlines(keepends=True):
            if len(passage) + len(line) > passage_bytes and passage:
                splits[split].append(passage)
                passage = b""
            while len(line) > passage_bytes:  # a line longer than a passage: cut it
                head, line = line[:passage_bytes], line[passage_bytes:]
                splits[split].append(head)
            if len(passage) + len(line) > passage_bytes and passage:
                splits[split].append(passage)
                passage = b""
            passage += line
        if passage:
            splits[split].append(passage)
        total += len(data)
        if total >= max_bytes and all(splits.values()):  # (a small max_bytes: no split left without text)
            break
    return splits


def write_text_tfrecords(output_dir: str, *, num_shards: int = 4, max_bytes: int = 4 << 20) -> list[str]:
    """Writes `text-{split}.tfrecord-XXXXX-of-YYYYY` shards of tf.train.Example with one feature, `text` (bytes)."""
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards} must be >= 1")
    os.makedirs(output_dir, exist_ok=True)
    written = []
    for split, passages in stdlib_passages(max_bytes=max_bytes).items():
        for shard, index in enumerate(np.array_split(np.arange(len(passages)), num_shards)):
            path = os.path.join(output_dir, f"text-{split}.tfrecord-{shard:05d}-of-{num_shards:05d}")
            with open(path, "wb") as f:
                tfrecord.write_records(f, (example_proto.encode_example({"text": passages[i]}) for i in index))
            written.append(path)
    return written


def unigram_bits_per_byte(passages) -> float:
    """The entropy, in bits, of the byte distribution of `passages` (an iterable of bytes): what a model that
    knows only each byte's frequency in these very bytes would pay per byte. A language model must beat it."""
    counts = np.zeros(256, np.int64)
    for passage in passages:
        counts += np.bincount(np.frombuffer(passage, np.uint8), minlength=256)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


PHOTO_SHORT_SIDE = (300, 500)
PHOTO_QUALITY = 90


def photo_jpegs(count: int, *, seed: int = 0) -> list[tuple[bytes, int]]:
    """`count` ImageNet-like JPEGs made from the two real photos scikit-learn ships (china.jpg, flower.jpg,
    427x640): each a random crop of one photo (a quarter to all of its area, aspect 3:4 to 4:3), resized so its
    short side is 300-500 px, encoded at quality 90 (~50-110 KB). Returns (jpeg bytes, photo index) pairs; the
    same `seed` gives the same bytes."""
    import io

    from PIL import Image
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        label = int(rng.integers(len(photos)))
        photo = photos[label]
        height, width = photo.shape[:2]
        area = rng.uniform(0.25, 1.0) * height * width
        aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        h = int(min(height, round(np.sqrt(area / aspect))))
        w = int(min(width, round(np.sqrt(area * aspect))))
        top, left = int(rng.integers(height - h + 1)), int(rng.integers(width - w + 1))
        short = int(rng.integers(*PHOTO_SHORT_SIDE, endpoint=True))
        scale = short / min(h, w)
        image = Image.fromarray(photo[top:top + h, left:left + w]).resize(
            (max(1, round(w * scale)), max(1, round(h * scale))), Image.BICUBIC)
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=PHOTO_QUALITY)
        out.append((buffer.getvalue(), label))
    return out


def write_photo_tfrecords(output_dir: str, count: int, *, num_shards: int = 4, seed: int = 0,
                          split: str = "train") -> list[str]:
    """Writes `photos-{split}.tfrecord-XXXXX-of-YYYYY` shards of `photo_jpegs(count, seed=seed)` in the ImageNet
    TFRecord layout: tf.train.Example with `image/encoded` (JPEG bytes), `image/format` (b"jpeg") and
    `image/class/label` (int64: which photo the crop came from)."""
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards} must be >= 1")
    os.makedirs(output_dir, exist_ok=True)
    photos = photo_jpegs(count, seed=seed)
    written = []
    for shard, index in enumerate(np.array_split(np.arange(count), num_shards)):
        path = os.path.join(output_dir, f"photos-{split}.tfrecord-{shard:05d}-of-{num_shards:05d}")
        with open(path, "wb") as f:
            tfrecord.write_records(f, (example_proto.encode_example(
                {"image/encoded": photos[i][0], "image/format": b"jpeg", "image/class/label": photos[i][1]})
                for i in index))
        written.append(path)
    return written


DIGIT_JPEG_SIDE = 32


def write_digits_jpeg_tfrecords(output_dir: str, *, num_shards: int = 4, side: int = DIGIT_JPEG_SIDE,
                                imagenet_files: bool = False) -> list[str]:
    """The digits (`digits_splits`) as JPEG files in the ImageNet TFRecord layout: each 8x8 image scaled up to
    side x side (bicubic), grey, quality 90, as `image/encoded` with `image/format` b"jpeg" and `image/class/label`
    (0-9), in `digits-jpeg-{split}.tfrecord-XXXXX-of-YYYYY` shards. Real JPEG decoding on data that trains in
    seconds. `imagenet_files`: as ImageNet's own TFRecords are, also in their names and labels: shards
    `train-XXXXX-of-YYYYY` and `validation-XXXXX-of-YYYYY`, labels 1-10 (ImageNet's are 1-1000)."""
    import io

    from PIL import Image

    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards} must be >= 1")
    os.makedirs(output_dir, exist_ok=True)
    written = []
    for split, (images, labels) in digits_splits().items():
        encoded = []
        for image in images:
            buffer = io.BytesIO()
            Image.fromarray(image).resize((side, side), Image.BICUBIC).save(buffer, "JPEG", quality=PHOTO_QUALITY)
            encoded.append(buffer.getvalue())
        name = ("train" if split == "train" else "validation") if imagenet_files else f"digits-jpeg-{split}.tfrecord"
        first = 1 if imagenet_files else 0
        for shard, index in enumerate(np.array_split(np.arange(len(labels)), num_shards)):
            path = os.path.join(output_dir, f"{name}-{shard:05d}-of-{num_shards:05d}")
            with open(path, "wb") as f:
                tfrecord.write_records(f, (example_proto.encode_example(
                    {"image/encoded": encoded[i], "image/format": b"jpeg", "image/class/label": labels[i] + first})
                    for i in index))
            written.append(path)
    return written
