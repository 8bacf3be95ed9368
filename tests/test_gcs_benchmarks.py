"""The gs:// benchmarks run end to end on tiny data (they reach into the loader's reader for its counts, so a change
there must not break them unseen), and what they report holds: ours reads at most 1.5x the bytes it serves, and a
restarted job on a disk cache makes fewer requests than one without."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.gcs


def _table(script: str, *args: str) -> list[list[str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STORAGE_EMULATOR", "CLOUD_STORAGE_EMULATOR"))}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in done.stdout.splitlines()
            if line.startswith("| ") and not line.startswith(("| latency", "| records", "| ---"))]
    assert rows, done.stdout
    return rows


def test_gcs_read_bench_reports_ours_and_grain_and_ours_reads_little_more_than_it_serves():
    rows = _table("gcs_read_bench.py", "--record-kb", "1,100", "--dataset-mb", "0.5,4", "--latency-ms", "5",
                  "--grain", "--grain-records", "64")
    readers = [row[2] for row in rows]
    assert readers == ["ours, merged by gap alone (1 MiB)", "ours: gap and 50% budget",
                       "grain ArrayRecordDataSource, 16 threads"] * 2
    for row in rows:
        assert float(row[3].replace(",", "")) > 0 and int(row[4].replace(",", "")) > 0
    ours = [row for row in rows if row[2].startswith("ours: gap")]
    assert all(float(row[5].rstrip("x")) <= 1.5 for row in ours), ours


def test_disk_cache_bench_restart_on_the_disk_cache_requests_less():
    rows = _table("disk_cache_bench.py", "--record-kb", "1", "--dataset-mb", "1", "--epochs", "1")
    requests = {(row[1], row[2]): int(row[5].replace(",", "")) for row in rows if row[1].startswith("gs://")}
    assert set(requests) == {(reader, epochs) for reader in ("gs://, no cache", "gs://, memory cache",
                                                             "gs://, disk cache") for epochs in ("1-1", "restart: 1")}
    assert requests["gs://, disk cache", "restart: 1"] < requests["gs://, no cache", "restart: 1"] / 2
