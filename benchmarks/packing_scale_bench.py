"""Packing at corpus scale: time to the first packed batch and memory, ours against grain's packers, in one run.

    .venv/bin/python benchmarks/packing_scale_bench.py --docs 1e6,1e7,1e8 [--data-dir DIR] [--seq-len 1024] [--rows 8]
    .venv/bin/python benchmarks/packing_scale_bench.py --docs 1e6 --lengths 8-1024     # first vs best fit

For each size, a pre-tokenized corpus of short documents (8-24 uint16 token ids, or `--lengths`, random: what the converter's
`--tokenizer` writes, made here directly since the converter is not what is measured) is written once into
`DIR/docs-N` (ArrayRecord group_size:1 shards of 100k documents, a `.counts` file beside each, a manifest; reused by
later runs). Each contender then runs in a fresh process:
- ours: `loader.load(DIR, batch_size=rows, packing=loader.Packing(seq_len=L, fit=...))` (lazy block layout over the
  memory-mapped counts; its record index is built once per corpus and host beforehand, timed apart);
- grain: `MapDataset.source(ArrayRecordDataSource(shards)).shuffle(seed=0).map(ids -> tokens/targets)
  .to_iter_dataset()` -> `grain.experimental.FirstFitPackIterDataset` / `BestFitPackIterDataset`
  (num_packing_bins=rows) -> `.batch(rows)`: MaxText's grain pipeline.
Reported: seconds to the first batch, peak memory above the process's baseline (bytes per document), real tokens
/ all tokens over the next `--batches` batches (more while under `--min-seconds` of work), and tokens/s there; and
ours / grain. Before each contender the corpus's files are read through, so that each starts with them in the page
cache (the first to run would otherwise pay for the disk reads of a corpus the OS had dropped).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

PER_SHARD = 100_000  # documents a shard (grain reads a record of a 1M-record shard in ~17 ms here, of a 200k one in 0.5 ms)
CONTENDERS = ("ours-first", "ours-best", "grain-first", "grain-best")


def _write_shard(path: str, n: int, seed: int, lengths_range: tuple[int, int] = (8, 24)) -> tuple[int, int]:
    from array_record.python.array_record_module import ArrayRecordWriter

    rng = np.random.default_rng(seed)
    lengths = rng.integers(lengths_range[0], lengths_range[1] + 1, n)
    data = rng.integers(0, 32000, int(lengths.sum()), dtype=np.uint16).astype("<u2").tobytes()
    ends = (np.cumsum(lengths) * 2).tolist()
    writer = ArrayRecordWriter(path + ".tmp", "group_size:1,uncompressed")
    start = 0
    for end in ends:
        writer.write(data[start:end])
        start = end
    writer.close()
    lengths.astype("<u4").tofile(path + ".counts")
    os.replace(path + ".tmp", path)
    return n, os.path.getsize(path)


def make_corpus(root: Path, docs: int, lengths: tuple[int, int] = (8, 24)) -> str:
    """`docs` documents of `lengths` ids (uniform, inclusive) in shards of PER_SHARD, with counts and a manifest
    (kept: a later run reuses them)."""
    from generated import write_corpus  # benchmarks/generated.py

    out = root / (f"docs-{docs}" if lengths == (8, 24) else f"docs-{docs}-ids-{lengths[0]}-{lengths[1]}")
    tokens = {"dtype": "<u2", "vocab_size": 32000, "tokenizer": "random", "tokenizer_sha256": "-", "text_key": "-",
              "add_bos": None, "add_eos": False, "counts": ".counts"}
    return write_corpus(out, docs, _write_shard, name="docs", per_shard=PER_SHARD,
                        writer_options="group_size:1,uncompressed", shard_args=(lengths,), tokens=tokens)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _warm(data: str) -> None:
    """Reads every file of the corpus `data` once (into the page cache)."""
    for path in Path(data).iterdir():
        with open(path, "rb") as f:
            while f.read(16 << 20):
                pass


def child(kind: str, data: str, seq_len: int, rows: int, batches: int, min_seconds: float) -> dict:
    """One contender in this (fresh) process."""
    import grain

    import loader

    base = _rss()
    started = time.perf_counter()
    if kind.startswith("ours"):
        it = iter(loader.load(data, batch_size=rows, packing=loader.Packing(seq_len=seq_len, fit=kind[5:]), seed=0))

        def real(batch):
            return int((batch["segment_ids"] > 0).sum())
    else:
        shards = loader.resolve(data).paths
        L = seq_len

        def example(record: bytes) -> dict:
            ids = np.frombuffer(record, "<u2").astype(np.int32)[: L + 1]
            return {"tokens": ids[:-1], "targets": ids[1:]}

        ds = (grain.MapDataset.source(grain.sources.ArrayRecordDataSource(list(shards))).shuffle(seed=0).repeat()
              .map(example).to_iter_dataset())
        packer = (grain.experimental.FirstFitPackIterDataset if kind == "grain-first"
                  else grain.experimental.BestFitPackIterDataset)
        it = iter(packer(ds, length_struct={"tokens": L, "targets": L}, num_packing_bins=rows).batch(rows))

        def real(batch):
            return int((batch["tokens_segment_ids"] > 0).sum())
    first = next(it)
    first_s = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tokens = total = taken = 0
    started = time.perf_counter()
    while taken < batches or time.perf_counter() - started < min_seconds:
        batch = next(it)
        tokens += real(batch)
        total += rows * seq_len
        taken += 1
    steady = time.perf_counter() - started
    assert real(first) > 0
    return {"first_s": first_s, "memory": max(0, peak - base), "efficiency": tokens / total,
            "tokens_per_s": tokens / steady, "batches": taken}


def _run_child(kind: str, data: str, args) -> dict:
    code = [sys.executable, __file__, "--child", kind, "--data", data, "--seq-len", str(args.seq_len), "--rows",
            str(args.rows), "--batches", str(args.batches), "--min-seconds", str(args.min_seconds)]
    _warm(data)
    proc = subprocess.run(code, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    if proc.returncode:
        raise SystemExit(f"{kind} on {data} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--docs", default="1e6,1e7", help="corpus sizes, comma-separated (e.g. 1e6,1e7,1e8)")
    p.add_argument("--data-dir", default=None, help="where the corpora are written and kept (default: a temp dir)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--batches", type=int, default=100, help="batches measured after the first, at least")
    p.add_argument("--min-seconds", type=float, default=2.0, help="more batches while their time is under this "
                   "(default 2 s: a rate over a few milliseconds is noise)")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--lengths", default="8-24", help="document lengths in ids, LO-HI (uniform; default 8-24: short "
                   "documents, which every packer fills rows with; e.g. 8-1024 tells first and best fit apart)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.data, args.seq_len, args.rows, args.batches, args.min_seconds)))
        return

    sys.path.insert(0, str(REPO))
    root = Path(args.data_dir or tempfile.mkdtemp(prefix="packing-scale-"))
    contenders = args.contenders.split(",")
    print(f"documents of {args.lengths} ids, seq_len {args.seq_len}, {args.rows} rows a batch, at least "
          f"{args.batches} batches and {args.min_seconds:g} s after the first; corpus in the page cache; "
          f"{os.cpu_count()} cores")
    print(f"{'documents':>12} {'contender':<12} {'first batch s':>13} {'memory B/doc':>12} {'efficiency':>10} "
          f"{'tokens/s':>12} {'batches':>8}")
    for docs in (int(float(d)) for d in args.docs.split(",")):
        data = make_corpus(root, docs, tuple(int(x) for x in args.lengths.split("-")))
        if any(c.startswith("ours") for c in contenders):
            started = time.monotonic()
            subprocess.run([sys.executable, "-c", f"import loader; from loader.format import index; "
                            f"index.RecordIndex.for_source(loader.resolve({data!r}))"], check=True,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
            print(f"{docs:>12,} {'ours: index':<12} built or checked once per corpus and host in "
                  f"{time.monotonic() - started:.1f} s", flush=True)
        results = {}
        for kind in contenders:
            r = results[kind] = _run_child(kind, data, args)
            print(f"{docs:>12,} {kind:<12} {r['first_s']:>13.2f} {r['memory'] / docs:>12.1f} "
                  f"{r['efficiency']:>10.3f} {r['tokens_per_s']:>12,.0f} {r['batches']:>8,}", flush=True)
        for ours, theirs in (("ours-first", "grain-first"), ("ours-best", "grain-best")):
            if ours in results and theirs in results:
                a, b = results[ours], results[theirs]
                print(f"{docs:>12,} {ours} / {theirs}: first batch {b['first_s'] / a['first_s']:.1f}x sooner, "
                      f"tokens/s {a['tokens_per_s'] / b['tokens_per_s']:.1f}x, efficiency "
                      f"{a['efficiency']:.3f} vs {b['efficiency']:.3f}", flush=True)


if __name__ == "__main__":
    main()
