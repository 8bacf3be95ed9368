"""HTTP clients for gs:// range reads, side by side through one shaped link: the loader's (loader/fetch/remote.py:
aiohttp with its bounds and host limits), bare aiohttp, obstore (Apache Arrow's Rust object_store) and tensorstore's
kvstore (C++, installed with orbax).

    .venv/bin/pip install -e ".[bench]"   # obstore: not a dependency of the loader, only of this benchmark
    .venv/bin/python benchmarks/gcs_client_bench.py [--record-kb 1,100] [--latency-ms 20,50] [--mbps 400,1000]

A local GCS emulator (tests/emulator.py) with a shaped link before it (tests/shaped_link.py, its own process: each
answer held `--latency-ms`, every answer's bytes sharing `--mbps` MB/s) serves one object of `--object-mb` random
bytes. Each client, in a fresh process, reads the same `--requests` ranges of one record each (random offsets, a fixed
seed), IN_FLIGHT (128) at once, each range its own request (as the loader's reads of scattered records are), and
checks every byte against the object. Reported per client: records/s, against the link's bound (min(128 / latency,
bandwidth / record size)), the CPU seconds its process spent a request (its own threads and the ones of its native
code, all counted), GET requests and bytes the link carried per byte asked. Also reported: what each needs to be
pointed at a local endpoint (an emulator, a test server) or a proxy.

Each client's process: the loader's `remote.fetch_bodies` of every range at once (its own IN_FLIGHT tasks: no request
timings; its storage client, credentials and event loop made by one request before timing), aiohttp on one asyncio loop with IN_FLIGHT tasks; obstore's `get_range_async` on an
asyncio loop, IN_FLIGHT at once (its Rust runtime does the I/O); tensorstore's `KvStore.read` with byte ranges, its
`gcs_request_concurrency` set to IN_FLIGHT, IN_FLIGHT futures at once. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

IN_FLIGHT = int(os.environ.get("IN_FLIGHT", 128))
BUCKET, NAME = "clients", "data/object"

# How each client is pointed at a local endpoint and a proxy (what a test of it needs).
POINTING = {
    "loader": "STORAGE_EMULATOR_HOST (the loader's gs:// URLs); HTTPS_PROXY/HTTP_PROXY and NO_PROXY",
    "aiohttp": "any URL; proxy= per request (or trust_env for HTTPS_PROXY)",
    "obstore": "GCSStore(config={'base_url': URL, 'skip_signature': True}, client_options={'allow_http': True}); "
               "HTTPS_PROXY, or client_options={'proxy_url': ...}; needs Last-Modified and ETag on every answer (the "
               "stock gcp-storage-emulator sends neither: every read fails)",
    "tensorstore": "TENSORSTORE_GCS_HTTP_URL and GOOGLE_AUTH_TOKEN_FOR_TESTING; HTTPS_PROXY through libcurl; reads "
                   "x-goog-generation (the stock emulator omits it)",
}

RUNNER = """
import asyncio, json, os, sys, time
import numpy as np
sys.path.insert(0, {repo!r})
data = np.fromfile({path!r}, dtype=np.uint8).tobytes()
rng = np.random.default_rng(0)
starts = rng.integers(0, len(data) - {record}, {requests}).tolist()
ranges = [(s, s + {record}) for s in starts]
link, bucket, name, client = {link!r}, {bucket!r}, {name!r}, {client!r}

took = []
async def run(get):
    todo = iter(ranges)
    got = {{}}
    async def worker():
        for start, end in todo:
            t = time.perf_counter()
            got[start, end] = await get(start, end)
            took.append(time.perf_counter() - t)
    await asyncio.gather(*[worker() for _ in range({in_flight})])
    return got

def timed(make):
    cpu, wall = time.process_time(), time.perf_counter()
    got = asyncio.run(make())
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    bad = sum(bytes(got[s, e]) != data[s:e] for s, e in ranges)  # (the loader's bodies: joined only here)
    p50, p99 = np.percentile(took, [50, 99]).tolist() if len(took) > 1 else (None, None)
    print(json.dumps({{"wall": wall, "cpu": cpu, "bad": bad, "p50": p50, "p99": p99}}), flush=True)

import urllib.parse
url = f"{{link}}/download/storage/v1/b/{{bucket}}/o/{{urllib.parse.quote(name, safe='')}}?alt=media"
if client == "loader":
    os.environ["STORAGE_EMULATOR_HOST"] = link
    from loader.fetch import remote
    remote.fetch([(f"gs://{{bucket}}/{{name}}", 0, 1)])  # its client, credentials and event loop made before timing
    async def make():
        got = await asyncio.to_thread(remote.fetch_bodies, [(f"gs://{{bucket}}/{{name}}", s, e) for s, e in ranges])
        took.append(0.0)
        return dict(zip(ranges, got))
elif client == "aiohttp":
    import aiohttp
    async def make():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit={in_flight}), auto_decompress=False) as session:
            async def get(s, e):
                async with session.get(url, headers={{"Range": f"bytes={{s}}-{{e - 1}}", "Accept-Encoding": "identity"}}) as r:
                    assert r.status == 206, r.status
                    return await r.read()
            return await run(get)
elif client == "obstore":
    import obstore
    from obstore.store import GCSStore
    store = GCSStore(bucket, config={{"base_url": link, "skip_signature": True}}, client_options={{"allow_http": True}})
    async def make():
        async def get(s, e):
            return bytes(await obstore.get_range_async(store, name, start=s, end=e))
        return await run(get)
elif client == "tensorstore":
    import tensorstore as ts
    os.environ["TENSORSTORE_GCS_HTTP_URL"] = link
    os.environ["GOOGLE_AUTH_TOKEN_FOR_TESTING"] = "x"
    kv = ts.KvStore.open({{"driver": "gcs", "bucket": bucket, "context": {{"gcs_request_concurrency": {{"limit": {in_flight}}}}}}}).result()
    async def make():
        async def get(s, e):
            r = await kv.read(name, byte_range=slice(s, e))
            return bytes(r.value)
        return await run(get)
timed(make)
"""


def run_client(client: str, link: str, path: Path, record: int, requests: int) -> dict:
    code = RUNNER.format(repo=str(REPO), path=str(path), record=record, requests=requests, link=link, bucket=BUCKET,
                         name=NAME, client=client, in_flight=IN_FLIGHT)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "TENSORSTORE_GCS_HTTP_URL": link, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "x"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(lines[-1])


def main() -> None:
    from gcs_read_bench import Front

    from tests import emulator

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--record-kb", default="1,100")
    p.add_argument("--latency-ms", default="20,50")
    p.add_argument("--mbps", default="400,1000")
    p.add_argument("--object-mb", type=int, default=256)
    p.add_argument("--requests", type=int, default=0, help="ranges read per client (default: 20,000 of 1 KB, "
                   "3,000 of 100 KB: ~10 s of the link each)")
    p.add_argument("--clients", default="loader,aiohttp,obstore,tensorstore")
    args = p.parse_args()
    clients = args.clients.split(",")
    with tempfile.TemporaryDirectory() as tmp, emulator.running(Path(tmp)) as env:
        os.environ.update(env)
        obj = Path(tmp) / "object"
        with open(obj, "wb") as f:
            for _ in range(args.object_mb):
                f.write(os.urandom(1 << 20))
        from google.cloud import storage

        client = storage.Client(project="test")
        client.create_bucket(BUCKET)
        client.bucket(BUCKET).blob(NAME).upload_from_filename(str(obj))
        front = Front(env["STORAGE_EMULATOR_HOST"])
        front.call("config", {"files": {f"{BUCKET}/{NAME}": str(obj)}})
        print(f"{os.cpu_count()} cores; {IN_FLIGHT} requests in flight; one object of {args.object_mb} MB", flush=True)
        print("| record | latency | link | client | records/s | of the link's bound | CPU a request | a request's time "
              "(median, 99th percentile) | GETs | bytes carried / asked |")
        print("|---|---|---|---|---:|---:|---:|---:|---:|---:|")
        for kb in map(int, args.record_kb.split(",")):
            record = kb * 1024
            requests = args.requests or (20_000 if kb <= 1 else 10_000)
            for ms in map(int, args.latency_ms.split(",")):
                for mbps in map(int, args.mbps.split(",")):
                    front.call("config", {"latency": ms / 1000, "bandwidth": mbps * 1e6})
                    bound = min(IN_FLIGHT / (ms / 1000), mbps * 1e6 / record)
                    for name in clients:
                        front.call("reset")
                        r = run_client(name, front.url, obj, record, requests)
                        stats = front.quiet()
                        if "error" in r:
                            print(f"| {kb} KB | {ms} ms | {mbps} MB/s | {name} | failed: {r['error'][:120]} | | | | | |",
                                  flush=True)
                            continue
                        rate = requests / r["wall"]
                        print(f"| {kb} KB | {ms} ms | {mbps} MB/s | {name} | {rate:,.0f} | {100 * rate / bound:.0f}% | "
                              f"{1e3 * r['cpu'] / requests:.3f} ms | "
                              + (f"{1e3 * r['p50']:.1f} ms, {1e3 * r['p99']:.1f} ms" if r["p50"] is not None else "")
                              + " | "
                              f"{stats['gets']:,} | "
                              f"{stats['bytes_out'] / (requests * record):.2f}x"
                              + (f" ({r['bad']} wrong)" if r["bad"] else "") + " |", flush=True)
        front.close()
    print("\nPointing each at a local endpoint or a proxy:")
    for name in clients:
        print(f"- {name}: {POINTING[name]}")


if __name__ == "__main__":
    main()
