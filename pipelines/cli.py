"""`python -m pipelines {convert,plan,verify,status,make-demo,tokenizer}`.

    python -m pipelines convert --input 'data/train-*' --output out/train [Beam options]
    python -m pipelines convert --input ~/tensorflow_datasets/digits/1.0.0 --output gs://my-bucket/digits/1.0.0
    python -m pipelines plan --input 'gs://my-bucket/raw/*.tfrecord' --output gs://my-bucket/ar [--json plan.json]
    python -m pipelines verify --output out/ [--deep]
    python -m pipelines status --output gs://my-bucket/ar      # how far a running conversion has got
    python -m pipelines make-demo --output data/ --num-shards 4 [--kind digits|text|digits-jpeg|imagenet|photos]
    python -m pipelines tokenizer --input 'raw/text-*' --kind bpe --vocab_size 32000 --output tokenizer.json

Other flags of `convert` are Beam pipeline options and pass through unchanged
(`--runner DataflowRunner --project P --region R --temp_location gs://...`: see dataflow/README.md); a flag that is
neither ours nor Beam's is an error naming it.
`plan` says what `convert` would do (a scheduled refresh launches no job when it finds nothing).
`tokenizer` trains the tokenizer `convert --tokenizer` takes, on a sample of the shards' text (pipelines/text_sample.py).
Boolean flags also take a value (`--prune=true`), as Flex Template launches pass them.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import math
import os
import re
import sys
import time

from dataset_format import booleans, logs, suggest
from dataset_format.lease import LeaseHeld
from pipelines.config import ConvertConfig, DEFAULT_COMPRESSION

log = logging.getLogger("pipelines")


def _boolean(text: str) -> bool:
    value = booleans.parse(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not true or false (or {'/'.join(booleans.TRUE[1:])}, "
                                         f"{'/'.join(booleans.FALSE[1:])})")
    return value


def _flag(p: argparse.ArgumentParser, name: str, help: str, default: bool | None = False) -> None:
    """`--name`, `--name=true|false` and the dashed spelling `--na-me`."""
    flags = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
    p.add_argument(*flags, dest=name, nargs="?", const=True, default=default, type=_boolean, metavar="BOOL",
                   help=help)


class _Parser(argparse.ArgumentParser):
    """A required flag reported missing names a misspelt one given instead (`--ouput` for `--output`)."""

    def parse_known_args(self, args=None, namespace=None):
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message):
        if "arguments are required" in message:
            ours = self.long_flags()
            given = [a.split("=", 1)[0] for a in getattr(self, "_given", []) if a.startswith("--")]
            close = [f"{g} ({hint})" for g in given if g not in ours if (hint := suggest.did_you_mean([g], ours, 0.75))]
            if close:
                message += f"; given instead: {', '.join(close)}"
        super().error(message)

    def long_flags(self) -> list[str]:
        return [o for a in self._actions for o in a.option_strings if o.startswith("--")]


class _Once(argparse.Action):
    """A flag given once: a second --input is an error, not a silent replacement of the first."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{option_string} given twice ({getattr(namespace, self.dest)}, then {values}): a conversion "
                         "takes one (a glob or a directory); convert each into an output of its own and mix them in "
                         "training (python -m trainer data=a=OUT_A,b=OUT_B weights=a=1,b=1)")
        setattr(namespace, self.dest, values)


def _convert_parser(prog: str = "python -m pipelines convert") -> argparse.ArgumentParser:
    """The conversion's flags; dataflow/metadata.json declares the same ones (a test checks)."""
    p = _Parser(prog=prog, description=
                                "Convert TFRecord shards (a glob or a TFDS directory) to matched ArrayRecord shards. "
                                "Other flags are Beam pipeline options.")
    p.add_argument("--input", required=True, action=_Once, help="TFRecord file or glob (local or gs://), or a TFDS "
                   "dataset version directory (holding dataset_info.json)")
    p.add_argument("--output", required=True, help="output directory, local or gs://")
    p.add_argument("--compression", default=None,
                   help="ArrayRecord compression: zstd:N, brotli:N, snappy or uncompressed (default: the output's, "
                   f"from its manifest; {DEFAULT_COMPRESSION} for a new output)")
    p.add_argument("--writer_options", "--writer-options", dest="writer_options", default=None,
                   help="full ArrayRecord writer options, e.g. 'group_size:1,zstd:1' (overrides --compression)")
    _flag(p, "skip_corrupt", "skip corrupt TFRecord frames and list them in OUT/report.json instead of failing "
                             "the shard (default: as the output's last conversion did, from its manifest; else false)",
          default=None)
    _flag(p, "prune", "delete outputs whose source no longer exists")
    _flag(p, "force", "convert every shard, even up-to-date ones")
    p.add_argument("--tokenizer", default=None, help="a Hugging Face tokenizer.json or SentencePiece .model (or a "
                   "model directory holding one): write each record's text as token ids, with a token count column, "
                   "for packing (docs/converting.md; default: the output's tokenisation, from its manifest, if it has "
                   "one; none: copy the records)")
    p.add_argument("--text_key", "--text-key", dest="text_key", default=None,
                   help="with --tokenizer: the tf.Example feature holding the text (default: text)")
    p.add_argument("--add_bos", "--add-bos", dest="add_bos", nargs="?", const=True, default=None, type=_boolean,
                   metavar="BOOL", help="with --tokenizer: begin each document with BOS (default: as the tokenizer does)")
    _flag(p, "add_eos", "with --tokenizer: end each document with the tokenizer's EOS id", default=None)
    return p


# Flags of `convert` that are not conversion parameters (and so not in dataflow/metadata.json).
LAUNCH_FLAGS = ("no_wait", "break_lock")


def _config(args: argparse.Namespace) -> ConvertConfig:
    """The flags given; those not given keep what the output's manifest recorded (a rerun or a scheduled refresh
    that names only --input and --output keeps a zstd or pre-tokenized dataset as it is), else the defaults."""
    given = {"compression": args.compression, "writer_options": args.writer_options, "tokenizer": args.tokenizer,
             "text_key": args.text_key, "add_bos": args.add_bos, "add_eos": args.add_eos,
             "skip_corrupt": args.skip_corrupt}
    from pipelines.plan import recorded_options

    given = {k: v for k, v in given.items() if v is not None}
    if given.get("tokenizer", "").lower() == "none":  # --tokenizer none: records copied as they are, whatever was kept
        given["tokenizer"] = None
    return ConvertConfig(input=args.input, output=args.output, prune=args.prune, force=args.force,
                         **recorded_options(args.output, given), **given)


def convert_main(argv: list[str]) -> int:
    p = _convert_parser()
    _flag(p, "no_wait", "on Dataflow, return once the job is submitted (the job writes the manifest last)")
    _flag(p, "break_lock", "take over the output's lease from a run known to be dead (OUT/.lease.json)")
    args, beam_args = p.parse_known_args(argv)
    unknown = unknown_beam_flags(beam_args) if beam_args else []  # (none given: no Beam imported to say so)
    flags = [a for a in unknown if a.startswith("-")]
    if flags:  # Beam would drop them with a warning: a misspelled --tokenizer would convert untokenised
        p.error(f"unrecognized arguments: {' '.join(flags)} (neither a flag of convert, listed by --help, nor a Beam "
                f"pipeline option){did_you_mean(flags, p.long_flags())}")
    if unknown:  # Beam would drop them too: an --input glob the shell expanded converts its first file only
        p.error(f"{len(unknown)} argument(s) that no flag takes: {' '.join(unknown[:3])}"
                f"{' ...' if len(unknown) > 3 else ''}; if the shell expanded an --input glob, quote it "
                f"(--input '{os.path.dirname(args.input) or '.'}/...*'), so that every file it matches is converted")
    _needs_beam()
    from pipelines.run import run_conversion

    outcome = run_conversion(_config(args), beam_args, wait=not args.no_wait, break_lock=args.break_lock)
    print(outcome.summary())
    return 0 if outcome.ok else 1


def _needs_beam() -> None:
    """A conversion imports Beam once its plan is made: an install without it is said before the plan, by the
    extras' one line (pipelines/__main__.py), without importing it."""
    import importlib.util

    try:
        found = importlib.util.find_spec("apache_beam") is not None
    except ValueError:  # (in sys.modules as None: made unimportable)
        found = False
    if not found:
        raise ModuleNotFoundError("No module named 'apache_beam'", name="apache_beam")


def _beam_parser():
    from apache_beam.options.pipeline_options import PipelineOptions, _BeamArgumentParser

    parser = _BeamArgumentParser(allow_abbrev=False)
    classes = {str(cls): cls for cls in PipelineOptions.__subclasses__()}
    for cls in classes.values():
        cls._add_argparse_args(parser)  # noqa: SLF001 - how PipelineOptions.get_all_options builds the same parser
    return parser


def unknown_beam_flags(beam_args: list[str]) -> list[str]:
    """The arguments in `beam_args` that no Beam pipeline options class takes: flags it does not declare, and values
    no flag takes (Beam itself only warns and drops them)."""
    _, unknown = _beam_parser().parse_known_args(beam_args)
    return unknown


# gcloud's names for Dataflow options (`gcloud dataflow flex-template run`), and Beam's for a direct launch.
GCLOUD_FLAGS = {"--max-workers": "--max_num_workers", "--num-workers": "--num_workers",
                "--worker-machine-type": "--machine_type", "--service-account-email": "--service_account_email",
                "--staging-location": "--staging_location", "--temp-location": "--temp_location",
                "--worker-region": "--worker_region", "--worker-zone": "--worker_zone",
                "--disable-public-ips": "--no_use_public_ips"}


def did_you_mean(flags: list[str], ours: list[str]) -> str:
    """' (did you mean X?)' for each of `flags` with a close match among `ours` and Beam's options (gcloud's names
    of Dataflow options mapped to Beam's); '' when none is close."""
    known = ours + [o for a in _beam_parser()._actions for o in a.option_strings if o.startswith("--")]  # noqa: SLF001
    close = [f"{name}: {hint}" for name in (f.split("=", 1)[0] for f in flags)
             if (hint := f"did you mean {GCLOUD_FLAGS[name]}?" if name in GCLOUD_FLAGS else
                 suggest.did_you_mean([name], known, 0.75))]
    return f" ({'; '.join(close)})" if close else ""


def plan_main(argv: list[str]) -> int:
    p = _convert_parser("python -m pipelines plan")
    p.description = "Say what `convert` with the same flags would do, without doing it."
    p.add_argument("--json", default=None, help="also write the plan as JSON to this local path")
    args = p.parse_args(argv)
    from pipelines.plan import make_plan

    plan = make_plan(_config(args))
    body = {"input": args.input, "output": args.output, "to_convert": [t.source.path for t in plan.tasks],
            "why": {t.source.path: t.reason for t in plan.tasks},  # each shard to convert: why
            "up_to_date": len(plan.kept), "to_prune": [e.path for e in plan.pruned],
            "orphaned": [e.path for e in plan.orphaned],
            # converted by a run that ended before its manifest: a run (converting nothing more) lists them in it
            "recovered": [r.entry.path for r in plan.recovered]}
    for task in plan.tasks:
        print(f"convert {task.source.path} ({task.reason})")
    for path in body["to_prune"]:
        print(f"prune {path}")
    todo = "" if plan.tasks or plan.pruned else (
        f": manifest.json lacks {len(plan.recovered)} converted shard(s), which `convert` with these flags adds "
        "(converting nothing)" if plan.recovered else ": nothing to do")
    print(f"plan: {plan.describe()}{todo}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(body, f, indent=1)
    return 0


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
    gone, unlisted, behind = ([s for s in result.stale if s.kind == kind] for kind in ("gone", "unlisted", "changed"))
    if unlisted:
        print(f"note: {len(unlisted)} source directory(ies) cannot be listed from this host (e.g. {unlisted[0]}): "
              "whether their sources changed since the conversion is not known")
    if behind:
        print(f"note: {len(behind)} source(s) changed since they were converted (e.g. {behind[0]}): the dataset is "
              "whole but behind its input; `python -m pipelines convert` with the same --input and --output converts "
              "them again")
    if gone and result.staged_from is not None:  # (a training host's copy: its sources are seldom there)
        print(f"note: {len(gone)} source(s) of the conversion are not on this host (e.g. {gone[0]}): a staged "
              f"copy's are where it was converted; verify {result.staged_from} there to compare with them")
    elif gone:
        print(f"note: {len(gone)} source(s) gone since they were converted (e.g. {gone[0]}): their shards are still "
              "in the dataset; `python -m pipelines convert` with the same --input and --output and --prune deletes "
              "them")
    if result.uncompared:
        print(f"note: {len(result.uncompared)} shard(s) were read whole, each chunk's hash checked (and a "
              "pre-tokenized shard's token counts), but not compared with their sources (e.g. "
              f"{result.uncompared[0]})")
    if result.restage:
        print(f"note: this is a staged copy of {result.staged_from}, and {len(result.restage)} of its shards changed "
              f"there since they were staged (e.g. {result.restage[0]}): `python -m loader stage "
              f"{result.staged_from} {args.output}` copies them again")
    print(f"verify {'--deep ' if args.deep else ''}{args.output}: {result.shards:,} shards, {result.records:,} "
          f"records, {len(result.problems)} problem(s), {time.monotonic() - started:.1f} s")
    return 0 if result.ok else 1


def make_demo_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m pipelines make-demo",
                                description="Write a demo dataset as TFRecord shards of tf.train.Example: scikit-learn's "
                                            "digits (image, label), the digits as JPEG files in the ImageNet layout "
                                            "(digits-jpeg; imagenet: also in ImageNet's file names, train-* and "
                                            "validation-*, and its 1-based labels), ImageNet-like JPEG photos "
                                            "(photos), or the Python standard library's sources (text).")
    p.add_argument("--output", required=True)
    p.add_argument("--kind", choices=("digits", "digits-jpeg", "imagenet", "photos", "text"), default="digits")
    p.add_argument("--count", type=int, default=3000, help="photos: how many (default 3000)")
    p.add_argument("--num_shards", "--num-shards", dest="num_shards", type=int, default=4)
    p.add_argument("--max_mb", "--max-mb", dest="max_mb", type=float, default=4.0,
                   help="text: how many MB of sources to take (default 4)")
    args = p.parse_args(argv)
    for flag, value, ok in (("--count", args.count, args.count >= 1), ("--num_shards", args.num_shards,
                                                                        args.num_shards >= 1),
                            ("--max_mb", args.max_mb, math.isfinite(args.max_mb) and args.max_mb > 0)):
        if not ok:
            raise ValueError(f"{flag} {value:g} must be above 0")
    try:
        return _make_demo(args)
    except ModuleNotFoundError as e:
        package = {"sklearn": "scikit-learn", "PIL": "Pillow"}.get((e.name or "").split(".")[0])
        if package is None:
            raise
        raise ValueError(f"make-demo --kind {args.kind} needs {package}, which the demo extra installs: pip install "
                         "\".[demo]\" (or pip install " + package + ")") from None


def _make_demo(args) -> int:
    from pipelines import demo

    if args.kind == "text":
        paths = demo.write_text_tfrecords(args.output, num_shards=args.num_shards,
                                          max_bytes=int(args.max_mb * (1 << 20)))
    elif args.kind in ("digits-jpeg", "imagenet"):
        paths = demo.write_digits_jpeg_tfrecords(args.output, num_shards=args.num_shards,
                                                 imagenet_files=args.kind == "imagenet")
    elif args.kind == "photos":
        paths = demo.write_photo_tfrecords(args.output, args.count, num_shards=args.num_shards)
    else:
        paths = demo.write_digits_tfrecords(args.output, num_shards=args.num_shards)
    globs = collections.Counter(re.sub(r"-\d+-of-\d+$", "-*", os.path.basename(p)) for p in paths)
    print(f"wrote {len(paths)} TFRecord shards to {args.output}: "
          + ", ".join(f"{glob} ({n:,} shard{'s' if n != 1 else ''})" for glob, n in globs.items()))
    return 0


def status_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m pipelines status",
                                description="How far a conversion of OUT has got (local or Dataflow), from its "
                                            "commit records, lease and manifest.")
    p.add_argument("--output", required=True)
    args = p.parse_args(argv)
    from dataset_format import storage
    from pipelines.progress import status

    if not storage.is_remote(args.output) and os.path.isfile(args.output):
        raise ValueError(f"--output {args.output} is a file: name a conversion's output directory")
    if not storage.is_remote(args.output) and not os.path.isdir(args.output):
        raise FileNotFoundError(f"--output {args.output} does not exist: no conversion has written there (check the "
                                "path)")
    print(status(args.output))
    return 0


def tokenizer_main(argv: list[str]) -> int:
    from dataset_format.tokenizer import add_training_arguments, check_training_arguments, train_and_report

    p = argparse.ArgumentParser(prog="python -m pipelines tokenizer",
                                description="Train a tokenizer on the text of TFRecord shards of tf.train.Example, "
                                            "for `convert --tokenizer`: on a sample of the shards past --max_bytes.")
    p.add_argument("--input", required=True, action="append",
                   help="the shards, as `convert --input` takes them (local or gs://); repeat it to train one "
                   "tokenizer on several corpora (a mixture's, which must share one)")
    add_training_arguments(p)
    args = p.parse_args(argv)
    check_training_arguments(args)
    from pipelines.paths import ConvertedInput
    from pipelines.text_sample import sample_texts

    try:
        sample = sample_texts(args.input, args.text_key, int(args.max_bytes), args.seed)
    except ConvertedInput as e:  # (its text is there, in ArrayRecord: trainer.tokenizer reads converted datasets)
        raise ValueError(f"--input {e.path} is a converted dataset (ArrayRecord), and this command reads "
                         f"TFRecords: `python -m trainer.tokenizer {e.path}` with the same options trains one on its "
                         "text") from None
    if not sample.texts:
        raise ValueError(f"--input {' '.join(args.input)}: its {sample.shards:,} shard(s) hold no records, so there is "
                         "no text to train a tokenizer on")
    return train_and_report(args, sample.texts, sample.describe(int(args.max_bytes)))


_COMMANDS = {"convert": convert_main, "plan": plan_main, "verify": verify_main, "status": status_main,
             "make-demo": make_demo_main, "tokenizer": tokenizer_main}


def main(argv: list[str] | None = None, *, process: bool = False) -> int:
    """The command's exit status. `process`: the command is this process (`python -m pipelines`), which ends at once
    after a stop (pipelines/__main__.py)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    if not argv or argv[0] not in _COMMANDS:
        print(__doc__.strip(), file=sys.stderr)
        if argv:
            print(f"error: {argv[0]!r} is not a command; the commands are {', '.join(_COMMANDS)}", file=sys.stderr)
        return 2
    logs.setup()
    sigterm = _SigTerm.install()
    try:
        return _COMMANDS[argv[0]](argv[1:])
    except (OSError, ValueError, LeaseHeld) as e:  # (a missing or unreadable path, a file where a directory goes)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, RuntimeError) as e:  # after Beam's own lines from its workers: what was kept, what to do
        if not _interrupted(e):
            raise
        if argv[0] == "convert" and any("DataflowRunner" in a for a in argv):  # only the wait was interrupted
            what = (": the Dataflow job goes on and writes the manifest when it ends (its id is in the log above); "
                    "stop it with `gcloud dataflow jobs cancel JOB_ID --region REGION`, or let it finish, before "
                    "converting to this output again")
        elif argv[0] == "convert":
            what = (": the shards committed so far are kept; run the same command again to finish (it converts only "
                    "what is left)")
        else:
            what = ""
        if process:  # Beam's in-process workers may still run, and log: the line below is the last
            logging.disable(logging.CRITICAL)
        sys.stderr.write(f"{'stopped by SIGTERM' if sigterm.received else 'interrupted'}{what}\n")  # (one write)
        sys.stderr.flush()
        return 143 if sigterm.received else 130


class _SigTerm:
    """A SIGTERM (a pod or VM stopped, `kill`) unwinds the command as Ctrl-C does: the lease given back, the workers
    stopped, one line on what was kept. Its default action ended the process at once, and the output's lease then held
    off a restart until it lapsed."""

    def __init__(self):
        self.received = False

    @classmethod
    def install(cls) -> _SigTerm:
        import signal
        import threading

        handler = cls()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, handler)
        return handler

    def __call__(self, *_) -> None:
        if not self.received:  # (a second one while the command unwinds is the same request)
            self.received = True
            raise KeyboardInterrupt("SIGTERM")


def _interrupted(error: BaseException) -> bool:
    """Whether `error` is Ctrl-C: a KeyboardInterrupt, or one that Beam's in-process runner re-raised from a DoFn as
    RuntimeError("KeyboardInterrupt [while running ...]")."""
    seen = 0
    while error is not None and seen < 20:
        if isinstance(error, KeyboardInterrupt) or str(error).startswith("KeyboardInterrupt"):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False
