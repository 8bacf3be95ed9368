"""Re-checks a converted directory against its manifest and, optionally, its sources.

Shallow (default): every shard in the manifest exists, has the recorded size, and its
ArrayRecord index holds the recorded number of records; a TFDS directory's
`dataset_info.json` agrees with the manifest. Deep (`--deep`): every record of every
output shard equals the record at the same position of its TFRecord source.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader

from dataset_format import staged, storage, tfds_info
from dataset_format.manifest import COUNTS_SUFFIX, MANIFEST_NAME, ShardEntry, redo
from pipelines import paths, tfrecord
from pipelines.plan import read_manifest, same_path
from pipelines.tokens import Tokenize, TokenizeSpec

log = logging.getLogger(__name__)

_BATCH = 1024


@dataclasses.dataclass(frozen=True)
class Stale:
    """A source behind its shard: `kind` is "changed" (another fingerprint), "gone", or "unlisted" (its directory
    cannot be listed from this host, `why`)."""
    path: str
    kind: str
    why: str = ""

    def __str__(self) -> str:
        if self.kind == "unlisted":
            return f"{self.path} (cannot be listed: {self.why})"
        return f"{self.path} ({self.kind})"


@dataclasses.dataclass
class VerifyResult:
    shards: int = 0
    records: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)
    # sources changed or gone since their shard was converted: the output is whole, but behind its input
    stale: list[Stale] = dataclasses.field(default_factory=list)
    # a staged copy (`loader stage`): where it was staged from, and its shards that changed there since
    staged_from: str | None = None
    restage: list[str] = dataclasses.field(default_factory=list)
    # --deep: shards read whole (their chunk hashes checked) but not compared, their sources gone or out of reach
    uncompared: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(output: str, *, deep: bool = False) -> VerifyResult:
    manifest = read_manifest(output)
    if manifest is None:
        raise FileNotFoundError(f"{storage.join(output, MANIFEST_NAME)} does not exist; is {output!r} the "
                                "output of `python -m pipelines convert`?")
    result = VerifyResult()
    for failure in manifest.failed:
        result.problems.append(f"{failure['source']}: failed to convert: {failure['error']}")
    sizes = storage.list_sizes(output)  # one listing for all shards (one request on gs://)
    spec, unloadable = None, None  # the conversion's tokenizer, or why it does not load (then nothing is compared)
    if manifest.tokens is not None and deep:
        spec, unloadable = _tokenize_spec(manifest.tokens)
    itemsize = np.dtype(manifest.tokens["dtype"]).itemsize if manifest.tokens is not None else None
    blocked = False  # a source in reach, not compared for want of the tokenizer
    for i, entry in enumerate(manifest.shards):
        path = storage.join(output, entry.path)
        problem = _check_shard(path, entry, sizes.get(entry.path)) or (
            _check_counts(path, entry, sizes.get(entry.path + COUNTS_SUFFIX)) if manifest.tokens else None)
        if deep and not problem:
            reachable = _reachable(entry.source)
            if reachable and unloadable is None:
                problem = _compare_records(path, entry, spec)
            else:
                blocked |= reachable
                result.uncompared.append(
                    f"{path} (its tokenizer {manifest.tokens['tokenizer']} does not load)" if reachable
                    else f"{path} (its source {entry.source} is gone or out of reach)")
                problem = _read_all(path, entry, itemsize)
        if problem:
            result.problems.append(problem)
        result.shards += 1
        result.records += entry.records
        log.info("[%d/%d] %s: %s", i + 1, len(manifest.shards), entry.path, problem or "ok")
    if blocked:
        result.problems.append(unloadable)
    if manifest.kind == "tfds":
        result.problems.extend(_check_tfds_info(output, manifest.shards))
    result.stale = stale_sources(manifest.shards)
    if not storage.is_remote(output):
        result.staged_from, result.restage = _restage(output, manifest.shards)
    return result


def _restage(output: str, entries) -> tuple[str | None, list[str]]:
    """For a staged copy: its source, and its shards whose source changed since they were copied (one listing of the
    source; a shard copied before copies were recorded counts as changed)."""
    source, copied = staged.read(output)
    if source is None:
        return None, []
    try:
        now = staged.versions(source)
    except (OSError, ValueError) as e:
        return source, [f"{source} (cannot be listed: {str(e).splitlines()[0][:200]})"]
    return source, [e.path for e in entries if e.path in now and copied.get(e.path) != now[e.path][1]]


def stale_sources(entries) -> list[Stale]:
    """The sources of `entries` that changed (another fingerprint) or are gone since they were converted: one listing
    of each source directory (one request a directory on gs://), no file read. A directory that cannot be listed is
    said as such, not as its sources gone."""
    by_directory: dict[str, list[tuple[str, ShardEntry]]] = {}
    for entry in entries:
        source = same_path(entry.source)  # (old manifests hold local sources as they were typed)
        by_directory.setdefault(source.rsplit("/", 1)[0], []).append((source, entry))
    stale = []
    for directory, group in by_directory.items():
        try:
            found = {f.path: f for f in paths.list_files(directory)}
        except (OSError, ValueError) as e:
            stale.append(Stale(directory, "unlisted", str(e).splitlines()[0][:200]))
            continue
        stale += [Stale(source, "gone" if source not in found else "changed") for source, e in group
                  if source not in found or not found[source].matches(e.source_fingerprint)]
    return stale


def _check_shard(path: str, entry: ShardEntry, size: int | None) -> str | None:
    if size is None:
        return f"{path}: listed in the manifest but missing; re-run the conversion to recreate it"
    if size != entry.bytes:
        return (f"{path}: {size} bytes, the manifest says {entry.bytes}; the file was changed or truncated, or "
                "rewritten by a conversion that did not finish: re-run the conversion (it converts a shard whose size "
                "differs from the manifest again)")
    try:
        reader = ArrayRecordReader(path)
        try:
            records = reader.num_records()
        finally:
            reader.close()
    except RuntimeError as e:  # riegeli's errors: a damaged footer or index (it was a traceback)
        return _corrupt(path, e)
    if records != entry.records:
        return f"{path}: holds {records} records, the manifest says {entry.records}; {redo(path)}"
    return None


def _tokenize_spec(tokens: dict) -> tuple[TokenizeSpec | None, str | None]:
    """The conversion's tokenisation, from the manifest, with its tokenizer file checked to be the one it used."""
    path = tokens.get("tokenizer", "")
    try:
        spec = TokenizeSpec.of(path, tokens["text_key"], tokens.get("add_bos"), bool(tokens.get("add_eos")))
    except (OSError, ValueError) as e:
        return None, f"cannot compare tokenised records: the tokenizer {path} does not load ({e})"
    if spec.sha256 != tokens.get("tokenizer_sha256"):
        return None, (f"cannot compare tokenised records: {path} is not the tokenizer the conversion used (its "
                      "SHA-256 differs); re-run the conversion with it, or verify without --deep")
    return spec, None


def _check_counts(path: str, entry: ShardEntry, size: int | None) -> str | None:
    """A pre-tokenized shard's counts file: there, one uint32 per record."""
    if size is None:
        return f"{path}{COUNTS_SUFFIX}: the shard's token counts are missing; re-run the conversion with --force"
    if size != 4 * entry.records:
        return (f"{path}{COUNTS_SUFFIX}: {size} bytes for {entry.records} records (4 a record); the file is damaged, "
                "re-run the conversion with --force")
    return None


def _rerun(path: str, entry: ShardEntry) -> str:
    """What converts the shard again: a plain re-run when its source changed since (the plan sees that), else
    --force (the output changed under an unchanged source); in a staged copy, staging it again."""
    if staged.source_of(path) is not None:
        return redo(path)
    try:
        now = paths.list_inputs(entry.source)[0]
    except OSError:
        now = None
    if now is not None and not now.matches(entry.source_fingerprint):
        return "its source changed after the conversion: re-run the conversion (it converts changed sources again)"
    return "re-run the conversion with --force"


def _reachable(source: str) -> bool:
    try:
        return storage.exists(source)
    except (OSError, ValueError):  # (no credentials for a gs:// source, no network)
        return False


def _read_all(path: str, entry: ShardEntry, itemsize: int | None) -> str | None:
    """Every record read, which checks its chunk's hash (a damaged shard is found without its source: a staged copy
    on a training host); a pre-tokenized shard's (`itemsize`: its token ids') counts checked against its records."""
    try:
        reader = ArrayRecordReader(path, "readahead_buffer_size:16M")
    except RuntimeError as e:  # riegeli's errors: a damaged footer or index
        return _corrupt(path, e)
    lengths = []
    try:
        for start in range(0, entry.records, _BATCH):
            end = min(start + _BATCH, entry.records)
            try:
                records = reader.read(start, end)
            except RuntimeError as e:
                return _corrupt(path, e, _first_unreadable(reader, start, end))
            lengths += map(len, records)
    finally:
        reader.close()
    if itemsize is None:
        return None
    lengths = np.asarray(lengths, np.int64)
    odd = np.flatnonzero(lengths % itemsize)
    if len(odd):
        return (f"{path}: record {int(odd[0])} holds {int(lengths[odd[0]])} bytes, not a whole number of "
                f"{itemsize}-byte token ids; {redo(path)}")
    wanted = (lengths // itemsize).astype("<u4").tobytes()
    counts = storage.read_bytes(path + COUNTS_SUFFIX) or b""
    return _counts_differ(path, counts, wanted) if counts != wanted else None


def _compare_records(path: str, entry: ShardEntry, spec: TokenizeSpec | None = None) -> str | None:
    """Every record against its source's (tokenised by `spec` when the dataset is pre-tokenized, and then its
    counts against the records' ids)."""
    try:
        reader = ArrayRecordReader(path, "readahead_buffer_size:16M")
    except RuntimeError as e:  # riegeli's errors: a damaged footer or index
        return _corrupt(path, e)
    skipped: list = []
    tokens = Tokenize(spec, entry.source) if spec is not None else None
    try:
        with paths.open_source(entry.source) as f:
            expected = tfrecord.iter_records(f, path=entry.source,
                                             on_corrupt=skipped.append if entry.skipped_corrupt else None)
            if tokens is not None:
                expected = tokens(expected)
            for start in range(0, entry.records, _BATCH):
                try:
                    got = reader.read(start, min(start + _BATCH, entry.records))
                except RuntimeError as e:  # riegeli's errors: a damaged chunk of the output (it was a traceback)
                    return _corrupt(path, e, _first_unreadable(reader, start, min(start + _BATCH, entry.records)))
                wanted = list(itertools.islice(expected, len(got)))
                if len(wanted) < len(got):
                    return (f"{path}: holds {entry.records} records but {entry.source} has only "
                            f"{start + len(wanted)}; {_rerun(path, entry)}")
                for offset, (want, have) in enumerate(zip(wanted, got)):
                    if want != have:
                        return (f"{path}: record {start + offset} differs from record {start + offset} of "
                                f"{entry.source} (sha256 {_digest(have)} vs {_digest(want)}); {_rerun(path, entry)}")
            if next(expected, None) is not None:
                return (f"{path}: {entry.source} has more records than the {entry.records} converted; "
                        f"{_rerun(path, entry)}")
        if tokens is not None:
            counts, wanted = storage.read_bytes(path + COUNTS_SUFFIX), tokens.counts_bytes()
            if counts != wanted:
                return _counts_differ(path, counts or b"", wanted)
            if entry.token_count is not None and entry.token_count != tokens.total():
                return (f"{path}: {MANIFEST_NAME} says {entry.token_count:,} tokens, and its records hold "
                        f"{tokens.total():,}; re-run with --force")
    except tfrecord.CorruptRecordError as e:
        return f"{path}: cannot compare, the source is corrupt: {e}"
    finally:
        reader.close()
    return None


def _counts_differ(path: str, counts: bytes, wanted: bytes) -> str:
    """A shard's token counts file that is not its records' ids counted: the first record it is wrong for."""
    have = np.frombuffer(counts[:len(counts) // 4 * 4], "<u4")
    want = np.frombuffer(wanted, "<u4")
    differ = np.flatnonzero(have[:len(want)] != want[:len(have)])
    if len(differ):
        i = int(differ[0])
        where = f"record {i} has {want[i]:,} token ids but its count says {have[i]:,}"
    else:
        where = f"it holds {len(counts):,} bytes, {len(wanted):,} for the {len(want):,} records' counts"
    return f"{path}{COUNTS_SUFFIX}: {where}; {redo(path)}"


def _first_unreadable(reader: ArrayRecordReader, start: int, end: int) -> int | None:
    """The first record of [start, end) that does not read (riegeli's error names a byte offset, not a record)."""
    for index in range(start, end):
        try:
            reader.read([index])
        except RuntimeError:
            return index
    return None


def _corrupt(path: str, error: Exception, record: int | None = None) -> str:
    lines = str(error).strip().splitlines()
    where = f"record {record} " if record is not None else ""
    why = lines[0] if lines else type(error).__name__
    return f"{path}: {where}cannot be read ({why}); the shard is corrupt: {redo(path)}"


def _digest(record: bytes) -> str:
    return hashlib.sha256(record).hexdigest()[:16]


def _check_tfds_info(output: str, shards: tuple[ShardEntry, ...]) -> list[str]:
    info = tfds_info.read_info(output)
    problems = []
    for split in info.get("splits", []):
        want = [e.records for e in shards if e.split == split["name"]]
        have = [int(n) for n in split.get("shardLengths", [])]
        if want != have:
            problems.append(f"{storage.join(output, tfds_info.INFO_NAME)}: split {split['name']!r} shardLengths "
                            f"{have} differ from the manifest's {want}; re-run the conversion")
            continue
        names = [storage.basename(e.path) for e in shards if e.split == split["name"]]
        named = [tfds_info.shard_name(info, split, "array_record", i, len(names)) for i in range(len(names))]
        if names != named:
            problems.append(f"{storage.join(output, tfds_info.INFO_NAME)}: split {split['name']!r} names its shards "
                            f"{named[0]!r} and on (its filepathTemplate), the manifest {names[0]!r} and on: TFDS "
                            "would not find them; re-run the conversion")
    return problems
