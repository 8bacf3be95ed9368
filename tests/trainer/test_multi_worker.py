"""multi_worker: two real processes on localhost (jax.distributed, gloo), launched from flags and from TF_CONFIG."""

import json
import re
import signal
import socket
import time

import numpy as np
import pytest

from tests.trainer.conftest import finish, run_trainer


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(args_by_process, *, cwds=None, envs=None, timeout=240):
    """Runs `python -m trainer` once per entry of `args_by_process` (a process's own key=value pairs), all at once on
    one CPU device each, in `cwds` (default: the repository), with `envs` added to each one's environment;
    returns (returncode, stdout, stderr) of each."""
    import subprocess
    import sys

    from tests.conftest import REPO

    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    procs = [subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=(cwds or [REPO] * len(args_by_process))[i],
                              env={**env, **((envs or {})[i] if envs else {})}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for i, args in enumerate(args_by_process)]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]


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
    args, envs = [], []
    for i in range(2):
        if launch == "flags":
            extra, env = (f"coordinator_address=127.0.0.1:{port}", "num_processes=2", f"process_id={i}"), {}
        else:
            spec = {"cluster": {"worker": [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]},
                    "task": {"type": "worker", "index": i}}
            extra, env = (), {"TF_CONFIG": json.dumps(spec)}
        args.append((*common, f"workdir={tmp_path / 'multi'}", "strategy=multi_worker", *extra))
        envs.append(env)
    results = _job(args, envs=envs)
    assert all(code == 0 for code, _, _ in results), results[0][2][-2000:] + results[1][2][-2000:]
    (_, out0, err0), (_, out1, err1) = results
    assert "strategy=multi_worker num_replicas_in_sync=2" in err0 and "process=1/2" in err1
    # stdout holds the summary alone (gloo's "[Gloo] Rank 0 is connected to 1 peer ranks" goes to stderr)
    assert json.loads(out0)["summary"]["final_step"] == json.loads(out1)["summary"]["final_step"] == 15
    assert "[Gloo]" in err0 + err1
    np.testing.assert_allclose(_losses(tmp_path / "multi"), _losses(tmp_path / "single"), rtol=1e-5)
    single_eval = json.loads((tmp_path / "single" / "metrics.jsonl").read_text().splitlines()[-1])
    multi_eval = json.loads((tmp_path / "multi" / "metrics.jsonl").read_text().splitlines()[-1])
    assert multi_eval["eval_examples"] == single_eval["eval_examples"] == 359
    assert multi_eval["eval_accuracy"] == pytest.approx(single_eval["eval_accuracy"], abs=1e-6)


@pytest.mark.slow  # 24 s; the gs:// workdir test (tests/trainer/test_workdir.py) preempts two processes by default
@pytest.mark.timeout(400)
@pytest.mark.parametrize("sent", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
                         ids=["SIGTERM", "SIGINT"])  # (SIGINT: ~25 s more; a Ctrl-C's own exit is tested alone)
def test_sigterm_to_one_process_stops_both_at_one_step_and_resume_matches(digits, tmp_path, sent):
    """A preemption notice that reaches process 1 only: both processes save at the same step and exit
    cleanly (JAX's preemption service agrees on the step); resuming both gives the uninterrupted losses. A Ctrl-C
    (SIGINT) to process 1 does the same (it sends itself the notice), and that process exits 130: it was
    a bare KeyboardInterrupt there, and both processes waited minutes for each other before JAX aborted them.

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
        procs[1].send_signal(sent)  # process 0 gets no signal
    finally:
        outputs = finish(procs, timeout=200)  # (a process left waiting in a collective must not outlive the test)
    # both exit as preempted (128 + SIGTERM), the one that got no signal too: the job was preempted; a Ctrl-C's
    # process as interrupted (128 + SIGINT)
    assert [p.returncode for p in procs] == [143, 128 + sent], outputs[0][-2000:] + outputs[1][-2000:]
    reason = "SIGTERM" if sent == signal.SIGTERM else "Ctrl-C"
    stops = [re.findall(rf"{why}: saved a checkpoint at step (\d+)", out)
             for why, out in zip(("SIGTERM", reason), outputs)]
    assert stops[0] == stops[1] and len(stops[0]) == 1, stops
    stopped_at = int(stops[0][0])
    assert stopped_at >= 10
    end = stopped_at + 10  # no schedule depends on `steps`: the losses up to `end` are those of a run to `end`

    procs = launch(end)
    outputs = finish(procs, timeout=200)
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
    outputs = finish(procs, timeout=240)
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


@pytest.mark.parametrize("started", [0, 1])
def test_a_process_that_never_joins_ends_the_other_after_join_timeout_with_the_cause_last(tmp_path, started):
    """Process 1 never started (process 0 waits for it), or process 0 never started (process 1 finds no coordinator):
    after join_timeout the one started ends, exit 1, its last line the cause. It was JAX's abort, a C++ stack with
    `DEADLINE_EXCEEDED ... RegisterTask` for a last line."""
    begun = time.monotonic()
    [(code, out, err)] = _job([_two(("data=unused", f"workdir={tmp_path}", "join_timeout=3"), port=_port())[started]],
                              timeout=120)
    assert code == 1 and out == "", err[-3000:]
    assert f"joining a job of 2 processes as process {started}" in err and "each waits up to 3 s" in err
    assert err.strip().splitlines()[-1] == (
        "error: the job's processes did not all join within 3 s (join_timeout=): one was not started, cannot reach "
        "process 0's coordinator_address, or has another coordinator_address or num_processes; start every process, "
        "process_id 0 to num_processes - 1 once each, with the same coordinator_address and num_processes"), err
    # (a fresh process: ~8 s of imports, more on a loaded host; JAX's own wait would be minutes)
    assert "Check failure stack trace" not in err and time.monotonic() - begun < 90


@pytest.mark.parametrize("sent, code, said", [(signal.SIGTERM, 143, "stopped by SIGTERM"),
                                              (signal.SIGINT, 130, "interrupted")])
def test_a_sigterm_or_ctrl_c_while_joining_ends_the_process_at_once(tmp_path, sent, code, said):
    """The main thread waits in jax.distributed.initialize (C++), where no Python handler runs: a SIGTERM or Ctrl-C
    did nothing until join_timeout (300 s by default), then exit 1."""
    import subprocess
    import sys

    from tests.conftest import REPO

    log = tmp_path / "err.txt"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "trainer", *_two(("data=unused", f"workdir={tmp_path / 'w'}",
                                                                         "join_timeout=200"), port=_port())[0]],
                                cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 120
        while "joining a job of 2" not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(1.0)  # inside jax.distributed.initialize
        begun = time.monotonic()
        proc.send_signal(sent)
        assert proc.wait(timeout=60) == code, log.read_text()[-3000:]
        assert time.monotonic() - begun < 10
    finally:
        proc.kill()
    assert log.read_text().strip().splitlines()[-1] == (
        f"{said} while joining the job, before anything ran (nothing saved; the same command starts it again)")


def _two(common, *, port, each=((), ())):
    return [(*common, "strategy=multi_worker", f"coordinator_address=127.0.0.1:{port}", "num_processes=2",
             f"process_id={i}", *each[i]) for i in range(2)]


@pytest.mark.timeout(300)
def test_processes_with_different_settings_stop_together_in_one_line(digits, tmp_path):
    """batch_size=32 on one process and 64 on the other trained on wrong values, then hung in a collective for good;
    now both stop before anything is read, exit 2, one line naming the setting and its value on each."""
    common = (f"data={digits['train']}", "model=mlp", "steps=4", "num_classes=10", f"workdir={tmp_path / 'run'}")
    results = _job(_two(common, port=_port(), each=(("batch_size=32",), ("batch_size=64", "seed=7"))))
    for code, out, err in results:
        assert code == 2, err[-3000:]
        assert err.strip().splitlines()[-1] == (
            "error: the job's processes were started with different settings: batch_size: 32 on process 0, 64 on "
            "process 1; seed: 0 on process 0, 7 on process 1; start every process with the same settings (only "
            "process_id differs)")
        assert out == ""
    assert not (tmp_path / "run" / "checkpoints").exists() or not list((tmp_path / "run" / "checkpoints").iterdir())


@pytest.mark.timeout(300)
def test_a_workdir_each_host_has_alone_is_one_line_on_every_process(digits, tmp_path):
    """The same relative workdir= from two directories, as one path on each host's own disk: checkpoints never
    finished, and the job hung; now both stop at once, exit 2, naming the process that does not see process 0's."""
    common = (f"data={digits['train']}", "model=mlp", "steps=4", "num_classes=10", "workdir=run")
    cwds = [tmp_path / "host0", tmp_path / "host1"]
    for cwd in cwds:
        cwd.mkdir()
    for code, _, err in _job(_two(common, port=_port()), cwds=cwds):
        assert code == 2, err[-3000:]
        assert err.strip().splitlines()[-1] == (
            "error: workdir=run is not one directory for the whole job: process(es) 1 do not see the file process 0 "
            "wrote there; give every process a workdir they all share (gs://bucket/run, or a mounted NFS/Filestore "
            "path)")


@pytest.mark.timeout(300)
def test_a_workdir_one_host_cannot_make_or_other_devices_stop_every_process_in_one_line(digits, tmp_path):
    """A workdir under a file on one host: that process ended in a traceback, the other waited ~100 s for it and
    ended in JAX's C++ abort. Hosts of different device counts: orbax's "cannot reshape array of size 3"."""
    common = (f"data={digits['train']}", "model=mlp", "steps=4", "num_classes=10", "workdir=blk/run")
    cwds = [tmp_path / "host0", tmp_path / "host1"]
    for cwd in cwds:
        cwd.mkdir()
    (cwds[1] / "blk").write_text("a file where a directory goes")
    (code0, _, err0), (code1, _, err1) = _job(_two(common, port=_port()), cwds=cwds)
    assert (code0, code1) == (2, 2), err0[-2000:] + err1[-2000:]
    mine = err1.strip().splitlines()[-1]
    assert mine == ("error: workdir=blk/run cannot be made or written here (NotADirectoryError: Not a directory); give "
                    "a directory this process can write (a path under a file, or a read-only mount, cannot hold the "
                    "run)"), err1[-2000:]
    assert err0.strip().splitlines()[-1] == f"error: process 1 stopped in its workdir: ValueError: {mine[7:]}"

    common = (f"data={digits['train']}", "model=mlp", "steps=4", "num_classes=10", f"workdir={tmp_path / 'run'}")
    two = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    for code, _, err in _job(_two(common, port=_port()), envs=[two, {}]):
        assert code == 2, err[-3000:]
        assert err.strip().splitlines()[-1] == (
            "error: the job's processes have different numbers of devices: 2 on process 0, 1 on process 1; every host "
            "needs as many (the same machine type, and CUDA_VISIBLE_DEVICES or XLA_FLAGS alike on each)")


@pytest.mark.timeout(300)
def test_data_missing_on_one_host_stops_every_process_in_one_line(digits, tmp_path):
    """The same relative data= from two directories, present under one only: the process without it said so and
    waited, the other waited in a collective, and JAX aborted both minutes later; now both stop at once, exit 2, the
    other naming the process that failed and why."""
    import shutil

    cwds = [tmp_path / "host0", tmp_path / "host1"]
    for cwd in cwds:
        cwd.mkdir()
    shutil.copytree(digits["train"], cwds[0] / "train")
    common = ("data=train", "model=mlp", "steps=4", "num_classes=10", f"workdir={tmp_path / 'run'}")
    (code0, _, err0), (code1, _, err1) = _job(_two(common, port=_port()), cwds=cwds)
    assert (code0, code1) == (2, 2), err0[-2000:] + err1[-2000:]
    mine = err1.strip().splitlines()[-1]
    assert mine.startswith("error: data=train: ") and "no such file or directory" in mine, mine
    assert err0.strip().splitlines()[-1] == f"error: process 1 stopped in its setup: FileNotFoundError: {mine[7:]}"


@pytest.mark.timeout(300)
def test_a_host_whose_copy_of_the_data_is_another_stops_every_process_in_one_line(digits, tmp_path):
    """The same relative data= from two directories, one holding another conversion (its test split): each process
    planned its own global order over its own records and the job trained on; now both stop at once, exit 2, naming
    what each process sees. Copies of one conversion on each host (other inodes and times) are one dataset."""
    import shutil

    cwds = [tmp_path / "host0", tmp_path / "host1", tmp_path / "host2"]
    for cwd, split in zip(cwds, ("train", "test", "train")):
        shutil.copytree(digits[split], cwd / "train")
    common = ("data=train", "model=mlp", "steps=4", "num_classes=10", "batch_size=32")
    results = _job(_two((*common, f"workdir={tmp_path / 'run'}"), port=_port()), cwds=cwds[:2])
    for code, out, err in results:
        assert code == 2, err[-3000:]
        assert err.strip().splitlines()[-1] == (
            "error: data=train: the job's processes see different data (process 0: 2 shard(s) of 1,438 records; "
            "process 1: 2 shard(s) of 359 records); every process must read the same conversion: a copy on each "
            "host made from one conversion, or one gs:// dataset not rewritten while the job starts"), err[-3000:]
        assert out == ""
    results = _job(_two((*common, f"workdir={tmp_path / 'run2'}"), port=_port()), cwds=cwds[::2])
    assert [code for code, _, _ in results] == [0, 0], results[0][2][-3000:] + results[1][2][-3000:]


def test_job_settings_go_with_multi_worker_and_a_host_and_port():
    from trainer import TrainConfig

    with pytest.raises(ValueError, match=re.escape(
            "coordinator_address=10.0.0.2:1234, num_processes=2, process_id=0: these join processes into one job "
            "under strategy=multi_worker only, and this run has strategy=mirrored: pass strategy=multi_worker, or "
            "drop coordinator_address=, num_processes=, process_id=")):
        TrainConfig(data="d", workdir="w", strategy="mirrored", coordinator_address="10.0.0.2:1234", num_processes=2,
                    process_id=0)
    with pytest.raises(ValueError, match=re.escape(
            "coordinator_address='10.0.0.2' is not HOST:PORT: give process 0's host and a free port, e.g. "
            "coordinator_address=10.0.0.2:1234")):
        TrainConfig(data="d", workdir="w", strategy="multi_worker", coordinator_address="10.0.0.2", num_processes=2,
                    process_id=0)
    with pytest.raises(ValueError, match=re.escape("process_id=2 is not one of the job's 0..1 (num_processes=2)")):
        TrainConfig(data="d", workdir="w", strategy="multi_worker", coordinator_address="h:1", num_processes=2,
                    process_id=2)
    with pytest.raises(ValueError, match=re.escape("join_timeout must be > 0 seconds (got join_timeout=0)")):
        TrainConfig(data="d", workdir="w", strategy="multi_worker", join_timeout=0)


@pytest.mark.timeout(300)
def test_a_process_killed_mid_run_ends_the_others_at_once_with_the_cause_last(digits, tmp_path):
    """SIGKILL to process 1 (the out-of-memory killer, a lost host): process 0 printed the collective's error, then
    waited ~80 s in jax.distributed's shutdown barrier and aborted with a C++ stack after it; now it exits 1 at once,
    its last line the error and which process to look at."""
    import subprocess
    import sys

    from tests.conftest import REPO

    port, workdir = _port(), tmp_path / "run"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for args in _two((f"data={digits['train']}", "model=mlp", "steps=100000", "num_classes=10",
                               "log_every=1", "checkpoint_every=100000", f"workdir={workdir}"), port=port)]
    try:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and not ((workdir / "metrics.jsonl").exists() and
                                                   len((workdir / "metrics.jsonl").read_text().splitlines()) >= 5):
            time.sleep(0.05)
        procs[1].kill()
        killed = time.monotonic()
        _, err = procs[0].communicate(timeout=120)
        took = time.monotonic() - killed
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == 1, err[-3000:]
    assert took < 30, took
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: JaxRuntimeError: ") and "Gloo" in last, err[-3000:]
    assert last.endswith(" (process 0 lost another process of the job in a collective: that process's own log has "
                         "the cause; restart every process and they resume from the last checkpoint)"), last
