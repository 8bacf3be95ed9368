"""`python -m pipelines tokenizer`: a tokenizer trained on TFRecord shards of text before any conversion, on a sample
drawn by shard (pipelines/text_sample.py), local, gzip and gs://; what `convert --tokenizer` then takes."""

import gzip

import pytest

from dataset_format import example_proto, tokenizer
from pipelines import cli, tfrecord, text_sample

SHARDS, PER_SHARD = 6, 50


def _text(shard: int, doc: int) -> bytes:
    return f"shard {shard} doc {doc:02d} ".encode() + bytes([97 + (shard * 7 + doc) % 26]) * 85  # 100 bytes


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Six shards of 50 documents of 100 bytes each: "shard S doc DD ..."."""
    root = tmp_path_factory.mktemp("raw")
    for s in range(SHARDS):
        with open(root / f"text.tfrecord-{s:05d}-of-{SHARDS:05d}", "wb") as f:
            tfrecord.write_records(f, (example_proto.encode_example({"text": _text(s, d)})
                                       for d in range(PER_SHARD)))
    return root


def _where(texts):
    return [(int(t.split()[1]), int(t.split()[3])) for t in texts]


def test_all_the_text_or_the_first_share_of_each_shard(shards):
    everything = text_sample.sample_texts(str(shards / "text.tfrecord-*"), "text", max_bytes=0)
    assert sorted(everything.texts) == sorted(_text(s, d) for s in range(SHARDS) for d in range(PER_SHARD))
    assert everything.describe(0) == ""
    sample = text_sample.sample_texts(str(shards / "text.tfrecord-*"), "text", max_bytes=1_200)
    assert sorted(_where(sample.texts)) == [(s, d) for s in range(SHARDS) for d in (0, 1)]  # 200 bytes a shard
    assert sample.describe(1_200) == ": the first ~200 bytes of text of each of the 6 shards, --max_bytes 1200"


def test_several_inputs_are_sampled_together(shards):
    """`tokenizer --input A --input B`: one tokenizer for a mixture's corpora, each shard once."""
    first, rest = str(shards / "text.tfrecord-0000[0-1]*"), str(shards / "text.tfrecord-*")
    both = text_sample.sample_texts([first, rest], "text", max_bytes=0)
    assert sorted(both.texts) == sorted(_text(s, d) for s in range(SHARDS) for d in range(PER_SHARD))
    assert both.shards == SHARDS


def test_past_max_shards_a_seeded_draw_of_shards(shards, monkeypatch):
    monkeypatch.setattr(text_sample, "MAX_SHARDS", 3)

    def drawn(seed):
        sample = text_sample.sample_texts(str(shards / "text.tfrecord-*"), "text", max_bytes=300, seed=seed)
        return sample, [s for s, _ in _where(sample.texts)]

    sample, order = drawn(0)
    assert order == [3, 2, 5] and _where(sample.texts) == [(3, 0), (2, 0), (5, 0)]
    assert drawn(0)[1] == order and drawn(1)[1] != order
    assert sample.describe(300) == (": the first ~100 bytes of text of each of 3 of the 6 shards, drawn at random, "
                                    "--max_bytes 300")


def test_the_command_trains_what_convert_takes_from_gzip_shards(shards, tmp_path, capsys):
    raw = tmp_path / "gz"
    raw.mkdir()
    for path in sorted(shards.iterdir()):
        (raw / f"{path.name}.gz").write_bytes(gzip.compress(path.read_bytes()))
    output = tmp_path / "tok" / "tokenizer.json"
    assert cli.main(["tokenizer", "--input", str(raw), "--vocab_size", "300", "--output", str(output),
                     "--max_bytes", "6000"]) == 0
    assert ("wrote a bpe tokenizer of 300 tokens, trained on 60 texts (6,000 bytes: the first ~1,000 bytes of text of "
            f"each of the 6 shards, --max_bytes 6000), to {output}") in capsys.readouterr().out
    import tokenizers

    ids = tokenizer.load(str(output)).encode_batch([_text(3, 7)])[0]
    assert ids[0] == 1 and tokenizers.Tokenizer.from_file(str(output)).decode(ids.tolist()) == _text(3, 7).decode()


@pytest.mark.parametrize("argv, message", [
    (["--text-key", "body"], ": record 0 has no feature 'body' (it has ['text']); pass its text feature as "
                             "--text-key"),
    (["--kind", "sentencepiece"], "must end in .model for --kind sentencepiece"),
])
def test_a_bad_flag_is_one_line(shards, tmp_path, capsys, argv, message):
    assert cli.main(["tokenizer", "--input", str(shards / "text.tfrecord-*"), "--output", str(tmp_path / "t.json"),
                     *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and message in err, err


def test_a_converted_input_is_sent_to_the_tokenizer_that_reads_it(tmp_path, capsys):
    """A converted directory's text is in ArrayRecord: trainer.tokenizer reads it (the error said to load it, or to
    pass the TFRecords)."""
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "manifest.json").write_text("{}")
    assert cli.main(["tokenizer", "--input", str(tmp_path / "ds"), "--output", str(tmp_path / "t.json")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --input {tmp_path / 'ds'} is a converted dataset (ArrayRecord), and this command reads "
        f"TFRecords: `python -m trainer.tokenizer {tmp_path / 'ds'}` with the same options trains one on its text")


def test_empty_shards_train_no_tokenizer(tmp_path, capsys):
    for s in range(2):
        (tmp_path / f"text.tfrecord-{s:05d}-of-00002").write_bytes(b"")
    assert cli.main(["tokenizer", "--input", str(tmp_path / "text.tfrecord-*"), "--output",
                     str(tmp_path / "t.json")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --input {tmp_path / 'text.tfrecord-*'}: its 2 shard(s) hold no records, so there is no text to "
        "train a tokenizer on")
    assert not (tmp_path / "t.json").exists()


@pytest.mark.gcs
def test_gs_shards(shards, tmp_path, gcs_bucket):
    bucket, client = gcs_bucket
    for path in sorted(shards.iterdir()):
        client.bucket(bucket).blob(f"raw/{path.name}").upload_from_filename(str(path))
    sample = text_sample.sample_texts(f"gs://{bucket}/raw/", "text", max_bytes=600)
    assert sorted(_where(sample.texts)) == [(s, 0) for s in range(SHARDS)]


@pytest.mark.gcs
def test_a_sample_of_gs_shards_downloads_about_what_it_reads(tmp_path, gcs_bucket, monkeypatch):
    """Each shard's first bytes only: the sniff of its compression is one 12-byte range, its records come in ranges
    of about its share (Beam's reader asked for 16 MB at a time: a 100 MB sample of 1,024 shards, 16 GB). The ranges
    are read off the requests the clients send."""
    import requests

    bucket, client = gcs_bucket
    for s in range(3):
        path = tmp_path / f"big.tfrecord-{s:05d}-of-00003"
        with open(path, "wb") as f:  # 2 MB a shard
            tfrecord.write_records(f, (example_proto.encode_example({"text": _text(s, d % 100)})
                                       for d in range(20_000)))
        client.bucket(bucket).blob(f"big/{path.name}").upload_from_filename(str(path))
    media = []
    send = requests.Session.send

    def recorded(session, request, **kwargs):
        if "alt=media" in request.url:
            media.append(request.headers.get("Range"))
        return send(session, request, **kwargs)

    monkeypatch.setattr(requests.Session, "send", recorded)
    sample = text_sample.sample_texts(f"gs://{bucket}/big/", "text", max_bytes=3_000)
    assert len(sample.texts) == 30
    assert None not in media and len(media) >= 3, media  # every download a range
    sizes = [int(b) - int(a) + 1 for a, b in (r.split("=")[1].split("-") for r in media)]
    assert sum(sizes) <= 3 * (12 + (256 << 10) + 1), (media, sizes)  # + 1: the client asks for one byte more


def test_the_demo_text_has_both_splits_at_any_size():
    """`make-demo --kind text --max_mb 0.3`: the first files of the stdlib all went to train, and test was empty."""
    from pipelines.demo import stdlib_passages

    small = stdlib_passages(max_bytes=100_000)
    assert small["train"] and small["test"]
    assert all(len(p) <= 256 for ps in small.values() for p in ps)
