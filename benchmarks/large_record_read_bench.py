"""Reading large records from local shards: this revision's reader against another's, in one run.

    .venv/bin/python benchmarks/large_record_read_bench.py --previous REV [--record-kb 100] [--group-mb 64]

8 shards of random records (ArrayRecord group_size:1, uncompressed; 96 MB) in the page cache; each contender, in
a process of its own, reads random read groups of `--group-mb` of records (the loader's groups of large records
hold ~64 MB) with `BatchReader`, one group after another on one thread, for 3 alternating rounds. Reported: ms a
record (medians) and previous / this.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import revision  # benchmarks/revision.py

_READ = """
import os, sys, time
import numpy as np
import loader
from loader.fetch.reader import BatchReader
reader = BatchReader(loader.resolve(sys.argv[1] + "/*.array_record"))
count, per_group = int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(0)
groups = [rng.choice(count, per_group, replace=False) for _ in range(12)]
reader(groups[0])
started = time.perf_counter()
for group in groups[1:]:
    reader(group)
print((time.perf_counter() - started) / (11 * per_group) * 1e3)
"""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--previous", required=True, help="the git revision to compare with")
    p.add_argument("--record-kb", type=float, default=100)
    p.add_argument("--group-mb", type=float, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    import gcs_read_bench  # benchmarks/gcs_read_bench.py: the shards

    work = Path(tempfile.mkdtemp(prefix="large-record-read-"))
    size = int(args.record_kb * 1000)
    paths = gcs_read_bench.write_shards(work, size, int(96e6))
    records = len(paths) * (int(96e6) // size // len(paths))
    per_group = int(args.group_mb * 1e6 // size)
    roots = {"previous": revision.checkout(args.previous, work / "previous"), "this": revision.REPO}
    times: dict[str, list[float]] = {name: [] for name in roots}
    try:
        for _ in range(args.rounds):
            for name, root in roots.items():
                env = {**os.environ, "PYTHONPATH": str(root), "LOADER_INDEX_DIR": str(work / f"index-{name}")}
                out = subprocess.run([sys.executable, "-c", _READ, str(work), str(records), str(per_group)],
                                     cwd=root, env=env, check=True, capture_output=True, text=True).stdout
                times[name].append(float(out.split()[-1]))
    finally:
        revision.remove(work / "previous")
    previous, this = (statistics.median(times[name]) for name in ("previous", "this"))
    print(f"{args.record_kb:g} KB records, groups of {per_group} ({args.group_mb:g} MB), {os.cpu_count()} cores, "
          f"{args.rounds} rounds (medians)")
    print("| reader | ms a record | previous / this |")
    print("| --- | ---: | ---: |")
    print(f"| {args.previous} | {previous:.3f} | |")
    print(f"| this revision | {this:.3f} | {previous / this:.2f}x |")


if __name__ == "__main__":
    main()
