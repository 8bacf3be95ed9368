"""Image benchmark: JPEG decode + random-resized crop + flip, ours against tf.data, grain's stock pipeline and a bare
loop, on the same records and the same cores, in one run.

    .venv/bin/python benchmarks/image_bench.py                          # 3,000 photos, 1 and 2 cores
    .venv/bin/python benchmarks/image_bench.py --images 1000 --cores 1  # quicker
    .venv/bin/python benchmarks/image_bench.py --decoders               # also: each decoder alone, one thread

Data: ImageNet-like JPEGs (`pipelines.demo.photo_jpegs`: crops of the two real photos scikit-learn ships, short
side 300-500 px, quality 90, ~50 KB) in the ImageNet TFRecord layout (`image/encoded`, `image/class/label`),
converted by our pipeline to ArrayRecord. Every contender yields uint8 [128, 224, 224, 3] batches of an Inception
crop (8-100% of the area, aspect 3:4-4:3) resized to 224, flipped at random, with the labels:

- tf.data: TFRecordDataset over the shards (interleaved), `shuffle(10_000)`, `parse_single_example`,
  `sample_distorted_bounding_box` + `decode_and_crop_jpeg` (decodes only the crop window), `resize` (bilinear),
  `random_flip_left_right`, `batch`, everything AUTOTUNE;
- grain stock: `MapDataset.source(ArrayRecordDataSource(shards)).shuffle(seed)`, our Example decode, `random_map`
  with the same crop as ours (loader.decoding.images), `batch`, `to_iter_dataset` (2 threads and 4 batches ahead a
  worker: grain's default of 500 batches ahead held ~10 GB a worker here), `mp_prefetch` with one worker a core;
- bare loop: one thread decoding and cropping the records (already in memory) in a Python loop: the rate times the
  cores is what perfect scaling would reach;
- ours: `loader.load(dir, random_map_fn=images.RandomResizedCrop("image/encoded", 224))`, threads = cores, no
  worker processes; "ours, workers" with one worker process a core; "ours, Ray actors" with one Ray actor a core,
  on a Ray node the contender starts on its cores (the batches come back through Ray's object store); and "ours, 1
  core + Ray actors on the rest": this process on the first core, a Ray node with actors on the others (compare
  with "ours" on 1 core: what workers elsewhere add when the host's own cores are taken).

Each contender runs in its own process, pinned to the first K cores (`sched_setaffinity`) for each K in `--cores`.
Reported: images/s over `--batches` batches after `--skip` (steady state), images/s per core, ratios to
tf.data, grain stock and the bare loop x cores, and the CPU the contender's own process spent a batch (with
workers: taking the batches from them, the transport's cost on the training host). Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIZE = 224
BATCH = 128

# Each contender: code that defines `batches` (an iterator of (images, labels) or dicts), run in a fresh process.
CONTENDERS = {
    "tf.data": """
import tensorflow as tf
tf.random.set_seed(0)
spec = {"image/encoded": tf.io.FixedLenFeature([], tf.string), "image/class/label": tf.io.FixedLenFeature([], tf.int64)}
def augment(record):
    ex = tf.io.parse_single_example(record, spec)
    data = ex["image/encoded"]
    shape = tf.io.extract_jpeg_shape(data)
    begin, size, _ = tf.image.sample_distorted_bounding_box(
        shape, tf.zeros([0, 0, 4], tf.float32), area_range=(0.08, 1.0), aspect_ratio_range=(3 / 4, 4 / 3),
        max_attempts=10, use_image_if_no_bounding_boxes=True)
    window = tf.stack([begin[0], begin[1], size[0], size[1]])
    image = tf.image.decode_and_crop_jpeg(data, window, channels=3)
    image = tf.image.resize(image, [SIZE, SIZE], method="bilinear")
    image = tf.image.random_flip_left_right(image)
    return tf.cast(image, tf.uint8), ex["image/class/label"]
files = tf.data.Dataset.from_tensor_slices(TFRECORDS).shuffle(len(TFRECORDS), seed=0).repeat()
ds = files.interleave(tf.data.TFRecordDataset, cycle_length=len(TFRECORDS), num_parallel_calls=tf.data.AUTOTUNE)
ds = ds.shuffle(10_000, seed=0).map(augment, num_parallel_calls=tf.data.AUTOTUNE).batch(BATCH)
batches = iter(ds.prefetch(tf.data.AUTOTUNE).as_numpy_iterator())
""",
    "grain stock": """
import grain, numpy as np
from absl import flags
flags.FLAGS.mark_as_parsed()
from loader.decoding import images
from loader.decoding.decode import ExampleDecoder
decode = ExampleDecoder(("image/encoded", "image/class/label"))
crop = images.RandomResizedCrop("image/encoded", size=SIZE)
class Crop(grain.transforms.RandomMap):
    def random_map(self, record, rng):
        out = crop(decode(record), rng)
        return {"image": out["image"], "label": out["image/class/label"]}
ds = (grain.MapDataset.source(grain.sources.ArrayRecordDataSource(SHARDS)).shuffle(seed=0).repeat()
      .random_map(Crop(), seed=0).batch(BATCH)
      .to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=4))
      .mp_prefetch(grain.MultiprocessingOptions(num_workers=CORES)))
batches = iter(ds)
""",
    "bare loop": """
import numpy as np
from loader.decoding import images
from loader.decoding.decode import ExampleDecoder
from loader.fetch.reader import BatchReader
from loader.format.source import resolve
source = resolve(OUT)
records = BatchReader(source)(np.arange(len(source)))
decode = ExampleDecoder(("image/encoded", "image/class/label"))
data = [decode(r) for r in records]
def loop():
    rng = np.random.default_rng(0)
    while True:
        for start in range(0, len(data) - BATCH + 1, BATCH):
            out = [images.random_resized_crop(d["image/encoded"], rng, SIZE) for d in data[start:start + BATCH]]
            yield np.stack(out)
batches = loop()
""",
    "ours": """
import loader
from loader.decoding import images
batches = iter(loader.load(OUT, batch_size=BATCH, seed=0, num_threads=CORES,
                           random_map_fn=images.RandomResizedCrop("image/encoded", size=SIZE)))
""",
    "ours, workers": """
import loader
from loader.decoding import images
batches = iter(loader.load(OUT, batch_size=BATCH, seed=0, worker_count=CORES,
                           random_map_fn=images.RandomResizedCrop("image/encoded", size=SIZE)))
""",
    "ours, Ray actors": """
import ray, loader
from loader.decoding import images
# A Ray node started by this process (on its cores): its actors are separate processes, the batches come back
# through the object store.
ray.init(address="local", num_cpus=CORES, include_dashboard=False, object_store_memory=2 << 30, logging_level="ERROR")
batches = iter(loader.load(OUT, batch_size=BATCH, seed=0, worker_count=CORES, ray_address="local",
                           random_map_fn=images.RandomResizedCrop("image/encoded", size=SIZE)))
def cleanup():
    ray.shutdown()
""",
    "ours, 1 core + Ray actors on the rest": """
import os, ray, loader
from loader.decoding import images
# The trainer's process on the first core, a Ray node (its actors) on the others: what workers on other machines
# add to a host whose own cores are busy. Compare with "ours" on 1 core.
os.sched_setaffinity(0, set(range(1, CORES)))
ray.init(address="local", num_cpus=CORES - 1, include_dashboard=False, object_store_memory=2 << 30,
         logging_level="ERROR")
os.sched_setaffinity(0, {0})
batches = iter(loader.load(OUT, batch_size=BATCH, seed=0, worker_count=CORES - 1, ray_address="local",
                           random_map_fn=images.RandomResizedCrop("image/encoded", size=SIZE)))
def cleanup():
    ray.shutdown()
""",
}

RUNNER = """
import json, os, sys, time
os.sched_setaffinity(0, set(range({cores})))
SIZE, BATCH, CORES = {size}, {batch}, {cores}
OUT, SHARDS, TFRECORDS = {out!r}, {shards!r}, {tfrecords!r}
{code}
def count(batch):
    first = batch[0] if isinstance(batch, tuple) else batch["image"] if isinstance(batch, dict) else batch
    assert first.shape == (BATCH, SIZE, SIZE, 3) and first.dtype.name == "uint8", (first.shape, first.dtype)
    return len(first)
for _ in range({skip}):
    count(next(batches))
t0, c0, n = time.perf_counter(), time.process_time(), 0
for _ in range({batches}):
    n += count(next(batches))
print(json.dumps({{"images_per_s": n / (time.perf_counter() - t0),
                  "main_cpu_ms_per_batch": (time.process_time() - c0) / {batches} * 1e3}}))
sys.stdout.flush()
globals().get("cleanup", lambda: None)()  # processes of its own session (a Ray node) end with it
os.killpg(0, 9)  # this process and every worker it started (a stock grain worker outlives an os._exit)
"""

DECODERS = """
import io, json, time, numpy as np
from loader.decoding.decode import ExampleDecoder
from loader.fetch.reader import BatchReader
from loader.format.source import resolve
source = resolve({out!r})
decode = ExampleDecoder(("image/encoded",))
data = [decode(r)["image/encoded"] for r in BatchReader(source)(np.arange(min(len(source), 600)))]
def simplejpeg_decode(d):
    import simplejpeg
    return simplejpeg.decode_jpeg(d, fastdct=True, fastupsample=True)
def opencv_decode(d):
    import cv2
    cv2.setNumThreads(1)
    return cv2.cvtColor(cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
def pillow_decode(d):
    from PIL import Image
    return np.asarray(Image.open(io.BytesIO(d)).convert("RGB"))
def tf_decode(d):
    import tensorflow as tf
    return tf.io.decode_jpeg(d, channels=3).numpy()
out = {{}}
for name, fn in [("simplejpeg", simplejpeg_decode), ("opencv", opencv_decode), ("pillow", pillow_decode),
                 ("tf.io.decode_jpeg", tf_decode)]:
    fn(data[0])
    t0 = time.perf_counter()
    for d in data:
        fn(d)
    out[name] = len(data) / (time.perf_counter() - t0)
print(json.dumps(out))
"""


def prepare(work: Path, count: int) -> tuple[Path, list[str], list[str]]:
    """TFRecord photos in `work/in` and their conversion in `work/out` (reused when already there)."""
    from pipelines import ConvertConfig, run_conversion
    from pipelines.demo import write_photo_tfrecords

    inp, out = work / f"in-{count}", work / f"out-{count}"
    if not inp.exists():
        print(f"writing {count} JPEG photos as TFRecords ...", flush=True)
        tmp = work / "in-tmp"
        write_photo_tfrecords(str(tmp), count, num_shards=8)
        tmp.rename(inp)
    if not (out / "manifest.json").exists():
        print("converting to ArrayRecord ...", flush=True)
        assert run_conversion(ConvertConfig(input=str(inp / "*"), output=str(out)), ["--direct_num_workers=1"]).ok
    shards = sorted(str(p) for p in out.glob("*.array_record*"))
    tfrecords = sorted(str(p) for p in inp.glob("photos-*"))
    return out, shards, tfrecords


def run(code: str, timeout: float = 900) -> dict:
    """Runs `code` in a new process group (its own session), which it ends with SIGKILL once it has printed."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=timeout,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}, start_new_session=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode not in (0, -9) or not lines:
        raise RuntimeError(f"contender failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=3000)
    p.add_argument("--cores", type=int, nargs="+", default=[1, 2], help="core counts to pin each contender to")
    p.add_argument("--batches", type=int, default=40, help="batches timed (after --skip)")
    p.add_argument("--skip", type=int, default=8, help="batches read before timing (start-up, ramp)")
    p.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    p.add_argument("--decoders", action="store_true", help="also time each decoder alone, one thread")
    p.add_argument("--workdir", default="/tmp/image-bench")
    args = p.parse_args()
    available = len(os.sched_getaffinity(0))
    if max(args.cores) > available:
        p.error(f"--cores {max(args.cores)} is more than the {available} cores this process may use")
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    out, shards, tfrecords = prepare(work, args.images)
    print(f"{args.images} photos, {sum(os.path.getsize(t) for t in tfrecords) / args.images / 1e3:.0f} KB each on "
          f"average; {args.batches} batches of {BATCH} timed after {args.skip}; cpu: {_cpu()}")
    if args.decoders:
        rates = run(DECODERS.format(out=str(out)))
        print("decode alone, one thread: " + ", ".join(f"{k} {v:,.0f} img/s" for k, v in rates.items()))
    results: dict[tuple[str, int], float] = {}
    main_cpu: dict[tuple[str, int], float] = {}  # CPU of the contender's own process (its threads), ms a batch
    for cores in args.cores:
        for name in args.contenders:
            if name.endswith("on the rest") and cores < 2:
                continue  # it needs a core beside the first
            code = RUNNER.format(cores=cores, size=SIZE, batch=BATCH, out=str(out), shards=shards, tfrecords=tfrecords,
                                 code=CONTENDERS[name], skip=args.skip, batches=args.batches)
            measured = run(code)
            results[name, cores] = measured["images_per_s"]
            main_cpu[name, cores] = measured["main_cpu_ms_per_batch"]
            alone = name == "bare loop"  # one thread on one core, whatever the cores: x cores in the table
            print(f"  {cores} core(s)  {name:14s} {results[name, cores]:8,.0f} img/s  "
                  f"({results[name, cores] / (1 if alone else cores):,.0f} per core{', one thread' if alone else ''})",
                  flush=True)
    workers = "ours, workers" in args.contenders
    print("\n| cores | contender | images/s | per core | ours / it |" + (" ours, workers / it |" if workers else "")
          + " main process CPU, ms a batch |")
    print("|---|---|---|---|---|" + ("---|" if workers else "") + "---|")
    for cores in args.cores:
        ours, ours_workers = results.get(("ours", cores)), results.get(("ours, workers", cores))
        for name in args.contenders:
            if (name, cores) not in results:
                continue
            rate = results[name, cores]
            ceiling = rate * cores if name == "bare loop" else rate
            ratio = f"{ours / ceiling:.2f}x" if ours and name != "ours" else ""
            label = f"{name} x {cores} cores" if name == "bare loop" and cores > 1 else name
            by_workers = (f" {ours_workers / ceiling:.2f}x |" if ours_workers and not name.startswith("ours") else
                          " |") if workers else ""
            print(f"| {cores} | {label} | {ceiling:,.0f} | {ceiling / cores:,.0f} | {ratio} |{by_workers} "
                  f"{main_cpu[name, cores]:,.0f} |")
    if len(args.cores) > 1 and ("ours", args.cores[0]) in results:
        lo, hi = args.cores[0], args.cores[-1]
        for name in args.contenders:
            if name == "bare loop":
                continue  # one thread at any core count: the table counts it x cores
            if (name, lo) in results and (name, hi) in results:
                print(f"scaling {lo} -> {hi} cores, {name}: {results[name, hi] / results[name, lo]:.2f}x")
            elif (name, hi) in results and ("ours", lo) in results:
                print(f"{name} ({hi} cores) against ours on {lo}: {results[name, hi] / results['ours', lo]:.2f}x")


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        model = "unknown"
    return f"{model}, {os.cpu_count()} cores"


if __name__ == "__main__":
    main()
