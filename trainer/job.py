"""The processes of one multi-host job agree before they train: the same settings, one workdir that all of them see,
and a setup that went well on every one of them.

Without this, a mismatch shows late or never. Processes given different `batch_size`s train on wrong values (each
feeds the step arrays of its own size) until a collective waits forever; different `steps` leave one process
waiting in a checkpoint's barrier for the other, which has finished; workdirs on each host's own disk leave every
checkpoint unfinished; one host without the data fails alone while the others wait in the first collective, and JAX
ends them minutes later with a C++ stack that does not say why. Each check here is one exchange through
jax.distributed's key-value store (the coordination service every process already talks to; no collective, so a
process that fails can still say so), and its failure is one line, the same on every process, exit 2.

    job.check_settings(config)           # right after jax.distributed.initialize
    job.check_shared(config.workdir)
    with job.alone_in(config.workdir):   # no other run trains in this workdir
        with job.together("setup"):      # one process's error here is every process's
            ...
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import jax

from dataset_format import storage
from dataset_format.lease import LEASE_NAME, Lease, LeaseHeld

log = logging.getLogger(__name__)

PREFIX = "arrayrecord_trainer"  # the key-value store's keys: PREFIX/<what>/<process index>
# Settings that may differ between hosts: the process's index, and how each host reads and caches (the batches are
# the same bitwise for any worker count or cache)
PER_HOST_KEYS = ("process_id", "data_workers", "data_cache_bytes", "data_cache_dir", "compilation_cache")
_POLL_S = 30.0  # a wait for another process logs a line this often


class JobMismatch(ValueError):
    """The job's processes were started with settings, or in places, that do not make one job."""


class WorkdirInUse(ValueError):
    """Another training run holds the workdir."""


def _multi() -> bool:
    return jax.process_count() > 1


def exchange(what: str, value: str) -> list[str]:
    """Publishes this process's `value` under `what` and returns every process's, in process order (waiting for each,
    with a line every 30 s). Process 0, whose coordination service holds them, returns only once every process has
    read them all: a process that fails on what it read may then leave at once without leaving another one unread
    (which JAX aborts, C++ stack and all, when the service is gone)."""
    from jax._src import distributed

    client, me, count = distributed.global_state.client, jax.process_index(), jax.process_count()
    client.key_value_set(f"{PREFIX}/{what}/{me}", value)
    values = [_get(client, f"{PREFIX}/{what}/{index}", f"its {what}", index) for index in range(count)]
    client.key_value_set(f"{PREFIX}/{what}/read/{me}", "1")
    if me == 0:
        for index in range(1, count):
            _get(client, f"{PREFIX}/{what}/read/{index}", f"the end of its {what}", index)
    return values


def _get(client, key: str, what: str, index: int) -> str:
    started = time.monotonic()
    while True:
        try:
            return client.blocking_key_value_get(key, int(_POLL_S * 1000))
        except Exception as e:  # noqa: BLE001 - jaxlib's error for a deadline: wait on, saying so
            if "DEADLINE_EXCEEDED" not in str(e):
                raise
            log.info("waiting for process %d of %d to reach %s (%.0f s)", index, jax.process_count(), what,
                     time.monotonic() - started)


def _settings(config) -> dict:
    return {k: v for k, v in dataclasses.asdict(config).items() if k not in PER_HOST_KEYS}


def check_settings(config) -> None:
    """Every process has this one's settings (all but PER_HOST_KEYS); else JobMismatch naming each that differs and
    its value on each process."""
    if not _multi():
        return
    theirs = [json.loads(v) for v in exchange("settings", json.dumps(_settings(config), sort_keys=True, default=str))]
    mine = theirs[jax.process_index()]  # (as the others read it: tuples as lists, ...)
    differ = sorted({k for s in theirs for k in set(s) | set(mine) if s.get(k) != mine.get(k)})
    if differ:
        said = "; ".join(f"{k}: " + ", ".join(f"{s.get(k)!r} on process {i}" for i, s in enumerate(theirs))
                         for k in differ[:5])
        more = f" (and {len(differ) - 5} more)" if len(differ) > 5 else ""
        raise JobMismatch(f"the job's processes were started with different settings: {said}{more}; start every "
                          "process with the same settings (only process_id differs)")
    devices = exchange("devices", str(jax.local_device_count()))
    if len(set(devices)) > 1:  # (orbax's first all-gather said "cannot reshape array of size 3 into shape (2,2)")
        raise JobMismatch("the job's processes have different numbers of devices: " + ", ".join(
            f"{n} on process {i}" for i, n in enumerate(devices)) + "; every host needs as many (the same machine "
            "type, and CUDA_VISIBLE_DEVICES or XLA_FLAGS alike on each)")


def check_shared(workdir: str) -> None:
    """`workdir` made on every process, and every process sees the file process 0 writes there (checkpoints are
    written by all of them into one directory, and finished only when all have written); else one line, the same on
    every process (a process that could not make it left the others waiting ~100 s, then JAX's C++ abort)."""
    path, token = storage.join(workdir, ".job"), ""
    with together("workdir"):
        try:
            storage.makedirs(workdir)
            if _multi() and jax.process_index() == 0:
                token = uuid.uuid4().hex
                storage.write_text(path, token)
        except OSError as e:  # (a path under a file, no permission, a read-only mount: EROFS is a plain OSError)
            raise ValueError(f"workdir={workdir} cannot be made or written here ({type(e).__name__}: "
                             f"{e.strerror or e}); give a directory this process can write (a path under a file, or "
                             "a read-only mount, cannot hold the run)") from None
    if not _multi():
        return
    token = exchange("workdir_token", token)[0]
    try:
        seen = storage.read_text(path)
    except OSError:  # (said as not seen)
        seen = None
    blind = [i for i, ok in enumerate(exchange("workdir_seen", "1" if (seen or "").strip() == token else "0"))
             if ok != "1"]
    if blind:
        raise JobMismatch(f"workdir={workdir} is not one directory for the whole job: process(es) "
                          f"{', '.join(map(str, blind))} do not see the file process 0 wrote there; give every "
                          "process a workdir they all share (gs://bucket/run, or a mounted NFS/Filestore path)")


def same_data(resolve: Callable[[], Any], seen: Callable[[Any], dict[str, dict]]) -> Any:
    """`resolve()`'s sources, which every process reads alike, or JobMismatch naming the source and what each process
    sees (`seen(sources)`: {source: {"shards", "records", "digest"}}). A host whose copy of the data is another
    conversion, or a part of it, or a gs:// dataset rewritten between two processes' listings: each process planned
    its own global order over its own records, and the job read some records twice and others never, or hung in a
    collective at an epoch's end. An error of `resolve` on any process is every process's, as in `together`."""
    if not _multi():
        return resolve()
    try:
        data = resolve()
        mine = json.dumps({"seen": seen(data)}, sort_keys=True)
    except BaseException as e:  # said to the others first (they wait for this process's value), then raised
        exchange("data", json.dumps({"error": _said(e)}))
        raise
    theirs = [json.loads(v) for v in exchange("data", mine)]
    failed = [(i, t["error"]) for i, t in enumerate(theirs) if "error" in t]
    if failed:
        raise JobMismatch(f"process {failed[0][0]} stopped in its setup: {failed[0][1]}")
    for key in sorted({k for t in theirs for k in t["seen"]}):
        views = [t["seen"].get(key) for t in theirs]
        if all(v == views[0] for v in views):
            continue
        counts = {(v["shards"], v["records"]) for v in views if v}
        said = "; ".join(f"process {i}: {v['shards']:,} shard(s) of {v['records']:,} records" if len(counts) > 1
                         else f"process {i}: digest {v['digest']}" for i, v in enumerate(views) if v)
        raise JobMismatch(f"{key}: the job's processes see different data ({said}"
                          f"{'' if len(counts) > 1 else ': the same counts, other shard names, sizes or versions'}); "
                          "every process must read the same conversion: a copy on each host made from one "
                          "conversion, or one gs:// dataset not rewritten while the job starts")
    return data


def _said(e: BaseException) -> str:
    """An error as another process's line names it: its type and first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


@contextlib.contextmanager
def together(what: str) -> Iterator[None]:
    """Around a stretch of setup with no collective in it: an error there on any process is raised on every process
    at its end (JobMismatch naming that process and its error), so none waits for it in a later collective."""
    if not _multi():
        yield
        return
    try:
        yield
    except BaseException as e:
        exchange(what, _said(e))
        raise
    failed = [(i, status) for i, status in enumerate(exchange(what, "")) if status]
    if failed:
        index, status = failed[0]
        raise JobMismatch(f"process {index} stopped in its {what}: {status}")


@contextlib.contextmanager
def alone_in(workdir: str) -> Iterator[None]:
    """The run holds `workdir`'s lease (process 0 for the job; dataset_format/lease.py): a second run started on the
    same workdir (a job launched twice, two runs given one directory) stops with one line naming the first, instead
    of both writing checkpoints and metrics there. A lease whose run is known dead (its process gone on this host, no
    heartbeat for 2 minutes) is taken over; one held from another host is watched until it beats or lapses, so a job
    restarted after its host was lost waits at most that long."""
    def held(holder: str) -> str:
        return (f"workdir={workdir} is in use by another training run ({holder}); stop that run, or give this one "
                f"another workdir ({LEASE_NAME} there names the run that holds it)")

    with contextlib.ExitStack() as holding:
        with together("workdir lease"):
            if jax.process_index() == 0:
                try:
                    holding.enter_context(Lease(workdir, held=held, wait=True))
                except LeaseHeld as e:
                    raise WorkdirInUse(str(e)) from None
        yield


@contextlib.contextmanager
def evaluating_alone(eval_dir: str) -> Iterator[None]:
    """The sidecar evaluator holds `eval_dir`'s lease (WORKDIR/eval; the training run's is WORKDIR's own): a second
    evaluator of the same workdir stops with one line naming the first, instead of both appending each step's results
    to its metrics.jsonl."""
    def held(holder: str) -> str:
        return (f"{eval_dir} is in use by another evaluator ({holder}); stop that one, or let it evaluate the "
                f"checkpoints alone ({LEASE_NAME} there names the process that holds it)")

    storage.makedirs(eval_dir)
    with contextlib.ExitStack() as holding:
        try:
            holding.enter_context(Lease(eval_dir, held=held, wait=True))
        except LeaseHeld as e:
            raise WorkdirInUse(str(e)) from None
        yield
