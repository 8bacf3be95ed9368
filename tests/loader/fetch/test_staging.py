"""Staging gs:// data to local disk, against the local GCS emulator."""

import os

import pytest

import loader
from pipelines import ConvertConfig, run_conversion
from tests.conftest import synthetic_records, write_tfrecord_shards

pytestmark = pytest.mark.gcs


def test_stage_copies_verifies_and_resumes(tmp_path, gcs_bucket):
    bucket, client = gcs_bucket
    write_tfrecord_shards(tmp_path / "in", [synthetic_records(i, n) for i, n in enumerate([30, 45, 12])])
    remote = f"gs://{bucket}/ds"
    run_conversion(ConvertConfig(input=str(tmp_path / "in" / "*"), output=remote), ["--direct_num_workers=1"])
    local = tmp_path / "staged"

    first = loader.stage(remote, str(local))
    assert (first.copied, first.skipped) == (3, 0)
    assert sorted(os.listdir(local)) == ["manifest.json", "report.json"] + [
        f"train-{i:05d}-of-00003.array_record" for i in range(3)]
    kw = dict(batch_size=6, seed=4, num_epochs=1, decode=None)
    assert list(loader.load(str(local), **kw)) == list(loader.load(remote, **kw))

    # Interrupted or damaged copies: only those are copied again.
    os.remove(local / "train-00001-of-00003.array_record")
    with open(local / "train-00002-of-00003.array_record", "r+b") as f:
        f.truncate(100)
    again = loader.stage(remote, str(local))
    assert (again.copied, again.skipped) == (2, 1)
    assert list(loader.load(str(local), **kw)) == list(loader.load(remote, **kw))


def test_stage_refuses_a_bucket_whose_shards_disagree_with_the_manifest(tmp_path, gcs_bucket):
    bucket, client = gcs_bucket
    write_tfrecord_shards(tmp_path / "in", [synthetic_records(0, 10)])
    remote = f"gs://{bucket}/ds"
    run_conversion(ConvertConfig(input=str(tmp_path / "in" / "*"), output=remote), ["--direct_num_workers=1"])
    client.bucket(bucket).blob("ds/train-00000-of-00001.array_record").upload_from_string(b"short")
    with pytest.raises(ValueError, match="train-00000-of-00001.array_record is 5 bytes but the manifest says"):
        loader.stage(remote, str(tmp_path / "staged"))
    with pytest.raises(FileNotFoundError, match="is empty or does not exist"):
        loader.stage(f"gs://{bucket}/nothing", str(tmp_path / "staged"))
