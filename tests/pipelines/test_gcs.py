"""gs:// in and out, against a local GCS emulator that the tests start (tests/conftest.py)."""

import json

import grain
import pytest

from dataset_format.manifest import Manifest
from pipelines import ConvertConfig, run_conversion
from pipelines.verify import verify
from tests.conftest import run_cli, synthetic_records, write_tfrecord_shards

pytestmark = pytest.mark.gcs


def _upload_dir(client, bucket, local_dir, prefix):
    for path in sorted(local_dir.iterdir()):
        client.bucket(bucket).blob(f"{prefix}/{path.name}").upload_from_filename(str(path))


def test_gcs_to_gcs_end_to_end(tmp_path, gcs_bucket):
    bucket, client = gcs_bucket
    contents = [synthetic_records(i, n) for i, n in enumerate([40, 0, 75])]
    write_tfrecord_shards(tmp_path / "in", contents)
    _upload_dir(client, bucket, tmp_path / "in", "in")
    config = ConvertConfig(input=f"gs://{bucket}/in/*.tfrecord", output=f"gs://{bucket}/out")

    outcome = run_conversion(config, ["--direct_num_workers=1"])

    assert outcome.ok and outcome.converted == 3
    names = sorted(b.name for b in client.list_blobs(bucket, prefix="out/"))
    # Only final names: no temporary objects left behind, no write probe; a commit record per shard.
    shards = [f"train-{i:05d}-of-00003.array_record" for i in range(3)]
    assert names == [f"out/.shards/{s}.json" for s in shards] + ["out/manifest.json", "out/report.json"] + [
        f"out/{s}" for s in shards]
    manifest = Manifest.from_json(client.bucket(bucket).blob("out/manifest.json").download_as_text())
    assert manifest.shards[2].source == f"gs://{bucket}/in/train-00002-of-00003.tfrecord"

    # array_record's own reader opens gs:// directly (through the emulator), via grain.
    source = grain.sources.ArrayRecordDataSource(manifest.shard_paths(f"gs://{bucket}/out"))
    assert [source[i] for i in range(len(source))] == [r for c in contents for r in c]

    result = verify(f"gs://{bucket}/out", deep=True)
    assert result.problems == [] and result.stale == []  # gs:// sources, listed as they were converted
    again = run_conversion(config, ["--direct_num_workers=1"])
    assert again.converted == 0 and len(again.plan.kept) == 3


def test_gcs_output_leaves_no_local_temp_files(tmp_path, gcs_bucket, gcs_emulator):
    bucket, client = gcs_bucket
    write_tfrecord_shards(tmp_path / "in", [synthetic_records(i, 30) for i in range(3)])
    scratch = tmp_path / "tmp"
    scratch.mkdir()

    proc = run_cli("convert", "--input", str(tmp_path / "in" / "*"), "--output", f"gs://{bucket}/out",
                   env={**gcs_emulator, "TMPDIR": str(scratch)}, check=True)

    assert "converted 3 shard(s) (90 records" in proc.stdout
    assert len([b for b in client.list_blobs(bucket, prefix="out/") if b.name.endswith(".array_record")]) == 3
    assert [p.name for p in scratch.iterdir() if p.name.startswith("arconv-")] == []


def test_gcs_input_to_local_output_via_cli(tmp_path, gcs_bucket, gcs_emulator):
    bucket, client = gcs_bucket
    write_tfrecord_shards(tmp_path / "in", [synthetic_records(0, 10), synthetic_records(1, 12)])
    _upload_dir(client, bucket, tmp_path / "in", "data")
    out = tmp_path / "out"

    proc = run_cli("convert", "--input", f"gs://{bucket}/data/*", "--output", str(out), env=gcs_emulator, check=True)

    assert "converted 2 shard(s) (22 records" in proc.stdout
    assert json.loads((out / "manifest.json").read_text())["totals"]["records"] == 22


def test_corrupt_gcs_shard_leaves_no_object(tmp_path, gcs_bucket):
    bucket, client = gcs_bucket
    (path,) = write_tfrecord_shards(tmp_path / "in", [synthetic_records(0, 10)])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    client.bucket(bucket).blob("in/bad.tfrecord").upload_from_string(bytes(data))

    outcome = run_conversion(ConvertConfig(input=f"gs://{bucket}/in/bad.tfrecord", output=f"gs://{bucket}/out"),
                             ["--direct_num_workers=1"])

    assert not outcome.ok
    assert f"gs://{bucket}/in/bad.tfrecord: corrupt TFRecord at byte offset {9 * 116}, record 9:" in outcome.manifest.failed[0]["error"]
    assert sorted(b.name for b in client.list_blobs(bucket, prefix="out/")) == ["out/manifest.json", "out/report.json"]


def test_a_403_writing_the_output_names_the_output_not_the_source(tmp_path, faulty_gcs, monkeypatch):
    """A 403 on the shard's upload (the output bucket's permission revoked mid-run, a retention policy) was reported
    as "<the local source> cannot be read (permission denied); grant read access"."""
    from dataset_format import storage

    bucket, front = faulty_gcs
    write_tfrecord_shards(tmp_path / "in", [synthetic_records(0, 10)])
    upload = storage.upload

    def upload_refused(local, remote):  # the real client, and a real 403 answer to the shard's upload
        front.fail_next(403, where="/upload/")
        return upload(local, remote)

    monkeypatch.setattr(storage, "upload", upload_refused)
    outcome = run_conversion(ConvertConfig(input=str(tmp_path / "in" / "*.tfrecord"), output=f"gs://{bucket}/out"),
                             ["--direct_num_workers=1"])
    assert [f["error"] for f in outcome.manifest.failed] == [
        f"gs://{bucket}/out/train-00000-of-00001.array_record: permission denied (403) on bucket {bucket!r}, object "
        "'out/train-00000-of-00001.array_record'; grant this account access to the bucket (roles/storage.objectViewer "
        "to read, objectAdmin to write) or check the path (the output: the converted shards are kept; rerun once it "
        "can be written)"]


def test_gcs_sources_are_fingerprinted_by_generation_not_by_their_updated_time(tmp_path, faulty_gcs):
    """Cloud Storage moves an object's `updated` time when only its metadata changes (a lifecycle rule's
    storage-class move, `gcloud storage objects update`); the fingerprint was size + `updated`, so a scheduled refresh
    converted such byte-identical sources again. It is size + generation: a metadata change converts nothing, `verify`
    finds nothing stale, a rewrite of the same bytes converts that source again. A manifest of the earlier form
    (size + `updated`) still holds while they do."""
    from dataset_format import storage
    from pipelines.verify import stale_sources

    bucket, front = faulty_gcs
    from google.cloud import storage as gcs

    client = gcs.Client(project="test")
    write_tfrecord_shards(tmp_path / "in", [synthetic_records(i, 5) for i in range(2)])
    _upload_dir(client, bucket, tmp_path / "in", "in")
    config = ConvertConfig(input=f"gs://{bucket}/in", output=f"gs://{bucket}/out")
    assert run_conversion(config, ["--direct_num_workers=1"]).converted == 2
    manifest_path = f"gs://{bucket}/out/manifest.json"
    manifest = Manifest.from_json(storage.read_text(manifest_path))
    generations = storage.list_generations(f"gs://{bucket}/in")
    assert [e.source_fingerprint for e in manifest.shards] == [
        f"size={size},generation={generation}" for _, (size, generation) in sorted(generations.items())]

    first = client.bucket(bucket).blob("in/train-00000-of-00002.tfrecord")
    first.metadata = {"reviewed": "yes"}
    first.patch()

    def metadata_changed(body):  # what GCS answers after the patch: a later `updated`, the same generation
        for item in body.get("items", [body]):
            if item.get("name", "").startswith("in/"):
                item["updated"] = "2031-01-01T00:00:00.000Z"

    front.edit_answers(metadata_changed, where="/o")
    again = run_conversion(config, ["--direct_num_workers=1"])
    assert again.ok and again.converted == 0 and len(again.plan.kept) == 2
    assert stale_sources(manifest.shards) == []

    # A manifest of the earlier form: the sources' size and `updated` time, as listed.
    listed = {f"gs://{bucket}/in/{name}": (b.size, b.updated.timestamp()) for name, b in
              ((b.name[3:], b) for b in client.list_blobs(bucket, prefix="in/"))}
    text = storage.read_text(manifest_path)
    for entry in manifest.shards:
        size, updated = listed[entry.source]
        text = text.replace(entry.source_fingerprint, f"size={size},mtime={updated:.6f}")
    storage.write_text(manifest_path, text)
    assert "mtime=" in text and run_conversion(config, ["--direct_num_workers=1"]).converted == 0

    first.upload_from_filename(str(tmp_path / "in" / "train-00000-of-00002.tfrecord"))  # the same bytes again
    rewritten = run_conversion(config, ["--direct_num_workers=1"])
    assert rewritten.converted == 1 and [t.reason for t in rewritten.plan.tasks] == ["its source changed"]
