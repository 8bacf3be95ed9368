import json
import re

import pytest

from dataset_format.manifest import FORMAT, FORMAT_VERSION, Manifest, ShardEntry, ShardTable


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


# -- ShardTable: the columns a reader needs ---------------------------------------------------------------

def manifest_text(**changes) -> str:
    shards = [ShardEntry(f"train-0000{i}-of-00003.array_record", f"/in/train-0000{i}.tfrecord", 10 + i, 1000 + i,
                         1100 + i, "size=1100,mtime=1.0", "group_size:1,snappy", "train" if i < 2 else "test")
              for i in range(3)]
    return Manifest("/in/*", "tfds", tuple(shards), "0.1.0").to_json() if not changes else \
        json.dumps({**json.loads(Manifest("/in/*", "tfds", tuple(shards), "0.1.0").to_json()), **changes})


def test_the_table_holds_the_manifests_columns():
    text = manifest_text()
    manifest, table = Manifest.from_json(text), ShardTable.from_json(text)
    assert table.kind == manifest.kind == "tfds" and table.complete
    assert table.paths == tuple(s.path for s in manifest.shards)
    assert table.records == (10, 11, 12) and table.bytes == (1000, 1001, 1002)
    assert table.splits == ("train", "train", "test")


def test_a_damaged_manifest_is_one_line_either_way():
    bad_totals = manifest_text(totals={"shards": 3, "records": 99, "bytes": 0})
    for parse in (Manifest.from_json, ShardTable.from_json):
        with pytest.raises(ValueError, match=r"^m.json: totals.records=99 but the shards add up to 33"):
            parse(bad_totals, path="m.json")
        with pytest.raises(ValueError, match=r"^m.json: not a conversion manifest"):
            parse(json.dumps({"format": "other"}), path="m.json")
        with pytest.raises(ValueError, match=rf"^m.json: manifest format_version 0 is not {FORMAT_VERSION}"):
            parse(json.dumps({"format": FORMAT, "format_version": 0}), path="m.json")
    d = json.loads(manifest_text())
    del d["shards"][1]["bytes"]
    with pytest.raises(ValueError, match=r"^m.json: a shard entry lacks 'bytes'"):
        ShardTable.from_json(json.dumps(d), path="m.json")
    for bad in ("9", -1, 1.5, True):
        d = json.loads(manifest_text())
        d["shards"][2]["token_count"] = bad
        with pytest.raises(ValueError, match=rf"^m.json: a shard's token_count is {re.escape(repr(bad))}, not a count "
                                             "of tokens; the manifest was edited or damaged: delete it and re-run "
                                             r"the conversion \(it rebuilds the manifest\)$"):
            ShardTable.from_json(json.dumps(d), path="m.json")
    # what a reader would trip on or be misled by: one line naming it, from either parser
    damaged = "; the manifest was edited or damaged: delete it and re-run the conversion (it rebuilds the manifest)"
    cases = [(lambda d: d.pop("shards"), "no 'shards'"),
             (lambda d: d.update(shards={}), "'shards' is not a list or 'totals' not an object"),
             (lambda d: d["shards"].__setitem__(0, "x"), "a shard entry is not an object"),
             (lambda d: d["shards"][1].update(records="x"), "shard 1's records is 'x', not a count"),
             (lambda d: d["shards"][0].update(bytes=-5), "shard 0's bytes is -5, not a count"),
             (lambda d: d["shards"][0].update(records=True), "shard 0's records is True, not a count"),
             (lambda d: d["shards"][1].update(path="../../elsewhere/x.array_record"),
              "a shard's path '../../elsewhere/x.array_record' is not a file inside the dataset directory"),
             (lambda d: d["shards"][1].update(path="/etc/passwd"),
              "a shard's path '/etc/passwd' is not a file inside the dataset directory"),
             (lambda d: d["shards"][1].update(path="gs://other/x"),
              "a shard's path 'gs://other/x' is not a file inside the dataset directory"),
             (lambda d: d["shards"][2].update(path=d["shards"][0]["path"]),
              "shard 'train-00000-of-00003.array_record' is listed more than once"),
             (lambda d: d.update(failed=["x"]), "'failed' is not a list of objects")]
    for damage, said in cases:
        d = json.loads(manifest_text())
        damage(d)
        for parse in (Manifest.from_json, ShardTable.from_json):
            with pytest.raises(ValueError, match=f"^m.json: {re.escape(said + damaged)}$"):
                parse(json.dumps(d), path="m.json")
    with pytest.raises(ValueError, match=r"^m.json: not a conversion manifest \(a JSON list, not an object\)$"):
        ShardTable.from_json("[]", path="m.json")
    d = json.loads(manifest_text())
    d["shards"][1]["path"] = "sub/dir/b.array_record"  # below the directory: fine
    assert ShardTable.from_json(json.dumps(d)).paths[1] == "sub/dir/b.array_record"
    d = json.loads(manifest_text())
    d["shards"][2]["token_count"] = 7
    assert ShardTable.from_json(json.dumps(d)).token_counts == (None, None, 7)
