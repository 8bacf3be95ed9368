"""The loader's index: resident memory per record, and the start of a dataset of many shards.

    .venv/bin/python benchmarks/index_bench.py                              # 1M and 8M records, 100k shards
    .venv/bin/python benchmarks/index_bench.py --previous 3f7d36e           # also the loader of that revision
    .venv/bin/python benchmarks/index_bench.py --start-only --many 100000   # the start of 100k shards alone

Memory: two datasets of tiny records (8 bytes, 8 shards, group_size:1, snappy; `--small`/`--large` records) are
read by `loader.load(..., decode=None)` in a child process, with `worker_count` 0 and 2, for `--batches` batches
of 256 (random batches touch every page of the index); then the proportional set size (PSS: shared pages split
between the processes that map them) of the process and its workers is summed. The slope between the two
datasets, (PSS_large - PSS_small) / (large - small), is the resident bytes per record a host pays. With
`--previous REV` the loader of that revision (read through ArrayRecord's reader) is measured the same way.

Start: `--many` shards (symbolic links to one 10-record shard, listed in a manifest.json as a conversion writes it):
the time to build the index once, and then from `loader.load` to the first batch with the index built.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import revision  # benchmarks/revision.py

REPO = Path(__file__).resolve().parents[1]

_CHILD = """
import json, sys, time, psutil
root, workers, batches = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
import grain, loader  # (imported before the clock: grain brings JAX, ~0.6 s, which iter() would otherwise import)
t0 = time.perf_counter()
it = iter(loader.load(root, batch_size=256, seed=0, decode=None, worker_count=workers))
next(it)
first = time.perf_counter() - t0
for _ in range(batches):
    next(it)
me = psutil.Process()
procs = [me] + me.children(recursive=True)
pss = sum(p.memory_full_info().pss for p in procs)
# the index file's own pages, summed over the processes that map it (PSS splits shared pages between them)
index = sum(m.pss for p in procs for m in p.memory_maps(grouped=True) if m.path.endswith(".idx"))
print(json.dumps({"pss": pss, "index_pss": index, "first_batch_s": first}))
"""


def write_dataset(root: Path, records: int, shards: int = 8) -> None:
    """`records` 8-byte records in `shards` ArrayRecord files and a manifest.json listing them."""
    from array_record.python.array_record_module import ArrayRecordWriter

    root.mkdir(parents=True)
    per, entries = records // shards, []
    for s in range(shards):
        name = f"tiny-{s:05d}-of-{shards:05d}.array_record"
        writer = ArrayRecordWriter(str(root / name), "group_size:1,snappy")
        for i in range(s * per, (s + 1) * per):
            writer.write(i.to_bytes(8, "little"))
        writer.close()
        entries.append((name, per))
    write_manifest(root, entries)


def write_manifest(root: Path, entries: list[tuple[str, int]]) -> None:
    from dataset_format.manifest import Manifest, ShardEntry

    shards = tuple(ShardEntry(path=name, source=f"/in/{name}", records=n, bytes=(root / name).stat().st_size,
                              source_bytes=0, source_fingerprint="", writer_options="group_size:1,snappy")
                   for name, n in entries)
    (root / "manifest.json").write_text(Manifest(input="/in/*", kind="tfrecord", shards=shards,
                                                 tool_version="bench").to_json())


def child(root: Path, workers: int, batches: int, cwd: Path, index_dir: Path) -> dict:
    env = {**os.environ, "LOADER_INDEX_DIR": str(index_dir)}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(root), str(workers), str(batches)], cwd=cwd,
                          capture_output=True, text=True, env=env, timeout=1200)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", type=int, default=1_000_000)
    p.add_argument("--large", type=int, default=8_000_000)
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3, help="runs per point (the median is taken)")
    p.add_argument("--many", type=int, default=100_000, help="shards of the start-time dataset (0: skip)")
    p.add_argument("--previous", default=None, help="also measure the loader of this git revision")
    p.add_argument("--workdir", default=None)
    p.add_argument("--start-only", action="store_true", help="only the start of the --many-shard dataset")
    args = p.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="index-bench-"))
    index_dir = work / "index"
    loaders = {"ours": REPO}
    if args.previous:
        loaders["previous"] = revision.checkout(args.previous, work / "previous")
    for n in () if args.start_only else (args.small, args.large):
        if not (work / f"tiny-{n}").exists():
            print(f"writing {n:,} tiny records ...", flush=True)
            write_dataset(work / f"tiny-{n}", n)
    for name, cwd in () if args.start_only else loaders.items():
        for workers in (0, 2):
            pss, index = {}, {}
            for n in (args.small, args.large):
                child(work / f"tiny-{n}", workers, 1, cwd, index_dir)  # builds the index (ours) outside the timing
                runs = [child(work / f"tiny-{n}", workers, args.batches, cwd, index_dir) for _ in range(args.repeats)]
                pss[n] = statistics.median(r["pss"] for r in runs)
                index[n] = statistics.median(r["index_pss"] for r in runs)
            slope = (pss[args.large] - pss[args.small]) / (args.large - args.small)
            print(f"{name:9s} worker_count={workers}: PSS {pss[args.small] / 2**20:,.0f} MB at {args.small:,} records, "
                  f"{pss[args.large] / 2**20:,.0f} MB at {args.large:,}: {slope:.2f} bytes/record per host; the index "
                  f"file's pages {index[args.large] / args.large:.2f} bytes/record", flush=True)
    if args.many:
        many = work / f"many-{args.many}"
        if not many.exists():
            print(f"linking {args.many:,} shards ...", flush=True)
            if not (work / "one").exists():
                write_dataset(work / "one", 10, shards=1)
            many.mkdir()
            one = work / "one" / "tiny-00000-of-00001.array_record"
            names = [f"m-{i:06d}-of-{args.many:06d}.array_record" for i in range(args.many)]
            for name in names:
                os.symlink(one, many / name)
            write_manifest(many, [(name, 10) for name in names])
        starts: dict[str, list[float]] = {}
        shutil.rmtree(index_dir, ignore_errors=True)
        for name, cwd in loaders.items():  # each builds its own index (their versions differ: files of their own)
            t0 = time.perf_counter()
            first = child(many, 0, 0, cwd, index_dir)["first_batch_s"]
            build = time.perf_counter() - t0
            print(f"{name}: {args.many:,} shards: first run (builds the index) {first:.2f} s to the first batch "
                  f"({build:.2f} s with the process start)", flush=True)
            starts[name] = []
        for _ in range(args.repeats):  # the loaders take turns, each with its index built
            for name, cwd in loaders.items():
                starts[name].append(child(many, 0, 0, cwd, index_dir)["first_batch_s"])
        for name, times in starts.items():
            print(f"{name}: {args.many:,} shards, index built: {statistics.median(times):.2f} s to the first batch "
                  f"(median of {len(times)}: {', '.join(f'{t:.2f}' for t in times)})")
        if "previous" in starts:
            print(f"ours / previous: {statistics.median(starts['ours']) / statistics.median(starts['previous']):.2f}x "
                  "the time to the first batch")
    if args.previous:
        revision.remove(loaders["previous"])
    if not args.workdir:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
