"""Runs a conversion: plan, check, launch the Beam pipeline (if anything changed), summarise.

    outcome = run_conversion(ConvertConfig(input="data/*.tfrecord", output="out/"), ["--runner", "DirectRunner"])
    print(outcome.summary())
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time

from dataset_format import storage
from dataset_format.lease import LEASE_NAME, Lease
from dataset_format.manifest import Manifest
from pipelines import commits, dataflow, local_workers, paths, report, tokens, tasks as shard_tasks
from pipelines.config import ConvertConfig
from pipelines.plan import Plan, make_plan, read_manifest
from pipelines.progress import Progress
from pipelines.shard import LOCAL_TEMP_PREFIX

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Outcome:
    plan: Plan
    manifest: Manifest | None  # None when the run ended at launch: the job writes it
    corrupt_records: int
    seconds: float
    record_bytes: int  # payload bytes of the records converted in this run
    launched: str | None = None  # what was launched when the run did not wait for the job

    @property
    def ok(self) -> bool:
        return self.launched is not None or self.manifest.complete

    @property
    def converted(self) -> int:
        return len(self.plan.tasks) - len(self.manifest.failed)

    def summary(self) -> str:
        if self.launched is not None:
            return f"{self.launched}: {self.plan.describe()}; the job writes manifest.json when it finishes"
        converted = {t.source.path for t in self.plan.tasks} - {f["source"] for f in self.manifest.failed}
        records = sum(s.records for s in self.manifest.shards if s.source in converted)
        rate = f", {records / self.seconds:,.0f} records/s, {self.record_bytes / 1e6 / self.seconds:,.1f} MB/s" \
            if records and self.seconds > 0 else ""
        lines = [
            f"converted {len(converted)} shard(s) ({records:,} records, {self.record_bytes / 1e6:,.1f} MB of record "
            f"data read) in {self.seconds:.1f} s{rate}",
            f"skipped {len(self.plan.kept)} up-to-date shard(s)"
            + (f" and {len(self.plan.recovered)} converted earlier (their commit records)" if self.plan.recovered else "")
            + f"; pruned {len(self.plan.pruned)}; "
            f"orphaned (source gone, kept) {len(self.plan.orphaned)}",
            f"dataset: {len(self.manifest.shards)} shards, {self.manifest.total_records:,} records, "
            + (f"{self.manifest.total_tokens:,} tokens, " if self.manifest.total_tokens is not None else "")
            + f"{self.manifest.total_bytes / 1e6:,.1f} MB of ArrayRecord files",
        ]
        if self.corrupt_records:
            lines.append(f"skipped {self.corrupt_records} corrupt record(s): see {report.REPORT_NAME}")
        for failure in self.manifest.failed:
            lines.append(f"FAILED: {failure['error']}")
        return "\n".join(lines)


def run_conversion(config: ConvertConfig, beam_args: list[str] | None = None, *, wait: bool = True,
                   break_lock: bool = False) -> Outcome:
    """Converts what changed; returns once the manifest in `config.output` is written, or, when
    `wait` is False or the options ask for a job description (`--template_location`), once the
    job is launched. A local run holds the output's lease throughout (dataset_format/lease.py)."""
    started = time.monotonic()
    on_dataflow = bool(beam_args) and dataflow.is_dataflow(_options(beam_args))
    if on_dataflow:
        dataflow.check_remote_paths(config.input, config.output, config.tokenizer)
    # reads only: bad input fails here, before anything is written (a local run plans again, as the lease holder)
    plan = make_plan(config, quiet=not on_dataflow)
    tokens.check_first_record(config, plan.tasks)
    storage.check_writable(config.output)
    if on_dataflow:
        return _run(config, beam_args, wait, started, on_dataflow, plan)
    def held(holder: str) -> str:
        return (f"{config.output} is being converted by another run ({holder}); wait for it to finish, or pass "
                f"--break-lock if that run is dead ({LEASE_NAME} in the output)")

    with Lease(config.output, held=held, break_lock="--break-lock" if break_lock else None):
        _remove_dead_temp_files(config.output)  # the lease holder's alone: no live run owns them
        return _run(config, beam_args, wait, started, on_dataflow, make_plan(config))  # again, as the lease holder


def _run(config: ConvertConfig, beam_args, wait: bool, started: float, on_dataflow: bool, plan: Plan) -> Outcome:
    log.info("plan: %s", plan.describe())
    import apache_beam as beam  # (here: a conversion that stops at its plan, a bad input, imports no Beam)

    from pipelines.convert import ConvertToArrayRecord, finalize

    options = pipeline_options(beam_args or [], num_tasks=len(plan.tasks), tokenize=config.tokenizer is not None,
                               input_bytes=sum(_work(t.source) for t in plan.tasks))
    template = dataflow.template_location(options)
    record_bytes = 0
    # A job description is always written when asked for (a Flex Template launcher waits for one),
    # even with nothing to convert: the job then only rewrites the manifest.
    if plan.tasks or template:
        pipeline = beam.Pipeline(runner=_runner(options), options=options)
        tasks_dir = shard_tasks.dataflow_dir(dataflow.temp_location(options)) if on_dataflow else None
        _ = pipeline | "ConvertToArrayRecord" >> ConvertToArrayRecord(config, plan, tasks_dir)
        local = not (template or on_dataflow)
        with (Progress(config.output, plan.tasks) if local else contextlib.nullcontext(),  # from the commit records
              local_workers.stopped_with_this_process(local and _worker_processes(options))):
            result = pipeline.run()
            if local:
                result.wait_until_finish()
        if template:
            return Outcome(plan, None, 0, time.monotonic() - started, 0,
                           launched=f"job description written to {template} (not submitted)")
        if not wait and on_dataflow:
            return Outcome(plan, None, 0, time.monotonic() - started, 0,
                           launched=f"Dataflow job {result.job_id()} submitted")
        result.wait_until_finish()
        record_bytes = _counter(result, "record_bytes")
        manifest = read_manifest(config.output)
    else:
        # Nothing to convert: no pipeline (a Dataflow job would cost minutes). Rewrite the
        # manifest locally so that pruning and a changed input spelling are recorded.
        manifest = finalize(config, plan, [], [])
    if manifest is not None and manifest.shards and not manifest.failed and not any(e.records for e in manifest.shards):
        raise ValueError(f"every shard of {config.input!r} holds no records ({len(manifest.shards)} shard(s), 0 "
                         "records): there is nothing to load; check the input files and the --input glob")
    body = report.read(config.output) or {}
    return Outcome(plan, manifest, len(body.get("corrupt_records", [])), time.monotonic() - started, record_bytes)


def _remove_dead_temp_files(output: str) -> None:
    """Temporary files a killed run left beside the shards and the commit records (`.tmp-*`, never a committed
    name), and its shard lists. Called only under the output's lease: then no live local run owns them. A Dataflow
    launch (or a job description written) holds no lease and removes nothing: it deleted a live run's shard lists."""
    dead = []
    for directory in (output, storage.join(output, commits.COMMITS_DIR)):  # shards, and commit records
        for name in storage.list_sizes(directory):
            if name.startswith(".tmp-"):
                storage.delete_quietly(storage.join(directory, name))
                dead.append(name)
    dead += _remove_dead_local_shards()
    if dead:
        log.info("removed %d temporary file(s) left by an interrupted run (e.g. %s)", len(dead), dead[0])
    staged = shard_tasks.delete_run(shard_tasks.local_dir(output))
    if staged:
        log.info("removed %d shard-list file(s) left by an interrupted run", staged)


def _remove_dead_local_shards() -> list[str]:
    """The shards of gs:// outputs that killed runs of this host were writing in the temporary directory (whole
    shards, before their upload: pipelines/shard.py), of processes that are gone."""
    import glob
    import tempfile

    dead = []
    for path in glob.glob(os.path.join(tempfile.gettempdir(), LOCAL_TEMP_PREFIX + "*")):
        pid = os.path.basename(path)[len(LOCAL_TEMP_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            try:
                os.remove(path)
            except OSError:  # (removed meanwhile by another run, or not ours to remove)
                continue
            dead.append(os.path.basename(path))
    return dead


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def pipeline_options(beam_args: list[str], *, num_tasks: int, tokenize: bool = False,
                     input_bytes: int | None = None) -> PipelineOptions:
    """Beam options as given; on Dataflow, our package shipped to the workers (`pipelines.dataflow`);
    on the DirectRunner, one worker process per core by default (at most one per BYTES_PER_WORKER of input), one when
    tokenising.

    The ArrayRecord writer holds the GIL, so threads do not convert two shards at once;
    processes do (see docs/benchmarks.md for the measurements behind this default). A worker process costs ~2 s to
    start (it imports Beam), what one process converts ~70 MB in: below BYTES_PER_WORKER a second one costs more
    than it saves, and a small conversion runs in this process (0.4 s for 4 shards of 0.1 MB, against 6 s with two
    worker processes). A tokenising conversion is bound by the tokenizer, whose batch call already runs on every
    core: a second process only contends with it (0.59x a bare loop of the tokenizer with two, 0.81x with one:
    benchmarks/tokenize_bench.py).
    """
    from apache_beam.options.pipeline_options import DirectOptions, StandardOptions

    options = _options(beam_args)
    if dataflow.is_dataflow(options):
        dataflow.ship_package(options)
    runner = options.view_as(StandardOptions).runner
    direct = options.view_as(DirectOptions)
    chosen = any(a.startswith(("--direct_num_workers", "--direct_running_mode")) for a in beam_args)
    if runner in (None, "DirectRunner", "direct") and not chosen:
        by_size = num_tasks if input_bytes is None else max(1, input_bytes // BYTES_PER_WORKER)
        workers = 1 if tokenize else min(num_tasks, os.cpu_count() or 1, by_size)
        if workers > 1:
            direct.direct_num_workers = workers
            direct.direct_running_mode = "multi_processing"
    return options


BYTES_PER_WORKER = 96 << 20


def _worker_processes(options: PipelineOptions) -> bool:
    """Whether the DirectRunner runs this pipeline in worker processes of its own."""
    from apache_beam.options.pipeline_options import DirectOptions

    return options.view_as(DirectOptions).direct_running_mode == "multi_processing"


def _work(source) -> int:
    """A source's share of the work, in bytes as read: a compressed file's size counts 4 times (its bytes
    decompress to several, and decompressing is work too)."""
    return source.size * (1 if source.compression == paths.Compression.UNCOMPRESSED else 4)


def _options(beam_args: list[str]) -> PipelineOptions:
    from apache_beam.options.pipeline_options import PipelineOptions

    return PipelineOptions(beam_args)


def _runner(options: PipelineOptions):
    """The FnApiRunner for local runs (what the DirectRunner picks for batch after trying to
    download Prism); otherwise None, so that Beam builds the runner that --runner names."""
    from apache_beam.options.pipeline_options import StandardOptions

    if options.view_as(StandardOptions).runner in (None, "DirectRunner", "direct"):
        from apache_beam.runners.portability.fn_api_runner import FnApiRunner

        return FnApiRunner()
    return None


def _counter(result, name: str) -> int:
    import apache_beam as beam

    try:
        counters = result.metrics().query(beam.metrics.MetricsFilter().with_name(name))["counters"]
    except Exception:  # noqa: BLE001 - some runners do not report metrics; the summary then omits them
        return 0
    return sum(c.committed or c.attempted or 0 for c in counters)
