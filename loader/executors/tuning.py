"""`worker_count="auto"`: which workers to run, chosen from the rate measured with each (the policy; the executor
that applies it: loader/executors/tuned.py).

A setting is where groups are computed: this process's threads, worker processes, or both. The settings form a
ladder from cheapest (threads here: no process to start, no transfer) to dearest (a worker process a core; the
counts double, so a 96-core host climbs in 8 steps). The tuner

1. climbs the ladder, measuring each setting's rate for a window (records the caller took per second, counting
   only groups sent once the setting's workers had all answered once: a worker's start is not held against it),
   while a step gains more than `margin`; it stops after two steps that gain nothing, or one that loses more than
   `margin`. A step that keeps the cores busy (`SATURATED`: CPU this process and its workers used over the window)
   ends the climb too, as another worker would find no core: threads here that fill the cores leave processes only
   the cost of moving batches. When that step gained over the one before, though (workers paid), it measures the
   last step as well, every group in a worker process: threads here running Python hold the GIL against the caller;
2. settles on the cheapest setting measured within `margin` of the best: when the caller (a training step) is
   slower than every setting, that is threads here, and the cores stay with the trainer;
3. probes while the run goes on: after `probe_seconds` it measures the setting in force and its neighbours on the
   ladder again and moves when one is better, so a run adapts when its step gets faster (compilation ends) or the
   host gets busier. The interval doubles while nothing changes (up to `max_probe_seconds`).

The batches never depend on the setting (a group is a pure function of its index): tuning changes only the speed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Setting:
    here: bool  # this process computes groups on its threads
    processes: int  # worker processes

    def __str__(self) -> str:
        parts = (["threads here"] if self.here else []) + (
            [f"{self.processes} worker process{'es' if self.processes != 1 else ''}"] if self.processes else [])
        return " + ".join(parts)


def ladder(cores: int) -> list[Setting]:
    """Settings from cheapest to dearest on a host with `cores` cores for the loader: threads here, then threads
    here and 1, 2, 4, ... worker processes up to one fewer than the cores, then a worker a core with this process
    only taking (its threads compete with the caller's own work for the GIL)."""
    steps = [Setting(True, 0)]
    p = 1
    while p < cores:
        steps.append(Setting(True, p))
        p *= 2
    if cores > 1 and steps[-1].processes != cores - 1:
        steps.append(Setting(True, cores - 1))
    steps.append(Setting(False, max(1, cores)))
    return steps


@dataclasses.dataclass
class _Window:
    """A setting's measurement. Groups come in bursts (the groups computed at once finish together), so the window
    runs from a take the caller waited for (a burst's first group) to a later one, counting the groups between
    (the first included, the last not): whole bursts, however long they are."""

    era: int
    first: float | None = None  # the first take of the window, and CPU then
    cpu0: float = 0.0
    after_first: int = 0  # records taken after the first take
    groups_after_first: int = 0
    t0: float | None = None  # the first take the caller waited for
    records: int = 0  # records of the groups taken since t0 (its own included)
    groups: int = 0
    edge: tuple[float, int, int] | None = None  # (time, records, groups) at the latest take waited for after t0

    def add(self, now: float, records: int, waited: bool) -> None:
        if self.first is None:
            self.first = now
        else:
            self.after_first += records
            self.groups_after_first += 1
        if waited and self.t0 is None:
            self.t0 = now
        elif waited:
            self.edge = (now, self.records, self.groups)
        if self.t0 is not None:
            self.records += records
            self.groups += 1

    def rate(self, now: float, seconds: float, groups: int) -> float | None:
        """Records/s once the window is long enough: whole bursts between two waits; or, when the caller hardly
        waits (it is slower than the loader), the takes over twice the time."""
        if self.edge is not None:
            t, records, n = self.edge
            if t - self.t0 >= seconds and n >= groups:
                return records / (t - self.t0)
        if now - self.first >= 2 * seconds and self.groups_after_first >= groups:
            return self.after_first / (now - self.first)
        return None


# The loader's processes using this much of the cores (CPU seconds a second, over the cores) leave nothing for
# another worker: the climb stops there, and probes do not try a dearer setting.
SATURATED = 0.85

# A window: at least this many seconds and groups (tests shorten them).
WINDOW_SECONDS = 2.0
WINDOW_GROUPS = 3
PROBE_SECONDS = 60.0  # the first probe after settling; doubled while nothing changes, up to MAX_PROBE_SECONDS
MAX_PROBE_SECONDS = 960.0


class Tuner:
    """Decides the setting from (time, era, records, waited) of each group the caller takes (see module doc).

    The executor tags each group it sends with `era` as it is then. When `taken` returns a setting, the executor
    applies it and calls `ready()` once the setting's new workers have all answered: that opens the setting's
    measuring window (a new era). `cpu()`: CPU seconds used so far by this process and its workers, over `cores`
    cores (None: not known; no step counts as saturated)."""

    def __init__(self, steps: list[Setting], *, cpu: Callable[[], float] | None = None, cores: int = 1,
                 window_seconds: float | None = None, window_groups: int | None = None, margin: float = 0.05,
                 probe_seconds: float | None = None, max_probe_seconds: float | None = None):
        if not steps:
            raise ValueError("the tuner needs at least one setting")
        self.steps = steps
        self._cpu, self.cores = cpu, cores
        self.window_seconds = WINDOW_SECONDS if window_seconds is None else window_seconds
        self.window_groups = WINDOW_GROUPS if window_groups is None else window_groups
        self.margin = margin
        self.probe_seconds = PROBE_SECONDS if probe_seconds is None else probe_seconds
        self.max_probe_seconds = MAX_PROBE_SECONDS if max_probe_seconds is None else max_probe_seconds
        self.at = 0  # the step in force
        self.era = 0
        self.history: list[tuple[Setting, float, float]] = []  # every window: (setting, records/s, cores busy 0-1)
        self._rates: dict[int, float] = {}  # this round's measurements: step -> records/s
        self._busy: dict[int, float] = {}  # step -> the share of the cores busy in its latest window
        self._trials: list[int] = []  # steps a probe round still measures
        self._climbing = True
        self._round_from = 0  # the step in force when this round began
        self._window: _Window | None = _Window(-1)  # measuring (None: settled)
        self._waiting = True  # the setting in force is starting: its window opens at ready()
        self._settled_at: float | None = None
        self._interval = self.probe_seconds

    @property
    def setting(self) -> Setting:
        return self.steps[self.at]

    @property
    def settled(self) -> bool:
        return self._window is None

    def ready(self) -> None:
        """The setting in force has all its workers: measure it from the groups sent from now on."""
        self.era += 1
        if self._waiting:
            self._waiting = False
            self._window = _Window(self.era)

    def taken(self, now: float, era: int, records: int, waited: bool = True) -> Setting | None:
        """The caller took a group sent in `era` holding `records` at time `now` (having `waited` for it, or finding
        it done). Returns a setting to change to."""
        w = self._window
        if w is None:  # settled: probe when the interval has passed
            if self._settled_at is None:
                self._settled_at = now
            elif len(self.steps) > 1 and now - self._settled_at >= self._interval:
                self._round_from, self._rates = self.at, {}
                self._trials = [s for s in (self.at + 1, self.at - 1) if 0 <= s < len(self.steps)]
                self.era += 1
                self._window = _Window(self.era)  # the step in force first: measured from the next group sent
            return None
        if self._waiting or era != w.era:
            return None
        if w.first is None:
            w.cpu0 = self._cpu() if self._cpu else 0.0
        w.add(now, records, waited)
        rate = w.rate(now, self.window_seconds, self.window_groups)
        if rate is None:
            return None
        busy = (self._cpu() - w.cpu0) / max(now - w.first, 1e-9) / self.cores if self._cpu else 0.0
        self._rates[self.at], self._busy[self.at] = rate, busy
        self.history.append((self.setting, rate, busy))
        log.info("loader workers: %s: %s records/s, %.0f%% of %d cores busy", self.setting, f"{rate:,.0f}",
                 100 * busy, self.cores)
        step = self._next_trial()
        return self._settle() if step is None else self._measure(step)

    def _next_trial(self) -> int | None:
        if not self._climbing:  # a probe: one step up only when the setting in force left cores idle
            if self._busy[self._round_from] >= SATURATED and self._round_from + 1 in self._trials:
                self._trials.remove(self._round_from + 1)
            return self._trials.pop(0) if self._trials else None
        r = self._rates[self.at]
        before = [self._rates[s] for s in range(self.at)]
        lost = bool(before) and r < max(before) * (1 - self.margin)
        flat = [not before[:i] or x <= max(before[:i]) * (1 + self.margin) for i, x in enumerate(before + [r])]
        last = len(self.steps) - 1
        if self._busy[self.at] >= SATURATED:
            # No core left for another worker. But when the workers added last paid (this step gained), this
            # process's threads may be holding the rest back (a Python map_fn holds the GIL against the caller):
            # the last step, with every group in a worker process, is worth one window.
            self._climbing = False
            gained = bool(before) and not flat[-1]
            return last if gained and self.at < last and last not in self._rates else None
        if self.at < last and not (lost or (len(flat) >= 3 and flat[-1] and flat[-2])):
            return self.at + 1
        self._climbing = False
        return None

    def _settle(self) -> Setting | None:
        best = max(self._rates.values())
        choice = min(s for s, r in self._rates.items() if r >= best * (1 - self.margin))
        log.info("loader workers: chose %s (%s)", self.steps[choice],
                 ", ".join(f"{self.steps[s]}: {r:,.0f}/s" for s, r in sorted(self._rates.items())))
        unchanged = choice == self._round_from and len(self.history) > len(self._rates)
        self._interval = min(2 * self._interval, self.max_probe_seconds) if unchanged else self.probe_seconds
        self._window, self._settled_at = None, None
        if choice == self.at:
            return None
        self.at = choice
        return self.steps[choice]

    def _measure(self, step: int) -> Setting | None:
        self._window = _Window(-1)
        if step == self.at:  # nothing to apply: measure from the next group sent
            self.era += 1
            self._window.era = self.era
            return None
        self.at, self._waiting = step, True
        return self.steps[step]
