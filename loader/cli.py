"""`python -m loader {inspect,bench,stage} SOURCE`.

    python -m loader inspect out/                    # counts, shards, feature ranges, feature spec, a sample
    python -m loader inspect ~/tfds/mnist/3.0.1 --split test
    python -m loader bench out/ --batch_size 256     # examples/s on your own data, and which stage bounds it
    python -m loader bench imagenet/ --image image/encoded --threads 8   # images/s: decode + random crop + flip
    python -m loader bench imagenet/ --step-time 0.0376 --workers auto --map images:224   # paced like a training step
    python -m loader bench tokens/ --packing 1024 --batch_size 64   # packed rows of a pre-tokenized corpus
    python -m loader stage gs://bucket/ds /local/ds  # copy to local disk (resumable, size-checked)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from loader.executors.stages import STEADY_SECONDS


def _describe(value) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype}{list(value.shape)}"
    if isinstance(value, (bytes, str)):
        return f"{type(value).__name__}[{len(value)}]"
    return type(value).__name__


def inspect_main(args) -> int:
    import loader
    from dataset_format.manifest import list_features
    from loader.decoding.decode import make_decoder

    source = loader.resolve(args.source, split=args.split, allow_incomplete=True)  # (said below when it is)
    print(f"source: {args.source} ({source.kind})")
    print(f"records: {len(source):,} in {len(source.paths)} shard(s)")
    failed = _failed(args.source) if source.kind == "manifest" else []
    if failed:
        print(f"incomplete: {len(failed)} shard(s) failed to convert (e.g. {failed[0].get('source')}), and their "
              "records are not here; loading it needs allow_incomplete=True (python -m trainer: "
              f"allow_incomplete=true); `python -m pipelines status --output {args.source}` names them")
    for path, n in list(zip(source.paths, source.lengths))[:5]:
        print(f"  {path}: {n:,}")
    if len(source.paths) > 5:
        print(f"  ... {len(source.paths) - 5} more")
    for line in _ranges(source):
        print(line)
    ds = loader.load(source, batch_size=1, shuffle=False, num_epochs=1, decode=None)
    raw = next(iter(ds))[0]
    decoder = make_decoder(args.decode, source.features_dir, tokens_dtype=source.tokens_dtype,
                           lists=list_features(source.feature_stats))
    print(f"record 0: {len(raw)} bytes")
    if decoder is not None:
        try:
            example = decoder(raw)
        except Exception as e:  # noqa: BLE001 - any decoder's error on bytes it was not made for (protobuf's)
            raise ValueError(f"record 0 of {args.source} does not decode as --decode {args.decode} "
                             f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}): records that "
                             "are not tf.train.Examples are shown with --decode none") from None
        print("features:" if isinstance(example, dict) else f"decoded: {_describe(example)}")
        for key, value in sorted(example.items()) if isinstance(example, dict) else ():
            sample = np.array2string(np.asarray(value).ravel()[:8], threshold=8) if isinstance(
                value, (np.ndarray, np.generic, int, float)) else repr(value)[:60]
            print(f"  {key}: {_describe(value)}  e.g. {sample}")
    return 0


def _failed(root: str) -> list[dict]:
    """The shards a conversion's manifest lists as failed."""
    from dataset_format import storage
    from dataset_format.manifest import MANIFEST_NAME, ShardTable

    path = storage.join(root, MANIFEST_NAME)
    text = storage.read_text(path)
    return list(ShardTable.from_json(text, path=path).failed) if text else []


def _ranges(source) -> list[str]:
    """The feature statistics the conversion recorded: each integer feature's range (what num_classes must cover),
    and which features some records lack."""
    stats = source.feature_stats
    if source.tokens_dtype is not None:
        lines = [f"pre-tokenized: each record is one document's token ids ({source.tokens_dtype}) by "
                 f"{source.tokenizer or 'the tokenizer its manifest names'}; no feature ranges"]
        if source.token_count is not None:
            documents = sum(source.records_in_files)
            lines.append(f"tokens: {source.token_count:,} in its shards' {documents:,} documents "
                         f"({source.token_count / documents:,.1f} a document)")
        return lines
    if stats is None:
        why = ("the manifest has none: converted before they were recorded, or records that are not tf.train.Examples; "
               "`python -m pipelines convert --force` records them") if source.kind == "manifest" else \
            f"recorded only by `python -m pipelines convert` (this is a {source.kind} source)"
        return [f"feature ranges: {why}"]
    whole = sum(source.records_in_files)  # (a slice's ranges are those of its shards' every record)
    among = f"; the slice's {len(source):,} are among them" if source.offsets is not None else ""
    lines = [f"feature ranges (over all {whole:,} records, from the manifest{among}):"]
    for key, s in stats.items():
        values = f"{s['min']}..{s['max']}" if "min" in s else "no values" if s["kind"] == "int64" else "present"
        share = "every record" if s["records"] == whole else f"{s['records']:,} of {whole:,} records"
        lines.append(f"  {key}: {s['kind']} {values} ({share}{_lengths(s)})")
    return lines


def _lengths(stats: dict) -> str:
    """How many values a record of the feature holds, where that is not one (recorded since the lengths were)."""
    if "min_length" not in stats or (stats["min_length"], stats["max_length"]) == (1, 1):
        return ""
    low, high = stats["min_length"], stats["max_length"]
    return f", {low} values a record" if low == high else f", {low}-{high} values a record"


def bench_main(args) -> int:
    """Time to the first batch, then examples/s over a start window (the loader ramps its reads up from one
    batch to groups of ~32k records) and over the batches after it (what a long training run sees). With
    --step-time: a consumer that takes a batch every so many seconds, as an accelerator would (paced_main)."""
    import resource

    import loader
    from loader.executors.tuned import idle_core_seconds, loader_cores

    options, unit = _bench_map(args)
    if args.threads:
        options["num_threads"] = args.threads
    started = time.perf_counter()
    batches = loader.load(args.source, batch_size=args.batch_size, split=args.split, seed=0, decode=args.decode,
                          worker_count=args.workers, allow_incomplete=args.allow_incomplete, **options)
    it = iter(batches)
    next(it)
    first = time.perf_counter() - started
    facts = _facts(args, batches.source)
    if args.step_time is not None:
        return _paced(it, args, first, unit, facts)
    rates = []
    for batches in (args.start, args.batches):
        it.stage_times(reset=True)
        t, idle = time.perf_counter(), idle_core_seconds()
        for _ in range(batches):
            next(it)
        rates.append(batches * args.batch_size / max(time.perf_counter() - t, 1e-9))
    elapsed = time.perf_counter() - t
    setting = it.worker_setting()
    report = it.stage_times().report(elapsed, compute_cores=loader_cores(), setting=setting,
                                     tuned=args.workers == "auto", idle=_idle_share(idle, elapsed), **facts)
    it.close()  # also ends the worker processes, whose peak RSS is then counted below
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    worker_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    workers = f", the largest worker {worker_mb:,.0f} MB" if args.workers and worker_mb else ""
    chosen = f" ({setting})" if args.workers == "auto" else ""
    figure = f"{rates[1]:,.0f} {unit}/s" if elapsed >= STEADY_SECONDS else (
        f"no steady rate (they took {elapsed:.2f} s, under {STEADY_SECONDS:.0f} s; take --batches "
        f"{max(args.batches * 10, 100)} or more)")
    start = f"{rates[0]:,.0f}/s" if args.start else "none"
    print(f"first batch {first:.2f} s; {figure} over {args.batches} batches of {args.batch_size} "
          f"after a start window of {args.start} ({start}); peak RSS {peak_mb:,.0f} MB{workers} "
          f"(decode={args.decode}, workers={args.workers}{chosen}, threads={args.threads or 'default'}, "
          f"globally shuffled)")
    print("\n".join(f"  {line}" for line in report.lines()[1:]))
    return 0


def _facts(args, source=None) -> dict:
    """What the report's advice needs of the benched data (`source`: its ShardedSource, resolved here when not given):
    whether its records are token ids (a pre-tokenized dataset decoded by default), and its first shard's
    compression."""
    import loader
    from loader.executors.stages import codec_of
    from loader.format.arrayrecord import read_footer

    if source is None:
        source = loader.resolve(args.source, split=args.split, allow_incomplete=args.allow_incomplete)
    try:
        codec = codec_of(read_footer(source.paths[0], source.shard_bytes[0]).writer_options)
    except (OSError, ValueError, TypeError):  # (sizes not known, a file our reader does not read: general advice)
        codec = None
    return {"tokens": args.decode == "auto" and source.tokens_dtype is not None, "codec": codec}


LONG_WAIT = 0.1  # seconds: the paced bench lists every wait longer than this


def _idle_share(since: float | None, seconds: float) -> float | None:
    """The share of this process's cores idle host-wide over the last `seconds`, from idle_core_seconds() `since`
    (other processes' use counts as busy: a bench beside a training job is told what is really free)."""
    from loader.executors.tuned import idle_core_seconds

    now = idle_core_seconds()
    if since is None or now is None or seconds <= 0:
        return None
    return min(1.0, max(0.0, (now - since) / (seconds * len(os.sched_getaffinity(0)))))


def _paced(it, args, first: float, unit: str, facts: dict) -> int:
    """Takes --start + --batches batches, each followed by --step-time seconds of "compute" (a sleep, as an
    accelerator's step leaves the host's cores to the loader): the rate delivered against the rate asked and the time spent waiting,
    over the batches after the start window (the first groups are all computed at once), and every wait over
    LONG_WAIT with its batch number."""
    from loader.executors.tuned import idle_core_seconds, loader_cores

    step, total = args.step_time, args.start + args.batches
    waits = np.zeros(total + 1)
    t0 = due = time.perf_counter()
    for b in range(1, total + 1):
        if b == args.start + 1:
            it.stage_times(reset=True)
            steady, idle = time.perf_counter(), idle_core_seconds()
        t = time.perf_counter()
        next(it)
        got = time.perf_counter()
        waits[b] = got - t
        # The step starts when both the batch and the device are there, and lasts `step`: a late wake-up of this
        # thread is not a slower device (an accelerator runs its queued steps meanwhile).
        due = max(due, got) + step
        time.sleep(max(0.0, due - time.perf_counter()))
    end = time.perf_counter()
    setting = it.worker_setting()
    after = waits[args.start + 1:]
    report = it.stage_times().report(end - steady, compute_cores=loader_cores(), setting=setting,
                                     tuned=args.workers == "auto", waited=after.sum() / (end - steady),
                                     idle=_idle_share(idle, end - steady), **facts)
    it.close()
    asked = args.batch_size / step

    def rate(batches: int, seconds: float) -> str:
        return f"{batches * args.batch_size / seconds:,.0f}/s ({batches * args.batch_size / seconds / asked:.2f})"

    print(f"paced: a batch of {args.batch_size} every {step * 1e3:,.1f} ms asks {asked:,.0f} {unit}/s; after a start "
          f"window of {args.start} batches, {rate(args.batches, end - steady)} delivered over {args.batches} "
          f"batches, waiting {100 * after.sum() / (end - steady):.1f}% of the time, the longest wait "
          f"{after.max() if len(after) else 0.0:.2f} s; over every batch {rate(total, end - t0)} (first batch "
          f"{first:.2f} s; workers={args.workers}: {setting})")
    long = [(b, w) for b, w in enumerate(waits) if b > args.start and w > LONG_WAIT]
    print(f"  waits over {LONG_WAIT * 1e3:.0f} ms after the start window: {len(long)}" + (": at batch " + ", ".join(
        f"{b} ({w:.2f} s)" for b, w in long[:40]) + (f", ... {len(long) - 40} more" if len(long) > 40 else "")
        if long else ""))
    print("\n".join(f"  {line}" for line in report.lines()[1:]))
    return 0


def _bench_map(args) -> tuple[dict, str]:
    """The bench's map (--image FEATURE, --map images:SIZE, or --packing SEQ_LEN): load options and the unit of its
    rate."""
    size = args.image_size
    if args.map is not None:
        kind, _, value = args.map.partition(":")
        if kind != "images" or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--map takes images:SIZE, e.g. images:224 (got {args.map!r})")
        size = int(value)
    if args.packing is not None:
        if args.image or args.map is not None:
            raise ValueError("--packing times packed token rows: it takes no --image or --map")
        import loader

        return {"packing": loader.Packing(seq_len=args.packing)}, f"rows of {args.packing} tokens"
    if not args.image and args.map is None:
        return {}, "examples"
    from loader.decoding import images

    feature = args.image or _image_feature(args.source, args.split, args.decode)
    return ({"random_map_fn": images.RandomResizedCrop(feature, size=size)},
            f"images ({size}x{size} random-resized crops)")


def _image_feature(source: str, split: str | None, decode) -> str:
    """The first feature of record 0 holding JPEG or PNG bytes (for --map images:SIZE without --image); of a TFDS
    dataset (decoded through its features.json, so its images come decoded), its first Image feature."""
    import loader
    from dataset_format import tfds_info

    features_dir = loader.resolve(source, split=split).features_dir
    features = tfds_info.read_features(features_dir) if features_dir and decode in ("auto", "tfds") else None
    if features is not None:
        images = [k for k, spec in sorted(tfds_info.feature_specs(features).items()) if spec["type"] == "Image"]
        if images:
            return images[0]
    record = next(iter(loader.load(source, batch_size=1, shuffle=False, num_epochs=1, split=split, decode=decode)))
    row = {k: v[0] for k, v in record.items()} if isinstance(record, dict) else {}
    for key, value in sorted(row.items()):
        data = value.item() if isinstance(value, np.ndarray) and value.ndim == 0 else value
        if isinstance(data, bytes) and data[:3] in (b"\xff\xd8\xff", b"\x89PN"):
            return key
    raise ValueError(f"no feature of {source}'s first record holds JPEG or PNG bytes (features: {sorted(row)}); "
                     "name the image feature with --image FEATURE")


def _at_least(low: int, flag: str, what: str):
    """An argparse type: a whole number >= `low`, else one line naming `flag`."""
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            number = None
        if number is None or number < low:
            raise argparse.ArgumentTypeError(f"{flag} takes {what}, a whole number >= {low} (got {value!r})")
        return number
    return parse


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:  # (NaN too)
        raise argparse.ArgumentTypeError(f"--step-time takes a training step's time in seconds, over 0 (got {value!r})")
    return seconds


def _workers(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--workers takes a number of worker processes or auto (got {value!r})")


def stage_main(args) -> int:
    import loader

    result = loader.stage(args.source, args.local_dir, parallelism=args.parallelism)
    print(f"staged {args.source} -> {result.directory}: copied {result.copied} shard(s) "
          f"({result.bytes_copied / 1e6:,.1f} MB), {result.skipped} already there, {result.seconds:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    from dataset_format import logs

    logs.setup()
    p = argparse.ArgumentParser(prog="python -m loader", description="Look at, time and stage converted datasets "
                                "(loading itself is loader.load; its options: docs/loading.md).")
    sub = p.add_subparsers(dest="command", required=True)
    staging = ("copy a gs:// dataset to local disk (checked against its manifest, resumable): training then reads "
               "local files")
    s = sub.add_parser("stage", help=staging, description=staging[0].upper() + staging[1:] + ".")
    s.add_argument("source", help="gs:// dataset: a converted directory or a TFDS array_record directory")
    s.add_argument("local_dir", help="where the copy goes (a directory with a manifest there is complete)")
    s.add_argument("--parallelism", type=_at_least(1, "--parallelism", "the files copied at once"), default=8,
                   help="files copied at once (default 8)")
    s.set_defaults(fn=stage_main, decode="auto")
    helps = {"inspect": "print a dataset's shards, records, feature ranges (each integer feature's min..max), features "
                        "and a first record",
             "bench": "time loader.load on a dataset: the first batch, records/s after a start window, peak memory"}
    for name, fn in (("inspect", inspect_main), ("bench", bench_main)):
        s = sub.add_parser(name, help=helps[name], description=helps[name][0].upper() + helps[name][1:] + ".")
        s.add_argument("source", help="a converted directory, a TFDS array_record directory, or a glob")
        s.add_argument("--split", default=None, help="TFDS split (default train), a slice of one (train[:99%%]), or a "
                       "slice alone for other sources ([99%%:])")
        s.add_argument("--decode", default="auto", help="auto, example, tfds or none")
        s.set_defaults(fn=fn)
        if name == "bench":
            s.add_argument("--batch_size", "--batch-size", type=int, default=256, help="records a batch (default 256)")
            s.add_argument("--start", type=_at_least(0, "--start", "the batches of the start window"), default=100,
                           help="batches timed first (the start window)")
            s.add_argument("--batches", type=_at_least(1, "--batches", "the batches timed after the start window"),
                           default=500, help="batches timed after the start window")
            s.add_argument("--workers", type=_workers, default=0,
                           help="loader worker processes, or auto (tuned as it runs; default 0: threads here)")
            s.add_argument("--threads", type=int, default=0, help="reading/decoding threads (default: the loader's)")
            s.add_argument("--image", default=None, metavar="FEATURE",
                           help="time the image path: decode FEATURE's JPEG/PNG bytes, random-resized crop, flip")
            s.add_argument("--image_size", "--image-size", type=int, default=224, help="--image's crop size (default 224)")
            s.add_argument("--map", default=None, metavar="images:SIZE",
                           help="the image path at SIZE on the first JPEG/PNG feature (or --image's)")
            s.add_argument("--packing", type=int, default=None, metavar="SEQ_LEN",
                           help="a pre-tokenized dataset (convert --tokenizer) packed into rows of SEQ_LEN tokens, as "
                                "the trainer's packing=true reads it; --batch_size counts rows")
            s.add_argument("--allow-incomplete", "--allow_incomplete", dest="allow_incomplete", action="store_true",
                           help="time a dataset whose conversion left shards failed, on the shards that converted")
            s.add_argument("--step-time", "--step_time", type=_seconds, default=None, metavar="SECONDS",
                           help="take a batch every SECONDS, as a training step would: the rate delivered against "
                                "the rate asked, the time waiting, every wait over 100 ms with its batch number")
    args = p.parse_args(argv)
    if args.decode == "none":
        args.decode = None
    try:
        return args.fn(args)
    except (FileNotFoundError, ValueError, OSError) as e:  # (loader.load's advice, said in this command's flags)
        print(f"error: {str(e).replace('decode=None', '--decode none').replace('another decode=', 'another --decode')}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # (a stage records what it copied: the same command resumes it)
        print("interrupted" + (": the same command resumes the staging, skipping what was copied"
                               if args.command == "stage" else ""), file=sys.stderr)
        return 130
