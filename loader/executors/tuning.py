"""`worker_count="auto"`: how many worker processes the caller needs, from what it waits for (the policy; the executor
that applies it: loader/executors/tuned.py).

A setting is where groups are computed: this process's threads (no process to start, nothing to move between
processes: the cheapest), or N worker processes. The tuner watches windows of the groups the caller takes (at least
`window_seconds` and `window_groups` takes with the caller's time before them, opened once the setting's workers have
all answered) and measures, per window:

    wait      the share of the time the caller waited for a group (it asked before the group was done)
    demand    records/s the caller would take if it never waited: a group's records over the caller's own time
              spent on it (from taking it to asking for the next), the low median over the window (a pause to
              compile or evaluate is one take, not the window's rate; a caller that asks for its second batch at once
              is one take too)
    cost      CPU seconds a record costs to compute (the groups' stage times: loader/executors/stages.py)
    idle      cores of the host (this process's affinity) that nobody used: the trainer's own cores are busy

and decides:

1. **grow** when the caller waits (more than GROW_WAIT of the time) and cores are idle: to the processes its demand
   needs (demand x cost, or what the processes running deliver each when that is less, plus HEADROOM), at least one
   more, at most the cores the loader uses now plus the idle ones
   (a caller that never stops asking, a benchmark, gets every idle core) and `max_processes`. The next window checks
   the gain: a step that leaves the caller waiting at no better rate is undone, and growing waits HOLD_SECONDS
   (doubled each time it happens again);
2. **shrink** when the caller has not waited for SHRINK_WINDOWS windows in a row: to what its rate needs with
   SHRINK_HEADROOM (never below one process); a shrink that makes the caller wait again is undone by the next grow,
   and the next shrink waits twice as many windows;
3. otherwise keep the setting: a caller that does not wait is served; one that waits with no core idle is bound by
   the cores, and another worker would find none.

So a training step that waits for input gets the workers it needs within a few windows (seconds),
an idle loader gives back its cores, and the cores the trainer uses are never counted as free. One log line per
change, with the figures it was decided on. The batches never depend on the setting (a group is a pure function of
its index): tuning changes only the speed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from collections.abc import Callable

from loader.executors.stages import GROW_WAIT

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Setting:
    here: bool  # this process computes groups on its threads
    processes: int  # worker processes

    def __str__(self) -> str:
        parts = (["threads here"] if self.here else []) + (
            [f"{self.processes} worker process{'es' if self.processes != 1 else ''}"] if self.processes else [])
        return " + ".join(parts)


HERE = Setting(True, 0)

# A window: at least this many seconds and groups (tests shorten them). One that lasts longer than MAX_WINDOW_SECONDS
# (the caller stopped taking: compiling, evaluating, checkpointing) is dropped and begun again.
WINDOW_SECONDS = 1.0
WINDOW_GROUPS = 3
MAX_WINDOW_SECONDS = 20.0
SHRINK_WAIT = 0.005  # ... less than this, SHRINK_WINDOWS windows in a row, for fewer
SHRINK_WINDOWS = 5
HEADROOM = 1.25  # cores given over the demand's estimate when growing (the transfer, uneven groups)
SHRINK_HEADROOM = 1.6  # ... and kept when shrinking (a wide margin: a shrink too far costs waits)
MIN_IDLE = 0.5  # cores idle for a grow to be worth it
GAIN = 0.05  # a grow that gains less than this (and leaves the caller waiting) is undone
HOLD_SECONDS = 30.0  # no grow for this long after one is undone; doubled each time, up to MAX_HOLD_SECONDS
MAX_HOLD_SECONDS = 960.0


@dataclasses.dataclass
class Window:
    """What the caller took since the window opened."""

    opened: float
    loader_cpu0: float | None
    idle0: float | None
    groups: int = 0
    records: int = 0
    wait: float = 0.0
    asks: list = dataclasses.field(default_factory=list)  # records/s of the caller's own time, a take each
    cpu: float = 0.0  # CPU the groups cost to compute
    costed: int = 0  # records of groups whose CPU is known


@dataclasses.dataclass(frozen=True)
class Measure:
    """A closed window: records/s, the share of the time waited, the rate asked, CPU a record, cores used/idle."""

    setting: Setting
    rate: float
    wait: float
    demand: float
    cost: float | None
    loader_cores: float | None
    idle: float | None

    def describe(self) -> str:
        demand = "it never stopped asking" if math.isinf(self.demand) else f"it asks {self.demand:,.0f}/s"
        parts = [f"the caller took {self.rate:,.0f} records/s waiting {100 * self.wait:.0f}% of the time ({demand})"]
        if self.cost is not None:
            parts.append(f"{1e3 * self.cost:.3g} ms of CPU a record")
        if self.idle is not None:
            parts.append(f"{self.idle:.1f} cores idle")
        return ", ".join(parts)


class Tuner:
    """Decides the setting from the groups the caller takes (see module doc).

    The executor calls `taken(now, records, wait, busy, cpu)` for each group handed out (when, its records, the
    seconds the caller waited for it, the seconds the caller spent since the previous take, the CPU seconds the group
    cost or None) and applies the setting it returns; it calls `ready()` once the setting's workers have all
    answered, which opens the next window. `loader_cpu()`: CPU seconds used so far by this process and its workers;
    `idle()`: idle core-seconds of the host's cores so far (None: not known; grows are then bounded by the cores)."""

    def __init__(self, max_processes: int, *, loader_cpu: Callable[[], float] | None = None,
                 idle: Callable[[], float] | None = None, window_seconds: float | None = None,
                 window_groups: int | None = None, hold_seconds: float | None = None):
        if max_processes < 1:
            raise ValueError(f"max_processes must be >= 1 (got max_processes={max_processes})")
        self.max_processes = max_processes
        self._loader_cpu, self._idle = loader_cpu, idle
        self.window_seconds = WINDOW_SECONDS if window_seconds is None else window_seconds
        self.window_groups = WINDOW_GROUPS if window_groups is None else window_groups
        self._hold = HOLD_SECONDS if hold_seconds is None else hold_seconds
        self.setting = HERE
        self.history: list[Measure] = []  # every window closed
        self._window: Window | None = None  # None: the setting's workers are starting
        self._grown_from: Measure | None = None  # the window before a grow: the next one checks the gain
        self._held_until = -math.inf
        self._quiet = 0  # windows in a row the caller did not wait
        self._shrink_after = SHRINK_WINDOWS
        self._shrunk = False  # the last change was a shrink: a wait after it doubles the next shrink's patience
        self._previous = 0  # records of the group taken last

    def ready(self, now: float) -> None:
        """The setting in force has all its workers (at `now`): measure it from then on."""
        self._window = self._open(now)

    def _open(self, now: float) -> Window:
        return Window(now, self._loader_cpu() if self._loader_cpu else None, self._idle() if self._idle else None)

    def taken(self, now: float, records: int, wait: float, busy: float, cpu: float | None = None) -> Setting | None:
        """The caller took a group of `records` at `now`, having waited `wait` s for it, `busy` s after the one
        before; computing it cost `cpu` s. Returns a setting to change to."""
        w = self._window
        if w is None:
            return None
        if now - w.opened > MAX_WINDOW_SECONDS:  # the caller paused: what it asked before says nothing now
            self._window = self._open(now)
            return None
        w.groups += 1
        w.records += records
        w.wait += wait
        if self._previous:  # the caller spent `busy` on the group before this one (the first has none before it)
            w.asks.append(self._previous / busy if busy > 0 else math.inf)
        self._previous = records
        if cpu is not None:
            w.cpu += cpu
            w.costed += records
        span = now - w.opened
        if span < self.window_seconds or len(w.asks) < self.window_groups:  # the very first take pairs with no time
            return None
        measure = self._measure(w, now)
        self.history.append(measure)
        self._window = self._open(now)
        return self._decide(measure, now)

    def _measure(self, w: Window, now: float) -> Measure:
        span = now - w.opened
        loader_cores = (self._loader_cpu() - w.loader_cpu0) / span if self._loader_cpu else None
        idle = max(0.0, (self._idle() - w.idle0) / span) if self._idle else None
        return Measure(self.setting, w.records / span, min(1.0, w.wait / span),
                       statistics.median_low(w.asks) if w.asks else math.inf, w.cpu / w.costed if w.costed else None,
                       loader_cores, idle)

    def _decide(self, m: Measure, now: float) -> Setting | None:
        before, self._grown_from = self._grown_from, None
        if m.wait > GROW_WAIT:
            self._quiet = 0
            if self._shrunk:  # that shrink went too far: be slower to shrink next time
                self._shrink_after *= 2
                self._shrunk = False
            if before is not None and m.rate < before.rate * (1 + GAIN):
                self._held_until = now + self._hold
                log.info("loader workers: %s -> %s: %s, against %s before: no gain; no more workers for %.0f s",
                         self.setting, before.setting, m.describe(), f"{before.rate:,.0f}/s", self._hold)
                self._hold = min(2 * self._hold, MAX_HOLD_SECONDS)
                return self._change(before.setting)
            if now < self._held_until or (m.idle is not None and m.idle < MIN_IDLE):
                return self._first(m)
            target = self._grow_target(m)
            if target is None:
                return self._first(m)
            self._grown_from = m
            log.info("loader workers: %s -> %s: %s", self.setting, target, m.describe())
            return self._change(target)
        self._shrunk = False
        if m.wait < SHRINK_WAIT:
            self._quiet += 1
        if self._quiet >= self._shrink_after and self.setting.processes > 1 and m.cost is not None:
            target = max(1, math.ceil(m.rate * m.cost * SHRINK_HEADROOM))
            if target < self.setting.processes:
                self._quiet, self._shrunk = 0, True
                new = Setting(False, target)
                log.info("loader workers: %s -> %s: no wait for %d windows; %s", self.setting, new,
                         self._shrink_after, m.describe())
                return self._change(new)
        return self._first(m)

    def _grow_target(self, m: Measure) -> Setting | None:
        """The setting a waiting caller needs, or None when no more processes can help."""
        now = self.setting.processes
        if now >= self.max_processes:
            return None
        needed = m.demand * m.cost * HEADROOM if m.cost is not None and not math.isinf(m.demand) else math.inf
        if now and m.rate > 0:  # what the processes running deliver each, if the groups' CPU undercounts the work
            needed = max(needed, now * m.demand / m.rate * HEADROOM)
        if m.idle is not None:
            used = m.loader_cores if m.loader_cores is not None else now
            needed = min(needed, used + m.idle)
        if math.isinf(needed):
            needed = self.max_processes
        return Setting(False, min(self.max_processes, max(now + 1, math.ceil(needed))))

    def _first(self, m: Measure) -> None:
        """Logs the first window's verdict when it changes nothing (a caller served by the first setting)."""
        if len(self.history) == 1:
            log.info("loader workers: keeping %s: %s", self.setting, m.describe())
        return None

    def _change(self, setting: Setting) -> Setting:
        self.setting = setting
        self._window = None  # opened again at ready()
        return setting
