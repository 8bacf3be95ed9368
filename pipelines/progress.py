"""Progress of a conversion, read from its commit records (`OUT/.shards/`, pipelines/commits.py).

Every worker, local or on Dataflow, writes a shard's record as it commits it, so the records say what is done
wherever the work runs. `Progress` polls them from the launcher while a local run goes on and prints one line,
redrawn in place on a terminal and logged every `LOG_EVERY_S` otherwise:

    converting: 412/1000 shards, 8,240,000 records, 1,650.3 MB of input files (41.2 MB/s), ETA 0:00:48

`status(output)` is the same reading for `python -m pipelines status --output OUT`, for a run anywhere.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
import threading
import time
from collections.abc import Iterable

from dataset_format import storage
from pipelines import commits

log = logging.getLogger(__name__)

POLL_S = 2.0
LOG_EVERY_S = 10.0


def committed_since(output: str, since: float, wanted: set[str] | None = None) -> dict[str, float]:
    """Shards (relative paths) whose commit record was written at or after `since` -> when."""
    details = storage.list_details(storage.join(output, commits.COMMITS_DIR))
    found = {name[:-len(".json")]: mtime for name, (_, mtime) in details.items()
             if commits.is_record(name) and mtime >= since - 1.0}
    return {k: v for k, v in found.items() if wanted is None or k in wanted}


def _totals(output: str, relatives: Iterable[str]) -> tuple[int, int]:
    records = commits.read(output, list(relatives))
    return sum(e.records for e, _ in records.values()), sum(e.bytes for e, _ in records.values())


def format_line(done: int, total: int, records: int, source_bytes: int, total_bytes: int, elapsed: float) -> str:
    rate = source_bytes / max(elapsed, 1e-9)
    eta = (total_bytes - source_bytes) / rate if rate > 0 and done < total else None
    eta_text = f", ETA {datetime.timedelta(seconds=round(eta))}" if eta is not None else ""
    return (f"converting: {done}/{total} shards, {records:,} records, {source_bytes / 1e6:,.1f} MB of input files "
            f"({rate / 1e6:.1f} MB/s){eta_text}")


class Progress:
    """`with Progress(output, tasks): ...` reports the tasks' commits while the block runs (see module doc)."""

    def __init__(self, output: str, tasks, *, stream=None):
        self._output = output
        self._sizes = {t.relative_path: t.source.size for t in tasks}
        self._stream = stream or sys.stderr
        self._tty = hasattr(self._stream, "isatty") and self._stream.isatty()
        self._stop = threading.Event()
        self._seen: set[str] = set()
        self._records = 0
        self._logged: tuple[int, int] | None = None  # the count last logged: the final one is not logged twice
        self._started = time.time()
        self._thread = threading.Thread(target=self._run, daemon=True, name="conversion-progress")

    def __enter__(self) -> Progress:
        if self._sizes:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
            if self._tty:
                self._stream.write("\n")

    def line(self) -> str:
        """Polls the records once and returns the progress line."""
        new = set(committed_since(self._output, self._started, set(self._sizes))) - self._seen
        if new:
            self._records += _totals(self._output, new)[0]
            self._seen |= new
        done_bytes = sum(self._sizes[r] for r in self._seen)
        return format_line(len(self._seen), len(self._sizes), self._records, done_bytes, sum(self._sizes.values()),
                           time.time() - self._started)

    def _run(self) -> None:
        last_log = 0.0
        while not self._stop.wait(POLL_S):
            due = time.monotonic() - last_log >= LOG_EVERY_S
            if self._show(log_it=due) and due:
                last_log = time.monotonic()
        self._show(log_it=True)  # the final count

    def _show(self, log_it: bool) -> bool:
        """Redraws the line on a terminal, or logs it when `log_it` and the count moved since the line last logged
        (its rate moves with the clock alone); False when the records could not be read."""
        try:
            text = self.line()
        except Exception as e:  # noqa: BLE001 - progress is a nicety; the conversion goes on
            log.debug("progress: %s", e)
            return False
        if self._tty:
            self._stream.write("\r" + text + " " * 8)
            self._stream.flush()
        elif log_it and (len(self._seen), self._records) != self._logged:
            log.info("%s", text)
            self._logged = (len(self._seen), self._records)
        return True


FAILED_SHOWN = 10  # failed shards `status` names; the manifest lists every one


def _failure(failed: dict) -> str:
    """A failed shard's line: its error (which names its source), else its source."""
    error = (str(failed.get("error") or "").splitlines() or [""])[0]
    source = str(failed.get("source"))
    return error if source in error else f"{source}: {error}" if error else source


def status(output: str) -> str:
    """What `python -m pipelines status` prints: the lease holder, the manifest, the shards committed since it."""
    from dataset_format.lease import LEASE_NAME, TTL_S, dead, describe
    from pipelines.plan import read_manifest

    lines = []
    lease = storage.read_text(storage.join(output, LEASE_NAME))
    if lease is None:
        lines.append("running: no local run holds the lease (a Dataflow job may: see its console)")
    else:
        try:
            holder = json.loads(lease)
            if not isinstance(holder, dict):
                raise ValueError(f"a {type(holder).__name__}, not a holder's record")
        except ValueError as e:
            raise ValueError(f"{storage.join(output, LEASE_NAME)} is damaged ({e}): when no conversion runs, delete "
                             "it (the next run writes its own)") from None
        why = dead(holder, TTL_S)
        lines.append(f"stopped: the last run ({describe(holder)}) is dead ({why}); the next run takes over"
                     if why else f"running: {describe(holder)}")
    manifest_details = storage.list_details(output).get("manifest.json")
    manifest = read_manifest(output)
    if manifest is None:
        lines.append("manifest: none yet (no run has finished)")
        since = 0.0
    else:
        since = manifest_details[1] if manifest_details else 0.0
        when = datetime.datetime.fromtimestamp(since).strftime("%Y-%m-%d %H:%M:%S")
        lines.append(f"manifest: {len(manifest.shards)} shards, {manifest.total_records:,} records, written {when}"
                     + ("" if manifest.complete else f", {len(manifest.failed)} failed"))
        lines += [f"failed: {_failure(f)}" for f in manifest.failed[:FAILED_SHOWN]]
        if len(manifest.failed) > FAILED_SHOWN:
            lines.append(f"failed: {len(manifest.failed) - FAILED_SHOWN} more (manifest.json's `failed` lists them "
                         "all)")
    newer = committed_since(output, since + 1.0) if since else committed_since(output, 0.0)
    records, nbytes = _totals(output, newer)
    latest = datetime.datetime.fromtimestamp(max(newer.values())).strftime("%H:%M:%S") if newer else None
    lines.append(f"committed since the manifest: {len(newer)} shard(s), {records:,} records, {nbytes / 1e6:,.1f} MB"
                 + (f" (latest at {latest})" if latest else ""))
    return "\n".join(lines)
