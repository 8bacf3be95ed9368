"""Progress: a line from the commit records while a local run goes on, and `status` for a run anywhere."""

import signal

import pytest

from pipelines.progress import format_line
from tests.conftest import run_cli, synthetic_records, write_tfrecord_shards
from tests.pipelines.conftest import killed_run


def test_the_progress_line_says_shards_records_rate_and_eta():
    assert format_line(412, 1000, 8_240_000, 1_650_300_000, 4_005_000_000, 40.0) == (
        "converting: 412/1000 shards, 8,240,000 records, 1,650.3 MB of input files (41.3 MB/s), ETA 0:00:57")
    assert format_line(3, 3, 30, 3_000_000, 3_000_000, 2.0) == \
        "converting: 3/3 shards, 30 records, 3.0 MB of input files (1.5 MB/s)"


def test_the_same_count_is_logged_once(tmp_path, caplog):
    """The last poll and the final count logged the same count twice at the end of a run (the rate, which moves with
    the clock, made the lines differ)."""
    import time
    from types import SimpleNamespace

    from dataset_format.manifest import ShardEntry
    from pipelines import commits
    from pipelines.progress import Progress

    tasks = [SimpleNamespace(relative_path=f"s{i}.array_record", source=SimpleNamespace(size=2_000_000))
             for i in range(2)]
    progress = Progress(str(tmp_path), tasks)
    commits.write(str(tmp_path), ShardEntry("s0.array_record", "/in/s0", 10, 100, 2_000_000, "f", "w"), ())
    with caplog.at_level("INFO", logger="pipelines.progress"):
        for _ in range(2):
            assert progress._show(log_it=True)  # noqa: SLF001 - the logging step
            time.sleep(0.05)
        commits.write(str(tmp_path), ShardEntry("s1.array_record", "/in/s1", 10, 100, 2_000_000, "f", "w"), ())
        assert progress._show(log_it=True)  # noqa: SLF001
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(" (")[0] for line in lines] == [
        "converting: 1/2 shards, 10 records, 2.0 MB of input files", "converting: 2/2 shards, 20 records, 4.0 MB of "
        "input files"], lines


def test_many_shards_log_a_progress_line_not_a_line_each(tmp_path):
    write_tfrecord_shards(tmp_path / "in", [synthetic_records(i, 20) for i in range(40)])
    proc = run_cli("convert", "--input", str(tmp_path / "in" / "*"), "--output", str(tmp_path / "out"), check=True)
    assert "converted /" not in proc.stderr  # per-shard lines are DEBUG past 36 shards
    lines = [line for line in proc.stderr.splitlines() if "converting: " in line]
    assert lines and "converting: 40/40 shards, 800 records, " in lines[-1], proc.stderr[-2000:]
    few = run_cli("convert", "--input", str(tmp_path / "in" / "train-0000[0-2]*"), "--output",
                  str(tmp_path / "few"), check=True)
    assert few.stderr.count(": converted /") == 3  # a line per shard (from the worker processes)


def test_status_of_a_killed_run_and_of_a_finished_one(job):
    assert killed_run(job, "commit:3") == -signal.SIGKILL
    out = str(job / "out")
    killed = run_cli("status", "--output", out, check=True).stdout
    assert "is dead (its process is gone); the next run takes over" in killed
    assert "manifest: none yet (no run has finished)" in killed
    committed = int(killed.split("committed since the manifest: ")[1].split(" shard(s)")[0])
    assert committed >= 3 and f"{committed * 3000:,} records" in killed

    run_cli("convert", "--input", str(job / "in" / "*.tfrecord"), "--output", out, check=True)
    done = run_cli("status", "--output", out, check=True).stdout
    assert "running: no local run holds the lease" in done
    assert "manifest: 8 shards, 24,000 records, written " in done
    assert "committed since the manifest: 0 shard(s)" in done


def test_status_names_the_failed_shards_and_their_errors(tmp_path):
    paths = write_tfrecord_shards(tmp_path / "in", [synthetic_records(i, 5) for i in range(2)])
    paths[1].write_bytes(paths[1].read_bytes()[:-1])
    out = str(tmp_path / "out")
    assert run_cli("convert", "--input", str(tmp_path / "in" / "*"), "--output", out,
                   "--direct_num_workers=1").returncode == 1
    lines = run_cli("status", "--output", out, check=True).stdout.splitlines()
    assert lines[1].startswith("manifest: 1 shards, 5 records, written ") and lines[1].endswith(", 1 failed"), lines
    assert lines[2].startswith(f"failed: {paths[1]}: corrupt TFRecord at byte offset 464, record 4: truncated record: "
                               "frame needs 116 bytes, file ends after 115. Re-create or re-copy this shard, or pass "
                               "--skip-corrupt"), lines


def test_a_temporary_file_left_by_a_killed_writer_is_no_commit(tmp_path):
    """A writer killed between writing a record's temporary file and renaming it leaves '.tmp-<id>-<name>.json';
    status and reruns must not count it as a committed shard (it made `status` say 4 shards but 3 shards' records)."""
    from dataset_format import storage
    from pipelines import commits
    from pipelines.progress import committed_since

    out = str(tmp_path)
    done = commits.record_path(out, "train-00000-of-00002.array_record")
    storage.write_text(done, "{}")
    left = storage.temp_name(commits.record_path(out, "train-00001-of-00002.array_record"))
    with open(left, "w") as f:
        f.write('{"entry": ')
    assert set(committed_since(out, 0.0)) == set(commits.listing(out)) == {"train-00000-of-00002.array_record"}


def _stopped(job, point: str, workers: int = 1):
    """`convert` of the job's 8 shards, sent a signal by the test hook at `point` (interrupt:N, terminate:N):
    (the finished process, its argv)."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    argv = ["convert", "--input", str(job / "in" / "*.tfrecord"), "--output", str(job / "out"),
            f"--direct_num_workers={workers}", *(["--direct_running_mode=multi_processing"] if workers > 1 else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(job / "site"), str(REPO)]),
           "ARCONV_KILL_AT": point, "ARCONV_KILL_COUNTER": str(job / "counter")}
    proc = subprocess.run([sys.executable, "-m", "pipelines", *argv], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120, start_new_session=True)
    return proc, argv


@pytest.mark.parametrize("workers", [1, 2])
def test_ctrl_c_ends_with_what_was_kept_and_a_rerun_finishes(job, workers):
    """Ctrl-C ended in KeyboardInterrupt (in-process: a RuntimeError Beam re-raised from the DoFn) and, on a terminal,
    pages of worker tracebacks: the last line now says the committed shards are kept and to run the command again,
    which converts only the rest. With worker processes, each printed its own KeyboardInterrupt and grpc tracebacks,
    and the runner's threads their workers' ends."""
    from pipelines import commits

    proc, argv = _stopped(job, "interrupt:3", workers)
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == ("interrupted: the shards committed so far are kept; run the same "
                                                    "command again to finish (it converts only what is left)")
    assert "Traceback" not in proc.stderr and " ERROR " not in proc.stderr, proc.stderr  # (Beam's record of the DoFn)
    kept = len(commits.listing(str(job / "out")))
    assert kept == 3 if workers == 1 else kept >= 3  # (the other worker may commit one as the first signals)
    if workers == 1:  # (the rerun is the same with workers)
        again = run_cli(*argv, check=True)
        assert "converted 5 shard(s)" in again.stdout and "3 converted earlier" in again.stdout, again.stdout


@pytest.mark.parametrize("workers", [1, 2])
def test_a_sigterm_gives_the_lease_back_and_says_what_was_kept(job, workers):
    """A SIGTERM (a stopped pod or VM) ended the conversion at once: no line, Beam's workers left, and the output's
    lease held off the restart ("being converted by another run") until it lapsed, 2 minutes later. It now ends as
    Ctrl-C does, exit 143: the lease is given back and the same command, run at once, converts the rest. With worker
    processes, Beam's cleanup could wait on them (once over ten minutes): they are killed first."""
    from dataset_format.lease import LEASE_NAME
    from pipelines import commits

    proc, argv = _stopped(job, "terminate:2", workers)
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == ("stopped by SIGTERM: the shards committed so far are kept; run "
                                                    "the same command again to finish (it converts only what is left)")
    assert not (job / "out" / LEASE_NAME).exists()
    kept = len(commits.listing(str(job / "out")))
    assert kept >= 2
    if workers == 1:  # (the rerun is the same with workers)
        again = run_cli(*argv, check=True)
        assert f"converted {8 - kept} shard(s)" in again.stdout and f"{kept} converted earlier" in again.stdout
