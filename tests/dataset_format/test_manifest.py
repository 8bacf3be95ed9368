import json

import pytest

from dataset_format.manifest import Manifest, ShardEntry


def _manifest():
    entry = ShardEntry(path="a.array_record", source="/in/a.tfrecord", records=3, bytes=131072, source_bytes=60,
                       source_fingerprint="size=60,mtime=1.000000", writer_options="group_size:1,zstd:3")
    return Manifest(input="/in/*.tfrecord", kind="tfrecord", shards=(entry,), tool_version="0.1.0")


def test_round_trip_and_totals():
    m = _manifest()
    text = m.to_json()
    assert Manifest.from_json(text) == m
    d = json.loads(text)
    assert d["totals"] == {"shards": 1, "records": 3, "bytes": 131072}
    assert d["complete"] is True
    assert m.shard_paths("gs://b/out") == ["gs://b/out/a.array_record"]


def test_damaged_manifests_are_named():
    d = json.loads(_manifest().to_json())
    d["totals"]["records"] = 4
    with pytest.raises(ValueError, match="totals.records=4 but the shards add up to 3"):
        Manifest.from_json(json.dumps(d), path="out/manifest.json")
    with pytest.raises(ValueError, match="out/manifest.json: not valid JSON"):
        Manifest.from_json("{", path="out/manifest.json")
    with pytest.raises(ValueError, match="not a conversion manifest"):
        Manifest.from_json("{}", path="out/manifest.json")
