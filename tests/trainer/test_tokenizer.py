"""task=lm tokenizer=PATH: a SentencePiece model and a Hugging Face BPE trained offline on the shipped text."""

import json
import math

import numpy as np
import pytest

import subprocess
import sys

from pipelines.demo import stdlib_passages
from trainer import TrainConfig, tokenizer
from trainer.tasks import LanguageModel
from tests.conftest import REPO
from tests.trainer.conftest import run_trainer
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
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "body" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "t.json").exists()


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


@pytest.mark.parametrize("kind, packing", [("bpe", "true"), ("sentencepiece", "false")])
def test_the_lm_trains_with_a_tokenizer(stdlib_text, tokenizers, tmp_path, kind, packing):  # noqa: F811
    proc = run_trainer(f"data={stdlib_text['train']}", f"eval_data={stdlib_text['test']}", f"workdir={tmp_path}",
                       "task=lm", "model=transformer_lm", f"tokenizer={tokenizers[kind]}", f"packing={packing}",
                       "seq_len=64", "batch_size=16", "steps=60", "log_every=20", "eval_every=60",
                       "checkpoint_every=60", "learning_rate=0.003", timeout=600)
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
    proc = run_trainer(f"data={stdlib_text['train']}", f"workdir={tmp_path / 'w'}", "task=lm", "model=transformer_lm",
                       f"tokenizer={path}", "steps=1")
    assert proc.returncode == 2 and f"error: tokenizer={path} {message}" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_vocab_size_below_the_tokenizers_is_refused(tokenizers):
    with pytest.raises(ValueError, match=rf"vocab_size=100 is below the vocabulary of tokenizer=.* \({VOCAB}\)"):
        LanguageModel.from_config(TrainConfig(data="x", workdir="w", task="lm", tokenizer=tokenizers["bpe"],
                                              vocab_size=100), {})
