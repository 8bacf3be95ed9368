"""Packing benchmark: our loader's packing against grain's own first-fit packing, on the same text, in one run.

    .venv/bin/python benchmarks/packing_bench.py [--seq-len 1024] [--rows 8] [--batches 200] [--max-mb 4]

Both read the LM demo's data (the Python standard library's sources as text Examples, converted to ArrayRecord
here, once), tokenise each passage the same way (BOS + one token per byte, `task=lm`'s `tokenize`) and yield batches
of `rows` rows of `seq_len` tokens:
- grain: `MapDataset.source(ArrayRecordDataSource(shards)).shuffle(seed).map(decode + tokenize)`
  `.to_iter_dataset()` -> `grain.experimental.FirstFitPackIterDataset(num_packing_bins=rows)` -> `.batch(rows)`;
  its bins are filled from the next elements and emitted together (a window of `rows` bins).
- ours: `loader.load(data, batch_size=rows, packing=loader.Packing(...))`: a window of 64 open rows over the
  epoch's permutation, exact resume and host sharding included.
Reported per contender: real tokens / all tokens (efficiency) and real tokens per second over `--batches` batches
after the first (start-up excluded: ours reads every example's length first, timed separately), and ours / grain.
Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np


def make_data(root: Path, max_mb: float) -> str:
    from pipelines import ConvertConfig, run_conversion
    from pipelines.demo import write_text_tfrecords

    write_text_tfrecords(str(root / "tfrecord"), num_shards=4, max_bytes=int(max_mb * (1 << 20)))
    run_conversion(ConvertConfig(input=str(root / "tfrecord" / "text-train.tfrecord-*"), output=str(root / "train")),
                   ["--direct_num_workers=1"])
    return str(root / "train")


def measure(batches, n: int, real, shape) -> tuple[float, float]:
    """(efficiency, real tokens/s) over batches 1..n (batch 0 is the start-up)."""
    it = iter(batches)
    next(it)
    tokens = total = 0
    started = time.perf_counter()
    for _ in range(n):
        batch = next(it)
        tokens += real(batch)
        total += int(np.prod(shape(batch)))
    seconds = time.perf_counter() - started
    return tokens / total, tokens / seconds


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--max-mb", type=float, default=4.0)
    args = p.parse_args()

    import grain

    import loader
    from loader.decoding.decode import ExampleDecoder
    from trainer import TrainConfig
    from trainer.tasks import LanguageModel

    scratch = Path(tempfile.mkdtemp(prefix="packing-bench-"))
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    data = make_data(scratch, args.max_mb)
    task = LanguageModel.from_config(TrainConfig(data=data, workdir="-", task="lm", seq_len=args.seq_len), {})
    decode = ExampleDecoder(("text",))

    def example(record: bytes) -> dict:
        ids = task.tokenize(decode(record)["text"])[: args.seq_len + 1]
        return {"tokens": ids[:-1], "targets": ids[1:]}

    shards = loader.resolve(data).paths
    L = args.seq_len
    grain_ds = (grain.MapDataset.source(grain.sources.ArrayRecordDataSource(list(shards))).shuffle(seed=0).repeat()
                .map(example).to_iter_dataset())
    grain_ds = grain.experimental.FirstFitPackIterDataset(grain_ds, length_struct={"tokens": L, "targets": L},
                                                          num_packing_bins=args.rows).batch(args.rows)
    started = time.perf_counter()
    ours = loader.load(data, batch_size=args.rows, seed=0, packing=task.packing)
    ours_start = time.perf_counter() - started

    results = {
        "grain FirstFitPack": measure(grain_ds, args.batches, lambda b: int((b["tokens_segment_ids"] > 0).sum()),
                                      lambda b: b["tokens"].shape),
        "ours": measure(ours, args.batches, lambda b: int((b["segment_ids"] > 0).sum()),
                        lambda b: b["tokens"].shape),
    }
    print(f"{len(loader.resolve(data))} passages, rows of {L}, {args.rows} rows a batch, {args.batches} batches "
          f"(ours read every length first: {ours_start:.2f} s)")
    for name, (efficiency, rate) in results.items():
        print(f"  {name:20s} efficiency {100 * efficiency:5.1f}%   {rate:12,.0f} real tokens/s")
    (ge, gr), (oe, orate) = results["grain FirstFitPack"], results["ours"]
    print(f"  ours / grain: efficiency {oe / ge:.3f}x, tokens/s {orate / gr:.2f}x")


if __name__ == "__main__":
    main()
