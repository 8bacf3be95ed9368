"""The sidecar evaluator: beside a training run, one eval record per checkpoint it saw, then it exits."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.trainer.conftest import run_trainer, train_here, trainer_here


def _common(digits, workdir):
    return (f"data={digits['train']}", f"eval_data={digits['test']}", f"workdir={workdir}", "model=mlp",
            "batch_size=32", "learning_rate=0.003", "num_classes=10", "steps=60", "log_every=20", "eval_every=60",
            "checkpoint_every=20")


@pytest.mark.timeout(400)
def test_evaluator_beside_training_records_each_checkpoint_it_saw_and_exits(digits, tmp_path):
    # The evaluator as a TF_CONFIG task of type "evaluator": it never joins the cluster, so the spec's other tasks
    # need not exist.
    spec = {"cluster": {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}, "task": {"type": "evaluator"}}
    evaluator = run_trainer(*_common(digits, tmp_path), "eval_timeout=300", popen=True,
                            extra_env={"TF_CONFIG": json.dumps(spec)})
    training = run_trainer(*_common(digits, tmp_path), timeout=300)
    assert training.returncode == 0, training.stderr[-3000:]
    log = evaluator.communicate(timeout=300)[0]
    assert evaluator.returncode == 0, log[-3000:]

    records = [json.loads(line) for line in (tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()]
    seen = [int(s) for s in re.findall(r"evaluator: step (\d+) eval_", log)]
    assert [r["step"] for r in records] == seen  # one record per checkpoint it evaluated, in order
    assert seen[-1] == 60 and set(seen) <= {20, 40, 60} and seen == sorted(set(seen))
    for r in records:
        assert r["eval_examples"] == 359 and r["eval_loss"] > 0 and 0 < r["eval_accuracy"] <= 1
    # the same parameters give the trainer's own final evaluation
    trained = json.loads(training.stdout)["summary"]
    assert records[-1]["eval_accuracy"] == pytest.approx(trained["eval_accuracy"], abs=1e-6)
    assert records[-1]["eval_loss"] == pytest.approx(trained["eval_loss"], rel=1e-5)
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "eval"))
    # it only read the checkpoints: orbax's iterator copied each whole into checkpoints/_SNAPSHOTS first
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["20", "40", "60"]

    # a restarted evaluator (mode=evaluate, no data= needed) has nothing left to do and says so, through a line
    # cut short at the end of its records (it stopped at a bare JSON error, at every restart)
    with open(tmp_path / "eval" / "metrics.jsonl", "a") as f:
        f.write('{"step": 80, "eval_lo')
    again = train_here(f"eval_data={digits['test']}", f"workdir={tmp_path}", "mode=evaluate", "model=mlp",
                        "num_classes=10", "steps=60", "batch_size=32", "eval_timeout=5")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "step 60 is already evaluated" in again.stderr
    assert f"line {len(records) + 1} is not a whole JSON record" in again.stderr

    # A parameter-server job's batch_size (each worker's own) need not split over the evaluator's devices: it
    # evaluated with all 4 and stopped on XLA's sharding error; it takes one. A local strategy's is one line.
    shutil.rmtree(tmp_path / "eval")
    # (No steps=: it stops after the training run's last step, saved beside the checkpoint; it waited eval_timeout.)
    evaluate = (f"eval_data={digits['test']}", f"workdir={tmp_path}", "mode=evaluate", "model=mlp", "num_classes=10",
                "batch_size=30", "eval_timeout=150")
    ps = run_trainer(*evaluate, "strategy=parameter_server", devices=4)
    assert ps.returncode == 0, ps.stderr[-3000:]
    assert "batch_size=30 does not split over this host's 4 devices: evaluating on one" in ps.stderr
    assert "step 60 is the last of the training run that wrote it (its steps=60); stopping" in ps.stderr
    assert json.loads(ps.stdout)["summary"]["eval_accuracy"] == pytest.approx(records[-1]["eval_accuracy"], abs=1e-6)
    mirrored = run_trainer(*evaluate, "strategy=mirrored", devices=4)
    assert mirrored.returncode == 2 and mirrored.stderr.strip().splitlines()[-1] == (
        "error: batch_size=30 does not split over the evaluator's num_replicas_in_sync=4 (strategy=mirrored); use a "
        "multiple of 4, or strategy=default (one device)")


_DELETED = """
import sys, jax, orbax.checkpoint as ocp
from trainer.evaluator import restore_params
meta = ocp.PyTreeCheckpointer().metadata(sys.argv[1] + "/60/state")  # the model's parameters: shapes, dtypes
tree = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
abstract = {"params": jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), tree["params"])}
try:
    print(restore_params(sys.argv[1], int(sys.argv[2]), abstract))
except Exception as e:
    print("raised", type(e).__name__)
"""


def test_a_checkpoint_deleted_before_or_while_it_is_read_is_skipped(digits, tmp_path):
    training = train_here(*_common(digits, tmp_path))
    assert training.returncode == 0, training.stderr[-3000:]
    checkpoints = tmp_path / "checkpoints"
    shutil.rmtree(checkpoints / "20")  # as max_to_keep does while the evaluator lists the steps
    # Half deleted: a deletion removes the files inside a checkpoint before its directory. Step 40 has 60 after it:
    # it is kept, and a read that fails there is an error; once 3 finished checkpoints follow it, it is being deleted.
    shutil.rmtree(checkpoints / "40" / "state" / "d")

    def restored(step):
        proc = subprocess.run([sys.executable, "-c", _DELETED, str(checkpoints), str(step)], cwd=REPO,
                              capture_output=True, text=True, timeout=120,
                              env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout.strip().splitlines()[-1], proc.stderr

    out, err = restored(20)
    assert out == "None" and "checkpoint 20 was deleted (max_to_keep) before it could be read; skipped" in err
    assert restored(40)[0].startswith("raised ")
    for step in (80, 100):  # (finished checkpoints, as far as the listing tells)
        shutil.copytree(checkpoints / "60", checkpoints / str(step))
    out, err = restored(40)
    assert out == "None" and "checkpoint 40 was deleted (max_to_keep) before it could be read; skipped" in err


@pytest.mark.gcs
def test_the_evaluator_sees_each_new_checkpoint_of_a_gs_workdir(gcs_bucket, gcs_emulator):
    """On gs://, the listing went through the file-system layer orbax uses, which keeps the listings it made: an
    evaluator beside a running trainer evaluated the checkpoints there at its start, then no other (eval_timeout,
    exit 0). A checkpoint without orbax's commit marker is not finished yet."""
    from trainer.evaluator import new_checkpoints

    bucket, client = gcs_bucket
    put = lambda name: client.bucket(bucket).blob(f"run/checkpoints/{name}").upload_from_string(b"x")  # noqa: E731
    put("1/state/_METADATA")
    put("1/commit_success.txt")
    found = new_checkpoints(f"gs://{bucket}/run/checkpoints", 0, timeout=5, poll=0.1)
    assert next(found) == 1
    put("2/state/_METADATA")  # being written
    put("3/state/_METADATA")
    put("3/commit_success.txt")
    assert next(found) == 3
    put("2/commit_success.txt")  # older than the last one seen: passed over, as tf's checkpoints_iterator does
    put("4/commit_success.txt")
    assert next(found) == 4


def test_mode_evaluate_needs_eval_data(tmp_path):
    proc = trainer_here(f"data={tmp_path}", f"workdir={tmp_path}", "mode=evaluate")
    assert proc.returncode == 2
    assert "mode=evaluate needs eval_data=" in proc.stderr


def test_evaluator_without_new_checkpoints_stops_after_its_timeout(digits, tmp_path):
    """Where no checkpoints directory ever appeared (a misspelt workdir=), it is an error: it exited 0, evaluating
    nothing."""
    evaluate = (f"eval_data={digits['test']}", f"workdir={tmp_path}", "mode=evaluate", "model=mlp", "num_classes=10",
                "steps=60", "eval_timeout=1")
    proc = train_here(*evaluate)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        f"error: no checkpoint in {tmp_path / 'checkpoints'} after eval_timeout=1s: the directory does not exist; "
        "check workdir= (the training run's)"), proc.stderr[-3000:]
    (tmp_path / "checkpoints").mkdir()  # a training run's, before its first checkpoint
    proc = train_here(*evaluate)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no new checkpoint for 1s; stopping after step 0" in proc.stderr
    assert json.loads(proc.stdout)["summary"]["checkpoints_evaluated"] == 0


def test_without_steps_the_evaluator_waits_for_the_training_runs_last_step(digits, tmp_path):
    """Without steps=, the default 1000 stopped the evaluator at the first checkpoint past step 1000 of a longer run,
    exit 0: the run's later checkpoints were never evaluated. Here the run that wrote step 1020 goes on to 1040 (its
    steps=, saved beside the checkpoint), whose checkpoint is not there yet: the evaluator waits for it."""
    trained = train_here(*_common(digits, tmp_path)[:4], "batch_size=8", "num_classes=10", "steps=1040",
                         "log_every=1040", "eval_every=1040", "checkpoint_every=1020")
    assert trained.returncode == 0, trained.stderr[-3000:]
    shutil.rmtree(tmp_path / "checkpoints" / "1040")  # (not written yet)
    evaluate = (f"eval_data={digits['test']}", f"workdir={tmp_path}", "mode=evaluate", "model=mlp", "num_classes=10",
                "eval_timeout=2")
    proc = train_here(*evaluate)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "until the training run's last step" in proc.stderr
    assert "evaluator: step 1020 eval_accuracy" in proc.stderr
    assert "no new checkpoint for 2s; stopping after step 1020" in proc.stderr

    # A model of other settings than the training run's: a partial restore loaded the arrays both have and the numbers
    # were wrong without a word (a same-shaped function), or orbax's advice on shapes was the error
    shutil.rmtree(tmp_path / "eval")
    for setting, message in (("model=cnn", "model=mlp"), ("num_classes=12", "num_classes=10")):
        other = train_here(*evaluate, setting)
        assert other.returncode == 2 and other.stderr.strip().splitlines()[-1] == (
            f"error: checkpoint 1020 in {tmp_path / 'checkpoints'} is of a model with {message} (the training run's "
            "settings): evaluate with those, as this command computes another model"), other.stderr[-3000:]


def test_a_second_evaluator_of_a_workdir_stops_in_one_line(tmp_path):
    """Two evaluators of one workdir both appended each step's results to eval/metrics.jsonl; the second now stops
    at once, naming the first."""
    (tmp_path / "eval").mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom dataset_format.lease import Lease\n"
         "with Lease(sys.argv[1], held=str):\n    print('held', flush=True)\n    time.sleep(120)",
         str(tmp_path / "eval")], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        proc = trainer_here(f"eval_data={tmp_path}", f"workdir={tmp_path}", "mode=evaluate")
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {tmp_path / 'eval'} is in use by another evaluator (host "), last
    assert f" pid {holder.pid}, since " in last and last.endswith(
        "; stop that one, or let it evaluate the checkpoints alone (.lease.json there names the process that holds "
        "it)"), last



def test_a_sigterm_stops_the_evaluator_in_one_line_and_gives_its_lease_back(digits, tmp_path):
    """A SIGTERM (a preempted sidecar) ended the evaluator without a line and left WORKDIR/eval's lease to lapse:
    the evaluator restarted by its scheduler stopped as a second one ("in use") for the next 2 minutes."""
    import signal

    proc = run_trainer(f"eval_data={digits['test']}", f"workdir={tmp_path}", "mode=evaluate", "model=mlp",
                       "num_classes=10", "steps=60", "eval_timeout=120", popen=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "evaluator: watching" in line:
            break
    assert (tmp_path / "eval" / ".lease.json").exists(), "".join(lines)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    output = "".join(lines) + out
    assert proc.returncode == 143 and "Traceback" not in output, output[-3000:]
    assert output.strip().splitlines()[-1] == (f"stopped by SIGTERM (the same command goes on after the last step in "
                                               f"{tmp_path / 'eval' / 'metrics.jsonl'})"), output[-3000:]
    assert not (tmp_path / "eval" / ".lease.json").exists()
