"""A bounded cache of a gs:// dataset's chunks on local disk, shared by every process on the host and kept across runs.

`loader.load(..., cache_dir=DIR, cache_bytes=N)`: each chunk downloaded is kept (the first N bytes of chunks read;
none is evicted: every epoch reads each record once in a new order, so a chunk's last read predicts nothing of its
next, and a fixed set serves N / dataset of each later epoch, the most any policy serves on one host:
benchmarks/cache_policy_bench.py). The cache outlives the process: a restarted or resumed job, and every worker
process of this one, read what any of them downloaded.

Layout: DIR/<source key>/ (the index's key: every shard's path, size and generation, so a rewritten shard gets a new
cache) holds two files, and two small ones: `dataset` (a hash of the shards' paths, the same for every version of a
dataset rewritten in place) and `users` (every process with the cache open holds a shared flock(2) on it).

    data    the chunks, appended: each entry is an 8-byte tag (the chunk's global record number + 1) and the chunk's
            file bytes, padded to 8 bytes. Created sparse at `cache_bytes`; entries never pass it. The bytes of each
            append are allocated (fallocate) before they are written: a full disk is an error of the write (the
            cache then stops taking chunks; the job reads on), never a page of a mapping with no block behind it,
            which kills the process with SIGBUS.
    table   a 64-byte header (u64: magic, version, slots, capacity, tail, entries, records, 0) and an open-addressing
            hash table of `slots` x (u64 key = record + 1, u64 data offset), found by linear probing (at most
            MAX_PROBES slots). ~32 bytes a cached chunk, allocated whole when the cache is made (it is written
            through a shared mapping).

Writers (any thread of any process) append under a lock (a thread lock and flock(2) on the table): reserve bytes at
the tail, write the entries, then publish each key after its offset. Readers take no lock. Nothing read from the
cache is trusted: an entry counts only if its offset lies below the tail and its tag names the record, and its
bytes are then decoded with riegeli's hashes checked, whatever check_hashes says. An entry that fails is read from
gs:// again and rewritten (a crash of the host can leave a published entry whose bytes never reached the disk).

Opening a cache removes the caches of the same dataset's earlier versions (same `dataset`, another key) that no
process has open: a dataset refreshed nightly in place would otherwise leave a cache of cache_bytes a night.

    cache = DiskCache.open("/mnt/ssd/cache", key, capacity=50 << 30, mean_chunk=1100, records=10**8)
    views = cache.lookup(records, lengths)       # a memoryview of each cached chunk, else None
    cache.admit(records, chunks)                 # keep those that fit
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import shutil
import tempfile
import threading

import numpy as np

log = logging.getLogger(__name__)

MAGIC = int.from_bytes(b"ARCACHE1", "little")
VERSION = 1
HEADER = 64
MAX_PROBES = 32  # a full or crafted table costs at most this many slots a lookup
_HASH = np.uint64(0x9E3779B97F4A7C15)
_GONE = np.uint64(2 ** 64 - 1)  # an offset that names no entry (an entry whose bytes failed their check)
# header words
_SLOTS, _CAPACITY, _TAIL, _ENTRIES, _RECORDS = 2, 3, 4, 5, 6


def _slots_for(capacity: int, mean_chunk: int) -> int:
    """Table slots: twice the chunks of mean size that fit in `capacity`, a power of two, >= 1024."""
    wanted = 2 * capacity // max(1, mean_chunk + 8) + 1
    return max(1024, 1 << int(wanted - 1).bit_length())


class DiskCache:
    """One process's handle on a cache directory (see module doc). Thread-safe; not picklable (open per process)."""

    def __init__(self, path: str, table: mmap.mmap, table_fd: int, data: mmap.mmap, data_fd: int, users_fd: int):
        self.path = path
        self._table_map, self._table_fd, self._data_map, self._data_fd = table, table_fd, data, data_fd
        self._users_fd = users_fd  # held with a shared flock while open: the cache is in use
        self._closed = False
        self._header = np.frombuffer(table, dtype="<u8", count=8)
        slots = int(self._header[_SLOTS])
        self._slots = np.frombuffer(table, dtype="<u8", count=2 * slots, offset=HEADER).reshape(slots, 2)
        self._mask = np.uint64(slots - 1)
        self._shift = np.uint64(64 - (slots.bit_length() - 1))
        self._data_words = np.frombuffer(data, dtype="<u8")
        self.capacity = int(self._header[_CAPACITY])
        self._lock = threading.Lock()
        self._full = False
        self.hits = self.admitted = self.refused = 0  # chunks served, written, and left out for want of room

    @classmethod
    def open(cls, directory: str, key: str, *, capacity: int, mean_chunk: int, records: int,
             dataset: str = "") -> DiskCache:
        """The cache of the source with index key `key` under `directory`: opened, or made (or remade, logged, when
        it does not pass its checks, or was made with another capacity and no process has it open: one that has is
        used with its own capacity, logged). `dataset`: what every version of the dataset
        shares (a hash of its shards' paths); the caches of its other versions that no process has open are removed."""
        capacity = capacity // 8 * 8
        if capacity < 4096:
            raise ValueError(f"cache_bytes={capacity:,} is too small for a disk cache: pass at least 4096")
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, key)
        for _ in range(3):
            if not os.path.exists(path):
                slots = _slots_for(capacity, mean_chunk)
                _check_room(directory, capacity, HEADER + 16 * slots)
                _create(directory, path, capacity, slots, records, dataset)
            try:
                cache = cls._map(path, capacity, records)
                if dataset:
                    _remove_other_versions(directory, key, dataset)
                return cache
            except _OtherCapacity as e:
                if not _in_use(path):
                    log.warning("%s: %s; starting it again", path, e)
                    _remove(path)
                    continue
                # a process reads through it: remade, its entries would vanish under that process
                log.warning("%s: %s, and a process has it open; using it as it is (pass cache_bytes=%s, or give "
                            "this job its own cache_dir)", path, e, f"{e.capacity:,}")
                capacity = e.capacity
            except _Stale as e:
                log.warning("%s: %s; starting it again", path, e)
                _remove(path)
            except FileNotFoundError:  # removed by another process as this one opened it
                pass
        raise OSError(f"cannot open or make the cache {path}: it keeps changing under this process; is another "
                      "job with a different cache_bytes using the same cache_dir? Give each its own cache_dir")

    @classmethod
    def _map(cls, path: str, capacity: int, records: int) -> DiskCache:
        flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
        users_fd = _use(path)
        try:
            table_fd = os.open(os.path.join(path, "table"), flags)
        except BaseException:
            os.close(users_fd)
            raise
        data_fd = -1
        try:
            size = os.fstat(table_fd).st_size
            if size < HEADER:
                raise _Stale(f"its table is {size} bytes, not a whole table")
            table = mmap.mmap(table_fd, 0)
            header = np.frombuffer(table, dtype="<u8", count=8)
            slots, have, tail = int(header[_SLOTS]), int(header[_CAPACITY]), int(header[_TAIL])
            if int(header[0]) != MAGIC or int(header[1]) != VERSION:
                raise _Stale("it is not a cache of this version")
            if slots < 1024 or slots & (slots - 1) or size != HEADER + 16 * slots:
                raise _Stale("its table does not match its header")
            try:  # every page of it, once (it is written through a shared mapping: see the module doc)
                if os.fstat(table_fd).st_blocks * 512 < size:
                    _allocate(table_fd, 0, size)
            except OSError as e:
                raise CacheDirError(f"{path}: cannot allocate the cache's table of {size:,} bytes on the disk of "
                                    f"cache_dir ({e.strerror}); free some room, or pass a smaller cache_bytes= or "
                                    "another cache_dir=") from None
            if int(header[_RECORDS]) != records:
                raise _Stale(f"it was made for {int(header[_RECORDS]):,} records, not {records:,}")
            if have != capacity:
                raise _OtherCapacity(have, f"it was made with cache_bytes={have:,}, not {capacity:,}")
            if tail > capacity or tail % 8:
                raise _Stale("its header's tail lies outside its data")
            data_fd = os.open(os.path.join(path, "data"), flags)
            if os.fstat(data_fd).st_size != capacity:
                raise _Stale("its data file is not cache_bytes long")
            data = mmap.mmap(data_fd, capacity, access=mmap.ACCESS_READ)
        except BaseException:
            os.close(table_fd)
            os.close(users_fd)
            if data_fd >= 0:
                os.close(data_fd)
            raise
        return cls(path, table, table_fd, data, data_fd, users_fd)

    def close(self) -> None:
        if self._closed:
            return
        del self._header, self._slots, self._data_words
        self._table_map.close()
        self._data_map.close()
        self._close_fds()

    def _close_fds(self) -> None:
        self._closed = True
        for fd in (self._table_fd, self._data_fd, self._users_fd):  # the users flock goes with its fd
            os.close(fd)

    def __del__(self):
        """A handle dropped without close(): its files closed (the maps close with their last view), so the cache
        is no longer in use."""
        if not getattr(self, "_closed", True):
            try:
                self._close_fds()
            except Exception:  # noqa: BLE001 - at interpreter exit: the process's files close with it
                pass

    # --- reads -------------------------------------------------------------------------------------------------------
    def _home(self, keys: np.ndarray) -> np.ndarray:
        return (keys * _HASH) >> self._shift

    def _find(self, keys: np.ndarray) -> np.ndarray:
        """The slot of each key (keys are record + 1), or -1."""
        found = np.full(len(keys), -1, dtype=np.int64)
        slot = self._home(keys)
        pending = np.arange(len(keys))
        for _ in range(MAX_PROBES):
            if not len(pending):
                break
            at = self._slots[slot[pending], 0]
            hit = at == keys[pending]
            found[pending[hit]] = slot[pending[hit]].astype(np.int64)
            pending = pending[~hit & (at != 0)]
            slot[pending] = (slot[pending] + np.uint64(1)) & self._mask
        return found

    def lookup(self, records: np.ndarray, lengths: np.ndarray) -> list[memoryview | None]:
        """The cached bytes of each chunk (by its global record number and length), or None where it is not here."""
        records = np.asarray(records, dtype=np.uint64)
        lengths = np.asarray(lengths, dtype=np.int64)
        out: list[memoryview | None] = [None] * len(records)
        slots = self._find(records + np.uint64(1))
        have = np.flatnonzero(slots >= 0)
        if not len(have):
            return out
        offsets = self._slots[slots[have], 1]
        tail = int(self._header[_TAIL])
        fits = (offsets != _GONE) & (offsets % np.uint64(8) == 0) & (offsets <= np.uint64(max(0, tail - 8)))
        have, offsets = have[fits], offsets[fits].astype(np.int64)
        fits = offsets + 8 + lengths[have] <= tail
        have, offsets = have[fits], offsets[fits]
        tagged = self._data_words[offsets // 8] == records[have] + np.uint64(1)
        view = memoryview(self._data_map)
        for i, at in zip(have[tagged].tolist(), offsets[tagged].tolist()):
            out[i] = view[at + 8:at + 8 + int(lengths[i])]
        self.hits += int(tagged.sum())
        return out

    # --- writes ------------------------------------------------------------------------------------------------------
    def admit(self, records: np.ndarray, chunks: list) -> int:
        """Keep the chunks that fit (each the file bytes of global record `records[i]`'s chunk); how many did."""
        if self._full or not len(chunks):
            self.refused += len(chunks)
            return 0
        sizes = np.array([8 + (len(c) + 7) // 8 * 8 for c in chunks], dtype=np.int64)
        with self._locked():
            tail = int(self._header[_TAIL])
            room = self.capacity - tail
            count = int(np.searchsorted(np.cumsum(sizes), room, side="right"))
            entries = int(self._header[_ENTRIES])
            count = min(count, max(0, len(self._slots) * 3 // 4 - entries))  # a table filled to 3/4 takes no more
            if count:
                self._header[_TAIL] = tail + int(sizes[:count].sum())  # reserved: no other writer gets these bytes
        if count < len(chunks):
            self._full = True
            self.refused += len(chunks) - count
            log.info("%s: the cache is full (%s of %s bytes)", self.path, f"{tail + int(sizes[:count].sum()):,}",
                     f"{self.capacity:,}")
        if not count:
            return 0
        total = int(sizes[:count].sum())
        buffer = bytearray(total)
        at = 0
        for record, chunk, size in zip(records[:count].tolist(), chunks[:count], sizes[:count].tolist()):
            buffer[at:at + 8] = (int(record) + 1).to_bytes(8, "little")
            buffer[at + 8:at + 8 + len(chunk)] = chunk
            at += size
        try:
            _allocate(self._data_fd, tail, total)  # a full disk fails here, not at a mapped read of the bytes
            written = os.pwrite(self._data_fd, buffer, tail)
            if written != total:
                raise OSError(f"wrote {written:,} of {total:,} bytes")
        except OSError as e:  # a full disk: go on without caching
            self._full = True
            self.refused += count
            with self._locked():  # the reservation given back where no writer has appended since
                if int(self._header[_TAIL]) == tail + total:
                    self._header[_TAIL] = tail
            log.warning("%s: cannot write to the cache (%s); reading on without it", self.path, e)
            return 0
        offsets = tail + np.concatenate([[0], np.cumsum(sizes[:count - 1])])
        self._publish(np.asarray(records[:count], dtype=np.uint64) + np.uint64(1), offsets.astype(np.uint64))
        self.admitted += count
        return count

    def forget(self, records: np.ndarray) -> None:
        """Entries whose bytes failed their check: no longer served (admit() may write them again)."""
        keys = np.asarray(records, dtype=np.uint64) + np.uint64(1)
        with self._locked():
            slots = self._find(keys)
            self._slots[slots[slots >= 0], 1] = _GONE

    def _publish(self, keys: np.ndarray, offsets: np.ndarray) -> None:
        """Each key's slot made to name its offset: the offset written before the key, so a reader that sees the
        key finds the offset (and the tag check catches any reader that does not). Keys are distinct."""
        with self._locked():
            slots = self._slots
            slot = self._home(keys)
            pending = np.arange(len(keys))
            added = 0
            for _ in range(MAX_PROBES):
                if not len(pending):
                    break
                at = slots[slot[pending], 0]
                free = pending[(at == keys[pending]) | (at == 0)]
                _, first = np.unique(slot[free], return_index=True)  # one key a slot a round
                won = free[first]
                added += int((slots[slot[won], 0] == 0).sum())
                slots[slot[won], 1] = offsets[won]
                slots[slot[won], 0] = keys[won]
                placed = np.zeros(len(keys), dtype=bool)
                placed[won] = True
                pending = pending[~placed[pending]]
                at = slots[slot[pending], 0]
                moved = pending[(at != keys[pending]) & (at != 0)]
                slot[moved] = (slot[moved] + np.uint64(1)) & self._mask
            self._header[_ENTRIES] = int(self._header[_ENTRIES]) + added

    def _locked(self):
        return _Locked(self._lock, self._table_fd)


class _Locked:
    """This process's threads and every other process, excluded (a thread lock, then flock on the table)."""

    def __init__(self, lock: threading.Lock, fd: int):
        self._lock, self._fd = lock, fd

    def __enter__(self):
        self._lock.acquire()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._lock.release()
            raise

    def __exit__(self, *exc):
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._lock.release()


class CacheDirError(OSError):
    """A cache_dir the cache cannot be opened or made in (unwritable, no room): the setting's fault, not the data's."""


class _Stale(Exception):
    """A cache directory that cannot be used as it is: made again."""


class _OtherCapacity(_Stale):
    """A cache made with another cache_bytes (`capacity`): made again, unless another process has it open."""

    def __init__(self, capacity: int, why: str):
        super().__init__(why)
        self.capacity = capacity


def _check_room(directory: str, capacity: int, table: int) -> None:
    """A new cache's cache_bytes refused when the disk of `directory` has less free than it and its table (`table`
    bytes): the cache would fill the disk (the checkpoints and logs written there too) before it is full."""
    stat = os.statvfs(directory)
    free = stat.f_bavail * stat.f_frsize
    if capacity + table > free:
        raise ValueError(f"cache_bytes={capacity:,} and its table of {table:,} bytes are more than the {free:,} bytes "
                         f"free on the disk of cache_dir={directory}: the cache would fill the disk before it is full; "
                         "pass a cache_bytes= below the free space (leave room for what else is written there), or "
                         "another cache_dir=")


def _allocate(fd: int, offset: int, length: int) -> None:
    """Disk blocks for bytes [offset, offset + length) of `fd` (OSError ENOSPC when the disk has none)."""
    if length > 0 and hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, offset, length)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem without it: the write says
                raise


def _create(directory: str, path: str, capacity: int, slots: int, records: int, dataset: str) -> None:
    """A new cache at `path`, made under a temporary name and renamed (another process may make it first)."""
    made = tempfile.mkdtemp(prefix=".making-", dir=directory)
    try:
        with open(os.path.join(made, "dataset"), "w") as f:
            f.write(dataset)
        open(os.path.join(made, "users"), "wb").close()
        with open(os.path.join(made, "table"), "wb") as f:
            f.write(np.array([MAGIC, VERSION, slots, capacity, 0, 0, records, 0], dtype="<u8").tobytes())
            f.truncate(HEADER + 16 * slots)
        with open(os.path.join(made, "data"), "wb") as f:
            try:
                f.truncate(capacity)
            except OSError as e:  # EFBIG: over the filesystem's largest file (it was blamed on the data's files)
                raise ValueError(f"cache_bytes={capacity:,}: the filesystem of cache_dir={directory} cannot hold a "
                                 f"file that large ({e.strerror}); pass a smaller cache_bytes=") from None
        try:
            os.rename(made, path)
            log.info("made a disk cache of %s bytes at %s", f"{capacity:,}", path)
        except OSError:  # another process made it first
            pass
    finally:
        shutil.rmtree(made, ignore_errors=True)


def _remove(path: str) -> None:
    """The cache at `path` moved aside and deleted (processes that have it open keep their mapped files)."""
    aside = tempfile.mkdtemp(prefix=".removing-", dir=os.path.dirname(path))
    try:
        os.rename(path, os.path.join(aside, "cache"))
    except FileNotFoundError:
        pass
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def _use(path: str) -> int:
    """An fd of `path`/users holding a shared flock: the cache is in use until it is closed. Checked to still be the
    file at that path once locked (a remover may have moved the directory away meanwhile: FileNotFoundError)."""
    users = os.path.join(path, "users")
    fd = os.open(users, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        if os.stat(users).st_ino != os.fstat(fd).st_ino:
            raise FileNotFoundError(users)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _in_use(path: str) -> bool:
    """Whether a process (this one included, through another handle) has the cache at `path` open."""
    try:
        fd = os.open(os.path.join(path, "users"), os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _remove_other_versions(directory: str, key: str, dataset: str) -> None:
    """Removes the caches under `directory` of other versions of `dataset` (their `dataset` file says so) that no
    process has open (an exclusive flock on their `users` file is granted). Logged with the bytes freed."""
    for name in os.listdir(directory):
        other = os.path.join(directory, name)
        if name == key or name.startswith("."):
            continue
        try:
            with open(os.path.join(other, "dataset")) as f:
                if f.read() != dataset:
                    continue
            fd = os.open(os.path.join(other, "users"), os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        except (OSError, UnicodeDecodeError):
            continue  # not a cache, one made before caches recorded their dataset, being removed, or not ours
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a process has it open: another job reads that version
            os.close(fd)
            continue
        try:
            freed = sum(os.stat(os.path.join(other, f)).st_blocks * 512 for f in ("data", "table")
                        if os.path.exists(os.path.join(other, f)))
            _remove(other)
            log.info("removed %s, the disk cache of another version of this dataset that no process has open "
                     "(%s bytes)", other, f"{freed:,}")
        except OSError as e:  # e.g. another user's cache in a shared directory: left as it is
            log.warning("cannot remove %s, the disk cache of another version of this dataset (%s); delete it to "
                        "free its disk", other, e)
        finally:
            os.close(fd)


class DiskChunks:
    """The reader's view of a DiskCache (loader/fetch/chunk_cache.py's interface), opened on first use in the process
    that reads (`options`: DiskCache.open's arguments). What it returns may have been lost by the disk: the reader
    checks it, and forget()s what fails."""

    checked = True

    def __init__(self, options: dict):
        self._options = options
        self._disk: DiskCache | None = None
        self._lock = threading.Lock()

    @property
    def disk(self) -> DiskCache:
        if self._disk is None:
            with self._lock:
                if self._disk is None:
                    try:
                        self._disk = DiskCache.open(**self._options)
                    except CacheDirError:
                        raise
                    except OSError as e:  # (not the shards': a read would blame them)
                        raise CacheDirError(f"cannot open or make a disk cache in cache_dir="
                                            f"{self._options['directory']} ({e}); pass a cache_dir= on a local disk "
                                            "this process can write, or none") from None
        return self._disk

    def lookup(self, read) -> list:
        lengths = np.array([end - begin for _, begin, end in read.chunks], dtype=np.int64)
        return self.disk.lookup(read.chunk_records, lengths)

    def store(self, read, data: list, indices: list[int]) -> None:
        if indices:
            self.disk.admit(read.chunk_records[indices], [data[i] for i in indices])

    def forget(self, read, indices: list[int]) -> None:
        self.disk.forget(read.chunk_records[indices])
