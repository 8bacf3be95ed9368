"""Sources other than our own conversion: TFDS's own ArrayRecord output, and gs:// directly."""

import numpy as np
import pytest
import tensorflow_datasets as tfds

import loader
from pipelines import ConvertConfig, run_conversion
from tests.conftest import synthetic_records, write_tfrecord_shards


def test_tfds_build_array_record_directory(tfds_digits_array_record):
    batches = list(loader.load(str(tfds_digits_array_record), split="test", batch_size=50, shuffle=False,
                               num_epochs=1, drop_remainder=False))
    assert sum(len(b["label"]) for b in batches) == 359
    assert batches[0]["image"].shape == (50, 8, 8, 1) and batches[0]["image"].dtype == np.uint8
    # Same examples, same order as TFDS's own data source.
    source = tfds.builder_from_directory(str(tfds_digits_array_record)).as_data_source("test")
    labels = np.concatenate([b["label"] for b in batches])
    np.testing.assert_array_equal(labels, [source[i]["label"] for i in range(len(source))])
    np.testing.assert_array_equal(batches[1]["image"][3], source[53]["image"])


def test_our_tfds_conversion_loads_by_split(tfds_digits, tmp_path):
    out = tmp_path / "digits" / "1.0.0"
    run_conversion(ConvertConfig(input=str(tfds_digits), output=str(out)), ["--direct_num_workers=1"])
    train = loader.load(str(out), split="train", batch_size=2, num_epochs=1)
    assert len(train) == 1438 // 2
    with pytest.raises(ValueError, match=r"no shards for split 'validation'; the splits are \['test', 'train'\]"):
        loader.load(str(out), split="validation", batch_size=2)


def test_tfrecord_tfds_directory_is_refused_with_the_fix(tfds_digits):
    with pytest.raises(ValueError, match="fileFormat='tfrecord'; convert it first: python -m pipelines convert"):
        loader.load(str(tfds_digits), batch_size=2)


@pytest.mark.gcs
def test_tfrecord_shards_given_as_arrayrecord_are_named_with_the_convert_command(tmp_path):
    write_tfrecord_shards(tmp_path, [synthetic_records(0, 3)])
    (shard,) = tmp_path.glob("*.tfrecord")
    renamed = shard.rename(tmp_path / "train-00000.array_record")  # a TFRecord under an ArrayRecord name
    with pytest.raises(ValueError, match=rf"{renamed} is a TFRecord file, not ArrayRecord: convert it first \(python -m "
                                         rf"pipelines convert --input {renamed} --output DIR\)"):
        loader.load(str(tmp_path / "*.array_record"), batch_size=1)


def test_gcs_source_reads_directly(tmp_path, gcs_bucket):
    bucket, client = gcs_bucket
    contents = [synthetic_records(i, n) for i, n in enumerate([20, 13])]
    write_tfrecord_shards(tmp_path / "in", contents)
    for output in (f"gs://{bucket}/ds", str(tmp_path / "local")):
        run_conversion(ConvertConfig(input=str(tmp_path / "in" / "*"), output=output), ["--direct_num_workers=1"])
    remote = list(loader.load(f"gs://{bucket}/ds", batch_size=11, seed=1, num_epochs=1, decode=None))
    assert [r for b in remote for r in b] != [r for c in contents for r in c]  # shuffled...
    assert sorted(r for b in remote for r in b) == sorted(r for c in contents for r in c)  # ...exactly once each
    assert remote == list(loader.load(str(tmp_path / "local"), batch_size=11, seed=1, num_epochs=1, decode=None))


def test_every_kind_of_source_knows_its_shard_sizes_and_versions(converted):
    """The index is keyed by each shard's size and version: its inode, change and modification times
    (loader/format/index.py), so a touch, a chmod or a replacement changes it."""
    import os

    import numpy as np

    from loader.format.source import _mix, resolve

    for source in (resolve(str(converted)), resolve(str(converted / "*.array_record*"))):
        assert source.shard_bytes == tuple(os.path.getsize(p) for p in source.paths), source.kind
        assert source.total_bytes == sum(source.shard_bytes)
        stats = [os.stat(p) for p in source.paths]
        columns = [np.array([getattr(st, name) for st in stats], dtype=np.int64)
                   for name in ("st_mtime_ns", "st_ctime_ns", "st_ino")]
        assert source.shard_versions == tuple(_mix(*columns).tolist()), source.kind
        assert len(set(source.shard_versions)) == len(source.paths)
    mixed = _mix(np.array([1, 1]), np.array([2, 2]), np.array([3, 4]))  # one inode apart
    assert mixed[0] != mixed[1]


def test_where_all_names_shards_and_runs_of_records():
    from loader.format.source import ShardedSource

    source = ShardedSource(("a", "b", "c", "d", "e"), (10, 10, 10, 10, 10), "glob")
    assert source.where_all(np.array([12, 3, 4, 5, 7, 49, 25, 33, 38, 4])) == \
        "a: records 3-5, 7; b: record 2; c: record 5; and records of 2 more shards"
    assert source.where_all(np.arange(0, 20, 2), numbers_shown=3) == \
        "a: records 0, 2, 4 and 2 more; b: records 0, 2, 4 and 2 more"
