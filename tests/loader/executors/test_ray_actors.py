"""The loader's workers as Ray actors on a local two-node Ray cluster (ray.cluster_utils.Cluster): the batches are
bitwise those of the local loader, through an actor killed mid-epoch, a resume, and workers added and removed while
iterating; a record that kills every actor that reads it is one clear error."""

import logging
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest

import loader
from loader.decoding import images

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    """A head node with no data resource and a second node offering `data_cpu`: the actors go there."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 100 << 20,
                                                             "include_dashboard": False})
    cluster.add_node(num_cpus=8, resources={"data_cpu": 8}, object_store_memory=100 << 20)  # logical CPUs
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


class _SlowCrop:
    """The crop, 10 ms a record: keeps the actors busy, so one killed at any moment holds groups in progress."""

    def __init__(self):
        self.crop = images.RandomResizedCrop("image/encoded", size=32)

    def __call__(self, record, rng):
        time.sleep(0.01)
        return self.crop(record, rng)


def _crops(photos, **options):
    return loader.load(str(photos), batch_size=8, seed=2, num_epochs=2, records_per_read=16,
                       random_map_fn=_SlowCrop(), **options)


def _remote(cluster, count=2):
    return dict(worker_count=count, ray_address=cluster.address, ray_resources={"data_cpu": 1})


def _same(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert sorted(a) == sorted(b)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])


def _raylets(*nodes) -> set[int]:
    """The pids of the raylets of `nodes` (cluster_utils nodes): the parents of the actor processes on them."""
    return {p.pid for node in nodes for kind, p in node.live_processes() if kind == "raylet"}


def _actor_pids(parents: set[int]) -> list[int]:
    """The pids of the loader's actor processes that `parents` started (nodes' raylets: not another test worker's)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and b"ray::_GroupActor" in (proc / "cmdline").read_bytes():
                if int((proc / "stat").read_text().rpartition(")")[2].split()[1]) in parents:
                    pids.append(int(proc.name))
        except (OSError, ValueError, IndexError):
            pass
    return pids


def _wait_for_an_actor_on(node, timeout: float = 60.0) -> None:
    """Until an actor process runs on `node` (a cluster_utils node), so that removing the node ends one."""
    raylet = _raylets(node)
    deadline = time.monotonic() + timeout
    while not _actor_pids(raylet):
        assert time.monotonic() < deadline, f"no loader actor was placed on the node of raylet {raylet} in {timeout}s"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def local_crops(photos):
    return list(_crops(photos))  # 2 epochs of 48 records: 12 batches


@pytest.mark.timeout(300)
def test_remote_crops_are_the_local_ones_through_a_killed_actor_a_resume_and_resizing(cluster, photos, local_crops,
                                                                                   caplog):
    it = iter(_crops(photos, **_remote(cluster)))
    actors = it._host.groups._workers
    pid_of = {id(w): ray.get(w.handle.pid.remote()) for w in actors}  # idle yet: answered at once
    raylets = _raylets(*cluster.list_all_nodes())
    assert sorted(pid_of.values()) == sorted(_actor_pids(raylets)), _actor_pids(raylets)
    got = [next(it)]  # one batch of 8 records; the next groups (16 records, 160 ms each) are in progress
    victim = next(w for w in actors if w.groups)  # killed holding groups: its end is seen, they are computed again
    with caplog.at_level(logging.WARNING, logger="loader.executors.schedule"):
        os.kill(pid_of[id(victim)], signal.SIGKILL)
        got += [next(it) for _ in range(5)]
    it.resize_workers(3)  # a node joined
    got += [next(it) for _ in range(2)]
    it.resize_workers(1)  # nodes left
    state = it.get_state()
    got += list(it)
    _same(got, local_crops)
    assert re.search(r"loader Ray actor \d ended \(\w+", caplog.text), caplog.text

    resumed = iter(_crops(photos, **_remote(cluster)))
    resumed.set_state(state)
    _same(list(resumed), local_crops[8:])
    resumed.close()
    it.close()
    deadline = time.monotonic() + 30
    while _actor_pids(raylets) and time.monotonic() < deadline:  # killed by close()
        time.sleep(0.2)
    assert _actor_pids(raylets) == []


def test_a_remote_mixture_is_the_local_one(cluster, converted, photos):
    sources = {"text": str(converted), "photos": str(photos)}
    options = dict(batch_size=8, seed=1, num_epochs=1, decode=None, weights={"text": 3, "photos": 1})
    _same_raw = [list(b) for b in loader.load(sources, **options)]
    remote = [list(b) for b in loader.load(sources, **options, **_remote(cluster))]
    assert remote == _same_raw and len(remote) >= 4


def test_a_remote_packed_mixture_is_the_local_one_and_resumes(cluster, token_data):
    from tests.loader.ids import flat_ids

    def mixed(**options):  # a lambda: Ray pickles with cloudpickle (local worker processes would refuse it)
        return loader.load({"a": token_data, "b": token_data}, weights={"a": 2, "b": 1}, batch_size=3, seed=0,
                           packing=loader.Packing("ids", seq_len=6, tokenize=lambda v: flat_ids(v)), **options)

    local = iter(mixed())
    expected = [next(local)["tokens"].tolist() for _ in range(12)]
    it = iter(mixed(**_remote(cluster)))
    got = [next(it)["tokens"].tolist() for _ in range(5)]
    state = it.get_state()
    it.close()
    resumed = iter(mixed(**_remote(cluster)))
    resumed.set_state(state)
    assert got + [next(resumed)["tokens"].tolist() for _ in range(7)] == expected
    resumed.close()


def test_connecting_to_ray_keeps_the_processs_own_sigterm_handler(cluster, token_data):
    """ray.init put its own SIGTERM handler (a sys.exit; in C, a stack dump and an abort) over the process's: python
    -m trainer's, which ends a run with one line and its lease given back, was gone once the loader's first iterator
    connected (and in strategy=parameter_server a SIGTERM during the setup aborted it)."""
    def own(*_):
        pass

    ray.shutdown()  # (connected by an earlier test: the loader connects again, as a fresh process does)
    before = signal.signal(signal.SIGTERM, own)
    try:
        it = iter(loader.load(token_data, batch_size=2, decode=None, num_epochs=1, **_remote(cluster, count=1)))
        assert next(it) and ray.is_initialized()
        assert signal.getsignal(signal.SIGTERM) is own
        it.close()
    finally:
        signal.signal(signal.SIGTERM, before)


OOM_KILLED = """
import logging, os, sys, time
os.environ["RAY_memory_usage_threshold"] = "0.02"  # Ray's memory monitor kills a busy worker at once
os.environ["RAY_memory_monitor_refresh_ms"] = "100"
import ray
import loader

ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)


class Slow:
    def __call__(self, record):
        time.sleep(0.05)
        return record


try:
    list(loader.load(sys.argv[1], batch_size=2, decode=None, num_epochs=1, map_fn=Slow(), worker_count=1,
                     ray_address="auto"))
    print("finished")
except Exception as e:
    print(type(e).__name__, str(e).splitlines()[0])
"""


@pytest.mark.timeout(240)
def test_actors_the_memory_monitor_kills_are_replaced_as_any_that_dies(token_data, tmp_path):
    """Ray's memory monitor (its OOM prevention) ends an actor's calls in OutOfMemoryError, which is not a
    RayActorError: the loader raised it raw, replacing nothing. It is a death: the actor is replaced (its groups
    computed again); here the monitor kills every one as it starts, so the loader's own error after 3 comes, naming
    the memory monitor (not unpickling, the usual reason actors end before they start)."""
    import subprocess
    import sys

    from tests.conftest import REPO

    proc = subprocess.run([sys.executable, "-c", OOM_KILLED, token_data], cwd=REPO, capture_output=True, text=True,
                          timeout=200, env={**os.environ, "PYTHONPATH": str(REPO)})
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-2000:]
    assert re.match(r"ValueError the loader's Ray actors end before they start \(3 of them, the last: "
                    r"OutOfMemoryError: .*\): Ray's memory monitor ends them \(the node's memory is nearly full",
                    last), last


class _Poison:
    """Kills the process it runs in at one record, except in the process that made it (the test's)."""

    def __init__(self):
        self.owner = os.getpid()

    def __call__(self, record: bytes) -> bytes:
        if record == b"2:50" and os.getpid() != self.owner:
            os.kill(os.getpid(), signal.SIGKILL)
        return record


@pytest.mark.timeout(240)
def test_actors_the_cluster_cannot_place_wait_while_the_placed_ones_compute_through_a_lost_node(
        cluster, photos, local_crops, caplog, monkeypatch):
    """Three actors for two slots (one node a slot), then one node lost: its actor's replacement cannot be placed
    either. The placed actors compute every batch meanwhile; they were sent to the unplaced ones and waited for
    ever."""
    from loader.executors import ray_actors

    monkeypatch.setattr(ray_actors, "STALL_SECONDS", 0.5)
    nodes = [cluster.add_node(num_cpus=1, resources={"lossy_cpu": 1}, object_store_memory=100 << 20)
             for _ in range(2)]
    cluster.wait_for_nodes()
    try:
        it = iter(_crops(photos, worker_count=3, ray_address=cluster.address, ray_resources={"lossy_cpu": 1}))
        with caplog.at_level(logging.WARNING, logger="loader.executors"):
            got = [next(it)]  # (one: what is left after the wait below is what the lost node's actor was to compute)
            _wait_for_an_actor_on(nodes[1])  # (under load the cluster may place it after the first batches)
            cluster.remove_node(nodes[1])  # its actor ends; the replacement has nowhere to go
            got += list(it)
        _same(got, local_crops)
        it.close()
    finally:
        cluster.remove_node(nodes[0])
    # (an actor waiting to be placed may wait on the lost node: it ends before it starts, and another waits instead)
    assert re.search(r"loader Ray actor \d ended (with its node |before it started )?\(\w+", caplog.text), caplog.text
    assert re.search(r"[12] of the loader's Ray actors are not placed after 0.5s \(each needs \{CPU: 1, lossy_cpu: 1\} "
                     r"free; ray status shows what is\); the [12] placed compute the batches meanwhile", caplog.text), \
        caplog.text


@pytest.mark.timeout(300)
def test_idle_actors_lost_with_their_node_blame_no_group_and_are_replaced_at_once(cluster, converted, caplog):
    """A node of idle actors lost (the loader ahead of training, then the node preempted). An idle actor's death is
    seen only once a group is sent to it: one group went to each dead actor in turn, each death counted against it,
    and after three the loader stopped with "a record there crashes the decoder". A death with its node blames no
    group, and the node's other actors are replaced as soon as one is seen dead."""
    options = dict(batch_size=4, seed=1, decode=None, num_epochs=1, records_per_read=4, shuffle=False)
    expected = list(loader.load(str(converted), **options))
    lossy = cluster.add_node(num_cpus=4, resources={"gone_cpu": 4}, object_store_memory=100 << 20)
    cluster.wait_for_nodes()
    spare = None
    try:
        it = iter(loader.load(str(converted), worker_count=4, ray_address=cluster.address,
                              ray_resources={"gone_cpu": 1}, **options))
        got = [next(it)]
        deadline = time.monotonic() + 120
        while len(_actor_pids(_raylets(lossy))) < 4:  # all four placed there
            assert time.monotonic() < deadline, "the loader's 4 actors were not placed in 120s"
            time.sleep(0.1)
        spare = cluster.add_node(num_cpus=4, resources={"gone_cpu": 4}, object_store_memory=100 << 20)
        cluster.wait_for_nodes()
        for _ in range(2):  # the actors' groups done and taken: all idle
            got.append(next(it))
            time.sleep(0.5)
        with caplog.at_level(logging.WARNING, logger="loader.executors"):
            cluster.remove_node(lossy)
            lossy = None
            while "ended with its node" not in caplog.text:  # a slow caller: one group sent at a time, to one actor
                got.append(next(it))
                time.sleep(0.5)
            got += list(it)
        assert got == expected
    finally:
        for node in (lossy, spare):
            if node is not None:
                cluster.remove_node(node)
    ended = re.findall(r"loader Ray actor \d ended with its node \((.*?)\) with (\d) group", caplog.text)
    assert len(ended) == 4, caplog.text
    assert ("its node was lost", "0") in ended, caplog.text  # seen dead through another's death: nothing sent to it
    assert "ended (" not in caplog.text, caplog.text  # (no death blamed on a group)


@pytest.mark.timeout(300)
def test_a_record_that_kills_every_actor_is_one_error_naming_its_group(cluster, converted):
    it = iter(loader.load(str(converted), batch_size=8, seed=3, decode=None, num_epochs=1, records_per_read=16,
                          shuffle=False, map_fn=_Poison(), **_remote(cluster)))
    with pytest.raises(ValueError, match=r"a loader worker ended 3 times while computing batches 9-10 \(16 records: "
                                         r"\S+/train-00002-of-00005\.array_record: records 35-50\) \(the last: "):
        list(it)


def test_ray_options_need_their_partners(photos):
    with pytest.raises(ValueError, match=r"ray_address='auto' runs worker_count workers on the Ray cluster: pass "
                                         r"worker_count=N"):
        loader.load(str(photos), batch_size=8, ray_address="auto")
    with pytest.raises(ValueError, match="ray_resources= places Ray actors: pass ray_address= too"):
        loader.load(str(photos), batch_size=8, worker_count=1, ray_resources={"data_cpu": 1})


def test_an_address_where_no_cluster_answers_fails_at_once_naming_it(photos):
    """Ray retries such an address for about 14 minutes before it gives up."""
    import socket
    import subprocess
    import sys

    from tests.conftest import REPO

    with socket.socket() as s:  # a port nothing listens on (bound, not listening)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        code = ("import loader; next(iter(loader.load(%r, batch_size=8, worker_count=1, ray_address='127.0.0.1:%d')))"
                % (str(photos), port))
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert time.monotonic() - started < 60 and proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"ValueError: no Ray cluster answers at 127.0.0.1:{port} (Connection refused): start its head there (ray "
        f"start --head --port={port}), or give the address `ray status` shows on the head")


def test_a_resource_no_node_offers_is_named_at_once(cluster, photos, caplog):
    """A misspelt resource (`data_cpus`): the actors wait for a node that offers it, which may never come."""
    with caplog.at_level(logging.WARNING, logger="loader.executors.ray_actors"):
        it = iter(_crops(photos, worker_count=1, ray_address=cluster.address, ray_resources={"data_cpus": 1}))
        it.close()
    assert re.search(r"no node of the Ray cluster offers data_cpus now \(its resources: CPU, data_cpu, [^)]*\): the "
                     r"loader's actors wait until one does; check the name against the nodes' `ray start "
                     r"--resources`", caplog.text), caplog.text
