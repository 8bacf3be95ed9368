"""What `--input` accepts, and one line with exit 2 (no traceback) for each input that cannot work."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO, file_permissions_apply, run_cli, synthetic_records, write_tfrecord_shards


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
    assert proc.stderr.count("converting its 3 TFRecord file(s); 2 other file(s) skipped (e.g. .hidden.tfrecord)") == 1
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert [s["path"] for s in manifest["shards"]] == ["empty.array_record", "train-00000-of-00002.array_record",
                                                       "train-00001-of-00002.array_record"]
    assert [s["records"] for s in manifest["shards"]] == [0, 10, 10]


IMAGENET_NAMES = ("train-00000-of-00002", "train-00001-of-00002", "validation-00000-of-00001")


def test_imagenet_shard_names_convert_one_split_per_glob(tmp_path):
    """ImageNet's own shard names carry no 'tfrecord': a glob per split converts them; the directory itself is
    refused with the globs to pass, one per split (its `DIR/*` would mix validation into train)."""
    from pipelines.paths import list_inputs

    for i, name in enumerate(IMAGENET_NAMES):
        write_tfrecord_shards(tmp_path / "imagenet", [synthetic_records(i, 3)], pattern=name)
    assert [f.path.rsplit("/", 1)[1] for f in list_inputs(str(tmp_path / "imagenet" / "train-*"))] == [
        "train-00000-of-00002", "train-00001-of-00002"]
    with pytest.raises(FileNotFoundError) as e:
        list_inputs(str(tmp_path / "imagenet"))
    assert str(e.value) == (
        f"input directory '{tmp_path / 'imagenet'}' holds no TFRecord files (names with 'tfrecord' or 'tfrecords'; it "
        "has train-00000-of-00002, train-00001-of-00002, validation-00000-of-00001); pass a glob of one split's files "
        f"instead, e.g. --input '{tmp_path / 'imagenet'}/train-*' and --input '{tmp_path / 'imagenet'}/validation-*' "
        "into another --output")


def test_a_glob_that_matches_nothing_lists_its_directory(tmp_path):
    from pipelines.paths import list_inputs

    for i, name in enumerate(IMAGENET_NAMES):
        write_tfrecord_shards(tmp_path / "imagenet", [synthetic_records(i, 3)], pattern=name)
    with pytest.raises(FileNotFoundError) as e:
        list_inputs(str(tmp_path / "imagenet" / "train-*.tfrecord"))  # the suffix ImageNet's names do not have
    assert str(e.value) == (
        f"no files match '{tmp_path / 'imagenet' / 'train-*.tfrecord'}'; check the directory and the glob; "
        f"{tmp_path / 'imagenet'}/ holds 3 file(s): train-00000-of-00002, train-00001-of-00002, "
        f"validation-00000-of-00001; one --input per split, e.g. --input '{tmp_path / 'imagenet'}/train-*' (and "
        f"--input '{tmp_path / 'imagenet'}/validation-*' into another --output)")


def test_a_directory_of_several_splits_warns_that_they_merge(tmp_path, caplog):
    from pipelines.paths import list_inputs

    write_tfrecord_shards(tmp_path / "d", [synthetic_records(0, 2)], pattern="mnist-train.tfrecord-00000-of-00001")
    write_tfrecord_shards(tmp_path / "d", [synthetic_records(1, 2)], pattern="mnist-test.tfrecord-00000-of-00001")
    with caplog.at_level("WARNING", logger="pipelines.paths"):
        assert len(list_inputs(str(tmp_path / "d"))) == 2
    assert (f"its TFRecord files form 2 groups ('{tmp_path / 'd'}/mnist-train.tfrecord-*', "
            f"'{tmp_path / 'd'}/mnist-test.tfrecord-*'): they all go into one dataset") in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="pipelines.paths"):  # a glob over both splits: the same warning, once
        assert len(list_inputs(str(tmp_path / "d" / "*"))) == 2
        assert len(list_inputs(str(tmp_path / "d" / "*"))) == 2
    assert caplog.text.count(f"{tmp_path / 'd'}/*: its TFRecord files form 2 groups ('{tmp_path / 'd'}/mnist-"
                             "train.tfrecord-*', ") == 1
    caplog.clear()
    with caplog.at_level("WARNING", logger="pipelines.paths"):  # one split's glob: nothing to say
        assert len(list_inputs(str(tmp_path / "d" / "mnist-train.*"))) == 1
    assert caplog.text == ""


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


def test_a_relative_output_inside_the_input_is_refused(tmp_path, monkeypatch):
    """The inputs were compared as absolute paths and the output as typed: `--input 'data/*' --output data` converted
    into the input, then read its own lock file, shards and report back as inputs."""
    from pipelines import ConvertConfig, run_conversion

    write_tfrecord_shards(tmp_path / "data", [synthetic_records(0, 5)])
    monkeypatch.chdir(tmp_path)
    os.symlink(tmp_path / "data", tmp_path / "link")  # the input's directory under another name
    for given, output in (("data/*", "data"), ("data", "./data"), ("./data/*", "data/"), ("data/*", "link")):
        with pytest.raises(ValueError, match=rf"^--output '{re.escape(output)}' is inside --input "):
            run_conversion(ConvertConfig(input=given, output=output), ["--direct_num_workers=1"])
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["train-00000-of-00001.tfrecord"]
    # A glob that reaches into a subdirectory the output makes: accepted on the first run (no output files yet to
    # match), refused on the second. A glob one level up leaves the output's files out: fine.
    for given in ("data/**", "d*/**"):
        with pytest.raises(ValueError, match=rf"^--output 'data/out' is inside --input '.*{re.escape(given)}' \(it "
                                             rf"matches '{re.escape(str(tmp_path / 'data' / 'out'))}/manifest\.json'"):
            run_conversion(ConvertConfig(input=given, output="data/out"), ["--direct_num_workers=1"])
    assert run_conversion(ConvertConfig(input="data/*", output="data/out"), ["--direct_num_workers=1"]).ok


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
    client.bucket(bucket).blob("more_raw/extra.tfrecord").upload_from_filename(str(path))
    # a wildcard in a directory part: both prefixes' files (the planner lists what convert would do)
    proc = run_cli("plan", "--input", f"gs://{bucket}/*raw/*.tfrecord", "--output", str(tmp_path / "out"),
                   env=gcs_emulator, check=True)
    assert f"convert gs://{bucket}/more_raw/extra.tfrecord" in proc.stdout
    assert "plan: 1 shard(s) to convert, 2 up to date" in proc.stdout


@pytest.mark.gcs
def test_a_gcs_tfds_directory_above_its_versions_is_named_with_one_to_pass(gcs_bucket, gcs_emulator):
    """A gs:// prefix whose objects are all in deeper prefixes was said not to exist."""
    from pipelines import paths

    bucket, client = gcs_bucket
    for name in ("digits/1.0.0/dataset_info.json", "digits/1.0.0/digits-train.tfrecord-00000-of-00001",
                 "digits/1.1.0/dataset_info.json"):
        client.bucket(bucket).blob(f"tfds/{name}").upload_from_string(b"{}")
    for given in (f"gs://{bucket}/tfds/digits", f"gs://{bucket}/tfds/digits/"):
        with pytest.raises(FileNotFoundError) as e:
            paths.list_inputs(given)
        assert str(e.value) == (f"input directory {given!r} is a TFDS dataset's directory: pass one version of it, "
                                f"which holds dataset_info.json, e.g. --input gs://{bucket}/tfds/digits/1.1.0 (it "
                                "has 1.0.0, 1.1.0)")
    with pytest.raises(FileNotFoundError) as e:
        paths.list_inputs(f"gs://{bucket}/tfds")
    assert str(e.value) == (f"input directory 'gs://{bucket}/tfds' holds TFDS datasets (digits/1.0.0, digits/1.1.0): "
                            f"pass one version of one, which holds dataset_info.json, e.g. --input "
                            f"gs://{bucket}/tfds/digits/1.1.0")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        paths.list_inputs(f"gs://{bucket}/tfds/missing")


def test_unreadable_inputs_are_one_line_before_anything_is_written(tmp_path):
    as_user = file_permissions_apply()
    write_tfrecord_shards(tmp_path / "data", [synthetic_records(i, 5) for i in range(3)])
    locked = tmp_path / "data" / "train-00001-of-00003.tfrecord"
    locked.chmod(0)
    for given in (tmp_path / "data", tmp_path / "data" / "*.tfrecord", locked):
        _one_line_error(run_cli("convert", "--input", str(given), "--output", str(tmp_path / "o"), prefix=as_user),
                        f"input '{locked}' cannot be read (permission denied); grant read access (e.g. chmod a+r "
                        f"'{locked}') or leave it out of --input")
    (tmp_path / "data").chmod(0o300)  # may write and enter, may not list
    _one_line_error(run_cli("convert", "--input", str(tmp_path / "data"), "--output", str(tmp_path / "o"),
                            prefix=as_user),
                    f"input directory '{tmp_path / 'data'}' cannot be listed (permission denied)")
    _one_line_error(run_cli("convert", "--input", str(tmp_path / "data" / "train-*"), "--output", str(tmp_path / "o"),
                            prefix=as_user),
                    f"input directory '{tmp_path / 'data'}/' cannot be listed (permission denied)")
    assert not (tmp_path / "o").exists()


def test_a_shard_unreadable_at_run_time_fails_alone_and_is_reported(tmp_path):
    """Read access lost between the plan and the worker: that shard is FAILED in the manifest, the others commit."""
    write_tfrecord_shards(tmp_path / "data", [synthetic_records(i, 5) for i in range(3)])
    locked = tmp_path / "data" / "train-00001-of-00003.tfrecord"
    script = f"""
import apache_beam as beam, json, os
from pipelines.config import ConvertConfig
from pipelines.convert import ConvertToArrayRecord
from pipelines.plan import make_plan, read_manifest
config = ConvertConfig(input={str(tmp_path / 'data')!r}, output={str(tmp_path / 'o')!r})
plan = make_plan(config)
os.chmod({str(locked)!r}, 0)
with beam.Pipeline() as p:
    _ = p | ConvertToArrayRecord(config, plan)
manifest = read_manifest(config.output)
print(json.dumps({{"failed": manifest.failed, "shards": [s.path for s in manifest.shards]}}))
"""
    proc = subprocess.run([*file_permissions_apply(), sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result == {"failed": [{"source": str(locked), "error": f"{locked} cannot be read (permission denied); "
                                  "grant read access and rerun (the converted shards are kept)"}],
                      "shards": ["train-00000-of-00003.array_record", "train-00002-of-00003.array_record"]}


@pytest.mark.gcs
def test_a_forbidden_gcs_input_is_one_line(tmp_path, faulty_gcs, gcs_emulator):
    bucket, front = faulty_gcs
    front.fail_next(403, times=20, where=f"/b/{bucket}/o")  # every listing and read of the bucket's objects
    _one_line_error(run_cli("convert", "--input", f"gs://{bucket}/raw/*.tfrecord", "--output", str(tmp_path / "out"),
                            env=gcs_emulator),
                    f"permission denied (403) on bucket '{bucket}'")
    assert front.failed and not (tmp_path / "out").exists()


def test_inputs_that_are_not_tfrecords_of_a_directory_are_named_with_what_to_pass(tmp_path):
    """A converted output given as --input was told to pass a glob of its .array_record files (which then failed as
    corrupt TFRecords); a TFDS dataset's directory without its version, a glob that matched nothing."""
    from pipelines import paths

    (tmp_path / "out").mkdir()
    for name in ("manifest.json", "report.json", "train.array_record-00000-of-00001"):
        (tmp_path / "out" / name).write_text("{}")
    with pytest.raises(FileNotFoundError) as e:
        paths.list_inputs(str(tmp_path / "out"))
    assert str(e.value) == (f"input directory '{tmp_path / 'out'}' is a converted output (it holds manifest.json): it "
                            f"needs no conversion; load it as it is (loader.load('{tmp_path / 'out'}'), python -m "
                            f"trainer data={tmp_path / 'out'}), or pass the TFRecords it was converted from as --input")
    # (with the leftovers of builds TFDS did not finish, in both of its forms: not versions to pass)
    for version in ("1.0.0", "1.10.0", "1.2.0", "incomplete.AB12CD_1.10.0", "1.10.0.incompleteXYZ"):
        (tmp_path / "digits" / version).mkdir(parents=True)
        (tmp_path / "digits" / version / "dataset_info.json").write_text("{}")
    with pytest.raises(FileNotFoundError) as e:
        paths.list_inputs(str(tmp_path / "digits"))
    assert str(e.value) == (f"input directory '{tmp_path / 'digits'}' is a TFDS dataset's directory: pass one version "
                            f"of it, which holds dataset_info.json, e.g. --input {tmp_path / 'digits' / '1.10.0'} (it "
                            "has 1.0.0, 1.2.0, 1.10.0)")
    (tmp_path / "data_dir" / "fashion" / "2.0.0").mkdir(parents=True)  # a TFDS data_dir: ~/tensorflow_datasets
    (tmp_path / "data_dir" / "fashion" / "2.0.0" / "dataset_info.json").write_text("{}")
    shutil.copytree(tmp_path / "digits", tmp_path / "data_dir" / "digits")
    with pytest.raises(FileNotFoundError) as e:  # it was told to pass 'data_dir/*', which matches no file
        paths.list_inputs(str(tmp_path / "data_dir"))
    assert str(e.value) == (f"input directory '{tmp_path / 'data_dir'}' holds TFDS datasets (digits/1.0.0, "
                            "digits/1.2.0, digits/1.10.0, fashion/2.0.0): pass one version of one, which holds "
                            f"dataset_info.json, e.g. --input {tmp_path / 'data_dir' / 'fashion' / '2.0.0'}")
    (tmp_path / "nested" / "a").mkdir(parents=True)
    (tmp_path / "nested" / "b").mkdir()
    with pytest.raises(FileNotFoundError) as e:
        paths.list_inputs(str(tmp_path / "nested"))
    assert str(e.value) == (f"input directory '{tmp_path / 'nested'}' holds no files, only directories (a, b); pass "
                            f"the one holding the TFRecord files, or a glob of them, e.g. --input "
                            f"'{tmp_path / 'nested' / 'a'}/*'")


def test_a_glob_skips_hidden_and_marker_files_unless_it_names_them(tmp_path, caplog):
    """A Spark export's `.part-r-00000.crc` and `_SUCCESS` were converted (and failed) as shards."""
    from pipelines import paths

    write_tfrecord_shards(tmp_path / "sp", [synthetic_records(0, 3), synthetic_records(3, 3)],
                          pattern="part-r-{i:05d}")
    (tmp_path / "sp" / ".part-r-00000.crc").write_bytes(b"\x00" * 12)
    (tmp_path / "sp" / "_SUCCESS").write_bytes(b"")
    with caplog.at_level("INFO", logger="pipelines.paths"):
        got = [p.rsplit("/", 1)[1] for p in map(lambda f: f.path, paths.list_inputs(str(tmp_path / "sp" / "*")))]
    assert got == ["part-r-00000", "part-r-00001"]
    assert f"{tmp_path / 'sp' / '*'}: 2 hidden or marker file(s) skipped (e.g. .part-r-00000.crc)" in caplog.text
    assert [f.path.rsplit("/", 1)[1] for f in paths.list_inputs(str(tmp_path / "sp" / ".*"))] == [".part-r-00000.crc"]
    assert [f.path.rsplit("/", 1)[1] for f in paths.list_inputs(str(tmp_path / "sp" / "_*"))] == ["_SUCCESS"]
    # `**` does not reach into hidden directories (an earlier output's .shards/ records, Spark's _temporary/)
    for hidden in (".shards", "_temporary"):
        (tmp_path / "sp" / "out" / hidden).mkdir(parents=True)
        (tmp_path / "sp" / "out" / hidden / "part-r-00009.json").write_text("{}")
    got = [f.path[len(str(tmp_path / "sp")) + 1:] for f in paths.list_inputs(str(tmp_path / "sp" / "**"))]
    assert got == ["part-r-00000", "part-r-00001"]
    assert [f.path.rsplit("/", 2)[1] for f in paths.list_inputs(str(tmp_path / "sp" / "out" / ".shards" / "*"))] == [
        ".shards"]  # named: taken


def test_a_file_whose_name_holds_glob_characters_is_that_file(tmp_path):
    """`--input 'br[1]/part.tfrecord'` said "no files match" (`[1]` is a glob's character class) though it exists."""
    from pipelines import paths

    write_tfrecord_shards(tmp_path / "br[1]", [synthetic_records(0, 5)])
    path = str(tmp_path / "br[1]" / "train-00000-of-00001.tfrecord")
    assert [f.path for f in paths.list_inputs(path)] == [path]


def test_arrayrecord_files_as_input_are_refused_up_front(tmp_path):
    """Each shard failed on its own ("is an ArrayRecord file"), exit 1, leaving an output of failures only."""
    from pipelines import ConvertConfig, run_conversion

    write_tfrecord_shards(tmp_path / "in", [synthetic_records(0, 5)])
    assert run_conversion(ConvertConfig(input=str(tmp_path / "in" / "*"), output=str(tmp_path / "out")),
                          ["--direct_num_workers=1"]).ok
    again = str(tmp_path / "out" / "*.array_record")
    with pytest.raises(FileNotFoundError, match=rf"^input '{re.escape(again)}' names ArrayRecord files \(e\.g\. .*"
                                                r"\), converted already: load them as they are"):
        run_conversion(ConvertConfig(input=again, output=str(tmp_path / "twice")), ["--direct_num_workers=1"])
    assert not (tmp_path / "twice").exists()
