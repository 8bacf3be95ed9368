"""Damaged and crafted shards and indexes: each case an attacker or a careless operator can make. None may crash the
process, exhaust its memory or return a wrong record; each is an error naming the file (and record), or is read
right. Cases that crashed the process run in a child process, so a crash is a failed test, not a dead test run."""

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordWriter

import loader
from loader.fetch.reader import BatchReader
from loader.format import _riegeli
from loader.format.arrayrecord import read_footer
from loader.format.source import resolve
from tests.conftest import REPO
from tests.loader import forge


def _write(path, records, options="group_size:1,uncompressed"):
    writer = ArrayRecordWriter(str(path), options)
    for r in records:
        writer.write(r)
    writer.close()
    return path


def _child(code: str, *, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh Python (the repository importable); its last stdout line is its verdict."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=str(REPO))


def _load_all_in_child(pattern: str, **options) -> subprocess.CompletedProcess:
    """loader.load(pattern) in a child: prints 'OK <count>' or 'ERROR <type>: <message>'; a crash is a signal."""
    code = f"""
import sys, loader
try:
    batches = loader.load({pattern!r}, batch_size=1, shuffle=False, num_epochs=1, decode=None, **{options!r})
    n = sum(len(b["record"]) if isinstance(b, dict) else len(b) for b in batches)
    print("OK", n)
except Exception as e:
    print("ERROR", type(e).__name__ + ":", e)
"""
    return _child(code)


def _verdict(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, f"the child died (return code {result.returncode}): {result.stderr[-2000:]}"
    return result.stdout.strip().splitlines()[-1]


# ---------------------------------------------------------------- footers


def test_footer_sizes_that_wrap_around_2_to_the_64_are_refused(tmp_path):
    """The footer's record sizes sum to the right total modulo 2^64 (the first 2^40 less, the second 2^40 more),
    hashes recomputed: read naively, the walk over the footer's records jumps 1 TB before its buffer (a SIGSEGV)."""
    path = _write(tmp_path / "wrap.array_record", [b"record %d" % i for i in range(10)])
    data = bytearray(path.read_bytes())
    _, sizes, values = forge.footer(bytes(data))
    entries = forge.footer_entries(values, sizes)
    # A copy of the metadata message last: read as one message, all the records still give the metadata.
    entries.append(entries[0])
    sizes = [(sizes[0] - (1 << 40)) % (1 << 64), sizes[1] + (1 << 40)] + sizes[2:] + [sizes[0]]
    forge.rewrite_footer(data, entries, sizes)
    path.write_bytes(bytes(data))
    verdict = _verdict(_load_all_in_child(str(tmp_path / "*.array_record")))
    assert verdict.startswith("ERROR ValueError: ") and "wrap.array_record is not a whole ArrayRecord file" in verdict
    assert "record sizes that add up to more than the chunk" in verdict, verdict


def test_a_footer_entry_with_a_changed_record_count_is_refused(tmp_path):
    """One footer entry says its chunk holds 2 records (the file was written with group_size:1), hashes recomputed:
    it must not reach ArrayRecord's C++ reader, which aborts on it."""
    path = _write(tmp_path / "count.array_record", [b"record %d" % i for i in range(10)])
    data = bytearray(path.read_bytes())
    _, sizes, values = forge.footer(bytes(data))
    entries = forge.footer_entries(values, sizes)
    fields = forge.parse_entry(entries[4])  # the chunk of record 3
    entries[4] = forge.entry(fields[1], fields[2], 2)
    forge.rewrite_footer(data, entries)
    path.write_bytes(bytes(data))
    verdict = _verdict(_load_all_in_child(str(tmp_path / "*.array_record")))
    assert verdict.startswith("ERROR ValueError: ") and "count.array_record is not a whole ArrayRecord file" in verdict
    assert "record counts" in verdict, verdict


@pytest.mark.parametrize("group", [2, 8])
def test_files_of_several_records_a_chunk_give_every_record(tmp_path, group):
    records = [b"r%03d" % i for i in range(500)]
    _write(tmp_path / "grouped.array_record", records, f"group_size:{group},snappy")
    source = resolve(str(tmp_path / "*.array_record"))
    assert len(source) == 500
    batches = loader.load(str(tmp_path / "*.array_record"), batch_size=100, shuffle=False, num_epochs=1, decode=None)
    got = [r for b in batches for r in b]
    assert got == records


# ---------------------------------------------------------------- the index


def _same_size_pair(tmp_path):
    """Two shards of the same size (128 KiB, the smallest) and record count, with records of other sizes."""
    a = [b"a" * (10 + i % 7) for i in range(100)]
    b = [b"b" * (10 + (i * 3) % 11) for i in range(100)]
    _write(tmp_path / "a.array_record", a)
    _write(tmp_path / "b.array_record", b)
    assert (tmp_path / "a.array_record").stat().st_size == (tmp_path / "b.array_record").stat().st_size
    return a, b


def test_a_shard_replaced_with_size_and_mtime_kept_is_reindexed(tmp_path, loader_index_dir):
    """cp -p / rsync -t: another file of the same size takes the shard's place and keeps its mtime. Keyed by path,
    size and mtime, the old index would return the new file's bytes at the old offsets."""
    data = tmp_path / "data"
    data.mkdir()
    a, b = _same_size_pair(tmp_path)
    shutil.copy2(tmp_path / "a.array_record", data / "x.array_record")
    pattern = str(data / "*.array_record")
    assert BatchReader(resolve(pattern))(np.arange(100)) == a  # the index of `a` is built and cached
    stat = (data / "x.array_record").stat()
    shutil.copyfile(tmp_path / "b.array_record", data / "x.array_record")
    os.utime(data / "x.array_record", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (data / "x.array_record").stat().st_mtime_ns == stat.st_mtime_ns
    assert BatchReader(resolve(pattern))(np.arange(100)) == b


def test_chunks_padded_to_block_boundaries_read(tmp_path):
    """pad_to_block_boundary:true puts a riegeli padding chunk after each chunk: a span may end with one."""
    records = [b"x" * (1000 * i) for i in range(6)]
    _write(tmp_path / "padded.array_record", records, "group_size:1,pad_to_block_boundary:true,snappy")
    assert BatchReader(resolve(str(tmp_path / "*.array_record")))(np.arange(6)[::-1]) == records[::-1]


@pytest.mark.gcs
def test_a_gs_shard_rewritten_with_its_size_is_reindexed(gcs_bucket, tmp_path):
    """On gs:// the index is keyed by each object's generation, which every write changes."""
    bucket, client = gcs_bucket
    a, b = _same_size_pair(tmp_path)
    blob = client.bucket(bucket).blob("ds/x.array_record")
    blob.upload_from_filename(str(tmp_path / "a.array_record"))
    before = resolve(f"gs://{bucket}/ds/*.array_record")
    assert BatchReader(before)(np.arange(100)) == a
    blob.upload_from_filename(str(tmp_path / "b.array_record"))
    after = resolve(f"gs://{bucket}/ds/*.array_record")
    assert after.shard_bytes == before.shard_bytes and after.shard_versions != before.shard_versions
    assert BatchReader(after)(np.arange(100)) == b


def test_a_span_longer_than_its_chunk_is_refused(tmp_path):
    """A record's span must end where its chunk does: a span over two chunks (a stale or forged index) is an error."""
    path = _write(tmp_path / "x.array_record", [b"%d" % i for i in range(5)])
    offsets = read_footer(str(path), path.stat().st_size).offsets.tolist()
    fd = os.open(path, os.O_RDONLY)
    try:
        ok = _riegeli.read(np.array([fd]), np.array([offsets[1]]), np.array([offsets[2]]), True, 0)
        assert ok == [b"1"]
        with pytest.raises(_riegeli.CorruptError, match="span"):
            _riegeli.read(np.array([fd]), np.array([offsets[1]]), np.array([offsets[3]]), True, 0)
    finally:
        os.close(fd)


def test_an_index_another_account_could_have_written_is_rebuilt(converted, tmp_path, caplog):
    """The index's hash finds damage, not a file crafted with a hash to match (offsets shifted by one record gave
    record i + 1 for record i): an index file writable by others, or owned by another user, is not trusted."""
    from loader.format.index import RecordIndex
    from loader.format.source import resolve

    source = resolve(str(converted))
    path = RecordIndex.for_source(source, str(tmp_path)).path
    assert os.stat(path).st_mode & 0o777 == 0o600
    good = open(path, "rb").read()
    changes = [lambda: os.chmod(path, 0o666)]
    if os.getuid() == 0:  # (as root: a file of another user)
        changes.append(lambda: os.chown(path, 12345, -1))
    for change in changes:
        change()
        with caplog.at_level(logging.WARNING, logger="loader.format.index"):
            caplog.clear()
            rebuilt = RecordIndex.for_source(source, str(tmp_path))
        assert "is not this user's own file" in caplog.text and "the index is rebuilt" in caplog.text, caplog.text
        assert os.stat(rebuilt.path).st_uid == os.getuid() and os.stat(rebuilt.path).st_mode & 0o777 == 0o600
        assert open(rebuilt.path, "rb").read() == good


def test_a_damaged_counts_file_says_a_fix_that_fixes_it(pretokenized, tmp_path):
    """A pre-tokenized shard's .counts file of the wrong size said "re-run the conversion", and a re-run kept the shard
    (its size is the manifest's) and its damaged counts. The fix it names now is one that works."""
    import loader
    from pipelines import ConvertConfig, run_conversion

    copy = tmp_path / "web"
    shutil.copytree(pretokenized["web"], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    shard = copy / manifest["shards"][1]["path"]
    counts = shard.with_name(shard.name + ".counts")
    counts.write_bytes(counts.read_bytes()[:-4])

    def batches(path):
        it = iter(loader.load(str(path), batch_size=4, seed=3, packing=loader.Packing(seq_len=16)))
        try:
            return [next(it)["tokens"].tolist() for _ in range(3)]
        finally:
            it.close()

    with pytest.raises(ValueError, match=re.escape(f"the file is damaged or from another conversion: delete {shard} "
                                                   "and re-run the conversion, which converts it again")):
        batches(copy)
    shard.unlink()
    source = os.path.dirname(manifest["shards"][0]["source"])
    assert run_conversion(ConvertConfig(input=f"{source}/*", output=str(copy),
                                        tokenizer=manifest["tokens"]["tokenizer"]), ["--direct_num_workers=1"]).ok
    assert batches(copy) == batches(pretokenized["web"])


FLIPS = 300


def test_a_damaged_index_file_is_rebuilt_with_one_log_line(converted, all_records, tmp_path):
    """Bits flipped in a cached index file (FLIPS single flips all over it), each loaded in a child process: every
    one is noticed and rebuilt (the records come back right), none crashes."""
    index_dir = tmp_path / "index"
    code = f"""
import json, logging, os, shutil, sys
import numpy as np
os.environ["LOADER_INDEX_DIR"] = {str(index_dir)!r}
from loader.fetch.reader import BatchReader
from loader.format.index import RecordIndex
from loader.format.source import resolve
source = resolve({str(converted)!r})
path = RecordIndex.for_source(source).path
good = open(path, "rb").read()
expected = BatchReader(source)(np.arange(len(source)))
rng = np.random.default_rng(0)
logged = []
class Catch(logging.Handler):
    def emit(self, record):
        logged.append(record.getMessage())
logging.getLogger("loader.format.index").addHandler(Catch())
logging.getLogger("loader.format.index").setLevel(logging.INFO)
wrong = errors = rebuilt = 0
for trial in range({FLIPS}):
    bad = bytearray(good)
    bit = int(rng.integers(0, len(bad) * 8))
    bad[bit // 8] ^= 1 << (bit % 8)
    with open(path, "wb") as f:
        f.write(bad)
    logged.clear()
    try:
        wrong += BatchReader(source)(np.arange(len(source))) != expected
    except Exception:
        errors += 1
    rebuilt += any("rebuilt" in m for m in logged)
print(json.dumps({{"wrong": wrong, "errors": errors, "rebuilt": rebuilt}}))
"""
    result = _child(code, timeout=300)
    assert json.loads(_verdict(result)) == {"wrong": 0, "errors": 0, "rebuilt": FLIPS}


# ---------------------------------------------------------------- chunks


def _first_chunk_with(data: bytes, **changes) -> bytearray:
    """The file with its first record chunk's header fields changed (hashes NOT recomputed: damage, not forgery)."""
    out = bytearray(data)
    header = bytearray(forge.read_logical(out, 64, 40))
    for name, value in changes.items():
        at = {"data_size": 8, "num_records": 24, "decoded_size": 32}[name]
        if name == "num_records":
            value = (value << 8) | header[24]
        header[at:at + 8] = int(value).to_bytes(8, "little")
    forge.write_logical(out, 64, bytes(header))
    return out


@pytest.mark.parametrize("size", [1 << 40, (1 << 63) + 5, (1 << 64) - 1])
def test_without_hash_checks_a_giant_record_size_is_an_error_naming_the_record(tmp_path, size):
    """check_hashes=False trusts the bytes, yet a flipped size is still bounded before any allocation: an OSError
    naming the shard and the record, not MemoryError, SystemError or OverflowError."""
    path = _write(tmp_path / "x.array_record", [b"record %d" % i for i in range(5)], "group_size:1,snappy")
    path.write_bytes(bytes(_first_chunk_with(path.read_bytes(), decoded_size=size)))
    reader = BatchReader(resolve(str(tmp_path / "*.array_record")), check_hashes=False)
    assert reader(np.arange(1, 5)) == [b"record %d" % i for i in range(1, 5)]
    with pytest.raises(OSError, match=r"x.array_record: record 0 cannot be read \(a record size that disagrees with the "
                                      r"chunk header\); the shard is corrupt"):
        reader(np.array([0, 3]))


def test_a_forged_decompression_bomb_is_refused_without_allocating_it(tmp_path):
    """A chunk that says its record is 2^40 bytes, hashes recomputed: refused by the codec's bound (an uncompressed
    record is as long as its bytes), in a child whose peak memory is measured."""
    path = _write(tmp_path / "bomb.array_record", [b"record %d" % i for i in range(5)])
    data = bytearray(path.read_bytes())
    header, body = forge.chunk_at(data, 64)
    forge.put_chunk(data, 64, forge.simple_chunk([1 << 40], b"record 0"), num_records=1, decoded_size=1 << 40)
    path.write_bytes(bytes(data))
    code = f"""
import resource, numpy as np
from loader.fetch.reader import BatchReader
from loader.format.source import resolve
reader = BatchReader(resolve({str(tmp_path / "*.array_record")!r}))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    reader(np.array([0]))
    print("READ")
except OSError as e:
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print("ERROR", grew // 1024, e)
"""
    verdict = _verdict(_child(code))
    assert verdict.startswith("ERROR "), verdict
    grew_mb = int(verdict.split()[1])
    assert grew_mb < 100 and "bomb.array_record: record 0 cannot be read" in verdict, verdict


def test_a_record_over_max_record_bytes_names_the_option(tmp_path):
    records = [b"x" * 5000, b"small"]
    _write(tmp_path / "big.array_record", records, "group_size:1,zstd:3")
    pattern = str(tmp_path / "*.array_record")
    assert BatchReader(resolve(pattern), max_record_bytes=5000)(np.arange(2)) == records
    with pytest.raises(OSError, match=r"big.array_record: record 0 is 5,000 bytes, over max_record_bytes=4,096"):
        BatchReader(resolve(pattern), max_record_bytes=4096)(np.arange(2))
    with pytest.raises(ValueError, match="max_record_bytes must be >= 1"):
        loader.load(pattern, batch_size=1, max_record_bytes=0)


def test_a_read_of_many_small_zstd_bombs_is_refused(tmp_path):
    """Records of 4 MB of zeros compress ~4,000x with zstd: each is under max_record_bytes, but a read of many of
    them would allocate far more than the bytes read could honestly hold. Refused naming the record, unless
    max_record_bytes (which also bounds a whole read) says such reads are expected."""
    records = [bytes(4 << 20) for _ in range(40)]
    _write(tmp_path / "zeros.array_record", records, "group_size:1,zstd:3")
    assert (tmp_path / "zeros.array_record").stat().st_size <= 256 << 10
    pattern = str(tmp_path / "*.array_record")
    reader = BatchReader(resolve(pattern), max_record_bytes=32 << 20)
    assert reader(np.arange(5)) == records[:5]  # 20 MB: within the 64 MB allowance
    with pytest.raises(OSError, match=r"zeros.array_record: record \d+ brings this read's records to [\d,]+ bytes, over "
                                      r"1,024 times the bytes they are stored in plus 64 MiB, and over "
                                      r"max_record_bytes=33,554,432"):
        reader(np.arange(40))
    assert BatchReader(resolve(pattern))(np.arange(40)) == records  # 160 MB: under the default max_record_bytes


# ---------------------------------------------------------------- per-thread state


def test_a_threads_zstd_context_is_freed_when_the_thread_ends(tmp_path):
    path = _write(tmp_path / "z.array_record", [b"zstd record %d" % i for i in range(50)], "group_size:1,zstd:3")
    reader = BatchReader(resolve(str(path)))
    seen, barrier = [], threading.Barrier(40)

    def read(first):
        reader(np.arange(first, first + 3))
        barrier.wait()  # all 40 threads hold a context now
        seen.append(_riegeli.zstd_contexts())

    before = _riegeli.zstd_contexts()  # (other tests' threads that are still ending may hold some)
    threads = [threading.Thread(target=read, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert max(seen) >= 40
    # a thread's key destructors run after join() returns (Python marks a thread done before the OS thread ends)
    deadline = time.monotonic() + 10
    while _riegeli.zstd_contexts() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _riegeli.zstd_contexts() <= before


def test_a_read_of_no_records_leaves_the_threads_buffer_usable(converted, all_records):
    reader = BatchReader(resolve(str(converted)))
    kept = []

    def run():
        empty = np.array([], dtype=np.int64)
        before = _riegeli.buffers_kept()  # counted here: threads of earlier tests may end (and free theirs) meanwhile
        assert _riegeli.read(empty, empty, empty, True, 0) == []
        assert _riegeli.buffers_kept() == before  # no records: no buffer
        assert reader(np.arange(10)) == all_records[:10]
        kept.append(_riegeli.buffers_kept() - before)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert kept == [1]  # the second read used (and kept) the thread's own buffer


def test_stat_paths_gives_sizes_change_times_and_inodes(tmp_path):
    """stat_paths (on several threads, the GIL released, its paths held in a tuple of its own meanwhile) gives what the
    index key mixes: sizes, change times and inodes; a missing file is an errno, not a crash."""
    (tmp_path / "f").write_bytes(b"x" * 10)
    paths = [str(tmp_path / "f")] * 5000 + [str(tmp_path / ("missing-%d" % i)) for i in range(5000)]
    sizes, mtimes, errnos = (np.empty(len(paths), dtype=np.int64) for _ in range(3))
    ctimes, inodes = (np.empty(len(paths), dtype=np.int64) for _ in range(2))
    _riegeli.stat_paths(paths, sizes, mtimes, errnos, 2, ctimes, inodes)
    assert sizes[:5000].tolist() == [10] * 5000 and (errnos[5000:] != 0).all()
    assert (inodes[:5000] == os.stat(tmp_path / "f").st_ino).all()
    assert (ctimes[:5000] == os.stat(tmp_path / "f").st_ctime_ns).all()


def test_loading_logs_nothing_for_good_data(converted, caplog):
    with caplog.at_level(logging.WARNING):
        next(iter(loader.load(str(converted), batch_size=4, decode=None)))
    assert not [r for r in caplog.records if r.name.startswith("loader")]
