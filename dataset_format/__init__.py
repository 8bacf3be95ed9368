"""The converted dataset on disk: the contract between the converter (`pipelines`) and the loader (`loader`).

One small package that imports neither Beam nor JAX nor grain, so every side can install it:
- `storage`: files on local disk or gs:// (google-cloud-storage, retries, clear errors);
- `manifest`: OUT/manifest.json, the shard list with record counts, sizes and feature statistics;
- `naming`: which ArrayRecord shard a TFRecord shard becomes;
- `tfds_info`: TFDS dataset_info.json and the shard names it implies;
- `example_proto`: the tf.train.Example codec, without TensorFlow; `example_batch`: a batch of Examples parsed at
  once with NumPy (the loader's decode, the converter's feature statistics);
- `logs`: console logging a person can read, for every command.

See docs/dataset-format.md for the format itself.
"""

from dataset_format.manifest import MANIFEST_NAME, Manifest, ShardEntry

__all__ = ["MANIFEST_NAME", "Manifest", "ShardEntry"]
