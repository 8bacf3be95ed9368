"""Read-path benchmark: one `read([i, ...])` call per run against `seek(i)` + `read()` per record.

    .venv/bin/python benchmarks/read_paths_bench.py                       # files of 100, 25k and 125k records
    .venv/bin/python benchmarks/read_paths_bench.py --file-records 1000 200000

The loader reads each read group as one sorted run of k records per shard (loader/reader.py). ArrayRecord
has two ways to read such a run from a file of N records, and this times both, side by side in this one
run, on the same runs of the same files (1 KB records, group_size:1, snappy, the converter's output;
files read once beforehand so both read from the page cache):

- list: `reader.read(sorted_indices)` on a reader opened with the loader's random-access options;
- per record: `reader.seek(i); reader.read()` on the same reader, for each i of the run;
- loader: what `BatchReader` picks for that (k, N) (SEEK_BELOW, SEEK_PER_FILE).

Reported per (N, k): microseconds a record (wall) for each path, per-record / list, and the loader's
pick. Results: docs/benchmarks.md ("Reading a shard").
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np


def write_file(path: str, n: int, rng: np.random.Generator) -> None:
    from array_record.python.array_record_module import ArrayRecordWriter

    from pipelines.config import DEFAULT_COMPRESSION
    from dataset_format.example_proto import encode_example

    writer = ArrayRecordWriter(path, f"group_size:1,{DEFAULT_COMPRESSION}")
    for i in range(n):
        writer.write(encode_example({"data": rng.integers(32, 96, 1000, dtype=np.uint8).tobytes(), "label": i}))
    writer.close()


def time_runs(read, runs: list[list[int]], rounds: int) -> float:
    """Median over rounds of the wall time per record of reading every run once."""
    per_record = []
    for _ in range(rounds):
        t = time.perf_counter()
        for run in runs:
            read(run)
        per_record.append((time.perf_counter() - t) / sum(map(len, runs)))
    return statistics.median(per_record)


def main() -> None:
    from array_record.python.array_record_module import ArrayRecordReader

    from loader.reader import RANDOM_ACCESS, SEEK_BELOW, SEEK_PER_FILE

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--file-records", type=int, nargs="*", default=[100, 25_000, 125_000])
    p.add_argument("--run-lengths", type=int, nargs="*", default=[1, 16, 64, 256, 512, 1024, 2048])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="read-paths-") as work:
        print(f"{'N':>8} {'k':>6} {'list us/rec':>12} {'per record':>11} {'per rec/list':>13}  loader reads")
        for n in args.file_records:
            path = os.path.join(work, f"{n}.array_record")
            write_file(path, n, rng)
            with open(path, "rb") as f:
                f.read()
            reader = ArrayRecordReader(path, RANDOM_ACCESS)

            def per_record(run, reader=reader):
                for i in run:
                    reader.seek(i)
                    reader.read()

            for k in args.run_lengths:
                if k > n:
                    continue
                count = max(4, 20_000 // k)  # ~20k records a round
                runs = [np.sort(rng.choice(n, k, replace=False)).tolist() for _ in range(count)]
                list_us = time_runs(reader.read, runs, args.rounds) * 1e6
                seek_us = time_runs(per_record, runs, args.rounds) * 1e6
                pick = "list" if k >= SEEK_BELOW + n // SEEK_PER_FILE else "per record"
                print(f"{n:>8,} {k:>6} {list_us:>12.2f} {seek_us:>11.2f} {seek_us / list_us:>12.2f}x  {pick}",
                      flush=True)


if __name__ == "__main__":
    main()
