"""What a read group cost, stage by stage, and which stage bounds the loader's rate.

Every read group (loader/pipeline.py `_ReadGroup`) times its stages on the thread that computes it, wherever that
is (this process's threads, a worker process, a Ray actor), and the time travels back with its batches:

    plan      which records: the permutation and this host's rows
    read      the records' bytes: file reads, decompression, hash checks (wall time beyond CPU time: waiting on I/O)
    decode    records -> features (Example/TFDS parsing)
    map       map_fn / random_map_fn (JPEG decode, crops, tokenising)
    collate   features -> batch arrays
    pack      raw records -> arrays to send (worker processes)

and the iterator adds what the caller's process spent: `take` (CPU to receive a group from workers and hand it
out: the transport's cost on the training host) and `wait` (wall time the caller waited for a group: when it is a
small part of the time, the loader is not what bounds the training step).

    it = iter(loader.load(...)); ...; print(it.stage_times().report())
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

STAGES = ("plan", "read", "decode", "map", "collate", "pack")


@dataclasses.dataclass
class Group:
    """A computed read group: its batches, its records and what each stage cost (seconds of thread CPU, and the
    read's wall time)."""

    batches: Any
    records: int
    cpu: dict[str, float]
    read_wall: float = 0.0


class Stopwatch:
    """Thread CPU and wall time per stage, on the thread computing one group."""

    def __init__(self):
        self.cpu = dict.fromkeys(STAGES, 0.0)
        self.read_wall = 0.0
        self._stage, self._cpu0, self._wall0 = None, 0.0, 0.0

    def stage(self, name: str) -> None:
        """Ends the stage running (if any) and starts `name` (None: ends it only)."""
        cpu, wall = time.thread_time(), time.perf_counter()
        if self._stage is not None:
            self.cpu[self._stage] += cpu - self._cpu0
            if self._stage == "read":
                self.read_wall += wall - self._wall0
        self._stage, self._cpu0, self._wall0 = name, cpu, wall

    def group(self, batches: Any, records: int) -> Group:
        self.stage(None)
        return Group(batches, records, self.cpu, self.read_wall)


@dataclasses.dataclass
class StageTimes:
    """Totals over the groups an iterator handed out."""

    groups: int = 0
    records: int = 0
    cpu: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    read_wall: float = 0.0
    take: float = 0.0  # CPU seconds the caller's thread spent receiving groups
    wait: float = 0.0  # wall seconds the caller waited for groups
    started: float = dataclasses.field(default_factory=time.perf_counter)

    def add(self, group: Group, take: float, wait: float) -> None:
        self.groups += 1
        self.records += group.records
        for k, v in group.cpu.items():
            self.cpu[k] += v
        self.read_wall += group.read_wall
        self.take += take
        self.wait += wait

    def report(self, elapsed: float | None = None, compute_cores: float | None = None,
               setting: str | None = None, tuned: bool = False, waited: float | None = None,
               idle: float | None = None, tokens: bool = False, codec: str | None = None) -> Report:
        elapsed = time.perf_counter() - self.started if elapsed is None else elapsed
        return Report(self, elapsed, compute_cores, setting, tuned, waited, idle, tokens, codec)


GROW_WAIT = 0.03  # the caller waiting more than this share of the time asks worker_count="auto" for more workers
STEADY_SECONDS = 1.0  # a timed window shorter than this has no steady rate (the read-ahead served much of it)


def codec_of(writer_options: str) -> str:
    """The compression named in an ArrayRecord file's writer options ("group_size:1,...,snappy,..."): "snappy",
    "zstd", "brotli" or "uncompressed" (riegeli's default, brotli, where none is named)."""
    names = {option.split(":", 1)[0] for option in writer_options.split(",")}
    return next((codec for codec in ("uncompressed", "snappy", "zstd", "brotli") if codec in names), "brotli")


def _cheaper_read(codec: str | None) -> str:
    if codec == "uncompressed":
        return "nothing cheaper to read: the shards are uncompressed already"
    if codec == "snappy":
        return "uncompressed shards (convert --compression uncompressed: nothing to decompress, larger files)"
    return "a faster codec at conversion (convert --compression snappy: it decompresses faster than zstd)"


@dataclasses.dataclass
class Report:
    """Where the time went and what bounds the rate. `compute_cores`: the cores the groups were computed on (None:
    not known, so the CPU-bound test is skipped)."""

    times: StageTimes
    elapsed: float
    compute_cores: float | None = None
    setting: str | None = None  # where groups were computed (worker_setting(): "threads here", "2 worker processes")
    tuned: bool = False  # worker_count="auto" chose the setting
    waited: float | None = None  # the share of the time the caller waited for batches (None: not measured)
    # the share of the compute cores idle over the window, host-wide (/proc/stat: other processes' use counts), where
    # measured; None: taken as what the loader's own CPU time leaves
    idle: float | None = None
    tokens: bool = False  # the records are token ids (a pre-tokenized dataset): one feature, nothing to select
    codec: str | None = None  # the shards' compression (codec_of: "snappy", "zstd", ...); None: not known

    def per_record_ms(self) -> dict[str, float]:
        n = max(1, self.times.records)
        return {k: 1e3 * v / n for k, v in self.times.cpu.items()}

    def _waited(self) -> float:
        """The share of the time the caller waited: its own measure where given (its time in next(), taking groups
        from workers too), else the groups' waits."""
        return self.waited if self.waited is not None else self.times.wait / max(self.elapsed, 1e-12)

    def bound(self) -> tuple[str, str]:
        """(what bounds the rate, what to change)."""
        t = self.times
        if t.records == 0:
            return "nothing measured", "take more batches"
        waited = self._waited()
        if waited < 0.1:
            return ("the caller", "the loader waited on the caller: batches were ready "
                    f"{100 * (1 - waited):.0f}% of the time; more loader workers would not help")
        work = sum(t.cpu.values())
        largest = max(STAGES, key=lambda k: t.cpu[k])
        io_wait = t.read_wall - t.cpu["read"]
        if self.compute_cores and work / self.elapsed < 0.6 * self.compute_cores and \
                io_wait > 0.5 * self.elapsed * self.compute_cores:
            return ("read (I/O)", "reads wait on storage: raise num_threads= or prefetch= (more reads in flight; bench: --threads), "
                    "cache_bytes= for gs://, or stage the dataset on local disk (python -m loader stage)")
        elsewhere = self.setting is None or "process" in self.setting or "actor" in self.setting
        if self.compute_cores and elsewhere and t.take > 0.5 * self.elapsed:  # (threads here hand over nothing)
            return ("transfer", "the caller's process is busy taking groups from the workers: fewer, larger groups "
                    "(records_per_read=), or decode less in workers (features=)")
        busy = work / self.elapsed / self.compute_cores if self.compute_cores else None
        if busy is not None and self.idle is not None:  # the host's: what other processes use is not idle
            busy = max(busy, 1 - self.idle)
        share = t.cpu[largest] / max(work, 1e-12)
        cheaper = {"read": _cheaper_read(self.codec),
                   "decode": "decode only the features you need (features=)",
                   "map": "a cheaper map function",
                   "collate": "fewer or smaller features (features=)",
                   "plan": "larger batches or records_per_read=",
                   "pack": "decode=None on threads (worker_count=0)"}[largest]
        if self.tokens and largest in ("decode", "collate"):  # one feature, stored in the narrowest integer type
            cheaper = f"nothing cheaper to {largest}: the records are token ids already"
        if busy is None:
            more = "more workers"
        elif busy >= 0.85:
            more = (f"the {self.compute_cores:g} cores are busy: more cores (Ray actors on other machines: "
                    "docs/ray-workers.md)")
        elif self.tuned:
            more = (f"{100 * (1 - busy):.0f}% of the cores idle with worker_count=\"auto\" (it starts workers while "
                    "the caller waits)")
        else:
            more = f"{100 * (1 - busy):.0f}% of the cores idle: more workers (worker_count=, or \"auto\")"
        where = f" ({100 * busy:.0f}% of {self.compute_cores:g} cores busy)" if busy is not None else ""
        return f"{largest}{where}", f"{largest} is {100 * share:.0f}% of the work; {more}, or {cheaper}"

    def lines(self) -> list[str]:
        t = self.times
        ms = self.per_record_ms()
        rate = t.records / max(self.elapsed, 1e-12)
        stages = ", ".join(f"{k} {v * 1e3:,.1f}" for k, v in ms.items() if t.cpu[k] > 0)
        io = max(0.0, t.read_wall - t.cpu["read"]) * 1e6 / max(1, t.records)
        head = f"{t.records:,} records in {self.elapsed:.1f} s: {rate:,.0f} records/s"
        if self.setting:
            head += f" ({self.setting})"
        bound, advice = self.bound()
        return [head,
                f"CPU per 1,000 records (ms): {stages or 'none'}; read's I/O wait {io:,.1f} ms",
                f"the caller: {1e3 * t.take / max(1, t.groups):,.2f} ms CPU a group taking it, waited "
                f"{100 * self._waited():.0f}% of the time",
                f"bound by {bound}: {advice}"] + (
            [f"timed over {self.elapsed:.2f} s only: too short for a steady figure (take more batches)"]
            if self.elapsed < STEADY_SECONDS else [])

    def __str__(self) -> str:
        return "\n".join(self.lines())
