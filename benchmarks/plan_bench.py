"""Planning time for many inputs: `make_plan` over a directory of N TFRecord shards, first run and rerun.

    .venv/bin/python benchmarks/plan_bench.py --inputs 100000

Writes N small TFRecord files (one record each) into a temporary directory, then times, in this process:
- plan (first run): list the inputs, read no manifest (none yet), build N tasks;
- convert's staging of those tasks as JSONL (pipelines/tasks.py), which replaced inlining them in the job;
- plan (rerun, all up to date): list the inputs, read the manifest of N entries, list the output, keep all.
The manifest for the rerun is written directly (N entries matching the inputs), not by converting N shards.
Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--inputs", type=int, default=100_000)
    args = p.parse_args()

    from dataset_format import storage
    from dataset_format.manifest import MANIFEST_NAME, Manifest, ShardEntry
    from pipelines import tasks as shard_tasks, tfrecord
    from pipelines.config import ConvertConfig
    from pipelines.plan import make_plan
    from pipelines.version import TOOL_VERSION

    root = Path(tempfile.mkdtemp(prefix="plan-bench-"))
    (root / "in").mkdir()
    started = time.perf_counter()
    for i in range(args.inputs):
        with open(root / "in" / f"part-{i:07d}.tfrecord", "wb") as f:
            tfrecord.write_records(f, [b"x"])
    print(f"wrote {args.inputs:,} inputs in {time.perf_counter() - started:.1f} s")

    config = ConvertConfig(input=str(root / "in"), output=str(root / "out"))
    started = time.perf_counter()
    plan = make_plan(config)
    first = time.perf_counter() - started
    started = time.perf_counter()
    files = shard_tasks.stage(plan.tasks, shard_tasks.local_dir(config.output), "bench")
    staging = time.perf_counter() - started

    (root / "out").mkdir(exist_ok=True)
    entries = []
    for task in plan.tasks:
        (root / "out" / task.relative_path).write_bytes(b"")
        entries.append(ShardEntry(task.relative_path, task.source.path, 1, 0, task.source.size,
                                  task.source.fingerprint, config.resolved_writer_options))
    storage.write_text(str(root / "out" / MANIFEST_NAME),
                       Manifest(config.input, "tfrecord", tuple(entries), TOOL_VERSION).to_json())
    started = time.perf_counter()
    again = make_plan(config)
    rerun = time.perf_counter() - started
    assert len(plan.tasks) == args.inputs and len(again.kept) == args.inputs and not again.tasks
    print(f"{args.inputs:,} inputs, local directory:")
    print(f"  plan, first run:            {first:6.2f} s ({first / args.inputs * 1e6:.0f} us an input)")
    print(f"  staging the shard list:     {staging:6.2f} s ({len(files)} JSONL files)")
    print(f"  plan, rerun (all kept):     {rerun:6.2f} s ({rerun / args.inputs * 1e6:.0f} us an input)")


if __name__ == "__main__":
    main()
