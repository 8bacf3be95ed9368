"""The conversion pipeline: TFRecord shards -> matched ArrayRecord shards, a manifest and a report.

Elements are shards, not records: each worker streams one whole shard from source to
output (see `pipelines.shard`), so records never pass through Beam's shuffle and a
worker's memory stays flat however large a shard is. A `Reshuffle` spreads the shards
across workers (both cores on the DirectRunner, many workers on Dataflow).

    plan = make_plan(config)
    with beam.Pipeline(options=options) as p:
        _ = p | ConvertToArrayRecord(config, plan)
"""

from __future__ import annotations

import logging

import apache_beam as beam
from apache_beam.metrics import Metrics

from dataset_format import storage
from dataset_format.manifest import COUNTS_SUFFIX, MANIFEST_NAME, Manifest
from pipelines import commits, local_workers, report, tasks as shard_tasks, tfds_dir
from pipelines.config import ConvertConfig
from pipelines.plan import Plan
from pipelines.shard import ShardCountMismatch, ShardResult, ShardTask, convert_shard
from pipelines.tfrecord import CorruptRecordError
from pipelines.tokens import TextKeyError, TokenizeSpec, spec_for
from pipelines.version import TOOL_VERSION

log = logging.getLogger(__name__)

_NAMESPACE = "pipelines.convert"
FAILED = "failed"
SHARD_LINES_UP_TO = 36  # a line per converted shard at INFO up to this many shards; past it, the progress line


def _names_output(e: OSError, output_dir: str) -> bool:
    """Whether an error names a path under the output (its filename, or a gs:// error's message, which begins with
    the object's path): a permission the output's side lacks, not the source's."""
    root = storage.absolute(output_dir).rstrip("/") + "/"
    return any(isinstance(named, str) and named and storage.absolute(named).startswith(root)
               for named in (e.filename, e.filename2, str(e).split(": ", 1)[0]))


class _ConvertShardFn(beam.DoFn):
    """Converts one shard; a shard with bad data goes to the FAILED output, never half-written."""

    def __init__(self, writer_options: str, skip_corrupt: bool, shard_log_level: int = logging.INFO,
                 tokenize: TokenizeSpec | None = None):
        self._writer_options = writer_options
        self._skip_corrupt = skip_corrupt
        self._shard_log_level = shard_log_level
        self._tokenize = tokenize

    def setup(self):
        local_workers.take_ctrl_c_silently()  # (in a local worker process: the command handles a Ctrl-C)
        self._records = Metrics.counter(_NAMESPACE, "records_written")
        self._bytes_read = Metrics.counter(_NAMESPACE, "record_bytes")
        self._bytes_written = Metrics.counter(_NAMESPACE, "bytes_written")
        self._converted = Metrics.counter(_NAMESPACE, "shards_converted")
        self._failed = Metrics.counter(_NAMESPACE, "shards_failed")
        self._corrupt = Metrics.counter(_NAMESPACE, "corrupt_records_skipped")

    def _progress(self, records: int, nbytes: int) -> None:
        self._records.inc(records)
        self._bytes_read.inc(nbytes)

    def process(self, task: ShardTask):
        try:
            result = convert_shard(task, writer_options=self._writer_options, skip_corrupt=self._skip_corrupt,
                                   on_records=self._progress, tokenize=self._tokenize)
        except (CorruptRecordError, ShardCountMismatch, TextKeyError, PermissionError, FileNotFoundError) as e:
            # Retrying would fail the same way: the shard is reported, the other shards go on.
            if isinstance(e, PermissionError) and _names_output(e, task.output_dir):  # writing the shard or its
                error = f"{e} (the output: the converted shards are kept; rerun once it can be written)"  # record
            elif isinstance(e, PermissionError):
                error = (f"{task.source.path} cannot be read (permission denied); grant read access and rerun (the "
                         "converted shards are kept)")
            elif isinstance(e, FileNotFoundError):
                if storage.exists(task.source.path):
                    raise  # (not the source: the output's side)
                error = (f"{task.source.path} is gone: it was deleted or moved while the run converted it; rerun (the "
                         "converted shards are kept; --prune deletes the outputs of sources that are gone)")
            else:
                error = str(e)
            self._failed.inc()
            log.error("shard failed, no output written for it: %s", error)
            yield beam.pvalue.TaggedOutput(FAILED, {"source": task.source.path, "error": error})
            return
        self._converted.inc()
        self._bytes_written.inc(result.entry.bytes)
        self._corrupt.inc(len(result.corruptions))
        log.log(self._shard_log_level, "converted %s -> %s: %d records, %.1f MB written", task.source.path,
                task.relative_path, result.entry.records, result.entry.bytes / 1e6)
        yield result


class ConvertShards(beam.PTransform):
    """Staged task files -> `converted` (ShardResult) and `failed` ({source, error}) PCollections.

    The job description holds only the task files' names (pipelines/tasks.py); the workers read the tasks and
    one Reshuffle spreads them (a Create of the tasks themselves would inline them, and reshuffle once more)."""

    def __init__(self, task_files: list[str], num_tasks: int, writer_options: str, skip_corrupt: bool,
                 tokenize: TokenizeSpec | None = None):
        super().__init__()
        self._task_files = task_files
        self._num_tasks = num_tasks
        self._writer_options = writer_options
        self._skip_corrupt = skip_corrupt
        self._tokenize = tokenize

    def expand(self, pbegin):
        return (
            pbegin
            | "ListShards" >> beam.Create(self._task_files, reshuffle=False)
            | "ReadShardList" >> beam.FlatMap(shard_tasks.read)
            | "Distribute" >> beam.Reshuffle()
            | "ConvertShard" >> beam.ParDo(_ConvertShardFn(
                self._writer_options, self._skip_corrupt,
                logging.INFO if self._num_tasks <= SHARD_LINES_UP_TO else logging.DEBUG, self._tokenize))
            .with_outputs(FAILED, main="converted")
        )


class ConvertToArrayRecord(beam.PTransform):
    """Converts the plan's shards, then writes the report, TFDS metadata and manifest once."""

    def __init__(self, config: ConvertConfig, plan: Plan, tasks_dir: str | None = None):
        """`tasks_dir`: where the shard list is staged (pipelines/tasks.py; default OUT/.tasks)."""
        super().__init__()
        self._config = config
        self._plan = plan
        self._run_id = shard_tasks.new_run_id()
        self._tasks_dir = tasks_dir or shard_tasks.local_dir(config.output)

    def expand(self, pbegin):
        task_files = shard_tasks.stage(self._plan.tasks, self._tasks_dir, self._run_id)
        plan_file = shard_tasks.stage_plan(self._plan.without_tasks(), self._tasks_dir, self._run_id)
        shards = pbegin | "Convert" >> ConvertShards(
            task_files, len(self._plan.tasks), self._config.resolved_writer_options, self._config.skip_corrupt,
            spec_for(self._config))
        return (
            pbegin
            | "Once" >> beam.Create([None])
            | "WriteManifest" >> beam.Map(
                _finalize_once, self._config, plan_file, self._tasks_dir, self._run_id,
                converted=beam.pvalue.AsList(shards.converted),
                failed=beam.pvalue.AsList(shards.failed))
        )


def _finalize_once(_, config: ConvertConfig, plan_file: str, tasks_dir: str, run_id: str, converted,
                   failed) -> Manifest:
    manifest = finalize(config, shard_tasks.read_plan(plan_file), list(converted), list(failed))
    shard_tasks.delete_run(tasks_dir, run_id)
    return manifest


def finalize(config: ConvertConfig, plan: Plan, converted: list[ShardResult], failed: list[dict]) -> Manifest:
    """Writes report.json, the TFDS metadata and manifest.json (the commit point), then prunes (a run stopped before
    its manifest leaves the pruned shards listed and there)."""
    converted = list(plan.recovered) + converted  # shards an interrupted run committed count as converted now
    split_rank = {split: rank for rank, split in enumerate(plan.split_order)}
    entries = sorted(plan.entries_after + tuple(r.entry for r in converted),
                     key=lambda e: (split_rank.get(e.split, 0), e.source))
    failed = sorted(failed, key=lambda f: f["source"])
    report.write(config.output, converted=converted, failed=failed, kept_sources={e.source for e in entries})
    if plan.kind == "tfds" and not failed:
        lengths: dict[str, list[int]] = {}
        for e in entries:
            lengths.setdefault(e.split, []).append(e.records)
        tfds_dir.write_metadata(config.input, config.output, lengths)
    spec = spec_for(config)
    manifest = Manifest(input=config.input, kind=plan.kind, shards=tuple(entries),
                        tool_version=TOOL_VERSION, failed=tuple(failed),
                        tokens=spec.manifest() if spec is not None else None, skip_corrupt=config.skip_corrupt)
    storage.write_text(storage.join(config.output, MANIFEST_NAME), manifest.to_json())
    for entry in plan.pruned:
        log.info("pruning %s: its source %s is gone", entry.path, entry.source)
        storage.delete_quietly(storage.join(config.output, entry.path))
        if entry.tokens is not None:
            storage.delete_quietly(storage.join(config.output, entry.path) + COUNTS_SUFFIX)
        commits.delete(config.output, entry.path)
    return manifest
