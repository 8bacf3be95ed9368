import re
import subprocess
import sys

import pytest

from tests.conftest import REPO


def _run(*args):
    return subprocess.run([sys.executable, "-m", "loader", *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_inspect_and_bench(converted):
    proc = _run("inspect", str(converted), "--decode", "none")
    assert proc.returncode == 0, proc.stderr
    assert "records: 257 in 5 shard(s)" in proc.stdout
    assert "record 0: 3 bytes" in proc.stdout  # b"0:0"
    bench = _run("bench", str(converted), "--batch_size", "16", "--start", "3", "--batches", "5", "--decode", "none")
    assert bench.returncode == 0, bench.stderr
    # 5 small batches take well under a second: no rate is claimed for them (it read millions a second)
    assert re.search(r"; no steady rate \(they took 0\.\d\d s, under 1 s; take --batches 100 or more\) over 5 "
                     r"batches of 16 after a start window of 3 \(", bench.stdout), bench.stdout
    assert "worker" not in bench.stdout.split("(decode=")[0]
    lines = bench.stdout.splitlines()
    assert lines[1].startswith("  CPU per 1,000 records (ms): plan ") and "read " in lines[1], bench.stdout
    assert lines[2].startswith("  the caller: ") and lines[3].startswith("  bound by "), bench.stdout


def test_bench_knows_token_records_from_the_manifest(pretokenized, converted):
    """Its advice for token ids names no features= (they are one feature, in the narrowest integer type); for reads,
    a codec cheaper than the shards' own (from the first shard's footer)."""
    import argparse

    from loader.cli import _facts

    def args(source, decode="auto"):
        return argparse.Namespace(source=source, decode=decode, split=None, allow_incomplete=False)

    assert [_facts(args(pretokenized["web"])), _facts(args(pretokenized["web"], None)),
            _facts(args(str(converted)))] == [{"tokens": True, "codec": "snappy"}, {"tokens": False, "codec": "snappy"},
                                              {"tokens": False, "codec": "snappy"}]


def test_inspect_prints_each_features_range(photos, converted, capsys):
    """The ranges the conversion recorded (what num_classes must cover), or why there are none."""
    from loader.cli import main

    assert main(["inspect", str(photos)]) == 0
    out = capsys.readouterr().out
    assert ("feature ranges (over all 48 records, from the manifest):\n"
            "  image/class/label: int64 0..1 (every record)\n"
            "  image/encoded: bytes present (every record)\n"
            "  image/format: bytes present (every record)\n") in out, out
    assert main(["inspect", str(photos), "--split", "[40:]"]) == 0  # a slice: the ranges of its shards' records
    out = capsys.readouterr().out
    assert "records: 8 in 3 shard(s)\n" in out and ("feature ranges (over all 48 records, from the manifest; the "
                                                    "slice's 8 are among them):\n"
                                                    "  image/class/label: int64 0..1 (every record)\n") in out, out
    assert main(["inspect", str(converted), "--decode", "none"]) == 0  # raw records, not tf.train.Examples
    assert "feature ranges: the manifest has none: converted before they were recorded, or records that are not " \
           "tf.train.Examples; `python -m pipelines convert --force` records them" in capsys.readouterr().out


def test_inspect_shows_an_incomplete_dataset_and_bench_takes_it_when_asked(converted, tmp_path, capsys):
    """inspect refused it, advising an `allow_incomplete=True` that neither inspect nor bench took."""
    import json
    import shutil

    from loader.cli import main

    copy = tmp_path / "out"
    shutil.copytree(converted, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["failed"] = [{"source": "/in/train-00005-of-00006", "error": "corrupt TFRecord at byte offset 8"}]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert main(["inspect", str(copy), "--decode", "none"]) == 0
    assert (f"records: 257 in 5 shard(s)\nincomplete: 1 shard(s) failed to convert (e.g. /in/train-00005-of-00006), "
            "and their records are not here; loading it needs allow_incomplete=True (python -m trainer: "
            f"allow_incomplete=true); `python -m pipelines status --output {copy}` names them\n"
            ) in capsys.readouterr().out
    bench = ["bench", str(copy), "--batch_size", "16", "--start", "1", "--batches", "2", "--decode", "none"]
    assert main(bench) == 2
    assert capsys.readouterr().err.strip().endswith(
        "or pass allow_incomplete=True (python -m trainer: allow_incomplete=true; python -m loader bench: "
        "--allow-incomplete) to load the shards that converted")
    assert main([*bench, "--allow-incomplete"]) == 0
    assert "batches of 16" in capsys.readouterr().out


def test_bench_reports_the_rate_of_a_window_long_enough(converted, monkeypatch, capsys):
    from loader import cli

    monkeypatch.setattr(cli, "STEADY_SECONDS", 0.0)  # (a window of a second or more, as a real bench takes)
    assert cli.main(["bench", str(converted), "--batch_size", "16", "--start", "0", "--batches", "5",
                     "--decode", "none"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^first batch \d+\.\d\d s; [\d,]+ examples/s over 5 batches of 16 after a start window of 0 "
                     r"\(none\)", out), out


def test_bench_auto_says_what_it_chose(converted):
    bench = _run("bench", str(converted), "--batch_size", "16", "--start", "3", "--batches", "5", "--decode", "none",
                 "--workers", "auto")
    assert bench.returncode == 0, bench.stderr
    assert "workers=auto (threads here" in bench.stdout, bench.stdout  # a few batches: the first setting
    bad = _run("bench", str(converted), "--workers", "many")
    assert bad.returncode == 2 and "--workers takes a number of worker processes or auto (got 'many')" in bad.stderr
    for step in ("0", "-1", "nan"):  # 0 was a ZeroDivisionError traceback; -1 timed "nothing measured"
        bad = _run("bench", str(converted), "--step-time", step)
        assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].endswith(
            f"--step-time takes a training step's time in seconds, over 0 (got '{step}')"), bad.stderr


def test_bench_with_worker_processes_reports_their_memory(converted):
    bench = _run("bench", str(converted), "--batch_size", "16", "--start", "3", "--batches", "5", "--decode", "none",
                 "--workers", "1")
    assert bench.returncode == 0, bench.stderr
    worker_mb = re.search(r"the largest worker ([\d,]+) MB", bench.stdout)
    assert worker_mb and int(worker_mb.group(1).replace(",", "")) > 20, bench.stdout  # a worker imports numpy


def test_errors_are_one_line(tmp_path):
    proc = _run("inspect", str(tmp_path / "missing-*.array_record"))
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: no files match") and "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv, last", [
    (["bench", "x", "--batches", "0"], "--batches takes the batches timed after the start window, a whole number >= 1 "
                                       "(got '0')"),  # (an UnboundLocalError with --step-time; else a rate of 0)
    (["bench", "x", "--start", "-2"], "--start takes the batches of the start window, a whole number >= 0 (got '-2')"),
    (["stage", "x", "y", "--parallelism", "0"], "--parallelism takes the files copied at once, a whole number >= 1 "
                                                "(got '0')"),
])
def test_bad_numbers_are_refused_before_any_work(argv, last, capsys):
    from loader.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1].endswith(last)


def test_a_stage_onto_its_source_is_one_line_and_ctrl_c_says_how_to_resume(converted, tmp_path, monkeypatch, capsys):
    from loader import cli
    from loader.fetch import staging

    assert cli.main(["stage", str(converted), f"{converted}/"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: local_dir {converted}/ is the source itself ({converted}): "
                                               f"name another directory, e.g. {converted}-staged")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(staging, "_copy", interrupted)
    assert cli.main(["stage", str(converted), str(tmp_path / "copy")]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "interrupted: the same command resumes the staging, skipping what was copied")


def test_inspect_of_records_that_are_not_examples_says_to_pass_decode_none(converted, capsys):
    """A protobuf DecodeError traceback: the records of `converted` are plain bytes."""
    from loader.cli import main

    assert main(["inspect", str(converted), "--decode", "example"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        f"error: record 0 of {converted} does not decode as --decode example (DecodeError: ")
    assert main(["inspect", str(converted), "--decode", "none"]) == 0
    # bench: loader.load's advice in the command's own flags (it said `decode=None`)
    assert main(["bench", str(converted), "--decode", "example", "--start", "0", "--batches", "1"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: ") and error.endswith(
        "; pass --decode none for raw bytes, or another --decode"), error


def test_help_describes_every_command(capsys):
    from loader.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command, words in (("stage", "copy a gs:// dataset"), ("inspect", "print a dataset's shards"),
                           ("bench", "time loader.load")):
        assert f"    {command}" in out and words in out, (command, out)
    # and each command's own --help says what it does, not only its arguments
    for command, words in (("stage", "Copy a gs:// dataset to local disk"), ("inspect", "Print a dataset's shards"),
                           ("bench", "Time loader.load on a dataset")):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert words in out, (command, out)


def test_paced_bench_reports_the_rate_asked_and_every_long_wait(photos):
    bench = _run("bench", str(photos), "--batch_size", "8", "--start", "2", "--batches", "6", "--step-time", "0.02",
                 "--map", "images:32", "--workers", "1")
    assert bench.returncode == 0, bench.stderr
    lines = bench.stdout.splitlines()
    head = re.match(r"paced: a batch of 8 every 20\.0 ms asks 400 images \(32x32 random-resized crops\)/s; after a "
                    r"start window of 2 batches, [\d,]+/s \((\d\.\d\d)\) delivered over 6 batches, waiting ([\d.]+)% of "
                    r"the time, the longest wait ([\d.]+) s; over every batch .*workers=1: 1 worker process\)$", lines[0])
    assert head, bench.stdout
    assert 0 < float(head.group(1)) <= 1.05 and 0 <= float(head.group(2)) <= 100, bench.stdout
    assert re.match(r"  waits over 100 ms after the start window: \d+", lines[1]), bench.stdout
    assert lines[2].startswith("  CPU per 1,000 records (ms): plan ") and "map " in lines[2], bench.stdout
    assert lines[4].startswith("  bound by "), bench.stdout
    bad = _run("bench", str(photos), "--map", "crops:32")
    assert bad.returncode == 2 and "--map takes images:SIZE, e.g. images:224 (got 'crops:32')" in bad.stderr
