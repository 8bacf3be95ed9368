"""End to end through the Beam runner and real files, read back with independent readers."""

import dataclasses
import json
import logging
import os
import re

import grain
import pytest
from array_record.python.array_record_module import ArrayRecordReader

import loader
from dataset_format.manifest import Manifest
from pipelines import ConvertConfig, run_conversion, tfrecord
from tests.conftest import run_cli, synthetic_records, write_tfrecord_shards

ONE_WORKER = ["--direct_num_workers=1"]


def _read_array_record(path) -> list[bytes]:
    reader = ArrayRecordReader(str(path))
    try:
        return reader.read_all()
    finally:
        reader.close()


def _read_tfrecord(path) -> list[bytes]:
    with open(path, "rb") as f:
        return list(tfrecord.iter_records(f, path=str(path)))


def _files(directory):
    """The names a reader sees, and any temporary file; `.shards/` (commit records) is checked on its own."""
    return sorted(p.name for p in directory.iterdir() if p.name != ".shards")


@pytest.fixture
def shards(tmp_path):
    """Five shards: ordinary, empty, zero-length records, one 5 MB record, and a bigger one."""
    contents = [
        synthetic_records(0, 300),
        [],
        [b"", b"between-empties", b""],
        [b"head", os.urandom(5 << 20), b"tail"],
        synthetic_records(4, 2000, size=1000),
    ]
    write_tfrecord_shards(tmp_path / "in", contents)
    return tmp_path / "in", contents


def test_matched_shards_same_records_same_order(shards, tmp_path):
    in_dir, contents = shards
    out = tmp_path / "out"
    outcome = run_conversion(ConvertConfig(input=str(in_dir / "*.tfrecord"), output=str(out)), ONE_WORKER)

    assert outcome.ok and outcome.converted == 5
    names = [f"train-{i:05d}-of-00005.array_record" for i in range(5)]
    assert _files(out) == sorted(names + ["manifest.json", "report.json"])  # no temporary files left
    assert sorted(os.listdir(out / ".shards")) == [n + ".json" for n in names]  # a commit record per shard
    for name, source, records in zip(names, sorted(in_dir.iterdir()), contents):
        assert _read_array_record(out / name) == records == _read_tfrecord(source)

    # grain reads the shards in manifest order: the concatenation of the inputs.
    manifest = Manifest.from_json((out / "manifest.json").read_text())
    source = grain.sources.ArrayRecordDataSource(manifest.shard_paths(str(out)))
    assert [source[i] for i in range(len(source))] == [r for c in contents for r in c]
    assert [s.records for s in manifest.shards] == [300, 0, 3, 3, 2000]
    assert all(s.writer_options == "group_size:1,snappy" for s in manifest.shards)  # the default
    assert manifest.shards[0].source == str(in_dir / "train-00000-of-00005.tfrecord")
    assert manifest.shards[3].bytes == os.path.getsize(out / names[3])


def test_writer_options_are_applied_and_recorded(shards, tmp_path):
    in_dir, _ = shards
    out = tmp_path / "out"
    run_conversion(ConvertConfig(input=str(in_dir / "*"), output=str(out), compression="snappy"), ONE_WORKER)
    reader = ArrayRecordReader(str(out / "train-00000-of-00005.array_record"))
    assert "snappy" in reader.writer_options_string()
    assert "group_size:1" in reader.writer_options_string()
    manifest = Manifest.from_json((out / "manifest.json").read_text())
    assert {s.writer_options for s in manifest.shards} == {"group_size:1,snappy"}


def test_incremental_reruns_convert_only_new_or_changed_shards(tmp_path, caplog):
    in_dir = tmp_path / "in"
    write_tfrecord_shards(in_dir, [synthetic_records(i, 50) for i in range(3)])
    config = ConvertConfig(input=str(in_dir / "*.tfrecord"), output=str(tmp_path / "out"))
    first = run_conversion(config, ONE_WORKER)
    assert (first.converted, len(first.plan.kept)) == (3, 0)

    again = run_conversion(config, ONE_WORKER)
    assert (again.converted, len(again.plan.kept)) == (0, 3)
    assert "converted 0 shard(s)" in again.summary() and "skipped 3 up-to-date shard(s)" in again.summary()

    # A rewritten source and a new shard are converted; the other two are kept.
    changed = in_dir / "train-00001-of-00003.tfrecord"
    with open(changed, "wb") as f:
        tfrecord.write_records(f, [b"new-content"])
    os.utime(changed, (1, 1))
    from pipelines.verify import verify

    assert verify(str(tmp_path / "out"), deep=True).problems == [  # the advice: a plain re-run, not --force
        f"{tmp_path / 'out' / 'train-00001-of-00003.array_record'}: holds 50 records but {changed} has only 1; its "
        "source changed after the conversion: re-run the conversion (it converts changed sources again)"]
    with open(in_dir / "train-00003-of-00003.tfrecord", "wb") as f:
        tfrecord.write_records(f, [b"added"])
    third = run_conversion(config, ONE_WORKER)
    assert sorted((t.source.path, t.reason) for t in third.plan.tasks) == [
        (str(changed), "its source changed"),
        (str(in_dir / "train-00003-of-00003.tfrecord"), "new: not in the manifest")]
    assert len(third.plan.kept) == 2
    assert _read_array_record(tmp_path / "out" / "train-00001-of-00003.array_record") == [b"new-content"]
    assert third.manifest.total_records == 50 + 1 + 50 + 1

    # A deleted output is recreated even though its source did not change.
    os.remove(tmp_path / "out" / "train-00000-of-00003.array_record")
    fourth = run_conversion(config, ONE_WORKER)
    assert [(t.relative_path, t.reason) for t in fourth.plan.tasks] == [
        ("train-00000-of-00003.array_record", "its output is missing")]

    # A vanished source: kept by default, removed with prune.
    os.remove(in_dir / "train-00002-of-00003.tfrecord")
    with caplog.at_level(logging.WARNING, logger="pipelines.plan"):
        fifth = run_conversion(config, ONE_WORKER)
    assert len(fifth.plan.orphaned) == 1 and (tmp_path / "out" / "train-00002-of-00003.array_record").exists()
    # (the plan is made twice: said once)
    assert caplog.text.count("have no source matched by this --input any more") == 1
    pruned = run_conversion(ConvertConfig(input=config.input, output=config.output, prune=True), ONE_WORKER)
    assert len(pruned.plan.pruned) == 1
    assert not (tmp_path / "out" / "train-00002-of-00003.array_record").exists()
    assert [s.path for s in pruned.manifest.shards] == [
        "train-00000-of-00003.array_record", "train-00001-of-00003.array_record", "train-00003-of-00003.array_record"]

    # New writer options make every shard stale.
    recompressed = run_conversion(ConvertConfig(input=config.input, output=config.output, compression="zstd:1"),
                                  ONE_WORKER)
    assert recompressed.converted == 3
    assert {t.reason for t in recompressed.plan.tasks} == {"writer options group_size:1,snappy -> group_size:1,zstd:1"}


def test_an_orphan_whose_output_is_gone_leaves_the_manifest(tmp_path, caplog):
    """A --prune run stopped after deleting outputs, before its manifest (as it once did): the rerun's manifest named
    files that were gone. Now the manifest comes first; an orphan whose file is missing is left out, with a line."""
    write_tfrecord_shards(tmp_path / "in", [synthetic_records(i, 5) for i in range(3)])
    config = ConvertConfig(input=str(tmp_path / "in" / "*"), output=str(tmp_path / "out"))
    run_conversion(config, ONE_WORKER)
    os.remove(tmp_path / "in" / "train-00002-of-00003.tfrecord")
    os.remove(tmp_path / "out" / "train-00002-of-00003.array_record")
    with caplog.at_level(logging.WARNING, logger="pipelines.plan"):
        again = run_conversion(config, ONE_WORKER)
    assert ("1 output shard(s) the manifest lists without a source are gone too (e.g. "
            "train-00002-of-00003.array_record): leaving them out of the manifest") in caplog.text
    assert [s.path for s in again.manifest.shards] == [f"train-0000{i}-of-00003.array_record" for i in range(2)]
    from pipelines.verify import verify

    assert verify(str(tmp_path / "out")).problems == []


def test_a_rerun_keeps_the_writer_options_of_most_shards(tmp_path):
    """An orphan kept from before a --compression change: the plain rerun converted every shard back to the default."""
    write_tfrecord_shards(tmp_path / "in", [synthetic_records(i, 5) for i in range(3)])
    config = ConvertConfig(input=str(tmp_path / "in" / "*"), output=str(tmp_path / "out"))
    run_conversion(config, ONE_WORKER)
    os.remove(tmp_path / "in" / "train-00002-of-00003.tfrecord")
    run_conversion(ConvertConfig(input=config.input, output=config.output, compression="zstd:3"), ONE_WORKER)
    plain = run_cli("convert", "--input", config.input, "--output", config.output, check=True)  # (the CLI keeps them)
    assert "converted 0 shard(s)" in plain.stdout
    assert ("shards were written with 2 sets of writer options: keeping those of most of them, group_size:1,zstd:3 "
            "(2 of 3 shards)") in plain.stderr


def test_a_tfds_twin_keeps_no_shard_of_an_earlier_build(tmp_path):
    """A TFDS directory built again (another shard count): kept, its old shards would be read twice over and counted
    into the twin's shardLengths, which TFDS then cannot open. Refused unless --prune."""
    from dataset_format.manifest import ShardEntry
    from pipelines.plan import _check_orphans

    old = ShardEntry(path="digits-train.array_record-00000-of-00003", source="/d/digits-train.tfrecord-00000-of-00003",
                     records=600, bytes=1, source_bytes=1, source_fingerprint="x", writer_options="w", split="train")
    config = ConvertConfig(input="/d", output="/out")
    with pytest.raises(ValueError, match=r"^1 output shard\(s\) of /out have no source in the TFDS directory /d any "
                                         r"more, e\.g\. digits-train\.array_record-00000-of-00003 \(from "
                                         r"/d/digits-train\.tfrecord-00000-of-00003\): it was built again .* pass "
                                         r"--prune to delete them$"):
        _check_orphans([old], "tfds", None, config, [])
    _check_orphans([old], "tfrecord", None, config, [])  # a glob's orphans are kept, with a warning


def test_an_input_written_again_in_another_number_of_shards_is_not_kept_twice(tmp_path):
    """4 shards re-exported as 2 of the same records: the old 4 were kept beside the new 2 (every record twice), with
    one warning and exit 0."""
    records = [synthetic_records(i, 10) for i in range(4)]
    write_tfrecord_shards(tmp_path / "in", records)
    config = ConvertConfig(input=str(tmp_path / "in" / "*"), output=str(tmp_path / "out"))
    assert run_conversion(config, ["--direct_num_workers=1"]).ok
    for path in (tmp_path / "in").iterdir():
        path.unlink()
    write_tfrecord_shards(tmp_path / "in", [records[0] + records[1], records[2] + records[3]])
    with pytest.raises(ValueError, match=r"^the input was written again in another number of shards: "
                                         r"train-00000-of-00004\.tfrecord is gone and shards of the same name "
                                         r"-of-00002 are new; kept, the old shards \(e\.g\. "
                                         r"train-00000-of-00004\.array_record\) would hold its records a second time: "
                                         r"pass --prune to replace them"):
        run_conversion(config, ["--direct_num_workers=1"])
    pruned = run_conversion(dataclasses.replace(config, prune=True), ["--direct_num_workers=1"])
    assert pruned.ok and loader.resolve(str(tmp_path / "out")).lengths == (20, 20)


def test_inputs_moved_elsewhere_replace_their_shards_once(tmp_path):
    """The same shard names from another directory (the sources moved, or the output was copied): each output shard
    is converted again and listed once, never also kept as an orphan of its old source."""
    write_tfrecord_shards(tmp_path / "a", [synthetic_records(i, 5) for i in range(2)])
    run_conversion(ConvertConfig(input=str(tmp_path / "a" / "*"), output=str(tmp_path / "out")), ONE_WORKER)
    os.rename(tmp_path / "a", tmp_path / "b")
    moved = run_conversion(ConvertConfig(input=str(tmp_path / "b" / "*"), output=str(tmp_path / "out")), ONE_WORKER)
    assert moved.converted == 2 and not moved.plan.orphaned
    assert [(s.path, s.source) for s in moved.manifest.shards] == [
        (f"train-0000{i}-of-00002.array_record", str(tmp_path / "b" / f"train-0000{i}-of-00002.tfrecord"))
        for i in range(2)]
    assert moved.manifest.total_records == 10


def test_a_local_input_is_recorded_whole_so_any_spelling_of_it_finds_its_shards(tmp_path, monkeypatch):
    """Converted as `raw/*` from one directory, then planned as `/abs/raw/*` (a cron job running from /) and verified
    from another directory, or through a symbolic link to its directory: nothing to convert, no source missing. A
    manifest that holds a relative source (as written by hand or by an older converter) still matches from the
    directory it was written in."""
    from pipelines.plan import make_plan
    from pipelines.verify import verify

    write_tfrecord_shards(tmp_path / "raw", [synthetic_records(i, 5) for i in range(2)])
    monkeypatch.chdir(tmp_path)
    first = run_conversion(ConvertConfig(input="raw/*", output="out"), ONE_WORKER)
    assert [s.source for s in first.manifest.shards] == [
        str(tmp_path / "raw" / f"train-0000{i}-of-00002.tfrecord") for i in range(2)]
    monkeypatch.chdir("/")
    again = make_plan(ConvertConfig(input=str(tmp_path / "raw" / "*"), output=str(tmp_path / "out")))
    assert (len(again.tasks), len(again.kept), again.orphaned) == (0, 2, ())
    assert verify(str(tmp_path / "out"), deep=True).problems == []
    os.symlink(tmp_path / "raw", tmp_path / "link")  # the same files through a link: converted again, every shard
    for spelling in ("link/*", "link", "link/train-*"):
        through = make_plan(ConvertConfig(input=str(tmp_path / spelling), output=str(tmp_path / "out")))
        assert (len(through.tasks), len(through.kept), through.orphaned) == (0, 2, ()), spelling

    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    for shard in manifest["shards"]:
        shard["source"] = os.path.relpath(shard["source"], tmp_path)  # "raw/train-...": as typed in tmp_path
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.chdir(tmp_path)
    relative = make_plan(ConvertConfig(input="raw/*", output="out"))
    assert (len(relative.tasks), len(relative.kept), relative.orphaned) == (0, 2, ())


def test_corrupt_shard_fails_alone_and_leaves_no_output(tmp_path):
    in_dir = tmp_path / "in"
    paths = write_tfrecord_shards(in_dir, [synthetic_records(i, 20) for i in range(3)])
    data = bytearray(paths[1].read_bytes())
    frame = 12 + 100 + 4
    data[5 * frame + 12 + 7] ^= 0x55  # payload of record 5 of shard 1
    paths[1].write_bytes(bytes(data))
    out = tmp_path / "out"

    outcome = run_conversion(ConvertConfig(input=str(in_dir / "*"), output=str(out)), ONE_WORKER)

    assert not outcome.ok
    assert _files(out) == ["manifest.json", "report.json", "train-00000-of-00003.array_record",
                           "train-00002-of-00003.array_record"]
    (failure,) = outcome.manifest.failed
    assert failure["source"] == str(paths[1])
    assert f"{paths[1]}: corrupt TFRecord at byte offset {5 * frame}, record 5: data CRC mismatch" in failure["error"]
    assert "FAILED:" in outcome.summary() and f"byte offset {5 * frame}" in outcome.summary()
    report = json.loads((out / "report.json").read_text())
    assert report["failed_shards"] == [failure]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is False and manifest["totals"]["records"] == 40

    # After the source is repaired, a re-run converts just that shard.
    with open(paths[1], "wb") as f:
        tfrecord.write_records(f, synthetic_records(1, 20))
    repaired = run_conversion(ConvertConfig(input=str(in_dir / "*"), output=str(out)), ONE_WORKER)
    assert repaired.ok and repaired.converted == 1 and repaired.manifest.total_records == 60


def test_a_source_deleted_during_the_run_fails_its_shard_alone(tmp_path, monkeypatch):
    from pipelines import convert

    paths = write_tfrecord_shards(tmp_path / "in", [synthetic_records(i, 20) for i in range(3)])
    real = convert.convert_shard

    def deleted_first(task, **kwargs):  # the source of shard 1 is removed as its turn comes
        if task.source.path == str(paths[1]):
            os.remove(paths[1])
        return real(task, **kwargs)

    monkeypatch.setattr(convert, "convert_shard", deleted_first)
    outcome = run_conversion(ConvertConfig(input=str(tmp_path / "in" / "*"), output=str(tmp_path / "out")), ONE_WORKER)
    assert not outcome.ok and outcome.manifest.total_records == 40
    assert outcome.manifest.failed == ({"source": str(paths[1]), "error": (
        f"{paths[1]} is gone: it was deleted or moved while the run converted it; rerun (the converted shards are "
        "kept; --prune deletes the outputs of sources that are gone)")},)


def test_skip_corrupt_reports_each_record_and_reconciles_counts(tmp_path):
    in_dir = tmp_path / "in"
    records = synthetic_records(0, 30)
    (path,) = write_tfrecord_shards(in_dir, [records])
    data = bytearray(path.read_bytes())
    frame = 12 + 100 + 4
    for i in (3, 17):
        data[i * frame + 12 + 1] ^= 0x01
    path.write_bytes(bytes(data))
    out = tmp_path / "out"

    outcome = run_conversion(ConvertConfig(input=str(path), output=str(out), skip_corrupt=True), ONE_WORKER)

    assert outcome.ok and outcome.corrupt_records == 2
    expected = [r for i, r in enumerate(records) if i not in (3, 17)]
    assert _read_array_record(out / "train-00000-of-00001.array_record") == expected
    report = json.loads((out / "report.json").read_text())
    assert report["corrupt_records"] == [
        {"source": str(path), "offset": i * frame, "length": frame, "reason": "data CRC mismatch in a 100-byte record",
         "records_before": before} for i, before in ((3, 3), (17, 16))]  # (its place among the records read)
    (shard,) = report["shards"]
    assert shard["records_written"] + shard["corrupt_frames_skipped"] == len(records)
    assert outcome.manifest.shards[0].skipped_corrupt == 2
    assert json.loads((out / "manifest.json").read_text())["skip_corrupt"] is True


def test_skip_corrupt_is_kept_by_a_rerun_that_does_not_name_it(tmp_path):
    """A rerun (or a scheduled refresh) naming only --input and --output failed a changed source's shard where the
    first run had skipped its corrupt frames."""
    from pipelines.cli import main

    in_dir, out = tmp_path / "in", tmp_path / "out"
    paths = write_tfrecord_shards(in_dir, [synthetic_records(0, 30), synthetic_records(30, 30)])

    def damage(path, at):
        data = bytearray(path.read_bytes())
        data[at * (12 + 100 + 4) + 12 + 1] ^= 0x01
        path.write_bytes(bytes(data))

    damage(paths[0], 3)
    flags = ["convert", "--input", str(in_dir / "*"), "--output", str(out), "--direct_num_workers=1"]
    assert main([*flags, "--skip-corrupt"]) == 0
    damage(paths[1], 5)  # a source changes, with a corrupt frame of its own
    assert main(flags) == 0  # kept: skipped again
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and manifest["skip_corrupt"] is True
    assert [s["skipped_corrupt"] for s in manifest["shards"]] == [1, 1]
    damage(paths[1], 7)
    assert main([*flags, "--skip-corrupt=false"]) == 1  # said otherwise: the changed shard fails
    manifest = json.loads((out / "manifest.json").read_text())
    assert not manifest["complete"] and "skip_corrupt" not in manifest


def test_a_conversion_whose_every_shard_is_empty_ends_with_one_clear_error(tmp_path):
    """It would convert and then fail at load time (no records to batch): the conversion says so as it ends."""
    import subprocess
    import sys

    from tests.conftest import REPO

    write_tfrecord_shards(tmp_path / "in", [[], []])
    with pytest.raises(ValueError, match=r"every shard of '.*in/\*' holds no records \(2 shard\(s\), 0 records\): "
                                         "there is nothing to load"):
        run_conversion(ConvertConfig(input=str(tmp_path / "in" / "*"), output=str(tmp_path / "out")), ONE_WORKER)
    proc = subprocess.run([sys.executable, "-m", "pipelines", "convert", "--input", str(tmp_path / "in" / "*"),
                           "--output", str(tmp_path / "out2")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: every shard of "), \
        proc.stderr[-2000:]


def test_a_damaged_output_shard_is_a_problem_line_of_verify_deep_and_deleting_it_repairs_it(tmp_path):
    """A flipped byte in a chunk of an output: verify --deep names the shard and the first record that does not read
    (it ended in riegeli's traceback, which names a byte offset), and
    deleting it and re-running the conversion writes it again (a re-run alone keeps it: size and source unchanged)."""
    from pipelines.verify import verify

    write_tfrecord_shards(tmp_path / "in", [synthetic_records(i, 200) for i in range(2)])
    config = ConvertConfig(input=str(tmp_path / "in" / "*.tfrecord"), output=str(tmp_path / "out"))
    run_conversion(config, ONE_WORKER)
    shard = tmp_path / "out" / "train-00001-of-00002.array_record"
    whole = shard.read_bytes()
    data = bytearray(whole)
    data[5000] ^= 0xFF  # in a chunk of records past the first (the file is padded to 64 KiB blocks: its middle is
    shard.write_bytes(bytes(data))  # padding)
    assert verify(str(tmp_path / "out")).problems == []  # plain verify checks sizes and counts, as documented
    problems = verify(str(tmp_path / "out"), deep=True).problems
    named = re.fullmatch(rf"{re.escape(str(shard))}: record (\d+) cannot be read \(.*\); the shard is corrupt: delete "
                         rf"{re.escape(str(shard))} and re-run the conversion, which converts it again", problems[0]) \
        if problems else None
    assert len(problems) == 1 and named, problems
    record = int(named[1])  # the first that does not read
    reader = ArrayRecordReader(str(shard))
    assert record > 0 and len(reader.read(0, record)) == record
    with pytest.raises(RuntimeError):
        reader.read([record])
    reader.close()
    assert run_conversion(config, ONE_WORKER).converted == 0  # what the line says is needed: a re-run keeps it
    footer = []  # a damaged index (after the records' chunks) fails plain verify too: a line, not a traceback
    for offset in range(0, len(whole.rstrip(b"\0")), 256):
        data = bytearray(whole)
        data[offset] ^= 0xFF
        shard.write_bytes(bytes(data))
        if footer := verify(str(tmp_path / "out")).problems:
            break
    assert len(footer) == 1 and footer[0].startswith(f"{shard}: cannot be read (") and "the shard is corrupt" in footer[0]
    shard.unlink()
    assert run_conversion(config, ONE_WORKER).converted == 1
    assert verify(str(tmp_path / "out"), deep=True).problems == []
