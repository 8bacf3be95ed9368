"""The real `python -m trainer`, on the digits converted by the pipeline."""

import json
import re
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests.trainer.conftest import run_trainer, train_here, trainer_here


def _metrics(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _params(workdir):
    """The latest checkpoint's step and params, as NumPy arrays (whatever mesh saved them)."""
    import jax

    handlers = {"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler()}
    with ocp.CheckpointManager(str(workdir / "checkpoints"), item_handlers=handlers) as mngr:
        step = mngr.latest_step()
        meta = mngr.item_metadata(step)["state"]
        target = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), meta)
        restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                              data=ocp.args.JsonRestore()))
    return step, restored["state"]["params"]


def _common(digits, workdir, *extra):
    return (f"data={digits['train']}", f"eval_data={digits['test']}", f"workdir={workdir}", "batch_size=32",
            "learning_rate=0.003", "num_classes=10", *extra)


def test_smoke_trains_logs_and_checkpoints(digits, tmp_path):
    # (eval_every not a multiple of log_every: an eval step is a row of its own; evaluations came only at steps of both)
    proc = train_here(*_common(digits, tmp_path, "model=mlp", "steps=30", "log_every=10", "eval_every=15",
                                "checkpoint_every=30"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "strategy=default num_replicas_in_sync=1" in proc.stderr
    records = _metrics(tmp_path)
    assert [r["step"] for r in records] == [10, 15, 20, 30]
    assert [r["step"] for r in records if "eval_accuracy" in r] == [15, 30]
    for key in ("loss", "examples_per_sec", "examples_per_sec_per_device", "step_time_s", "data_wait_fraction",
                "host_wait_fraction"):
        assert all(np.isfinite(r[key]) for r in records), key
    # data-wait is the part of the host's wait with no step running (the devices idle for want of input); its longest
    # single wait is part of it
    assert all(0 <= r["data_wait_fraction"] <= r["host_wait_fraction"] < 1 for r in records)
    assert all(0 <= r["data_wait_longest_s"] <= r["data_wait_fraction"] * r["step_time_s"] * 10 * (1 + 1e-9)
               for r in records)  # (a fraction of a time times the time again: 1 ulp either way; periods <= 10)
    assert re.search(r"step 30/30 loss [\d.]+ eval_\w+ .* ex/s data-wait [\d.]+% \(longest \d+\.\d\d s\)", proc.stderr)
    assert records[-1]["loss"] < records[0]["loss"]
    assert 0.5 < records[-1]["eval_accuracy"] <= 1.0 and records[-1]["eval_examples"] == 359
    assert list((tmp_path / "tensorboard").iterdir())
    assert _params(tmp_path)[0] == 30
    summary = json.loads(proc.stdout)["summary"]
    assert summary["final_step"] == 30 and summary["eval_accuracy"] == pytest.approx(records[-1]["eval_accuracy"])


# slow (24-34 s a strategy): the default run keeps device-count invariance in tests/trainer/test_images.py (BatchNorm
# statistics across device counts) and eight mirrored devices in tests/trainer/test_central_storage.py
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["mirrored", "fsdp"])
def test_eight_devices_match_one_device(digits, tmp_path, strategy):
    one = train_here(*_common(digits, tmp_path / "one", "model=mlp", "steps=20", "log_every=1", "strategy=default"))
    many = run_trainer(*_common(digits, tmp_path / "many", "model=mlp", "steps=20", "log_every=1",
                                f"strategy={strategy}"), devices=8)
    assert one.returncode == 0 and many.returncode == 0, (one.stderr[-2000:], many.stderr[-2000:])
    assert f"strategy={strategy} num_replicas_in_sync=8" in many.stderr
    np.testing.assert_allclose([r["loss"] for r in _metrics(tmp_path / "many")],
                               [r["loss"] for r in _metrics(tmp_path / "one")], rtol=1e-4)
    (_, a), (_, b) = _params(tmp_path / "one"), _params(tmp_path / "many")
    np.testing.assert_allclose(np.concatenate([np.ravel(v) for v in _leaves(b)]),
                               np.concatenate([np.ravel(v) for v in _leaves(a)]), atol=1e-4)


def _leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_sigterm_then_resume_matches_an_uninterrupted_run(digits, tmp_path):
    """The interrupted run asks for far more steps than it can run in the test's time, so only the SIGTERM ends it
    (with 60 steps, a run could finish between the 10th metrics line and the signal); the resume and the reference
    run go to where it stopped + 10 (no schedule depends on `steps`)."""
    args = ("model=mlp", "log_every=1", "checkpoint_every=100000")
    proc = run_trainer(*_common(digits, tmp_path / "stopped", *args, "steps=100000"), popen=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # wait until training is under way, then preempt
        if (tmp_path / "stopped" / "metrics.jsonl").exists() and len(_metrics(tmp_path / "stopped")) >= 10:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, output[-2000:]  # 128 + SIGTERM: preempted, checkpoint saved (a scheduler restarts)
    stopped_at, _ = _params(tmp_path / "stopped")
    assert stopped_at >= 10 and "SIGTERM: saved a checkpoint" in output
    end = stopped_at + 10

    resumed = train_here(*_common(digits, tmp_path / "stopped", *args, f"steps={end}"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from step {stopped_at}" in resumed.stderr
    straight = train_here(*_common(digits, tmp_path / "straight", *args, f"steps={end}"))
    assert straight.returncode == 0, straight.stderr[-2000:]
    want = {r["step"]: r["loss"] for r in _metrics(tmp_path / "straight")}
    got = {r["step"]: r["loss"] for r in _metrics(tmp_path / "stopped")}
    assert sorted(got) == list(range(1, end + 1))
    assert got == want  # bitwise: same batches, same losses
    (_, a), (_, b) = _params(tmp_path / "straight"), _params(tmp_path / "stopped")
    assert all(np.array_equal(x, y) for x, y in zip(_leaves(a), _leaves(b)))


def test_resumes_between_log_steps_write_the_rows_of_a_run_without_stops(digits, tmp_path):
    """log_every=2, checkpoint_every=3: a run of steps=5 (rows 2, 4, 5; checkpoints 3, 5), its checkpoint 5 lost (a
    kill before it was written), resumed with steps=7 (from 3; rows 4, 6, 7), then extended to steps=8 (from 7). Its
    metrics.jsonl was rows 2, 4, 4, 5, 6, 7, 8, each loss the mean of the steps since the restart; it is now the
    uninterrupted run's: rows 2, 4, 6, 8 (and the evaluation at the last step), each loss the mean of its two steps."""
    args = ("model=mlp", "log_every=2", "checkpoint_every=3", "eval_every=1000")
    straight = train_here(*_common(digits, tmp_path / "straight", *args, "steps=8"))
    assert straight.returncode == 0, straight.stderr[-2000:]
    workdir = tmp_path / "stopped"
    first = train_here(*_common(digits, workdir, *args, "steps=5"))
    assert first.returncode == 0, first.stderr[-2000:]
    assert [r["step"] for r in _metrics(workdir)] == [2, 4, 5]
    shutil.rmtree(workdir / "checkpoints" / "5")
    for steps, start in ((7, 3), (8, 7)):
        again = train_here(*_common(digits, workdir, *args, f"steps={steps}"))
        assert again.returncode == 0 and f"resumed from step {start}" in again.stderr, again.stderr[-2000:]
    want, got = _metrics(tmp_path / "straight"), _metrics(workdir)
    assert [r["step"] for r in want] == [2, 4, 6, 8]
    assert [(r["step"], r["loss"], r.get("eval_accuracy")) for r in got] == \
        [(r["step"], r["loss"], r.get("eval_accuracy")) for r in want]


def test_ctrl_c_saves_a_checkpoint_and_stops(digits, tmp_path):
    """Ctrl-C was a bare KeyboardInterrupt traceback, and the steps since the last checkpoint were lost."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "trainer", *_common(digits, tmp_path, "model=mlp", "steps=400", "log_every=1",
                                                      "checkpoint_every=1000")]
    # as a terminal's shell starts it: SIGINT at its default (a test runner's worker may ignore it, and pass that on)
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if (tmp_path / "metrics.jsonl").exists() and len(_metrics(tmp_path)) >= 5:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output[-3000:]
    stopped_at, _ = _params(tmp_path)
    assert 5 <= stopped_at < 400 and "Traceback" not in output
    assert f"Ctrl-C: saved a checkpoint at step {stopped_at}; exiting (the same command resumes from it)" in output


@pytest.mark.parametrize("sig, code, last", [
    (signal.SIGINT, 130, "stopped by Ctrl-C (no checkpoint saved; the latest one, if any, is where the same command "
                         "resumes)"),
    (signal.SIGTERM, 143, "stopped by SIGTERM before a step of this run ran (nothing saved; the same command resumes "
                          "from the latest checkpoint, if any)")], ids=["ctrl_c", "sigterm"])
def test_a_stop_before_the_loop_is_one_line(digits, tmp_path, sig, code, last):
    """A Ctrl-C or a SIGTERM (a preemption) while the run sets up (here: after the data check, in the model's build
    and compile) ends it with one line, its exit status, and the workdir's lease given back. The Ctrl-C was a
    KeyboardInterrupt traceback; the SIGTERM ended the process without a line, its lease left to lapse."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "trainer", *_common(digits, tmp_path, "model=mlp", "steps=400")]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "'label' holds 0..9" in line:
            break
    assert (tmp_path / ".lease.json").exists()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    err = "".join(lines) + err
    assert proc.returncode == code, err[-3000:]
    assert out == "" and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == last, err[-3000:]
    assert not (tmp_path / ".lease.json").exists()


def test_resume_after_a_crash_between_log_and_checkpoint_logs_each_step_once(digits, tmp_path):
    args = ("model=mlp", "steps=20", "log_every=1", "checkpoint_every=10")
    # every program into the workdir's compilation cache, however fast it compiled (JAX's default keeps those over 1 s)
    cache_all = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_COMPILATION_CACHE_DIR": ""}
    first = run_trainer(*_common(digits, tmp_path, *args), extra_env=cache_all)
    assert first.returncode == 0, first.stderr[-2000:]
    want = _metrics(tmp_path)
    shutil.rmtree(tmp_path / "checkpoints" / "20")  # as if the process died after logging 11..20, before saving 20
    assert "step compiled in" in first.stderr
    assert len(list((tmp_path / "compilation_cache").glob("jit_train_step-*"))) == 1

    again = run_trainer(*_common(digits, tmp_path, *args), extra_env=cache_all)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed from step 10" in again.stderr
    assert "dropped 10 record(s) after step 10" in again.stderr
    assert "step read from the compilation cache in" in again.stderr  # the restart did not compile its step again
    got = _metrics(tmp_path)
    assert [r["step"] for r in got] == list(range(1, 21))
    assert [r["loss"] for r in got] == [r["loss"] for r in want]  # the repeated steps, bitwise


def test_a_resume_with_a_larger_batch_size_reads_on_from_where_the_batches_stopped(digits, tmp_path):
    """A batch-size ramp by restarts: 4 steps of 32 examples, then steps 5-8 of 48 from the same workdir. The loader
    continues its stream at example 128 (its state says where batch 4 of 48 begins), neither repeating nor skipping."""
    first = train_here(*_common(digits, tmp_path, "model=mlp", "steps=4", "checkpoint_every=4"))
    assert first.returncode == 0, first.stderr[-2000:]
    args = [a for a in _common(digits, tmp_path, "model=mlp", "steps=8", "checkpoint_every=4") if a != "batch_size=32"]
    second = train_here(*args, "batch_size=48")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "restoring a state saved with batch_size=32 with batch_size=48: batch 4 and after continue" in second.stderr
    assert "resumed from step 4" in second.stderr
    handlers = {"data": ocp.JsonCheckpointHandler()}
    with ocp.CheckpointManager(str(tmp_path / "checkpoints"), item_handlers=handlers) as mngr:
        state = mngr.restore(8, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]
    assert (state["next_batch"], state["batch_size"], state["origin"]) == (8, 48, 4 * 32 - 4 * 48)


def test_a_batch_size_ramp_up_grows_the_batch_and_resumes_inside_it_exactly(digits, tmp_path):
    """batch_size 32 -> 48 -> 64 over 192 examples (MaxText's rule: 96 examples at each smaller size, ceil(96 / size)
    steps of it). A run stopped at step 4, inside the ramp, and resumed gives the losses of one that ran through, and
    its loader reads on where the batches of each size stopped (384 examples in 8 steps)."""
    ramp = ("model=mlp", "batch_size=64", "batch_size_start=32", "batch_size_increment=16", "rampup_samples=192",
            "log_every=1", "checkpoint_every=4", "eval_every=1000")
    args = lambda workdir, steps: [a for a in _common(digits, workdir, *ramp, f"steps={steps}") if a != "batch_size=32"]
    through = train_here(*args(tmp_path / "through", 8))
    assert through.returncode == 0, through.stderr[-2000:]
    assert "batch-size ramp-up over 192 examples: 32 for steps 1-3, 48 for steps 4-5, 64 from step 6" in through.stderr
    assert re.search(r"step 4: batch_size=48 from here \(the ramp-up\), its step ready in [\d.]+ s", through.stderr)
    want = _metrics(tmp_path / "through")
    assert [r["batch_size"] for r in want] == [32, 32, 32, 48, 48, 64, 64, 64]
    stopped = train_here(*args(tmp_path / "resumed", 4))
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    resumed = train_here(*args(tmp_path / "resumed", 8))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "restoring a state saved with batch_size=48 with batch_size=48" not in resumed.stderr  # (the same size)
    got = _metrics(tmp_path / "resumed")
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    handlers = {"data": ocp.JsonCheckpointHandler()}
    with ocp.CheckpointManager(str(tmp_path / "resumed" / "checkpoints"), item_handlers=handlers) as mngr:
        state = mngr.restore(8, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]
    assert (state["next_batch"], state["batch_size"], state["origin"]) == (8, 64, 3 * 32 + 2 * 48 + 3 * 64 - 8 * 64)


def test_the_last_steps_evaluation_is_the_summarys_not_run_again(digits, tmp_path, monkeypatch):
    """Evaluations at steps 2 and 4 of 4: two passes over eval_data (the summary's is step 4's, which it was run a
    second time for)."""
    from trainer import train
    from trainer.config import TrainConfig
    from trainer.program import Program

    calls = []
    real = Program.evaluate
    monkeypatch.setattr(Program, "evaluate", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    summary = train.train_and_evaluate(TrainConfig(data=str(digits["train"]), eval_data=str(digits["test"]),
                                                   workdir=str(tmp_path), model="mlp", num_classes=10, batch_size=32,
                                                   steps=4, log_every=2, eval_every=2, checkpoint_every=4))
    assert len(calls) == 2
    assert summary["eval_accuracy"] == _metrics(tmp_path)[-1]["eval_accuracy"] and summary["final_step"] == 4


def test_resuming_with_settings_that_reshape_the_model_is_one_line_naming_them(digits, tmp_path):
    """A workdir resumed with another num_classes: one line before any restore, naming the array and the setting the
    checkpoint was written with (orbax's own error, hundreds of lines long, advised an orbax API change)."""
    first = train_here(*_common(digits, tmp_path, "model=mlp", "steps=2", "checkpoint_every=2"))
    assert first.returncode == 0, first.stderr[-2000:]
    again = train_here(*_common(digits, tmp_path, "model=mlp", "steps=4")[:-1], "num_classes=12")
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert again.stderr.splitlines()[-1] == (
        f"error: {tmp_path / 'checkpoints'} holds step 2 of a model other than this one (params['Dense_2']['bias'] "
        "is (10,) there and (12,) here, and 1 more arrays differ): resume with num_classes=10 (what it was written "
        "with), or pass another workdir= to start afresh")
    assert "initialising its parameters" not in again.stderr  # said from the shapes alone, before the model's init
    shutil.rmtree(tmp_path / "checkpoints" / "2" / "config")  # a checkpoint written before the settings were kept
    older = train_here(*_common(digits, tmp_path, "model=mlp", "steps=4")[:-1], "num_classes=12")
    assert older.returncode == 2 and older.stderr.splitlines()[-1].endswith(
        "resume with the settings it was written with (model=, width=, depth=, heads=, seq_len=, vocab_size=, "
        "num_classes=, ...), or pass another workdir= to start afresh")
    assert (tmp_path / "checkpoints" / "2" / "state").is_dir()  # nothing written over
    # another optimizer: the parameters fit, its state does not (orbax advised partial_restore=True, no setting here)
    other = train_here(*_common(digits, tmp_path, "model=mlp", "steps=4")[:-1], "optimizer=sgd")
    assert other.returncode == 2 and "Traceback" not in other.stderr
    assert other.stderr.splitlines()[-1].startswith(
        f"error: {tmp_path / 'checkpoints'} holds step 2 of a training state other than this run's (its optimizer "
        "state holds other arrays): resume with "), other.stderr[-2000:]
    # a constant schedule resumed as a cosine one (an optimizer state with a step count): the error alone, no advice
    # on keeping the schedule before it
    cosine = train_here(*_common(digits, tmp_path, "model=mlp", "steps=4")[:-1], "schedule=cosine")
    assert cosine.returncode == 2 and "holds step 2 of a training state other than this run's" in cosine.stderr
    assert "learning rate there is now" not in cosine.stderr, cosine.stderr[-2000:]


def test_transformer_learns_rows_as_a_sequence(digits, tmp_path):
    proc = train_here(*_common(digits, tmp_path, "model=transformer", "steps=120", "log_every=40", "eval_every=120"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = _metrics(tmp_path)
    assert records[-1]["loss"] < records[0]["loss"] and records[-1]["eval_accuracy"] > 0.6


def test_non_finite_loss_stops_with_the_step(digits, tmp_path):
    proc = train_here(f"data={digits['train']}", f"workdir={tmp_path}", "model=mlp", "steps=50", "log_every=50",
                       "learning_rate=1e30", "batch_size=32", "num_classes=10")
    assert proc.returncode != 0
    assert "NonFiniteLoss: loss is" in proc.stderr and " at step " in proc.stderr


def test_strategy_without_its_hardware_says_what_was_found(digits, tmp_path):
    proc = run_trainer(f"data={digits['train']}", f"workdir={tmp_path}", "strategy=tpu", "steps=1", devices=2)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "strategy='tpu' needs TPU devices, but found 2 device(s) of platform cpu" in proc.stderr
    proc = train_here(f"data={digits['train']}", f"workdir={tmp_path}", "strategy=one_device", "device=gpu:0",
                       "steps=1")
    assert proc.returncode != 0 and "device='gpu:0' not found; the devices are ['cpu:0']" in proc.stderr


def test_bad_config_is_one_line(tmp_path):
    proc = trainer_here("data=x", f"workdir={tmp_path}", "stepz=3")
    assert proc.returncode == 2 and "unknown config key(s) ['stepz']; did you mean steps? (python -m trainer " \
        "--help lists every key)" in proc.stderr
    proc = trainer_here("data=x", f"workdir={tmp_path}", "packing=ture")  # was read as false, silently
    assert proc.returncode == 2 and "packing='ture' is not a valid bool (true or false)" in proc.stderr
    proc = trainer_here("--steps=3", "data=x", f"workdir={tmp_path}")
    assert proc.returncode == 2 and "--steps=3: keys are written key=value without dashes: steps=3" in proc.stderr
    config = tmp_path / "c.json"
    config.write_text('{"steps": "many"}')  # --config among the pairs is read (it was "unrecognized arguments")
    proc = trainer_here("data=x", "--config", str(config), f"workdir={tmp_path}")
    assert proc.returncode == 2 and "steps='many' is not a valid int" in proc.stderr
    config.write_text('{"steps": 3')
    proc = trainer_here("data=x", "--config", str(config), f"workdir={tmp_path}")
    assert proc.returncode == 2 and f"--config {config} is not JSON: Expecting ',' delimiter" in proc.stderr
    proc = trainer_here("data=x", f"workdir={tmp_path}", "steps=many")
    assert proc.returncode == 2 and "steps='many' is not a valid int" in proc.stderr
    proc = trainer_here("data=x", f"workdir={tmp_path}", "strategy=tpu_pod")
    assert proc.returncode == 2 and "strategy='tpu_pod' is not one of" in proc.stderr
    proc = trainer_here("data=x", f"workdir={tmp_path}", "strategy=mirored")
    assert proc.returncode == 2 and proc.stderr.strip().endswith("(did you mean mirrored?)"), proc.stderr[-500:]
    proc = trainer_here("data=x", "--config", str(tmp_path / "c.jsn"), f"workdir={tmp_path}")  # (a bare Errno 2)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == \
        f"error: --config {tmp_path / 'c.jsn'}: no such file; did you mean {tmp_path / 'c.json'}?", proc.stderr[-500:]


@pytest.mark.parametrize("setting, last", [
    ('{"steps": 2.5}', "error: steps=2.5 (--config) is not a valid int"),  # a traceback at the loop, exit 1
    ('{"batch_size": null}', "error: batch_size: null is not a valid int (--config)"),
    ('{"steps": [1, 2]}', "error: steps=[1, 2] (--config) is not a valid int"),
    ('{"steps": true}', "error: steps=True (--config) is not a valid int (YAML reads on/off/yes/no as true/false: "
                        "quote it)"),  # (it ran 1 step)
    ("compilation_cache: off", "error: compilation_cache=False (--config) is not a valid str (YAML reads "
                               "on/off/yes/no as true/false: quote it)"),
    ("learning_rate=nan", "error: learning_rate=nan is not a finite number"),  # stopped at step 2: "lower it"
    ("grad_clip=inf", "error: grad_clip=inf is not a finite number"),
    ("compilation_cache=", "error: compilation_cache= is empty: pass auto, none, or a directory"),
    ("workdir=", "error: workdir= is empty: name the run's directory (a local path or gs://bucket/run)"),
])
def test_a_setting_of_the_wrong_type_or_not_a_number_is_one_line(tmp_path, setting, last):
    """A config file's values went on as they were (JSON, YAML: typed already), and nan passed every `x <= 0` check:
    the run failed later, with a traceback naming no key, or a wrong fix."""
    if "=" in setting:
        proc = trainer_here("data=x", f"workdir={tmp_path}", setting)
    else:
        config = tmp_path / ("c.yaml" if ":" in setting and "{" not in setting else "c.json")
        config.write_text(setting + "\n")
        proc = trainer_here("data=x", f"workdir={tmp_path}", "--config", str(config))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == last, proc.stderr[-1000:]


def test_off_words_turn_the_compilation_cache_off_and_whole_json_numbers_are_ints(tmp_path):
    """compilation_cache=off cached into a directory ./off; JSON's 1e3 is a float."""
    from trainer.config import TrainConfig

    for word in ("off", "None", "false", "NONE"):
        config = TrainConfig.from_args(["data=x", f"workdir={tmp_path}", f"compilation_cache={word}"])
        assert config.compilation_cache == "none"
    (tmp_path / "c.json").write_text('{"steps": 1e3, "learning_rate": 1}')
    config = TrainConfig.from_args(["data=x", f"workdir={tmp_path}"], str(tmp_path / "c.json"))
    assert (config.steps, config.learning_rate) == (1000, 1.0) and isinstance(config.steps, int)


def test_two_config_files_or_a_workdir_that_is_a_file_are_one_line(tmp_path):
    """A second --config replaced the first unread; a workdir that is a file was a FileExistsError traceback, exit
    1."""
    (tmp_path / "a.json").write_text('{"steps": 3}')
    (tmp_path / "b.json").write_text('{"bogus": 1}')
    proc = trainer_here("data=x", f"workdir={tmp_path}", "--config", str(tmp_path / "a.json"), "--config",
                        str(tmp_path / "b.json"))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        f"error: --config is given 2 times ({tmp_path / 'a.json'}, {tmp_path / 'b.json'}): give one file; key=value "
        "pairs on the command line override it")
    proc = trainer_here("data=x", f"workdir={tmp_path / 'a.json'}")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        f"error: workdir={tmp_path / 'a.json'} is a file, not a directory: name the run's directory")


def test_an_incomplete_conversion_is_refused_unless_allow_incomplete(digits, tmp_path):
    """A manifest that lists a failed shard: one line naming it and both ways on; allow_incomplete=true trains on the
    shards that converted."""
    data = tmp_path / "train"
    shutil.copytree(digits["train"], data)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["failed"] = [{"source": "/data/digits-train-00003-of-00004.tfrecord", "error": "DataLossError: corrupted"}]
    manifest["complete"] = False
    (data / "manifest.json").write_text(json.dumps(manifest))
    args = (f"data={data}", f"workdir={tmp_path / 'run'}", "model=mlp", "num_classes=10", "steps=2", "log_every=1")
    refused = train_here(*args)
    last = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode == 2 and "the conversion is incomplete (1 shard(s) failed, e.g. /data/digits-train-" \
        "00003-of-00004.tfrecord)" in last and last.endswith("(python -m trainer: allow_incomplete=true; python -m "
                                                             "loader bench: --allow-incomplete) to load the shards "
                                                             "that converted"), last
    allowed = train_here(*args, "allow_incomplete=true")
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert [r["step"] for r in _metrics(tmp_path / "run")] == [1, 2]


def test_a_shard_damaged_during_training_ends_the_run_with_the_shard_as_the_last_line(digits, tmp_path):
    """A chunk damaged after the run started (its first batch read): the failure's last line names the shard and the
    fix, not grain's note on the frames it removed."""
    from loader.format.source import resolve

    data = tmp_path / "train"
    shutil.copytree(digits["train"], data)
    shard = resolve(str(data)).paths[-1]
    raw = bytearray(open(shard, "rb").read())
    raw[len(raw) // 2] ^= 0xFF  # in a chunk's data, far from the first records
    open(shard, "wb").write(bytes(raw))
    proc = train_here(f"data={data}", f"workdir={tmp_path / 'run'}", "model=mlp", "num_classes=10", "steps=200",
                       "batch_size=32", "log_every=100")
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith(f"error: OSError: {shard}: record ") and \
        f"the shard is corrupt: delete {shard} and re-run the conversion" in last, proc.stderr[-3000:]


def test_labels_outside_num_classes_are_one_line_before_step_1(digits, tmp_path):
    """Digits' labels are 0..9: num_classes=9 would train with the 9s' one-hot all zeros, silently."""
    proc = train_here(f"data={digits['train']}", f"workdir={tmp_path}", "model=mlp", "num_classes=9", "steps=5")
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and last == (f"error: label_key='label' holds 0..9 over the 1,438 records of "
                                             f"{digits['train']} (its manifest), outside 0..8 (num_classes=9): set "
                                             "num_classes=10 (or check label_key=)"), last
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_the_label_check_names_1_based_labels():
    from trainer.tasks import Classification

    task = Classification("image", "label", 10, None)
    images = np.zeros((10, 8, 8), np.uint8)
    task.check({"image": images, "label": np.arange(10)})  # 0..9: fine
    with pytest.raises(ValueError, match=r"holds 1\.\.10, outside 0\.\.9 \(num_classes=10\): "
                                         r"1-based labels: pass label_offset=-1"):
        task.check({"image": images, "label": np.arange(1, 11)})
    Classification("image", "label", 10, None, label_offset=-1).check({"image": images, "label": np.arange(1, 11)})
    with pytest.raises(ValueError, match="class ids must not be negative"):
        task.check({"image": images[:2], "label": np.array([-1, 3])})


@pytest.mark.parametrize("image, label, message", [
    (np.arange(4), np.arange(4), "image_key='image' holds one number per example, not an image or a vector; set "
                                 "image_key= to the image (or feature-vector) feature"),
    (np.zeros((4, 8, 8)), np.zeros((4, 8, 8, 1), np.uint8), "label_key='label' holds arrays of shape (8, 8, 1) per "
                                                             "example, not one class id; set label_key= to the integer "
                                                             "label feature"),
    (np.zeros((4, 3)), np.zeros(4, np.float32), "label_key='label' holds float32 values, not integer class ids; set "
                                                "label_key= to the integer label feature"),
])
def test_the_task_check_names_features_of_the_wrong_shape_or_dtype(image, label, message):
    from trainer.tasks import Classification

    Classification("image", "label", 10, None).check({"image": np.zeros((4, 3)), "label": np.arange(4)})
    with pytest.raises(ValueError) as e:
        Classification("image", "label", 10, None).check({"image": image, "label": label})
    assert str(e.value) == message


def test_help_lists_every_key_with_its_default_and_description(capsys):
    """`python -m trainer --help` is read from TrainConfig's own fields and comments, so it cannot drift."""
    import dataclasses

    from dataset_format.config_help import descriptions
    from trainer.__main__ import main
    from trainer.config import TrainConfig

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    described = descriptions(TrainConfig)
    for field in dataclasses.fields(TrainConfig):
        default = "(required)" if field.default is dataclasses.MISSING else f"= {field.default!r}"
        assert f"  {field.name}: {field.type} {default}" in out, field.name
        assert described[field.name], f"TrainConfig.{field.name} has no comment to describe it in --help"
    assert "      optimizer updates to run" in out and "  steps: int = 1000\n" in out


def test_help_names_every_registered_model_task_and_strategy(capsys):
    """The names --help lists are the registries' own: a model added to MODELS is listed without a help edit."""
    import re

    from trainer import config, models, tasks
    from trainer.__main__ import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # the help is wrapped: compare its words

    def listed(key: str, words: str) -> list[str]:
        return re.search(rf"\b{key}: str( \| None)? = ('[^']*'|None) .*?\({words} (.*?)\)", out).group(3).split(", ")

    assert listed("model", "built in:") == list(models.MODELS) and "transformer_lm" in models.MODELS
    assert listed("task", "built in:") == list(tasks.TASKS)
    assert listed("strategy", "one of:") == list(config.STRATEGIES)


@pytest.mark.slow
def test_in_memory_batches_train_on_the_loaders_first_batches_cycled(digits, tmp_path):
    """in_memory_batches=2 (the benchmark's input-bound limit): steps 1-2 see the loader's batches 1-2,
    exactly as a streaming run does; step 3 sees batch 1 again, where a streaming run sees batch 3."""
    args = ("model=mlp", "steps=3", "log_every=1", "eval_every=100", "checkpoint_every=100")
    streamed = train_here(*_common(digits, tmp_path / "streamed", *args))
    cached = train_here(*_common(digits, tmp_path / "cached", *args, "in_memory_batches=2"))
    assert streamed.returncode == 0 and cached.returncode == 0, (streamed.stderr[-2000:], cached.stderr[-2000:])
    assert "in_memory_batches=2: cycling batches held on the devices" in cached.stderr
    a, b = [r["loss"] for r in _metrics(tmp_path / "streamed")], [r["loss"] for r in _metrics(tmp_path / "cached")]
    assert a[:2] == b[:2] and a[2] != b[2]
    assert _metrics(tmp_path / "cached")[-1]["data_wait_fraction"] < 0.05  # no input on the step path
    # Stopped at step 2 and resumed: the same two batches cached again, the cycle going on where it was (the
    # checkpoint held the loader's state after them, and the resumed run cached the next two)
    first = train_here(*_common(digits, tmp_path / "resumed", *args[:1], "steps=2", *args[2:], "in_memory_batches=2"))
    again = train_here(*_common(digits, tmp_path / "resumed", *args, "in_memory_batches=2"))
    assert first.returncode == 0 and again.returncode == 0, (first.stderr[-2000:], again.stderr[-2000:])
    assert "resumed from step 2 (loader at batch 0)" in again.stderr
    assert [r["loss"] for r in _metrics(tmp_path / "resumed")] == b


def test_data_workers_on_ray_need_their_partner_keys():
    from trainer.config import TrainConfig

    with pytest.raises(ValueError, match=r"data_ray_address='auto' runs data_workers workers on the Ray cluster: pass "
                                         r"data_workers=N \(N >= 1\)"):
        TrainConfig(data="x", workdir="w", data_ray_address="auto")
    with pytest.raises(ValueError, match="data_ray_resource= places Ray actors: pass data_ray_address= too"):
        TrainConfig(data="x", workdir="w", data_workers=2, data_ray_resource="data_cpu")
    with pytest.raises(ValueError) as refused:  # (a command line has no iterator to call resize_workers on)
        TrainConfig(data="x", workdir="w", data_workers="auto", data_ray_address="auto")
    assert str(refused.value) == ("data_workers='auto' tunes this host's workers; with data_ray_address='auto' pass the "
                                  "number of Ray actors (data_workers=N)")
    config = TrainConfig(data="x", workdir="w", data_workers=2, data_ray_address="auto", data_ray_resource="data_cpu")
    assert (config.data_ray_address, config.data_ray_resource) == ("auto", "data_cpu")


def test_data_workers_auto_from_the_command_line():
    from trainer.config import TrainConfig

    assert TrainConfig.from_args(["data=x", "workdir=w", "data_workers=auto"]).data_workers == "auto"
    assert TrainConfig.from_args(["data=x", "workdir=w", "data_workers=3"]).data_workers == 3
    with pytest.raises(ValueError, match="data_workers must be a number of worker processes or 'auto' "
                                         r"\(got data_workers='many'\)"):
        TrainConfig.from_args(["data=x", "workdir=w", "data_workers=many"])
    with pytest.raises(ValueError, match="data_workers='auto' tunes this host's workers; with data_ray_address='auto' "
                                         r"pass the number of Ray actors \(data_workers=N\)"):
        TrainConfig(data="x", workdir="w", data_workers="auto", data_ray_address="auto")


@pytest.mark.gcs
def test_gs_data_is_cached_on_local_disk_with_data_cache_dir(gcs_bucket, digits, tmp_path):
    """data_cache_dir= and data_cache_bytes= reach the loader: a second pass over gs:// data requests nothing."""
    from trainer.config import TrainConfig
    from trainer.program import Program

    bucket, client = gcs_bucket
    for f in Path(digits["train"]).iterdir():
        if f.is_file():
            client.bucket(bucket).blob(f"digits/{f.name}").upload_from_filename(str(f))
    with pytest.raises(ValueError, match="data_cache_dir='c' keeps chunks on disk up to data_cache_bytes: pass "
                                         "data_cache_bytes="):
        TrainConfig.from_args([f"data=gs://{bucket}/digits", "workdir=w", "data_cache_dir=c"])
    config = TrainConfig.from_args([f"data=gs://{bucket}/digits", f"workdir={tmp_path / 'w'}",
                                    f"data_cache_dir={tmp_path / 'cache'}", "data_cache_bytes=67108864",
                                    "num_classes=10"])
    program = Program.build(config)
    first = [b["label"].tolist() for b in program.load_train(num_epochs=1)]
    again = program.load_train(num_epochs=1)
    assert [b["label"].tolist() for b in again] == first and len(first) > 1
    assert again._reader._remote_reader.requests == 0 and again._reader._remote_reader._cache.disk.hits > 0


def test_the_step_is_compiled_before_any_batch_is_placed_and_the_loop_places_each(digits, tmp_path, monkeypatch):
    """Streamed batches take no more device memory than batches held in memory (trainer/train.py's docstring): the
    step is compiled, with the state already placed, before the first batch goes to the devices, and every batch is
    placed by the loop's own thread, one a step, so none lands while a step's temporaries are being allocated."""
    import threading

    from loader.executors import device
    from trainer import TrainConfig, train

    events = []
    place, compile_step = device.to_global_arrays, train.compile_step

    def placed(batch, sharding):
        events.append("place" if threading.current_thread() is threading.main_thread() else "place elsewhere")
        return place(batch, sharding)

    def compiled(step, state, *args):
        events.append(f"compile with the state on {sorted(d.platform for d in state['step'].devices())}")
        return compile_step(step, state, *args)

    monkeypatch.setattr(device, "to_global_arrays", placed)
    monkeypatch.setattr(train, "compile_step", compiled)
    config = TrainConfig(data=str(digits["train"]), workdir=str(tmp_path), model="mlp", steps=6, batch_size=32,
                         num_classes=10, log_every=3, checkpoint_every=100)
    summary = train.train_and_evaluate(config)
    assert summary["final_step"] == 6 and np.isfinite(summary["loss"])
    assert events == ["compile with the state on ['cpu']"] + ["place"] * 6


def test_the_rates_leave_out_the_time_a_checkpoint_takes(digits, tmp_path, monkeypatch, caplog):
    """A period's ex/s and step time are the steps' own: a checkpoint saved within it (3 s here) is logged with its
    own time, not spread over the period's steps."""
    import logging

    from trainer import TrainConfig, train

    class SlowSaves:
        def __init__(self, mngr):
            self._mngr = mngr

        def save(self, *args, **kwargs):
            time.sleep(3)
            return self._mngr.save(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self._mngr, name)

    real = train.checkpoint_manager
    monkeypatch.setattr(train, "checkpoint_manager", lambda config, **kw: SlowSaves(real(config, **kw)))
    config = TrainConfig(data=str(digits["train"]), workdir=str(tmp_path), model="mlp", steps=6, batch_size=32,
                         num_classes=10, log_every=2, checkpoint_every=2, async_checkpointing=False)
    with caplog.at_level(logging.INFO, logger="trainer.train"):
        train.train_and_evaluate(config)
    assert [r["step"] for r in _metrics(tmp_path)] == [2, 4, 6]
    # a 3 s save counted in the rates would make each step of the next period take 1.5 s; an MLP step takes ms
    assert all(r["step_time_s"] < 1.0 for r in _metrics(tmp_path)), _metrics(tmp_path)  # (room for a loaded host)
    saved = [re.fullmatch(r"step (\d+): checkpoint saved in ([\d.]+) s", r.getMessage()) for r in caplog.records]
    assert [(int(m[1]), float(m[2]) >= 3) for m in saved if m] == [(2, True), (4, True), (6, True)]


def test_the_loop_runs_with_the_setups_objects_left_out_of_garbage_collection(digits, tmp_path, monkeypatch):
    """A full collection in the loop would scan everything the imports and the setup made (tens of ms on this VM,
    more with a bigger heap): the loop runs with those objects frozen (gc.freeze), and the process collects as
    before once it ends."""
    import gc

    from trainer import TrainConfig, train

    before, frozen, compile_step = gc.get_freeze_count(), [], train.compile_step

    def compiled(*args):
        step = compile_step(*args)

        def run(state, batch):
            frozen.append(gc.get_freeze_count())
            return step(state, batch)
        return run

    monkeypatch.setattr(train, "compile_step", compiled)
    config = TrainConfig(data=str(digits["train"]), workdir=str(tmp_path), model="mlp", steps=5, batch_size=32,
                         num_classes=10, log_every=5, checkpoint_every=100)
    train.train_and_evaluate(config)
    assert len(frozen) == 5 and min(frozen) > 10_000, frozen  # JAX alone makes ~100k objects
    assert gc.get_freeze_count() == before


def _top_level_calls(trace: Path, name: str) -> int:
    """Calls of `name` in an xplane trace that no other call of it encloses (a jitted call shows as two nested
    events)."""
    from jax.profiler import ProfileData

    spans = sorted((e.start_ns, e.start_ns + e.duration_ns) for plane in ProfileData.from_file(str(trace)).planes
                   for line in plane.lines for e in line.events if e.name == name)
    calls, end = 0, -1.0
    for start, stop in spans:
        if start >= end:
            calls, end = calls + 1, stop
    return calls


def test_profile_steps_trace_those_steps_and_the_report_reads_the_trace(digits, tmp_path):
    from trainer import profile_report

    proc = train_here(*_common(digits, tmp_path, "model=mlp", "steps=8", "log_every=8", "eval_every=100",
                                "checkpoint_every=100", "profile_steps=3", "profile_skip=2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"profile of steps 3 to 5 written to {tmp_path / 'profile'}" in proc.stderr
    traces = list((tmp_path / "profile" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1
    assert _top_level_calls(traces[0], "PjitFunction(jit(train_step))") == 3
    # XLA:CPU traces no device plane: the report says so, where a GPU's or TPU's lists its operations
    assert profile_report.device_ops(str(tmp_path / "profile")) == {}
    assert profile_report.main([str(tmp_path / "profile")]) == 0
    with pytest.raises(SystemExit, match="2"):
        profile_report.main([str(tmp_path / "nothing")])


def test_profile_report_lists_operations_by_device_time():
    from trainer.profile_report import report

    ops = {"fusion.7": {"seconds": 0.02, "count": 4, "category": "loop fusion"},
           "custom-call.3": {"seconds": 0.06, "count": 4, "category": "custom-call"},
           "fusion.9": {"seconds": 0.02, "count": 8, "category": "loop fusion"}}
    assert report(ops, top=2).splitlines() == [
        " share   seconds  count  operation (category)",
        " 60.0%    0.0600      4  custom-call.3 (custom-call)",
        " 20.0%    0.0200      4  fusion.7 (loop fusion)",
        "",
        " share   seconds  category",
        " 60.0%    0.0600  custom-call",
        " 40.0%    0.0400  loop fusion",
        "total device time 0.1000 s over 3 operations"]
    assert report(ops, top=1, occupied=(0.1, 0.125)).splitlines()[-1] == (
        "the devices ran an operation 0.1000 s of the 0.1250 s from their first operation to their last (80.0%); "
        "idle between operations: 0.0250 s")
    assert report({}) == "no device operations in this trace (a CPU run traces none)"


def test_profile_report_counts_overlapping_operations_once_and_the_gaps_between_them():
    from trainer.profile_report import occupancy

    assert occupancy([(0.0, 1.0), (0.5, 1.5), (2.0, 3.0), (2.2, 2.4), (4.0, 4.5)]) == (3.0, 4.5)
    assert occupancy([]) == (0.0, 0.0)


def test_profile_settings_are_counts():
    from trainer.config import TrainConfig

    for name in ("profile_steps", "profile_skip"):
        with pytest.raises(ValueError, match=f"{name} must be >= 0 \\(got {name}=-1\\)"):
            TrainConfig(data="x", workdir="w", **{name: -1})


def test_device_goes_with_one_device_only(tmp_path):
    """device= with another strategy was ignored silently (mirrored used every device)."""
    proc = trainer_here("data=x", f"workdir={tmp_path}", "strategy=mirrored", "device=gpu:1")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: device='gpu:1' picks strategy=one_device's device; strategy='mirrored' places the step itself: drop "
        "device=, or pass strategy=one_device")


def test_profile_report_names_a_gpu_kernels_kind_by_its_name():
    from trainer.profile_report import kernel_kind

    assert [kernel_kind(name) for name in (
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "cudnn_generated_fort_native_sdpa_sm90",
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "MemcpyDtoD", "loop_add_fusion")] == [
        "matrix multiply", "attention (cuDNN)", "collective", "copy", ""]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("failing", ["compile_step", "Throughput"])  # as the step compiles; after it compiled
def test_a_failure_before_the_loop_stops_the_loaders_workers_and_closes_the_checkpoints(digits, tmp_path,
                                                                                         monkeypatch, failing):
    """An error between the loader's start and the loop (a restore, a compile, a check of the first batch) in a
    process that lives on (a notebook, a sweep): the loader's worker processes stop and the checkpoint manager is
    closed, as when the loop ends."""
    import multiprocessing

    from trainer import TrainConfig, train

    closed, real = [], train.checkpoint_manager

    def recorded(config, **kw):
        mngr = real(config, **kw)
        close = mngr.close
        mngr.close = lambda: (closed.append(True), close())[1]
        return mngr

    def workers() -> list:
        return [p for p in multiprocessing.active_children() if p.name.startswith("loader-worker")]

    started = []

    def fail(*args):
        started.extend(workers())
        raise ValueError(f"{failing} failed")

    monkeypatch.setattr(train, "checkpoint_manager", recorded)
    monkeypatch.setattr(train, failing, fail if failing == "compile_step" else type("T", (), {"of": fail}))
    config = TrainConfig(data=str(digits["train"]), workdir=str(tmp_path), model="mlp", steps=5, batch_size=32,
                         num_classes=10, data_workers=2)
    with pytest.raises(ValueError, match=f"{failing} failed"):
        train.train_and_evaluate(config)
    assert len(started) == 2, started  # the workers ran when it failed
    assert not any(p.is_alive() for p in started) and workers() == []
    assert closed == [True] and not (tmp_path / ".lease.json").exists()  # the workdir is free for the next run
