"""The real `python -m pipelines` command: summaries, exit codes, and one-line errors before any work."""

import json
import os

import pytest

from dataset_format.manifest import ShardEntry
from tests.conftest import run_cli, synthetic_records, write_tfrecord_shards


def test_convert_then_verify(tmp_path):
    write_tfrecord_shards(tmp_path / "in", [synthetic_records(i, 100) for i in range(3)])
    out = tmp_path / "out"
    proc = run_cli("convert", "--input", str(tmp_path / "in" / "*"), "--output", str(out), check=True)
    assert "converted 3 shard(s) (300 records" in proc.stdout
    assert "dataset: 3 shards, 300 records" in proc.stdout
    assert "train-00002-of-00003.tfrecord -> train-00002-of-00003.array_record: 100 records" in proc.stderr

    again = run_cli("convert", "--input", str(tmp_path / "in" / "*"), "--output", str(out), check=True)
    assert "skipped 3 up-to-date shard(s)" in again.stdout

    ok = run_cli("verify", "--output", str(out), "--deep", check=True)
    assert "3 shards, 300 records, 0 problem(s)" in ok.stdout and "note:" not in ok.stdout

    # a source rewritten and one gone since: the output is whole (exit 0), and said to be behind its input
    source = tmp_path / "in" / "train-00000-of-00003.tfrecord"
    os.utime(source, (1_000_000_000, 1_000_000_000))
    (tmp_path / "in" / "train-00002-of-00003.tfrecord").rename(tmp_path / "moved")
    stale = run_cli("verify", "--output", str(out), check=True)
    assert (f"note: 1 source(s) changed since they were converted (e.g. {source} (changed)): the dataset is "
            "whole but behind its input; `python -m pipelines convert` with the same --input and --output converts "
            "them again") in stale.stdout
    gone = tmp_path / "in" / "train-00002-of-00003.tfrecord"
    assert (f"note: 1 source(s) gone since they were converted (e.g. {gone} (gone)): their shards are still in the "
            "dataset; `python -m pipelines convert` with the same --input and --output and --prune deletes them"
            ) in stale.stdout
    # a manifest of an older version, its sources as they were typed (relative to where it ran): not "gone"
    from pipelines.verify import stale_sources

    manifest = json.loads((out / "manifest.json").read_text())
    entries = [ShardEntry.from_json({**e, "source": os.path.relpath(e["source"])}) for e in manifest["shards"]]
    assert [str(s) for s in stale_sources(entries)] == [
        f"{source} (changed)", f"{tmp_path / 'in' / 'train-00002-of-00003.tfrecord'} (gone)"]

    (out / "train-00001-of-00003.array_record").write_bytes(b"")
    bad = run_cli("verify", "--output", str(out))
    assert bad.returncode == 1
    assert "train-00001-of-00003.array_record: 0 bytes, the manifest says" in bad.stdout


def test_corrupt_input_exits_nonzero_naming_file_and_offset(tmp_path):
    (path,) = write_tfrecord_shards(tmp_path / "in", [synthetic_records(0, 5)])
    path.write_bytes(path.read_bytes()[:-1])
    proc = run_cli("convert", "--input", str(path), "--output", str(tmp_path / "out"), "--direct_num_workers=1")
    assert proc.returncode == 1
    assert f"FAILED: {path}: corrupt TFRecord at byte offset 464, record 4: truncated record" in proc.stdout


def _one_line_error(proc, expected):
    assert proc.returncode == 2, proc.stderr
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and expected in error_lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_arguments_fail_before_any_work(tmp_path):
    write_tfrecord_shards(tmp_path / "in", [synthetic_records(0, 5)])
    out = tmp_path / "out"
    _one_line_error(run_cli("convert", "--input", str(tmp_path / "missing.tfrecord"), "--output", str(out)),
                    "does not exist")
    _one_line_error(run_cli("convert", "--input", str(tmp_path / "in" / "*.nope"), "--output", str(out)),
                    "no files match")
    (tmp_path / "a-file").write_text("x")
    _one_line_error(run_cli("convert", "--input", str(tmp_path / "in" / "*"), "--output", str(tmp_path / "a-file" / "out")),
                    "is not writable")
    _one_line_error(run_cli("convert", "--input", str(tmp_path / "in" / "*"), "--output", str(out), "--compression", "lz4"),
                    "compression='lz4' is not one of")
    _one_line_error(run_cli("verify", "--output", str(tmp_path / "empty")), "manifest.json does not exist")
    _one_line_error(run_cli("status", "--output", str(tmp_path / "otu")), "does not exist: no conversion has written "
                    "there")  # a misspelt --output looked like a conversion not started yet
    assert not out.exists()


@pytest.mark.parametrize("flags, line", [
    (["--compression", "zstd:99"], "error: compression='zstd:99' is not one of zstd:N (N in -131072..22), brotli:N "
                                   "(0..11), snappy, uncompressed"),
    (["--writer-options", "group_size:1,zstd:3,window_log:40"],
     "error: writer_options='group_size:1,zstd:3,window_log:40' is refused by ArrayRecord's writer: Option "
     "window_log: invalid value: 40, valid values: auto, integers in the range [10..31]"),
    (["--writer-options", "group_size:1,fooz:3"], "error: writer_options='group_size:1,fooz:3' is refused by "
                                                  "ArrayRecord's writer: Unknown option fooz, valid options: "),
    (["--writer-options", "group_size:64,zstd:1"],
     "error: writer_options='group_size:64,zstd:1' sets group_size:64: converted files hold one record a chunk "
     "(group_size:1), which random access needs; put group_size:1 in it"),
    # "" kept no options: a zstd output went back to snappy, every shard converted again
    (["--writer-options", ""], "error: writer_options is empty; leave --writer_options out to keep the output's (its "
                               "manifest's), or give one"),
    (["--tokenizer", " "], "error: tokenizer is empty; leave --tokenizer out to keep the output's (its manifest's), or "
                           "give one (none: copy the records as they are)"),  # ([Errno 21] Is a directory: '.')
])
def test_writer_options_the_writer_refuses_are_one_line_before_any_work(tmp_path, capsys, flags, line):
    """Each shard's conversion failed inside Beam (~460 lines of tracebacks, exit 1), and group_size:64 was written
    (the loader then reads through ArrayRecord's slower reader)."""
    from pipelines import cli as pipelines_cli

    write_tfrecord_shards(tmp_path / "in", [synthetic_records(0, 5)])
    assert pipelines_cli.main(["convert", "--input", str(tmp_path / "in" / "*"), "--output", str(tmp_path / "out"),
                               *flags]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(line)
    assert not (tmp_path / "out").exists()


def test_make_demo_without_the_demo_extra_names_it(tmp_path, capsys, monkeypatch):
    """converting.md's install line is `.[convert]`; make-demo's digits need scikit-learn (`.[demo]`): a traceback."""
    import sys

    from pipelines import cli as pipelines_cli

    monkeypatch.setitem(sys.modules, "sklearn", None)  # not installed
    monkeypatch.delitem(sys.modules, "sklearn.datasets", raising=False)
    assert pipelines_cli.main(["make-demo", "--output", str(tmp_path / "d")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        'error: make-demo --kind digits needs scikit-learn, which the demo extra installs: pip install ".[demo]" (or '
        "pip install scikit-learn)")


def test_make_demo_says_the_glob_of_each_split(tmp_path, capsys):
    from pipelines import cli as pipelines_cli

    assert pipelines_cli.main(["make-demo", "--output", str(tmp_path / "d"), "--num-shards", "3"]) == 0
    assert capsys.readouterr().out.strip() == (f"wrote 6 TFRecord shards to {tmp_path / 'd'}: digits-train.tfrecord-* "
                                               "(3 shards), digits-test.tfrecord-* (3 shards)")


def test_an_unknown_command_is_named(capsys):
    from pipelines import cli as pipelines_cli

    assert pipelines_cli.main(["stats"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: 'stats' is not a command; the commands are convert, plan, verify, status, make-demo, tokenizer")


def test_output_of_another_kind_is_refused(tmp_path, tfds_digits):
    write_tfrecord_shards(tmp_path / "in", [synthetic_records(0, 5)])
    out = tmp_path / "out"
    run_cli("convert", "--input", str(tmp_path / "in" / "*"), "--output", str(out), check=True)
    _one_line_error(run_cli("convert", "--input", str(tfds_digits), "--output", str(out)),
                    "would mix datasets")
    assert json.loads((out / "manifest.json").read_text())["kind"] == "tfrecord"


def test_an_unknown_flag_of_convert_is_an_error_naming_it(tmp_path, capsys):
    """Beam drops flags it does not know with a warning: a misspelled --tokenizer converted untokenised, exit 0."""
    from pipelines import cli as pipelines_cli

    with pytest.raises(SystemExit) as e:
        pipelines_cli.main(["convert", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"),
                            "--tokeniser", "t.json", "--direct_num_workers=1"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "error: unrecognized arguments: --tokeniser (neither a flag of convert, listed by --help, nor a Beam "
        "pipeline option) (--tokeniser: did you mean --tokenizer?)")
    assert not (tmp_path / "out").exists()
    # gcloud's names of Dataflow options (the operators' guide's) are Beam's under another spelling
    with pytest.raises(SystemExit):
        pipelines_cli.main(["convert", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"),
                            "--max-workers=5", "--skip_corupt", "--zzz"])
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "(--max-workers: did you mean --max_num_workers?; --skip_corupt: did you mean --skip_corrupt?)")

    # a misspelt required flag: the line names it beside the one it was meant to be
    with pytest.raises(SystemExit) as e:
        pipelines_cli.main(["convert", "--input", str(tmp_path / "in"), "--ouput", str(tmp_path / "out")])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "error: the following arguments are required: --output; given instead: --ouput (did you mean --output?)")

    # an unquoted glob, expanded by the shell: --input takes the first file, Beam dropped the others with a warning
    with pytest.raises(SystemExit) as e:
        pipelines_cli.main(["convert", "--input", str(tmp_path / "in" / "a-0.tfrecord"), str(tmp_path / "in" /
                            "a-1.tfrecord"), "--output", str(tmp_path / "out"), "--direct_num_workers=1"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f"error: 1 argument(s) that no flag takes: {tmp_path / 'in' / 'a-1.tfrecord'}; if the shell expanded an "
        f"--input glob, quote it (--input '{tmp_path / 'in'}/...*'), so that every file it matches is converted")
    assert not (tmp_path / "out").exists()

    # --input twice: argparse kept the last one, silently
    with pytest.raises(SystemExit) as e:
        pipelines_cli.main(["convert", "--input", "web/*", "--input", "code/*", "--output", str(tmp_path / "out")])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "error: --input given twice (web/*, then code/*): a conversion takes one (a glob or a directory); convert "
        "each into an output of its own and mix them in training (python -m trainer data=a=OUT_A,b=OUT_B "
        "weights=a=1,b=1)")
    assert not (tmp_path / "out").exists()


def test_a_rerun_without_the_options_keeps_the_outputs_own(tmp_path, capsys):
    """A rerun (or a scheduled refresh) that names only --input and --output keeps the compression and the
    tokenisation the output's manifest records; it reconverted a zstd or pre-tokenized dataset as plain snappy."""
    from dataset_format import tokenizer as tokenizers
    from pipelines import cli as pipelines_cli
    from dataset_format import example_proto

    texts = [f"line {i} of the corpus".encode() for i in range(40)]
    write_tfrecord_shards(tmp_path / "in", [[example_proto.encode_example({"body": t}) for t in texts[:20]],
                                            [example_proto.encode_example({"body": t}) for t in texts[20:]]])
    tok = tokenizers.train_bpe(texts, 280, str(tmp_path / "tok.json"))
    base = ["convert", "--input", str(tmp_path / "in" / "*.tfrecord"), "--output", str(tmp_path / "out"),
            "--direct_num_workers=1"]
    assert pipelines_cli.main([*base, "--compression", "zstd:3", "--tokenizer", tok, "--text-key", "body",
                               "--add-eos"]) == 0
    first = json.loads((tmp_path / "out" / "manifest.json").read_text())
    capsys.readouterr()
    assert pipelines_cli.main(base) == 0
    out, err = capsys.readouterr()
    assert "converted 0 shard(s)" in out
    assert (f"keeping {tmp_path / 'out'}'s options (from its manifest): --compression zstd:3 --tokenizer {tok} "
            "--text-key body --add-eos True; pass the flags to change them") in err
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["shards"] == first["shards"]
    assert pipelines_cli.main([*base, "--compression", "snappy"]) == 0  # a flag given changes it
    assert "converted 2 shard(s)" in capsys.readouterr().out
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert {s["writer_options"] for s in manifest["shards"]} == {"group_size:1,snappy"}
    assert manifest["tokens"]["text_key"] == "body"  # the tokenisation kept
    assert len(list((tmp_path / "out").glob("*.counts"))) == 2
    assert pipelines_cli.main([*base, "--tokenizer", "none"]) == 0  # and the way back to records copied as they are
    assert "converted 2 shard(s)" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "manifest.json").read_text()).get("tokens") is None
    assert list((tmp_path / "out").glob("*.counts")) == []  # the token counts went with the tokens


def test_a_rerun_after_a_first_run_died_before_its_manifest_keeps_the_options_of_its_commits(tmp_path, capsys):
    """A first run killed after committing its shards, before its manifest: a rerun (a scheduled refresh) without
    the flags took the defaults and converted every shard again as snappy, silently. Now it keeps the commit records'
    writer options and recovers the shards; tokenised ones, whose records name no tokenizer file, need --tokenizer."""
    from dataset_format import example_proto, tokenizer as tokenizers
    from pipelines import cli as pipelines_cli

    texts = [f"line {i} of the corpus".encode() for i in range(40)]
    write_tfrecord_shards(tmp_path / "in", [[example_proto.encode_example({"body": t}) for t in texts[:20]],
                                            [example_proto.encode_example({"body": t}) for t in texts[20:]]])
    tok = tokenizers.train_bpe(texts, 280, str(tmp_path / "tok.json"))
    out_dir = tmp_path / "out"
    base = ["convert", "--input", str(tmp_path / "in" / "*.tfrecord"), "--output", str(out_dir),
            "--direct_num_workers=1"]
    assert pipelines_cli.main([*base, "--compression", "zstd:3", "--tokenizer", tok, "--text-key", "body"]) == 0
    first = json.loads((out_dir / "manifest.json").read_text())
    (out_dir / "manifest.json").unlink()  # as if the run died after its shards' commits, before its manifest
    capsys.readouterr()

    assert pipelines_cli.main(base) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {out_dir} holds 2 shard(s) that an interrupted first run converted and tokenised "
        f"({first['shards'][0]['tokens']}), and no manifest to say with which tokenizer file: pass the same "
        "--tokenizer (and --text-key, --add-bos, --add-eos) to keep them, or --tokenizer none to convert them all "
        "again as they are")
    assert not (out_dir / "manifest.json").exists()

    assert pipelines_cli.main([*base, "--tokenizer", tok, "--text-key", "body"]) == 0
    out, err = capsys.readouterr()
    assert (f"keeping {out_dir}'s options (from the commit records of 2 shard(s) an interrupted first run "
            "converted): --compression zstd:3; pass the flags to change them") in err
    assert "plan: 0 shard(s) to convert, 0 up to date, 2 recovered from an interrupted run" in err + out
    assert json.loads((out_dir / "manifest.json").read_text())["shards"] == first["shards"]


def test_boolean_flags_take_the_trainers_words():
    """--force on, as python -m trainer takes packing=on; a misspelt word is refused, naming the words."""
    from pipelines.cli import _convert_parser

    parser = _convert_parser()
    parsed = parser.parse_args(["--input", "x", "--output", "y", "--force", "on", "--prune=off", "--skip-corrupt"])
    assert (parsed.force, parsed.prune, parsed.skip_corrupt) == (True, False, True)
    with pytest.raises(SystemExit):
        parser.parse_args(["--input", "x", "--output", "y", "--force", "ture"])


def test_ctrl_c_of_a_dataflow_launch_says_the_job_goes_on(monkeypatch, capsys):
    """Ctrl-C stops only the launcher's wait on Dataflow: "run it again" would start a second job on the output."""
    from pipelines import cli as pipelines_cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setitem(pipelines_cli._COMMANDS, "convert", interrupted)
    assert pipelines_cli.main(["convert", "--input", "gs://b/in/*", "--output", "gs://b/out",
                               "--runner=DataflowRunner"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "interrupted: the Dataflow job goes on and writes the manifest when it ends (its id is in the log above); stop "
        "it with `gcloud dataflow jobs cancel JOB_ID --region REGION`, or let it finish, before converting to this "
        "output again")
    assert pipelines_cli.main(["convert", "--input", "a", "--output", "b"]) == 130  # local: the rerun finishes it
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("interrupted: the shards committed so far")


def test_help_is_exit_0_on_stdout_and_file_errors_are_one_line(tmp_path, capsys):
    """--help was exit 2 on stderr; an OSError other than a missing file or a permission (a file where a directory
    goes) was a traceback; make-demo took sizes of 0; a damaged lease stopped `status` with a bare JSON error."""
    from pipelines.cli import main

    assert main(["--help"]) == 0
    out, err = capsys.readouterr()
    assert "convert" in out and not err
    assert main(["conver"]) == 2 and "error: 'conver' is not a command" in capsys.readouterr().err
    afile = tmp_path / "afile"
    afile.write_text("x")
    for argv, last in (
            (["make-demo", "--output", str(afile)], f"error: [Errno 17] File exists: '{afile}'"),
            (["make-demo", "--output", str(tmp_path / "d"), "--kind", "photos", "--count", "0"],
             "error: --count 0 must be above 0"),
            (["make-demo", "--output", str(tmp_path / "d"), "--kind", "text", "--max-mb", "-1"],
             "error: --max_mb -1 must be above 0"),
            (["status", "--output", str(afile)], f"error: --output {afile} is a file: name a conversion's output "
                                                  "directory")):
        assert main(argv) == 2, argv
        assert capsys.readouterr().err.strip().splitlines()[-1] == last
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / ".lease.json").write_text("[1, 2]")
    assert main(["status", "--output", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'out' / '.lease.json'} is damaged (a list, not a holder's record): when no conversion "
        "runs, delete it (the next run writes its own)")
