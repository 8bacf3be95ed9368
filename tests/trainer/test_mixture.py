"""Training on a mixture: rows per component in metrics.jsonl, eval per component, new weights on resume."""

import json
import re

import pytest

from tests.trainer.conftest import train_here, trainer_here
from tests.trainer.test_lm import stdlib_text  # noqa: F401 - the fixture


def _metrics(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_mixture_trains_reports_rows_per_component_and_takes_new_weights_on_resume(digits, tmp_path):
    common = (f"data=a={digits['train']},b={digits['test']}", f"eval_data=a={digits['test']},b={digits['train']}",
              f"workdir={tmp_path}", "model=mlp", "num_classes=10", "batch_size=32", "log_every=10",
              "eval_every=20", "checkpoint_every=20")
    first = train_here(*common, "weights=a=0.75,b=0.25", "steps=20")
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads(first.stdout)["summary"]
    assert {k for k in summary if k.startswith("eval_") and k.endswith("loss")} == \
        {"eval_loss", "eval_a_loss", "eval_b_loss"}
    n_a, n_b = summary["eval_a_examples"], summary["eval_b_examples"]
    # the log line has each component's metrics; its counts are in metrics.jsonl, not as "eval_a_examples 359.0000"
    assert re.search(r"step 20/20 loss [\d.]+ eval_accuracy [\d.]+ eval_loss [\d.]+ eval_a_accuracy [\d.]+ "
                     r"eval_a_loss [\d.]+ eval_b_accuracy [\d.]+ eval_b_loss [\d.]+ \d+ ex/s", first.stderr)
    assert summary["eval_examples"] == n_a + n_b
    assert summary["eval_loss"] == pytest.approx((summary["eval_a_loss"] * n_a + summary["eval_b_loss"] * n_b)
                                                 / (n_a + n_b), rel=1e-4)
    second = train_here(*common, "weights=a=0.5,b=0.5", "steps=30")  # resumes at step 20 under new weights
    assert second.returncode == 0, second.stderr[-3000:]
    rows = [(r["step"], r["rows_a"], r["rows_b"]) for r in _metrics(tmp_path) if "rows_a" in r]
    assert rows == [(10, 240, 80), (20, 480, 160), (30, 640, 320)]


@pytest.mark.parametrize("overrides, message", [
    (("weights=a=1",), "error: weights do not match the mixture's components ['a', 'b']: no weight for ['b']"),
    (("weights=a=1,b=-1",), "error: weights['b'] = -1.0 is negative; weights must be >= 0"),
    (("weights=a=0,b=0",), "error: all weights are 0"),
    ((), "error: a mixture of ['a', 'b'] needs weights=, e.g. weights=a=1,b=1"),
])
def test_bad_mixture_settings_are_one_line_and_exit_2(digits, tmp_path, overrides, message):
    proc = trainer_here(f"data=a={digits['train']},b={digits['test']}", f"workdir={tmp_path}", "model=mlp",
                        "num_classes=10", "steps=1", *overrides)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("offset", ["0", "-1"])
def test_components_whose_labels_need_different_offsets_are_told_the_one_setting_that_fits(digits, one_based,
                                                                                          tmp_path, offset):
    """0-based digits beside 1-based ones: each component's own hint (label_offset=-1 for 'b', then 0 for 'a') moved
    the other out of range, one run after the other."""
    proc = trainer_here(f"data=a={digits['train']},b={one_based['train']}", "weights=a=1,b=1",
                        f"workdir={tmp_path}", "model=mlp", "num_classes=10", "steps=1", f"label_offset={offset}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: the mixture's components hold 'label' in different ranges ('a' 0..9, 'b' 1..10), and label_offset="
        f"{offset} applies to every one of them: label_offset=0 num_classes=11 puts them all in range; if they do not "
        "share one set of classes, relabel one (convert it with its labels shifted) instead")


def test_an_empty_component_is_one_line(digits, tmp_path):
    (tmp_path / "empty").mkdir()
    proc = trainer_here(f"data=a={digits['train']},b={tmp_path / 'empty'}", "weights=a=1,b=1",
                        f"workdir={tmp_path / 'w'}", "model=mlp", "num_classes=10", "steps=1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"error: mixture component 'b': {tmp_path / 'empty'} has neither manifest.json" in proc.stderr


def test_an_lm_trains_on_a_packed_mixture(stdlib_text, tmp_path):  # noqa: F811
    proc = train_here(f"data=a={stdlib_text['train']},b={stdlib_text['test']}", "weights=a=0.75,b=0.25",
                       f"workdir={tmp_path}", "task=lm", "model=transformer_lm", "packing=true", "seq_len=64",
                       "batch_size=16", "steps=10", "log_every=5", "checkpoint_every=10", "learning_rate=0.003")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [(r["step"], r["rows_a"], r["rows_b"]) for r in _metrics(tmp_path)]
    assert rows == [(5, 60, 20), (10, 120, 40)]  # rows of 64 tokens: token proportions 3:1


def test_a_config_file_gives_a_mixture_as_mappings(tmp_path):
    from trainer import TrainConfig

    path = tmp_path / "run.json"
    path.write_text(json.dumps({"data": {"web": "gs://b/web", "code": "out/code"}, "weights": {"web": 3, "code": 1},
                                "eval_data": {"web": "out/web-test"}, "workdir": "w"}))
    config = TrainConfig.from_args([], str(path))
    assert config.data_source == {"web": "gs://b/web", "code": "out/code"}
    assert config.data_weights == {"web": 3, "code": 1} and config.eval_source == {"web": "out/web-test"}
    flags = TrainConfig.from_args(["data=web=gs://b/web,code=out/code", "weights=web=3,code=1", "workdir=w"])
    assert flags.data_source == config.data_source and flags.data_weights == {"web": 3.0, "code": 1.0}
    assert TrainConfig.from_args(["data=gs://b/plain", "workdir=w"]).data_source == "gs://b/plain"
