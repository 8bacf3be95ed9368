"""Trainer benchmark: steps/s and data-wait with the loader, against the same run on batches already in memory.

    .venv/bin/python benchmarks/trainer_bench.py                 # demo CNN on digits + a larger CNN on 32x32 data
    .venv/bin/python benchmarks/trainer_bench.py --steps 200     # quicker

Builds two datasets with our own pipeline (TFRecord of tf.train.Example -> `python -m pipelines convert`):
- demo: scikit-learn's digits (8x8), the README's demo model (`model=cnn`, ~0.3M parameters);
- larger: synthetic 32x32 images (`--records`, default 32,768, 8 shards), `model=cnn` (~0.5M parameters,
  16x the activations per example).

Each runs the real `python -m trainer` twice, interleaved: with the loader (`in_memory_batches=0`: read,
shuffle, decode, device-prefetch) and with `in_memory_batches=16` (16 batches read once, kept on the devices
and cycled: no input cost, the input-bound limit). Reported per run from WORKDIR/metrics.jsonl, log periods
after the first (compilation) only: steps/s, the data-wait fraction (time blocked on `next(batch)` with no step
running: the devices idle for want of input) and the host wait (all time blocked on `next(batch)`, also while a
step still runs). Ratios: loader steps/s / in-memory steps/s. Target: data-wait < 2% of step time.
Without an accelerator the runs use 8 simulated CPU devices (`strategy=mirrored`), as the demo does.
Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def _convert(tfrecords: str, output: Path) -> None:
    subprocess.run([sys.executable, "-m", "pipelines", "convert", "--input", tfrecords, "--output", str(output)],
                   check=True, cwd=REPO, capture_output=True)


def build_demo(work: Path) -> Path:
    from pipelines.demo import write_digits_tfrecords

    write_digits_tfrecords(str(work / "digits-tfrecord"), num_shards=4)
    _convert(str(work / "digits-tfrecord" / "digits-train*"), work / "digits")
    return work / "digits"


def build_larger(work: Path, records: int, shards: int) -> Path:
    from dataset_format import example_proto
    from pipelines import tfrecord

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, records)
    # Learnable: each class is a noisy copy of its own random prototype.
    prototypes = rng.integers(0, 256, (10, 32 * 32))
    (work / "synthetic-tfrecord").mkdir(parents=True, exist_ok=True)  # (a --workdir of an earlier run: written anew)
    for shard, index in enumerate(np.array_split(np.arange(records), shards)):
        path = work / "synthetic-tfrecord" / f"synthetic-train.tfrecord-{shard:05d}-of-{shards:05d}"
        noise = rng.integers(-40, 40, (len(index), 32 * 32))
        images = np.clip(prototypes[labels[index]] + noise, 0, 255)
        with open(path, "wb") as f:
            tfrecord.write_records(f, (example_proto.encode_example({"image": images[j], "label": labels[i]})
                                       for j, i in enumerate(index)))
    _convert(str(work / "synthetic-tfrecord" / "*"), work / "synthetic")
    return work / "synthetic"


def run_trainer(data: Path, workdir: Path, steps: int, log_every: int, batch_size: int, in_memory: int,
                env: dict, data_workers: int = 0) -> dict:
    cmd = [sys.executable, "-m", "trainer", f"data={data}", f"workdir={workdir}", "model=cnn", "num_classes=10",
           "strategy=mirrored",
           f"steps={steps}", f"batch_size={batch_size}", f"log_every={log_every}", f"eval_every={steps}",
           f"checkpoint_every={10 * steps}", f"in_memory_batches={in_memory}", "learning_rate=0.002",
           f"data_workers={data_workers}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    periods = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()][1:]
    step_time = statistics.median(p["step_time_s"] for p in periods)
    return {"steps_per_sec": 1 / step_time, "data_wait": statistics.mean(p["data_wait_fraction"] for p in periods),
            "host_wait": statistics.mean(p["host_wait_fraction"] for p in periods)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--records", type=int, default=32_768)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2, help="loader/in-memory pairs per model, interleaved")
    p.add_argument("--data-workers", type=int, default=0, help="trainer data_workers= (loader processes)")
    p.add_argument("--workdir", default=None)
    args = p.parse_args()

    env = dict(os.environ)
    import jax

    if jax.default_backend() == "cpu":
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
        where = "8 simulated CPU devices"
    else:
        where = f"{jax.device_count()} x {jax.devices()[0].device_kind}"
    work = Path(args.workdir or tempfile.mkdtemp(prefix="trainer-bench-"))
    if not args.workdir:
        atexit.register(shutil.rmtree, work, ignore_errors=True)
    print(f"building data in {work} ...", flush=True)
    datasets = {"demo (digits 8x8, cnn)": build_demo(work),
                f"larger (synthetic 32x32, {args.records:,} records, cnn)": build_larger(work, args.records, args.shards)}

    print(f"strategy=mirrored on {where}; batch {args.batch_size}; {args.steps} steps, log every {args.log_every} "
          "(first period = compilation, dropped)\n")
    print("| model | input | steps/s | examples/s | data-wait | host wait |\n| --- | --- | ---: | ---: | ---: | ---: |")
    results = {}
    for name, data in datasets.items():
        runs = {"loader": [], "in memory": []}
        for r in range(args.repeats):
            for mode, cached in (("loader", 0), ("in memory", 16)):
                out = run_trainer(data, work / f"run-{len(results)}-{mode.replace(' ', '_')}-{r}", args.steps,
                                  args.log_every, args.batch_size, cached, env, args.data_workers)
                runs[mode].append(out)
        for mode, outs in runs.items():
            sps = statistics.median(o["steps_per_sec"] for o in outs)
            wait = statistics.median(o["data_wait"] for o in outs)
            host = statistics.median(o["host_wait"] for o in outs)
            print(f"| {name} | {mode} | {sps:.1f} | {sps * args.batch_size:,.0f} | {100 * wait:.2f}% | {100 * host:.2f}% |",
                  flush=True)
        results[name] = runs
    print()
    for name, runs in results.items():
        loader_sps = statistics.median(o["steps_per_sec"] for o in runs["loader"])
        memory_sps = statistics.median(o["steps_per_sec"] for o in runs["in memory"])
        wait = statistics.median(o["data_wait"] for o in runs["loader"])
        print(f"{name}: loader / in-memory steps/s = {loader_sps / memory_sps:.2f}x; data-wait with the loader "
              f"{100 * wait:.2f}% (target < 2%: {'met' if wait < 0.02 else 'NOT met'})")


if __name__ == "__main__":
    main()
