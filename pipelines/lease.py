"""One writer per output: a lease, `OUT/.lease.json`, held for the whole of a local conversion.

Created exclusively (a local file opened with O_EXCL; a gs:// object uploaded with `if_generation_match=0`, which
Cloud Storage turns into a 412 when it exists), refreshed by a heartbeat every `ttl / 3` and deleted at the end. A
second run on the same output fails at once, naming the holder (host, pid, since when, last heartbeat) and the fix.
A lease is taken over without asking when its holder is known dead: its heartbeat is older than `ttl`, or it names
this host and a process that no longer runs. `--break-lock` takes it over in any case (the holder must be dead).

Dataflow jobs are not covered here: their launcher returns at submission, and launches by `cloudbuild.yaml` and
the scheduled refresh check for a running job of the same output by its name (docs/operators-guide.md).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time

from dataset_format import storage

log = logging.getLogger(__name__)

LEASE_NAME = ".lease.json"
TTL_S = 120.0


class LeaseHeld(RuntimeError):
    """Another live run holds the output's lease."""


def describe(lease: dict) -> str:
    age = time.time() - lease.get("heartbeat", 0)
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(lease.get("started", 0)))
    return f"host {lease.get('host')!r} pid {lease.get('pid')}, since {started}, last heartbeat {age:.0f} s ago"


def dead(lease: dict, ttl: float) -> str | None:
    """Why the holder is known dead, or None."""
    if time.time() - lease.get("heartbeat", 0) > ttl:
        return f"no heartbeat for over {ttl:.0f} s"
    if lease.get("host") == socket.gethostname():
        try:
            os.kill(int(lease.get("pid", 0)), 0)
        except ProcessLookupError:
            return "its process is gone"
        except (PermissionError, ValueError):
            pass
    return None


class Lease:
    """`with Lease(output): ...` holds the output's lease (see module doc)."""

    def __init__(self, output: str, *, break_lock: bool = False, ttl: float = TTL_S):
        self._path = storage.join(output, LEASE_NAME)
        self._output, self._break, self._ttl = output, break_lock, ttl
        self._body = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        self._generation = None  # gs://: the object's generation we wrote last
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self) -> Lease:
        if not self._create():
            current, generation = self._read()
            reason = "--break-lock" if self._break else (dead(current, self._ttl) if current else "it vanished")
            if reason is None:
                raise LeaseHeld(f"{self._output} is being converted by another run ({describe(current)}); wait for "
                                f"it to finish, or pass --break-lock if that run is dead ({LEASE_NAME} in the output)")
            log.warning("taking over the lease of %s from %s: %s", self._output,
                        describe(current) if current else "nobody", reason)
            self._write(expected_generation=generation)
        self._thread = threading.Thread(target=self._beat, daemon=True, name="lease-heartbeat")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        storage.delete_quietly(self._path)

    def _payload(self) -> str:
        return json.dumps({**self._body, "heartbeat": time.time()})

    def _create(self) -> bool:
        """Creates the lease if there is none; False when one exists."""
        created = storage.create(self._path, self._payload().encode())
        if created and storage.is_remote(self._path):
            self._generation = storage.read_versioned(self._path)[1]
        return created

    def _read(self) -> tuple[dict | None, int | None]:
        data, generation = storage.read_versioned(self._path)
        return (json.loads(data) if data else None), generation

    def _write(self, expected_generation: int | None = None) -> None:
        generation = storage.write_versioned(self._path, self._payload().encode(), generation=expected_generation)
        if storage.is_remote(self._path):
            if generation is None:
                raise LeaseHeld(f"{self._output}: another run took the lease over ({LEASE_NAME} changed under us)")
            self._generation = generation

    def _beat(self) -> None:
        while not self._stop.wait(self._ttl / 3):
            try:
                self._write(expected_generation=self._generation if storage.is_remote(self._path) else None)
            except Exception as e:  # noqa: BLE001 - a missed heartbeat is retried; the run goes on
                log.warning("lease heartbeat for %s failed (%s); retrying", self._output, e)
