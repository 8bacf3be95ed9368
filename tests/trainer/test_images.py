"""The trainer on encoded images (JPEG bytes in the ImageNet TFRecord layout): decode and crop in the loader,
models with BatchNorm state (ResNets), under the synchronous strategies and through checkpoints."""

import json
import re

import numpy as np
import orbax.checkpoint as ocp
import pytest

from pipelines.demo import write_digits_jpeg_tfrecords
from tests.conftest import built_once
from tests.trainer.conftest import convert_splits, run_trainer, train_here, trainer_here

IMAGENET_KEYS = ("image_key=image/encoded", "label_key=image/class/label", "num_classes=10")


@pytest.fixture(scope="session")
def digits_jpeg(tmp_path_factory):
    """The digits as 32x32 JPEGs in the ImageNet TFRecord layout, converted: {'train': dir, 'test': dir}."""
    def build(root):
        write_digits_jpeg_tfrecords(str(root / "tfrecord"), num_shards=2)
        return convert_splits(root, "digits-jpeg")

    return built_once(tmp_path_factory, "digits-jpeg", build)


def _metrics(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _state(workdir):
    import jax

    handlers = {"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler()}
    with ocp.CheckpointManager(str(workdir / "checkpoints"), item_handlers=handlers) as mngr:
        step = mngr.latest_step()
        meta = mngr.item_metadata(step)["state"]
        target = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), meta)
        return step, mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                                 data=ocp.args.JsonRestore()))["state"]


def _run(data, workdir, *extra, devices=1):
    """The trainer on `data` with a small BatchNorm model: in this process on one device, else in a process of its
    own with `devices` CPU devices."""
    args = (f"data={data['train']}", f"eval_data={data['test']}", f"workdir={workdir}", *IMAGENET_KEYS, "image_size=16",
            "batch_size=32", "learning_rate=0.01", "model=tests.trainer.bn_model:TinyBN", *extra)
    return train_here(*args) if devices == 1 else run_trainer(*args, devices=devices)


def test_resnets_have_the_reference_parameter_counts():
    """ResNet-18 and -50 with 1000 classes have torchvision's parameter counts (11,689,512 and 25,557,032) and keep
    BatchNorm statistics beside them."""
    import jax
    import jax.numpy as jnp

    from trainer.models import resnet18, resnet50

    for make, params, stats in ((resnet18, 11_689_512, 9_600), (resnet50, 25_557_032, 53_120)):
        shapes = jax.eval_shape(lambda: make(1000).init(jax.random.key(0), jnp.zeros((1, 224, 224, 3))))
        assert sorted(shapes) == ["batch_stats", "params"]
        assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes["params"])) == params
        assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes["batch_stats"])) == stats


def test_batchnorm_statistics_train_checkpoint_and_match_across_device_counts(digits_jpeg, tmp_path):
    one = _run(digits_jpeg, tmp_path / "one", "steps=12", "log_every=1", "eval_every=12", "checkpoint_every=6")
    many = _run(digits_jpeg, tmp_path / "many", "steps=12", "log_every=1", "eval_every=12", "checkpoint_every=6",
                "strategy=mirrored", devices=8)
    assert one.returncode == 0 and many.returncode == 0, (one.stderr[-3000:], many.stderr[-3000:])
    # BatchNorm normalises over the global batch in both: the same losses for 1 device and 8
    np.testing.assert_allclose([r["loss"] for r in _metrics(tmp_path / "many")],
                               [r["loss"] for r in _metrics(tmp_path / "one")], rtol=2e-4)
    step, state = _state(tmp_path / "one")
    assert step == 12 and sorted(state) == ["model_state", "opt_state", "params", "step"]
    stats = state["model_state"]["batch_stats"]["BatchNorm_0"]
    assert stats["mean"].shape == (8,) and np.abs(stats["mean"]).sum() > 0  # moved off their zero start
    np.testing.assert_allclose(_state(tmp_path / "many")[1]["model_state"]["batch_stats"]["BatchNorm_0"]["var"],
                               stats["var"], rtol=1e-3)
    first = _metrics(tmp_path / "one")[-1]
    assert 0 < first["eval_accuracy"] <= 1 and first["eval_examples"] == 359

    # Resume from step 6's checkpoint (statistics restored with the parameters): the same losses as straight on.
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    (tmp_path / "one" / "checkpoints").rename(resumed_dir / "checkpoints")
    import shutil

    shutil.rmtree(resumed_dir / "checkpoints" / "12")
    resumed = _run(digits_jpeg, resumed_dir, "steps=12", "log_every=1", "eval_every=12", "checkpoint_every=6")
    assert resumed.returncode == 0 and "resumed from step 6" in resumed.stderr, resumed.stderr[-3000:]
    assert [r["loss"] for r in _metrics(resumed_dir)] == [r["loss"] for r in _metrics(tmp_path / "one")][6:]
    assert _metrics(resumed_dir)[-1]["eval_accuracy"] == first["eval_accuracy"]


def test_encoded_images_without_image_size_say_what_to_set(digits_jpeg, tmp_path):
    proc = trainer_here(f"data={digits_jpeg['train']}", f"workdir={tmp_path}", *IMAGENET_KEYS, "model=cnn", "steps=2")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: feature 'image/encoded' of {digits_jpeg['train']} holds bytes values, not numbers the model can "
        "take (encoded images: pass image_size=, e.g. image_size=224, to decode and crop them)")


def test_the_loaders_limits_are_keys_of_the_trainer(digits_jpeg, tmp_path):
    """max_pixels=, max_record_bytes= and check_hashes= reach the image ops and the loader, so the fixes their errors
    name can be applied to `python -m trainer` (they were unknown keys)."""
    common = (f"data={digits_jpeg['train']}", *IMAGENET_KEYS, "model=cnn", "image_size=16", "steps=2", "batch_size=8")
    small = trainer_here(*common, f"workdir={tmp_path / 'pixels'}", "max_pixels=100")
    last = small.stderr.strip().splitlines()[-1]
    assert small.returncode == 2 and re.search(r"an image declaring 32x32 = 1,?024 pixels, over max_pixels=100 \(a "
                                               r"decompression bomb\?\); pass a larger max_pixels=", last), last
    record = trainer_here(*common, f"workdir={tmp_path / 'bytes'}", "max_record_bytes=10")
    last = record.stderr.strip().splitlines()[-1]
    assert record.returncode == 1 and re.search(r"record 0 is \d+ bytes, over max_record_bytes=10; if the records are "
                                                r"genuine, pass a larger max_record_bytes= \(to loader.load, or python "
                                                r"-m trainer;", last), last
    ran = train_here(*common, f"workdir={tmp_path / 'ran'}", "max_pixels=1024", "check_hashes=false")
    assert ran.returncode == 0, ran.stderr[-3000:]
    # the defaults are the loader's own
    import dataclasses

    from loader.decoding.images import MAX_IMAGE_PIXELS
    from loader.fetch.reader import MAX_RECORD_BYTES
    from trainer import TrainConfig

    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    assert (defaults["max_pixels"], defaults["max_record_bytes"], defaults["check_hashes"]) == (
        MAX_IMAGE_PIXELS, MAX_RECORD_BYTES, True)


@pytest.mark.slow
def test_resnet18_learns_the_digits_from_jpeg_under_mirrored(digits_jpeg, tmp_path):
    """The documented result (docs/training.md, "Images"): ResNet-18, 200 steps of 64, 8 simulated devices, >= 85%."""
    proc = run_trainer(f"data={digits_jpeg['train']}", f"eval_data={digits_jpeg['test']}", f"workdir={tmp_path}",
                       *IMAGENET_KEYS, "model=resnet18", "strategy=mirrored", "image_size=32", "steps=200",
                       "batch_size=64", "learning_rate=0.002", "log_every=50", "eval_every=200",
                       "checkpoint_every=200", devices=8, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _metrics(tmp_path)[-1]["eval_accuracy"] >= 0.85
    assert "batch_stats" in _state(tmp_path)[1]["model_state"]
