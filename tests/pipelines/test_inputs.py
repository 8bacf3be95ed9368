"""What `--input` accepts, and one line with exit 2 (no traceback) for each input that cannot work."""

import json

import pytest

from tests.conftest import run_cli, synthetic_records, write_tfrecord_shards


def _one_line_error(proc, message):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], proc.stderr


def test_a_directory_converts_its_tfrecord_files(tmp_path):
    write_tfrecord_shards(tmp_path / "data", [synthetic_records(i, 10) for i in range(2)])
    (tmp_path / "data" / "README.txt").write_text("not data")
    (tmp_path / "data" / ".hidden.tfrecord").write_bytes(b"")
    (tmp_path / "data" / "empty.tfrecord").write_bytes(b"")  # an empty file is an empty shard
    (tmp_path / "data" / "nested").mkdir()

    proc = run_cli("convert", "--input", str(tmp_path / "data"), "--output", str(tmp_path / "out"), check=True)

    assert "converted 3 shard(s) (20 records" in proc.stdout
    assert "converting its 3 TFRecord file(s); 2 other file(s) skipped (e.g. .hidden.tfrecord)" in proc.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert [s["path"] for s in manifest["shards"]] == ["empty.array_record", "train-00000-of-00002.array_record",
                                                       "train-00001-of-00002.array_record"]
    assert [s["records"] for s in manifest["shards"]] == [0, 10, 10]


def test_bad_local_inputs_are_one_line(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("x")
    _one_line_error(run_cli("convert", "--input", str(tmp_path / "docs"), "--output", str(tmp_path / "o")),
                    f"input directory '{tmp_path / 'docs'}' holds no TFRecord files (names with 'tfrecord' or "
                    f"'tfrecords'; it has a.txt); pass a glob of its files instead, e.g. --input '{tmp_path / 'docs'}/*'")
    _one_line_error(run_cli("convert", "--input", str(tmp_path / "nothing"), "--output", str(tmp_path / "o")),
                    f"input '{tmp_path / 'nothing'}' does not exist")
    _one_line_error(run_cli("convert", "--input", str(tmp_path / "*.tfrecord"), "--output", str(tmp_path / "o")),
                    f"no files match '{tmp_path / '*.tfrecord'}'; check the directory and the glob")
    write_tfrecord_shards(tmp_path / "data", [synthetic_records(0, 5)])
    _one_line_error(run_cli("convert", "--input", str(tmp_path / "data" / "*"), "--output", str(tmp_path / "data")),
                    f"--output '{tmp_path / 'data'}' is inside --input '{tmp_path / 'data' / '*'}'")
    assert not (tmp_path / "o").exists() and sorted(p.name for p in (tmp_path / "data").iterdir()) == [
        "train-00000-of-00001.tfrecord"]


@pytest.mark.gcs
def test_a_missing_bucket_is_one_line(tmp_path, gcs_emulator):
    write_tfrecord_shards(tmp_path / "data", [synthetic_records(0, 5)])
    _one_line_error(run_cli("convert", "--input", str(tmp_path / "data"), "--output", "gs://no-such-bucket-x/out",
                            env=gcs_emulator),
                    "bucket 'no-such-bucket-x' does not exist (404); check the bucket name, or create it")
    _one_line_error(run_cli("convert", "--input", "gs://no-such-bucket-x/raw/*.tfrecord", "--output",
                            str(tmp_path / "out"), env=gcs_emulator),
                    "error: gs://no-such-bucket-x/raw/: bucket 'no-such-bucket-x' does not exist (404)")


@pytest.mark.gcs
def test_a_gcs_prefix_converts_its_tfrecord_objects(tmp_path, gcs_bucket, gcs_emulator):
    bucket, client = gcs_bucket
    for path in write_tfrecord_shards(tmp_path / "data", [synthetic_records(i, 7) for i in range(2)]):
        client.bucket(bucket).blob(f"raw/{path.name}").upload_from_filename(str(path))
    client.bucket(bucket).blob("raw/_SUCCESS").upload_from_string(b"")
    proc = run_cli("convert", "--input", f"gs://{bucket}/raw", "--output", str(tmp_path / "out"), env=gcs_emulator,
                   check=True)
    assert "converted 2 shard(s) (14 records" in proc.stdout
