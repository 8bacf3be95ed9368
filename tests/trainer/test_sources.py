"""The run's setup in one pass: each source's metadata read once, the task, the first record and the model made once,
whatever the run evaluates or checks afterwards."""

import collections
import functools

import numpy as np
import pytest

import loader
from trainer import data_checks, models, sources, tasks, train
from trainer.config import TrainConfig
from trainer.program import Program


def _counted(monkeypatch, calls, module, name, key=lambda *a, **k: None):
    original = getattr(module, name)

    @functools.wraps(original)
    def counted(*args, **kwargs):
        calls[(name, key(*args, **kwargs))] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


def test_each_setup_step_runs_once_per_run(digits, tmp_path, monkeypatch):
    """A run that evaluates three times and checks its labels' range: every setup function is called once (per
    source, where it takes one), and nothing reads a source's metadata again after the setup: each source's manifest
    is read into shards (and every shard stat'ed) once, not by each check, the training loader and each evaluation."""
    from loader.format import source as loader_source

    calls = collections.Counter()
    for module, name, key in [
        (sources, "resolve", lambda config: None),
        (sources, "source_split", lambda path, default: path),
        (sources, "_feature_specs", lambda path: path),
        (sources, "first_record", lambda source, task: source.path),
        (loader_source, "_from_manifest", lambda root, *a: str(root)),
        (tasks, "make", lambda config, specs: None),
        (models, "make", lambda name, kwargs: name),
        (data_checks, "check_ranges", lambda task, config, found: tuple(s.path for s in found)),
    ]:
        _counted(monkeypatch, calls, module, name, key)
    build = Program.build.__func__
    monkeypatch.setattr(Program, "build", classmethod(
        lambda cls, config, data=None: (calls.update([("Program.build", None)]), build(cls, config, data))[1]))

    train_dir, test_dir = str(digits["train"]), str(digits["test"])
    config = TrainConfig(data=train_dir, eval_data=test_dir, workdir=str(tmp_path), model="mlp", steps=6,
                         batch_size=32, num_classes=10, log_every=3, eval_every=2, checkpoint_every=100)
    summary = train.train_and_evaluate(config)

    assert summary["final_step"] == 6 and np.isfinite(summary["eval_loss"])
    assert dict(calls) == {
        ("Program.build", None): 1,
        ("resolve", None): 1,
        ("source_split", train_dir): 1, ("source_split", test_dir): 1,
        ("_feature_specs", train_dir): 1, ("_feature_specs", test_dir): 1,
        ("make", None): 1,  # tasks.make
        ("first_record", train_dir): 1,
        ("_from_manifest", train_dir): 1, ("_from_manifest", test_dir): 1,
        ("make", "mlp"): 1,  # models.make
        ("check_ranges", (train_dir, test_dir)): 1,
    }


def test_sources_resolve_splits_specs_and_mixture_names(digits, rich_tfds):
    """A converted directory has no split; a TFDS directory gets `train` (eval: `test`) and its feature metadata;
    a mixture's components keep their names; the sidecar evaluator is shaped by eval_data and reads no `data`."""
    train_dir, tfds_dir = str(digits["train"]), str(rich_tfds)
    found = sources.resolve(TrainConfig(data=f"a={train_dir},b={tfds_dir}", weights="a=1,b=1", eval_data=tfds_dir,
                                        workdir="w"))
    assert [(s.name, s.path, s.split) for s in found.train] == [("a", train_dir, None), ("b", tfds_dir, "train")]
    assert [(s.name, s.path, s.split) for s in found.eval] == [(None, tfds_dir, "test")]
    assert found.train[0].specs == {} and found.train[1].specs["label"] == {"type": "ClassLabel", "num_classes": 10}
    assert found.shaping is found.train[0]

    evaluator = sources.resolve(TrainConfig(eval_data=tfds_dir, workdir="w", mode="evaluate", data="missing/dir"))
    assert evaluator.train == () and evaluator.shaping is evaluator.eval[0]


def test_a_path_that_names_nothing_is_named_before_the_task_reads_its_metadata(digits, tmp_path):
    """Without the check, a classification run on a misspelt path said the data had no ClassLabel metadata."""
    train_dir = str(digits["train"])
    misspelt = train_dir[:-1] + "x"
    with pytest.raises(FileNotFoundError, match=rf"^data={misspelt}: no such file or directory; did you mean "
                                                rf"{train_dir}\?$"):
        Program.build(TrainConfig(data=misspelt, workdir="w"))
    with pytest.raises(FileNotFoundError, match=rf"^eval_data={tmp_path}/gone: no such file or directory$"):
        sources.resolve(TrainConfig(data=train_dir, eval_data=str(tmp_path / "gone"), workdir="w"))
    with pytest.raises(FileNotFoundError, match=rf"^data component b={tmp_path}/nowhere: no such file or directory$"):
        sources.resolve(TrainConfig(data=f"a={train_dir},b={tmp_path}/nowhere", weights="a=1,b=1", workdir="w"))


def test_packing_needs_a_task_that_packs(digits):
    with pytest.raises(ValueError, match=r"packing=true needs a task that packs token sequences \(task=lm\); "
                                         r"task='classification' does not"):
        Program.build(TrainConfig(data=str(digits["train"]), workdir="w", packing=True, num_classes=10))
    # on text data too: the packing is named, not the image feature a classification reads
    with pytest.raises(ValueError, match=r"packing=true needs a task that packs token sequences"):
        tasks.make(TrainConfig(data="x", workdir="w", packing=True), {"text": {"type": "Text"}})


def test_a_held_out_slice_of_one_corpus_trains_and_evaluates(digits, tmp_path):
    """split= and eval_split= slice one converted dataset (TFDS's syntax): 90% to train on, the rest to evaluate."""
    train_dir = str(digits["train"])  # 1,438 records
    config = TrainConfig(data=train_dir, split="[:90%]", eval_data=train_dir, eval_split="[90%:]",
                         workdir=str(tmp_path), model="mlp", steps=2, batch_size=32, num_classes=10, log_every=1,
                         eval_every=2, checkpoint_every=100)
    data = sources.resolve(config)
    assert (data.train[0].split, data.eval[0].split) == ("[:90%]", "[90%:]")
    summary = train.train_and_evaluate(config)
    assert summary["final_step"] == 2 and summary["eval_examples"] == 1438 - 1294  # round(1294.2) train records


def test_a_slice_alone_slices_a_tfds_sources_default_split(tfds_digits_array_record, tmp_path):
    path = str(tfds_digits_array_record)
    config = TrainConfig(data=path, split="[:50%]", eval_data=path, eval_split="[-100:]", workdir=str(tmp_path))
    data = sources.resolve(config)
    assert (data.train[0].split, data.eval[0].split) == ("train[:50%]", "test[-100:]")
    joined = TrainConfig(data=path, eval_data=path, eval_split="[:10]+train[:5]", workdir=str(tmp_path))
    assert sources.resolve(joined).eval[0].split == "test[:10]+train[:5]"
    named = TrainConfig(data=path, split="test[1shard:]", eval_data=path, workdir=str(tmp_path))
    assert [s.split for s in sources.resolve(named).train + sources.resolve(named).eval] == ["test[1shard:]", "test"]


def test_a_resume_over_another_split_names_it_and_eval_split_needs_eval_data(digits, tmp_path):
    common = dict(data=str(digits["train"]), workdir=str(tmp_path), model="mlp", num_classes=10, batch_size=32,
                  checkpoint_every=2)
    assert train.train_and_evaluate(TrainConfig(steps=2, split="[:90%]", **common))["final_step"] == 2
    with pytest.raises(ValueError, match=r"holds step 2 of a run over other batches: resume with split=\[:90%\] \(what "
                                         r"it was written with\), or pass another workdir= to start afresh \(the "
                                         r"loader: cannot restore loader state: dataset: saved '2 shards, 1,294 records, "
                                         r"sha256:[0-9a-f]{16}', now '2 shards, 1,150 records, sha256:[0-9a-f]{16}', "
                                         r"records: saved \[\[0, 1294\]\], now \[\[0, 1150\]\]; restore with"):
        train.train_and_evaluate(TrainConfig(steps=4, split="[:80%]", **common))
    with pytest.raises(ValueError, match=r"eval_split=\[90%:\] is the records of eval_data=, and no eval_data is "
                                         r"given: add eval_data=PATH"):
        TrainConfig(data="x", workdir="w", eval_split="[90%:]")


def test_eval_data_that_training_reads_is_said(digits, tfds_digits_array_record, caplog):
    """Evaluating on records training reads (the same records, a slice of what training reads whole, or the whole of
    what training reads a slice of) is a warning counting them, with the held-out way; disjoint slices, another
    dataset, or another split of a TFDS dataset are not."""
    train_dir, test_dir = str(digits["train"]), str(digits["test"])
    n = len(loader.load(train_dir, batch_size=1, num_epochs=1))

    def warned(**keys) -> str:
        caplog.clear()
        with caplog.at_level("WARNING", logger="trainer.sources"):
            sources.resolve(TrainConfig(workdir="w", **keys))
        return caplog.text

    assert f"eval_data={train_dir} holds {n:,} of the {n:,} records training reads (data={train_dir}): its figures " \
           "are not held out; hold part of one dataset out with split=[:95%] eval_split=[95%:]" in \
        warned(data=train_dir, eval_data=train_dir)
    tail = n - int(n * 0.95)
    assert f"eval_data={train_dir} eval_split=[95%:] holds {tail:,} of the {n:,} records training reads " \
           f"(data={train_dir})" in warned(data=train_dir, eval_data=train_dir, eval_split="[95%:]")
    # the whole dataset held out while training reads 95% of it: those 95% are in it
    assert f"eval_data={train_dir} holds {n - tail:,} of the {n - tail:,} records training reads (data={train_dir} " \
           "split=[:95%])" in warned(data=train_dir, split="[:95%]", eval_data=train_dir)
    assert warned(data=train_dir, split="[:95%]", eval_data=train_dir, eval_split="[95%:]") == ""
    assert warned(data=train_dir, eval_data=test_dir) == ""
    tfds = str(tfds_digits_array_record)
    assert warned(data=tfds, eval_data=tfds) == ""  # (train and test: files of their own)
    assert "holds" in warned(data=tfds, eval_data=tfds, eval_split="train[90%:]")
