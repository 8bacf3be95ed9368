"""The disk cache of gs:// chunks (loader/fetch/disk_cache.py): bounded, shared by processes, kept across runs, and
never trusted: a damaged or crafted cache costs a download, never a wrong record."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import numpy as np
import pytest

import loader
from loader.fetch.disk_cache import DiskCache, HEADER
from loader.fetch.reader import BatchReader
from loader.format.source import resolve
from tests.conftest import REPO
from tests.emulator import upload_files


def _chunks(records: np.ndarray) -> list[bytes]:
    return [bytes([int(r) % 251]) * (40 + int(r) % 90) for r in records]


def _open(directory, capacity=1 << 16, records=10_000):
    return DiskCache.open(str(directory), "key", capacity=capacity, mean_chunk=80, records=records)


def _served(cache, records):
    chunks = _chunks(records)
    views = cache.lookup(records, np.array([len(c) for c in chunks]))
    assert all(bytes(v) == c for v, c in zip(views, chunks) if v is not None)  # what it serves is what was put
    return np.array([v is not None for v in views])


def test_what_is_admitted_is_served_by_every_later_handle_until_the_bound(tmp_path):
    cache = _open(tmp_path)
    records = np.arange(0, 3000, 7)
    assert cache.admit(records, _chunks(records)) == len(records)  # ~40 KB: fits in 64 KiB
    assert _served(cache, records).all() and not _served(cache, records + 1).any()
    more = np.arange(1, 3000, 7)
    admitted = cache.admit(more, _chunks(more))
    assert 0 < admitted < len(more) and cache.refused == len(more) - admitted  # the rest did not fit
    again = _open(tmp_path)  # another process, or the next run
    assert _served(again, records).all()
    assert _served(again, more).sum() == admitted and _served(again, more)[:admitted].all()
    tail = int(np.frombuffer(open(tmp_path / "key" / "table", "rb").read(HEADER), "<u8")[4])
    assert tail <= 1 << 16 and os.stat(tmp_path / "key" / "data").st_blocks * 512 <= (1 << 16) + 4096


def test_a_cache_made_for_another_capacity_or_source_is_made_again(tmp_path, caplog):
    records = np.arange(50)
    _open(tmp_path).admit(records, _chunks(records))
    with caplog.at_level(logging.WARNING, logger="loader.fetch.disk_cache"):
        assert not _served(_open(tmp_path, capacity=1 << 17), records).any()
    assert "made with cache_bytes=65,536, not 131,072; starting it again" in caplog.text
    with caplog.at_level(logging.WARNING, logger="loader.fetch.disk_cache"):
        assert not _served(_open(tmp_path, capacity=1 << 17, records=20_000), records).any()
    assert "made for 10,000 records, not 20,000" in caplog.text



def test_a_cache_larger_than_the_free_space_or_the_largest_file_is_refused_naming_cache_bytes(tmp_path):
    """A sparse data file of cache_bytes fills the disk before the cache is full; one over the filesystem's largest
    file failed with EFBIG, blamed on the gs:// files being read."""
    stat = os.statvfs(tmp_path)
    free = stat.f_bavail * stat.f_frsize
    with pytest.raises(ValueError, match=rf"^cache_bytes=[\d,]+ and its table of [\d,]+ bytes are more than the "
                                         rf"[\d,]+ bytes free on the disk of cache_dir={tmp_path}: the cache would "
                                         "fill the disk"):
        _open(tmp_path, capacity=free + (1 << 30))
    assert not (tmp_path / "key").exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".making")]


def test_a_cache_over_the_largest_file_of_its_filesystem_is_refused_naming_cache_bytes(tmp_path):
    from loader.fetch import disk_cache

    with open(tmp_path / "probe", "wb") as f:
        try:
            f.truncate(1 << 61)
            pytest.skip("this filesystem holds a file of 2^61 bytes (ext4's limit is 16 TiB, XFS's 8 EiB)")
        except OSError:
            pass
    with pytest.raises(ValueError, match=rf"^cache_bytes=2,305,843,009,213,693,952: the filesystem of "
                                         rf"cache_dir={tmp_path} cannot hold a file that large \(File too large\)"):
        disk_cache._create(str(tmp_path), str(tmp_path / "key"), 1 << 61, 1024, 10, "")  # past the free-space check
    assert not (tmp_path / "key").exists()

FULL_DISK = """
import logging, os, sys
import numpy as np
from loader.fetch.disk_cache import DiskCache
logging.basicConfig(level=logging.WARNING, format="%(message)s")
mount = sys.argv[1]
cache = DiskCache.open(mount + "/cache", "key", capacity=64 << 10, mean_chunk=8, records=10**6)  # a 256 KiB table
with open(mount + "/filler", "wb", buffering=0) as f:  # something else fills the disk
    try:
        while True:
            f.write(bytes(4096))
    except OSError:
        pass
records = np.arange(0, 40_000, 97)  # keys all over the table
print("admitted", cache.admit(records, [b"x" * 8 for _ in records]), "refused", cache.refused)
print("served", sum(v is not None for v in cache.lookup(records, np.full(len(records), 8))))
os.remove(mount + "/filler")
print("admitted", cache.admit(records[:3], [b"y" * 8] * 3))  # full once: the cache takes no more
"""


def test_a_full_disk_is_a_cache_that_takes_no_more_not_a_sigbus(tmp_path):
    """The table, made sparse and written through a shared mapping, had pages with no block behind them: when the
    disk filled, touching one killed the process with SIGBUS (no exception, no log line), on a tmpfs even a lookup.
    A 1 MiB tmpfs, in a mount namespace of the test's own."""
    mount = tmp_path / "small"
    mount.mkdir()
    proc = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {mount} && exec "
                           f"{sys.executable} -c '{FULL_DISK}' {mount}"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    if proc.returncode and "mount" in proc.stderr and "permission denied" in proc.stderr.lower():
        pytest.skip(f"cannot mount a small filesystem here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["admitted 0 refused 413", "served 0", "admitted 0"], proc.stdout
    assert proc.stderr.startswith(f"{mount}/cache/key: cannot write to the cache ([Errno 28] No space left on device); "
                                  "reading on without it"), proc.stderr


def test_a_cache_dir_that_cannot_hold_a_cache_is_one_error_naming_it(gcs_bucket, converted, tmp_path):
    """It failed every read with "cannot read gs://... and others of this read (...); check the files are there and
    readable, or restage the data": the data's fault, by its words."""
    bucket, client = gcs_bucket
    remote = upload_files(client, bucket, converted, "ds")
    (tmp_path / "a-file").write_text("")
    reader = BatchReader(resolve(remote), cache_bytes=1 << 20, cache_dir=str(tmp_path / "a-file"))
    with pytest.raises(OSError, match=rf"^cannot open or make a disk cache in cache_dir={tmp_path / 'a-file'} "
                                      r"\(\[Errno 17\] File exists: .*\); pass a cache_dir= on a local disk this "
                                      r"process can write, or none$"):
        reader(np.arange(3))


@pytest.mark.parametrize("damage", ["header", "truncated table", "data size"])
def test_a_damaged_cache_is_made_again(tmp_path, caplog, damage):
    records = np.arange(50)
    _open(tmp_path).admit(records, _chunks(records))
    table, data = tmp_path / "key" / "table", tmp_path / "key" / "data"
    if damage == "header":
        with open(table, "r+b") as f:
            f.write(b"\xff" * 16)
    elif damage == "truncated table":
        os.truncate(table, 1000)
    else:
        os.truncate(data, 100)
    with caplog.at_level(logging.WARNING, logger="loader.fetch.disk_cache"):
        cache = _open(tmp_path)
    assert "starting it again" in caplog.text and not _served(cache, records).any()
    assert cache.admit(records, _chunks(records)) == len(records) and _served(cache, records).all()


def test_crafted_slots_and_tags_are_misses_not_records(tmp_path):
    """Slots naming offsets past the tail, unaligned or at another record's entry, and entries whose tag names
    another record: each is a miss (read from gs:// again), never bytes of the wrong record."""
    cache = _open(tmp_path)
    records = np.arange(200)
    cache.admit(records, _chunks(records))
    slots = np.memmap(tmp_path / "key" / "table", dtype="<u8", mode="r+", offset=HEADER).reshape(-1, 2)
    used = np.flatnonzero(slots[:, 0])
    offsets = slots[used, 1].copy()
    slots[used[:50], 1] = np.uint64(1 << 40)  # past the tail
    slots[used[50:100], 1] = offsets[50:100] + np.uint64(4)  # unaligned
    slots[used[100:150], 1] = np.roll(offsets[100:150], 1)  # another record's entry
    slots.flush()
    del slots
    served = _served(_open(tmp_path), records)  # asserts every served chunk is the record's own bytes
    assert served.sum() == 50  # the 50 slots left alone


def test_a_forgotten_entry_is_a_miss_and_can_be_written_again(tmp_path):
    cache = _open(tmp_path)
    records = np.arange(20)
    cache.admit(records, _chunks(records))
    cache.forget(records[:5])
    assert _served(cache, records).tolist() == [False] * 5 + [True] * 15
    assert cache.admit(records[:5], _chunks(records[:5])) == 5 and _served(cache, records).all()


_WRITER = """
import sys
import numpy as np
from loader.fetch.disk_cache import DiskCache
cache = DiskCache.open(sys.argv[1], "key", capacity=1 << 18, mean_chunk=80, records=100_000)
start = int(sys.argv[2])
for first in range(start, start + 40_000, 500):
    records = np.arange(first, first + 500)
    cache.admit(records, [bytes([int(r) % 251]) * (40 + int(r) % 90) for r in records])
print(cache.admitted)
"""


def test_processes_writing_at_once_share_the_bound_and_lose_no_entry(tmp_path):
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(start)], stdout=subprocess.PIPE,
                                text=True) for start in (0, 40_000)]
    admitted = [int(w.communicate(timeout=120)[0]) for w in writers]
    assert all(w.returncode == 0 for w in writers)
    cache = DiskCache.open(str(tmp_path), "key", capacity=1 << 18, mean_chunk=80, records=100_000)
    served = _served(cache, np.arange(80_000))
    assert served.sum() == sum(admitted) > 0  # every entry either process wrote is there, and readable
    assert sum(len(c) + 8 for c in _chunks(np.flatnonzero(served))) <= 1 << 18


# ---------------------------------------------------------------- through the loader, on the emulator


@pytest.mark.gcs
def test_a_later_run_reads_what_an_earlier_one_cached_and_requests_nothing(gcs_bucket, converted, tmp_path):
    bucket, client = gcs_bucket
    remote = upload_files(client, bucket, converted, "disk")
    options = dict(batch_size=8, seed=5, num_epochs=1, decode=None, cache_dir=str(tmp_path), cache_bytes=1 << 20)
    local = list(loader.load(str(converted), **{k: v for k, v in options.items() if not k.startswith("cache")}))
    first = loader.load(remote, worker_count=2, **options)  # the workers' downloads land in the shared cache
    assert list(first) == local
    later = loader.load(remote, **options)  # a new run: a new reader in a new process would open the same files
    assert list(later) == local
    spans = later._reader._remote_reader
    assert spans.requests == 0 and spans.records == len(local) * 8 and spans._cache.disk.hits == spans.records
    source = loader.DataSource(remote, cache_dir=str(tmp_path), cache_bytes=1 << 20)  # grain's protocol, the same
    assert source.__getitems__(list(range(len(source)))) == list(loader.DataSource(str(converted)))
    assert source._reader._remote_reader.requests == 1  # the one record of 257 the batches of 8 left out


@pytest.mark.gcs
def test_a_damaged_chunk_on_gs_is_the_shards_fault_and_leaves_the_cache_as_it_was(gcs_bucket, tmp_path, caplog):
    """A shard with one damaged chunk, read through a warm disk cache: the warning blamed the disk cache, every good
    cached chunk of the read was dropped and appended again (on every try: a cache that filled with copies), and the
    damaged chunk itself was cached."""
    from array_record.python.array_record_module import ArrayRecordWriter

    bucket, client = gcs_bucket
    records = [b"rec-%04d-" % i * 30 for i in range(100)]
    writer = ArrayRecordWriter(str(tmp_path / "shard"), "group_size:1,uncompressed")
    for r in records:
        writer.write(r)
    writer.close()
    good = (tmp_path / "shard").read_bytes()
    blob = client.bucket(bucket).blob("ds/data.array_record-00000-of-00001")
    blob.upload_from_string(good)
    begin, end = BatchReader(resolve(f"gs://{bucket}/ds/data.array_record-*"))._index.locate(np.array([0]),
                                                                                           np.array([60]))
    bad = bytearray(good)
    bad[(int(begin[0]) + int(end[0])) // 2] ^= 0xFF  # inside record 60's chunk
    blob.upload_from_string(bytes(bad))
    reader = BatchReader(resolve(f"gs://{bucket}/ds/data.array_record-*"), cache_bytes=1 << 20,
                         cache_dir=str(tmp_path / "cache"))
    assert reader(np.arange(0, 60)) == records[:60]  # 60 good chunks cached
    disk = reader._remote_reader._cache.disk
    kept = (int(disk._header[4]), int(disk._header[5]))  # tail, entries
    for _ in range(3):
        with caplog.at_level(logging.WARNING), pytest.raises(OSError, match=rf"^gs://{bucket}/ds/data.array_record-"
                                                                            r"00000-of-00001: record 60 cannot be read "
                                                                            r"\(chunk data whose hash"):
            reader(np.arange(0, 61))
    assert (int(disk._header[4]), int(disk._header[5])) == kept
    assert "disk cache fail" not in caplog.text
    assert reader(np.arange(0, 60)) == records[:60] and reader._remote_reader.requests == 4  # (the 3 tries: 1 each)
    # check_hashes=False: the damaged record comes as it is (asked for), never into the cache, blamed on it
    unchecked = BatchReader(resolve(f"gs://{bucket}/ds/data.array_record-*"), cache_bytes=1 << 20,
                            cache_dir=str(tmp_path / "cache"), check_hashes=False)
    for _ in range(3):
        with caplog.at_level(logging.WARNING):
            [damaged] = unchecked(np.array([60]))
        assert damaged != records[60] and len(damaged) == len(records[60])
    assert (int(disk._header[4]), int(disk._header[5])) == kept
    assert "disk cache fail" not in caplog.text


@pytest.mark.gcs
def test_slices_of_a_source_share_its_disk_cache(gcs_bucket, converted, all_records, tmp_path):
    """A slice (split="[...]") names its records by the whole source's numbers: two slices of one length read the
    whole's cached chunks, each its own records, with no request."""
    bucket, client = gcs_bucket
    remote = upload_files(client, bucket, converted, "sliced")
    options = dict(batch_size=8, seed=5, num_epochs=1, decode=None, cache_dir=str(tmp_path), cache_bytes=1 << 20)
    list(loader.load(remote, drop_remainder=False, **options))  # every record, now cached
    for split, first in (("[:128]", 0), ("[128:256]", 128)):
        part = loader.load(remote, split=split, **options)
        assert sorted(r for batch in part for r in batch) == sorted(all_records[first:first + 128])
        spans = part._reader._remote_reader
        assert spans.requests == 0 and spans._cache.disk.hits == spans.records == 128


@pytest.mark.gcs
def test_a_bucket_larger_than_the_disk_cache_gives_the_local_batches_within_the_bound(gcs_bucket, converted,
                                                                                        tmp_path):
    bucket, client = gcs_bucket
    remote = upload_files(client, bucket, converted, "small-disk")
    options = dict(batch_size=8, seed=5, num_epochs=2, decode=None)
    local = list(loader.load(str(converted), **options))
    cached = loader.load(remote, cache_dir=str(tmp_path), cache_bytes=1 << 13, **options)
    assert list(cached) == local
    disk = cached._reader._remote_reader._cache.disk
    assert disk.admitted > 0 and disk.refused > 0 and disk.hits > 0
    assert int(disk._header[4]) <= 1 << 13 and os.stat(os.path.join(disk.path, "data")).st_blocks * 512 <= 3 << 12


@pytest.mark.gcs
def test_chunks_damaged_on_disk_are_read_again_and_rewritten(gcs_bucket, converted, all_records, tmp_path, caplog):
    """check_hashes=False does not reach the cache: what the disk gives back is checked (a crash of the host can
    leave entries whose bytes never reached it), read from gs:// again when it fails, and written again."""
    bucket, client = gcs_bucket
    source = resolve(upload_files(client, bucket, converted, "damaged"))
    reader = BatchReader(source, cache_dir=str(tmp_path), cache_bytes=1 << 20, check_hashes=False)
    everything = np.arange(len(all_records))
    assert reader(everything) == all_records
    path = reader._remote_reader._cache.disk.path
    slots = np.fromfile(os.path.join(path, "table"), dtype="<u8", offset=HEADER).reshape(-1, 2)
    with open(os.path.join(path, "data"), "r+b") as f:  # a byte of each chunk's data, past its tag and header
        for offset in slots[slots[:, 0] != 0, 1].tolist():
            f.seek(offset + 8 + 41)
            f.write(b"\xa5")
    again = BatchReader(source, cache_dir=str(tmp_path), cache_bytes=1 << 20, check_hashes=False)
    with caplog.at_level(logging.WARNING, logger="loader.fetch.reader"):
        assert again(everything) == all_records
    assert "fail their checks; reading them from gs:// again" in caplog.text
    spans = again._remote_reader
    assert 0 < spans.requests
    caplog.clear()
    third = BatchReader(source, cache_dir=str(tmp_path), cache_bytes=1 << 20, check_hashes=False)
    with caplog.at_level(logging.WARNING, logger="loader.fetch.reader"):
        assert third(everything) == all_records
    assert third._remote_reader.requests == 0 and "fail their checks" not in caplog.text  # rewritten


def test_random_damage_to_either_file_gives_misses_or_the_records_own_entry(tmp_path):
    """200 damaged caches (bytes of the table's header or slots, or of the data, set at random): each opens (or is
    made again) and serves each chunk from its own entry or not at all; none crashes, hangs or serves another
    record's entry. (Damaged bytes within an entry are the reader's to catch: riegeli's hashes, checked on
    everything read from the disk, then a download: test_chunks_damaged_on_disk_are_read_again_and_rewritten.)"""
    records = np.arange(0, 1200, 3)
    _open(tmp_path).admit(records, _chunks(records))
    pristine = {name: (tmp_path / "key" / name).read_bytes() for name in ("table", "data")}
    slots = np.frombuffer(pristine["table"], dtype="<u8", offset=HEADER).reshape(-1, 2)
    entry = {int(key) - 1: int(offset) for key, offset in slots[slots[:, 0] != 0].tolist()}
    asked = np.arange(1300)
    lengths = np.array([len(c) for c in _chunks(asked)])
    rng = np.random.default_rng(7)
    served = 0
    for case in range(200):
        (tmp_path / "key").mkdir(exist_ok=True)
        damaged = case % 2
        for name, content in pristine.items():
            content = bytearray(content)
            if name == ("table", "data")[damaged]:
                span = HEADER + 16 * 1024 if name == "table" else 40_000  # where damage can matter
                for at in rng.integers(0, span, int(rng.integers(1, 64))):
                    content[at] = int(rng.integers(0, 256))
            (tmp_path / "key" / name).write_bytes(content)
        data = (tmp_path / "key" / "data").read_bytes()
        cache = _open(tmp_path)
        for record, view in zip(asked.tolist(), cache.lookup(asked, lengths)):
            if view is not None:
                at = entry[record] + 8
                assert bytes(view) == data[at:at + lengths[record]], (case, record)
                served += 1
        cache.close()
    assert served > 200 * len(records) // 4  # damage is sparse: most entries stay served


def test_opening_a_new_version_removes_the_unused_caches_of_earlier_ones_and_keeps_others(tmp_path, caplog):
    def version(key, dataset):
        cache = DiskCache.open(str(tmp_path), key, capacity=1 << 16, mean_chunk=80, records=100, dataset=dataset)
        cache.admit(np.arange(10), _chunks(np.arange(10)))
        return cache

    version("v1", "ds").close()
    version("other", "another dataset").close()
    with caplog.at_level(logging.INFO, logger="loader.fetch.disk_cache"):
        v2 = version("v2", "ds")
    assert sorted(os.listdir(tmp_path)) == ["other", "v2"]  # v1 removed: same dataset, no process had it open
    assert f"removed {tmp_path / 'v1'}, the disk cache of another version of this dataset" in caplog.text
    v3 = version("v3", "ds")  # v2 is open (as another job reading that version would have it): kept
    assert sorted(os.listdir(tmp_path)) == ["other", "v2", "v3"]
    del v2  # dropped without close(): no longer in use
    v3.close()
    version("v4", "ds").close()
    assert sorted(os.listdir(tmp_path)) == ["other", "v4"]
    assert _served(DiskCache.open(str(tmp_path), "other", capacity=1 << 16, mean_chunk=80, records=100),
                   np.arange(10)).all()  # another dataset's cache is untouched


def test_a_cache_in_use_by_another_process_is_kept(tmp_path):
    DiskCache.open(str(tmp_path), "v1", capacity=1 << 16, mean_chunk=80, records=100, dataset="ds").close()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from loader.fetch.disk_cache import DiskCache; "
         "c = DiskCache.open(sys.argv[1], 'v1', capacity=1 << 16, mean_chunk=80, records=100, dataset='ds'); "
         "print('open', flush=True); sys.stdin.read()", str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "open\n"
        DiskCache.open(str(tmp_path), "v2", capacity=1 << 16, mean_chunk=80, records=100, dataset="ds").close()
        assert sorted(os.listdir(tmp_path)) == ["v1", "v2"]
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    DiskCache.open(str(tmp_path), "v3", capacity=1 << 16, mean_chunk=80, records=100, dataset="ds").close()
    assert sorted(os.listdir(tmp_path)) == ["v3"]


def test_a_cache_of_another_capacity_that_a_process_has_open_is_used_as_it_is(tmp_path, caplog):
    records = np.arange(50)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; import numpy as np; from loader.fetch.disk_cache import DiskCache; "
         "from tests.loader.fetch.test_disk_cache import _chunks; "
         "c = DiskCache.open(sys.argv[1], 'key', capacity=1 << 16, mean_chunk=80, records=10_000); "
         "r = np.arange(50); c.admit(r, _chunks(r)); print('open', flush=True); sys.stdin.read()", str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline() == "open\n"
        with caplog.at_level(logging.WARNING, logger="loader.fetch.disk_cache"):
            shared = _open(tmp_path, capacity=1 << 17)  # another job's cache_bytes
        assert shared.capacity == 1 << 16 and _served(shared, records).all()  # its entries, not a new cache
        assert "made with cache_bytes=65,536, not 131,072, and a process has it open; using it as it is" in caplog.text
        shared.close()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert not _served(_open(tmp_path, capacity=1 << 17), records).any()  # no process has it: made again
