"""Incremental planning: which shards to convert, which to keep, which to prune.

A shard is kept (skipped) when the previous manifest lists it with the same source
fingerprint and writer options, and its output file exists with the recorded size.
Everything else is converted. Scheduled refreshes rely on this: a run with no new or
changed shards starts no pipeline at all.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import re

from dataset_format import storage
from dataset_format.manifest import MANIFEST_NAME, Manifest, ShardEntry
from pipelines import commits, paths, tfds_dir, tokens
from pipelines.config import COMPRESSION_NAME, DEFAULT_COMPRESSION, ConvertConfig
from pipelines.paths import InputFile
from pipelines.shard import ShardResult, ShardTask

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Plan:
    kind: str  # "tfrecord" or "tfds"
    tasks: tuple[ShardTask, ...]  # to convert
    kept: tuple[ShardEntry, ...]  # up to date, carried into the new manifest
    orphaned: tuple[ShardEntry, ...]  # source gone; kept unless pruned
    pruned: tuple[ShardEntry, ...]  # source gone; output to delete
    recovered: tuple[ShardResult, ...] = ()  # committed by a run that died before its manifest (pipelines/commits.py)
    input_splits: tuple[str | None, ...] = ()  # the inputs' splits in order (TFDS: dataset_info.json's)

    @property
    def split_order(self) -> tuple[str | None, ...]:
        """The splits in input order (TFDS: the order of dataset_info.json), for the manifest's shard order: the same
        on every run, whichever shards it converts (the splits of this run's tasks came first: a rerun converting only
        `test` shards listed test before train)."""
        return tuple(dict.fromkeys([*self.input_splits, *(t.split for t in self.tasks),
                                    *(r.entry.split for r in self.recovered), *(e.split for e in self.entries_after)]))

    def without_tasks(self) -> FinalizePlan:
        """What the last step needs, without the task list (which would otherwise travel in the job description)."""
        return FinalizePlan(self.kind, (), self.kept, self.orphaned, self.pruned, self.recovered,
                            input_splits=self.split_order)

    def describe(self) -> str:
        recovered = f", {len(self.recovered)} recovered from an interrupted run" if self.recovered else ""
        return (f"{len(self.tasks)} shard(s) to convert, {len(self.kept)} up to date{recovered}, "
                f"{len(self.pruned)} to prune")

    @property
    def entries_after(self) -> tuple[ShardEntry, ...]:
        """Entries that stay in the manifest whatever this run's tasks do."""
        return self.kept + self.orphaned


@dataclasses.dataclass(frozen=True)
class FinalizePlan(Plan):
    """A Plan whose tasks were left out; its `input_splits` hold the split order they gave."""


def read_manifest(output: str) -> Manifest | None:
    path = storage.join(output, MANIFEST_NAME)
    text = storage.read_text(path)
    return None if text is None else Manifest.from_json(text, path=path)


def make_plan(config: ConvertConfig, *, quiet: bool = False) -> Plan:
    """Lists the inputs and the previous manifest; raises before any work on bad input. `quiet`: a check that the
    plan is made again after (its warnings are the second one's)."""
    if tfds_dir.is_tfds_dir(config.input):
        kind = "tfds"
        inputs = [(s.file, s.split, s.expected_records) for s in tfds_dir.list_shards(config.input)]
    else:
        kind = "tfrecord"
        inputs = [(f, None, None) for f in paths.list_inputs(config.input)]
    paths.check_readable([f for f, _, _ in inputs])
    names = paths.output_names([f.path for f, _, _ in inputs])
    paths.check_output_outside([f for f, _, _ in inputs], config.input, config.output)

    previous = read_manifest(config.output)
    if previous is not None and previous.kind != kind:
        raise ValueError(f"{config.output} holds a {previous.kind} conversion of {previous.input!r}; "
                         f"converting {kind} input {config.input!r} there would mix datasets: use another "
                         "--output")
    old = {same_path(e.source): e for e in previous.shards} if previous else {}
    records_there = commits.listing(config.output)
    recorded = {} if config.force else records_there
    existing = storage.list_sizes(config.output) if old or records_there else {}
    options = config.resolved_writer_options
    spec = tokens.spec_for(config)
    tokenized = spec.identity if spec is not None else None

    tasks, kept = [], []
    stale = _rewritten(config.output, [old[f.path] for f, _, _ in inputs if f.path in old], records_there,
                       bool(old) and not records_there and commits.kept(config.output))
    for file, split, expected in inputs:
        relative = names[file.path]
        entry = old.get(file.path)
        reason = _stale(entry, config.force, file, options, tokenized, relative, existing.get(relative))
        if reason is None and entry.path in stale:
            reason = stale[entry.path]
        if reason is None:
            kept.append(entry)
        else:
            tasks.append(ShardTask(file, storage.join(config.output, relative), relative, split, expected, reason,
                                   has_record=relative in records_there))
    recovered = _recover(config.output, tasks, recorded, existing, options, tokenized)
    done = {r.entry.path for r in recovered}
    tasks = [t for t in tasks if t.relative_path not in done]

    sources = {f.path for f, _, _ in inputs}
    produced = set(names.values())  # an old entry whose shard a task writes again (its source moved) is replaced
    gone = [e for e in old.values() if same_path(e.source) not in sources and e.path not in produced]
    # Shards with a commit record that no input makes and the manifest does not list: a first run's that stopped before
    # its manifest (their sources gone since: as the manifest's own), or a --prune run's that stopped after its
    # manifest, before deleting them (pruned by the next --prune)
    listed = {e.path for e in old.values()}
    leftover = [r for r in records_there if r not in produced and r not in listed]
    leftover = [e for e, _ in commits.read(config.output, leftover, known=records_there).values()] if leftover else []
    if previous is None:
        gone += leftover
        leftover = []
    elif leftover and not config.prune and not quiet:
        log.warning("%d shard(s) with a commit record are in no manifest and have no source (e.g. %s, from %s): left "
                    "by a --prune run that stopped; pass --prune to delete them", len(leftover), leftover[0].path,
                    leftover[0].source)
    missing = [e for e in gone if e.path not in existing]  # (a --prune run stopped after deleting them)
    if missing and not quiet:
        log.warning("%d output shard(s) the manifest lists without a source are gone too (e.g. %s): leaving them "
                    "out of the manifest", len(missing), missing[0].path)
    gone = [e for e in gone if e.path in existing]
    if gone and not config.prune:
        _check_orphans(gone, kind, tokenized, config, sorted(sources - old.keys()))
    orphaned, pruned = ((), tuple(gone) + tuple(leftover)) if config.prune else (tuple(gone), ())
    if orphaned and not quiet:
        log.warning("%d output shard(s) have no source matched by this --input any more (e.g. %s); keeping them. "
                    "Pass --prune to delete them.", len(orphaned), orphaned[0].source)
    return Plan(kind, tuple(tasks), tuple(kept), orphaned, pruned, tuple(recovered),
                tuple(dict.fromkeys(split for _, split, _ in inputs)))


_SHARDED = re.compile(r"^(.*)-(\d{5})-of-(\d{5})(.*)$")  # name-00003-of-00016.suffix: one shard of 16


def _check_orphans(gone: list[ShardEntry], kind: str, tokenized: str | None, config: ConvertConfig,
                   new: list[str]) -> None:
    """Raises where keeping the outputs without a source (`gone`) would leave a dataset that is not one: a TFDS
    directory's twin holds its shards alone (TFDS finds them by their names and counts), shards of another
    tokenisation would be read as this one's ids, and the shards of an input written again in another number of
    shards (the same name, another `-of-N`: `new` sources) would hold its records twice."""
    example = f"{gone[0].path} (from {gone[0].source})"
    counts: dict[tuple[str, str], set[str]] = {}
    for source in new:
        named = _SHARDED.match(storage.basename(source))
        if named:
            counts.setdefault((source.rsplit("/", 1)[0] + "/" + named[1], named[4]), set()).add(named[3])
    for entry in gone:
        named = _SHARDED.match(storage.basename(same_path(entry.source)))
        now = counts.get((same_path(entry.source).rsplit("/", 1)[0] + "/" + named[1], named[4])) if named else None
        if now and named[3] not in now:
            raise ValueError(
                f"the input was written again in another number of shards: {storage.basename(entry.source)} is gone "
                f"and shards of the same name -of-{sorted(now)[0]} are new; kept, the old shards (e.g. {entry.path}) "
                "would hold its records a second time: pass --prune to replace them, or convert into a new --output")
    if kind == "tfds":
        raise ValueError(f"{len(gone)} output shard(s) of {config.output} have no source in the TFDS directory "
                         f"{config.input} any more, e.g. {example}: it was built again (another shard count or "
                         "version?), and its ArrayRecord twin must hold its shards alone; pass --prune to delete them")
    other = [e for e in gone if e.tokens != tokenized]
    if other:
        theirs, ours = other[0].tokens or "not tokenised", tokenized or "not tokenised"
        raise ValueError(f"{len(other)} output shard(s) of {config.output} without a source any more were tokenised "
                         f"otherwise ({theirs}) than this run ({ours}), e.g. {other[0].path}: kept, they would mix two "
                         "tokenisations in one dataset; pass --prune to delete them")


def _stale(entry: ShardEntry | None, force: bool, source: InputFile, options: str, tokenized: str | None,
           relative: str, size: int | None) -> str | None:
    """Why the shard of `entry` (None: the manifest has none) is converted, or None: it is up to date."""
    if entry is None:
        return "new: not in the manifest"
    if force:
        return "--force"
    if not source.matches(entry.source_fingerprint):
        return "its source changed"
    if entry.writer_options != options:
        return f"writer options {entry.writer_options} -> {options}"
    if entry.tokens != tokenized:
        return f"tokenisation {entry.tokens or 'none'} -> {tokenized or 'none'}"
    if entry.path != relative:
        return f"its output name {entry.path} -> {relative}"
    if size != entry.bytes:
        return ("its output is missing" if size is None else
                f"its output holds {size:,} bytes, the manifest {entry.bytes:,}")
    return None


def _rewritten(output: str, entries: list[ShardEntry], records_there: dict[str, str | None], kept: bool
               ) -> dict[str, str]:
    """Manifest entries whose shard a later run began to write again: {path: why}. A shard's commit record is
    removed before its file is replaced and written after, so where the output keeps records (`records_there`, or
    `kept`: commits.KEPT_MARK with none there, every shard's removed by runs that stopped before writing one), an
    entry without its record, or with one that describes another file, may name a file an interrupted run replaced
    (an ArrayRecord file often keeps its size across options: its blocks are 64 KiB)."""
    if not (records_there or kept) or not entries:
        return {}
    there = [e.path for e in entries if e.path in records_there]
    records = commits.read(output, there, known=records_there) if there else {}
    why = {}
    for entry in entries:
        record = records.get(entry.path)
        if record is None:
            why[entry.path] = "its commit record is missing: a run that stopped may have been writing it again"
        elif not _same_file(record[0], entry):
            why[entry.path] = "its commit record describes another file than the manifest: a later run wrote it"
    return why


def _same_file(a: ShardEntry, b: ShardEntry) -> bool:
    keys = ("path", "source_fingerprint", "writer_options", "tokens", "records", "bytes")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def same_path(source: str) -> str:
    """A recorded source as this run's inputs spell it: local paths absolute, directories' links resolved (a manifest
    may hold one as it was typed, relative to the directory the command ran in, or through a link)."""
    return storage.resolved(source)


def _recover(output: str, tasks: list[ShardTask], recorded: dict[str, str | None], existing: dict[str, int],
             options: str, tokenized: str | None) -> list[ShardResult]:
    """The tasks already done by an earlier run: a commit record for the same source fingerprint and writer
    options, and the output file there with the recorded size."""
    candidates = [t for t in tasks if t.relative_path in recorded]
    records = commits.read(output, [t.relative_path for t in candidates], known=recorded) if candidates else {}
    recovered = []
    for task in candidates:
        entry, corruptions = records.get(task.relative_path, (None, ()))
        if (entry is not None and same_path(entry.source) == task.source.path
                and task.source.matches(entry.source_fingerprint) and entry.writer_options == options
                and entry.tokens == tokenized and existing.get(task.relative_path) == entry.bytes):
            recovered.append(ShardResult(entry, corruptions))
    return recovered  # (the plan's line says how many: "N recovered from an interrupted run", once, as the lease holder)


def recorded_options(output: str, given: dict) -> dict:
    """The writing, skipping and tokenising options `output`'s manifest records, for those of them not in `given` (the
    flags passed), logged once; {} for an output without a manifest or commit records. Writing: the shards' writer
    options when they all share one. Skipping: --skip-corrupt, when the last run used it. Tokenising: the manifest's
    `tokens` (tokenizer, text_key, add_bos, add_eos), unless --tokenizer is given (its own flags then stand alone).
    An output a first run left without its manifest (killed after committing shards): the writer options of its commit
    records, and a refusal when they were tokenised and --tokenizer is not given (they name no tokenizer file)."""
    try:
        manifest = read_manifest(output)
    except (OSError, ValueError):
        return {}  # unreadable: the plan reads it again and says what is wrong
    if manifest is None:
        return _options_of_commits(output, given)
    kept = _writer_options(collections.Counter(s.writer_options for s in manifest.shards), output, given)
    if manifest.skip_corrupt and "skip_corrupt" not in given:
        kept["skip_corrupt"] = True
    tokens = manifest.tokens or {}
    if tokens.get("tokenizer") and "tokenizer" not in given:
        kept["tokenizer"] = tokens["tokenizer"]
        for key in ("text_key", "add_bos", "add_eos"):
            if key not in given and tokens.get(key) is not None:
                kept[key] = tokens[key]
    _say_kept(output, kept, "from its manifest")
    return kept


def _options_of_commits(output: str, given: dict) -> dict:
    """recorded_options for an output with commit records and no manifest (see there)."""
    recorded = commits.listing(output)
    entries = [entry for entry, _ in commits.read(output, sorted(recorded), known=recorded).values()]
    if not entries:
        return {}
    tokenized = sorted({e.tokens for e in entries if e.tokens})
    if tokenized and "tokenizer" not in given:
        raise ValueError(
            f"{output} holds {len(entries):,} shard(s) that an interrupted first run converted and tokenised "
            f"({tokenized[0]}), and no manifest to say with which tokenizer file: pass the same --tokenizer (and "
            "--text-key, --add-bos, --add-eos) to keep them, or --tokenizer none to convert them all again as they are")
    kept = _writer_options(collections.Counter(e.writer_options for e in entries), output, given)
    _say_kept(output, kept, f"from the commit records of {len(entries):,} shard(s) an interrupted first run converted")
    return kept


def _writer_options(writers: collections.Counter, output: str, given: dict) -> dict:
    """{"compression": ...} or {"writer_options": ...}: the shards' writer options when no flag chose; where they
    differ (shards kept without a source from an earlier run), those of most shards, said."""
    if {"compression", "writer_options"} & set(given) or not writers:
        return {}
    (writer, most), *others = writers.most_common()
    if others and others[0][1] == most:
        log.warning(
            "%s's shards were written with %d sets of writer options, as many with each (%s): converting with the "
            "default %s; pass --compression or --writer-options to choose", output, len(writers),
            ", ".join(sorted(writers)[:3]), DEFAULT_COMPRESSION)
        return {}
    if others:
        log.warning("%s's shards were written with %d sets of writer options: keeping those of most of them, %s (%d "
                    "of %d shards); pass --compression or --writer-options to choose", output, len(writers), writer,
                    most, sum(writers.values()))
    parts = writer.split(",")
    if parts[0] == "group_size:1" and len(parts) == 2 and COMPRESSION_NAME.match(parts[1]):
        return {"compression": parts[1]} if parts[1] != DEFAULT_COMPRESSION else {}
    return {"writer_options": writer}


def _say_kept(output: str, kept: dict, where: str) -> None:
    if kept:
        log.info("keeping %s's options (%s): %s; pass the flags to change them", output, where,
                 " ".join(f"--{k.replace('_', '-')} {v}" for k, v in kept.items()))
