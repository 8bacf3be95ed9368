"""Tasks and models by name or import path, on data with the features real datasets carry."""

import json
import textwrap

import numpy as np
import pytest

import loader
from dataset_format import tfds_info
from tests.conftest import REPO
from tests.trainer.conftest import run_trainer, train_here, trainer_here


def _losses(workdir):
    return [r["loss"] for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_feature_specs_read_the_tfds_metadata(rich_tfds):
    specs = tfds_info.feature_specs(tfds_info.read_features(str(rich_tfds)))
    assert specs == {"image": {"type": "Image", "dtype": "uint8", "shape": [8, 8, 1]},
                     "label": {"type": "ClassLabel", "num_classes": 10},
                     "text": {"type": "Text"}, "tokens": {"type": "Sequence"},
                     "vec": {"type": "Tensor", "dtype": "float32", "shape": [3]}, "meta": {"type": "FeaturesDict"}}


def test_the_loader_decodes_only_the_features_asked_for(rich_tfds):
    everything = next(iter(loader.load(str(rich_tfds), batch_size=4, shuffle=False)))
    assert sorted(everything) == ["image", "label", "meta", "text", "tokens", "vec"]
    assert isinstance(everything["tokens"], list)  # ragged: what broke device placement
    picked = next(iter(loader.load(str(rich_tfds), batch_size=4, shuffle=False, features=["label", "image"])))
    assert sorted(picked) == ["image", "label"]
    assert picked["image"].shape == (4, 8, 8, 1) and picked["label"].tolist() == everything["label"].tolist()
    with pytest.raises(ValueError, match=r"features must be a non-empty list of feature names \(got features='image'\)"):
        loader.load(str(rich_tfds), batch_size=4, features="image")


def test_a_nested_tfds_feature_is_selected_by_its_own_name(rich_tfds):
    """features= was checked against the tf.Example names (`meta/index`), which TFDS decodes as one nested `meta`:
    `meta` was refused at load() and `meta/index` failed at the first record. `meta` comes whole; `meta/index` is one
    line at load() naming `meta`."""
    batch = next(iter(loader.load(str(rich_tfds), batch_size=4, shuffle=False, features=["label", "meta"])))
    everything = next(iter(loader.load(str(rich_tfds), batch_size=4, shuffle=False)))
    assert sorted(batch) == ["label", "meta"]
    assert batch["meta"]["index"].tolist() == everything["meta"]["index"].tolist() and len(set(batch["label"])) > 1
    assert batch["meta"]["stats"]["mean"].shape == (4,)
    with pytest.raises(ValueError, match=r"records have no 'meta/index'; they have \['image', 'label', 'meta', 'text', "
                                         r"'tokens', 'vec'\] \(a TFDS dataset's nested features come whole, under "
                                         r"their top-level name\)"):
        loader.load(str(rich_tfds), batch_size=4, features=["meta/index"])


@pytest.mark.slow
def test_a_tfds_dataset_with_text_tensor_and_sequence_features_trains(rich_tfds, tmp_path):
    """num_classes comes from the ClassLabel; mirrored over 8 devices matches one device."""
    common = (f"data={rich_tfds}", f"eval_data={rich_tfds}", "task=classification", "model=mlp", "steps=20",
              "batch_size=32", "log_every=1", "eval_every=20", "checkpoint_every=100", "learning_rate=0.003")
    one = train_here(*common, f"workdir={tmp_path / 'one'}", "strategy=default")
    many = run_trainer(*common, f"workdir={tmp_path / 'many'}", "strategy=mirrored", devices=8)
    assert one.returncode == 0, one.stderr[-3000:]
    assert many.returncode == 0, many.stderr[-3000:]
    assert "task=classification features=['image', 'label'] model=mlp" in one.stderr
    assert "strategy=mirrored num_replicas_in_sync=8" in many.stderr
    a, b = _losses(tmp_path / "one"), _losses(tmp_path / "many")
    assert len(a) == len(b) == 20 and a[-1] < a[0]
    np.testing.assert_allclose(a, b, atol=1e-3)
    summary = json.loads(one.stdout)["summary"]
    assert summary["eval_examples"] == 200 and 0.0 <= summary["eval_accuracy"] <= 1.0


NETS = '''
import flax.linen as nn


class TwoLayer(nn.Module):
    """A user's own model: the trainer builds it with the task's keyword arguments."""
    num_classes: int
    width: int = 64

    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.Dense(self.width)(x.reshape((x.shape[0], -1))))
        return nn.Dense(self.num_classes)(x)


def small(num_classes):
    return TwoLayer(num_classes=num_classes, width=32)


def wrong_task(config, specs):
    return TwoLayer(num_classes=3)


not_a_model = 42
'''


def test_a_model_by_import_path_from_outside_the_project_trains_digits(digits, tmp_path):
    (tmp_path / "user" / "mynets").mkdir(parents=True)
    (tmp_path / "user" / "mynets" / "__init__.py").write_text("")
    (tmp_path / "user" / "mynets" / "nets.py").write_text(textwrap.dedent(NETS))
    proc = run_trainer(f"data={digits['train']}", f"eval_data={digits['test']}", f"workdir={tmp_path / 'run'}",
                       "model=mynets.nets:TwoLayer", "num_classes=10", "steps=300", "batch_size=32",
                       "learning_rate=0.003", "log_every=100", "eval_every=300", "checkpoint_every=300",
                       extra_env={"PYTHONPATH": f"{REPO}:{tmp_path / 'user'}"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["summary"]["eval_accuracy"] >= 0.85
    assert "model=mynets.nets:TwoLayer parameters=4,810" in proc.stderr  # 64*64+64 + 64*10+10


@pytest.mark.parametrize("overrides, message", [
    (("model=nosuch_pkg.nets:Net",), "error: model='nosuch_pkg.nets:Net': module 'nosuch_pkg.nets' does not import "
                                     "(ModuleNotFoundError: No module named 'nosuch_pkg')"),
    (("model=mynets.nets:Missing",), "error: model='mynets.nets:Missing': module 'mynets.nets' has no attribute "
                                     "'Missing'; it has ['TwoLayer', 'nn', 'not_a_model', 'small', 'wrong_task']"),
    (("model=mynets.nets:not_a_model",), "error: model='mynets.nets:not_a_model' is a int, not a flax.linen.Module"),
    (("model=mlp", "label_key=digit"), "error: task reads feature 'digit', which "),
    (("model=mlp", "task=mynets.nets:wrong_task"), "error: task='mynets.nets:wrong_task' returned a TwoLayer without"),
    (("model=mlp", "task=mynets.nets:small"), "error: task='mynets.nets:small' cannot be called as small(config, specs) "
                                              "(small() takes 1 positional argument but 2 were given)"),
    (("model=mlp", "task=regression"), "error: task='regression' is not one of ['classification', 'lm']"),
    (("model=resnet34",), "error: model='resnet34' is not one of ['cnn', 'mlp', 'resnet18', 'resnet50', 'transformer', "
                          "'transformer_lm'] (did you mean resnet50?); or name your own as model=package.module:attr"),
    (("model=cnn", "image_key=label"), "error: image_key='label' holds one number per example, not an image or a "
                                       "vector; set image_key= to the image (or feature-vector) feature"),
    (("model=mlp", "image_key=vec", "image_size=32"), "error: image_size=32 decodes and crops images, and feature "
                                                      "'vec' of "),
])
def test_bad_models_and_tasks_are_one_line_and_exit_2(rich_tfds, tmp_path, overrides, message):
    (tmp_path / "user" / "mynets").mkdir(parents=True)
    (tmp_path / "user" / "mynets" / "__init__.py").write_text("")
    (tmp_path / "user" / "mynets" / "nets.py").write_text(textwrap.dedent(NETS))
    proc = trainer_here(f"data={rich_tfds}", f"workdir={tmp_path / 'run'}", "steps=1", *overrides,
                        path=tmp_path / "user")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
    if "image_size=32" in overrides:
        assert proc.stderr.rstrip().endswith("holds float32 arrays of shape (3,), not pixels [H, W] or [H, W, C] or "
                                             "encoded JPEG/PNG bytes: drop image_size= to train on it as it is, or "
                                             "set image_key= to the image feature"), proc.stderr[-2000:]
    if "label_key=digit" in overrides:
        assert "its features are ['image', 'label', 'meta', 'text', 'tokens', 'vec']" in proc.stderr


def test_an_unlabelled_tfds_split_is_refused_before_a_step(rich_tfds, tmp_path):
    """A TFDS ClassLabel of -1 means "no label" (imagenet2012's test split, which eval_data= reads by default, holds
    only those). A ClassLabel was taken to be in range by construction: the run logged "each label in range",
    evaluated to eval_accuracy 0.0 and exited 0 (and -1 trained as the last class). The manifest's recorded range
    is checked now, with the split to pass."""
    proc = trainer_here(f"data={rich_tfds}", f"eval_data={rich_tfds}", "eval_split=unlabelled", "model=mlp",
                        f"workdir={tmp_path / 'run'}", "steps=1")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: label_key='label' holds -1..-1 over the 40 records of {rich_tfds} (its manifest): -1 is a TFDS "
        "ClassLabel's \"no label\", so split 'unlabelled' has unlabelled records (imagenet2012's test split has only "
        "those); train and evaluate on labelled splits (eval_data= reads the test split unless eval_split= names "
        "another, e.g. eval_split=validation)")
    assert "each label in range" not in proc.stderr


def test_custom_examples_without_metadata_need_num_classes(digits, tmp_path):
    proc = trainer_here(f"data={digits['train']}", f"workdir={tmp_path}", "model=mlp", "steps=1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "the data has no ClassLabel metadata for 'label' (not a TFDS dataset, or another feature type): pass " \
           "num_classes=N" in proc.stderr


def test_a_pretokenized_corpus_without_packing_is_warned_of(caplog):
    """Converted for packing (counts beside it), trained without it: each document cut to seq_len, said at INFO only."""
    from trainer import TrainConfig, tasks

    tokens = {"tokens": {"type": "Tokens", "dtype": "<u2", "vocab_size": 300, "tokenizer": "t.json (sha256:0)"}}
    for specs, packing, level in ((tokens, False, "WARNING"), (tokens, True, None), ({}, False, "INFO")):
        caplog.clear()
        with caplog.at_level("INFO", logger="trainer.tasks"):
            tasks.make(TrainConfig(data="x", workdir="w", task="lm", seq_len=64, packing=packing), specs)
        said = [r.levelname for r in caplog.records if "packing=false: each example is cut" in r.getMessage()]
        assert said == ([level] if level else []), (specs, packing, said)


def test_label_smoothing_trains_on_smoothed_labels_and_evaluates_on_the_labels(digits, tmp_path):
    """label_smoothing=0.1: the training loss of a batch is the cross-entropy against 0.9 x one-hot + 0.1 / 10, by
    hand from the model's log-probabilities; evaluation's loss is against the labels, as without it."""
    import jax
    import jax.numpy as jnp

    from trainer import TrainConfig
    from trainer.program import Program

    config = TrainConfig(data=str(digits["train"]), workdir=str(tmp_path), model="mlp", num_classes=10,
                         batch_size=32, label_smoothing=0.1)
    program = Program.build(config)
    batch = {k: jnp.asarray(v) for k, v in next(iter(program.load_train(num_epochs=1))).items()}
    params = program.init_variables()["params"]
    logp = np.asarray(jax.nn.log_softmax(program.outputs(params, batch)), np.float64)
    labels = np.asarray(batch["label"])
    want_train = -(0.9 * logp[np.arange(32), labels] + 0.1 * logp.mean(axis=1))
    loss_sum, (weight_sum, _) = program.loss_sums(params, batch)
    assert float(weight_sum) == 32
    np.testing.assert_allclose(float(loss_sum), want_train.sum(), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(program.task.losses(program.outputs(params, batch), batch)),
                               -logp[np.arange(32), labels], rtol=1e-5)
    plain = Program.build(TrainConfig(data=str(digits["train"]), workdir=str(tmp_path), model="mlp", num_classes=10,
                                      batch_size=32))
    np.testing.assert_allclose(float(plain.loss_sums(params, batch)[0]), -logp[np.arange(32), labels].sum(),
                               rtol=1e-5)
