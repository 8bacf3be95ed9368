"""Converting one TFRecord shard into one ArrayRecord shard: same records, same order.

The shard streams: one record is in memory at a time, so a worker's memory does not grow
with the shard. The output is written under a temporary name, its record count is checked
against what was read, and only then is it committed under its final name (renamed
locally, uploaded and renamed for gs://). On any failure the temporary file is removed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator

from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

from dataset_format import storage
from dataset_format.manifest import COUNTS_SUFFIX, ShardEntry
from dataset_format.storage import is_remote
from pipelines import commits, paths, tfrecord
from pipelines.paths import InputFile
from pipelines.stats import ShardStats
from pipelines.tokens import TextKeyError, Tokenize, TokenizeSpec

log = logging.getLogger(__name__)

_PROGRESS_EVERY_S = 10.0


@dataclasses.dataclass(frozen=True)
class ShardTask:
    """One unit of work: convert `source` into `output` (full path of the final shard)."""

    source: InputFile
    output: str
    relative_path: str  # the output's path relative to the dataset directory
    split: str | None = None
    expected_records: int | None = None  # known from TFDS's dataset_info.json
    reason: str = ""  # why the plan converts it (`python -m pipelines plan` says)
    has_record: bool = False  # an earlier run's commit record is there: removed before the shard is written again

    @property
    def output_dir(self) -> str:
        """The dataset directory the shard is written into."""
        return self.output[: -len(self.relative_path)].rstrip("/") or "."


@dataclasses.dataclass(frozen=True)
class ShardResult:
    entry: ShardEntry
    corruptions: tuple[dict, ...] = ()  # skipped frames: {source, offset, length, reason}


class ShardCountMismatch(ValueError):
    """The written shard does not hold the records that were read (or that TFDS promised)."""

LOCAL_TEMP_PREFIX = "arconv-"  # a gs:// output's shard, written in the temporary directory before its upload


def convert_shard(
    task: ShardTask,
    *,
    writer_options: str,
    skip_corrupt: bool,
    on_records: Callable[[int, int], None] | None = None,
    tokenize: TokenizeSpec | None = None,
) -> ShardResult:
    """Converts `task.source` to `task.output`; raises CorruptRecordError / ShardCountMismatch (and TextKeyError
    when tokenising).

    `on_records(records, bytes)` is called now and then with the progress since its last call. With `tokenize`, each
    record is written as its text's token ids, and the counts file goes beside the shard (pipelines/tokens.py).
    The entry carries the records' feature statistics (pipelines/stats.py), gathered as they stream; a tokenised
    shard's records are ids, and get none.
    """
    if task.has_record:  # (the record describes the old file: a run stopped while replacing it must not keep it)
        commits.mark_kept(task.output_dir)  # (first: with every record removed, the output still says it keeps them)
        commits.remove(task.output_dir, task.relative_path)
    remote = is_remote(task.output)
    if remote:
        # (named by this process: a run killed leaves it, and the next removes those of processes gone: run.py)
        fd, local = tempfile.mkstemp(prefix=f"{LOCAL_TEMP_PREFIX}{os.getpid()}-",
                                     suffix="-" + os.path.basename(task.relative_path))
        os.close(fd)
    else:
        os.makedirs(os.path.dirname(os.path.abspath(task.output)), exist_ok=True)
        local = storage.temp_name(task.output)
    corruptions: list[dict] = []

    def on_corrupt(c: tfrecord.Corruption) -> None:
        log.warning("%s: skipping corrupt data at byte %d (%d bytes): %s", task.source.path, c.offset,
                    c.length, c.reason)
        corruptions.append({"source": task.source.path, **dataclasses.asdict(c)})

    tokens = Tokenize(tokenize, task.source.path) if tokenize is not None else None
    counts_local = local + COUNTS_SUFFIX
    try:
        stats = ShardStats() if tokens is None else None
        try:
            written, raw_bytes = _copy_records(task, local, writer_options, on_corrupt if skip_corrupt else None,
                                               on_records, tokens, stats)
        except TextKeyError as e:
            before = sum(1 for c in corruptions if c["records_before"] <= (e.index or 0))
            if not before:
                raise
            raise TextKeyError(f"{e} (counting the records read: {before} corrupt region(s) before it were skipped "
                               "by --skip-corrupt, so it lies further into the file)", e.index) from e
        _check_count(task, local, written, skip_corrupt)
        if tokens is not None and tokens.not_utf8:  # (kept: a web crawl's texts have some; said, not silent)
            log.warning("%s: %d record(s) hold text that is not UTF-8 (record %s%s); each invalid byte was tokenised "
                        "as U+FFFD, the replacement character", task.source.path, len(tokens.not_utf8),
                        ", ".join(map(str, tokens.not_utf8[:5])), ", ..." if len(tokens.not_utf8) > 5 else "")
        size = os.path.getsize(local)
        if tokens is not None:  # the counts land first: a committed shard always has its counts beside it
            with open(counts_local, "wb") as f:
                f.write(tokens.counts_bytes())
            if remote:
                storage.upload(counts_local, task.output + COUNTS_SUFFIX)
            else:
                os.replace(counts_local, task.output + COUNTS_SUFFIX)
        if remote:
            storage.upload(local, task.output)
        else:
            os.replace(local, task.output)
        if tokens is None and storage.exists(task.output + COUNTS_SUFFIX):  # a tokenised shard's, now stale
            storage.delete(task.output + COUNTS_SUFFIX)
    finally:
        for leftover in (local, counts_local):
            if os.path.exists(leftover):
                os.remove(leftover)
    entry = ShardEntry(path=task.relative_path, source=task.source.path, records=written, bytes=size,
                       source_bytes=task.source.size, source_fingerprint=task.source.fingerprint,
                       writer_options=writer_options, split=task.split, skipped_corrupt=len(corruptions),
                       tokens=tokenize.identity if tokenize is not None else None,
                       token_count=tokens.total() if tokens is not None else None,
                       feature_stats=stats.result() if stats is not None else None)
    commits.write(task.output_dir, entry, tuple(corruptions))  # the shard is done, whatever happens next
    return ShardResult(entry, tuple(corruptions))


def _copy_records(task, local, writer_options, on_corrupt, on_records, tokens=None,
                  stats: ShardStats | None = None) -> tuple[int, int]:
    source = task.source
    writer = ArrayRecordWriter(local, writer_options)
    written = raw_bytes = 0
    reported_records = reported_bytes = 0
    started = last_log = time.monotonic()
    try:
        compression = paths.source_compression(source.path)
        with paths.open_source(source.path, compression) as f:
            records = tfrecord.iter_records(f, path=source.path, on_corrupt=on_corrupt)
            read = _Measured(records) if tokens is not None else None  # the source's bytes, not the token ids'
            for record in (tokens(read) if read is not None else records):
                writer.write(record)
                if stats is not None:
                    stats.add(record)
                written += 1
                raw_bytes = read.bytes if read is not None else raw_bytes + len(record)
                if written & 0x3FF == 0:  # check the clock every 1024 records
                    now = time.monotonic()
                    if now - last_log >= _PROGRESS_EVERY_S:
                        plain = compression == paths.Compression.UNCOMPRESSED
                        done = f.tell() / source.size if source.size and plain else None
                        log.info("%s: %d records, %.1f MB%s, %.0f records/s", os.path.basename(source.path),
                                 written, raw_bytes / 1e6, f" ({done:.0%})" if done is not None else "",
                                 written / (now - started))
                        last_log = now
                    if on_records:
                        on_records(written - reported_records, raw_bytes - reported_bytes)
                        reported_records, reported_bytes = written, raw_bytes
    finally:
        writer.close()
    if on_records:
        on_records(written - reported_records, raw_bytes - reported_bytes)
    return written, raw_bytes


class _Measured:
    """Records passed through, their bytes counted (what a tokenised shard read, as its records' ids are written)."""

    def __init__(self, records: Iterator[bytes]):
        self._records, self.bytes = records, 0

    def __iter__(self) -> Iterator[bytes]:
        for record in self._records:
            self.bytes += len(record)
            yield record


def _check_count(task: ShardTask, local: str, written: int, skip_corrupt: bool) -> None:
    reader = ArrayRecordReader(local)
    try:
        on_disk = reader.num_records()
    finally:
        reader.close()
    if on_disk != written:
        raise ShardCountMismatch(f"{task.output}: wrote {written} records from {task.source.path} but the "
                                 f"file holds {on_disk}; the local disk may be full or failing, re-run")
    if task.expected_records is not None and written != task.expected_records and not skip_corrupt:
        raise ShardCountMismatch(f"{task.source.path}: holds {written} records but dataset_info.json says "
                                 f"{task.expected_records}; the TFDS directory is inconsistent, rebuild it "
                                 "(tfds build) or fix its shardLengths")
