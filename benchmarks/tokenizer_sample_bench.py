"""Text for a tokenizer from a large converted corpus: `trainer.tokenizer.sample_texts` (a seeded uniform sample of
the documents up to --max-bytes, read through the index) against reading the whole corpus (what `python -m
trainer.tokenizer` did before it sampled, and what a sequential format has to do), in one run.

    .venv/bin/python benchmarks/tokenizer_sample_bench.py --docs 1e6,1e7 [--data-dir DIR] [--max-mb 10]

For each size, a corpus of text tf.Examples (50-150 bytes of text a document, what `convert` writes from text
TFRecords: ArrayRecord group_size:1 snappy shards of 100k, a manifest) is written once into `DIR/text-N` and kept.
The record index is built once per corpus and host beforehand, timed apart. Each contender then runs in a fresh
process: seconds, peak memory above the process's baseline, texts and bytes it holds. Reported: ours / whole.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
PER_SHARD = 100_000


def _write_shard(path: str, n: int, seed: int) -> tuple[int, int]:
    from array_record.python.array_record_module import ArrayRecordWriter

    from dataset_format.example_proto import encode_example

    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", np.uint8)
    lengths = rng.integers(50, 151, n)
    text = letters[rng.integers(0, len(letters), int(lengths.sum()))].tobytes()
    writer = ArrayRecordWriter(path + ".tmp", "group_size:1,snappy")
    start = 0
    for end in np.cumsum(lengths).tolist():
        writer.write(encode_example({"text": text[start:end]}))
        start = end
    writer.close()
    os.replace(path + ".tmp", path)
    return n, os.path.getsize(path)


def make_corpus(root: Path, docs: int) -> str:
    from generated import write_corpus  # benchmarks/generated.py

    return write_corpus(root / f"text-{docs}", docs, _write_shard, name="text", per_shard=PER_SHARD,
                        writer_options="group_size:1,snappy")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(kind: str, data: str, max_bytes: int) -> dict:
    """One contender in this (fresh) process."""
    import resource

    import loader
    from trainer.tokenizer import sample_texts

    base = _rss()
    started = time.perf_counter()
    if kind == "ours":
        texts, _ = sample_texts(data, "text", max_bytes=max_bytes, seed=0)
    else:  # the whole corpus, in order, as the command read it before
        batches = loader.load(data, batch_size=1024, shuffle=False, num_epochs=1, drop_remainder=False,
                              features=["text"])
        texts = [bytes(t) for batch in batches for t in batch["text"]]
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": seconds, "memory": max(0, peak - base), "texts": len(texts), "bytes": sum(map(len, texts))}


def _run_child(kind: str, data: str, max_bytes: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", kind, "--data", data, "--max-bytes", str(max_bytes)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    if proc.returncode:
        raise SystemExit(f"{kind} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--docs", default="1e6,1e7", help="corpus sizes, comma-separated (e.g. 1e6,1e7)")
    p.add_argument("--data-dir", default=None, help="where the corpora are written and kept (default: a temp dir)")
    p.add_argument("--max-mb", type=float, default=10.0, help="the sample's text, MB (default 10)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    p.add_argument("--max-bytes", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.data, args.max_bytes)))
        return
    sys.path.insert(0, str(REPO))
    root = Path(args.data_dir or tempfile.mkdtemp(prefix="tokenizer-sample-"))
    max_bytes = int(args.max_mb * 1e6)
    print(f"text tf.Examples of 50-150 bytes, a sample of {max_bytes:,} bytes; {os.cpu_count()} cores")
    print(f"{'documents':>12} {'contender':<10} {'seconds':>9} {'memory MB':>10} {'texts':>12} {'text MB':>9}")
    for docs in (int(float(d)) for d in args.docs.split(",")):
        data = make_corpus(root, docs)
        started = time.monotonic()
        subprocess.run([sys.executable, "-c", "import loader; from loader.format import index; "
                        f"index.RecordIndex.for_source(loader.resolve({data!r}))"], check=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
        print(f"{docs:>12,} {'index':<10} built or checked once per corpus and host in "
              f"{time.monotonic() - started:.1f} s", flush=True)
        results = {}
        for kind in ("ours", "whole"):
            r = results[kind] = _run_child(kind, data, max_bytes)
            print(f"{docs:>12,} {kind:<10} {r['seconds']:>9.2f} {r['memory'] / 1e6:>10.0f} {r['texts']:>12,} "
                  f"{r['bytes'] / 1e6:>9.1f}", flush=True)
        ours, whole = results["ours"], results["whole"]
        print(f"{docs:>12,} ours / whole: {ours['seconds'] / whole['seconds']:.3f}x the time, "
              f"{ours['memory'] / max(whole['memory'], 1):.3f}x the memory", flush=True)


if __name__ == "__main__":
    main()
