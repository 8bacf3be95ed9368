"""multi_worker: two real processes on localhost (jax.distributed, gloo), launched from flags and from TF_CONFIG."""

import json
import re
import signal
import socket
import time

import numpy as np
import pytest

from tests.trainer.conftest import run_trainer


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(workdir):
    return [json.loads(line)["loss"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("launch", ["flags", pytest.param("tf_config", marks=pytest.mark.slow)])
@pytest.mark.timeout(300)
def test_two_processes_agree_with_one(digits, tmp_path, launch):
    common = (f"data={digits['train']}", f"eval_data={digits['test']}", "model=mlp", "steps=15", "log_every=1",
              "eval_every=15", "checkpoint_every=15", "batch_size=32", "learning_rate=0.003", "num_classes=10")
    single = run_trainer(*common, f"workdir={tmp_path / 'single'}", "strategy=mirrored", devices=2)
    assert single.returncode == 0, single.stderr[-2000:]

    port = _port()
    procs = []
    for i in range(2):
        if launch == "flags":
            extra, env = (f"coordinator_address=127.0.0.1:{port}", "num_processes=2", f"process_id={i}"), None
        else:
            spec = {"cluster": {"worker": [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]},
                    "task": {"type": "worker", "index": i}}
            extra, env = (), {"TF_CONFIG": json.dumps(spec)}
        procs.append(run_trainer(*common, f"workdir={tmp_path / 'multi'}", "strategy=multi_worker", *extra,
                                 popen=True, extra_env=env))
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs[0][-2000:] + outputs[1][-2000:]
    assert "strategy=multi_worker num_replicas_in_sync=2" in outputs[0] and "process=1/2" in outputs[1]
    np.testing.assert_allclose(_losses(tmp_path / "multi"), _losses(tmp_path / "single"), rtol=1e-5)
    single_eval = json.loads((tmp_path / "single" / "metrics.jsonl").read_text().splitlines()[-1])
    multi_eval = json.loads((tmp_path / "multi" / "metrics.jsonl").read_text().splitlines()[-1])
    assert multi_eval["eval_examples"] == single_eval["eval_examples"] == 359
    assert multi_eval["eval_accuracy"] == pytest.approx(single_eval["eval_accuracy"], abs=1e-6)


@pytest.mark.slow  # 24 s; the gs:// workdir test (tests/trainer/test_workdir.py) preempts two processes by default
@pytest.mark.timeout(400)
def test_sigterm_to_one_process_stops_both_at_one_step_and_resume_matches(digits, tmp_path):
    """A preemption notice that reaches process 1 only: both processes save at the same step and exit
    cleanly (JAX's preemption service agrees on the step); resuming both gives the uninterrupted losses.

    The interrupted run asks for far more steps than it can run in the test's time, so it ends only through
    the notice, however fast the machine (the service takes a moment to agree on a step: with a short run,
    a fast machine finished before it did)."""
    common = ("model=mlp", "log_every=1", "checkpoint_every=100000", "batch_size=32", "learning_rate=0.003",
              "num_classes=10")
    multi = tmp_path / "multi"

    def launch(steps):
        port = _port()
        return [run_trainer(f"data={digits['train']}", *common, f"steps={steps}", f"workdir={multi}",
                            "strategy=multi_worker", f"coordinator_address=127.0.0.1:{port}", "num_processes=2",
                            f"process_id={i}", popen=True) for i in range(2)]

    procs = launch(100000)
    metrics = multi / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 10):
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGTERM)  # process 0 gets no signal
        outputs = [p.communicate(timeout=200)[0] for p in procs]
    finally:
        for p in procs:  # a process left waiting in a collective must not outlive the test
            p.kill()
    # both exit as preempted (128 + SIGTERM), the one that got no signal too: the job was preempted
    assert [p.returncode for p in procs] == [143, 143], outputs[0][-2000:] + outputs[1][-2000:]
    stops = [re.findall(r"SIGTERM: saved a checkpoint at step (\d+)", out) for out in outputs]
    assert stops[0] == stops[1] and len(stops[0]) == 1, stops
    stopped_at = int(stops[0][0])
    assert stopped_at >= 10
    end = stopped_at + 10  # no schedule depends on `steps`: the losses up to `end` are those of a run to `end`

    procs = launch(end)
    outputs = [p.communicate(timeout=200)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs[0][-2000:] + outputs[1][-2000:]
    assert f"resumed from step {stopped_at}" in outputs[0] and f"resumed from step {stopped_at}" in outputs[1]
    got = {}
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        got[record["step"]] = record["loss"]
    assert sorted(got) == list(range(1, end + 1))

    single = run_trainer(f"data={digits['train']}", *common, f"steps={end}", f"workdir={tmp_path / 'single'}",
                         "strategy=mirrored", devices=2)
    assert single.returncode == 0, single.stderr[-2000:]
    np.testing.assert_allclose([got[s] for s in range(1, end + 1)], _losses(tmp_path / "single"), rtol=1e-5)


@pytest.fixture(scope="module")
def stock_gcs(tmp_path_factory):
    """The GCS emulator as its package starts it (HTTP/1.0, one connection at a time, an accept queue of 5)."""
    from tests import emulator

    with emulator.running(tmp_path_factory.mktemp("stock-gcloud"), stock=True) as env:
        yield env


@pytest.mark.gcs
@pytest.mark.timeout(300)
def test_two_processes_train_on_gs_data_from_the_stock_emulator(digits, tmp_path, stock_gcs):
    """Two hosts read the same gs:// dataset at once from the stock emulator, whose every answer closes its
    connection: each trains, and their losses are the same global ones."""
    from google.cloud import storage

    from tests.emulator import upload_files

    client = storage.Client(project="test")
    client.create_bucket("stock")
    data = upload_files(client, "stock", digits["train"], "digits-train")
    port = _port()
    common = (f"data={data}", "model=mlp", "steps=12", "log_every=4", "checkpoint_every=12", "batch_size=32",
              "learning_rate=0.003", "num_classes=10", f"workdir={tmp_path / 'multi'}", "strategy=multi_worker",
              f"coordinator_address=127.0.0.1:{port}", "num_processes=2")
    procs = [run_trainer(*common, f"process_id={i}", popen=True, extra_env=stock_gcs) for i in range(2)]
    started = time.monotonic()
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs[0][-2000:] + outputs[1][-2000:]
    assert not any("retrying" in out for out in outputs), outputs  # no connection refused, reset or timed out
    losses = _losses(tmp_path / "multi")
    assert len(losses) == 3 and all(np.isfinite(losses)) and time.monotonic() - started < 200


def test_multi_worker_without_a_cluster_says_how_to_name_one(tmp_path):
    """No coordinator_address, no TF_CONFIG, no cluster JAX detects: JAX's own words were "coordinator_address should
    be defined"."""
    from tests.trainer.conftest import run_trainer

    proc = run_trainer("data=unused", f"workdir={tmp_path}", "strategy=multi_worker")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: strategy=multi_worker found no cluster to join: pass coordinator_address=HOST:PORT (process 0's) "
        "num_processes=N process_id=I to every process, or set TF_CONFIG, or launch on a cluster JAX finds by itself "
        "(TPU VMs, Slurm, GKE, ...); on one host use strategy=mirrored")
