"""Tokenising at conversion time against a bare loop of the same tokenizer, in one run.

    .venv/bin/python benchmarks/tokenize_bench.py [--max-mb 16] [--vocab 8192] [--workers 1,2]

The text: the Python standard library's sources as tf.Example passages (the LM demo's data, `pipelines.demo`),
written as TFRecord shards. A byte-level BPE of `--vocab` ids is trained on them. Then:
- bare: the same texts, already in memory, through `tokenizer.encode_batch` in batches of 2,048 (native threads on
  every core): the tokenizer's own speed, nothing read or written;
- ours: `python -m pipelines convert --tokenizer ... --text-key text` (Beam's DirectRunner, `--workers` processes;
  its default, one, since the tokenizer's batch call is already on every core):
  read TFRecords, parse each tf.Example, tokenise, write ArrayRecord shards and counts, commit, manifest; the
  pipeline's start and its manifest included.
Reported: MB of text per second and documents per second (the fastest of `--repeat` runs each, interleaved), and
ours / bare (goal >= 0.8). `--copies N` writes the text N times (N times the shards): the pipeline's start (~1 s)
weighs less, as on a real corpus.
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import tempfile
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-mb", type=float, default=16.0)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--workers", default="auto,2", help="DirectRunner worker processes to time, comma-separated "
                   "(auto: the converter's default, one when tokenising)")
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3, help="runs of each; the fastest counts (a shared VM's speed drifts)")
    p.add_argument("--copies", type=int, default=1, help="the text written this many times (more shards)")
    args = p.parse_args()

    from dataset_format import example_proto, tokenizer
    from pipelines import ConvertConfig, run_conversion, tfrecord
    from pipelines.demo import write_text_tfrecords
    from pipelines.tokens import BATCH

    root = Path(tempfile.mkdtemp(prefix="tokenize-bench-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    files = write_text_tfrecords(str(root / "raw"), num_shards=args.shards, max_bytes=int(args.max_mb * (1 << 20)))
    texts = []
    for path in sorted(f for f in files if "-train." in f):
        with open(path, "rb") as f:
            texts += [example_proto.decode_example(r)["text"][0] for r in tfrecord.iter_records(f, path=path)]
    for copy in range(1, args.copies):  # more shards of the same text, matched by the same glob (numbered as its
        for path in sorted(f for f in files if "-train." in f):  # own shards are: one split, not several groups)
            shutil.copy(path, path.replace("text-train.tfrecord-", f"text-train.tfrecord-{copy}"))
    texts_once, texts = texts, texts * args.copies
    mb = sum(map(len, texts)) / 1e6
    tok_path = tokenizer.train_bpe(texts_once[:20000], args.vocab, str(root / "tokenizer.json"))
    tok = tokenizer.load(tok_path)
    print(f"{len(texts):,} documents, {mb:.1f} MB of text (train split{f', {args.copies} copies' if args.copies > 1 else ''}), "
          f"a BPE of {args.vocab} ids")

    def bare_loop() -> tuple[float, int]:
        started, ids = time.perf_counter(), 0
        for first in range(0, len(texts), BATCH):
            ids += sum(len(i) for i in tok.encode_batch(texts[first:first + BATCH]))
        return time.perf_counter() - started, ids

    def convert(workers: str) -> float:
        out = root / f"out-{workers}"
        shutil.rmtree(out, ignore_errors=True)
        config = ConvertConfig(input=str(root / "raw" / "text-train.tfrecord-*"), output=str(out),
                               tokenizer=tok_path, text_key="text")
        started = time.perf_counter()
        beam_args = [] if workers == "auto" else [f"--direct_num_workers={workers}"] + (
            ["--direct_running_mode=multi_processing"] if int(workers) > 1 else [])
        outcome = run_conversion(config, beam_args)
        seconds = time.perf_counter() - started
        assert outcome.ok and outcome.manifest.total_records == len(texts)
        return seconds

    # interleaved (bare, then each setting, `--repeat` times), so a drift of the machine's speed hits all alike
    bare_runs, runs = [], {w: [] for w in args.workers.split(",")}
    for _ in range(args.repeat):
        seconds, ids = bare_loop()
        bare_runs.append(seconds)
        for workers in runs:
            runs[workers].append(convert(workers))
    bare = min(bare_runs)
    print(f"{'bare encode_batch':<28} {mb / bare:>8.2f} MB/s {len(texts) / bare:>10,.0f} docs/s ({ids:,} ids)")
    for workers, seconds in runs.items():
        seconds = min(seconds)
        print(f"{f'convert --tokenizer, {workers} worker(s)':<28} {mb / seconds:>8.2f} MB/s "
              f"{len(texts) / seconds:>10,.0f} docs/s   ours / bare: {bare / seconds:.2f}x")


if __name__ == "__main__":
    main()
