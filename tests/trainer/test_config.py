"""trainer/config.py: settings given where the run does not read them are refused with one line naming the fix."""
import re

import pytest

from trainer.config import TrainConfig


@pytest.mark.parametrize("settings, message", [
    ({"end_lr_fraction": 0.1}, "end_lr_fraction=0.1 is for a decaying schedule (schedule=cosine or linear), and this "
                               "run has schedule=constant: drop end_lr_fraction=, or pass schedule=cosine"),
    ({"learning_rate_schedule_steps": 50}, "learning_rate_schedule_steps=50 is for a decaying schedule"),
    ({"optimizer": "adamw", "momentum": 0.5}, "momentum=0.5 is for optimizer=sgd, and this run has optimizer=adamw: "
                                              "drop momentum=, or pass optimizer=sgd"),
    ({"seq_len": 512}, "seq_len=512 is for task=lm, and this run has task=classification: drop seq_len=, or pass "
                       "task=lm"),
    ({"tokenizer": "t.json"}, "tokenizer=t.json is for task=lm, and this run has task=classification"),
    ({"vocab_size": 32000}, "vocab_size=32000 is for task=lm"),
    ({"text_key": "body"}, "text_key=body is for task=lm"),
    ({"task": "lm", "num_classes": 10}, "num_classes=10 is for task=classification, and this run has task=lm: drop "
                                        "num_classes=, or pass task=classification"),
    ({"task": "lm", "image_size": 224}, "image_size=224 is for task=classification"),
    ({"task": "lm", "label_offset": -1}, "label_offset=-1 is for task=classification"),
    ({"num_workers": 4}, "num_workers=4 is for strategy=parameter_server, and this run has strategy=default: drop "
                         "num_workers=, or pass strategy=parameter_server"),
    ({"strategy": "mirrored", "ray_address": "10.0.0.1:6379"}, "ray_address=10.0.0.1:6379 is for "
                                                               "strategy=parameter_server, and this run has "
                                                               "strategy=mirrored"),
    ({"num_ps": 2}, "num_ps=2 is for strategy=parameter_server"),
    ({"join_timeout": 60.0}, "join_timeout=60.0 is for strategy=multi_worker or parameter_server"),
    ({"eval_steps": 10}, "eval_steps=10 is for evaluating eval_data=, and this run has no eval_data: drop "
                         "eval_steps=, or add eval_data=PATH"),
    ({"profile_skip": 3}, "profile_skip=3 is for a device profile (profile_steps=N), and this run has none: drop "
                          "profile_skip=, or add profile_steps=N"),
])
def test_a_setting_this_run_does_not_read_is_refused(settings, message):
    """Each was ignored without a word: a run with end_lr_fraction under a constant schedule, or momentum under adamw,
    trained as if it were not given."""
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainConfig(data="d", workdir="w", **settings)


@pytest.mark.parametrize("settings", [
    {"schedule": "cosine", "end_lr_fraction": 0.1, "learning_rate_schedule_steps": 50},
    {"optimizer": "sgd", "momentum": 0.5},
    {"task": "lm", "seq_len": 512, "vocab_size": 32000, "text_key": "body"},
    {"num_classes": 10, "image_size": 224, "label_offset": -1, "max_pixels": 1 << 20},
    {"task": "my_tasks:Ranking", "seq_len": 512, "num_classes": 10},  # a task of one's own may read any
    {"strategy": "parameter_server", "num_workers": 4, "num_ps": 2, "join_timeout": 60.0},
    {"strategy": "multi_worker", "join_timeout": 60.0},
    {"eval_data": "e", "eval_steps": 10},
    {"profile_steps": 2, "profile_skip": 3},
    {"momentum": 0.9, "seq_len": 256},  # the defaults, written out (a config file listing every key)
])
def test_the_same_settings_where_the_run_reads_them_are_taken(settings):
    config = TrainConfig(data="d", workdir="w", **settings)
    assert {k: getattr(config, k) for k in settings} == settings


def test_a_directory_named_with_an_equals_sign_is_a_path_not_a_mixture(tmp_path, monkeypatch):
    """Hive-style directories (k=v) were read as a mixture: data=run=1 as the component `run` at path 1."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run=1").mkdir()
    (tmp_path / "run=1" / "a.array_record").touch()
    for data in ("run=1", "run=1/*.array_record", f"{tmp_path}/run=1"):
        assert TrainConfig(data=data, workdir="w").data_source == data
    config = TrainConfig(data="web=run=1,code=run=1", workdir="w", weights="web=1,code=1")
    assert config.data_source == {"web": "run=1", "code": "run=1"}
    with pytest.raises(ValueError, match=re.escape("data=run=2 reads as a mixture of one, run=2, and 2 does not "
                                                   "exist: a path holding '=' is written ./run=2")):
        TrainConfig(data="run=2", workdir="w").data_source  # noqa: B018
    assert TrainConfig(data="web=gs://bucket/web", workdir="w", weights="web=1").data_source == {
        "web": "gs://bucket/web"}


@pytest.mark.parametrize("argv, last", [
    (["-steps=3", "data=x", "workdir=w"], "error: -steps=3: keys are written key=value without dashes: steps=3 "
                                          "(python -m trainer --help lists every key)"),  # (argparse's usage)
    (["data=x", "workdir=w", "max_pixels=0"], "error: max_pixels must be >= 1 (got max_pixels=0)"),
    (["data=x", "workdir=w", "max_record_bytes=-1"], "error: max_record_bytes must be >= 1 (got max_record_bytes=-1)"),
])
def test_a_bad_command_line_is_one_line_exit_2(argv, last, capsys):
    from trainer.__main__ import main

    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == last


def test_a_key_given_twice_takes_the_later(tmp_path):
    (tmp_path / "c.json").write_text('{"steps": 7}')
    assert TrainConfig.from_args(["data=x", "workdir=w", "steps=3", "steps=5"]).steps == 5
    assert TrainConfig.from_args(["data=x", "workdir=w", "steps=3"], str(tmp_path / "c.json")).steps == 3
