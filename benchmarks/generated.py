"""Generated corpora for the scale benchmarks (packing_scale_bench.py, tokenizer_sample_bench.py): shards written in
parallel by a benchmark's own shard writer, then a manifest listing them, as `python -m pipelines convert` would;
kept, so a later run reuses them."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path


def write_corpus(out: Path, docs: int, write_shard: Callable[..., tuple[int, int]], *, name: str, per_shard: int,
                 writer_options: str, shard_args: tuple = (), tokens: dict | None = None) -> str:
    """`docs` records in shards of `per_shard` under `out` (nothing done when its manifest exists):
    `write_shard(path, records, seed, *shard_args) -> (records, bytes)` writes each, in a process of its own; the
    manifest lists them (with `tokens`, a pre-tokenized dataset's section). Returns `out` as a string."""
    from dataset_format.manifest import Manifest, ShardEntry

    if (out / "manifest.json").exists():
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = [min(per_shard, docs - first) for first in range(0, docs, per_shard)]
    names = [f"{name}-{i:05d}-of-{len(sizes):05d}.array_record" for i in range(len(sizes))]
    started = time.monotonic()
    with ProcessPoolExecutor(os.cpu_count() or 1) as pool:
        written = list(pool.map(write_shard, [str(out / n) for n in names], sizes, range(len(sizes)),
                                *([arg] * len(sizes) for arg in shard_args)))
    print(f"wrote {docs:,} documents in {len(names)} shards ({sum(b for _, b in written) / 1e9:.2f} GB) in "
          f"{time.monotonic() - started:.0f} s", flush=True)
    entries = tuple(ShardEntry(path=shard, source=f"generated:{i}", records=n, bytes=b, source_bytes=0,
                               source_fingerprint="generated", writer_options=writer_options,
                               tokens="generated" if tokens else None)
                    for i, (shard, (n, b)) in enumerate(zip(names, written)))
    manifest = Manifest(input="generated", kind="tfrecord", shards=entries, tool_version="bench", tokens=tokens)
    (out / "manifest.json").write_text(manifest.to_json())
    return str(out)
