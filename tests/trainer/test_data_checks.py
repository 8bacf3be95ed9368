"""Labels checked over the whole dataset before step 1 (trainer/data_checks.py), `label_offset=`, and what a run says
about itself: an automatic choice, a finished run."""

import json
import logging
import shutil
import time

import pytest

import loader
from tests.trainer.conftest import train_here, trainer_here

ONE_BASED = "error: label_key='label' holds 1..10 over the 1,292 records of {data} ({how}), outside 0..9 " \
            "(num_classes=10): 1-based labels: pass label_offset=-1"


def _errors(proc) -> list[str]:
    """The error lines of a run (in-process runs may also show log records on stderr), none of them a traceback."""
    assert "Traceback" not in proc.stderr, proc.stderr
    return [line for line in proc.stderr.splitlines() if line.startswith("error: ")]


def _no_checkpoint(workdir) -> bool:
    return not (workdir / "checkpoints").exists() or not any((workdir / "checkpoints").iterdir())


def test_1_based_labels_with_a_rare_top_label_are_one_line_before_step_1(one_based, tmp_path):
    """ImageNet's case: labels 1..N with num_classes=N, label N in 1 of 1,292 records. The first batch does not hold
    it (so a first-batch check passes, and training turned NaN steps later); the manifest's range does."""
    first = next(iter(loader.load(str(one_based["train"]), batch_size=32, seed=0, features=("image", "label"))))
    assert first["label"].min() >= 1 and first["label"].max() < 10
    proc = trainer_here(f"data={one_based['train']}", f"workdir={tmp_path}", "num_classes=10", "batch_size=32",
                        "steps=50")
    assert proc.returncode == 2 and _errors(proc) == [ONE_BASED.format(data=one_based["train"], how="its manifest")]
    assert _no_checkpoint(tmp_path)


def test_without_recorded_ranges_the_labels_are_counted(one_based, tmp_path, caplog):
    """A manifest written before conversions recorded feature ranges: one pass over the label feature alone."""
    old = tmp_path / "old"
    shutil.copytree(one_based["train"], old)
    manifest = json.loads((old / "manifest.json").read_text())
    for shard in manifest["shards"]:
        del shard["feature_stats"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    trainer_log = logging.getLogger("trainer")
    trainer_log.addHandler(caplog.handler)  # (the in-process run sets the root logger's handlers aside)
    try:
        with caplog.at_level("INFO", logger="trainer"):
            proc = trainer_here(f"data={old}", f"workdir={tmp_path / 'run'}", "num_classes=10", "steps=50")
    finally:
        trainer_log.removeHandler(caplog.handler)
    assert proc.returncode == 2 and _errors(proc) == [ONE_BASED.format(data=old, how="counted")]
    assert "its manifest has no feature ranges (`python -m pipelines convert --force` records them)" in caplog.text
    assert _no_checkpoint(tmp_path / "run")


@pytest.mark.parametrize("offset", ["0", "-1"])
def test_eval_data_is_checked_too(one_based, digits, tmp_path, offset):
    """1-based training data, 0-based eval data: named before anything runs. Each one's own hint (label_offset=-1,
    then 0) sent the user back and forth: the line names both ranges and the setting that fits them both."""
    proc = trainer_here(f"data={one_based['train']}", f"eval_data={digits['test']}", f"workdir={tmp_path}",
                        "num_classes=10", f"label_offset={offset}", "steps=50")
    assert proc.returncode == 2 and _errors(proc) == [
        f"error: the run's data (data=, eval_data=) hold 'label' in different ranges ('{one_based['train']}' 1..10, "
        f"'{digits['test']}' 0..9), and label_offset={offset} applies to every one of them: label_offset=0 "
        "num_classes=11 puts them all in range; if they do not share one set of classes, relabel one (convert it "
        "with its labels shifted) instead"]


def test_an_empty_eval_data_is_named_before_anything_compiles(digits, tmp_path):
    """A converted eval_data whose shards are all empty: one line naming eval_data (it was found by the first
    evaluation, after compiling and training, with an error that named neither the key nor the path)."""
    from pipelines import ConvertConfig, run_conversion
    from tests.conftest import write_tfrecord_shards

    write_tfrecord_shards(tmp_path / "raw", [[], []])
    with pytest.raises(ValueError, match="holds no records"):  # the conversion says so too, and writes its manifest
        run_conversion(ConvertConfig(input=str(tmp_path / "raw" / "*.tfrecord"), output=str(tmp_path / "empty")),
                       ["--direct_num_workers=1"])
    proc = trainer_here(f"data={digits['train']}", f"eval_data={tmp_path / 'empty'}", f"workdir={tmp_path / 'run'}",
                        "model=mlp", "num_classes=10", "steps=5")
    assert proc.returncode == 2 and _errors(proc) == [
        f"error: eval_data={tmp_path / 'empty'} has no records (2 shard(s), all empty); check that the conversion "
        "finished and that its input had records"]
    assert "step compiled" not in proc.stderr and _no_checkpoint(tmp_path / "run")


def test_eval_data_with_other_feature_names_is_one_line_before_anything_compiles(digits, tmp_path):
    """Its features named like the training data's or not: checked on its first record at start (the first
    evaluation found it, after training, with the loader's advice on features=)."""
    import numpy as np

    from dataset_format.example_proto import encode_example
    from pipelines import ConvertConfig, run_conversion
    from tests.conftest import write_tfrecord_shards

    records = [encode_example({"img": np.arange(64), "lbl": np.array([i % 10])}) for i in range(20)]
    write_tfrecord_shards(tmp_path / "raw", [records])
    assert run_conversion(ConvertConfig(input=str(tmp_path / "raw" / "*.tfrecord"), output=str(tmp_path / "other")),
                          ["--direct_num_workers=1"]).ok
    proc = trainer_here(f"data={digits['train']}", f"eval_data={tmp_path / 'other'}", f"workdir={tmp_path / 'run'}",
                        "model=mlp", "num_classes=10", "steps=5")
    assert proc.returncode == 2 and _errors(proc) == [
        f"error: task reads feature 'image', which eval_data={tmp_path / 'other'} does not have; its features are "
        "['img', 'lbl']: data= and eval_data= need the same names (set image_key= / label_key= / text_key= to names "
        "both have, or convert it with them)"]
    assert "step compiled" not in proc.stderr and _no_checkpoint(tmp_path / "run")


@pytest.mark.parametrize("low, high, num_classes, offset, hint", [
    (1, 1000, 1000, 0, "1-based labels: pass label_offset=-1"),
    (0, 10, 10, 0, "set num_classes=11 (or check label_key=)"),
    (5, 9, 5, 0, "pass label_offset=-5 to start them at 0, or num_classes=10"),
    (-1, 3, 10, 0, "class ids must not be negative: pass label_offset=1"),
    (2, 11, 10, -1, "1-based labels: pass label_offset=-2"),
    (-5, 20, 10, 0, "class ids must not be negative, and they span more than num_classes: check label_key="),
])
def test_the_range_error_names_the_fix(low, high, num_classes, offset, hint):
    from trainer.tasks import Classification

    task = Classification("image", "label", num_classes, None, offset)
    with pytest.raises(ValueError) as e:
        task.check_range("label", low, high, " over the 5 records of D (its manifest)")
    assert str(e.value).endswith(hint), str(e.value)
    Classification("image", "label", 10, None, -1).check_range("label", 1, 10, "")  # in range once offset


def test_label_offset_trains_auto_workers_log_their_choice_and_a_finished_run_stops_at_once(one_based, tmp_path):
    args = (f"data={one_based['train']}", f"eval_data={one_based['validation']}", f"workdir={tmp_path}",
            "model=cnn", "num_classes=10", "label_offset=-1", "data_workers=auto", "steps=300", "batch_size=32",
            "log_every=100", "eval_every=300", "checkpoint_every=300", "learning_rate=0.003")
    proc = train_here(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)["summary"]
    assert summary["final_step"] == 300 and summary["eval_accuracy"] > 0.85, summary
    tuned = [line for line in proc.stderr.splitlines() if "loader.executors.tuning: loader workers: " in line]
    assert tuned and ("keeping threads here: the caller took " in tuned[0] or " -> " in tuned[0]), proc.stderr

    started = time.monotonic()
    again = train_here(*args)
    elapsed = time.monotonic() - started
    # (the one line below shows nothing was built; the bound only catches a wait, e.g. for the loader, under load)
    assert again.returncode == 0 and elapsed < 30, (elapsed, again.stderr)
    lines = again.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(
        f"INFO trainer.checkpoints: nothing to do: {tmp_path}/checkpoints holds a checkpoint at step 300 and steps=300; "
        "raise steps= to train on from it, or pass another workdir="), again.stderr
    assert json.loads(again.stdout)["summary"] == {"preempted": False, "final_step": 300, "already_finished": True}


def test_a_first_record_out_of_range_is_told_with_the_whole_datas_range(digits, tmp_path):
    """The first record's label alone gave the range and the fix (6..6: "set num_classes=7", or for other values
    "1-based labels: pass label_offset=-1"), which was wrong for the rest of the data."""
    first = next(iter(loader.load(str(digits["test"]), batch_size=1, shuffle=False, features=("label",))))
    assert first["label"].tolist() == [6]
    proc = trainer_here(f"data={digits['test']}", f"workdir={tmp_path}", "num_classes=5", "batch_size=32", "steps=2")
    assert proc.returncode == 2 and _errors(proc) == [
        f"error: label_key='label' holds 0..9 over the 359 records of {digits['test']} (its manifest), outside 0..4 "
        "(num_classes=5): set num_classes=10 (or check label_key=)"], proc.stderr[-2000:]
