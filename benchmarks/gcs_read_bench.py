"""Reading gs:// through a shaped link: records/s, requests, and bytes downloaded per byte served, ours against the
link's bounds and grain's ArrayRecordDataSource, in one run.

    .venv/bin/python benchmarks/gcs_read_bench.py [--record-kb 1,100] [--dataset-mb 32] [--latency-ms 20,50]
                                                  [--mbps 400] [--cache-mb 8] [--worker-count 0] [--grain]

A local GCS emulator (tests/emulator.py) holds the objects; a shaped link in its own process (tests/shaped_link.py,
aiohttp) answers their reads from local copies, holding each answer `--latency-ms` and sharing `--mbps` MB/s among
them (it counts the bytes it sends). For each record size, 8 shards of random records (ArrayRecord
group_size:1, uncompressed) totalling `--dataset-mb` are uploaded, then, at each latency:
- ours: `loader.load("gs://.../*.array_record", batch_size=B, seed=0, decode=None, cache_bytes=--cache-mb)`, one epoch
  in a shuffled order (or `--batches`), with the loader's rule for merging chunks into one range request (a gap of at
  most REMOTE_GAP and at most REMOTE_WASTE percent more bytes than the chunks hold) and, as the anchor, merging by gap
  alone (1 MiB: what a local-disk coalescer does, scaled to a request's cost);
- grain (`--grain`): `grain.sources.ArrayRecordDataSource` on the same objects (array_record's C++ client makes the
  requests), read as MaxText reads it, `MapDataset.source(s).shuffle(seed).to_iter_dataset()` with 16 threads,
  `--grain-records` records (its rate is steady).
Reported: records/s handed out, GET requests, bytes the front sent / bytes of the records' chunks (ours: the chunks
its reads asked for, read-ahead included; grain: the records read), and the link's bound on records/s: min(requests
in flight / latency x records a request, bandwidth / record size), and the cores the reader's process and the link's
used meanwhile (they share the host: on a small one, their CPU sets the pace before the link does). With
`--worker-count N` ours reads in N worker processes (the reader's cores are theirs and this process's; the anchor's
row is left out, as the rule is set in this process only).
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np


def write_shards(directory: Path, record_bytes: int, total: int, shards: int = 8) -> list[Path]:
    from array_record.python.array_record_module import ArrayRecordWriter

    rng = np.random.default_rng(record_bytes)
    per = max(1, total // record_bytes // shards)
    paths = []
    for s in range(shards):
        path = directory / f"data-{s:05d}-of-{shards:05d}.array_record"
        writer = ArrayRecordWriter(str(path), "group_size:1,uncompressed")
        for _ in range(per):
            writer.write(rng.bytes(record_bytes))
        writer.close()
        paths.append(path)
    return paths


class Front:
    """The shaped link (tests/shaped_link.py), a process of its own before the emulator."""

    def __init__(self, upstream: str):
        import subprocess
        import sys

        script = Path(__file__).resolve().parents[1] / "tests" / "shaped_link.py"
        self._proc = subprocess.Popen([sys.executable, str(script), upstream], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{int(self._proc.stdout.readline())}"

    def call(self, what: str, payload: dict | None = None) -> dict:
        import json
        import urllib.request

        data = None if payload is None else json.dumps(payload).encode()
        with urllib.request.urlopen(urllib.request.Request(f"{self.url}/__link/{what}", data=data)) as answer:
            return json.loads(answer.read())

    def quiet(self, seconds: float = 60) -> dict:
        """The counts once no request has been in flight for 0.3 s (a closed iterator's reads in flight landed)."""
        deadline, calm = time.monotonic() + seconds, 0
        while time.monotonic() < deadline and calm < 3:
            stats = self.call("stats")
            calm = calm + 1 if stats["active"] == 0 else 0
            time.sleep(0.1)
        return self.call("stats")

    def close(self) -> None:
        self._proc.stdin.close()  # the front exits when its stdin closes
        self._proc.wait(timeout=30)


def cpu_seconds(others: set[int]) -> float:
    """CPU seconds of this process and its living children but `others` (the link, the emulator) and theirs: the
    reader's process and the loader's worker processes, so far."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    skip = set(others)
    for pid in others:
        try:
            skip.update(child.pid for child in psutil.Process(pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2]) if child.pid not in skip else 0
        except psutil.NoSuchProcess:
            pass
    return total


def measure(read_batches, front: Front, spans, record_bytes: int, counted: bool) -> dict:
    """Runs `read_batches` (which returns the records handed out, its seconds and the reader's CPU seconds) and
    counts what the link carried and what the loader's reader served (`counted`: all reads are this process's)."""
    front.quiet()
    cpu = front.call("reset", {})["cpu"]
    spans.requests = spans.downloaded = spans.records = spans.served = 0
    handed, seconds, reader_cpu = read_batches()
    stats = front.call("stats")
    front_cores = (stats["cpu"] - cpu) / seconds
    stats = front.quiet()
    # with worker processes the reads (and their counts) are theirs: the records handed out, then, and their bytes
    records, served = (spans.records, spans.served) if counted else (handed, handed * record_bytes)
    return {"records_per_s": handed / seconds, "requests": stats["gets"], "records": records,
            "front_cores": front_cores, "reader_cores": reader_cpu / seconds,
            "ratio": stats["bytes_out"] / max(1, served), "seconds": seconds}


def read_grain(paths: list[str], records: int, threads: int) -> dict:
    """grain's ArrayRecordDataSource on the same gs:// shards (array_record's reader makes the range requests), read
    as MaxText reads it: `MapDataset.source(source).shuffle(seed).to_iter_dataset()`, `threads` reading threads
    (read-ahead: 2 records a thread)."""
    import grain

    source = grain.sources.ArrayRecordDataSource(paths)
    ds = grain.MapDataset.source(source).shuffle(seed=0)
    it = iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=2 * threads)))
    started, cpu_started = time.perf_counter(), time.process_time()
    for _ in range(records):
        next(it)
    seconds = time.perf_counter() - started
    reader_cores = (time.process_time() - cpu_started) / seconds
    it.close()
    return {"records": records, "seconds": seconds, "reader_cores": reader_cores}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--record-kb", default="1,100", help="record sizes in KB, comma-separated")
    p.add_argument("--dataset-mb", default="96",
                   help="the dataset's size in MB for each record size, comma-separated (one value: for all)")
    p.add_argument("--latency-ms", default="20", help="latencies a request, ms, comma-separated")
    p.add_argument("--mbps", type=float, default=400, help="the link's bandwidth, MB/s (0: none)")
    p.add_argument("--batches", type=int, default=0, help="ours: batches read (0: an epoch)")
    p.add_argument("--grain-records", type=int, default=2560, help="grain: records read (its rate is steady)")
    p.add_argument("--batch-size", type=int, default=256, help="records a batch, for records up to 10 KB")
    p.add_argument("--image-batch-size", type=int, default=32, help="records a batch, for larger records")
    p.add_argument("--cache-mb", type=float, default=0, help="ours: a chunk cache of this many MB (0: none)")
    p.add_argument("--in-flight", type=int, default=0,
                   help="ours: range requests in flight a process (default: loader.fetch.remote.IN_FLIGHT)")
    p.add_argument("--worker-count", default="0",
                   help="ours: loader.load(worker_count=): worker processes, each with its own requests in flight "
                        "(0: this process's threads; 'auto': tuned)")
    p.add_argument("--grain", action="store_true", help="also grain's ArrayRecordDataSource on the same link")
    p.add_argument("--grain-threads", type=int, default=16, help="grain's reading threads (its default: 16)")
    args = p.parse_args()

    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests import emulator

    root = Path(tempfile.mkdtemp(prefix="gcs-read-bench-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)  # (~470 MB a run)
    (root / "gcloud").mkdir()
    latencies = [float(ms) / 1000 for ms in args.latency_ms.split(",")]
    bandwidth = args.mbps * 1e6 or None
    with emulator.running(root / "gcloud") as env:
        front = Front(env["STORAGE_EMULATOR_HOST"])
        import psutil

        others = {child.pid for child in psutil.Process().children()}  # the link and the emulator
        try:
            os.environ["STORAGE_EMULATOR_HOST"] = front.url
            os.environ["CLOUD_STORAGE_EMULATOR_ENDPOINT"] = front.url  # array_record's C++ client
            os.environ["LOADER_INDEX_DIR"] = str(root / "index")
            from google.cloud import storage

            import loader
            from loader.fetch import reader, remote

            if args.in_flight:
                remote.IN_FLIGHT = args.in_flight

            client = storage.Client(project="test")
            client.create_bucket("bench")
            read = f"{args.batches} batches" if args.batches else "an epoch"
            print(f"link: {args.mbps:g} MB/s shared, the latency a request as given; ours reads {read} in a shuffled "
                  f"order; {os.cpu_count()} cores")
            print("| latency | records | reader | records/s | requests | bytes downloaded / bytes served | "
                  "link bound, records/s | reader's CPU, cores | link's CPU, cores |")
            print("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
            sizes = [float(k) for k in args.record_kb.split(",")]
            dataset_mb = [float(mb) for mb in args.dataset_mb.split(",")]
            for kb, mb in zip(sizes, dataset_mb * len(sizes) if len(dataset_mb) == 1 else dataset_mb):
                size = int(kb * 1000)
                local = root / f"kb-{kb:g}"
                local.mkdir()
                paths = write_shards(local, size, int(mb * 1e6))
                front.call("config", {"latency": 0.0, "bandwidth": None})
                generations = {}
                for path in paths:
                    blob = client.bucket("bench").blob(f"kb-{kb:g}/{path.name}")
                    blob.upload_from_filename(str(path))
                    generations[path] = blob.generation
                # the front answers the shards' reads from these local copies (the emulator is slower than the link),
                # naming the emulator's generations (the loader's reads ask for the ones it listed)
                front.call("config", {"files": {f"bench/kb-{kb:g}/{path.name}": [str(path), generations[path]]
                                                for path in paths}})
                pattern = f"gs://bench/kb-{kb:g}/*.array_record"
                batch_size = args.batch_size if size <= 10_000 else args.image_batch_size
                epoch = len(loader.resolve(pattern)) // batch_size
                batches = min(args.batches, epoch) if args.batches else epoch
                workers = args.worker_count if args.worker_count == "auto" else int(args.worker_count)
                processes = workers if isinstance(workers, int) and workers else 1  # each with IN_FLIGHT requests
                options = dict(batch_size=batch_size, seed=0, decode=None, num_epochs=1, worker_count=workers)

                def read_ours() -> tuple[int, float, float]:
                    started, cpu_started = time.perf_counter(), cpu_seconds(others)
                    it = iter(ours)
                    try:
                        handed = sum(len(next(it)) for _ in range(batches))
                        # the CPU before the close: the worker processes, if any, end with it
                        return handed, time.perf_counter() - started, cpu_seconds(others) - cpu_started
                    finally:
                        it.close()  # its prefetch stops before the link does

                for latency in latencies:
                    front.call("config", {"latency": latency, "bandwidth": bandwidth})

                    def bound(records_per_request: float, in_flight: int) -> float:
                        b = in_flight / latency * records_per_request if latency else float("inf")
                        return min(b, args.mbps * 1e6 / size) if args.mbps else b

                    rules = [("ours, merged by gap alone (1 MiB)", 1 << 20, -1),
                             ("ours: gap and 50% budget", reader.REMOTE_GAP, reader.REMOTE_WASTE)]
                    if workers:  # spawned workers read with the loader's own rule (the anchor's is set here only)
                        rules = [(f"ours: gap and 50% budget, worker_count={workers}", 0, 0)]
                    for rule, gap, waste in rules:
                        ours = loader.load(pattern, cache_bytes=int(args.cache_mb * 1e6), **options)
                        saved_rule = reader.REMOTE_GAP, reader.REMOTE_WASTE
                        if not workers:
                            reader.REMOTE_GAP, reader.REMOTE_WASTE = gap, waste
                        try:
                            r = measure(read_ours, front, ours._reader._remote_reader, size, counted=not workers)
                        finally:
                            reader.REMOTE_GAP, reader.REMOTE_WASTE = saved_rule
                        per_request = r["records"] / max(1, r["requests"])
                        print(f"| {latency * 1000:g} ms | {kb:g} KB x {r['records']:,} | {rule} | "
                              f"{r['records_per_s']:,.0f} | {r['requests']:,} | {r['ratio']:.2f}x | "
                              f"{bound(per_request, remote.IN_FLIGHT * processes):,.0f} | {r['reader_cores']:.2f} | "
                              f"{r['front_cores']:.2f} |", flush=True)
                    if args.grain:
                        front.quiet()
                        cpu = front.call("reset", {})["cpu"]
                        g = read_grain([f"gs://bench/kb-{kb:g}/{path.name}" for path in paths],
                                       min(args.grain_records, epoch * batch_size), args.grain_threads)
                        stats = front.call("stats")
                        front_cores = (stats["cpu"] - cpu) / g["seconds"]
                        stats = front.quiet()
                        print(f"| {latency * 1000:g} ms | {kb:g} KB x {g['records']:,} | grain ArrayRecordDataSource, "
                              f"{args.grain_threads} threads | {g['records'] / g['seconds']:,.0f} | {stats['gets']:,} | "
                              f"{stats['bytes_out'] / (g['records'] * size):.2f}x | "
                              f"{bound(g['records'] / max(1, stats['gets']), args.grain_threads):,.0f} | "
                              f"{g['reader_cores']:.2f} | {front_cores:.2f} |", flush=True)
        finally:
            front.close()


if __name__ == "__main__":
    main()
