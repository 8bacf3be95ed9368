"""Feature statistics: gathered while converting, per shard, held against an independent parse of every record."""

import json

import numpy as np
import pytest

from dataset_format.example_proto import decode_example, encode_example
from dataset_format.manifest import Manifest, ShardTable, list_features, merge_feature_stats
from pipelines import ConvertConfig, run_conversion
from pipelines.stats import ShardStats
from tests.conftest import write_tfrecord_shards

_KINDS = {"i": "int64", "f": "float", "O": "bytes"}


def reference(records: list[bytes]) -> dict:
    """The statistics by protobuf's own parse of each record, one by one (dataset_format/example_proto.py)."""
    out: dict = {}
    for record in records:
        for key, values in decode_example(record).items():
            kind = _KINDS[values.dtype.kind]
            stats = out.setdefault(key, {"kind": kind, "records": 0, "min_length": values.size,
                                         "max_length": values.size})
            stats["records"] += 1
            stats["min_length"] = min(stats["min_length"], values.size)
            stats["max_length"] = max(stats["max_length"], values.size)
            if kind == "int64" and values.size:
                stats["min"] = min(stats.get("min", int(values.min())), int(values.min()))
                stats["max"] = max(stats.get("max", int(values.max())), int(values.max()))
    return dict(sorted(out.items()))


def gathered(records: list[bytes]) -> dict | None:
    stats = ShardStats()
    for record in records:
        stats.add(record)
    return stats.result()


def imagenet_like(i: int, image_bytes: int = 300) -> bytes:
    """ImageNet's layout: 1-based labels, a variable number of boxes (so batches differ in layout every so often)."""
    boxes = 1 + (i % 7 == 0)
    return encode_example({"image/encoded": bytes(image_bytes), "image/format": b"jpeg",
                           "image/class/label": 1 + i % 1000, "image/height": 300 + i % 200,
                           "image/object/bbox/xmin": [0.1] * boxes, "image/object/bbox/label": [1 + i % 1000] * boxes})


@pytest.mark.parametrize("records", [
    pytest.param([encode_example({"image": np.arange(64) * (i % 5), "label": i % 10 - 3}) for i in range(2000)],
                 id="one-layout"),  # parsed a batch at a time with NumPy
    pytest.param([imagenet_like(i) for i in range(1500)], id="boxes-vary"),  # protobuf, record by record
    pytest.param([imagenet_like(i, 40_000) for i in range(120)], id="large-records"),  # batches of a few records
    pytest.param([encode_example({"label": i, **({"extra": [i, -i]} if i % 300 == 0 else {})}) for i in range(1500)],
                 id="a-rare-feature"),
    pytest.param([encode_example({"label": 2**62 + i, "text": "é" * i}) for i in range(700)], id="wide-ints"),
])
def test_statistics_match_a_parse_of_every_record(records):
    assert gathered(records) == reference(records)


def test_records_that_are_not_examples_get_none():
    assert gathered([b"\xff\xd8\xff\xe0 a JPEG, not an Example"] * 100) is None
    assert gathered([encode_example({"label": 1})] * 100 + [b"\xff\xff\xff"]) is None  # one is enough


def test_merging_shards(tmp_path):
    a, b = gathered([imagenet_like(i) for i in range(0, 500)]), gathered([imagenet_like(i) for i in range(500, 999)])
    assert merge_feature_stats([a, b]) == reference([imagenet_like(i) for i in range(999)])
    assert merge_feature_stats([a, None]) is None  # a shard without statistics: unknown, not partial
    mixed = merge_feature_stats([{"x": {"kind": "int64", "records": 2, "min": 0, "max": 3}},
                                 {"x": {"kind": "bytes", "records": 1}}])
    assert mixed == {"x": {"kind": "mixed", "records": 3}}
    lengths = merge_feature_stats([{"x": {"kind": "float", "records": 2, "min_length": 1, "max_length": 1}},
                                   {"x": {"kind": "float", "records": 1, "min_length": 3, "max_length": 4}}])
    assert lengths == {"x": {"kind": "float", "records": 3, "min_length": 1, "max_length": 4}}
    old = merge_feature_stats([{"x": {"kind": "float", "records": 2, "min_length": 1, "max_length": 1}},
                               {"x": {"kind": "float", "records": 1}}])  # a shard converted before lengths were kept
    assert old == {"x": {"kind": "float", "records": 3}}
    assert list_features(lengths) == {"x"} and list_features(old) == set()
    assert list_features({"one": {"kind": "int64", "records": 5, "min_length": 1, "max_length": 1},
                          "pair": {"kind": "int64", "records": 5, "min_length": 2, "max_length": 2},
                          "maybe": {"kind": "bytes", "records": 5, "min_length": 0, "max_length": 1}}) == {"pair", "maybe"}


def test_the_conversion_records_each_shards_statistics(tmp_path):
    shards = [[imagenet_like(i) for i in range(s * 400, s * 400 + 400)] for s in range(3)]
    write_tfrecord_shards(tmp_path / "in", shards, pattern="train-{i:05d}-of-{n:05d}")
    outcome = run_conversion(ConvertConfig(input=str(tmp_path / "in" / "train-*"), output=str(tmp_path / "out")),
                             ["--direct_num_workers=1"])
    assert outcome.ok
    text = (tmp_path / "out" / "manifest.json").read_text()
    manifest = Manifest.from_json(text)
    assert [s.feature_stats for s in manifest.shards] == [reference(records) for records in shards]
    assert manifest.feature_stats["image/class/label"] == {"kind": "int64", "records": 1200, "min": 1, "max": 1000,
                                                           "min_length": 1, "max_length": 1}
    assert manifest.feature_stats["image/object/bbox/xmin"]["max_length"] == 2
    assert ShardTable.from_json(text).feature_stats == tuple(s.feature_stats for s in manifest.shards)
    record = json.loads((tmp_path / "out" / ".shards" / "train-00001-of-00003.array_record.json").read_text())
    assert record["entry"]["feature_stats"] == reference(shards[1])  # a resumed run keeps them


def test_a_manifest_without_statistics_still_loads(tmp_path):
    """Manifests written before statistics were recorded: every reader takes them, with the statistics unknown."""
    write_tfrecord_shards(tmp_path / "in", [[encode_example({"label": i}) for i in range(5)]])
    assert run_conversion(ConvertConfig(input=str(tmp_path / "in" / "*"), output=str(tmp_path / "out")),
                          ["--direct_num_workers=1"]).ok
    old = json.loads((tmp_path / "out" / "manifest.json").read_text())
    for shard in old["shards"]:
        del shard["feature_stats"]
    text = json.dumps(old)
    assert Manifest.from_json(text).feature_stats is None and ShardTable.from_json(text).feature_stats == (None,)
