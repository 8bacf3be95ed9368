"""Checkpoints in the training loop: each written before the loop goes on (async_checkpointing=false, the anchor)
against each written in orbax's thread while the next steps run (async_checkpointing=true, the default).

Each side runs the real `python -m trainer`, `--repeats` times, interleaved, on the same data and settings:
`--steps` steps with a checkpoint every `--every` (and at the last step). The model is a byte-level transformer_lm
on the text demo corpus (`python -m pipelines make-demo --kind text`, converted by the pipeline), sized by --width
and --depth; its checkpoint holds the parameters and Adam's two moments (12 bytes a parameter).
Reported per run: the loop's time, which is the steps' time (metrics.jsonl: step_time_s over each log period; the
steps of a period while a checkpoint is written in the background are slowed by the writing, on a CPU host) plus the
time the loop was held by checkpoints (the summary's checkpoint_wait_s: the saves, waits for a previous write, and
the last checkpoint's write before the run returns). The ratio: the anchor's loop time over ours.

    .venv/bin/python benchmarks/checkpoint_bench.py                        # ~85M parameters, 1 GB a checkpoint
    .venv/bin/python benchmarks/checkpoint_bench.py --width 512 --heads 8 --depth 4 --steps 12 --every 4 --repeats 1
Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from compile_cache_bench import corpus  # (beside this script): the text demo corpus, converted

REPO = Path(__file__).resolve().parents[1]


def loop_times(data: Path, workdir: Path, args: argparse.Namespace, background: bool) -> tuple[float, float, float]:
    """One `python -m trainer` run: (the steps' time, the time checkpoints held the loop, a checkpoint's bytes)."""
    cmd = [sys.executable, "-m", "trainer", f"data={data}", f"workdir={workdir}", "task=lm", "model=transformer_lm",
           f"seq_len={args.seq_len}", f"width={args.width}", f"depth={args.depth}", f"heads={args.heads}",
           f"batch_size={args.batch_size}", f"steps={args.steps}", f"log_every={args.every}",
           f"checkpoint_every={args.every}", "compilation_cache=none", f"async_checkpointing={str(background).lower()}"]
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        sys.exit(f"the trainer failed ({' '.join(cmd[3:])}):\n{proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout)["summary"]
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    steps, previous = 0.0, 0
    for row in rows:
        steps += row["step_time_s"] * (row["step"] - previous)
        previous = row["step"]
    latest = max((workdir / "checkpoints").iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else -1)
    size = sum(f.stat().st_size for f in latest.rglob("*") if f.is_file())
    return steps, summary["checkpoint_wait_s"], size


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=10, help="steps between checkpoints (and log lines)")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    sides = {"anchor (async_checkpointing=false)": False, "ours (async_checkpointing=true)": True}
    results: dict[str, list[tuple[float, float, float]]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        print("converting the text demo corpus ...", flush=True)
        data = corpus(root, max_mb=1)
        for repeat in range(args.repeats):
            for side, background in sides.items():
                workdir = root / f"{int(background)}-{repeat}"
                steps, held, size = loop_times(data, workdir, args, background)
                results[side].append((steps, held, size))
                print(f"{side}: steps {steps:.1f} s + held by checkpoints {held:.1f} s = loop {steps + held:.1f} s "
                      f"({size / 1e6:,.0f} MB a checkpoint)", flush=True)
    saves = -(-args.steps // args.every)
    print(f"\nLM width {args.width} depth {args.depth} seq {args.seq_len} batch {args.batch_size}, {args.steps} steps, "
          f"{saves} checkpoints; {platform.machine()} {os.cpu_count()} cores; medians of {args.repeats}")
    loops = {}
    for side, runs in results.items():
        steps = statistics.median(r[0] for r in runs)
        held = statistics.median(r[1] for r in runs)
        loops[side] = statistics.median(r[0] + r[1] for r in runs)
        print(f"{side}: loop {loops[side]:.1f} s (steps {steps:.1f} s, held {held:.1f} s: {held / saves:.2f} s a "
              "checkpoint)")
    anchor, ours = loops.values()
    print(f"loop time: {anchor:.1f} s -> {ours:.1f} s ({anchor / ours:.2f}x)")


if __name__ == "__main__":
    main()
