"""Tokenising at conversion time (pipelines/tokens.py): records become token ids, with a count column beside each
shard, and the loader packs them with no tokenize function."""

import dataclasses
import json
import os
import re

import numpy as np
import pytest

import loader
from dataset_format import example_proto
from pipelines import ConvertConfig, run_conversion
from tests.conftest import write_tfrecord_shards
from dataset_format import tokenizer as tokenizers

TEXTS = [f"def f{i}(x):\n    return x * {i} + {i % 7}  # line {i}".encode() * (1 + i % 5) for i in range(120)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenize")
    records = [example_proto.encode_example({"text": t, "id": [i]}) for i, t in enumerate(TEXTS)]
    write_tfrecord_shards(root / "raw", [records[:50], records[50:90], records[90:]])
    tok = tokenizers.train_bpe(TEXTS, 300, str(root / "tokenizer.json"))
    return root, tok


def _convert(root, out, tok, **options):
    config = ConvertConfig(input=str(root / "raw" / "*.tfrecord"), output=str(out), tokenizer=tok, text_key="text",
                           **options)
    return run_conversion(config, ["--direct_num_workers=1"])


@pytest.fixture(scope="module")
def converted(corpus):
    root, tok = corpus
    _convert(root, root / "out", tok)
    return root / "out", tok


def test_every_record_holds_the_tokenizers_ids_for_its_text(converted):
    out, tok = converted
    manifest = json.loads((out / "manifest.json").read_text())
    tokens = manifest["tokens"]
    assert tokens["dtype"] == "<u2" and tokens["vocab_size"] == 300 and tokens["text_key"] == "text"
    expected = tokenizers.load(tok).encode_batch(TEXTS)
    got = [b["tokens"][0] for b in loader.load(str(out), batch_size=1, shuffle=False, num_epochs=1)]
    assert len(got) == len(TEXTS)
    assert all(np.array_equal(g, e) for g, e in zip(got, expected))
    assert got[0].dtype == np.dtype("<u2") and got[0][0] == 1  # the BOS train_bpe's post-processor adds
    counts = np.concatenate([np.fromfile(out / (s["path"] + ".counts"), "<u4") for s in manifest["shards"]])
    assert counts.tolist() == [len(e) for e in expected]
    # each shard's total in its entry, the dataset's for the loader
    assert [s["token_count"] for s in manifest["shards"]] == [sum(map(len, part)) for part in
                                                               (expected[:50], expected[50:90], expected[90:])]
    assert loader.resolve(str(out)).token_count == sum(map(len, expected))
    assert loader.resolve(str(out / "*.array_record")).token_count == sum(map(len, expected))  # a glob of it too


def test_packing_a_pretokenized_dataset_needs_no_tokenize_and_packs_every_target_once(converted):
    out, tok = converted
    expected = tokenizers.load(tok).encode_batch(TEXTS)
    batches = loader.load(str(out), batch_size=1, packing=loader.Packing(seq_len=64), num_epochs=1, seed=3)
    seen = []
    for batch in batches:
        seen += batch["targets"][batch["segment_ids"] > 0].tolist()
    assert sorted(seen) == sorted(t for ids in expected for t in ids[1:].tolist())
    assert batches.counts.identity.startswith("files:")


@pytest.mark.parametrize("count, error", [
    (2**32 - 1, r"train-00001-of-00003\.array_record\.counts says record 7 of .* holds 4,294,967,295 token ids, "
                r"more than a record can \(at most 1,024: max_record_bytes"),
    (3, r"train-00001-of-00003\.array_record: record 7 has \d+ token ids but its token count says 3; the "
        r"counts are stale or damaged"),
])
def test_a_damaged_counts_file_is_an_error_naming_its_record(converted, tmp_path, count, error):
    """A count no record can hold fails before anything is read; a plausible wrong one, when its record is read.
    Neither lays out rows for the lie nor packs a wrong record."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(converted[0], out)
    (path,) = out.glob("*-00001-of-00003.array_record.counts")
    counts = np.fromfile(path, "<u4")
    counts[7] = count
    counts.tofile(path)
    with pytest.raises(ValueError, match=error):
        list(loader.load(str(out), batch_size=2, packing=loader.Packing(seq_len=1), shuffle=False, num_epochs=1,
                         max_record_bytes=2048))


def test_a_rerun_converts_nothing_and_a_new_tokenisation_converts_everything(corpus, tmp_path):
    root, tok = corpus
    first = _convert(root, tmp_path / "out", tok)
    again = _convert(root, tmp_path / "out", tok)
    assert first.ok and again.ok and again.converted == 0
    eos = _convert(root, tmp_path / "out", tok, add_eos=True)
    assert eos.converted == 3
    got = next(iter(loader.load(str(tmp_path / "out"), batch_size=1, shuffle=False, num_epochs=1)))["tokens"][0]
    assert got[0] == 1 and got[-1] == 2  # BOS ... EOS


def test_shards_without_a_source_of_another_tokenisation_are_pruned_or_refused(corpus, tmp_path):
    """Kept, an output whose source is gone would hold the old tokenisation's ids in a dataset of the new one."""
    import shutil

    root, tok = corpus
    shutil.copytree(root / "raw", tmp_path / "raw")
    assert _convert(tmp_path, tmp_path / "out", tok).ok
    os.remove(sorted((tmp_path / "raw").glob("*.tfrecord"))[0])
    with pytest.raises(ValueError, match=r"^1 output shard\(s\) of .* without a source any more were tokenised "
                                         r"otherwise \(sha256:.* eos:False\) than this run \(sha256:.* eos:True\), "
                                         r"e\.g\. .*: kept, they would mix two tokenisations in one dataset; pass "
                                         r"--prune to delete them$"):
        _convert(tmp_path, tmp_path / "out", tok, add_eos=True)
    pruned = _convert(tmp_path, tmp_path / "out", tok, add_eos=True, prune=True)
    assert pruned.ok and pruned.converted == 2 and len(pruned.manifest.shards) == 2
    assert sorted(p.name for p in (tmp_path / "out").glob("*.counts")) == sorted(
        s.path + ".counts" for s in pruned.manifest.shards)  # the pruned shard's counts went with it


def test_a_text_key_the_records_lack_stops_before_anything_is_written(corpus, tmp_path):
    """Checked on the first record before converting: one error, and an output converted before keeps its manifest
    (every shard failed one by one, and the manifest then listed none of them)."""
    root, tok = corpus
    _convert(root, tmp_path / "out", tok)
    manifest = (tmp_path / "out" / "manifest.json").read_bytes()
    config = ConvertConfig(input=str(root / "raw" / "*.tfrecord"), output=str(tmp_path / "out"), tokenizer=tok,
                           text_key="body")
    with pytest.raises(ValueError) as e:
        run_conversion(config, ["--direct_num_workers=1"])
    assert str(e.value) == (f"{root / 'raw' / 'train-00000-of-00003.tfrecord'}: record 0 has no feature 'body' (it has ['id', "
                            "'text']); pass its text feature as --text-key (checked before converting: nothing was "
                            "written)")
    assert (tmp_path / "out" / "manifest.json").read_bytes() == manifest


def test_a_record_without_the_text_key_fails_its_shard_naming_the_record_and_the_keys(corpus, tmp_path):
    root, tok = corpus
    records = [example_proto.encode_example({"text": t, "id": [i]}) for i, t in enumerate(TEXTS[:20])]
    records[7] = example_proto.encode_example({"id": [7]})  # the first record has the text: the shard fails later
    write_tfrecord_shards(tmp_path / "raw", [records[:10], records[10:]])
    config = ConvertConfig(input=str(tmp_path / "raw" / "*.tfrecord"), output=str(tmp_path / "out"), tokenizer=tok,
                           text_key="text")
    outcome = run_conversion(config, ["--direct_num_workers=1"])
    assert not outcome.ok
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    errors = [f["error"] for f in manifest["failed"]]
    assert errors == [f"{tmp_path / 'raw' / 'train-00000-of-00002.tfrecord'}: record 7 has no feature 'text' (it has ['id']); "
                      "pass its text feature as --text-key"]
    assert [s["records"] for s in manifest["shards"]] == [10]  # the other shard converted
    # --skip-corrupt: record 7 of those read is further into the file when a corrupt frame before it was skipped
    first = tmp_path / "raw" / "train-00000-of-00002.tfrecord"
    data = bytearray(first.read_bytes())
    data[12 + 5] ^= 0xFF  # inside record 0's data: its data CRC fails
    first.write_bytes(bytes(data))
    outcome = run_conversion(dataclasses.replace(config, skip_corrupt=True, force=True), ["--direct_num_workers=1"])
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert [f["error"] for f in manifest["failed"]] == [
        f"{first}: record 6 has no feature 'text' (it has ['id']); pass its text feature as --text-key (counting the "
        "records read: 1 corrupt region(s) before it were skipped by --skip-corrupt, so it lies further into the file)"]


def test_packing_text_without_tokens_says_how_to_convert(corpus, tmp_path):
    root, _ = corpus
    run_conversion(ConvertConfig(input=str(root / "raw" / "*.tfrecord"), output=str(tmp_path / "plain")),
                   ["--direct_num_workers=1"])
    with pytest.raises(ValueError, match=r"is not one: convert the text with `python -m pipelines convert "
                                         r"--tokenizer PATH --text-key KEY`"):
        loader.load(str(tmp_path / "plain"), batch_size=2, packing=loader.Packing(seq_len=64))


def test_verify_deep_tokenises_the_sources_again_and_checks_the_counts(corpus, tmp_path):
    from pipelines.verify import verify

    root, tok = corpus
    _convert(root, tmp_path / "out", tok)
    result = verify(str(tmp_path / "out"), deep=True)
    assert result.ok and result.records == len(TEXTS), result.problems
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    counts = tmp_path / "out" / (manifest["shards"][1]["path"] + ".counts")
    damaged = bytearray(counts.read_bytes())
    first = int.from_bytes(damaged[:4], "little")
    damaged[0] ^= 1
    counts.write_bytes(bytes(damaged))
    shard = tmp_path / "out" / manifest["shards"][1]["path"]
    assert verify(str(tmp_path / "out"), deep=True).problems == [  # (it named no record, and advised --force)
        f"{shard}.counts: record 0 has {first:,} token ids but its count says {first ^ 1:,}; delete {shard} and "
        "re-run the conversion, which converts it again"]
    counts.write_bytes(bytes(damaged[:-4]))
    assert verify(str(tmp_path / "out")).problems[0].endswith("bytes for 40 records (4 a record); the file is "
                                                              "damaged, re-run the conversion with --force")
    counts.write_bytes(bytes(damaged))
    damaged[0] ^= 1
    counts.write_bytes(bytes(damaged))  # (the counts mended: the manifest's total edited instead)
    manifest["shards"][1]["token_count"] += 1
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(manifest))
    assert verify(str(tmp_path / "out"), deep=True).problems == [
        f"{tmp_path / 'out' / manifest['shards'][1]['path']}: manifest.json says "
        f"{manifest['shards'][1]['token_count']:,} tokens, and its records hold "
        f"{manifest['shards'][1]['token_count'] - 1:,}; re-run with --force"]


def test_a_relative_tokenizer_path_is_kept_absolute_so_verify_deep_runs_from_anywhere(corpus, tmp_path, monkeypatch):
    from pipelines.verify import verify

    root, tok = corpus
    monkeypatch.chdir(root)
    _convert(root, tmp_path / "out", "tokenizer.json")  # as typed, relative to where the conversion ran
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["tokens"]["tokenizer"] == tok
    monkeypatch.chdir(tmp_path)
    result = verify(str(tmp_path / "out"), deep=True)
    assert result.ok and result.records == len(TEXTS), result.problems


def test_a_file_that_is_no_tokenizer_is_named_by_the_converters_flag(tmp_path):
    from pipelines.tokens import TokenizeSpec

    (tmp_path / "notes.txt").write_text("not a tokenizer")
    with pytest.raises(ValueError) as e:
        TokenizeSpec.of(str(tmp_path / "notes.txt"), "text")
    assert str(e.value).startswith(f"--tokenizer {tmp_path / 'notes.txt'} is not a SentencePiece model (")


def test_datasets_of_different_tokenizers_are_not_mixed_or_evaluated_together(corpus, converted, tmp_path):
    """Their ids mean other tokens: a mixture trained on garbage (or ended in a NaN loss), eval_data= scored it."""
    import hashlib

    from trainer import sources
    from trainer.config import TrainConfig

    root, tok = corpus
    out, _ = converted
    other = tokenizers.train_bpe(TEXTS[::-1], 280, str(tmp_path / "other.json"))
    _convert(root, tmp_path / "other", other)
    _convert(root, tmp_path / "same", tok)  # the same tokenizer file: mixes
    mixed = loader.load({"a": str(out), "b": str(tmp_path / "same")}, weights={"a": 1, "b": 1}, batch_size=2,
                        packing=loader.Packing(seq_len=64))
    assert next(iter(mixed))["tokens"].shape == (2, 64)
    with pytest.raises(ValueError) as e:
        loader.load({"a": str(out), "b": str(tmp_path / "other")}, weights={"a": 1, "b": 1}, batch_size=2,
                    packing=loader.Packing(seq_len=64))
    def digest(path):
        return hashlib.sha256(open(path, "rb").read()).hexdigest()[:16]

    assert str(e.value) == (f"the mixture's components were tokenized by different tokenizers (a: {tok} "
                            f"(sha256:{digest(tok)}), b: {other} (sha256:{digest(other)})): an id means another "
                            "token in each; convert them all with one --tokenizer")
    with pytest.raises(ValueError, match=rf"^the datasets of data= and eval_data= were tokenized by different "
                                         rf"tokenizers \(data={out}: .*, eval_data={tmp_path}/other: .*\): an id means"):
        sources.resolve(TrainConfig(task="lm", data=str(out), eval_data=str(tmp_path / "other"), workdir="w"))
    with pytest.raises(ValueError, match=rf"^the components of data= were tokenized by different tokenizers "
                                         rf"\(data component a={out}: .*, data component b={tmp_path}/other: "):
        sources.resolve(TrainConfig(task="lm", data=f"a={out},b={tmp_path}/other", weights="a=1,b=1", workdir="w"))
    run_conversion(ConvertConfig(input=str(root / "raw" / "*.tfrecord"), output=str(tmp_path / "text")),
                   ["--direct_num_workers=1"])
    with pytest.raises(ValueError) as e:
        sources.resolve(TrainConfig(task="lm", data=f"a={out},b={tmp_path}/text", weights="a=1,b=1", workdir="w"))
    assert str(e.value) == (f"data component b={tmp_path}/text is not pre-tokenized but data component a={out} is: "
                            f"convert it with the same --tokenizer ({tok} (sha256:{digest(tok)})), or give only "
                            "datasets of text")
    found = sources.resolve(TrainConfig(task="lm", data=str(out), eval_data=str(tmp_path / "same"), workdir="w"))
    assert [s.path for s in found.train + found.eval] == [str(out), str(tmp_path / "same")]


def test_the_conversions_summary_counts_the_tokens(corpus, converted):
    root, tok = corpus
    total = sum(map(len, tokenizers.load(tok).encode_batch(TEXTS)))
    rerun = _convert(root, converted[0], tok)  # (nothing to convert: the dataset's line is its manifest's)
    assert f"dataset: 3 shards, 120 records, {total:,} tokens, " in rerun.summary(), rerun.summary()


def test_inspect_shows_a_pretokenized_datasets_ids(converted, capsys):
    import hashlib

    from loader.cli import main

    out, tok = converted
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    digest = hashlib.sha256(open(tok, "rb").read()).hexdigest()[:16]
    assert (f"pre-tokenized: each record is one document's token ids (<u2) by {tok} (sha256:{digest}); no feature "
            "ranges\n") in text, text
    total = sum(map(len, tokenizers.load(tok).encode_batch(TEXTS)))
    assert f"tokens: {total:,} in its shards' 120 documents ({total / 120:,.1f} a document)\n" in text, text
    first = tokenizers.load(tok).encode_batch(TEXTS[:1])[0]
    assert f"  tokens: uint16[{len(first)}]  e.g. [" in text, text


def test_packing_options_that_cannot_work_are_named_at_load(corpus, tmp_path):
    """packing=True, Packing(64), seq_len="64" and a text feature packed as ids were AttributeError / TypeError
    tracebacks, the last from deep in the counting pass."""
    root, _ = corpus
    plain = tmp_path / "plain"
    run_conversion(ConvertConfig(input=str(root / "raw" / "*.tfrecord"), output=str(plain)), ["--direct_num_workers=1"])
    for given, suggestion in ((True, "N"), (64, "64")):
        with pytest.raises(ValueError) as e:
            loader.load(str(plain), batch_size=2, packing=given)
        assert str(e.value) == (f"packing= takes a loader.Packing, e.g. packing=loader.Packing(seq_len={suggestion}) "
                                f"for a pre-tokenized dataset (got packing={given!r})")
    with pytest.raises(ValueError, match=r"^Packing's first argument is feature=, the records' text feature \(got "
                                         r"64\); pass the row length by name: Packing\(seq_len=64\)$"):
        loader.Packing(64)
    with pytest.raises(ValueError, match=r"^seq_len must be a whole number >= 1 \(got seq_len='64'\)$"):
        loader.Packing(seq_len="64")
    with pytest.raises(ValueError, match=r"^tokenize= takes a function \(got tokenize='bpe'\)$"):
        loader.Packing("text", seq_len=64, tokenize="bpe")
    with pytest.raises(ValueError, match=r"^packing= reads one feature, Packing.feature, and gives rows of token ids: "
                                         r"drop features=\['text'\] \(name the text feature as Packing\(feature=\.\.\.\)\)$"):
        loader.load(str(plain), batch_size=2, features=["text"], packing=loader.Packing(seq_len=64))
    fix = ("pass Packing(feature='text', seq_len=N, tokenize=...) to tokenise it as it loads, or convert the dataset "
           "with `python -m pipelines convert --tokenizer PATH --text-key text`")
    with pytest.raises(ValueError) as e:  # said at load, from the manifest's feature statistics
        loader.load(str(plain), batch_size=2, packing=loader.Packing("text", seq_len=64))
    assert str(e.value) == (f"Packing(feature='text') without tokenize= packs token ids, but {plain}'s 'text' holds "
                            f"bytes values: {fix}")
    manifest = json.loads((plain / "manifest.json").read_text())
    for shard in manifest["shards"]:
        del shard["feature_stats"]  # as a manifest written before they were recorded: said by the first record read
    (plain / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError) as e:
        next(iter(loader.load(str(plain), batch_size=2, packing=loader.Packing("text", seq_len=64))))
    assert f"feature 'text' holds bytes values, not token ids: {fix}" in str(e.value)
    assert "train-00000-of-00003.array_record" in str(e.value) and "record 0" in str(e.value), str(e.value)


def test_a_tokenizer_is_not_trained_on_token_ids(converted, tmp_path, capsys):
    """Following the "no feature 'text'" advice (--text_key tokens) trained a BPE on the ids' bytes, silently."""
    from trainer import tokenizer as command

    out, tok = converted
    for key in ("text", "tokens"):
        assert command.main([str(out), "--text_key", key, "--output", str(tmp_path / "t.json")]) == 2
        assert capsys.readouterr().err == (f"error: {out} is pre-tokenized (by {tok}): its records are token ids, not "
                                           "text; train on a conversion of the text without --tokenizer, or use that "
                                           "tokenizer\n")
    assert not (tmp_path / "t.json").exists()


def test_the_summary_counts_the_bytes_read_not_the_ids_written(corpus, tmp_path):
    root, tok = corpus
    outcome = _convert(root, tmp_path / "out", tok)
    read = sum(len(example_proto.encode_example({"text": t, "id": [i]})) for i, t in enumerate(TEXTS))
    assert outcome.record_bytes == read
    assert f"({len(TEXTS):,} records, {read / 1e6:,.1f} MB of record data read)" in outcome.summary()


def test_the_bench_times_packed_rows(converted, capsys):
    from loader.cli import main

    out, _ = converted
    assert main(["bench", str(out), "--packing", "64", "--batch_size", "4", "--start", "2", "--batches", "3",
                 "--step-time", "0.05"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("paced: a batch of 4 every 50.0 ms asks 80 rows of 64 tokens/s; after a start window of 2 "
                           "batches, "), text
    assert main(["bench", str(out), "--packing", "64", "--map", "images:224"]) == 2
    assert capsys.readouterr().err.strip().endswith("--packing times packed token rows: it takes no --image or --map")


def test_text_that_is_not_utf8_is_tokenised_with_replacement_characters_and_said(corpus, tmp_path, caplog):
    """A text of invalid UTF-8 (a web crawl has some) was tokenised as U+FFFD without a word; each shard now names
    its records of such text."""
    import logging

    root, tok = corpus
    texts = [b"plain ascii", b"caf\xc3\xa9 is UTF-8", b"bad \xff\xfe bytes", b"ok", b"\xc3 cut"]
    records = [example_proto.encode_example({"text": t}) for t in texts]
    write_tfrecord_shards(tmp_path / "raw", [records])
    config = ConvertConfig(input=str(tmp_path / "raw" / "*.tfrecord"), output=str(tmp_path / "out"), tokenizer=tok,
                           text_key="text")
    with caplog.at_level(logging.WARNING, logger="pipelines.shard"):
        assert run_conversion(config, ["--direct_num_workers=1"]).ok
    assert [r.getMessage() for r in caplog.records if "UTF-8" in r.getMessage()] == [
        f"{tmp_path / 'raw' / 'train-00000-of-00001.tfrecord'}: 2 record(s) hold text that is not UTF-8 (record 2, 4); "
        "each invalid byte was tokenised as U+FFFD, the replacement character"]
    ids = [r.tolist() for b in loader.load(str(tmp_path / "out"), batch_size=1, shuffle=False, num_epochs=1)
           for r in b["tokens"]]
    assert ids[2] == tokenizers.load(tok).encode_batch(["bad \ufffd\ufffd bytes"])[0].tolist()


def test_a_vocabulary_whose_ids_leave_gaps_is_sized_by_its_largest_id(tmp_path):
    """A WordLevel vocabulary numbering its tokens 0, 1, 70000 was 3 tokens (uint16 ids): the conversion met id 70000
    mid-pipeline and failed in a Beam traceback."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel({"[UNK]": 0, "hello": 1, "far": 70000}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(tmp_path / "sparse.json"))
    assert tokenizers.load(str(tmp_path / "sparse.json")).vocab_size == 70001
    records = [example_proto.encode_example({"text": t}) for t in (b"hello far", b"far far hello")]
    write_tfrecord_shards(tmp_path / "raw", [records])
    out = tmp_path / "out"
    assert run_conversion(ConvertConfig(input=str(tmp_path / "raw" / "*"), output=str(out),
                                        tokenizer=str(tmp_path / "sparse.json")), ["--direct_num_workers=1"]).ok
    assert json.loads((out / "manifest.json").read_text())["tokens"]["dtype"] == "<u4"
    got = [b["tokens"][0].tolist() for b in loader.load(str(out), batch_size=1, shuffle=False, num_epochs=1)]
    assert got == [[1, 70000], [70000, 70000, 1]]
