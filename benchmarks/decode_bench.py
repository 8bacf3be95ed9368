"""Example decode benchmark: our NumPy wire-format batch parse against protobuf and TensorFlow.

    .venv/bin/python benchmarks/decode_bench.py

Decodes the same serialized `tf.train.Example` batches, in this one process, with:
- per record: protobuf parse of each record, then `collate` (the loader's fallback path);
- protobuf columns: protobuf parse of each record, columns built per feature (the previous batch path);
- ours: `dataset_format.example_batch.parse_examples`, every field of every record parsed at once with NumPy;
- `tf.io.parse_example` on the batch (TensorFlow's C++ parser; when TensorFlow is installed), with the
  feature spec given, as tf.data pipelines use it.
Record kinds: the loader benchmark's (`data`: 1 KB bytes, `label`: int64) and the digits demo's (`image`:
64 int64 pixels 0-255, `label`). Batch sizes: 256 (one batch) and 16,384 (a loader read group, which the
loader decodes in one call). Reported: microseconds per record (best of 5) and ours / each (speed ratio).
Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def kinds(rng: np.random.Generator, n: int) -> dict:
    from dataset_format.example_proto import encode_example

    return {
        "1 KB bytes + label": [encode_example({"data": rng.integers(32, 96, 1000, dtype=np.uint8).tobytes(),
                                               "label": i}) for i in range(n)],
        "digits (64 ints + label)": [encode_example({"image": rng.integers(0, 256, 64), "label": i % 10})
                                     for i in range(n)],
    }


def tf_parser(records: list[bytes]):
    try:
        import tensorflow as tf
    except ImportError:
        return None
    from loader.decoding.decode import ExampleDecoder

    first = ExampleDecoder()(records[0])
    spec = {}
    for key, value in first.items():
        shape = list(np.shape(value))
        dtype = tf.string if isinstance(value, bytes) or np.asarray(value).dtype == object else (
            tf.float32 if np.asarray(value).dtype.kind == "f" else tf.int64)
        spec[key] = tf.io.FixedLenFeature(shape, dtype)
    serialized = tf.constant(records)
    return lambda: tf.io.parse_example(serialized, spec)


def best_us_per_record(fn, n: int, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) / n * 1e6


def main() -> None:
    from loader.decoding.decode import ExampleDecoder, collate
    from dataset_format.example_batch import parse_examples

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[256, 16384])
    args = p.parse_args()
    rng = np.random.default_rng(0)
    decoder = ExampleDecoder()
    for kind, all_records in kinds(rng, max(args.batch_sizes)).items():
        for n in args.batch_sizes:
            records = all_records[:n]
            contenders = {
                "per record": lambda: collate([decoder(r) for r in records]),
                "protobuf columns": lambda: decoder._protobuf_columns(records),
                "ours (NumPy wire parse)": lambda: parse_examples(records),
            }
            tf_parse = tf_parser(records)
            if tf_parse is not None:
                contenders["tf.io.parse_example"] = tf_parse
            results = {name: best_us_per_record(fn, n) for name, fn in contenders.items()}
            ours = results["ours (NumPy wire parse)"]
            for name, us in results.items():
                ratio = "" if name.startswith("ours") else f"   ours / this: {us / ours:.2f}x the speed"
                print(f"{kind:26s} batch {n:6d}  {name:24s} {us:7.2f} us/record{ratio}", flush=True)


if __name__ == "__main__":
    main()
