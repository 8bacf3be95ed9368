"""task=lm with model=transformer_lm: a byte-level language model on the Python standard library's own sources."""

import dataclasses
import json
import re

import numpy as np
import pytest

import loader
from pipelines.demo import stdlib_passages, unigram_bits_per_byte, write_text_tfrecords
from trainer import TrainConfig
from trainer.tasks import BOS, BYTE_OFFSET, LanguageModel
from tests.conftest import built_once
from tests.trainer.conftest import convert_splits, run_trainer, train_here, trainer_here


@pytest.fixture(scope="session")
def stdlib_text(tmp_path_factory):
    """1 MB of stdlib sources as text Examples, converted: {'train': dir, 'test': dir}."""
    def build(root):
        write_text_tfrecords(str(root / "tfrecord"), num_shards=2, max_bytes=1 << 20)
        return convert_splits(root, "text")

    return built_once(tmp_path_factory, "text", build)


def _metrics(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_bytes_become_padded_next_token_rows():
    task = LanguageModel.from_config(TrainConfig(data="x", workdir="w", task="lm", seq_len=6), {})
    assert task.model_kwargs() == {"vocab_size": 258, "max_len": 6}
    row = task.preprocess({"text": b"abc"})
    a, b, c = (ord(x) + BYTE_OFFSET for x in "abc")
    assert row["tokens"].tolist() == [BOS, a, b, 0, 0, 0]
    assert row["targets"].tolist() == [a, b, c, 0, 0, 0]
    assert row["segment_ids"].tolist() == [1, 1, 1, 0, 0, 0]
    long = task.preprocess({"text": b"abcdefghij"})  # cut to the first seq_len targets
    assert long["targets"].tolist() == [ord(x) + BYTE_OFFSET for x in "abcdef"]
    ids = LanguageModel("tokens", 4, 10, byte_level=False).preprocess({"tokens": np.array([3, 4, 5])})
    assert ids["tokens"].tolist() == [3, 4, 0, 0] and ids["targets"].tolist() == [4, 5, 0, 0]
    with pytest.raises(ValueError, match=r"'tokens' has token id 12 outside \[0, vocab_size=10\); raise vocab_size"):
        LanguageModel("tokens", 4, 10, byte_level=False).preprocess({"tokens": np.array([3, 12])})


def test_the_passages_split_on_lines_and_keep_every_byte():
    passages = stdlib_passages(max_bytes=1 << 20)
    assert all(0 < len(p) <= 256 for split in passages.values() for p in split)
    assert len(passages["train"]) > 5 * len(passages["test"]) > 0
    assert 4.0 < unigram_bits_per_byte(passages["test"]) < 5.5  # Python source: ~4.8 bits per byte


def _train_and_compare(stdlib_text, workdir, seq_len: int, steps: int) -> tuple[dict, float]:
    """Trains the LM; returns its summary and the unigram entropy of the eval bytes it predicted."""
    proc = run_trainer(f"data={stdlib_text['train']}", f"eval_data={stdlib_text['test']}", f"workdir={workdir}",
                       "task=lm", "model=transformer_lm", f"seq_len={seq_len}", "batch_size=16", f"steps={steps}",
                       "learning_rate=0.003", f"log_every={steps // 4}", f"eval_every={steps}",
                       f"checkpoint_every={steps}", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    test = loader.load(str(stdlib_text["test"]), batch_size=64, shuffle=False, num_epochs=1, drop_remainder=False)
    # The bytes it predicted: the first seq_len of each passage (BOS predicts the first).
    return json.loads(proc.stdout)["summary"], unigram_bits_per_byte(t[:seq_len] for b in test for t in b["text"])


def test_packed_evaluation_scores_every_token_of_eval_data_and_eval_steps_caps_it(stdlib_text, tmp_path, caplog):
    """packing=true: evaluation packs eval_data as training packs data, so every byte of every passage is scored (not
    each passage's first seq_len), the last batch short and padded; eval_steps takes the first batches only. A batch
    larger than all the rows evaluates them all."""
    from trainer import tasks, train
    from trainer.config import TrainConfig

    common = dict(data=str(stdlib_text["train"]), eval_data=str(stdlib_text["test"]), task="lm", packing=True,
                  seq_len=64, batch_size=8, steps=2, log_every=2, eval_every=2, checkpoint_every=2, width=32,
                  depth=1, heads=2)
    config = TrainConfig(workdir=str(tmp_path / "all"), **common)
    packing = tasks.make(config, {}).packing
    rows = loader.load(str(stdlib_text["test"]), batch_size=8, shuffle=False, num_epochs=1, packing=packing,
                       drop_remainder=False)
    real = sum(int((b["segment_ids"] > 0).sum()) for b in rows)
    passages = loader.load(str(stdlib_text["test"]), batch_size=64, shuffle=False, num_epochs=1, drop_remainder=False)
    assert real == sum(len(t) for b in passages for t in b["text"])  # each byte, predicted (the first from BOS)
    all_rows = rows.plan.layout.epoch_rows(0)
    assert all_rows % 8  # (a short last batch)
    caplog.clear()  # (the layouts above may have been logged)
    with caplog.at_level("INFO", logger="loader.planning.packing"):
        summary = train.train_and_evaluate(dataclasses.replace(config, steps=4))  # evaluations at steps 2 and 4
    assert summary["eval_examples"] == all_rows > 8
    laid_out = [m for m in caplog.messages if m.startswith("packing ") and "examples into rows" in m]
    assert len(laid_out) == 2, laid_out  # training's and eval_data's, the latter once for both evaluations
    capped = train.train_and_evaluate(TrainConfig(workdir=str(tmp_path / "two"), eval_steps=2, **common))
    assert capped["eval_examples"] == 16
    part = loader.load(str(stdlib_text["test"]), batch_size=8, split="[:5%]", shuffle=False, num_epochs=1,
                       packing=packing, drop_remainder=False).plan.layout.epoch_rows(0)
    assert 8 < part < 128
    big = train.train_and_evaluate(TrainConfig(workdir=str(tmp_path / "big"), eval_split="[:5%]",
                                               **{**common, "batch_size": 128}))
    assert big["eval_examples"] == part


def test_a_packed_lm_ramps_its_batch_up_with_remat_chosen_at_the_largest_batch(stdlib_text, tmp_path, caplog):
    """Rows of 64 tokens, 4 a batch for 2 steps, then 8: remat=auto chooses at the last size (compiled first), each
    size's step compiled once; the metrics rows say each step's size."""
    from trainer import train
    from trainer.config import TrainConfig

    config = TrainConfig(data=str(stdlib_text["train"]), workdir=str(tmp_path), task="lm", packing=True, seq_len=64,
                         batch_size=8, batch_size_start=4, batch_size_increment=4, rampup_samples=8, steps=4,
                         log_every=1, checkpoint_every=4, width=32, depth=1, heads=2)
    with caplog.at_level("INFO"):
        summary = train.train_and_evaluate(config)
    assert summary["final_step"] == 4
    rows = _metrics(tmp_path)
    assert [r["batch_size"] for r in rows] == [4, 4, 8, 8] and all(r["tokens_per_sec"] > 0 for r in rows)
    assert "remat=auto: elementwise" in caplog.text
    compiled = [m for m in caplog.messages if m.startswith("step compiled in") or "from the compilation cache" in m]
    assert len(compiled) == 2, compiled  # one step for 8 rows (the choice), one for 4, none again at step 3
    assert "step 3: batch_size=8 from here (the ramp-up)" in caplog.text


@pytest.mark.slow
def test_the_lm_beats_the_unigram_entropy_of_the_eval_bytes(stdlib_text, tmp_path):
    summary, unigram = _train_and_compare(stdlib_text, tmp_path, seq_len=128, steps=200)
    assert summary["eval_bits_per_byte"] < unigram - 0.75, (summary["eval_bits_per_byte"], unigram)
    assert summary["eval_loss"] == pytest.approx(summary["eval_bits_per_byte"] * np.log(2))
    records = _metrics(tmp_path)
    assert [r["step"] for r in records] == [50, 100, 150, 200] and records[-1]["loss"] < records[0]["loss"]
    assert "eval_bits_per_byte" in records[-1]


@pytest.mark.slow
def test_the_lm_on_whole_passages_beats_the_unigram_entropy_by_far(stdlib_text, tmp_path):
    summary, unigram = _train_and_compare(stdlib_text, tmp_path, seq_len=256, steps=800)
    assert summary["eval_bits_per_byte"] < unigram - 1.5, (summary["eval_bits_per_byte"], unigram)


@pytest.mark.slow
def test_lm_mirrored_over_8_devices_matches_one_device(stdlib_text, tmp_path):
    common = (f"data={stdlib_text['train']}", "task=lm", "model=transformer_lm", "seq_len=64", "batch_size=16",
              "steps=8", "log_every=1", "eval_every=100", "checkpoint_every=100", "learning_rate=0.003")
    one = train_here(*common, f"workdir={tmp_path / 'one'}", "strategy=default")
    many = run_trainer(*common, f"workdir={tmp_path / 'many'}", "strategy=mirrored", devices=8)
    assert one.returncode == 0 and many.returncode == 0, (one.stderr[-2000:], many.stderr[-2000:])
    a, b = [r["loss"] for r in _metrics(tmp_path / "one")], [r["loss"] for r in _metrics(tmp_path / "many")]
    assert len(a) == 8
    np.testing.assert_allclose(a, b, atol=1e-3)


def test_lm_over_an_int64_sequence_feature_trains(rich_tfds, tmp_path):
    proc = train_here(f"data={rich_tfds}", f"workdir={tmp_path}", "task=lm", "text_key=tokens", "vocab_size=256",
                       "model=transformer_lm", "seq_len=16", "batch_size=16", "steps=5", "log_every=5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "task=lm features=['tokens'] model=transformer_lm" in proc.stderr


def test_llamas_layout_trains_from_the_command_line_and_a_resume_without_it_names_it(stdlib_text, tmp_path):
    """num_kv_heads, rope, rmsnorm and SwiGLU by their MaxText names on packed text; a resume that drops one of them
    is one line naming it."""
    common = (f"data={stdlib_text['train']}", f"workdir={tmp_path}", "task=lm", "seq_len=64", "packing=true",
              "batch_size=8", "log_every=1", "learning_rate=0.003", "width=64", "heads=4", "position_embedding=rope",
              "normalization=rmsnorm", "mlp_activations=silu,linear", "mlp_dim=160")
    proc = train_here(*common, "num_kv_heads=2", "steps=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "attention: blockwise for queries 8x64x4x16 (2 key/value heads) float32" in proc.stderr
    assert ("model=transformer_lm parameters=120,770 (width=64 num_kv_heads=2 mlp_dim=160 mlp_activations=silu,linear "
            "normalization=rmsnorm position_embedding=rope)") in proc.stderr
    losses = [r["loss"] for r in _metrics(tmp_path)]
    assert len(losses) == 4 and losses[-1] < losses[0] - 1, losses  # it learns
    again = trainer_here(*common, "steps=6")
    assert again.returncode == 2, again.stderr[-2000:]
    assert again.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'checkpoints'} holds step 4 of a model other than this one (params['TransformerBlock_0']"
        "['MultiHeadDotProductAttention_0']['key']['bias'] is (2, 16) there and (4, 16) here, and 7 more arrays "
        "differ): resume with num_kv_heads=2 (what it was written with), or pass another workdir= to start afresh")


@pytest.mark.parametrize("overrides, message", [
    (("text_key=vec",), "error: task=lm needs a token-sequence feature (int64 ids, or text read as bytes), but 'vec' "
                        "is Tensor of float32"),
    (("text_key=tokens",), "error: 'tokens' holds token ids: pass vocab_size=N (ids must be < N)"),
    (("text_key=caption",), "error: task reads feature 'caption', which the data does not have; its features are "
                            "['image', 'label', 'meta', 'text', 'tokens', 'vec'] (set text_key=)"),
    # (a byte past the vocabulary was a NaN loss at the step that met it, "lower learning_rate")
    (("text_key=text", "vocab_size=130"), "error: vocab_size=130 is below byte-level text's 258 ids (PAD, BOS and a "
                                          "byte each: 'text' holds text, read as bytes); drop vocab_size=, or pass "
                                          "tokenizer="),
])
def test_lm_over_the_wrong_feature_is_one_line(rich_tfds, tmp_path, overrides, message):
    proc = trainer_here(f"data={rich_tfds}", f"workdir={tmp_path}", "task=lm", "model=transformer_lm", "steps=1",
                        *overrides)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_text_trained_without_task_lm_names_task_lm():
    """The default task (classification) over a pre-tokenized corpus, or text: the error's fix names task=lm."""
    from trainer.tasks import Classification

    for specs, what in (({"tokens": {"type": "Tokens", "dtype": "<u2", "vocab_size": 300}}, "pre-tokenized text"),
                        ({"text": {"type": "Text"}}, "text in 'text'")):
        with pytest.raises(ValueError, match=r"\(set image_key= / label_key=, or task=lm: the data is " + what +
                                             r"\)$"):
            Classification.from_config(TrainConfig(data="x", workdir="w"), specs)


def test_packed_examples_never_see_each_other():
    """Changing one example's tokens leaves the logits of the other examples in its row unchanged."""
    import jax

    from trainer.models import TransformerLM

    model = TransformerLM(vocab_size=50, max_len=12, width=32, depth=2, heads=2)
    segments = np.array([[1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 0, 0]])
    positions = np.array([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 0, 0]])
    tokens = np.array([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 0, 0]])
    params = model.init(jax.random.key(0), {"tokens": tokens, "segment_ids": segments, "positions": positions})

    def logits(t):
        return np.asarray(model.apply(params, {"tokens": t, "segment_ids": segments, "positions": positions}))

    changed = tokens.copy()
    changed[0, 4:7] = [40, 41, 42]  # the second example
    before, after = logits(tokens), logits(changed)
    others = (segments[0] == 1) | (segments[0] == 3)
    np.testing.assert_allclose(before[0, others], after[0, others], atol=1e-6)
    assert np.abs(before[0, 4:7] - after[0, 4:7]).max() > 1e-3  # the check can fail: the changed example moved


def test_packing_the_demo_text_wastes_under_ten_percent(stdlib_text):
    task = LanguageModel.from_config(TrainConfig(data="x", workdir="w", task="lm", seq_len=1024), {})
    batches = loader.load(str(stdlib_text["train"]), batch_size=8, packing=task.packing)
    assert batches.plan.efficiency(0) >= 0.90


@pytest.mark.slow
def test_packed_training_resumes_exactly(stdlib_text, tmp_path):
    """A packed run stopped at step 6 and resumed matches a straight run of 10 steps."""
    common = (f"data={stdlib_text['train']}", "task=lm", "model=transformer_lm", "seq_len=128", "packing=true",
              "batch_size=8", "log_every=1", "checkpoint_every=6", "learning_rate=0.003")
    straight = train_here(*common, "steps=10", f"workdir={tmp_path / 'straight'}")
    first = train_here(*common, "steps=6", f"workdir={tmp_path / 'resumed'}")
    second = train_here(*common, "steps=10", f"workdir={tmp_path / 'resumed'}")
    for proc in (straight, first, second):
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resumed from step 6 (loader at batch 6)" in second.stderr
    assert "real tokens" in straight.stderr  # the packing log line, with its efficiency
    a = [r["loss"] for r in _metrics(tmp_path / "straight")]
    b = [r["loss"] for r in _metrics(tmp_path / "resumed")]
    assert len(a) == len(b) == 10
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_packed_training_on_a_pretokenized_dataset_takes_its_vocabulary_and_counts(tmp_path):
    """`convert --tokenizer` output trains with packing=true and nothing else said: the ids, the vocabulary (the
    manifest's) and the token counts (the .counts files) are the converter's."""
    from dataset_format import tokenizer
    from pipelines import ConvertConfig, run_conversion

    passages = stdlib_passages(max_bytes=200_000)["train"]
    write_text_tfrecords(str(tmp_path / "raw"), num_shards=1, max_bytes=200_000)
    tok = tokenizer.train_bpe(passages, 300, str(tmp_path / "tokenizer.json"))
    run_conversion(ConvertConfig(input=str(tmp_path / "raw" / "text-train.tfrecord-*"), output=str(tmp_path / "tok"),
                                 tokenizer=tok, add_eos=True), ["--direct_num_workers=1"])
    proc = train_here(f"data={tmp_path / 'tok'}", "task=lm", "model=transformer_lm", "seq_len=64", "packing=true",
                       "batch_size=4", "steps=3", "log_every=1", f"workdir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "packing " in proc.stderr and "real tokens" in proc.stderr and "counted" not in proc.stderr
    corpus = loader.resolve(str(tmp_path / "tok"))
    assert (f"data: {corpus.token_count:,} tokens in {len(corpus):,} documents; 3 steps read 12 rows of 64 tokens, "
            f"~{12 * 64 / corpus.token_count:.2f} epochs of it") in proc.stderr, proc.stderr[-2000:]
    records = _metrics(tmp_path / "run")
    assert len(records) == 3
    # real tokens/s: at most every position of every row; no MFU on the CPU (no bf16 peak to measure it against)
    assert all(0 < r["tokens_per_sec"] <= r["examples_per_sec"] * 64 and "mfu" not in r for r in records)
    assert re.search(r"step 3/3 loss [\d.]+ [\d.]+ ex/s [\d,]+ tokens/s data-wait", proc.stderr), proc.stderr[-2000:]
    assert "attention: blockwise for queries 4x64x4x32 float32" in proc.stderr
    with pytest.raises(ValueError, match="the data is pre-tokenized"):
        LanguageModel.from_config(TrainConfig(data="x", workdir="w", task="lm", tokenizer=tok),
                                  {"tokens": {"type": "Tokens", "dtype": "<u2", "vocab_size": 300}})
    task = LanguageModel.from_config(TrainConfig(data="x", workdir="w", task="lm", seq_len=64),
                                     {"tokens": {"type": "Tokens", "dtype": "<u2", "vocab_size": 300}})
    assert (task.text_key, task.vocab_size, task.packing.tokenized) == ("tokens", 300, True)
