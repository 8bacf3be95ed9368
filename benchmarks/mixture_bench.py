"""A mixture against one dataset of the same total size: records/s through `loader.load`, side by side.

    .venv/bin/python benchmarks/mixture_bench.py                       # 600k records of ~1 KB, 3 components
    .venv/bin/python benchmarks/mixture_bench.py --records 200000 --rounds 3
    .venv/bin/python benchmarks/mixture_bench.py --packing 1024  # packed rows of 1024 byte tokens: real tokens/s

Writes `--records` tf.Examples ({"id", "text": ~1 KB}) once as one dataset of 8 shards and once as three
components of 50%, 30% and 20% of the records (8 shards between them), then reads `--batches` batches of 256 from
each, decoded, alternating the two `--rounds` times (the machine's noise falls on both alike), and reports the median
records/s of each and their ratio. Weights 0.5/0.3/0.2: the components are read at their share, so both runs read
the same records' worth of data; the mixture's extra work is its schedule and per-component permutations.
With `--packing SEQ_LEN` both pack the text's bytes as tokens into rows of SEQ_LEN (batches of 256 rows; the mixture
packs each component on its own and draws rows) and the rate is real (non-padding) tokens/s; the packing's one pass
over the token counts happens in `load`, before the clock starts.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def write(path: Path, name: str, first: int, count: int, shards: int) -> str:
    from array_record.python.array_record_module import ArrayRecordWriter

    from dataset_format import example_proto

    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(first)
    for shard, part in enumerate(np.array_split(np.arange(first, first + count), shards)):
        writer = ArrayRecordWriter(str(path / f"{name}-{shard:05d}.array_record"), "group_size:1,snappy")
        for i in part:
            text = rng.integers(97, 123, size=int(rng.integers(512, 1536)), dtype=np.uint8).tobytes()
            writer.write(example_proto.encode_example({"id": int(i), "text": text}))
        writer.close()
    return str(path / f"{name}-*.array_record")


def byte_tokens(value) -> np.ndarray:
    return np.frombuffer(bytes(value[0]), np.uint8).astype(np.int32)


def rate(source, batches: int, seq_len: int = 0, **options) -> float:
    """Records/s, or with `seq_len` real tokens/s of packed rows."""
    import loader

    if seq_len:
        options["packing"] = loader.Packing("text", seq_len, byte_tokens)
    it = iter(loader.load(source, batch_size=256, seed=0, **options))
    next(it)  # the index is built and the first read made before the clock starts
    started, units = time.perf_counter(), 0
    for _ in range(batches):
        batch = next(it)
        units += int((batch["segment_ids"] > 0).sum()) if seq_len else 256
    elapsed = time.perf_counter() - started
    it.close()
    return units / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=600_000)
    p.add_argument("--batches", type=int, default=600)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--packing", type=int, default=0, metavar="SEQ_LEN", help="pack rows of SEQ_LEN byte tokens")
    args = p.parse_args()
    unit = "tokens/s" if args.packing else "records/s"
    shares = {"web": 0.5, "code": 0.3, "books": 0.2}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        single = write(root / "single", "all", 0, args.records, 8)
        counts = [int(args.records * s) for s in shares.values()]
        counts[0] += args.records - sum(counts)
        components, first = {}, 0
        for (name, _), count, shards in zip(shares.items(), counts, (4, 2, 2)):
            components[name] = write(root / name, name, first, count, shards)
            first += count
        ours, anchor = [], []
        for _ in range(args.rounds):
            anchor.append(rate(single, args.batches, args.packing))
            ours.append(rate(components, args.batches, args.packing, weights=shares))
        a, o = statistics.median(anchor), statistics.median(ours)
        packing = f", packed into rows of {args.packing} tokens" if args.packing else ""
        print(f"{args.records:,} records of ~1 KB{packing}, {args.batches} batches of 256, median of {args.rounds} "
              "rounds")
        print(f"one dataset:                 {a:12,.0f} {unit}  (rounds: {', '.join(f'{x:,.0f}' for x in anchor)})")
        print(f"mixture web/code/books .5/.3/.2: {o:9,.0f} {unit}  (rounds: {', '.join(f'{x:,.0f}' for x in ours)})")
        print(f"ratio mixture / one dataset: {o / a:.2f}x")


if __name__ == "__main__":
    main()
