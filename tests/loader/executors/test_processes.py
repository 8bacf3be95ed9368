"""Local worker processes that heal (loader/executors/processes.py): a worker killed mid-epoch is replaced and the
batches are those of a run without workers; a record that kills every worker that reads it is one clear error."""

import logging
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import loader

OPTIONS = dict(batch_size=8, seed=3, decode=None, num_epochs=2, records_per_read=16)


def _slow(record: bytes) -> bytes:
    time.sleep(0.003)  # keeps the workers busy: a worker killed at any moment holds groups in progress
    return record


def _poisoned(record: bytes) -> bytes:
    if record == b"2:50" and multiprocessing.parent_process() is not None:  # in a worker: a crash in native code
        os.kill(os.getpid(), signal.SIGKILL)
    return record


def _rows(batches) -> list[list[bytes]]:
    return [[bytes(r) for r in np.asarray(b, dtype=object)] for b in batches]


def _workers() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("loader-worker")]


@pytest.mark.timeout(120)
def test_a_worker_killed_mid_epoch_is_replaced_and_the_batches_are_the_same(converted, caplog):
    expected = _rows(loader.load(str(converted), map_fn=_slow, **OPTIONS))
    assert len(expected) == 64  # 2 epochs of 257 records, batches of 8
    it = iter(loader.load(str(converted), map_fn=_slow, worker_count=2, **OPTIONS))
    got = _rows([next(it) for _ in range(5)])
    assert len(_workers()) == 2
    victim = next(w for w in it._host.groups._workers if w.groups)  # killed holding groups: computed again
    with caplog.at_level(logging.WARNING, logger="loader.executors.schedule"):
        os.kill(victim.process.pid, signal.SIGKILL)
        got += _rows(it)
    assert got == expected
    assert re.search(r"loader worker \d \(pid \d+\) ended \(signal SIGKILL\) with [1-9]\d* group\(s\) in progress; "
                     r"another computes them again", caplog.text), caplog.text
    it.close()
    assert _workers() == []


def _hangs_in_a_worker(record: bytes) -> bytes:
    if multiprocessing.parent_process() is not None:
        time.sleep(3600)  # a map function that never returns
    return record


@pytest.mark.timeout(120)
def test_the_iterator_is_one_batch_at_a_time_from_any_thread_and_a_close_from_another_ends_a_wait(converted):
    """Two threads' next() interleaved on the workers' pipes: the loader killed healthy workers, hung, or both. A
    close() from another thread (a caller's own timeout) left a waiting next() waiting for ever, and the loader
    started workers in place of those close() had stopped, which lived as long as the process."""
    import threading

    expected = _rows(loader.load(str(converted), map_fn=_slow, **OPTIONS))
    it = iter(loader.load(str(converted), map_fn=_slow, worker_count=2, **OPTIONS))
    got: list = []
    threads = [threading.Thread(target=lambda: got.extend((i, _rows([b])[0]) for i, b in zip(range(32), it)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert sorted(rows for _, rows in got) == sorted(expected)  # each batch once
    it.close()

    it = iter(loader.load(str(converted), map_fn=_hangs_in_a_worker, worker_count=1, **OPTIONS))
    threading.Timer(1.0, it.close).start()
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"^this loader iterator was closed while a batch was awaited \(close\(\) "
                                         r"from another thread\)"):
        next(it)
    assert time.monotonic() - started < 30
    time.sleep(0.5)
    assert _workers() == []


@pytest.mark.timeout(120)
def test_a_record_that_kills_every_worker_is_one_error_naming_its_group(converted):
    it = iter(loader.load(str(converted), map_fn=_poisoned, worker_count=2, **{**OPTIONS, "shuffle": False}))
    with pytest.raises(ValueError) as e:
        list(it)
    message = str(e.value)
    # without shuffling, record 2:50 is global record 37 + 50 = 87; groups: batch 0, then 2 batches each
    assert re.match(r"a loader worker ended 3 times while computing batches 9-10 \(16 records: \S+"
                    r"/train-00002-of-00005\.array_record: records 35-50\) \(the last: signal SIGKILL\): a record "
                    r"there crashes the decoder or map function", message), message
    assert message.endswith("run with worker_count=0 to see the error, or give the workers more memory")
    assert _workers() == []


class _FlakyStarts:
    """A map function whose odd-numbered worker processes die as they unpickle it (before they start), and whose
    even-numbered ones die at their 20th record: start failures that are not in a row."""

    def __init__(self, counter: str):
        self.counter, self.start, self.seen = counter, 0, 0

    def __getstate__(self):
        return {"counter": self.counter}

    def __setstate__(self, state):
        import fcntl

        self.counter, self.seen = state["counter"], 0
        with open(self.counter, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            self.start = int(f.read() or 0) + 1
            f.seek(0)
            f.write(str(self.start))
        if self.start in (1, 3, 5):
            os._exit(1)

    def __call__(self, record: bytes) -> bytes:
        self.seen += 1
        if self.start in (2, 4) and self.seen == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        return record


@pytest.mark.timeout(120)
def test_workers_that_fail_to_start_now_and_then_are_not_counted_together(converted, tmp_path, caplog):
    """Three starts failed in all, each followed by a worker that started: the run goes on (three in a row is the
    error above), and its batches are those of a run without workers."""
    expected = _rows(loader.load(str(converted), **OPTIONS))
    counter = tmp_path / "starts"
    counter.write_text("0")
    with caplog.at_level(logging.WARNING, logger="loader.executors.schedule"):
        got = _rows(loader.load(str(converted), map_fn=_FlakyStarts(str(counter)), worker_count=1, **OPTIONS))
    assert got == expected
    assert int(counter.read_text()) == 6, caplog.text
    assert caplog.text.count("ended before it started (exit code 1)") == 3, caplog.text
    assert caplog.text.count("ended (signal SIGKILL)") == 2, caplog.text


def test_results_arrays_travel_through_one_shm_file_that_is_gone_once_taken():
    from loader.executors import processes

    value = [{"image": np.arange(3 << 20, dtype=np.uint8).reshape(3, -1), "label": np.arange(3)}, b"raw", "text"]
    packed = processes._pack(value, "loader-test", 0)
    assert packed[0] == "shm" and os.path.exists(f"/dev/shm/loader-test-{os.getpid()}-0")
    got = processes._unpack(packed)
    assert not os.path.exists(f"/dev/shm/loader-test-{os.getpid()}-0")
    np.testing.assert_array_equal(got[0]["image"], value[0]["image"])
    np.testing.assert_array_equal(got[0]["label"], value[0]["label"])
    assert got[1:] == [b"raw", "text"]
    got[0]["image"][0, 0] = 7  # writable, as a batch from threads is
    small = processes._pack({"label": np.arange(3)}, "loader-test", 1)
    assert small[0] == "pipe" and processes._unpack(small)["label"].tolist() == [0, 1, 2]


def test_result_files_of_an_owner_killed_with_its_workers_are_removed_by_the_next_iterator(converted):
    """SIGKILL to a whole process group leaves nobody to remove results in flight: the next iterator does."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = f"/dev/shm/loader-{int(dead.stdout)}-0123456789ab-1-0"
    open(orphan, "wb").close()
    mine = f"/dev/shm/loader-{os.getpid()}-0123456789ab-1-0"  # a live owner's: kept
    open(mine, "wb").close()
    try:
        it = iter(loader.load(str(converted), worker_count=1, **OPTIONS))
        next(it)
        it.close()
        assert not os.path.exists(orphan) and os.path.exists(mine)
    finally:
        for path in (orphan, mine):
            if os.path.exists(path):
                os.unlink(path)


INTERRUPTED = """
import sys, time
import loader

def slow(record):
    time.sleep(0.01)
    return record

if __name__ == "__main__":
    it = iter(loader.load(sys.argv[1], batch_size=8, seed=3, decode=None, num_epochs=100, worker_count=2, map_fn=slow))
    next(it)
    print("reading", flush=True)
    for _ in it:
        pass
"""


@pytest.mark.timeout(120)
def test_a_terminals_ctrl_c_is_the_owners_alone(converted, tmp_path):
    """A Ctrl-C reaches the whole process group: each worker printed a KeyboardInterrupt traceback of its own."""
    script = tmp_path / "read.py"
    script.write_text(INTERRUPTED)
    proc = subprocess.Popen([sys.executable, str(script), str(converted)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.readline() == "reading\n"
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGINT and err.count("Traceback") == 1, err  # (the owner's KeyboardInterrupt)
    assert "loader-worker" not in err, err


UNGUARDED = """
import sys
import loader
# no `if __name__ == "__main__":` guard: each spawned worker imports this again and fails to start
batches = list(loader.load(sys.argv[1], batch_size=8, seed=3, decode=None, num_epochs=10, worker_count=2))
print("batches", len(batches))
"""


@pytest.mark.timeout(120)
def test_an_unguarded_script_is_told_to_guard_its_top_level(converted, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(UNGUARDED)
    proc = subprocess.run([sys.executable, str(script), str(converted)], capture_output=True, text=True,
                          timeout=110, cwd=tmp_path)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: loader worker processes end before they start (3 of them, the last: exit "
                           "code 1; its error is printed above): a script that starts them (worker_count=) must "
                           "guard its top level with `if __name__ == \"__main__\":`"), proc.stderr[-3000:]
    assert "An attempt has been made to start a new process before" in proc.stderr  # the workers' own error


def test_more_workers_than_cores_is_a_warning_once(monkeypatch, caplog):
    """worker_count=64 on 2 cores started 64 processes without a word."""
    from loader import executors
    from loader.executors import tuned
    from loader.executors.processes import Processes

    monkeypatch.setattr(tuned, "loader_cores", lambda: 2)
    monkeypatch.setattr(executors, "_TOLD", set())
    with caplog.at_level(logging.WARNING, logger="loader.executors"):
        assert isinstance(executors.make(2, num_threads=1, prefetch=1), Processes)
        assert not caplog.records
        for _ in range(2):  # a loader makes an executor each epoch: told once
            executors.make(3, num_threads=1, prefetch=1)
    assert [r.getMessage() for r in caplog.records] == [
        "worker_count=3: 3 worker processes for 2 cores; each decodes on a core of its own, so those past the cores "
        "add memory, not speed (worker_count='auto' starts what the step's demand needs)"]
