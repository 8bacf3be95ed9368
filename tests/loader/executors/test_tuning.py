"""The tuner's policy (loader/executors/tuning.py) on simulated rates: which settings it tries, in which order, and
where it settles; fixed expected sequences."""

import collections

import pytest

from loader.executors.tuning import Setting, Tuner, ladder

H, P = True, False  # Setting(here=H, ...) : this process's threads on / off


def test_ladder_doubles_processes_up_to_a_worker_a_core():
    assert ladder(1) == [Setting(H, 0), Setting(P, 1)]
    assert ladder(2) == [Setting(H, 0), Setting(H, 1), Setting(P, 2)]
    assert ladder(8) == [Setting(H, 0), Setting(H, 1), Setting(H, 2), Setting(H, 4), Setting(H, 7), Setting(P, 8)]
    assert [s.processes for s in ladder(96)] == [0, 1, 2, 4, 8, 16, 32, 64, 95, 96]
    assert str(Setting(H, 0)) == "threads here" and str(Setting(H, 1)) == "threads here + 1 worker process"
    assert str(Setting(P, 8)) == "8 worker processes"


def simulate(tuner: Tuner, rate, *, groups: int, records: int = 1000, depth: int = 4, start_delay: int = 0):
    """Drives `tuner` as the executor does: each group is sent `depth` groups before the caller takes it, tagged with
    the era then, and takes records / rate(setting it was sent under) seconds. A new setting is ready after
    `start_delay` more groups (its workers starting). Returns the settings in force, one per group taken."""
    now, in_force = 0.0, []
    tuner.ready()  # the first setting's workers
    sent = collections.deque((tuner.era, tuner.setting) for _ in range(depth))
    pending_ready = None
    for _ in range(groups):
        era, setting = sent.popleft()
        now += records / rate(setting, now)
        change = tuner.taken(now, era, records)
        if change is not None:
            pending_ready = start_delay
        if pending_ready is not None:
            if pending_ready == 0:
                tuner.ready()
                pending_ready = None
            else:
                pending_ready -= 1
        sent.append((tuner.era, tuner.setting))
        in_force.append(tuner.setting)
    return in_force


def tried(tuner: Tuner) -> list[tuple[bool, int]]:
    return [(s.here, s.processes) for s, _, _ in tuner.history]


def by_step(steps, rates):
    table = dict(zip(steps, rates))
    return lambda setting, now: table[setting]


def test_climbs_while_it_gains_and_settles_on_the_cheapest_near_the_best():
    steps = ladder(4)  # here; here+1; here+2; here+3; 4 processes
    tuner = Tuner(steps, window_seconds=2.0, window_groups=3, probe_seconds=1e9)
    simulate(tuner, by_step(steps, [1000, 1800, 2500, 2600, 2550]), groups=200)
    # +80%, +39% gain; +4% and -2% are flat: two flat steps end the climb; 2500 is within 5% of 2600
    assert tried(tuner) == [(H, 0), (H, 1), (H, 2), (H, 3), (P, 4)]
    assert tuner.setting == Setting(H, 2) and tuner.settled
    assert [round(r) for _, r, _ in tuner.history] == [1000, 1800, 2500, 2600, 2550]


def test_a_caller_slower_than_every_setting_keeps_threads_here():
    steps = ladder(8)
    tuner = Tuner(steps, probe_seconds=1e9)
    in_force = simulate(tuner, by_step(steps, [500] * len(steps)), groups=100)
    assert tried(tuner) == [(H, 0), (H, 1), (H, 2)]  # two flat steps
    assert tuner.setting == Setting(H, 0) and in_force[-1] == Setting(H, 0)


def test_a_step_that_loses_ends_the_climb():
    steps = ladder(2)
    tuner = Tuner(steps, probe_seconds=1e9)
    simulate(tuner, by_step(steps, [1400, 1200, 1900]), groups=100)
    assert tried(tuner) == [(H, 0), (H, 1)]
    assert tuner.setting == Setting(H, 0)


def test_the_best_at_the_top_of_the_ladder():
    steps = ladder(2)
    tuner = Tuner(steps, probe_seconds=1e9)
    simulate(tuner, by_step(steps, [1000, 1500, 1900]), groups=100)
    assert tried(tuner) == [(H, 0), (H, 1), (P, 2)]
    assert tuner.setting == Setting(P, 2)


def test_a_setting_is_measured_only_from_groups_sent_once_its_workers_answered():
    """Groups sent before ready() (while new workers start) never count: a slow start is not held against them."""
    steps = ladder(2)
    slow_start = {}

    def rate(setting, now):  # each setting's first 3 seconds are slow, as a worker's imports are
        first = slow_start.setdefault(setting, now)
        return 100.0 if now - first < 3 else [1000, 1500, 1900][steps.index(setting)]

    tuner = Tuner(steps, window_seconds=2.0, probe_seconds=1e9)
    simulate(tuner, rate, groups=300, start_delay=6)
    assert [round(r) for _, r, _ in tuner.history] == [1000, 1500, 1900]


def test_probes_adapt_when_the_rates_change_and_back_off_when_they_do_not():
    steps = ladder(2)
    tuner = Tuner(steps, window_seconds=1.0, probe_seconds=30.0, max_probe_seconds=120.0)

    def rate(setting, now):  # from t=60 s a busier host: one more worker pays off
        table = [1000, 1020, 900] if now < 60 else [1000, 1700, 1300]
        return table[steps.index(setting)]

    in_force = simulate(tuner, rate, groups=400)
    assert [(s.processes, round(r)) for s, r, _ in tuner.history] == [
        (0, 1000), (1, 1020), (2, 900),  # the climb: flat, then a loss: threads here
        (0, 1000), (1, 1700),  # the first probe, after 30 s (past 60 s): the setting in force, then one up: moves
        (1, 1700), (2, 1300), (0, 1000),  # the probes after it: up and down are worse; the interval doubles
        (1, 1700), (2, 1300), (0, 1000)]
    assert tuner.setting == Setting(H, 1) == in_force[-1]
    assert tuner._interval == 120.0  # doubled twice, up to max_probe_seconds


def test_window_needs_both_its_seconds_and_its_groups():
    tuner = Tuner(ladder(2), window_seconds=10.0, window_groups=3)
    assert tuner.taken(0.0, 0, 100) is None and tuner.era == 0  # sent before the first workers answered: ignored
    tuner.ready()
    assert tuner.era == 1
    assert tuner.taken(0.5, 0, 100) is None  # still ignored
    assert tuner.taken(1.0, 1, 100) is None  # starts the clock
    for t in (2.0, 3.0, 4.0, 10.0):
        assert tuner.taken(t, 1, 100) is None and not tuner.history
    assert tuner.taken(11.0, 1, 100) == Setting(H, 1)  # 10 s from the first take to this one: 5 groups before it
    assert tuner.history == [(Setting(H, 0), 50.0, 0.0)]
    assert tuner.taken(12.0, 1, 100) is None  # a group of the old era: not counted
    tuner.ready()
    assert tuner.era == 2


def test_no_settings_is_an_error():
    with pytest.raises(ValueError, match="at least one"):
        Tuner([])


def test_a_window_counts_whole_bursts():
    """Groups computed at once finish together: a window from a waited-for take to another counts whole bursts.
    Bursts of 4 groups of 100 records each second are 400 records/s; closing inside a burst would say 500."""
    tuner = Tuner(ladder(2), window_seconds=2.0, window_groups=10)
    tuner.ready()
    changes = {(second, i): tuner.taken(second + i * 1e-4, 1, 100, waited=i == 0)
               for second in range(1, 6) for i in range(4)}
    assert {k: v for k, v in changes.items() if v is not None} == {(4, 0): Setting(H, 1)}
    assert tuner.history == [(Setting(H, 0), 400.0, 0.0)]  # 12 groups from second 1 to second 4


def test_a_caller_that_never_waits_is_measured_over_twice_the_window():
    tuner = Tuner(ladder(2), window_seconds=1.0, window_groups=3)
    tuner.ready()
    takes = [tuner.taken(0.1 * i, 1, 100, waited=False) for i in range(21)]
    assert takes[:20] == [None] * 20 and takes[20] == Setting(H, 1)
    assert [(s, round(r)) for s, r, _ in tuner.history] == [(Setting(H, 0), 1000)]


def test_cores_kept_busy_end_the_climb_and_probes_look_only_down():
    steps = ladder(4)
    clock = {"now": 0.0}

    def cpu():  # this process and its workers: 95% of the 4 cores for the first 45 s, then 50%
        now = clock["now"]
        return 4 * (0.95 * min(now, 45.0) + 0.5 * max(0.0, now - 45.0))

    tuner = Tuner(steps, cpu=cpu, cores=4, window_seconds=1.0, probe_seconds=20.0)
    rates = by_step(steps, [1000, 1900, 2500, 2600, 2550])

    def rate(setting, now):
        clock["now"] = now
        return rates(setting, now)

    simulate(tuner, rate, groups=120)
    assert [(s.processes, round(r), round(b, 2)) for s, r, b in tuner.history][:4] == [
        (0, 1000, 0.95),  # saturated: no climb
        (0, 1000, 0.95),  # the probe after 20 s: still saturated, and nothing below: stays
        (0, 1000, 0.5), (1, 1900, 0.5)]  # the next probe (40 s later): cores free, one step up pays
    assert tuner.setting.processes >= 1


def test_busy_cores_after_a_gain_try_every_group_in_workers():
    """A Python map_fn: threads here hold the GIL (half the cores busy); one worker process nearly doubles the rate
    and fills the cores; moving the rest of the work out of this process is worth one more window."""
    steps = ladder(2)
    clock = {"now": 0.0}
    busy = {0: 0.5, 1: 0.94, 2: 0.97}
    used = {"cpu": 0.0, "at": 0.0}

    def cpu():  # CPU accrues at the busy share of the setting in force
        used["cpu"] += (clock["now"] - used["at"]) * 2 * busy[tuner.at]
        used["at"] = clock["now"]
        return used["cpu"]

    tuner = Tuner(steps, cpu=cpu, cores=2, window_seconds=1.0, probe_seconds=1e9)
    rates = by_step(steps, [9500, 17500, 21000])

    def rate(setting, now):
        clock["now"] = now
        return rates(setting, now)

    simulate(tuner, rate, groups=100)
    assert tried(tuner) == [(H, 0), (H, 1), (P, 2)] and tuner.setting == Setting(P, 2)
    # the same busy cores after no gain (threads here fill them): no climb
    tuner = Tuner(steps, cpu=cpu, cores=2, window_seconds=1.0, probe_seconds=1e9)
    busy[0] = 0.9
    used.update(cpu=0.0, at=0.0)
    simulate(tuner, rate, groups=100)
    assert tried(tuner) == [(H, 0)] and tuner.setting == Setting(H, 0)
