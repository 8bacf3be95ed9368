"""worker_count="auto" (loader/executors/tuned.py): this process's threads and worker processes, in the mix the
tuner chooses, give the batches of a run without workers; the stage times say which stage bounds the rate."""

import logging
import os
import signal
import time

import numpy as np
import pytest

import loader
from loader.executors import tuning

OPTIONS = dict(batch_size=8, seed=3, decode=None, num_epochs=3, records_per_read=16)


def _busy(record: bytes) -> bytes:
    end = time.thread_time() + 0.0005  # CPU, not sleep: the stage times count CPU
    while time.thread_time() < end:
        pass
    return record


def _rows(batches) -> list[list[bytes]]:
    return [[bytes(r) for r in np.asarray(b, dtype=object)] for b in batches]


@pytest.fixture
def quick_tuner(monkeypatch):
    """Windows of 50 ms, a grow undone held for 0.3 s, and idle cores not known (so a waiting caller always gets
    more workers, however busy the test host is): a short run goes through several settings."""
    from loader.executors import tuned

    monkeypatch.setattr(tuning, "WINDOW_SECONDS", 0.05)
    monkeypatch.setattr(tuning, "WINDOW_GROUPS", 2)
    monkeypatch.setattr(tuning, "HOLD_SECONDS", 0.3)
    monkeypatch.setattr(tuned, "idle_core_seconds", lambda *args: None)


@pytest.mark.timeout(180)
def test_auto_gives_the_batches_of_threads_while_it_moves_between_settings(converted, quick_tuner):
    expected = _rows(loader.load(str(converted), map_fn=_busy, **OPTIONS))
    assert len(expected) == 96  # 3 epochs of 257 records, batches of 8
    it = iter(loader.load(str(converted), map_fn=_busy, worker_count="auto", **OPTIONS))
    got = _rows(it)
    assert got == expected
    history = it._host.groups.tuner.history
    tried = {m.setting for m in history}
    assert tuning.HERE in tried and any(s.processes for s in tried), history
    it.close()


@pytest.mark.timeout(120)
def test_auto_resumes_and_resizes_like_fixed_workers(converted, quick_tuner):
    expected = _rows(loader.load(str(converted), map_fn=_busy, **OPTIONS))
    it = iter(loader.load(str(converted), map_fn=_busy, worker_count="auto", **OPTIONS))
    got = _rows([next(it) for _ in range(30)])
    state = it.get_state()
    it.resize_workers(2)  # a fixed count: tuning stops
    assert it.worker_setting() == "2 worker processes"
    got += _rows([next(it) for _ in range(10)])
    it.set_state(state)
    assert it.worker_setting() == "2 worker processes"  # the count holds through a restore (it went back to auto)
    got = got[:30] + _rows(it)
    assert got == expected
    it.close()
    assert it.worker_setting() == "closed"
    it.resize_workers(1)  # on a closed iterator: for its next start
    it.set_state(state)
    assert it.worker_setting() == "1 worker process"
    assert _rows([next(it)]) == expected[30:31]
    it.close()


def test_stage_times_name_the_stage_that_bounds_the_rate(converted):
    it = iter(loader.load(str(converted), map_fn=_busy, **{**OPTIONS, "num_epochs": 1}))
    batches = list(it)
    times = it.stage_times()
    assert times.records == 8 * len(batches) == 256 and times.groups == 17  # groups of 1, 2 x 15, 1 batches
    assert times.cpu["map"] >= 256 * 0.0005 and times.cpu["map"] > 5 * times.cpu["read"]
    report = times.report(compute_cores=64)
    bound, advice = report.bound()
    assert bound.startswith("map (") and advice.startswith("map is ")
    assert "of the cores idle: more workers (worker_count=, or \"auto\"), or a cheaper map function" in advice
    lines = report.lines()
    assert lines[0].startswith("256 records in ") and lines[3].startswith("bound by map")
    assert "map " in lines[1] and "read " in lines[1]


def test_busy_cores_call_for_more_cores():
    from loader.executors.stages import StageTimes

    times = StageTimes(groups=10, records=1000, take=0.01, wait=0.9)
    times.cpu.update(read=0.1, map=1.8)
    assert times.report(elapsed=1.0, compute_cores=2).bound() == (
        "map (95% of 2 cores busy)", "map is 95% of the work; the 2 cores are busy: more cores (Ray actors on other "
        "machines: docs/ray-workers.md), or a cheaper map function")
    times.read_wall = 1.9  # reads that mostly wait: storage bounds it
    times.cpu.update(read=0.1, map=0.1)
    assert times.report(elapsed=1.0, compute_cores=2).bound()[0] == "read (I/O)"


def test_transfer_is_named_only_where_workers_hand_groups_over_and_auto_is_not_told_to_use_auto():
    """Threads here hand over nothing: a caller busy taking groups from them is not "transfer" (bench with workers=0
    said so); worker_count="auto" is not advised to use "auto"; a window under a second says it is short."""
    from loader.executors.stages import StageTimes

    times = StageTimes(groups=10, records=1000, take=0.9, wait=0.5)
    times.cpu.update(read=0.1, decode=0.2)
    assert times.report(elapsed=1.0, compute_cores=4, setting="2 worker processes").bound()[0] == "transfer"
    here = times.report(elapsed=1.0, compute_cores=4, setting="threads here")
    assert here.bound() == ("decode (8% of 4 cores busy)", "decode is 67% of the work; 92% of the cores idle: more "
                            "workers (worker_count=, or \"auto\"), or decode only the features you need (features=)")
    tuned = times.report(elapsed=1.0, compute_cores=4, setting="threads here", tuned=True).bound()[1]
    assert "92% of the cores idle with worker_count=\"auto\" (it starts workers while the caller waits)" in tuned
    # a paced caller's own measure of its waiting decides (the groups' waits said 50%, its next() calls 1.2%)
    paced = times.report(elapsed=1.0, compute_cores=4, setting="threads here", tuned=True, waited=0.012).bound()
    assert paced == ("the caller", "the loader waited on the caller: batches were ready 99% of the time; more loader "
                                   "workers would not help")
    # what other processes use is not idle (bench measures the host's idle cores over its window)
    shared = times.report(elapsed=1.0, compute_cores=4, setting="threads here", idle=0.1).bound()
    assert shared == ("decode (90% of 4 cores busy)", "decode is 67% of the work; the 4 cores are busy: more cores "
                      "(Ray actors on other machines: docs/ray-workers.md), or decode only the features you need "
                      "(features=)")
    assert here.lines()[-1].startswith("bound by decode")
    tokens = times.report(elapsed=1.0, compute_cores=4, setting="threads here", tokens=True).bound()[1]
    assert tokens.endswith("more workers (worker_count=, or \"auto\"), or nothing cheaper to decode: the records are "
                           "token ids already"), tokens  # features= has nothing to drop from them
    assert times.report(elapsed=0.2, compute_cores=4, setting="threads here").lines()[-1] == \
        "timed over 0.20 s only: too short for a steady figure (take more batches)"


def test_read_bound_advice_follows_the_shards_codec():
    """A read-bound report advises a cheaper codec than the shards': snappy for zstd (or unknown), uncompressed for
    snappy, and nothing for uncompressed shards (it advised snappy on snappy data)."""
    from loader.executors.stages import StageTimes, codec_of

    assert [codec_of(o) for o in ("group_size:1,transpose:false,pad_to_block_boundary:false,snappy,max_parallelism:1",
                                  "group_size:1,zstd:3", "uncompressed,group_size:1", "group_size:1",
                                  "brotli:6,window_log:20")] == ["snappy", "zstd", "uncompressed", "brotli", "brotli"]
    times = StageTimes(groups=10, records=1000, take=0.01, wait=0.5)
    times.cpu.update(read=0.3, decode=0.1)
    advice = {codec: times.report(elapsed=1.0, compute_cores=4, setting="threads here", codec=codec).bound()[1]
              for codec in (None, "zstd", "snappy", "uncompressed")}
    assert advice[None] == advice["zstd"] == (
        "read is 75% of the work; 90% of the cores idle: more workers (worker_count=, or \"auto\"), or a faster codec "
        "at conversion (convert --compression snappy: it decompresses faster than zstd)")
    assert advice["snappy"].endswith(", or uncompressed shards (convert --compression uncompressed: nothing to "
                                     "decompress, larger files)")
    assert advice["uncompressed"].endswith(", or nothing cheaper to read: the shards are uncompressed already")


def test_a_caller_slower_than_the_loader_is_what_bounds_it(converted):
    it = iter(loader.load(str(converted), **{**OPTIONS, "num_epochs": 1}))
    next(it)
    it.stage_times(reset=True)  # from the second batch: the first waits for the threads to start, whatever the caller
    for _ in it:
        time.sleep(0.02)  # a training step: the batches are ready before it asks
    bound, advice = it.stage_times().report(compute_cores=2).bound()
    assert bound == "the caller" and "more loader workers would not help" in advice


@pytest.mark.parametrize("value, message", [
    ("four", "worker_count must be a number of worker processes or 'auto' (got worker_count='four')"),
    (True, "worker_count must be a number"),
    (-1, "worker_count must be >= 0 (got worker_count=-1)"),
])
def test_worker_count_values(converted, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        loader.load(str(converted), batch_size=8, worker_count=value)


def test_auto_with_ray_asks_for_a_count(converted):
    with pytest.raises(ValueError, match=r"worker_count='auto' tunes this host's workers; with ray_address='auto' "
                                         r"pass the number of Ray actors"):
        loader.load(str(converted), batch_size=8, worker_count="auto", ray_address="auto")


def _where(g: int) -> tuple[int, int]:
    time.sleep(0.1)  # the worker killed holds the groups it was sent
    return g, os.getpid()


@pytest.mark.timeout(120)
def test_a_group_a_worker_died_with_is_computed_in_a_worker_even_when_the_setting_has_none():
    """Computing it on this process's threads could end the caller's process the way it ended the worker."""
    from loader.executors.tuned import Tuned

    groups = Tuned(per_worker=2).map(_where, 20)
    groups._tuning = False  # settings applied by hand
    groups.apply(tuning.Setting(False, 1))
    got = []
    while groups._starting or len(got) < 3:  # until the process has answered: threads here compute meanwhile
        got.append(next(groups))
    (victim,) = [w for w in groups._workers if w.isolated]
    while not victim.groups:  # a hand-out sends the next group: the worker killed holds one it has only begun
        got.append(next(groups))
    os.kill(victim.process.pid, signal.SIGKILL)
    groups.apply(tuning.Setting(True, 0))  # threads here only, from now on
    got += list(groups)
    assert [g for g, _ in got] == list(range(20))
    assert groups.tuner.history == []
    here = [g for g, pid in got if pid == os.getpid()]
    assert victim.groups and not victim.groups & set(here)  # the groups it held: computed in a new worker
    assert here  # threads here took over (they also computed while the first process started)
    assert len({pid for _, pid in got}) == 3  # the victim, the rescuer, this process
    assert groups.setting() == tuning.Setting(True, 0)  # the rescuer retired once its groups were done
    groups.close()


class _Ghost:
    """Defined in a module only this process has: a worker process cannot unpickle it, so it ends before it starts
    (as a worker of an unguarded script does, or one whose map function is not importable)."""

    def __call__(self, g: int) -> tuple[int, int]:
        return g, os.getpid()


@pytest.mark.timeout(120)
def test_auto_goes_on_on_threads_when_worker_processes_cannot_start(caplog, monkeypatch):
    import sys
    import threading
    import types

    from loader.executors.tuned import Tuned, _TunedGroups

    # Threads here compute while the process starts: each group waits until the executor has given processes up, so
    # the 30 groups cannot all be done first (on a loaded host a start takes longer than they do).
    given_up = threading.Event()
    cannot_start = _TunedGroups._cannot_start
    monkeypatch.setattr(_TunedGroups, "_cannot_start", lambda self, how: (cannot_start(self, how), given_up.set())[0])

    def call(self, g: int) -> tuple[int, int]:
        assert given_up.wait(60), "the worker processes were never given up"
        return g, os.getpid()

    ghost = types.ModuleType("ghost_module_of_this_test")
    ghost._Ghost = type("_Ghost", (_Ghost,), {"__module__": ghost.__name__, "__call__": call})
    sys.modules[ghost.__name__] = ghost
    try:
        groups = Tuned(per_worker=2).map(ghost._Ghost(), 30)
        groups._tuning = False
        groups.apply(tuning.Setting(False, 1))  # a process only: it cannot start
        with caplog.at_level(logging.WARNING):
            got = list(groups)
    finally:
        del sys.modules[ghost.__name__]
    assert got == [(g, os.getpid()) for g in range(30)]  # every group here, in order
    assert groups.setting() == tuning.Setting(True, 0)
    assert caplog.text.count("ended before it started") == 2
    assert "so worker_count='auto' reads on this process's threads only" in caplog.text


@pytest.mark.timeout(120)
def test_a_setting_waits_for_the_worker_started_in_place_of_one_that_ended_before_it_answered():
    """Else the setting's measuring window opens before the new worker answers, and its rate reads low."""
    from loader.executors.tuned import Tuned

    groups = Tuned(per_worker=2).map(_where, 6)
    groups._tuning = False
    groups.apply(tuning.Setting(False, 1))
    (first,) = [w for w in groups._workers if w.isolated]
    assert not first.ready and groups._starting == {id(first)}  # spawning takes ~1 s
    groups._replace(first, "killed for the test")
    (second,) = [w for w in groups._workers if w.isolated]
    assert second is not first and groups._starting == {id(second)}
    assert [g for g, _ in groups] == list(range(6))
    assert groups._starting == set()
    groups.close()
