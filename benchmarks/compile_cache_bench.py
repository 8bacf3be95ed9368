"""A restarted run's start: compiling its step again (compilation_cache=none, the anchor) against reading it from
the persistent compilation cache the first run wrote (compilation_cache=auto: WORKDIR/compilation_cache).

Each side runs the real `python -m trainer` twice in one workdir: a first run of `--steps` steps, then a restart to
twice as many (it resumes from the first run's checkpoint, as a preempted run's restart does). Reported per side,
from the restart's log: the step's compile (or cache read) time, and the restart's wall time from its start to its
end. The model is a byte-level transformer_lm on the text demo corpus (`python -m pipelines make-demo --kind text`,
converted by the pipeline), sized by --width/--depth/--seq-len.

    .venv/bin/python benchmarks/compile_cache_bench.py                  # width 512, depth 6, seq 512
    .venv/bin/python benchmarks/compile_cache_bench.py --width 1024 --depth 8 --seq-len 1024 --batch-size 8
Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_STEP = re.compile(r"step (compiled|read from the compilation cache) in ([\d.]+) s")


def corpus(root: Path, max_mb: float | None = None) -> Path:
    """The text demo corpus (`max_mb` of it: make-demo's default when None), converted: a byte-level LM's training
    data."""
    def run(*args):
        subprocess.run([sys.executable, "-m", "pipelines", *args], check=True, cwd=REPO, capture_output=True)

    run("make-demo", "--kind", "text", "--output", str(root / "text"),
        *(["--max_mb", str(max_mb)] if max_mb is not None else []))
    run("convert", "--input", str(root / "text" / "text-train.*"), "--output", str(root / "train"))
    return root / "train"


def trainer(data: Path, workdir: Path, steps: int, args: argparse.Namespace, cache: str) -> tuple[str, float, float]:
    """One `python -m trainer` run: how its step came (compiled, or read from the cache), in how many seconds, and
    the run's wall time."""
    cmd = [sys.executable, "-m", "trainer", f"data={data}", f"workdir={workdir}", "task=lm", "model=transformer_lm",
           "packing=true", f"seq_len={args.seq_len}", f"width={args.width}", f"depth={args.depth}",
           f"heads={args.heads}", f"batch_size={args.batch_size}", "dtype=bfloat16", f"steps={steps}",
           f"log_every={steps}", f"checkpoint_every={steps}", f"compilation_cache={cache}"]
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t
    if proc.returncode:
        sys.exit(f"the trainer failed ({' '.join(cmd[3:])}):\n{proc.stderr[-3000:]}")
    found = _STEP.search(proc.stderr)
    if not found:
        sys.exit(f"no 'step compiled' line in the trainer's log:\n{proc.stderr[-3000:]}")
    return found.group(1), float(found.group(2)), wall


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=2, help="the first run's steps (the restart runs as many more)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        print("converting the text demo corpus ...", flush=True)
        data = corpus(root)
        rows = {}
        for side, cache in (("anchor (compilation_cache=none)", "none"), ("ours (compilation_cache=auto)", "auto")):
            workdir = root / cache
            first = trainer(data, workdir, args.steps, args, cache)
            restart = trainer(data, workdir, 2 * args.steps, args, cache)
            rows[side] = (first, restart)
            print(f"{side}: first run: step {first[0]} in {first[1]:.1f} s, run {first[2]:.1f} s; restart: step "
                  f"{restart[0]} in {restart[1]:.1f} s, run {restart[2]:.1f} s", flush=True)
        (_, anchor), (_, ours) = rows.values()
        if ours[0] != "read from the compilation cache":
            sys.exit("the restart compiled its step again: the cache did not serve it")
    print(f"\nLM width {args.width} depth {args.depth} seq {args.seq_len} batch {args.batch_size}, bf16, "
          f"{platform.machine()} {os.cpu_count()} cores")
    print(f"restart's step: {anchor[1]:.1f} s compiled -> {ours[1]:.2f} s from the cache "
          f"({anchor[1] / max(ours[1], 1e-3):.0f}x); restart's run: {anchor[2]:.1f} s -> {ours[2]:.1f} s "
          f"({anchor[2] / ours[2]:.2f}x)")


if __name__ == "__main__":
    main()
