"""strategy=parameter_server on a local Ray cluster: the partitioner, training digits, a worker SIGKILLed mid-run,
the coordinator SIGKILLed and rerun."""

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from tests.conftest import REPO
from tests.trainer.conftest import finish, run_trainer
from trainer.parameter_server import Shard, assemble, partition, split

pytest.importorskip("ray")


def test_min_size_partitioner_shards_large_variables_and_deals_out_the_rest():
    shapes = {"embed": ((1000, 64), np.float32),  # 256,000 B: 3 shards of 64 KiB would fit, 2 ps cap it at 2
              "bias": ((10,), np.float32),  # 40 B: whole
              "scale": ((), np.float32),  # a scalar: whole
              "wide": ((3, 100_000), np.float32),  # 1.2 MB, 3 rows: 2 shards, as even as rows allow
              "small": ((100, 100), np.float32)}  # 40,000 B < 64 KiB: whole
    shards = partition(shapes, num_ps=2, min_shard_bytes=64 << 10)
    assert shards == [Shard("embed", 0, 0, 500, (500, 64)), Shard("embed", 1, 500, 1000, (500, 64)),
                      Shard("bias", 0, 0, 10, (10,)), Shard("scale", 1, 0, 1, ()),
                      Shard("wide", 0, 0, 2, (2, 100_000)), Shard("wide", 1, 2, 3, (1, 100_000)),
                      Shard("small", 0, 0, 100, (100, 100))]
    # one ps: nothing is cut
    assert [s.shape for s in partition(shapes, num_ps=1, min_shard_bytes=64 << 10)] == [
        (1000, 64), (10,), (), (3, 100_000), (100, 100)]
    rng = np.random.default_rng(0)
    flat = {name: rng.normal(size=shape).astype(np.float32) for name, (shape, _) in shapes.items()}
    parts = split(flat, shards, 2)
    assert sorted(parts[1]) == ["embed[500:1000]", "scale[0:1]", "wide[2:3]"]
    back = assemble(parts, shards)
    assert all(np.array_equal(back[k], flat[k]) for k in flat)


def _args(digits, workdir, steps, *extra):
    return (f"data={digits['train']}", f"eval_data={digits['test']}", f"workdir={workdir}", "model=mlp",
            "strategy=parameter_server", "num_workers=2", "num_ps=2", "ps_min_shard_bytes=16384", "batch_size=32",
            "learning_rate=0.003", "num_classes=10", f"steps={steps}", "log_every=50", "eval_every=1000000",
            "checkpoint_every=100", *extra)


def _read_until(proc, pattern, lines):
    for line in proc.stdout:
        lines.append(line)
        found = re.search(pattern, line)
        if found:
            return found
    raise AssertionError(f"the run ended before {pattern!r}:\n" + "".join(lines)[-3000:])


class _Stepper:
    """A worker for the coordinator alone: a step takes 0.2 s and returns its id."""

    def __init__(self, index, loader_state):
        self.index = index

    def pid(self):
        return os.getpid()

    def node(self):
        import ray

        return ray.get_runtime_context().get_node_id()

    def step(self, step_id):
        time.sleep(0.2)
        return {"step": step_id, "worker": self.index, "loss": 0.0, "loader": {"after": step_id}}


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster of a head alone, connected to: a test adds the nodes it needs."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 100 << 20,
                                                             "include_dashboard": False})
    ray.init(address=cluster.address)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


class _NoData(_Stepper):
    def __init__(self, index, loader_state):
        if index == 1:
            raise ValueError("no data at /nowhere on this node")
        super().__init__(index, loader_state)


@pytest.mark.timeout(120)
def test_a_worker_whose_init_raises_stops_the_coordinator_at_once_with_the_cause_last(ray_cluster):
    """A worker's __init__ that raises (its data missing on its node) would raise again: one error, not retried."""
    import ray

    from trainer import parameter_server

    remote = ray.remote(_NoData).options(num_cpus=0, max_restarts=0)
    with pytest.raises(RuntimeError, match=r"(?s)^worker 1 could not start: .*ValueError: no data at /nowhere on "
                                           r"this node$"):
        parameter_server.Coordinator(lambda i, state: remote.remote(i, state), [None, None])


@pytest.mark.timeout(240)
def test_a_lost_workers_replacement_that_cannot_be_placed_leaves_the_steps_to_the_placed_ones(ray_cluster, caplog,
                                                                                               monkeypatch):
    """TF_CONFIG's layout: a node a worker, each offering one 'worker'. A worker's node lost, its replacement has
    nowhere to go: its step was given to the replacement, and join() waited for it for ever without a line."""
    import ray

    from trainer import parameter_server

    monkeypatch.setattr(parameter_server, "STALL_SECONDS", 0.5)
    nodes = [ray_cluster.add_node(num_cpus=1, resources={"worker": 1}, object_store_memory=100 << 20)
             for _ in range(2)]
    ray_cluster.wait_for_nodes()
    try:
        remote = ray.remote(_Stepper).options(num_cpus=0, resources={"worker": 1}, max_restarts=0)
        coordinator = parameter_server.Coordinator(lambda i, state: remote.remote(i, state), [None, None])
        for step in range(1, 5):
            coordinator.schedule(step)
        first = list(coordinator.join())
        assert sorted(r["step"] for r in first) == [1, 2, 3, 4]
        lost = ray.get(coordinator.workers[1].node.remote())
        ray_cluster.remove_node(next(n for n in nodes if n.node_id == lost))
        nodes = [n for n in nodes if n.node_id != lost]
        with caplog.at_level(logging.INFO, logger="trainer.parameter_server"):
            for step in range(5, 13):
                coordinator.schedule(step)
            results = list(coordinator.join())
        assert sorted(r["step"] for r in results) == list(range(5, 13))  # each once: at-least-once, none lost
        assert {r["worker"] for r in results} == {0}
        before = [r["step"] for r in first if r["worker"] == 1]
        assert coordinator.loader_states == [{"after": results[-1]["step"]}, {"after": before[-1]}]  # (its last)
        assert re.search(r"worker 1 died during step \d+ \(\w+\); the step is queued again and the worker replaced",
                         caplog.text), caplog.text
        assert re.search(r"worker 1 is not placed after 0.5s: the cluster has no room for it .*; the 1 placed "
                         r"worker\(s\) run the steps meanwhile", caplog.text), caplog.text
    finally:
        for node in nodes:
            ray_cluster.remove_node(node)


@pytest.mark.timeout(400)
def test_trains_digits_and_finishes_after_a_worker_is_killed(digits, tmp_path):
    proc = run_trainer(*_args(digits, tmp_path, 400, "warmup_steps=50"), popen=True)
    lines = []
    pid = int(_read_until(proc, r"worker 1: pid (\d+)", lines).group(1))
    assert re.search(r"ps 0 \(pid \d+\) holds", "".join(lines)) and "['Dense_0']['kernel'][32, 256]" in "".join(lines)
    _read_until(proc, r"step 100/400", lines)
    os.kill(pid, signal.SIGKILL)
    out = "".join(lines) + proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-3000:]
    assert re.search(r"worker 1 died during step \d+ \(ActorDiedError\); the step is queued again", out), out[-3000:]
    assert "worker 1: replaced" in out
    summary = json.loads(out[out.index("{\n"):])["summary"]
    assert summary["final_step"] == 400 and summary["workers_replaced"] == 1
    assert summary["eval_accuracy"] >= 0.90, summary
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(50, 401, 50))
    # asynchronous: the other worker's updates land between a pull and a push
    assert all(r["staleness_max"] >= 0 for r in records) and max(r["staleness_max"] for r in records) >= 1
    assert records[-1]["workers_replaced"] == 1
    # each ps's learning rate at its 50th update, in warmup (49 of 50 steps from 0), and the log line's
    assert records[0]["learning_rate"] == pytest.approx(0.003 * 49 / 50)
    assert records[2]["learning_rate"] == pytest.approx(0.003)
    assert re.search(r"step 50/400 loss .* ex/s lr 0\.00294\n", out), out[-3000:]


@pytest.mark.slow  # ~30 s
@pytest.mark.timeout(300)
def test_a_dead_ps_stops_the_run_naming_it_and_the_checkpoint_a_rerun_resumes_from(digits, tmp_path):
    """It was `error: RayTaskError(ActorDiedError): ray::Worker.step() (pid=...)`: a worker's failure, the ps
    unnamed."""
    proc = run_trainer(*_args(digits, tmp_path, 3000), popen=True)
    lines = []
    ps = int(_read_until(proc, r"ps 1 \(pid (\d+)\) holds", lines).group(1))
    _read_until(proc, r"step 150/3000", lines)
    os.kill(ps, signal.SIGKILL)
    out = "".join(lines) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 1, out[-3000:]
    saved = max(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit())
    assert saved >= 100
    assert out.strip().splitlines()[-1] == (
        f"error: ParameterServerLost: ps 1 (pid {ps}) died (ActorDiedError): the updates it applied since the last "
        f"checkpoint died with it, so the run stops, as tf's does; the same command resumes from the checkpoint at "
        f"step {saved}"), out[-3000:]


@pytest.mark.slow
def test_labels_outside_num_classes_stop_the_run_before_a_step_with_the_cause(digits, tmp_path):
    """The labels' range over the whole dataset is checked as the synchronous loop's is, before any worker starts:
    the run exits 2, its last line the cause (raised in a Ray actor, it would end in Ray's traceback, or be retried
    as a dead worker)."""
    proc = run_trainer(*_args(digits, tmp_path, 20, "num_classes=9"))
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert last.endswith("(its manifest), outside 0..8 (num_classes=9): set num_classes=10 (or check label_key=)"), last
    assert "worker 0" not in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_coordinator_killed_then_rerun_resumes_from_its_checkpoint(digits, tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "trainer", *_args(digits, tmp_path, 600)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines = []
    _read_until(proc, r"step 300/600", lines)
    os.kill(proc.pid, signal.SIGKILL)  # the coordinator only
    proc.wait(timeout=30)
    time.sleep(1)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # then what was left of its local Ray cluster, as if the machine went
    except ProcessLookupError:
        pass
    saved = sorted(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit())
    assert saved and saved[-1] >= 200

    rerun = run_trainer(*_args(digits, tmp_path, 600), timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resumed from step {saved[-1]}" in rerun.stderr
    summary = json.loads(rerun.stdout)["summary"]
    assert summary["final_step"] == 600 and summary["eval_accuracy"] >= 0.90
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(50, 601, 50))  # the killed run's records after the checkpoint were dropped

    # the sidecar evaluator reads a parameter-server checkpoint like any other: the same final numbers
    evaluated = run_trainer(f"eval_data={digits['test']}", f"workdir={tmp_path}", "mode=evaluate", "model=mlp",
                            "num_classes=10", "steps=600", "batch_size=32", "eval_timeout=5")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    record = json.loads((tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 600 and record["eval_accuracy"] == pytest.approx(summary["eval_accuracy"], abs=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("sig, to, status, reason", [(signal.SIGTERM, "coordinator", 143, "SIGTERM"),
                                                     (signal.SIGINT, "group", 130, "Ctrl-C")])
def test_sigterm_or_ctrl_c_saves_after_the_running_steps_and_a_rerun_resumes(digits, tmp_path, sig, to, status,
                                                                                reason):
    """A preemption notice to the coordinator, or a Ctrl-C in its terminal (to its local Ray cluster too): the
    steps running finish, a checkpoint is saved at their count, the exit status says why; Ray's own handler ended
    the process with no checkpoint."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "trainer", *_args(digits, tmp_path, 600, "checkpoint_every=1000")]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "step 150/600" in line:
            break
    (os.kill if to == "coordinator" else os.killpg)(proc.pid, sig)
    out, err = proc.communicate(timeout=120)
    err = "".join(lines) + err
    assert proc.returncode == status, err[-3000:]
    summary = json.loads(out)["summary"]
    stopped = summary["final_step"]
    assert summary["preempted"] and summary["stopped_by"] == reason and 150 <= stopped < 600, summary
    assert err.strip().splitlines()[-1].endswith(
        f"{reason}: saved a checkpoint at step {stopped}; exiting (the same command resumes from it)"), err[-2000:]
    assert sorted(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit()) == [stopped]
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["step"] == stopped

    rerun = run_trainer(*_args(digits, tmp_path, 600, "checkpoint_every=1000"), timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resumed from step {stopped}" in rerun.stderr
    assert json.loads(rerun.stdout)["summary"]["final_step"] == 600
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [*range(50, stopped, 50), stopped, *range(stopped // 50 * 50 + 50, 601, 50)], steps


def test_ps_tasks_need_the_parameter_server_strategy(digits, tmp_path):
    spec = {"cluster": {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}, "task": {"type": "worker", "index": 0}}
    proc = run_trainer(f"data={digits['train']}", f"workdir={tmp_path}", "strategy=mirrored",
                       extra_env={"TF_CONFIG": json.dumps(spec)})
    assert proc.returncode == 2
    assert "TF_CONFIG lists ps tasks, but strategy='mirrored'; use strategy=parameter_server" in proc.stderr
    bad = run_trainer(f"data={digits['train']}", f"workdir={tmp_path}", "strategy=parameter_server",
                      "optimizer=adafactor", extra_env={"RAY_AUTH_MODE": "token"})
    assert bad.returncode == 2 and "adafactor" in bad.stderr and "use optimizer=adam" in bad.stderr


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return True
    except OSError:
        return False


def _named_head(port: int) -> bool:
    """Whether Ray's address file (/tmp/ray/ray_current_cluster) names a head on `port`."""
    from ray._common.utils import get_ray_address_file

    try:
        with open(get_ray_address_file(None)) as f:
            return f.read().strip().rpartition(":")[2] == str(port)
    except FileNotFoundError:
        return False


@pytest.mark.slow  # ~40-60 s on 2 cores; a TF_CONFIG cluster's other tests are slow-marked too
@pytest.mark.timeout(200)
def test_a_tf_config_chief_killed_while_its_tasks_join_takes_its_ray_head_with_it(digits, tmp_path):
    """SIGKILL to the chief (no `finally` runs): the Ray head it started, in a session of its own, was left running
    (and the tasks with it); now the head's watch sees the chief's pipe close and stops it. A port already answering
    is refused in one line: the chief joined whatever answered there, and nobody stopped it."""
    port = _free_port()
    spec = {"cluster": {"chief": [f"127.0.0.1:{port}"], "worker": ["127.0.0.1:1"]}, "task": {"type": "chief", "index": 0}}
    env = {"TF_CONFIG": json.dumps(spec), "RAY_AUTH_TOKEN": "0123456789abcdef" * 4}
    args = [a for a in _args(digits, tmp_path, 300) if not a.startswith(("num_workers", "num_ps"))]
    chief = run_trainer(*args, popen=True, extra_env=env)
    try:
        _read_until(chief, "waiting for TF_CONFIG's tasks to join", [])
        assert _answers(port)
        chief.kill()
        chief.wait(timeout=30)
        deadline = time.monotonic() + 60
        while _answers(port) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _answers(port), "the chief's Ray head outlived it"
        # and its address is forgotten, as `ray stop` does: a later plain ray.init() took it for a live cluster
        while _named_head(port) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _named_head(port)
    finally:
        chief.kill()

    import socket

    with socket.socket() as taken:
        # (the head's closed connections may linger in TIME_WAIT on the port: no listener, nothing to refuse the bind)
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", port))
        taken.listen()
        proc = run_trainer(*args, extra_env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: something already answers at 127.0.0.1:{port}, the chief's address in TF_CONFIG (a Ray head an "
        "earlier run left?): stop it (ray stop, on this machine) and run again")


@pytest.mark.slow  # ~65 s on 2 cores: four Ray nodes start and leave
@pytest.mark.timeout(400)
def test_tf_config_chief_workers_and_ps_form_one_ray_cluster(digits, tmp_path):
    """Four processes from one TF_CONFIG cluster: the chief starts the Ray head and coordinates, two workers and a
    ps join as Ray nodes, and the actors land on them; every task exits 0 when training ends."""
    port = _free_port()
    cluster = {"chief": [f"127.0.0.1:{port}"], "worker": ["127.0.0.1:1", "127.0.0.1:2"], "ps": ["127.0.0.1:3"]}
    # One token shared by every task (token authentication stays on); nodes notice the head is gone in 5 s.
    shared = {"RAY_AUTH_TOKEN": "0123456789abcdef" * 4, "RAY_gcs_rpc_server_reconnect_timeout_s": "5"}
    args = [a for a in _args(digits, tmp_path, 300) if not a.startswith(("num_workers", "num_ps"))]
    tasks = {}
    for role, index in (("worker", 0), ("worker", 1), ("ps", 0), ("chief", 0)):
        spec = {"cluster": cluster, "task": {"type": role, "index": index}}
        tasks[f"{role}{index}"] = run_trainer(*args, popen=True,
                                              extra_env={"TF_CONFIG": json.dumps(spec), **shared})
    outputs = dict(zip(tasks, finish(list(tasks.values()), timeout=360)))
    assert tasks["chief0"].returncode == 0, outputs["chief0"][-3000:]
    chief = outputs["chief0"]
    assert f"ray head started at 127.0.0.1:{port}" in chief
    assert re.search(r"ray cluster: .*'worker': 2\.0", chief) and re.search(r"'ps': 1\.0", chief)
    summary = json.loads(chief[chief.index("{\n"):])["summary"]
    assert summary["final_step"] == 300 and summary["eval_accuracy"] >= 0.90
    for name in ("worker0", "worker1", "ps0"):
        assert tasks[name].returncode == 0, outputs[name][-3000:]
        assert f"left the Ray cluster at 127.0.0.1:{port}" in outputs[name]


@pytest.mark.slow  # ~30 s: a Ray cluster started by hand
@pytest.mark.timeout(300)
def test_joins_an_existing_ray_cluster_by_address(digits, tmp_path):
    port = _free_port()
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "fedcba9876543210" * 4}
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # (its address file too: not the host's /tmp/ray, which a
    # later ray.init() without an address would take for a live cluster once this head is gone)
    head = subprocess.Popen([ray_cli, "start", "--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false",
                             "--disable-usage-stats", "--resources", '{"worker": 2, "ps": 1}', "--block",
                             f"--temp-dir={temp}"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        args = [a for a in _args(digits, tmp_path, 300) if not a.startswith(("num_ps", "num_workers"))]
        # a cluster offering fewer "worker" units than num_workers: each actor takes one, so one would wait for ever
        # without a word; the run waits join_timeout for more nodes, saying so, then names the two ways out
        short = run_trainer(*args, "num_workers=3", "num_ps=1", "join_timeout=3", f"ray_address=127.0.0.1:{port}",
                            timeout=240, extra_env={"RAY_AUTH_TOKEN": env["RAY_AUTH_TOKEN"]})
        assert short.returncode == 1, short.stderr[-3000:]
        assert "waiting for nodes offering the actors' resources to join the Ray cluster: it offers {'worker': 2.0, " \
               "'ps': 1.0} of {'worker': 3, 'ps': 1}" in short.stderr, short.stderr[-3000:]
        assert short.stderr.strip().splitlines()[-1] == (
            "error: TimeoutError: the Ray cluster offers {'worker': 2.0, 'ps': 1.0} after 3 s, not the {'worker': 3, "
            f"'ps': 1}} this run needs: run `ray start --address=127.0.0.1:{port} --resources='{{\"worker\": 1}}'` "
            "on 1 more machine(s), or pass num_workers=2 (each actor of a role takes one unit of its resource)")
        proc = run_trainer(*args, "num_workers=2", "num_ps=1", f"ray_address=127.0.0.1:{port}", timeout=240,
                           extra_env={"RAY_AUTH_TOKEN": env["RAY_AUTH_TOKEN"]})
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert re.search(r"ray cluster: .*'worker': 2\.0", proc.stderr)
        assert json.loads(proc.stdout)["summary"]["eval_accuracy"] >= 0.90
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=60)
        shutil.rmtree(temp, ignore_errors=True)
