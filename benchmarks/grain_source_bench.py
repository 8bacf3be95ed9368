"""grain data sources: `loader.DataSource` against grain's `ArrayRecordDataSource` on the same shards, in one run.

    .venv/bin/python benchmarks/grain_source_bench.py                        # 1M x 1 KB records, 8 shards
    .venv/bin/python benchmarks/grain_source_bench.py --records 200000 --workdir /tmp/gsb   # quicker; kept

Data: loader_bench's ~1 KB tf.train.Examples (`data`: 1,000 bytes, `label`), converted by our pipeline (snappy,
group_size:1), kept in `--workdir` (loader_bench's layout, so a loader_bench workdir serves too).

Reads, both sources in this process, after the shards were read once into the page cache, on the same random
indices; the two take turns for `--repeats` rounds and the medians are reported:
- batched: `source.__getitems__(indices)`, `--batch` uniformly random indices a call (grain's reads each shard's
  positions with one ArrayRecordReader.read call, the shards on a thread pool; ours is one call of the loader's
  reader), `--batches` calls;
- single: `source[i]`, `--singles` random indices;
- pipeline: MaxText's read path, `grain.MapDataset.source(source).shuffle(seed).to_iter_dataset()` (grain's default
  ReadOptions: 16 threads, each reading with `source[i]`), `--pipeline-records` records from the start.

Memory: each source opened in a fresh child process (grain and our package imported) and read for `--memory-reads`
random records, by `source[i]` in one child and by `__getitems__` in another, which opens every shard's reader and
touches every page of our index.
Reported: the child's RSS growth from before the source was made, and of it our index file's resident pages, which
every process on the host that maps the file shares; grain's readers hold 8 bytes a record, and their buffers, in
each process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from loader_bench import build, converted, warm  # benchmarks/loader_bench.py

REPO = Path(__file__).resolve().parents[1]

_CHILD = """
import gc, json, os, sys
import numpy as np, psutil
import grain, loader
kind, mode, data, reads, batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])


def open_source(data, paths):
    return loader.DataSource(data) if kind == "ours" else grain.sources.ArrayRecordDataSource(paths)


def read(source, count):
    rng = np.random.default_rng(0)
    if mode == "single":
        for i in rng.integers(0, len(source), count).tolist():
            source[i]
    else:
        for _ in range(max(1, count // batch)):
            source.__getitems__(rng.integers(0, len(source), batch).tolist())


index_dir = os.environ["LOADER_INDEX_DIR"]
paths = list(loader.resolve(data).paths)
me = psutil.Process()
gc.collect()
before = me.memory_info().rss
source = open_source(data, paths)
read(source, reads)
gc.collect()
growth = me.memory_info().rss - before
maps = [m for m in me.memory_maps(grouped=True) if m.path.startswith(index_dir) and m.path.endswith(".idx")]
print(json.dumps({"growth": growth, "index_rss": sum(m.rss for m in maps),
                  "index_file": sum(os.path.getsize(m.path) for m in maps)}))
"""


def batched(source, batches: list[list[int]]) -> float:
    """Records/s of `source.__getitems__` over `batches`."""
    started = time.perf_counter()
    for indices in batches:
        source.__getitems__(indices)
    return sum(map(len, batches)) / (time.perf_counter() - started)


def single(source, indices: list[int]) -> float:
    """Records/s of `source[i]` over `indices`."""
    started = time.perf_counter()
    for i in indices:
        source[i]
    return len(indices) / (time.perf_counter() - started)


def pipeline(source, records: int, seed: int) -> float:
    """Records/s of MaxText's read path: `MapDataset.source(source).shuffle(seed).to_iter_dataset()` (grain's
    default ReadOptions: 16 threads read record by record, `source[i]`), over `records` records."""
    import grain

    started = time.perf_counter()
    it = iter(grain.MapDataset.source(source).shuffle(seed=seed).to_iter_dataset())
    for _ in range(records):
        next(it)
    return records / (time.perf_counter() - started)


def memory(kind: str, mode: str, data: str, reads: int, batch: int) -> dict:
    """RSS growth of a fresh process that opens the `kind` source and reads `reads` random records (`mode`: "single",
    `source[i]`; "batched", `__getitems__` of `batch`)."""
    proc = subprocess.run([sys.executable, "-c", _CHILD, kind, mode, data, str(reads), str(batch)], cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    if proc.returncode != 0:
        raise RuntimeError(f"the {kind} memory child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--batch", type=int, default=32, help="random indices per __getitems__ call")
    p.add_argument("--batches", type=int, default=2000, help="__getitems__ calls timed per round")
    p.add_argument("--singles", type=int, default=10000, help="source[i] reads timed per round")
    p.add_argument("--pipeline-records", type=int, default=5000,
                   help="records read through MaxText's read path per round")
    p.add_argument("--repeats", type=int, default=3, help="rounds; medians reported")
    p.add_argument("--memory-reads", type=int, default=20000, help="random records each memory child reads")
    p.add_argument("--workdir", default=None, help="keep the data here (reused when it is there)")
    args = p.parse_args()

    from pipelines.config import DEFAULT_COMPRESSION

    work = Path(args.workdir or tempfile.mkdtemp(prefix="grain-source-bench-"))
    os.environ.setdefault("LOADER_INDEX_DIR", str(work / "index"))  # the children map the index built here
    if not (work / "tfrecord").exists():
        print(f"building {args.records:,} records in {args.shards} shards under {work} ...", flush=True)
        build(work, args.records, args.shards)
    out, shards = converted(work, DEFAULT_COMPRESSION)

    import grain

    import loader

    ours = loader.DataSource(str(out))  # builds the index on first use (outside the timing)
    theirs = grain.sources.ArrayRecordDataSource(list(ours.paths))
    n = len(ours)
    assert len(theirs) == n
    warm(shards)
    rng = np.random.default_rng(0)
    check = rng.integers(0, n, args.batch).tolist()
    assert ours.__getitems__(check) == theirs.__getitems__(check), "the sources disagree"
    rates: dict[str, list[float]] = {}
    for round_ in range(args.repeats):
        batches = [rng.integers(0, n, args.batch).tolist() for _ in range(args.batches)]
        singles = rng.integers(0, n, args.singles).tolist()
        for name, source in (("grain", theirs), ("ours", ours)):
            rates.setdefault(f"{name} batched", []).append(batched(source, batches))
            rates.setdefault(f"{name} single", []).append(single(source, singles))
            rates.setdefault(f"{name} pipeline", []).append(pipeline(source, args.pipeline_records, round_))
    mid = {k: statistics.median(v) for k, v in rates.items()}
    ratio = {mode: statistics.median(a / b for a, b in zip(rates[f"ours {mode}"], rates[f"grain {mode}"]))
             for mode in ("batched", "single", "pipeline")}

    print(f"\n{n:,} records in {len(ours.paths)} shards ({sum(os.path.getsize(s) for s in shards) / n:,.0f} bytes a "
          f"record stored), page cache warm; medians of {args.repeats} round(s)\n")
    print("| read | grain ArrayRecordDataSource, records/s | loader.DataSource, records/s | ours / grain |")
    print("| --- | ---: | ---: | ---: |")
    for mode, label in (("batched", f"`__getitems__`, {args.batch} random indices"), ("single", "`[i]`, random i"),
                        ("pipeline", "`MapDataset.source().shuffle().to_iter_dataset()`")):
        print(f"| {label} | {mid[f'grain {mode}']:,.0f} | {mid[f'ours {mode}']:,.0f} | {ratio[mode]:.2f}x |")

    mem = {(kind, mode): memory(kind, mode, str(out), args.memory_reads, args.batch)
           for kind in ("grain", "ours") for mode in ("single", "batched")}
    print(f"\nmemory: RSS growth of a fresh process that opens the source and reads {args.memory_reads:,} random "
          "records\n")
    print(f"| source | reads by `[i]`, MB | reads by `__getitems__` ({args.batch}), MB | of it the shared index "
          "file's pages, MB | index file |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for kind, name in (("grain", "grain ArrayRecordDataSource"), ("ours", "loader.DataSource")):
        single_, batched_ = mem[(kind, "single")], mem[(kind, "batched")]
        shared = f"{batched_['index_rss'] / 1e6:.2f}" if kind == "ours" else "-"
        size = batched_["index_file"]
        index = f"{size / 1e6:.2f} MB ({size / n:.2f} B/record)" if kind == "ours" else "-"
        print(f"| {name} | {single_['growth'] / 1e6:.1f} | {batched_['growth'] / 1e6:.1f} | {shared} | {index} |")


if __name__ == "__main__":
    main()
