"""A conversion killed (SIGKILL to its whole process group) anywhere, then run again: finished shards are kept.

The kill comes from a `sitecustomize` on PYTHONPATH, so it fires in the launcher and in every DirectRunner worker
process, at one of three points: inside the first shard (its temporary file written, not yet renamed), after the
Nth commit record, or as the manifest is about to be written (every shard committed).
"""

import json
import os
import signal
import subprocess
import sys

import pytest

from pipelines import commits
from tests.conftest import REPO, run_cli, synthetic_records, write_tfrecord_shards
from tests.pipelines.conftest import SHARDS, killed_run

def _committed(out) -> dict[str, int]:
    """Shards with a commit record -> their file's mtime (ns)."""
    records = out / ".shards"
    names = [p.name[:-len(".json")] for p in records.iterdir() if commits.is_record(p.name)] if records.exists() else []
    return {n: (out / n).stat().st_mtime_ns for n in names}


@pytest.mark.parametrize("point, committed_before", [pytest.param("first-shard", 0, marks=pytest.mark.slow),
                                                     ("commit:3", 3),
                                                     pytest.param("manifest", SHARDS, marks=pytest.mark.slow)])
def test_a_killed_conversion_resumes_without_redoing_committed_shards(job, point, committed_before):
    out = job / "out"
    assert killed_run(job, point) == -signal.SIGKILL
    assert not (out / "manifest.json").exists()
    before = _committed(out)
    assert len(before) >= committed_before
    if point == "first-shard":
        assert [p.name for p in out.iterdir() if p.name.startswith(".tmp-")]  # the dead run's temporary file

    rerun = run_cli("convert", "--input", str(job / "in" / "*.tfrecord"), "--output", str(out), check=True)

    after = _committed(out)
    assert {n: after[n] for n in before} == before  # committed shards were not rewritten
    assert len(after) == SHARDS
    assert f"converted {SHARDS - len(before)} shard(s)" in rerun.stdout
    if before:
        assert f"{len(before)} recovered from an interrupted run" in rerun.stderr
        assert f"skipped 0 up-to-date shard(s) and {len(before)} converted earlier (their commit records)" \
            in rerun.stdout  # the summary counts them (it said "converted N, skipped 0" of a dataset of 8)
    assert [p.name for p in [*out.iterdir(), *(out / ".shards").iterdir()] if p.name.startswith(".tmp-")] == []
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and manifest["totals"] == {"shards": SHARDS, "records": SHARDS * 3000,
                                                          "bytes": manifest["totals"]["bytes"]}
    verify = run_cli("verify", "--output", str(out), "--deep", check=True)
    assert f"{SHARDS} shards, {SHARDS * 3000:,} records, 0 problem(s)" in verify.stdout
    again = run_cli("convert", "--input", str(job / "in" / "*.tfrecord"), "--output", str(out), check=True)
    assert "converted 0 shard(s)" in again.stdout and _committed(out) == after


def test_a_record_of_another_source_version_is_not_trusted(job):
    """A shard whose source changed after its record was written is converted again."""
    out = job / "out"
    assert killed_run(job, "manifest") == -signal.SIGKILL
    source = job / "in" / "train-00002-of-00008.tfrecord"
    write_tfrecord_shards(job / "in2", [synthetic_records(99, 10)])
    os.replace(job / "in2" / "train-00000-of-00001.tfrecord", source)

    rerun = run_cli("convert", "--input", str(job / "in" / "*.tfrecord"), "--output", str(out), check=True)

    assert "converted 1 shard(s) (10 records" in rerun.stdout
    assert "7 recovered from an interrupted run" in rerun.stderr
    assert json.loads((out / "manifest.json").read_text())["totals"]["records"] == 7 * 3000 + 10


@pytest.mark.slow  # ~40 s; the one-shard case below runs by default
def test_a_shard_rewritten_by_a_killed_run_of_other_options_is_converted_again(job):
    """A run with other writer options killed after replacing a shard's file, before its record: the file often keeps
    its size (ArrayRecord pads), so the size alone did not tell; the plain rerun (the manifest's options) kept a file
    the manifest does not describe. The record is removed before a file is replaced: its absence tells."""
    out = job / "out"
    run_cli("convert", "--input", str(job / "in" / "*.tfrecord"), "--output", str(out), check=True)
    assert killed_run(job, "replaced:2", "--compression", "zstd:3") == -signal.SIGKILL
    plan = run_cli("plan", "--input", str(job / "in" / "*.tfrecord"), "--output", str(out), check=True)
    assert "its commit record is missing: a run that stopped may have been writing it again" in plan.stdout + \
        plan.stderr
    rerun = run_cli("convert", "--input", str(job / "in" / "*.tfrecord"), "--output", str(out), check=True)
    manifest = json.loads((out / "manifest.json").read_text())
    records = commits.read(str(out), [e["path"] for e in manifest["shards"]])
    assert len(records) == SHARDS
    for entry in manifest["shards"]:  # every shard is the file its entry and its record describe
        assert entry["writer_options"] == records[entry["path"]][0].writer_options == "group_size:1,snappy"
        assert entry["bytes"] == (out / entry["path"]).stat().st_size == records[entry["path"]][0].bytes
    assert "converted 0 shard(s)" not in rerun.stdout


def test_a_one_shard_output_rewritten_by_a_killed_run_is_converted_again(tmp_path):
    """The same with every shard in flight at once (a one-shard split): the killed run had removed every commit
    record, and an output without any was taken for one converted before records existed: the rerun kept the file
    the killed run wrote (zstd), its size the same, under the manifest's entry (snappy), and verify passed. The
    output's runs mark that they keep records (.shards/records-kept), so none there is every record removed."""
    from pipelines.verify import verify
    from tests.pipelines.conftest import SITECUSTOMIZE

    write_tfrecord_shards(tmp_path / "in", [synthetic_records(0, 3000, size=200)])
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    out = tmp_path / "out"
    run_cli("convert", "--input", str(tmp_path / "in" / "*.tfrecord"), "--output", str(out), check=True)
    snappy = (out / "train-00000-of-00001.array_record").stat().st_size
    assert killed_run(tmp_path, "replaced:1", "--compression", "zstd:3") == -signal.SIGKILL
    assert not commits.listing(str(out)) and (out / "train-00000-of-00001.array_record").stat().st_size == snappy
    rerun = run_cli("convert", "--input", str(tmp_path / "in" / "*.tfrecord"), "--output", str(out), check=True)
    assert "converted 1 shard(s)" in rerun.stdout, rerun.stdout + rerun.stderr
    assert verify(str(out), deep=True).problems == []
    record, _ = commits.read(str(out), ["train-00000-of-00001.array_record"])["train-00000-of-00001.array_record"]
    assert record.writer_options == "group_size:1,snappy"


@pytest.mark.gcs
@pytest.mark.parametrize("point", [pytest.param("commit:3", marks=pytest.mark.slow), "manifest"])
def test_a_killed_conversion_to_gcs_resumes_without_redoing_committed_shards(job, gcs_bucket, gcs_emulator, point):
    bucket, client = gcs_bucket
    output = f"gs://{bucket}/out"
    env = {**os.environ, **gcs_emulator, "PYTHONPATH": os.pathsep.join([str(job / "site"), str(REPO)]),
           "ARCONV_KILL_AT": point, "ARCONV_KILL_COUNTER": str(job / "counter"), "TMPDIR": str(job)}
    killed = subprocess.run([sys.executable, "-m", "pipelines", "convert", "--input", str(job / "in" / "*.tfrecord"),
                             "--output", output], cwd=REPO, env=env, capture_output=True, timeout=300,
                            start_new_session=True)
    assert killed.returncode == -signal.SIGKILL

    def committed() -> dict[str, int]:
        """Shards with a commit record -> their object's generation."""
        blobs = {b.name: b.generation for b in client.list_blobs(bucket, prefix="out/")}
        return {n[len("out/.shards/"):-len(".json")]: blobs[f"out/{n[len('out/.shards/'):-len('.json')]}"]
                for n in blobs if n.startswith("out/.shards/")}

    before = committed()
    assert len(before) >= 3 and "out/manifest.json" not in {b.name for b in client.list_blobs(bucket)}

    rerun = run_cli("convert", "--input", str(job / "in" / "*.tfrecord"), "--output", output,
                    env=gcs_emulator, check=True)

    after = committed()
    assert {n: after[n] for n in before} == before and len(after) == SHARDS  # not rewritten: same generations
    assert f"converted {SHARDS - len(before)} shard(s)" in rerun.stdout
    names = {b.name for b in client.list_blobs(bucket)}
    assert not [n for n in names if "/.tmp-" in n] and "out/manifest.json" in names
    verify = run_cli("verify", "--output", output, "--deep", env=gcs_emulator, check=True)
    assert f"{SHARDS} shards, {SHARDS * 3000:,} records, 0 problem(s)" in verify.stdout


def test_a_rerun_removes_temporary_files_beside_shards_and_commit_records(tmp_path):
    """A run killed while writing a shard or a commit record leaves a `.tmp-*` file; the next run removes both kinds
    and keeps committed names."""
    from pipelines.run import _remove_dead_temp_files

    (tmp_path / ".shards").mkdir()
    left = [tmp_path / ".tmp-0123456789ab-train-00000-of-00002.array_record",
            tmp_path / ".shards" / ".tmp-ba9876543210-train-00001-of-00002.array_record.json"]
    kept = [tmp_path / "train-00000-of-00002.array_record", tmp_path / ".shards" / "train-00000-of-00002.array_record.json"]
    for path in left + kept:
        path.write_text("x")
    _remove_dead_temp_files(str(tmp_path))
    assert [p.exists() for p in left + kept] == [False, False, True, True]


@pytest.mark.gcs
def test_a_rerun_removes_the_local_shards_a_killed_run_to_gcs_left(job, gcs_bucket, gcs_emulator):
    """A conversion to gs:// writes each shard whole in the temporary directory, then uploads it: a run killed with
    shards in flight left them there (as large as the shards), and no rerun removed them."""
    bucket, _ = gcs_bucket
    output, scratch = f"gs://{bucket}/out", job / "scratch"
    scratch.mkdir()
    env = {**os.environ, **gcs_emulator, "PYTHONPATH": os.pathsep.join([str(job / "site"), str(REPO)]),
           "ARCONV_KILL_AT": "first-shard", "ARCONV_KILL_COUNTER": str(job / "counter"), "TMPDIR": str(scratch)}
    killed = subprocess.run([sys.executable, "-m", "pipelines", "convert", "--input", str(job / "in" / "*.tfrecord"),
                             "--output", output], cwd=REPO, env=env, capture_output=True, timeout=300,
                            start_new_session=True)
    assert killed.returncode == -signal.SIGKILL
    assert [p.name for p in scratch.iterdir() if p.name.startswith("arconv-")]  # the dead run's shard(s)
    (scratch / "arconv-1-not-ours.array_record").write_bytes(b"x")  # pid 1 lives: kept
    run_cli("convert", "--input", str(job / "in" / "*.tfrecord"), "--output", output,
            env={**gcs_emulator, "TMPDIR": str(scratch)}, check=True)
    left = sorted(p.name for p in scratch.iterdir() if p.name.startswith("arconv-"))
    assert left == ["arconv-1-not-ours.array_record"]


GONE = "train-00002-of-00008"


def _names(out):
    return sorted(p.name for p in out.iterdir()), sorted(p.name for p in (out / ".shards").iterdir())


def test_prune_deletes_committed_shards_of_a_removed_source_after_a_first_run_died(job):
    """A first run killed before its manifest, then a source removed: --prune only looked at the manifest's entries,
    and the shard (and its record) stayed for good, read by a glob of the output."""
    out = job / "out"
    assert killed_run(job, "manifest") == -signal.SIGKILL  # all 8 shards committed, no manifest yet
    os.remove(job / "in" / f"{GONE}.tfrecord")  # the source is removed before the rerun

    run_cli("convert", "--input", str(job / "in" / "*.tfrecord"), "--output", str(out), "--prune", check=True)

    files, records = _names(out)
    assert f"{GONE}.array_record" not in files, "the shard of a removed source is left in the output"
    assert f"{GONE}.array_record.json" not in records, "its commit record is left too"
    assert len(json.loads((out / "manifest.json").read_text())["shards"]) == SHARDS - 1


PRUNE_KILL = '''
import os, signal
from dataset_format import storage
_dq = storage.delete_quietly
def delete_quietly(path):
    if os.environ.get("KILL_ON_PRUNE") and path.endswith(".array_record"):
        os.killpg(os.getpgrp(), signal.SIGKILL)
    _dq(path)
storage.delete_quietly = delete_quietly
'''


def test_a_prune_run_killed_after_its_manifest_leaves_the_shard_for_the_next_prune(job):
    """A --prune run writes its manifest, then deletes the pruned shards: killed between, the next --prune found
    them in no manifest and left them for good."""
    out = job / "out"
    inp = str(job / "in" / "*.tfrecord")
    run_cli("convert", "--input", inp, "--output", str(out), check=True)
    os.remove(job / "in" / f"{GONE}.tfrecord")
    (job / "site2").mkdir()
    (job / "site2" / "sitecustomize.py").write_text(PRUNE_KILL)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(job / "site2"), str(REPO)]), "KILL_ON_PRUNE": "1"}
    killed = subprocess.run([sys.executable, "-m", "pipelines", "convert", "--input", inp, "--output", str(out),
                             "--prune"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                            start_new_session=True)
    assert killed.returncode == -signal.SIGKILL

    again = run_cli("convert", "--input", inp, "--output", str(out), "--prune", check=True)

    files, records = _names(out)
    assert f"{GONE}.array_record" not in files, "the pruned shard stays in the output for good: " + again.stdout
    assert f"{GONE}.array_record.json" not in records
