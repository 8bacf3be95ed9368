"""Loader benchmark: ours against grain's stock pipeline, tf.data on the TFRecord originals, and a raw read.

    .venv/bin/python benchmarks/loader_bench.py                         # 1M x 1 KB records, 8 shards
    .venv/bin/python benchmarks/loader_bench.py --records 200000 --batches 200   # quicker

Builds TFRecord shards of tf.train.Example (`data`: ~1 KB bytes, `label`: int64), converts them with our
pipeline, then runs each contender in its own process, one after the other, in this one run:

- ours: `loader.load(dir, batch_size=256, seed=0)`, globally shuffled (exact permutation), on the default
  conversion (snappy) and on the same data converted `--compression zstd:3` (array_record's and TFDS's default);
- grain stock: `MapDataset.source(ArrayRecordDataSource(shards)).shuffle(seed).batch(256)`, global shuffle;
- tf.data: `TFRecordDataset` with `interleave` over the shards, `shuffle(10_000)`, `batch(256)`, `prefetch`;
- previous loader (`--previous REV`): `loader.load` as it was at git revision REV (run from a git worktree of it),
  e.g. the loader that read through ArrayRecord's own reader;
- raw sequential: ArrayRecordReader.read(start, end) over each shard in order, 256 records a call (an upper
  bound: no shuffle), opened with 16 MB of read-ahead (the anchor of the 0.5x target), and again with
  array_record's default options ("raw seq (defaults)": no read-ahead, a pread per chunk; about half as fast
  here, and near the ~270k ex/s the issue quotes for a bulk sequential read).

Each is measured raw (bytes) and with a tf.train.Example decode (tf.data: `tf.io.parse_example` on the
batch; grain and ours: our TensorFlow-free decoder per record). Reported: time to the first batch (from
building the pipeline, imports excluded); examples/s over the `--start` batches after it (the start window,
where ours still ramps its read groups up from one batch) and over the `--batches` after those (the steady
state, which is what a training run sees for most of its time; the targets are judged on it, and both are
printed); peak RSS. A window ends early after `--max-seconds` (grain stock reads a few thousand ex/s).
`--first-batch-shards 1000` also runs ours and the raw read on a dataset of that many shards of 100 records
(time to the first batch; throughput where each read group takes few records from each shard).
`--repeats N` runs N rounds of all contenders in turn and reports the medians, and for the ratios the
median of each round's ratio (this VM's speed drifts by +-20% between minutes; one round can mislead).
Results: docs/benchmarks.md.
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

import numpy as np
import psutil

REPO = Path(__file__).resolve().parents[1]


def _sequential(options: str) -> str:
    """A raw read of each shard in order, 256 records a call, with ArrayRecord reader `options`."""
    return """
from array_record.python.array_record_module import ArrayRecordReader
from loader.decoding.decode import ExampleDecoder
t0 = time.perf_counter()
def gen():
    dec = ExampleDecoder()
    small = []  # shards of < 256 records (--first-batch-shards) are joined into batches
    while True:
        for path in SHARDS:
            r = ArrayRecordReader(path, "%s")
            n = r.num_records()
            if n < 256:
                small += r.read(0, n)
                if len(small) < 256:
                    continue
                recs, small = small[:256], small[256:]
                yield [dec(x) for x in recs] if DECODE else recs
            for s in range(0, n - 255, 256):
                recs = r.read(s, s + 256)
                yield [dec(x) for x in recs] if DECODE else recs
it = gen()
""" % options


_CONTENDERS = {
    "ours": """
import grain, loader  # (imported before the clock, as the other contenders' libraries are: grain brings JAX, ~0.6 s)
t0 = time.perf_counter()
ds = loader.load(OUT, batch_size=256, seed=0, decode="example" if DECODE else None, num_threads=THREADS or 2,
                 worker_count=WORKERS)
it = iter(ds)
""",
    # The same code run from a worktree of --previous REV (measure() sets the working directory).
    "previous loader": """
import grain, loader  # (imported before the clock, as the other contenders' libraries are: grain brings JAX, ~0.6 s)
t0 = time.perf_counter()
ds = loader.load(OUT, batch_size=256, seed=0, decode="example" if DECODE else None, worker_count=WORKERS)
it = iter(ds)
""",
    # The same records converted with --compression zstd:3, what `tfds build --file_format=array_record`
    # writes: ~12% smaller here, but every random read pays a zstd decompression (benchmarks/compression_bench.py).
    "ours, zstd:3": """
import grain, loader  # (imported before the clock, as the other contenders' libraries are: grain brings JAX, ~0.6 s)
t0 = time.perf_counter()
ds = loader.load(OUT_ZSTD, batch_size=256, seed=0, decode="example" if DECODE else None,
                 num_threads=THREADS or 2, worker_count=WORKERS)
it = iter(ds)
""",
    "grain stock": """
import grain
from loader.decoding.decode import ExampleDecoder
t0 = time.perf_counter()
src = grain.sources.ArrayRecordDataSource(SHARDS)
ds = grain.MapDataset.source(src).shuffle(seed=0).repeat()
if DECODE:
    ds = ds.map(ExampleDecoder())
it = iter(ds.batch(256).to_iter_dataset())
""",
    "tf.data": """
import tensorflow as tf
t0 = time.perf_counter()
files = tf.data.Dataset.from_tensor_slices(TFRECORDS).shuffle(len(TFRECORDS), seed=0)
ds = files.interleave(tf.data.TFRecordDataset, cycle_length=len(TFRECORDS), num_parallel_calls=tf.data.AUTOTUNE)
ds = ds.shuffle(10_000, seed=0).repeat().batch(256)
if DECODE:
    spec = {"data": tf.io.FixedLenFeature([], tf.string), "label": tf.io.FixedLenFeature([], tf.int64)}
    ds = ds.map(lambda b: tf.io.parse_example(b, spec), num_parallel_calls=tf.data.AUTOTUNE)
it = iter(ds.prefetch(tf.data.AUTOTUNE).as_numpy_iterator())
""",
    # The anchor: 16 MB of read-ahead, each call one pread of many records (2x array_record's defaults here).
    "raw sequential": _sequential("readahead_buffer_size:16M"),
    # array_record's default options (no read-ahead: a pread per chunk), near the ~270k ex/s the issue quotes.
    "raw seq (defaults)": _sequential(""),
}

_HARNESS = """
import json, sys, time, resource
OUT, SHARDS, TFRECORDS, DECODE, WINDOWS, MAX_S, THREADS, WORKERS, OUT_ZSTD, SHARDS_ZSTD = \
    json.load(open(sys.argv[1]))
{setup}
first = next(it)
t1 = time.perf_counter()
rates = []
for batches in WINDOWS:  # the start window (the batches right after the first), then the steady one
    start, done = time.perf_counter(), 0
    while done < batches and time.perf_counter() - start < MAX_S:
        next(it)
        done += 1
    rates.append((done * 256 / (time.perf_counter() - start), done))
print(json.dumps({{"first_batch_s": t1 - t0, "start_examples_per_s": rates[0][0], "examples_per_s": rates[1][0],
                  "batches_timed": rates[1][1]}}))
"""


def build(work: Path, records: int, shards: int) -> list[str]:
    """TFRecord shards of Examples under work/tfrecord (kept in a --workdir between runs)."""
    from dataset_format import example_proto
    from pipelines import tfrecord

    rng = np.random.default_rng(0)
    per = records // shards
    (work / "tfrecord").mkdir(parents=True)
    for s in range(shards):
        block = rng.integers(32, 96, size=(per, 1000), dtype=np.uint8)
        with open(work / "tfrecord" / f"data-{s:05d}-of-{shards:05d}.tfrecord", "wb") as f:
            tfrecord.write_records(f, (example_proto.encode_example({"data": row.tobytes(), "label": s * per + i})
                                       for i, row in enumerate(block)))
    return sorted(str(p) for p in (work / "tfrecord").iterdir())


def converted(work: Path, compression: str) -> tuple[Path, list[str]]:
    """work/tfrecord converted by our pipeline with `compression` (once per workdir)."""
    from pipelines import ConvertConfig, run_conversion
    from dataset_format.manifest import Manifest

    out = work / f"array_record-{compression.replace(':', '')}"
    if not (out / "manifest.json").exists():
        assert run_conversion(ConvertConfig(input=str(work / "tfrecord" / "*"), output=str(out),
                                            compression=compression)).ok
    return out, Manifest.from_json((out / "manifest.json").read_text()).shard_paths(str(out))


def warm(paths: list[str]) -> None:
    """Reads the files once so every contender starts from the page cache (this VM reclaims it: kdamond)."""
    for path in paths:
        with open(path, "rb") as f:
            while f.read(16 << 20):
                pass


PREVIOUS: dict[str, Path] = {}  # "previous loader" -> the worktree it runs in


def measure(name: str, args: list) -> dict:
    """Runs contender `name` in a child process on the harness arguments `args` (see _HARNESS)."""
    tfrecords, shards, shards_zstd = args[2], args[1], args[-1]
    warm(tfrecords if name == "tf.data" else shards_zstd if name == "ours, zstd:3" else shards)
    code = _HARNESS.format(setup=_CONTENDERS[name])
    # Output goes to files, not pipes: nothing reads a pipe while the child runs, and a chatty child (grain's
    # worker processes log to stderr) would block once the pipe's buffer is full.
    # The arguments go in a file: with a thousand shards their paths exceed the kernel's limit for one argument.
    with tempfile.TemporaryFile("w+") as out_file, tempfile.TemporaryFile("w+") as err_file, \
            tempfile.NamedTemporaryFile("w", suffix=".json") as args_file:
        json.dump(args, args_file)
        args_file.flush()
        proc = subprocess.Popen([sys.executable, "-c", code, args_file.name], cwd=PREVIOUS.get(name, REPO), stdout=out_file,
                                stderr=err_file, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
        root = psutil.Process(proc.pid)
        peak = 0
        while proc.poll() is None:
            try:
                peak = max(peak, sum(p.memory_info().rss for p in [root] + root.children(recursive=True)))
            except psutil.Error:
                pass
            time.sleep(0.05)
        out_file.seek(0)
        err_file.seek(0)
        out, err = out_file.read(), err_file.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{err[-3000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_rss_mb"] = peak / 2**20
    return result


def _line(name: str, decode: bool, r: dict) -> str:
    return (f"  {name:18s} {'decode' if decode else 'raw':6s} {r['examples_per_s']:>10,.0f} ex/s over "
            f"{r['batches_timed']:,.0f} batches (start window {r['start_examples_per_s']:>9,.0f})  first batch "
            f"{r['first_batch_s']:.2f} s  peak RSS {r['peak_rss_mb']:,.0f} MB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--start", type=int, default=400, help="batches timed right after the first (start window)")
    p.add_argument("--batches", type=int, default=2000, help="batches timed after those (steady state)")
    p.add_argument("--max-seconds", type=float, default=20.0, help="a window ends after this long")
    p.add_argument("--threads", type=int, default=0, help="ours: prefetch threads (0: the loader chooses)")
    p.add_argument("--workers", type=int, default=0, help="ours: grain worker processes")
    p.add_argument("--only", nargs="*", default=None, help="run only these contenders")
    p.add_argument("--repeats", type=int, default=1, help="rounds of all contenders; medians and their ratios")
    p.add_argument("--workdir", default=None)
    p.add_argument("--previous", default=None, help="also run the loader of this git revision (a worktree of it)")
    p.add_argument("--first-batch-shards", type=int, default=0,
                   help="also time ours to the first batch on a dataset with this many shards (e.g. 1000)")
    args = p.parse_args()

    from pipelines.config import DEFAULT_COMPRESSION

    work = Path(args.workdir or tempfile.mkdtemp(prefix="loader-bench-"))
    if not (work / "tfrecord").exists():
        print(f"building {args.records:,} records in {args.shards} shards under {work} ...", flush=True)
        build(work, args.records, args.shards)
    tfrecords = sorted(str(p) for p in (work / "tfrecord").iterdir())
    out, shards = converted(work, DEFAULT_COMPRESSION)
    out_zstd, shards_zstd = converted(work, "zstd:3")
    names = [n for n in args.only or list(_CONTENDERS) if n != "previous loader" or args.previous]
    if args.previous:
        PREVIOUS["previous loader"] = revision.checkout(args.previous, work / "previous")
    windows = [args.start, args.batches]
    runs: dict = {}
    for repeat in range(args.repeats):  # the contenders take turns, so drift on the machine hits them all
        for decode in (False, True):
            for name in names:
                r = measure(name, [str(out), shards, tfrecords, decode, windows, args.max_seconds, args.threads,
                                   args.workers, str(out_zstd), shards_zstd])
                runs.setdefault((name, decode), []).append(r)
                print(_line(name, decode, r), flush=True)
    results = {key: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for key, rs in runs.items()}
    print(f"\nmedians of {args.repeats} run(s):" if args.repeats > 1 else "")
    for (name, decode), r in results.items() if args.repeats > 1 else ():
        print(_line(name, decode, r))
    pairs = [(mine, name, decode) for decode in (False, True) for mine in ("ours", "ours, zstd:3") for name in names
             if not name.startswith("ours") and (mine, decode) in runs and (name, decode) in runs]
    for window, key in ((f"steady state, {args.batches} batches", "examples_per_s"),
                        (f"start window, batches 1-{args.start}", "start_examples_per_s")) if pairs else ():
        print(f"ratios, {window}:")
        for mine, name, decode in pairs:
            # the median of each round's ratio: a round's contenders ran minutes apart at most
            ratio = statistics.median(a[key] / b[key] for a, b in zip(runs[(mine, decode)], runs[(name, decode)]))
            print(f"  {mine} / {name} ({'decode' if decode else 'raw'}): {ratio:.2f}x")
    if args.first_batch_shards:
        many = work / f"shards-{args.first_batch_shards}"
        if not (many / "tfrecord").exists():
            build(many, args.first_batch_shards * 100, args.first_batch_shards)
        many_out, many_shards = converted(many, DEFAULT_COMPRESSION)
        many_args = [str(many_out), many_shards, [], False, windows, args.max_seconds, args.threads, args.workers, "",
                     []]
        seq = measure("raw sequential", many_args)
        for name in ["ours"] + (["previous loader"] if args.previous else []):
            r = measure(name, many_args)
            print(f"{name}, {args.first_batch_shards} shards of 100 records: first batch {r['first_batch_s']:.2f} s, "
                  f"{r['examples_per_s']:,.0f} ex/s raw (start window {r['start_examples_per_s']:,.0f}), "
                  f"{r['examples_per_s'] / seq['examples_per_s']:.2f}x raw sequential "
                  f"({seq['examples_per_s']:,.0f} ex/s)")
    if args.previous:
        revision.remove(work / "previous")
    if not args.workdir:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
