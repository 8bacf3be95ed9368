"""task=lm tokenizer=PATH: a SentencePiece model and a Hugging Face BPE trained offline on the shipped text."""

import json
import re
import math

import numpy as np
import pytest

import subprocess
import sys

from pipelines.demo import stdlib_passages
from trainer import TrainConfig, tokenizer
from trainer.tasks import LanguageModel
from tests.conftest import REPO
from tests.trainer.conftest import run_trainer, train_here, trainer_here
from tests.trainer.test_lm import stdlib_text  # noqa: F401 - the fixture

VOCAB = 512


@pytest.fixture(scope="module")
def tokenizers(stdlib_text, tmp_path_factory):  # noqa: F811
    """{'bpe': tokenizer.json, 'sentencepiece': spm.model}, trained by `python -m trainer.tokenizer` on the converted
    1 MB of demo text (its train split)."""
    root = tmp_path_factory.mktemp("tokenizers")
    paths = {"bpe": str(root / "tokenizer.json"), "sentencepiece": str(root / "spm.model")}
    for kind, path in paths.items():
        proc = subprocess.run([sys.executable, "-m", "trainer.tokenizer", str(stdlib_text["train"]), "--kind", kind,
                               "--vocab_size", str(VOCAB), "--output", path], cwd=REPO, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"wrote a {kind} tokenizer of {VOCAB} tokens, trained on " in proc.stdout
    return paths


def test_training_a_tokenizer_on_a_missing_feature_is_one_line(stdlib_text, tmp_path):  # noqa: F811
    proc = subprocess.run([sys.executable, "-m", "trainer.tokenizer", str(stdlib_text["train"]), "--text_key", "body",
                           "--output", str(tmp_path / "t.json")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == f"error: {stdlib_text['train']} has no feature 'body' (its features are ['text']); pass " \
        "--text_key text\n"
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("args, last", [
    (["--vocab_size", "-5"], "error: --vocab_size -5 must be >= 259 (a bpe tokenizer holds the 256 bytes and 3 special "
                             "tokens)"),  # (an OverflowError traceback)
    (["--vocab_size", "10"], "error: --vocab_size 10 must be >= 259"),  # (259 tokens written without a word)
    (["--kind", "sentencepiece", "--vocab_size", "0", "--output", "t.model"], "error: --vocab_size 0 must be >= 1"),
    (["--max_bytes", "inf"], "error: --max_bytes inf must be a number of bytes >= 0 (0: all the text)"),
    (["--max_bytes", "nan"], "error: --max_bytes nan must be a number of bytes >= 0 (0: all the text)"),
    (["--output", "afile/t.json"], "error: --output afile/t.json: its directory cannot be made (File exists: "),
])
def test_bad_tokenizer_arguments_are_one_line_before_the_text_is_read(args, last, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("a file, not a directory")
    argv = ["no-such-source", "--output", "t.json", *args]
    assert tokenizer.main(argv) == 2  # (the source, read after the checks, does not exist)
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(last)


def test_the_tokenizer_command_says_what_it_wrote_and_refuses_what_cannot_work(stdlib_text, tmp_path, capsys):  # noqa: F811
    """The size written is the tokenizer's own (a small text gives fewer tokens than asked); an --output whose suffix
    names the other kind, and a SentencePiece vocabulary the text cannot give, are one line each."""
    source = str(stdlib_text["train"])
    assert tokenizer.main([source, "--vocab_size", "1000000", "--output", str(tmp_path / "big.json")]) == 0
    out, err = capsys.readouterr()
    size = tokenizer.load(str(tmp_path / "big.json")).vocab_size
    assert size < 1000000 and f"wrote a bpe tokenizer of {size:,} tokens" in out
    assert err == f"note: this text gives a bpe tokenizer {size:,} tokens, fewer than --vocab_size 1000000 asked " \
        "for; the converter and the trainer take the tokenizer's own size\n"
    assert tokenizer.main([source, "--kind", "sentencepiece", "--output", str(tmp_path / "sp.json")]) == 2
    assert capsys.readouterr().err.startswith(f"error: --output {tmp_path / 'sp.json'} must end in .model for "
                                              "--kind sentencepiece")
    assert tokenizer.main([source, "--kind", "sentencepiece", "--vocab_size", "1000000",
                           "--output", str(tmp_path / "sp.model")]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"error: sentencepiece cannot train vocab_size=1000000 on this text: this text gives at most "
                        r"(\d+) pieces \(set vocab_size to \1 or less, or train on more text\)\n", err), err
    assert tokenizer.main([source, "--kind", "sentencepiece", "--vocab_size", "100",
                           "--output", str(tmp_path / "sp.model")]) == 2
    err = capsys.readouterr().err  # sentencepiece's own fix names a flag (--character_coverage) we do not pass on
    assert re.fullmatch(r"error: sentencepiece cannot train vocab_size=100 on this text: the text's characters and the "
                        r"256 byte pieces need at least (\d+) \(set vocab_size to \1 or more\)\n", err), err
    assert not (tmp_path / "sp.model").exists()


@pytest.mark.parametrize("kind", ["bpe", "sentencepiece"])
def test_a_trained_tokenizer_round_trips_the_text_and_starts_with_bos(tokenizers, kind):
    tok = tokenizer.load(tokenizers[kind])
    assert tok.vocab_size == VOCAB
    texts = stdlib_passages(max_bytes=1 << 20)["test"][:50]  # held out from training
    assert len(texts) == 50
    ids = tok.encode_batch(texts)
    assert all(i[0] == 1 and i.dtype == np.int32 and i.max() < VOCAB for i in ids)
    decoded = tok._tok.decode_batch([i[1:].tolist() for i in ids]) if kind == "bpe" else \
        [tok._sp.Decode(i[1:].tolist()) for i in ids]
    assert decoded == [t.decode() for t in texts]
    assert sum(map(len, texts)) / sum(len(i) - 1 for i in ids) > 1.5  # compresses (bytes alone: 1 a token)
    task = LanguageModel.from_config(TrainConfig(data="x", workdir="w", task="lm", tokenizer=tokenizers[kind]), {})
    assert task.model_kwargs()["vocab_size"] == VOCAB
    one = task.tokenize(np.array([texts[0]], dtype=object))  # a decoded tf.Example's text
    assert one.tolist() == ids[0].tolist() == task.tokenize_batch([texts[0]])[0].tolist()


@pytest.mark.parametrize("kind, packing", [("bpe", "true"),
                                           pytest.param("sentencepiece", "false", marks=pytest.mark.slow)])
def test_the_lm_trains_with_a_tokenizer(stdlib_text, tokenizers, tmp_path, kind, packing):  # noqa: F811
    proc = train_here(f"data={stdlib_text['train']}", f"eval_data={stdlib_text['test']}", f"workdir={tmp_path}",
                      "task=lm", "model=transformer_lm", f"tokenizer={tokenizers[kind]}", f"packing={packing}",
                      "seq_len=64", "batch_size=16", "steps=60", "log_every=20", "eval_every=60",
                      "checkpoint_every=60", "learning_rate=0.003")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    summary = json.loads(proc.stdout)["summary"]
    assert losses[-1] < losses[0] and summary["eval_loss"] < math.log(VOCAB) - 1, (losses, summary)
    assert "bits_per_byte" not in summary


@pytest.mark.parametrize("name, content, message", [
    ("missing.model", None, "does not exist; pass a SentencePiece .model file or a Hugging Face tokenizer.json"),
    ("bad.model", b"not a model", "is not a SentencePiece model"),
    ("bad.json", b"{\"model\": 1}", "is not a Hugging Face tokenizer.json"),
])
def test_a_bad_tokenizer_is_one_line(stdlib_text, tmp_path, name, content, message):  # noqa: F811
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    proc = trainer_here(f"data={stdlib_text['train']}", f"workdir={tmp_path / 'w'}", "task=lm",
                        "model=transformer_lm", f"tokenizer={path}", "steps=1")
    assert proc.returncode == 2 and f"error: tokenizer={path} {message}" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_vocab_size_below_the_tokenizers_is_refused(tokenizers):
    with pytest.raises(ValueError, match=rf"vocab_size=100 is below the vocabulary of tokenizer=.* \({VOCAB}\)"):
        LanguageModel.from_config(TrainConfig(data="x", workdir="w", task="lm", tokenizer=tokenizers["bpe"],
                                              vocab_size=100), {})


# --- BOS and EOS: add_bos=, add_eos= -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Tokenizers of 512 tokens trained in-process on ~256 KB of the demo text: {'bpe': tokenizer.json (post-processor
    "<s> $A"), 'sentencepiece': .model, both <pad> 0, <s> 1, </s> 2}, and the texts."""
    root = tmp_path_factory.mktemp("small_tokenizers")
    passages = stdlib_passages(max_bytes=1 << 20)
    train, texts = passages["train"][:1500], [t.decode() for t in passages["test"][:20]]
    assert len(texts) == 20
    return {"bpe": tokenizer.train_bpe(train, VOCAB, str(root / "tokenizer.json")),
            "sentencepiece": tokenizer.train_sentencepiece(train, VOCAB, str(root / "spm.model")), "texts": texts}


def _library(kind: str, path: str, texts: list[str], special: bool) -> list[list[int]]:
    """The library's own ids, from a fresh object of its own: with its special tokens (SentencePiece: its add_bos
    option) or without."""
    if kind == "bpe":
        import tokenizers

        return [e.ids for e in tokenizers.Tokenizer.from_file(path).encode_batch(texts, add_special_tokens=special)]
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_file=path).encode(texts, add_bos=special)


@pytest.mark.parametrize("kind", ["bpe", "sentencepiece"])
def test_unset_bos_and_eos_give_the_librarys_own_ids(small, kind):
    ids = tokenizer.load(small[kind]).encode_batch(small["texts"])
    assert [i.tolist() for i in ids] == _library(kind, small[kind], small["texts"], special=True)
    assert all(i[0] == 1 and i[-1] != 2 for i in ids)  # BOS first, no EOS: as before these options


@pytest.mark.parametrize("kind", ["bpe", "sentencepiece"])
@pytest.mark.parametrize("add_bos, add_eos", [(True, True), (True, False), (False, True), (False, False),
                                              (None, True), (False, None)])
def test_bos_and_eos_as_asked(small, kind, add_bos, add_eos):
    tok = tokenizer.load(small[kind], add_bos=add_bos, add_eos=add_eos)
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    plain = _library(kind, small[kind], small["texts"], special=False)
    want_bos = add_bos is not False  # unset: the BOS both tokenizers add by themselves
    expected = [[1] * want_bos + p + [2] * bool(add_eos) for p in plain]
    assert [i.tolist() for i in tok.encode_batch(small["texts"])] == expected
    import pickle  # loader worker processes get the tokenizer pickled: the options travel with it

    again = pickle.loads(pickle.dumps(tok))
    assert [i.tolist() for i in again.encode_batch(small["texts"][:3])] == expected[:3]


def _retemplate(path: str, out, template: str | None, specials: list[str]) -> str:
    """A copy of the tokenizer.json at `path` whose post-processor is `template` (None: none)."""
    import tokenizers
    from tokenizers import processors

    tok = tokenizers.Tokenizer.from_file(path)
    tok.post_processor = None if template is None else processors.TemplateProcessing(
        single=template, special_tokens=[(s, tok.token_to_id(s)) for s in specials])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return str(out / "tokenizer.json")


def test_a_post_processor_that_adds_bos_and_eos_is_never_doubled(small, tmp_path):
    path = _retemplate(small["bpe"], tmp_path, "<s> $A </s>", ["<s>", "</s>"])
    texts = small["texts"]
    own = _library("bpe", path, texts, special=True)
    plain = _library("bpe", path, texts, special=False)
    assert all(o == [1] + p + [2] for o, p in zip(own, plain))
    for add_bos, add_eos, expected in [(None, None, own), (True, True, own), (True, False, [o[:-1] for o in own]),
                                       (False, True, [o[1:] for o in own]), (False, False, plain)]:
        ids = [i.tolist() for i in tokenizer.load(path, add_bos=add_bos, add_eos=add_eos).encode_batch(texts)]
        assert ids == expected, (add_bos, add_eos)


def test_the_tokens_come_from_tokenizer_config_json_beside_the_file(small, tmp_path):
    """GPT-2's way: no post-processor, `<|endoftext|>` for both, named in tokenizer_config.json."""
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(small["bpe"])
    tok.post_processor = None
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    path, texts = str(tmp_path / "tokenizer.json"), small["texts"][:5]
    end = tok.token_to_id("<|endoftext|>")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": None,
                                                                "eos_token": {"content": "<|endoftext|>"}}))
    plain = _library("bpe", path, texts, special=False)
    assert [i.tolist() for i in tokenizer.load(path).encode_batch(texts)] == plain
    assert [i.tolist() for i in tokenizer.load(path, add_eos=True).encode_batch(texts)] == [p + [end] for p in plain]
    with pytest.raises(tokenizer.TokenizerError) as e:
        tokenizer.load(path, add_bos=True)
    assert str(e.value) == (f"tokenizer={path} has no BOS token (the tokenizer_config.json beside it sets bos_token to "
                            "null); set add_bos=false, or name its BOS token as bos_token in a tokenizer_config.json "
                            "beside it")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|endoftext|>"}))
    ids = tokenizer.load(path, add_bos=True, add_eos=True).encode_batch(texts)
    assert [i.tolist() for i in ids] == [[end] + p + [2] for p in plain]  # EOS: </s>, found by its name


def test_a_model_directory_is_taken_as_its_tokenizer_file(small, tmp_path):
    """A Hugging Face model's directory (tokenizer.json, or a SentencePiece tokenizer.model, with tokenizer_config.json
    beside it) was an IsADirectoryError traceback in the converter and "does not exist" in the trainer."""
    import shutil

    from pipelines.tokens import TokenizeSpec

    texts = small["texts"][:3]
    for kind, name in (("bpe", "tokenizer.json"), ("sentencepiece", "tokenizer.model")):
        model = tmp_path / kind
        model.mkdir()
        shutil.copy(small[kind], model / name)
        (model / "config.json").write_text("{}")
        loaded = tokenizer.load(str(model))
        assert loaded.path == str(model / name)
        assert [i.tolist() for i in loaded.encode_batch(texts)] == \
            [i.tolist() for i in tokenizer.load(small[kind]).encode_batch(texts)]
        assert TokenizeSpec.of(str(model), "text").tokenizer == str(model / name)  # what the manifest records
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.safetensors").write_bytes(b"")
    for load, flag in ((tokenizer.load, "tokenizer="), (lambda p: TokenizeSpec.of(p, "text"), "--tokenizer ")):
        with pytest.raises(tokenizer.TokenizerError) as e:
            load(str(tmp_path / "weights"))
        assert str(e.value) == (f"{flag}{tmp_path / 'weights'} is a directory without a tokenizer.json or one .model "
                                "file (it holds ['model.safetensors']); pass the tokenizer file itself")


def test_a_missing_eos_is_one_line_naming_the_file_and_the_fix(small, tmp_path):
    import tokenizers
    import sentencepiece

    tok = tokenizers.Tokenizer.from_file(small["bpe"])
    json_path = str(tmp_path / "no_eos.json")
    tok.save(json_path)
    spec = json.loads(open(json_path).read())  # the tokenizer as train_bpe made it before it had </s>
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "</s>"]
    spec["model"]["vocab"] = {k: v for k, v in spec["model"]["vocab"].items() if k != "</s>"}
    open(json_path, "w").write(json.dumps(spec))
    with pytest.raises(tokenizer.TokenizerError) as e:
        tokenizer.load(json_path, add_eos=True)
    assert str(e.value) == (f"tokenizer={json_path} has no EOS token (none of </s>, <|end_of_text|>, <eos>, "
                            "<|endoftext|> is in its vocabulary); set add_eos=false, or name its EOS token as "
                            "eos_token in a tokenizer_config.json beside it")
    assert tokenizer.load(json_path).encode_batch(["x = 1"])[0][0] == 1  # unset: as before

    spm_path = str(tmp_path / "no_eos.model")
    sentencepiece.SentencePieceTrainer.Train(sentence_iterator=iter(small["texts"] * 20), model_prefix=spm_path[:-6],
                                             vocab_size=400, eos_id=-1, byte_fallback=True, minloglevel=2)
    with pytest.raises(tokenizer.TokenizerError) as e:
        tokenizer.load(spm_path, add_eos=True)
    assert str(e.value) == (f"tokenizer={spm_path} has no EOS token (its eos_id() is -1); set add_eos=false, or train "
                            "it with eos_id= set (train_sentencepiece gives bos_id=1, eos_id=2)")


def test_add_eos_reaches_the_lm_tasks_tokens(small):
    config = TrainConfig(data="x", workdir="w", task="lm", tokenizer=small["sentencepiece"], add_eos=True, seq_len=8)
    task = LanguageModel.from_config(config, {})
    one = task.tokenize(np.array([small["texts"][0].encode()], dtype=object))
    assert one[0] == 1 and one[-1] == 2 and (one == 2).sum() == 1
    assert [i.tolist() for i in task.tokenize_batch([small["texts"][0]])] == [one.tolist()]
    row = LanguageModel.from_config(config, {}).preprocess({"text": b"x"})  # short: the row's last target is EOS
    assert row["targets"][row["segment_ids"] == 1][-1] == 2


@pytest.mark.parametrize("key", ["add_bos=false", "add_eos=true"])
def test_bos_and_eos_options_without_a_tokenizer_are_refused(key):
    name, _, value = key.partition("=")
    with pytest.raises(ValueError) as e:
        TrainConfig.from_args(["data=x", "workdir=w", "task=lm", key])
    assert str(e.value) == (f"{name}={value} applies to text tokenised by tokenizer=; byte-level text always begins "
                            f"with BOS and has no EOS, token ids are read as they are (a pre-tokenized dataset's "
                            f"have the BOS and EOS its conversion gave them: convert --{name.replace('_', '-')}): "
                            f"drop {name}=, or pass tokenizer= with text data")


def test_the_tokenizer_module_imports_without_jax(small):
    """The Beam converter tokenises with it: loaded on its own (not through trainer/__init__.py), it brings no JAX."""
    code = ("import importlib.util, sys\n"
            "spec = importlib.util.spec_from_file_location('tokenizer', 'dataset_format/tokenizer.py')\n"
            "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
            f"ids = module.load({small['bpe']!r}, add_eos=True).encode_batch(['x = 1'])[0]\n"
            "print(ids[0], ids[-1], sorted(m for m in ('jax', 'flax', 'optax', 'grain') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["1", "2", "[]"]


@pytest.fixture(scope="module")
def numbered_text(tmp_path_factory):
    """400 documents, "document 0000 ..." to "document 0399 ...", 100 bytes each, converted as one dataset."""
    from dataset_format import example_proto
    from pipelines import ConvertConfig, run_conversion, tfrecord

    root = tmp_path_factory.mktemp("numbered")
    texts = [f"document {i:04d} ".encode() + bytes([97 + i % 26]) * 86 for i in range(400)]
    for shard in range(2):
        with open(root / f"text.tfrecord-{shard:05d}-of-00002", "wb") as f:
            tfrecord.write_records(f, (example_proto.encode_example({"text": t}) for t in texts[shard::2]))
    run_conversion(ConvertConfig(input=str(root / "text.tfrecord-*"), output=str(root / "out")),
                   ["--direct_num_workers=1"])
    return root / "out", texts


def test_a_large_corpus_is_sampled_uniformly_and_the_same_for_the_same_seed(numbered_text, tmp_path, capsys):
    """Past --max_bytes the tokenizer trains on the documents a seeded global shuffle puts first: spread over the
    whole corpus (not its first shard), without repeats, the same documents for the same seed."""
    source, texts = numbered_text
    everything, documents = tokenizer.sample_texts(str(source), "text", max_bytes=0)
    assert documents == 400 and sorted(everything) == sorted(texts)

    def ids(seed):
        sample, _ = tokenizer.sample_texts(str(source), "text", max_bytes=5_000, seed=seed)
        return [int(t[9:13]) for t in sample]

    sample = ids(0)
    assert len(sample) == 50 == len(set(sample))  # 5,000 bytes of 100-byte documents
    assert sample[:8] == [168, 329, 20, 178, 318, 68, 137, 209]
    assert ids(0) == sample and ids(1) != sample
    assert min(sample) < 40 and max(sample) > 360
    assert tokenizer.main([str(source), "--max_bytes", "5000", "--output", str(tmp_path / "t.json")]) == 0
    assert ("trained on 50 texts (5,000 bytes: a uniform sample of the 400 documents, --max_bytes 5000), to "
            in capsys.readouterr().out)
    assert tokenizer.main([str(source), "--max_bytes", "-1", "--output", str(tmp_path / "t.json")]) == 2
    assert capsys.readouterr().err.strip() == "error: --max_bytes -1 must be a number of bytes >= 0 (0: all the text)"
