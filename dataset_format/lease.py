"""One writer per directory: a lease, `DIR/.lease.json`, held while a conversion writes its output or a training run
its workdir.

Created exclusively and whole (a local file written aside and hard-linked to its name; a gs:// object uploaded with
`if_generation_match=0`, which Cloud Storage turns into a 412 when it exists), refreshed by a heartbeat every
`ttl / 3` and deleted at the end. A second run on the same directory fails, naming the holder (host, pid, since
when, last heartbeat) and the fix.
A lease is taken over without asking when its holder is known dead: its heartbeat is older than `ttl`, or it names
this host and a process that no longer runs. `break_lock=` (the flag that asked, for the log) takes it over in any
case (the holder must be dead). Of runs that take over the same lease at once, one does: on gs:// the write is
conditional on the generation read, locally it is made under an flock(2) of `DIR/.lease.json.lock` (left there)
after reading the lease again.

A holder on another host whose heartbeat is recent may be a run that lives or one whose host was lost a moment ago
(a preempted VM, a restarted pod). With `wait=True` the lease is watched until one of the two shows: its heartbeat
beats (a live run: refused) or lapses (taken over), at most `ttl` seconds.

Dataflow conversions are not covered here: their launcher returns at submission, and launches by `cloudbuild.yaml`
and the scheduled refresh check for a running job of the same output by its name (docs/operators-guide.md).
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
WATCH_EVERY_S = 2.0  # how often a watched lease is read again


class LeaseHeld(RuntimeError):
    """Another live run holds the directory's lease."""


def describe(lease: dict) -> str:
    age = time.time() - lease.get("heartbeat", 0)
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(lease.get("started", 0)))
    return f"host {lease.get('host')!r} pid {lease.get('pid')}, since {started}, last heartbeat {age:.0f} s ago"


def _process(pid: int) -> tuple[str, float] | None:
    """Process `pid`'s state letter and when it started (seconds since the epoch), from Linux's /proc; None where
    that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the command's name, which may hold anything
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        return fields[0].decode(), boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # fields 3 and 22 of stat
    except (OSError, ValueError, IndexError, StopIteration, UnicodeDecodeError):
        return None


def dead(lease: dict, ttl: float) -> str | None:
    """Why the holder is known dead, or None. A holder on this host is judged by its process (one stopped by Ctrl-Z
    or SIGSTOP beats no more, but lives: it is not taken over); others, and one whose process cannot be read, by the
    age of their heartbeat."""
    if lease.get("host") == socket.gethostname():
        try:
            pid = int(lease.get("pid", 0))
            if pid == os.getpid():  # a restarted container's process often gets its predecessor's pid (1, say)
                return "its process is gone (this process has its pid now)"
            os.kill(pid, 0)
        except ProcessLookupError:
            return "its process is gone"
        except (PermissionError, ValueError, OverflowError):
            pid = None
        process = _process(pid) if pid is not None else None
        if process is not None and process[0] in ("Z", "X"):  # killed, not yet reaped by its parent
            return "its process is gone (it has exited; its parent has not reaped it)"
        if process is not None and process[1] > lease.get("started", 0) + 1:  # 1 s: /proc's clock-tick rounding
            return f"its process is gone (pid {pid} is another process, started after the lease)"
        if process is not None:
            return None  # it lives
    if time.time() - lease.get("heartbeat", 0) > ttl:
        return f"no heartbeat for over {ttl:.0f} s"
    return None


def suspended(lease: dict) -> str:
    """', suspended: ...' when the holder is a stopped process of this host (its fix), else ''."""
    if lease.get("host") != socket.gethostname():
        return ""
    try:
        process = _process(int(lease.get("pid", 0)))
    except (ValueError, OverflowError):
        return ""
    if process is None or process[0] not in ("T", "t"):
        return ""
    return (f", suspended (stopped by Ctrl-Z or SIGSTOP): resume it (`fg` in its shell, or kill -CONT "
            f"{lease.get('pid')}) or end it")


class Lease:
    """`with Lease(directory, held=...): ...` holds the directory's lease (see module doc). `held(holder)` is the
    error's text when a live run holds it (`holder`: describe() of its lease)."""

    def __init__(self, directory: str, *, held, break_lock: str | None = None, wait: bool = False,
                 ttl: float = TTL_S):
        """`break_lock`: what asked to take the lease over in any case (its flag, for the log), or None."""
        self._path = storage.join(directory, LEASE_NAME)
        self._directory, self._held, self._break, self._wait, self._ttl = directory, held, break_lock, wait, ttl
        self._body = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        self._generation = None  # gs://: the object's generation we wrote last
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self) -> Lease:
        if not self._create():
            current, generation = self._read()
            if self._break:
                reason = self._break
            elif current is None:
                reason = "it vanished"
            else:
                reason = dead(current, self._ttl)
                if reason is None and self._wait and current.get("host") != socket.gethostname():
                    reason, current, generation = self._watch(current)
            if reason is None:
                raise LeaseHeld(self._held(describe(current) + suspended(current)))
            if current is None:  # its run ended: created anew (on gs://, only if nobody else did first)
                if not self._create():
                    raise LeaseHeld(self._held("another run, which took it a moment ago"))
            else:
                if not self._take_over(current, generation):
                    raise LeaseHeld(self._held("another run, which took it over a moment ago"))
                log.warning("taking over the lease of %s from %s: %s", self._directory, describe(current), reason)
        self._thread = threading.Thread(target=self._beat, daemon=True, name="lease-heartbeat")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        if self._ours():  # (a run that took it over, from a run of ours it judged dead, keeps it)
            storage.delete_quietly(self._path)

    def _ours(self) -> bool:
        """Whether the lease is still this run's."""
        try:
            current, _ = self._read()
        except (OSError, ValueError):
            return False
        return self._is_ours(current)

    def _is_ours(self, lease: dict | None) -> bool:
        return lease is not None and all(lease.get(k) == v for k, v in self._body.items())

    def _watch(self, current: dict) -> tuple[str | None, dict | None, int | None]:
        """Reads the lease again until its holder beats (reason None: it lives), lapses (the reason) or ends (no
        lease); with the lease and its generation as last read."""
        beat = current.get("heartbeat", 0)
        log.warning("%s is held by %s: waiting up to %.0f s for that run's next heartbeat, to tell a live run "
                    "(refused) from one whose host was lost (taken over)", self._directory, describe(current),
                    self._ttl - (time.time() - beat))
        while True:
            time.sleep(min(WATCH_EVERY_S, max(0.05, beat + self._ttl - time.time() + 0.05)))
            latest, generation = self._read()
            if latest is None:
                return "its run ended", None, None
            if (latest.get("heartbeat"), latest.get("pid"), latest.get("host")) != (
                    beat, current.get("pid"), current.get("host")):
                return None, latest, generation
            reason = dead(latest, self._ttl)
            if reason is not None:
                return reason, latest, generation

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

    def _take_over(self, current: dict, generation: int | None) -> bool:
        """The lease made ours if it is still `current` (as read, at `generation` on gs://); False when another run
        took it first. Locally the check and the write hold an flock(2) on DIR/.lease.json.lock, so of runs that
        take over one dead holder's lease at the same moment one does (gs:// has the generation for it)."""
        if storage.is_remote(self._path):
            try:
                self._write(expected_generation=generation)
            except LeaseHeld:
                return False
            return True
        import fcntl

        fd = os.open(self._path + ".lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as e:  # a filesystem without locks (NFS mounted nolock): the check alone, as before
                log.warning("%s: cannot lock it (%s); taking the lease over without the lock", self._path + ".lock",
                            e.strerror)
            now, _ = self._read()
            if now != current:
                return False
            self._write()
            return True
        finally:
            os.close(fd)  # (the lock goes with it)

    def _write(self, expected_generation: int | None = None) -> None:
        generation = storage.write_versioned(self._path, self._payload().encode(), generation=expected_generation)
        if storage.is_remote(self._path):
            if generation is None:  # a 412: another run wrote it, or this one did and the answer was lost (the
                # client's retry of a write applied at once meets its own new generation); the body tells which
                current, generation = self._read()
                if not self._is_ours(current):
                    raise LeaseHeld(f"{self._directory}: another run took the lease over ({LEASE_NAME} changed under "
                                    "us)")
            self._generation = generation

    def _beat(self) -> None:
        while not self._stop.wait(self._ttl / 3):
            try:
                if not storage.is_remote(self._path) and not self._ours():  # (gs://: the generation tells)
                    raise LeaseHeld(f"{self._directory}: another run took the lease over ({LEASE_NAME} changed under "
                                    "us)")
                self._write(expected_generation=self._generation if storage.is_remote(self._path) else None)
            except LeaseHeld as e:
                log.error("%s; this run stops renewing it and will not delete it: its output may be written by both",
                          e)
                return
            except Exception as e:  # noqa: BLE001 - a missed heartbeat is retried; the run goes on
                log.warning("lease heartbeat for %s failed (%s); retrying", self._directory, e)
