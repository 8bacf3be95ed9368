"""`python -m pipelines {convert,verify,make-demo}`.

    python -m pipelines convert --input 'data/train-*.tfrecord' --output out/ [Beam options]
    python -m pipelines convert --input ~/tensorflow_datasets/digits/1.0.0 --output gs://b/digits/1.0.0
    python -m pipelines verify --output out/ [--deep]
    python -m pipelines make-demo --output data/ --num-shards 4

Unknown flags of `convert` are Beam pipeline options and pass through unchanged
(`--runner DataflowRunner --project P --region R --temp_location gs://...`).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from pipelines import logs
from pipelines.config import DEFAULT_COMPRESSION, ConvertConfig

log = logging.getLogger("pipelines")


def _convert_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipelines convert", description=
                                "Convert TFRecord shards (a glob or a TFDS directory) to matched ArrayRecord shards. "
                                "Other flags are Beam pipeline options.")
    p.add_argument("--input", required=True, help="TFRecord file or glob (local or gs://), or a TFDS "
                   "dataset version directory (holding dataset_info.json)")
    p.add_argument("--output", required=True, help="output directory, local or gs://")
    p.add_argument("--compression", default=DEFAULT_COMPRESSION,
                   help="ArrayRecord compression: zstd:N, brotli:N, snappy or uncompressed (default %(default)s)")
    p.add_argument("--writer_options", "--writer-options", dest="writer_options", default=None,
                   help="full ArrayRecord writer options, e.g. 'group_size:1,zstd:1' (overrides --compression)")
    p.add_argument("--skip_corrupt", "--skip-corrupt", dest="skip_corrupt", action="store_true",
                   help="skip corrupt TFRecord frames and list them in OUT/report.json instead of failing the shard")
    p.add_argument("--prune", action="store_true", help="delete outputs whose source no longer exists")
    p.add_argument("--force", action="store_true", help="convert every shard, even up-to-date ones")
    return p


def convert_main(argv: list[str]) -> int:
    args, beam_args = _convert_parser().parse_known_args(argv)
    config = ConvertConfig(input=args.input, output=args.output, compression=args.compression,
                           writer_options=args.writer_options, skip_corrupt=args.skip_corrupt,
                           prune=args.prune, force=args.force)
    from pipelines.run import run_conversion

    outcome = run_conversion(config, beam_args)
    print(outcome.summary())
    return 0 if outcome.ok else 1


def verify_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m pipelines verify",
                                description="Re-check a converted directory against its manifest.")
    p.add_argument("--output", required=True, help="the converted directory (local or gs://)")
    p.add_argument("--deep", action="store_true",
                   help="also compare every record with its TFRecord source, in order")
    args = p.parse_args(argv)
    from pipelines.verify import verify

    started = time.monotonic()
    result = verify(args.output, deep=args.deep)
    for problem in result.problems:
        print(f"PROBLEM: {problem}")
    print(f"verify {'--deep ' if args.deep else ''}{args.output}: {result.shards} shards, {result.records} records, "
          f"{len(result.problems)} problem(s), {time.monotonic() - started:.1f} s")
    return 0 if result.ok else 1


def make_demo_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m pipelines make-demo",
                                description="Write scikit-learn's digits as TFRecord shards of tf.train.Example.")
    p.add_argument("--output", required=True)
    p.add_argument("--num_shards", "--num-shards", dest="num_shards", type=int, default=4)
    args = p.parse_args(argv)
    from pipelines.demo import write_digits_tfrecords

    paths = write_digits_tfrecords(args.output, num_shards=args.num_shards)
    print(f"wrote {len(paths)} TFRecord shards to {args.output}")
    return 0


_COMMANDS = {"convert": convert_main, "verify": verify_main, "make-demo": make_demo_main}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in _COMMANDS:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    logs.setup()
    try:
        return _COMMANDS[argv[0]](argv[1:])
    except (FileNotFoundError, PermissionError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
