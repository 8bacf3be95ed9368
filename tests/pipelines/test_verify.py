"""pipelines/verify.py: --deep finds a damaged shard whose sources are gone (a staged copy on a training host)."""
import json
import shutil

import pytest

from dataset_format.manifest import redo
from pipelines import ConvertConfig, run_conversion
from tests.conftest import synthetic_records, write_tfrecord_shards


@pytest.fixture
def sourceless(tmp_path):
    """A converted dataset of 3 shards of 300 records whose manifest names sources that are gone."""
    write_tfrecord_shards(tmp_path / "in", [synthetic_records(i, 300, size=200) for i in range(3)])
    out = tmp_path / "out"
    assert run_conversion(ConvertConfig(input=str(tmp_path / "in" / "*"), output=str(out)),
                          ["--direct_num_workers=1"]).ok
    shutil.rmtree(tmp_path / "in")
    return out


def test_deep_reads_every_shard_whose_source_is_gone_and_finds_the_damaged_one(sourceless, capsys):
    """Every shard was a PROBLEM "its source no longer exists, cannot compare records", the damaged one among them,
    none of them read: riegeli's chunk hashes find the damage without a source."""
    from pipelines.cli import verify_main

    assert verify_main(["--output", str(sourceless), "--deep"]) == 0
    out = capsys.readouterr().out
    assert ("note: 3 shard(s) were read whole, each chunk's hash checked (and a pre-tokenized shard's token counts), "
            f"but not compared with their sources (e.g. {sourceless / 'train-00000-of-00003.array_record'} "
            "(its source ") \
        in out and " is gone or out of reach))" in out and "PROBLEM" not in out, out
    assert "0 problem(s)" in out
    shard = sourceless / "train-00001-of-00003.array_record"
    data = bytearray(shard.read_bytes())
    data[10_000] ^= 0x40  # inside the first chunk's records
    shard.write_bytes(bytes(data))
    assert verify_main(["--output", str(sourceless), "--deep"]) == 1
    problems = [line for line in capsys.readouterr().out.splitlines() if line.startswith("PROBLEM")]
    assert len(problems) == 1 and problems[0].startswith(f"PROBLEM: {shard}: record ") and "corrupt" in problems[0]


def test_a_staged_copys_sources_are_not_said_to_be_pruned(sourceless, tmp_path, capsys):
    """A staged copy on a training host has no sources: verify advised `convert --prune`, which would delete the
    dataset's shards."""
    import loader
    from pipelines.cli import verify_main

    loader.stage(str(sourceless), str(tmp_path / "copy"))
    assert verify_main(["--output", str(tmp_path / "copy")]) == 0
    out = capsys.readouterr().out
    assert "--prune" not in out and "note: 3 source(s) of the conversion are not on this host (e.g. " in out, out
    assert f"a staged copy's are where it was converted; verify {sourceless} there to compare with them" in out


def test_sources_on_gcs_without_credentials_are_said_and_not_waited_for(sourceless, tmp_path, monkeypatch, capsys):
    """A local copy of a conversion from gs://, verified on a host without credentials: a traceback after 133 s."""
    import time

    from pipelines.cli import verify_main

    manifest = json.loads((sourceless / "manifest.json").read_text())
    for entry in manifest["shards"]:
        entry["source"] = "gs://raw-bucket/in/" + entry["source"].rsplit("/", 1)[1]
    (sourceless / "manifest.json").write_text(json.dumps(manifest))
    _without_credentials(monkeypatch, tmp_path)
    started = time.monotonic()
    assert verify_main(["--output", str(sourceless), "--deep"]) == 0
    out = capsys.readouterr().out
    assert time.monotonic() - started < 30, out
    assert ("note: 1 source directory(ies) cannot be listed from this host (e.g. gs://raw-bucket/in (cannot be "
            "listed: gs:// paths need Google Cloud credentials, and none were found: run `gcloud auth "
            "application-default login`") in out, out
    assert "note: 3 shard(s) were read whole" in out


def test_deep_checks_a_pretokenized_shards_counts_without_its_sources_or_tokenizer(tmp_path, capsys):
    """A staged pre-tokenized copy on a training host has neither its sources nor its tokenizer: --deep stopped at
    "the tokenizer does not load" (a PROBLEM, exit 1) and read nothing. Its records are read and each shard's counts
    checked against them (their ids counted), which finds a wrong count of the right size."""
    import numpy as np

    from dataset_format import example_proto
    from dataset_format import tokenizer as tokenizers
    from pipelines.cli import verify_main

    texts = [f"document {i} says {'word ' * (i % 7)}".encode() for i in range(60)]
    write_tfrecord_shards(tmp_path / "in", [[example_proto.encode_example({"text": t}) for t in texts[:30]],
                                            [example_proto.encode_example({"text": t}) for t in texts[30:]]])
    tok = tokenizers.train_bpe(texts, 300, str(tmp_path / "tokenizer.json"))
    out = tmp_path / "out"
    assert run_conversion(ConvertConfig(input=str(tmp_path / "in" / "*"), output=str(out), tokenizer=tok),
                          ["--direct_num_workers=1"]).ok
    (tmp_path / "tokenizer.json").rename(tmp_path / "moved.json")
    assert verify_main(["--output", str(out), "--deep"]) == 1  # its sources are here: not comparing them is a problem
    said = capsys.readouterr().out
    assert f"PROBLEM: cannot compare tokenised records: the tokenizer {tok} does not load" in said, said
    assert f"(e.g. {out / 'train-00000-of-00002.array_record'} (its tokenizer {tok} does not load))" in said, said

    shutil.rmtree(tmp_path / "in")
    assert verify_main(["--output", str(out), "--deep"]) == 0
    assert "note: 2 shard(s) were read whole" in capsys.readouterr().out
    counts_path = out / "train-00001-of-00002.array_record.counts"
    counts = np.fromfile(counts_path, "<u4")
    right = int(counts[4])
    counts[4] += 1
    counts.tofile(counts_path)
    assert verify_main(["--output", str(out)]) == 0  # the right size: only the records tell
    assert verify_main(["--output", str(out), "--deep"]) == 1
    problems = [line for line in capsys.readouterr().out.splitlines() if line.startswith("PROBLEM")]
    assert problems == [f"PROBLEM: {counts_path}: record 4 has {right:,} token ids but its count says {right + 1:,}; "
                        f"{redo(str(out / 'train-00001-of-00002.array_record'))}"], problems


def _without_credentials(monkeypatch, tmp_path):
    """This process as on a host with no Google Cloud credentials (and no metadata server)."""
    from dataset_format import storage

    for name in ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST", "CLOUD_STORAGE_EMULATOR_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    monkeypatch.setenv("NO_GCE_CHECK", "true")
    monkeypatch.setattr(storage, "_client", lambda: storage._client_for.__wrapped__(0, None))


def test_the_commands_that_run_no_pipeline_import_no_beam():
    """verify and status took ~3.4 s, ~3 s of it importing Beam for its file-system layer: 0.5 s now."""
    import subprocess
    import sys

    from tests.conftest import REPO

    code = ("import sys, pipelines.cli, pipelines.verify, pipelines.progress, pipelines.plan, pipelines.paths; "
            "print(sorted(m for m in sys.modules if m.startswith('apache_beam'))[:3])")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-2000:]
