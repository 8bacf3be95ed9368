"""TFDS dataset metadata: `dataset_info.json` and the shard file names it implies. Pure JSON, no TensorFlow.

A TFDS dataset version directory (e.g. `~/tensorflow_datasets/mnist/3.0.1`) holds `dataset_info.json` (a
DatasetInfo proto in JSON), `features.json`, label files, and the shards `{name}-{split}.{format}-{XXXXX}-of-{YYYYY}`
(or the split's own `filepathTemplate`). The converter reads the TFRecord names and writes the ArrayRecord twin's
info; the loader reads that info to find a split's shards and their lengths.
"""

from __future__ import annotations

import json

from dataset_format import storage

INFO_NAME = "dataset_info.json"
FEATURES_NAME = "features.json"
_DEFAULT_TEMPLATE = "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}"


def read_info(directory: str) -> dict:
    """The parsed dataset_info.json of `directory`; raises naming the file and the fix."""
    path = storage.join(directory, INFO_NAME)
    text = storage.read_text(path)
    if text is None:
        raise FileNotFoundError(f"{path} does not exist; pass a TFDS dataset version directory "
                                "(the one that holds dataset_info.json)")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); rebuild the dataset with tfds build") from e


def shard_name(info: dict, split: dict, file_format: str, index: int, num_shards: int) -> str:
    """The base name of shard `index` of `num_shards` of `split` stored as `file_format`."""
    template = split.get("filepathTemplate") or _DEFAULT_TEMPLATE
    return template.format(
        DATASET=info["name"], SPLIT=split["name"], FILEFORMAT=file_format,
        SHARD_X_OF_Y=f"{index:05d}-of-{num_shards:05d}", SHARD_INDEX=f"{index:05d}",
        NUM_SHARDS=f"{num_shards:05d}")


def split_shards(info: dict, split: str, file_format: str) -> list[tuple[str, int]]:
    """(base name, records) of each shard of `split`, in order; raises naming the splits there are."""
    splits = {s["name"]: s for s in info.get("splits", [])}
    if split not in splits:
        raise ValueError(f"{INFO_NAME} of {info.get('name')!r} has no split {split!r}; the splits are {sorted(splits)}")
    lengths = [int(n) for n in splits[split].get("shardLengths", [])]
    return [(shard_name(info, splits[split], file_format, i, len(lengths)), n) for i, n in enumerate(lengths)]


def read_features(directory: str) -> dict | None:
    """The parsed features.json of `directory` (TFDS's FeaturesDict as JSON), or None if there is none."""
    text = storage.read_text(storage.join(directory, FEATURES_NAME))
    return None if text is None else json.loads(text)


def feature_specs(features: dict) -> dict[str, dict]:
    """The top-level features of a features.json: name -> {"type": TFDS class name, and where TFDS records them
    "num_classes" (ClassLabel), "dtype" and "shape" (Image, Tensor)}.

        feature_specs(read_features(d))["label"]  # {"type": "ClassLabel", "num_classes": 10}
    """
    specs = {}
    for name, feature in features.get("featuresDict", {}).get("features", {}).items():
        spec = {"type": feature.get("pythonClassName", "").rsplit(".", 1)[-1]}
        if "classLabel" in feature:
            spec["num_classes"] = int(feature["classLabel"]["numClasses"])
        body = feature.get("image") or feature.get("tensor")
        if body:
            spec["dtype"] = body.get("dtype")
            spec["shape"] = [int(d) for d in body.get("shape", {}).get("dimensions", [])]
        specs[name] = spec
    return specs
