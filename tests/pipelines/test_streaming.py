"""A worker streams: its peak memory does not grow with the shard's size."""

import subprocess
import sys

from tests.conftest import REPO

_CONVERT_AND_REPORT_PEAK = """
import os, resource, sys
from pipelines import tfrecord
from pipelines.paths import InputFile
from pipelines.shard import ShardTask, convert_shard
src, dst, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
with open(src, "wb") as f:  # written before the baseline is taken, in 1 MB records
    tfrecord.write_records(f, (os.urandom(1 << 10) * 1024 for _ in range(n)))
baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
task = ShardTask(InputFile(src, os.path.getsize(src), 0.0), dst, os.path.basename(dst))
result = convert_shard(task, writer_options="group_size:1,zstd:1", skip_corrupt=False)
assert result.entry.records == n
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline) // 1024)
"""


def _peak_growth_mb(tmp_path, megabytes: int) -> int:
    proc = subprocess.run([sys.executable, "-c", _CONVERT_AND_REPORT_PEAK, str(tmp_path / f"in{megabytes}"),
                           str(tmp_path / f"out{megabytes}"), str(megabytes)],
                          cwd=REPO, capture_output=True, text=True, check=True, timeout=300)
    return int(proc.stdout.strip())


def test_peak_memory_is_flat_as_the_shard_grows(tmp_path):
    small = _peak_growth_mb(tmp_path, 16)
    large = _peak_growth_mb(tmp_path, 160)
    # 10x the data may cost a few MB of buffers, never the shard itself (160 MB).
    assert large - small < 24, (small, large)
    assert large < 48, (small, large)
