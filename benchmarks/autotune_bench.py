"""worker_count="auto" against every fixed setting, in one run: is the tuned loader as fast as the best fixed one?

    .venv/bin/python benchmarks/autotune_bench.py                       # images, 1 KB records: 60 s each
    .venv/bin/python benchmarks/autotune_bench.py --seconds 20 --workloads 1kb   # quicker

Workloads (each contender yields the same batches):
- images: ImageNet-like JPEGs (benchmarks/image_bench.py's photos, ~50 KB), batches of 128 random-resized crops
  to 224 (`loader.decoding.images.RandomResizedCrop`): JPEG decode and resize in C, with the GIL released;
- 1kb raw / 1kb decode: 1 KB tf.train.Example records (benchmarks/loader_bench.py's), batches of 256, raw bytes
  or decoded: read-bound, where this process's threads are cheapest;
- python map: the same records decoded, then a map_fn in Python bytecode (a hash of 512 bytes, ~50 us a record):
  it holds the GIL, so this process's threads run it on one core at a time; the case for worker processes.

Contenders: `worker_count=0` (threads here), 1, 2, ... up to the cores, and "auto". Each runs for `--seconds` in a
fresh process pinned to the cores (`sched_setaffinity`); contenders take turns (`--repeats` rounds) so the VM's
drift hits them all. Reported per contender: records/s over the whole run from its first batch (auto's tuning
included) and over its second half (steady state), and for auto what it chose and what it measured on the way.
The ratio that matters: auto over the best fixed setting, over the whole run. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import image_bench  # benchmarks/image_bench.py: the photos, and its runner
import loader_bench  # benchmarks/loader_bench.py: the 1 KB records


RUNNER = """
import json, logging, os, sys, time
os.sched_setaffinity(0, set(range({cores})))
logging.basicConfig(level=logging.WARNING)
import loader
from loader.decoding import images
options = {options}
if {image!r}:
    options["random_map_fn"] = images.RandomResizedCrop("image/encoded", size=224)
def python_hash(example):  # per-record work in Python bytecode: it holds the GIL
    h = 0
    for b in example["data"][:512]:
        h = (h * 31 + b) & 0xFFFFFFFF
    return {{"hash": h, "label": example["label"]}}
if {python_map!r}:
    options["map_fn"] = python_hash
it = iter(loader.load({out!r}, seed=0, worker_count={workers!r}, **options))
next(it)
t0 = time.perf_counter()
marks = []
while time.perf_counter() - t0 < {seconds}:
    next(it)
    marks.append(time.perf_counter() - t0)
rows = options["batch_size"]
half = [m for m in marks if m >= marks[-1] / 2]
groups = it._host.groups
history = [(str(m.setting), m.rate, m.wait) for m in getattr(getattr(groups, "tuner", None), "history", [])]
print(json.dumps({{"rate": len(marks) * rows / marks[-1], "steady": (len(half) - 1) * rows / (half[-1] - half[0]),
                  "setting": it.worker_setting(), "history": history}}))
sys.stdout.flush()
os.killpg(0, 9)
"""


def workloads(work: Path, names: list[str], images: int, records: int) -> dict:
    """name -> (converted directory, load options, the map: "image", "python map" or None)."""
    from pipelines.config import DEFAULT_COMPRESSION

    found = {}
    if "images" in names:
        out, _, _ = image_bench.prepare(work / "images", images)
        found["images"] = (str(out), {"batch_size": 128}, "image")
    if {"1kb raw", "1kb decode", "python map"} & set(names):
        small = work / f"1kb-{records}"
        if not (small / "tfrecord").exists():
            print(f"building {records:,} records of 1 KB under {small} ...", flush=True)
            loader_bench.build(small, records, 8)
        out, shards = loader_bench.converted(small, DEFAULT_COMPRESSION)
        loader_bench.warm(shards)
        if "1kb raw" in names:
            found["1kb raw"] = (str(out), {"batch_size": 256, "decode": None}, None)
        if "1kb decode" in names:
            found["1kb decode"] = (str(out), {"batch_size": 256, "decode": "example"}, None)
        if "python map" in names:
            found["python map"] = (str(out), {"batch_size": 256, "decode": "example"}, "python map")
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", nargs="+", default=["images", "1kb raw", "1kb decode"],
                   choices=["images", "1kb raw", "1kb decode", "python map"])
    p.add_argument("--seconds", type=float, default=60.0, help="each contender's run, from its first batch")
    p.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--images", type=int, default=1500)
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--workdir", default="/tmp/autotune-bench")
    args = p.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    found = workloads(work, args.workloads, args.images, args.records)
    contenders = list(range(args.cores + 1)) + ["auto"]
    print(f"{args.seconds:.0f} s a contender, {args.cores} cores ({image_bench._cpu()}), {args.repeats} round(s)")
    for name, (out, options, mapping) in found.items():
        runs: dict = {}
        for _ in range(args.repeats):
            for workers in contenders:
                code = RUNNER.format(cores=args.cores, options=options, image=mapping == "image", out=out,
                                     workers=workers, seconds=args.seconds, python_map=mapping == "python map")
                r = image_bench.run(code, timeout=args.seconds * 3 + 120)  # its own session, ended by SIGKILL
                runs.setdefault(workers, []).append(r)
                chose = f"  chose {r['setting']}; measured " + ", ".join(
                    f"{s} {v:,.0f}/s ({100 * w:.0f}% waiting)" for s, v, w in r["history"]) if workers == "auto" else ""
                print(f"  {name:10s} workers={workers!s:4s} {r['rate']:>9,.0f} records/s "
                      f"(second half {r['steady']:>9,.0f}){chose}", flush=True)
        rate = {w: statistics.median(r["rate"] for r in rs) for w, rs in runs.items()}
        steady = {w: statistics.median(r["steady"] for r in rs) for w, rs in runs.items()}
        best = max((w for w in contenders if w != "auto"), key=lambda w: rate[w])
        best_steady = max((w for w in contenders if w != "auto"), key=lambda w: steady[w])
        print(f"{name}: auto {rate['auto']:,.0f}/s over the whole run, the best fixed (workers={best}) "
              f"{rate[best]:,.0f}/s: {rate['auto'] / rate[best]:.2f}x; second half {steady['auto']:,.0f}/s against "
              f"{steady[best_steady]:,.0f}/s (workers={best_steady}): {steady['auto'] / steady[best_steady]:.2f}x",
              flush=True)


if __name__ == "__main__":
    main()
