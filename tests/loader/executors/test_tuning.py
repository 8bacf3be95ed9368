"""The tuner's policy (loader/executors/tuning.py) in fake time: a host of known cores, a loader whose rate under each
setting is known, a caller that asks at a known rate; which settings it goes through, when, and the waits left.
Fixed expected sequences."""

import logging
import math

import pytest

from loader.executors import tuning
from loader.executors.tuning import HERE, Setting, Tuner

RECORDS = 1024  # a group


class Host:
    """`cores` cores; the caller's own work takes `caller_cores` of them while it computes (not while it waits); the
    loader's setting computes `supply(setting)` records/s at `cost` CPU seconds a record; a new setting's workers
    answer `start` seconds after it is applied (the old setting computes meanwhile)."""

    def __init__(self, cores, supply, cost, *, caller_cores=1.0, start=1.0):
        self.cores, self.supply, self.cost, self.caller_cores, self.start = cores, supply, cost, caller_cores, start
        self.now = 0.0
        self.loader_cpu = 0.0
        self.idle = 0.0

    def run(self, tuner: Tuner, demand, seconds: float):
        """The caller takes groups until `seconds`, asking demand(now) records/s; returns [(time, setting, wait)] a
        group."""
        in_force, pending = tuner.setting, None  # the setting computing, and (when it answers, the new one)
        tuner.ready(self.now)
        taken = []
        while self.now < seconds:
            rate = self.supply(in_force)
            own = RECORDS / demand(self.now)
            compute = RECORDS / rate
            wait = max(0.0, compute - own)
            step = own + wait
            busy_cores = min(self.cores, rate * self.cost * min(1.0, compute / step))
            self.loader_cpu += busy_cores * step
            self.idle += max(0.0, self.cores - busy_cores - self.caller_cores * own / step) * step
            self.now += step
            change = tuner.taken(self.now, RECORDS, wait, own, RECORDS * self.cost)
            taken.append((round(self.now, 3), in_force, round(wait, 3)))
            if change is not None:
                pending = (self.now + self.start, change)
            if pending is not None and self.now >= pending[0]:
                in_force, pending = pending[1], None
                tuner.ready(self.now)
        return taken


def tuner_for(host: Host, max_processes: int, **kwargs) -> Tuner:
    return Tuner(max_processes, loader_cpu=lambda: host.loader_cpu, idle=lambda: host.idle, **kwargs)


def changes(taken) -> list[tuple[float, Setting]]:
    """(when, setting) at each change of the setting computing."""
    out = []
    for now, setting, _ in taken:
        if not out or out[-1][1] != setting:
            out.append((now, setting))
    return out


def per_core(rate: float, here_cores: float = 2.0):
    """Threads here use `here_cores` cores; a worker process a core; `rate` records/s a core."""
    return lambda s: rate * (here_cores if s.here else s.processes)


def test_a_trainer_waiting_for_images_gets_the_workers_its_step_needs_at_once(caplog):
    # 16 cores; a crop costs 1.25 ms of CPU (800 images/s a core); the step asks 6,800 images/s.
    host = Host(16, per_core(800), 1 / 800)
    tuner = tuner_for(host, 15)
    with caplog.at_level(logging.INFO, logger="loader.executors.tuning"):
        taken = host.run(tuner, lambda now: 6800, 30)
    # 6,800 x 1.25 ms = 8.5 cores, +25%: 11 processes, after one window of threads here.
    # One window of threads here (1 s and 3 takes after the first), then they start (1 s) and run from 3.99 s.
    assert changes(taken) == [(0.64, HERE), (3.991, Setting(False, 11))]
    assert all(wait == 0 for now, _, wait in taken if now > 4.0)  # no wait once they run
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == ("loader workers: threads here -> 11 worker processes: the caller took 1,600 records/s waiting 76% "
                    "of the time (it asks 6,800/s), 1.25 ms of CPU a record, 13.8 cores idle")


def test_a_caller_that_never_stops_asking_gets_every_idle_core_but_one():
    host = Host(16, per_core(800), 1 / 800, caller_cores=0)
    tuner = tuner_for(host, 15)
    taken = host.run(tuner, lambda now: math.inf, 20)
    assert changes(taken) == [(0.64, HERE), (3.925, Setting(False, 15))]
    assert [m.setting for m in tuner.history] == [HERE] + [Setting(False, 15)] * len(tuner.history[1:])


def test_threads_here_that_fill_the_cores_are_kept(caplog):
    # 2 cores, the images' decode in C on both: nothing idle, so no process could add anything.
    host = Host(2, per_core(700, here_cores=1.9), 1 / 700, caller_cores=0)
    tuner = tuner_for(host, 2)
    with caplog.at_level(logging.INFO, logger="loader.executors.tuning"):
        taken = host.run(tuner, lambda now: math.inf, 20)
    assert changes(taken) == [(0.77, HERE)]
    assert caplog.records[0].getMessage().startswith("loader workers: keeping threads here: the caller took 1,330 "
                                                     "records/s waiting 100% of the time (it never stopped asking)")


def test_a_map_that_holds_the_gil_moves_to_processes():
    # Threads here run a Python map on one core at a time (the GIL): a core idle, so 2 processes; they double the rate.
    host = Host(2, per_core(9000, here_cores=1.0), 1 / 9000, caller_cores=0)
    tuner = tuner_for(host, 2)
    taken = host.run(tuner, lambda now: math.inf, 10)
    assert changes(taken) == [(0.114, HERE), (2.105, Setting(False, 2))]


def test_a_grow_that_gains_nothing_is_undone_and_tried_again_later_each_time_later():
    # Raw records: threads here read 300k records/s; worker processes spend it moving them: 15 of them, 200k.
    host = Host(16, lambda s: 300_000 if s.here else 200_000, 2 / 300_000, caller_cores=0)
    tuner = tuner_for(host, 15)
    taken = host.run(tuner, lambda now: math.inf, 120)
    assert [(round(t), s) for t, s in changes(taken)] == [
        (0, HERE), (2, Setting(False, 15)), (4, HERE),  # undone, held 30 s
        (34, Setting(False, 15)), (36, HERE),  # tried again, held 60 s
        (96, Setting(False, 15)), (98, HERE)]


def test_an_idle_loader_gives_back_cores_and_a_shrink_too_far_is_undone_and_not_soon_repeated():
    # The step asks 6,800 images/s for 20 s, then 2,000 (a smaller model's step, or a slower phase), then 6,800 again.
    host = Host(16, per_core(800), 1 / 800)
    tuner = tuner_for(host, 15)
    demand = lambda now: 2000 if 20.5 <= now < 60.5 else 6800  # noqa: E731 (the changes fall inside windows)
    taken = host.run(tuner, demand, 90)
    # 2,000 x 1.25 ms x 1.6 = 4 processes, once the caller has not waited for 5 windows; when it waits again, what
    # the 4 delivered each against the rate it asks: 4 x 6,800 / 2,667 x 1.25 = 13 (kept: its rate needs 6,800 x
    # 1.25 ms x 1.6 = 14 to shrink).
    assert [(round(t), s) for t, s in changes(taken)] == [
        (1, HERE), (4, Setting(False, 11)), (24, Setting(False, 4)), (63, Setting(False, 13))]
    assert tuner._shrink_after == tuning.SHRINK_WINDOWS  # the caller waited when its demand rose, not after the shrink


def test_a_shrink_too_far_is_undone_and_the_next_waits_twice_as_long():
    # The groups' stage times count half the CPU a record really costs (the transfer, say). Growing, the second step
    # goes by what the 6 processes delivered each. Shrinking, 2,000 x 0.625 ms x 1.6 makes 2 processes, 1,600
    # images/s: the caller waits, and gets its workers back.
    host = Host(16, per_core(800), 1 / 800)
    host.cost = 1 / 1600
    tuner = tuner_for(host, 15)
    taken = host.run(tuner, lambda now: 6800 if now < 10.5 else 2000, 40)
    assert [(round(t), s) for t, s in changes(taken)] == [
        (1, HERE), (4, Setting(False, 6)), (6, Setting(False, 11)), (13, Setting(False, 4)), (22, Setting(False, 2)),
        (25, Setting(False, 4))]
    assert tuner._shrink_after == 2 * tuning.SHRINK_WINDOWS


def test_a_pause_in_the_caller_drops_the_window():
    tuner = Tuner(4, window_seconds=1.0, window_groups=3)
    tuner.ready(0.0)
    assert tuner.taken(0.5, RECORDS, 0.4, 0.1) is None
    assert tuner.taken(30.0, RECORDS, 0.0, 29.5) is None  # compiling, evaluating: 29.5 s of its own
    assert tuner.history == []
    for t in (30.5, 31.0, 31.5):
        change = tuner.taken(t, RECORDS, 0.4, 0.1)
    assert tuner.history[0].rate == pytest.approx(3 * RECORDS / 1.5)
    assert change == Setting(False, 4)  # idle cores unknown: as many as the demand needs, at most max_processes


def test_a_window_needs_both_its_seconds_and_its_groups():
    tuner = Tuner(4, window_seconds=2.0, window_groups=3)
    tuner.ready(0.0)
    tuner.taken(3.0, RECORDS, 1.0, 0.1)
    tuner.taken(3.1, RECORDS, 0.0, 0.1)
    tuner.taken(3.2, RECORDS, 0.0, 0.1)
    assert tuner.history == []  # 3 s, but 2 takes with the caller's time before them (the first has none)
    tuner.taken(3.3, RECORDS, 0.0, 0.1)
    assert len(tuner.history) == 1
    assert Tuner(4).taken(1.0, RECORDS, 0.5, 0.1) is None  # before ready(): the setting's workers are starting


def test_bad_max_processes():
    with pytest.raises(ValueError, match=r"max_processes must be >= 1 \(got max_processes=0\)"):
        Tuner(0)


def test_the_rate_asked_pairs_the_callers_time_with_the_group_it_spent_it_on():
    """Read groups ramp up (1, 4, 16 batches ...): the caller's time before a group was spent on the group before it.
    Paired with the group taken, the first window of a caller asking 1,000 records/s read 2,600/s."""
    tuner = Tuner(4, window_seconds=1.0, window_groups=3)
    tuner.ready(0.0)
    now, previous = 0.0, 0
    for records in (256, 1024, 4096, 4096, 4096):
        busy = previous / 1000.0  # 1,000 records/s of its own work
        now += busy + 0.1  # and 0.1 s waited for each group
        tuner.taken(now, records, 0.1, busy)
        previous = records
    assert tuner.history[0].demand == pytest.approx(1000.0)


def test_a_pause_of_the_caller_inside_a_window_is_one_take_not_the_windows_rate():
    tuner = Tuner(4, window_seconds=1.0, window_groups=3)
    tuner.ready(0.0)
    now = 0.0
    for busy in (0.25, 0.25, 0.25, 3.0):  # 3 s of compiling or evaluating between two takes
        now += busy + 0.05
        tuner.taken(now, 1000, 0.05, busy)
    assert tuner.history[0].demand == pytest.approx(4000.0)  # 1,000 records a 0.25 s, not 5,000 over 4 s


def test_a_trainers_first_window_reads_its_steps_not_its_compile():
    """The first batch has no time before it; the second comes after the step's compile. Counted by groups, the
    window held two rates, and the lower (the compile's) was the rate asked: "took 546 records/s ... asks 28/s"."""
    tuner = Tuner(4, window_seconds=1.0, window_groups=3)
    tuner.ready(0.0)
    now = 0.0
    for busy in (0.0, 10.0, 0.25, 0.25):  # the first take; 10 s compiling; then 0.25 s steps
        now += busy + 0.05
        tuner.taken(now, 1000, 0.05, busy)
    assert [round(m.demand) for m in tuner.history] == [4000]
