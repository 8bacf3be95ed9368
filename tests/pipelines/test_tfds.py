"""TFDS in, TFDS out: the converted directory loads with tfds and holds the same examples."""

import json

import numpy as np
import pytest
import tensorflow_datasets as tfds

from pipelines import ConvertConfig, run_conversion, tfds_dir, tfrecord
from pipelines.verify import verify


def _original_records(tfds_dir_path, split):
    """The split's serialized examples, read from the TFRecord shards TFDS wrote (shard order)."""
    records = []
    for shard in sorted(tfds_dir_path.glob(f"digits-{split}.tfrecord-*")):
        with open(shard, "rb") as f:
            records.extend(tfrecord.iter_records(f, path=str(shard)))
    return records


def test_tfds_directory_converts_to_a_loadable_array_record_dataset(tfds_digits, tmp_path):
    out = tmp_path / "digits" / "1.0.0"
    outcome = run_conversion(ConvertConfig(input=str(tfds_digits), output=str(out)))

    assert outcome.ok and outcome.converted == 6
    info = json.loads((out / "dataset_info.json").read_text())
    source_info = json.loads((tfds_digits / "dataset_info.json").read_text())
    assert info["fileFormat"] == "array_record"
    assert [s["shardLengths"] for s in info["splits"]] == [s["shardLengths"] for s in source_info["splits"]]
    assert (out / "features.json").read_text() == (tfds_digits / "features.json").read_text()

    builder = tfds.builder_from_directory(str(out))
    features = tfds.builder_from_directory(str(tfds_digits)).info.features
    for split, expected_len in (("train", 1438), ("test", 359)):
        source = builder.as_data_source(split)
        originals = _original_records(tfds_digits, split)
        assert len(source) == len(originals) == expected_len
        for i in range(len(source)):
            want = features.deserialize_example_np(originals[i])
            assert source[i]["label"] == want["label"]
            np.testing.assert_array_equal(source[i]["image"], want["image"])

    # Manifest order follows the splits, then the shards.
    assert [s.path for s in outcome.manifest.shards] == [
        f"digits-{split}.array_record-{i:05d}-of-00003" for split in ("train", "test") for i in range(3)]
    result = verify(str(out), deep=True)
    assert result.problems == [] and result.stale == []  # a TFDS directory's sources, listed as it was converted
    # ... also after a rerun that converts test shards only (its tasks' splits came first: test before train)
    (out / "digits-test.array_record-00001-of-00003").unlink()
    again = run_conversion(ConvertConfig(input=str(tfds_digits), output=str(out)))
    assert again.converted == 1 and [s.path for s in again.manifest.shards] == [
        f"digits-{split}.array_record-{i:05d}-of-00003" for split in ("train", "test") for i in range(3)]


def test_a_split_of_no_shards_converts_as_an_empty_split(tfds_digits, tmp_path):
    """A split that dataset_info.json lists with no shards: every shard converted, then the metadata step failed ("has
    no converted shards"), and every rerun the same way, with no manifest written. It is an empty split, as TFDS
    reads it."""
    source = tmp_path / "source"
    source.mkdir()
    for f in tfds_digits.iterdir():
        (source / f.name).write_bytes(f.read_bytes())
    info = json.loads((source / "dataset_info.json").read_text())
    info["splits"].append({"name": "extra", "shardLengths": [], "numBytes": "0"})
    (source / "dataset_info.json").write_text(json.dumps(info))
    out = tmp_path / "out"
    outcome = run_conversion(ConvertConfig(input=str(source), output=str(out)), ["--direct_num_workers=1"])
    assert outcome.ok and outcome.converted == 6
    written = json.loads((out / "dataset_info.json").read_text())
    assert [(s["name"], len(s["shardLengths"])) for s in written["splits"]] == [("train", 3), ("test", 3), ("extra", 0)]
    builder = tfds.builder_from_directory(str(out))
    assert len(builder.as_data_source("test")) == 359 and builder.info.splits["extra"].num_examples == 0


@pytest.mark.parametrize("template", ["{SPLIT}-{SHARD_X_OF_Y}", "{DATASET}.{SPLIT}.tfrecord-{SHARD_INDEX}"])
def test_a_file_name_template_without_the_file_format_names_the_converted_shards(tfds_digits, tmp_path, template):
    """A split's filepathTemplate without {FILEFORMAT}: the output's dataset_info.json kept it, naming the TFRecords'
    names, so tfds.builder_from_directory(OUT) found no shard (and verify passed). It names the ArrayRecord shards
    now; a template with subdirectories, which the conversion does not read, is one line at the plan."""
    source = tmp_path / "source"
    source.mkdir()
    info = json.loads((tfds_digits / "dataset_info.json").read_text())
    for split in info["splits"]:
        n = len(split["shardLengths"])
        for i in range(n):
            old = tfds_dir.shard_name(info, split, "tfrecord", i, n)
            split["filepathTemplate"] = template
            (source / tfds_dir.shard_name(info, split, "tfrecord", i, n)).write_bytes((tfds_digits / old).read_bytes())
            del split["filepathTemplate"]
        split["filepathTemplate"] = template
    for f in tfds_digits.iterdir():  # the other metadata files
        if ".tfrecord-" not in f.name and f.name != "dataset_info.json":
            (source / f.name).write_bytes(f.read_bytes())
    (source / "dataset_info.json").write_text(json.dumps(info))
    out = tmp_path / "out"
    assert run_conversion(ConvertConfig(input=str(source), output=str(out)), ["--direct_num_workers=1"]).ok
    builder = tfds.builder_from_directory(str(out))
    assert len(builder.as_data_source("train")) == 1438 and len(builder.as_data_source("test")) == 359
    assert verify(str(out)).problems == []
    written = json.loads((out / "dataset_info.json").read_text())
    written["splits"][0]["filepathTemplate"] = template  # as the conversion wrote it before
    (out / "dataset_info.json").write_text(json.dumps(written))
    assert "TFDS would not find them" in verify(str(out)).problems[0]

    info["splits"][0]["filepathTemplate"] = "{SPLIT}/data.{FILEFORMAT}-{SHARD_INDEX}"
    (source / "dataset_info.json").write_text(json.dumps(info))
    with pytest.raises(ValueError, match=r"split 'train' keeps its shards in subdirectories \(filepathTemplate "
                                         r"'\{SPLIT\}/data.\{FILEFORMAT\}-\{SHARD_INDEX\}'\)"):
        tfds_dir.list_shards(str(source))


def test_tfds_shard_count_mismatch_fails_the_shard(tfds_digits, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tfds_digits.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    info = json.loads((broken / "dataset_info.json").read_text())
    info["splits"][1]["shardLengths"][0] = str(int(info["splits"][1]["shardLengths"][0]) + 1)
    (broken / "dataset_info.json").write_text(json.dumps(info))

    outcome = run_conversion(ConvertConfig(input=str(broken), output=str(tmp_path / "out")), ["--direct_num_workers=1"])

    assert not outcome.ok
    (failure,) = outcome.manifest.failed
    assert failure["source"] == str(broken / "digits-test.tfrecord-00000-of-00003")
    assert "dataset_info.json says 121" in failure["error"]
    assert not (tmp_path / "out" / "digits-test.array_record-00000-of-00003").exists()
    assert not (tmp_path / "out" / "dataset_info.json").exists()  # an incomplete TFDS dir is not made loadable


def test_missing_tfds_shard_is_named(tfds_digits, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tfds_digits.iterdir():
        if "train.tfrecord-00001" not in f.name:
            (broken / f.name).write_bytes(f.read_bytes())
    try:
        tfds_dir.list_shards(str(broken))
    except FileNotFoundError as e:
        assert "digits-train.tfrecord-00001-of-00003 is listed in dataset_info.json (split 'train', shard 1)" in str(e)
    else:
        raise AssertionError("a missing shard was not reported")
