"""Caching a gs:// dataset larger than the cache: bytes downloaded and records/s with no cache, a memory cache
(`cache_bytes=`) and a disk cache (`cache_dir=`, `cache_bytes=`), over several epochs and then a restarted job, in
one run through a shaped link.

    .venv/bin/python benchmarks/disk_cache_bench.py [--record-kb 1,100] [--dataset-mb 48] [--cache-share 0.5]
                                                    [--epochs 3] [--latency-ms 20] [--mbps 100]

The link and the shards are benchmarks/gcs_read_bench.py's (a GCS emulator behind tests/shaped_link.py: each answer
held `--latency-ms`, `--mbps` shared among answers; 8 shards of random records, group_size:1, uncompressed). For
each record size, each contender reads `--epochs` shuffled epochs with one loader (`loader.load(..., seed=0,
decode=None, num_epochs=E)`), then a new loader reads one epoch, as a job restarted on the same host (or a second
job beside it) would. The caches hold `--cache-share` of the dataset's bytes; the anchor is the same loader on the
shards staged on local disk. Reported: records/s, GET requests, the bytes the link sent / the bytes of the records
served, and the disk the cache took.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gcs_read_bench  # benchmarks/gcs_read_bench.py: the shaped link and the shards


def read(data: str, epochs: int, options: dict) -> tuple[int, float, object]:
    """(records, seconds, the loader) for `epochs` epochs of `data`."""
    import loader

    ours = loader.load(data, num_epochs=epochs, **options)
    started = time.perf_counter()
    records = sum(len(batch) for batch in ours)
    return records, time.perf_counter() - started, ours


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--record-kb", default="1,100", help="record sizes in KB, comma-separated")
    p.add_argument("--dataset-mb", type=float, default=48, help="the dataset's size in MB, for each record size")
    p.add_argument("--cache-share", type=float, default=0.5, help="the caches' size, as a share of the dataset")
    p.add_argument("--epochs", type=int, default=3, help="epochs read by one loader, before the restart")
    p.add_argument("--latency-ms", type=float, default=20, help="the latency a request, ms")
    p.add_argument("--mbps", type=float, default=100, help="the link's bandwidth, MB/s (0: none)")
    p.add_argument("--batch-size", type=int, default=256, help="records a batch, for records up to 10 KB")
    p.add_argument("--image-batch-size", type=int, default=32, help="records a batch, for larger records")
    args = p.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests import emulator

    root = Path(tempfile.mkdtemp(prefix="disk-cache-bench-"))
    (root / "gcloud").mkdir()
    try:
        with emulator.running(root / "gcloud") as env:
            front = gcs_read_bench.Front(env["STORAGE_EMULATOR_HOST"])
            try:
                os.environ["STORAGE_EMULATOR_HOST"] = front.url
                os.environ["LOADER_INDEX_DIR"] = str(root / "index")
                run(args, root, front)
            finally:
                front.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(args, root: Path, front: gcs_read_bench.Front) -> None:
    from google.cloud import storage

    client = storage.Client(project="test")
    client.create_bucket("bench")
    print(f"link: {args.latency_ms:g} ms a request, {args.mbps:g} MB/s; caches of {args.cache_share:.0%} of the "
          f"dataset; {args.epochs} epochs, then a restarted job's first epoch; {os.cpu_count()} cores")
    print("| records | reader | epochs | records/s | vs staged | requests | link bytes / bytes served | "
          "cache on disk, MB |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for kb in (float(k) for k in args.record_kb.split(",")):
        size = int(kb * 1000)
        local = root / f"kb-{kb:g}"
        local.mkdir()
        paths = gcs_read_bench.write_shards(local, size, int(args.dataset_mb * 1e6))
        front.call("config", {"latency": 0.0, "bandwidth": None})
        generations = {}
        for path in paths:
            blob = client.bucket("bench").blob(f"kb-{kb:g}/{path.name}")
            blob.upload_from_filename(str(path))
            generations[path] = blob.generation  # (what the link's answers name: the reads ask for it)
        front.call("config", {"files": {f"bench/kb-{kb:g}/{path.name}": [str(path), generations[path]]
                                        for path in paths},
                              "latency": args.latency_ms / 1000, "bandwidth": args.mbps * 1e6 or None})
        dataset = sum(path.stat().st_size for path in paths)
        cache = int(args.cache_share * dataset)
        options = dict(batch_size=args.batch_size if size <= 10_000 else args.image_batch_size, seed=0, decode=None)
        records, seconds, _ = read(str(local / "*.array_record"), args.epochs, options)
        staged = records / seconds
        print(f"| {kb:g} KB x {records // args.epochs:,} | staged on local disk | 1-{args.epochs} | {staged:,.0f} | "
              "1.00x | | | |", flush=True)
        pattern = f"gs://bench/kb-{kb:g}/*.array_record"
        for name, cache_options in (("gs://, no cache", {}), ("gs://, memory cache", {"cache_bytes": cache}),
                                    ("gs://, disk cache", {"cache_bytes": cache,
                                                           "cache_dir": str(root / f"cache-{kb:g}")})):
            for epochs, label in ((args.epochs, f"1-{args.epochs}"), (1, "restart: 1")):
                front.quiet()
                front.call("reset", {})
                records, seconds, ours = read(pattern, epochs, {**options, **cache_options})
                stats = front.quiet()
                served = ours._reader._remote_reader.served
                disk = ""
                if "cache_dir" in cache_options:
                    data = Path(ours._reader._remote_reader._cache.disk.path) / "data"
                    disk = f"{data.stat().st_blocks * 512 / 1e6:,.1f}"
                print(f"| {kb:g} KB x {records // epochs:,} | {name} | {label} | {records / seconds:,.0f} | "
                      f"{records / seconds / staged:.2f}x | {stats['gets']:,} | "
                      f"{stats['bytes_out'] / max(1, served):.2f}x | {disk} |", flush=True)
                del ours


if __name__ == "__main__":
    main()
