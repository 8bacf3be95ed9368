"""Planning time for many inputs: `make_plan` over N TFRecord shards, first run and rerun, on a local directory or
on gs:// (a local GCS emulator this script starts).

    .venv/bin/python benchmarks/plan_bench.py --inputs 100000
    .venv/bin/python benchmarks/plan_bench.py --inputs 100000 --gcs

Writes N small TFRecord files (one record each) under BASE/in (a temporary directory, or a bucket on the emulator),
then times, in this process:
- plan (first run): list the inputs, read no manifest (none yet), build N tasks;
- convert's staging of those tasks as JSONL (pipelines/tasks.py), which replaced inlining them in the job;
- plan (rerun, all up to date): list the inputs, read the manifest of N entries, list the output, keep all.
The manifest for the rerun, and N empty output files, are written directly, not by converting N shards.
Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


@contextlib.contextmanager
def _base(gcs: bool):
    """BASE: a temporary local directory, or a fresh bucket on an emulator started for the run."""
    if not gcs:
        yield tempfile.mkdtemp(prefix="plan-bench-")
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests import emulator

    with emulator.running(Path(tempfile.mkdtemp(prefix="plan-bench-gcloud-"))):
        from google.cloud import storage as gcs_client

        gcs_client.Client(project="test").create_bucket("plan-bench")
        yield "gs://plan-bench"


def _write_all(paths: list[str], data: bytes) -> float:
    """Writes `data` to every path (4 threads: uploads are round trips; the emulator drops connections at 16);
    returns the seconds taken."""
    from dataset_format import storage

    started = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: storage.write_bytes(p, data), paths))
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--inputs", type=int, default=100_000)
    p.add_argument("--gcs", action="store_true", help="inputs and output on gs:// (a local GCS emulator)")
    args = p.parse_args()

    import io

    from dataset_format import storage
    from dataset_format.manifest import MANIFEST_NAME, Manifest, ShardEntry
    from pipelines import tasks as shard_tasks, tfrecord
    from pipelines.config import ConvertConfig
    from pipelines.plan import make_plan
    from pipelines.version import TOOL_VERSION

    one_record = io.BytesIO()
    tfrecord.write_records(one_record, [b"x"])
    with _base(args.gcs) as base:
        inputs = [storage.join(base, f"in/part-{i:07d}.tfrecord") for i in range(args.inputs)]
        print(f"wrote {args.inputs:,} inputs in {_write_all(inputs, one_record.getvalue()):.1f} s")

        config = ConvertConfig(input=storage.join(base, "in"), output=storage.join(base, "out"))
        started = time.perf_counter()
        plan = make_plan(config)
        first = time.perf_counter() - started
        started = time.perf_counter()
        files = shard_tasks.stage(plan.tasks, shard_tasks.local_dir(config.output), "bench")
        staging = time.perf_counter() - started
        shard_tasks.delete_run(shard_tasks.local_dir(config.output), "bench")

        _write_all([storage.join(config.output, t.relative_path) for t in plan.tasks], b"")
        entries = [ShardEntry(t.relative_path, t.source.path, 1, 0, t.source.size, t.source.fingerprint,
                              config.resolved_writer_options) for t in plan.tasks]
        storage.write_text(storage.join(config.output, MANIFEST_NAME),
                           Manifest(config.input, "tfrecord", tuple(entries), TOOL_VERSION).to_json())
        started = time.perf_counter()
        again = make_plan(config)
        rerun = time.perf_counter() - started
    assert len(plan.tasks) == args.inputs and len(again.kept) == args.inputs and not again.tasks, again.describe()
    print(f"{args.inputs:,} inputs, {'gs:// (GCS emulator)' if args.gcs else 'local directory'}:")
    print(f"  plan, first run:            {first:6.2f} s ({first / args.inputs * 1e6:.0f} us an input)")
    print(f"  staging the shard list:     {staging:6.2f} s ({len(files)} JSONL files)")
    print(f"  plan, rerun (all kept):     {rerun:6.2f} s ({rerun / args.inputs * 1e6:.0f} us an input)")


if __name__ == "__main__":
    main()
