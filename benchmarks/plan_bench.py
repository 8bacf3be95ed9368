"""Planning time for many inputs: `make_plan` over N TFRecord shards on a local directory or on gs:// (a local GCS
emulator this script starts), beside the bare listing every plan needs at least.

    .venv/bin/python benchmarks/plan_bench.py --inputs 100000
    .venv/bin/python benchmarks/plan_bench.py --inputs 100000 --gcs

N one-record TFRecord files as inputs; for the later plans N empty outputs with their commit records, then a
manifest of N entries, written directly (not by converting N shards). Locally they are files under a temporary
directory; on gs:// they are seeded into the emulator's store while it is stopped (tests/emulator.py `seed`: its
uploads slow down quadratically), inputs and outputs in two buckets. Timed, in this process:
- listing alone (the anchor): the inputs' names, sizes and times, as os.scandir or google-cloud-storage list them;
- plan, first run: list the inputs, no manifest, no commit records: N tasks;
- convert's staging of those tasks as JSONL (pipelines/tasks.py), which replaced inlining them in the job;
- plan after a crash: N commit records and no manifest (a run killed before its manifest): read every record,
  keep every shard, nothing to convert;
- plan, rerun: the manifest of N entries read, the output listed, all kept.
Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import io
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class _LocalStore:
    """Paths under a temporary directory."""

    def __init__(self):
        self.base = Path(tempfile.mkdtemp(prefix="plan-bench-"))
        atexit.register(shutil.rmtree, self.base, ignore_errors=True)  # (100,000 inputs: ~1 GB)

    def url(self, path: str) -> str:
        return str(self.base / path)

    @staticmethod
    def objects(records: dict[str, tuple[str, dict | None]]) -> dict[str, bytes]:
        """Commit records as files: their text (local files have no custom metadata)."""
        return {path: text.encode() for path, (text, _) in records.items()}

    def put(self, objects: dict[str, bytes]) -> None:
        for path, data in objects.items():
            target = self.base / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)

    @contextlib.contextmanager
    def serving(self):
        yield


class _EmulatorStore:
    """Paths `top/rest` as gs://plan-bench-top/top/rest on a GCS emulator kept on disk, seeded while stopped."""

    def __init__(self):
        sys.path.insert(0, str(REPO))
        from tests import emulator

        self.emulator = emulator
        self.work = Path(tempfile.mkdtemp(prefix="plan-bench-gcloud-"))
        atexit.register(shutil.rmtree, self.work, ignore_errors=True)
        self.buckets: set[str] = set()

    def url(self, path: str) -> str:
        return f"gs://plan-bench-{path.split('/')[0]}/{path}"

    @staticmethod
    def objects(records: dict[str, tuple[str, dict | None]]) -> dict[str, tuple[bytes, dict | None]]:
        """Commit records as objects: their text and custom metadata, as commits.write uploads them."""
        return {path: (text.encode(), metadata) for path, (text, metadata) in records.items()}

    def put(self, objects: dict[str, bytes | tuple]) -> None:
        by_bucket: dict[str, dict[str, bytes | tuple]] = {}
        for path, data in objects.items():
            by_bucket.setdefault(self.url(path)[5:].split("/")[0], {})[path] = data
        new = [b for b in by_bucket if b not in self.buckets]
        if new:  # each new bucket, and one real upload in it: the metadata the seeded objects are made from
            with self.serving():
                from google.cloud import storage as gcs_client

                client = gcs_client.Client(project="test")
                for bucket in new:
                    name = next(iter(by_bucket[bucket]))
                    data = by_bucket[bucket].pop(name)
                    blob = client.create_bucket(bucket).blob(name)
                    blob.metadata = data[1] if isinstance(data, tuple) else None
                    blob.upload_from_string(data[0] if isinstance(data, tuple) else data)
                    self.buckets.add(bucket)
        for bucket, seeded in by_bucket.items():
            self.emulator.seed(self.work, bucket, seeded)

    def serving(self):
        return self.emulator.running(self.work, data_dir=self.work)


def _bare_listing(directory: str) -> int:
    """What any planner must do at least: every input's name, size and modification time, in one listing."""
    if directory.startswith("gs://"):
        from google.cloud import storage as gcs_client

        bucket, prefix = directory[5:].split("/", 1)
        listing = [(b.name, b.size, b.updated) for b in gcs_client.Client(project="test").list_blobs(
            bucket, prefix=prefix + "/")]
    else:
        listing = [(e.path, e.stat().st_size, e.stat().st_mtime) for e in os.scandir(directory)]
    return len(listing)


def _timed(fn):
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--inputs", type=int, default=100_000)
    p.add_argument("--gcs", action="store_true", help="inputs and output on gs:// (a local GCS emulator)")
    args = p.parse_args()

    from dataset_format import storage
    from dataset_format.manifest import MANIFEST_NAME, Manifest, ShardEntry
    from pipelines import commits, tasks as shard_tasks, tfrecord
    from pipelines.config import ConvertConfig
    from pipelines.plan import make_plan
    from pipelines.version import TOOL_VERSION

    n = args.inputs
    store = _EmulatorStore() if args.gcs else _LocalStore()
    one_record = io.BytesIO()
    tfrecord.write_records(one_record, [b"x"])
    store.put({**{f"in/part-{i:07d}.tfrecord": one_record.getvalue() for i in range(n)}, "out/README": b"bench"})
    inputs = store.url("in")
    with store.serving():
        _bare_listing(inputs)  # once untimed: the plans below find the listing warm too
        listed, listing = _timed(lambda: _bare_listing(inputs))
        config = ConvertConfig(input=inputs, output=store.url("out/first"))
        plan, first = _timed(lambda: make_plan(config))
        files, staging = _timed(lambda: shard_tasks.stage(plan.tasks, shard_tasks.local_dir(config.output), "b"))
        shard_tasks.delete_run(shard_tasks.local_dir(config.output), "b")

    config = ConvertConfig(input=inputs, output=store.url("out/run"))
    entries = [ShardEntry(t.relative_path, t.source.path, 1, 0, t.source.size, t.source.fingerprint,
                          config.resolved_writer_options) for t in plan.tasks]
    records = {f"out/run/{commits.COMMITS_DIR}/{e.path}.json": commits.encode(e, ()) for e in entries}
    store.put({**{f"out/run/{e.path}": b"" for e in entries}, **store.objects(records)})
    with store.serving():
        crashed, recovery = _timed(lambda: make_plan(config))
        storage.write_text(storage.join(config.output, MANIFEST_NAME),
                           Manifest(inputs, "tfrecord", tuple(entries), TOOL_VERSION).to_json())
        again, rerun = _timed(lambda: make_plan(config))
    assert listed == len(plan.tasks) == n, (listed, plan.describe())
    assert len(crashed.recovered) == n and not crashed.tasks, crashed.describe()
    assert len(again.kept) == n and not again.tasks, again.describe()

    def line(label: str, seconds: float, note: str = "") -> None:
        ratio = f"; {seconds / listing:.1f}x the listing" if note is None else note
        print(f"  {label:34s} {seconds:6.2f} s ({seconds / n * 1e6:.0f} us an input{ratio})")

    print(f"{n:,} inputs, {'gs:// (GCS emulator)' if args.gcs else 'local directory'}:")
    line("listing alone (anchor):", listing, "")
    line("plan, first run:", first, None)
    print(f"  {'staging the shard list:':34s} {staging:6.2f} s ({len(files)} JSONL files)")
    line("plan after a crash (all recorded):", recovery, None)
    line("plan, rerun (all in the manifest):", rerun, None)


if __name__ == "__main__":
    main()
