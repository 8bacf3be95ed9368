"""Token counts: how many token ids each document of a source holds, the one column packing needs (Megatron's indexed
datasets keep the same "sizes" array).

A pre-tokenized dataset (`python -m pipelines convert --tokenizer ...`) has them beside its shards: each shard's
`.counts` file holds one little-endian uint32 per record, memory-mapped here, so a corpus of a billion documents
costs no start-up time and at most 4 bytes a document of page cache, shared by the processes of a host. A gs://
corpus's are copied once to the loader's index directory (keyed by each object's generation) and mapped there. For
text tokenised at load time they are counted once (reading, decoding and tokenising on the loader's executor: every
core) and cached beside the loader's index, keyed by the source's index key and the tokenizer's `cache_key`, so a
restart reads them back instead of tokenising again.

    counts = TokenCounts.of_source(source)                        # pre-tokenized shards
    counts(np.array([3, 17]))                                      # token ids of records 3 and 17
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from dataset_format import storage
from dataset_format.manifest import COUNTS_SUFFIX, redo

log = logging.getLogger(__name__)

SUFFIX = COUNTS_SUFFIX
DTYPE = np.dtype("<u4")
_COUNT_READ = 16384  # records per task of the counting pass
_COPY_THREADS = 16  # gs:// counts files downloaded at once (a request each: latency-bound)


class TokenCounts:
    """Token ids per record, for global record indices of a source (its shards end to end)."""

    def __init__(self, columns: list[np.ndarray], identity: str, paths: tuple[str, ...] = (),
                 max_count: int | None = None, first: tuple[int, ...] | None = None, legacy: str | None = None):
        self._columns = columns
        self._starts = np.concatenate([[0], np.cumsum([len(c) for c in columns])]).astype(np.int64)
        self.identity = identity  # what the loader's state key holds of them: how they were made, of which records
        # how they were made ("files": the dataset's own; "counted:KEY": by the tokenizer KEY names), apart from which
        # records: what a mixture's state holds, whose components may change
        self.how = identity.split(":", 1)[0] if identity.startswith("files:") else identity
        self.legacy = legacy  # the identity a state saved by an earlier release holds of the same counts, or None
        self._paths, self._max_count = paths, max_count  # the counts files; the most ids a record can hold
        self._first = first or (0,) * len(columns)  # each column's first record in its shard (a slice's)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __call__(self, records: np.ndarray) -> np.ndarray:
        records = np.asarray(records, np.int64)
        if len(self._columns) == 1:
            out = self._columns[0][records].astype(np.int64)
        else:
            shard = np.searchsorted(self._starts, records, side="right") - 1
            out = np.empty(len(records), np.int64)
            order = np.argsort(shard, kind="stable")
            bounds = np.searchsorted(shard[order], np.arange(len(self._columns) + 1))
            for s in np.flatnonzero(np.diff(bounds)):
                at = order[bounds[s]:bounds[s + 1]]
                out[at] = self._columns[s][records[at] - self._starts[s]]
        if self._max_count is not None and len(out) and out.max() > self._max_count:
            at = int(np.argmax(out > self._max_count))
            bad = int(records[at])
            shard = int(np.searchsorted(self._starts, bad, side="right") - 1)
            record = bad - int(self._starts[shard]) + self._first[shard]
            raise ValueError(f"{self._paths[shard]}{SUFFIX} says record {record} of "
                             f"{self._paths[shard]} holds {int(out[at]):,} token ids, more than a record can "
                             f"(at most {self._max_count:,}: max_record_bytes over the id size); the counts file is "
                             f"damaged or from another conversion: {redo(self._paths[shard])}")
        return out

    @classmethod
    def of_source(cls, source, max_count: int | None = None, directory: str | None = None) -> TokenCounts:
        """The `.counts` files beside a pre-tokenized source's shards (loader.format.source.ShardedSource), each
        checked to hold one count per record of its shard; a slice's part of each. A count over `max_count` (more ids
        than a record can hold) is an error naming its file and record when it is used. gs:// counts files are copied
        to `directory` (default: the loader's index directory) and mapped there."""
        first = source.first_records.tolist()
        # (a slice's shards outside it are not opened: on gs:// each would be a whole download)
        opened = [n or source.offsets is None for n in source.lengths]
        copies = _local_copies({path + SUFFIX: whole for path, whole, wanted in
                                zip(source.paths, source.records_in_files, opened)
                                if wanted and storage.is_remote(path)}, directory)
        columns = []
        for path, n, whole, at, wanted in zip(source.paths, source.lengths, source.records_in_files, first, opened):
            column = _open_column(path + SUFFIX, whole, copies.get(path + SUFFIX)) if wanted else None
            columns.append(column[at:at + n] if wanted else np.zeros(0, DTYPE))
        # Of which shards (their file names and records, not their directory: a staged or copied corpus is the same),
        # made how (tokenization: another tokenizer, or BOS/EOS added, lays out other rows).
        made = [[storage.basename(p) for p in source.paths], list(source.records_in_files), tokenization(source)]
        digest = hashlib.sha256(json.dumps(made).encode()).hexdigest()[:16]
        sliced = source.slice_key and ":" + source.slice_key
        # what a state saved before named them by: their paths (accepted at the same paths)
        legacy = hashlib.sha256("\n".join(source.paths).encode()).hexdigest()[:16]
        return cls(columns, f"files:{digest}{sliced}", tuple(source.paths), max_count, tuple(first),
                   legacy=f"files:{legacy}{sliced}")

    @classmethod
    def counted(cls, source, index_key: str, feature: str, cache_key: str | None,
                count: Callable[[list[tuple[int, int]]], Iterator[np.ndarray]], directory: str) -> TokenCounts:
        """Counts of every record's `feature` from `count(spans)` (each span's counts, in order, computed in parallel
        by the loader's executor); cached in `directory` when `cache_key` names the tokenizer (without it they are
        counted at every start: the tokenizer's identity is unknown), under the source, the feature and the key."""
        path = None
        if cache_key is not None:
            name = hashlib.sha256(f"{index_key}\n{feature}\n{cache_key}".encode()).hexdigest()[:32]
            path = os.path.join(directory, f"{name}{SUFFIX}")
            if os.path.exists(path):
                try:
                    column = _open_column(path, len(source))
                except ValueError as e:
                    log.warning("packing: the cached token counts %s are damaged (%s); counting again", path, e)
                else:
                    log.info("packing: token counts of %d examples from the cache %s", len(source), path)
                    return cls([column], f"counted:{cache_key}")
        started, n = time.monotonic(), len(source)
        counts = np.empty(n, DTYPE)
        spans = [(first, min(n, first + _COUNT_READ)) for first in range(0, n, _COUNT_READ)]
        for (first, end), got in zip(spans, count(spans)):
            if np.any(got > np.iinfo(DTYPE).max):
                raise ValueError(f"a document of {int(got.max())} tokens (between records {first} and {end}) "
                                 "is too long to count in uint32; split such documents before packing")
            counts[first:end] = got
        log.info("packing: counted the tokens of %d examples (%d ids) in %.1f s%s", n, int(counts.sum(dtype=np.int64)),
                 time.monotonic() - started, f", cached at {path}" if path else
                 "; pass Packing(cache_key=...) naming the tokenizer to count them only once")
        if path is not None:
            os.makedirs(directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=".counts-")
            with os.fdopen(fd, "wb") as f:
                f.write(counts.tobytes())
            os.replace(tmp, path)
        return cls([counts], f"counted:{cache_key}")


def tokenization(source) -> str | None:
    """How a pre-tokenized source's ids were made, as far as its manifest says: its tokenizer's digest and its token
    count (another tokenizer, or BOS/EOS added, changes them); None when the manifest says neither."""
    if source.tokenizer is None and source.token_count is None:
        return None
    made = source.tokenizer.rsplit("(", 1)[-1].rstrip(")") if source.tokenizer else "tokenizer unknown"
    return made if source.token_count is None else f"{made}, {source.token_count:,} token ids"


def _missing(path: str) -> FileNotFoundError:
    return FileNotFoundError(f"{path} is missing: a pre-tokenized shard's token counts; {redo(path[:-len(SUFFIX)])}")


def _check_size(path: str, size: int, records: int) -> None:
    if size != records * DTYPE.itemsize:
        raise ValueError(f"{path} is {size} bytes but its shard has {records} records ({records * DTYPE.itemsize} "
                         f"bytes of counts); the file is damaged or from another conversion: {redo(path[:-len(SUFFIX)])}")


def _local_copies(records: dict[str, int], directory: str | None) -> dict[str, str]:
    """{gs:// counts file: its local copy} for the files of `records` ({file: its shard's records}), each checked to
    hold a count per record (before it is copied). A copy is named by its object's path, size and generation, so a
    file written again is copied again and the others are not copied twice; the missing ones are downloaded on
    threads. (Read into memory instead, they would hold 4 bytes a document on every process: 4 GB at 1e9.)"""
    if not records:
        return {}
    if directory is None:
        from loader.format import index

        directory = index.default_dir()
    listed = storage.generations_of(list(records))
    copies, wanted = {}, []
    for path, n in records.items():
        if path not in listed:
            raise _missing(path)
        size, generation = listed[path]
        _check_size(path, size, n)
        name = hashlib.sha256(f"gs-copy\n{path}\n{size}\n{generation}".encode()).hexdigest()[:32]
        copies[path] = os.path.join(directory, f"{name}{SUFFIX}")
        if not os.path.exists(copies[path]):
            wanted.append((path, copies[path], size, generation))
    if wanted:
        started = time.monotonic()
        os.makedirs(directory, exist_ok=True)
        with ThreadPoolExecutor(min(_COPY_THREADS, len(wanted))) as pool:
            copied = sum(pool.map(lambda job: storage.download(job[0], job[1], expected_size=job[2],
                                                               generation=job[3]), wanted))
        log.info("packing: copied %d token-count file(s) (%d bytes) of %s to %s in %.1f s", len(wanted), copied,
                 wanted[0][0].rsplit("/", 1)[0], directory, time.monotonic() - started)
    return copies


def _open_column(path: str, records: int, copy: str | None = None) -> np.ndarray:
    """A local counts file (or `copy`, a gs:// one's local copy), memory-mapped; its size must be one count per
    record."""
    try:
        size = os.path.getsize(copy or path)
    except FileNotFoundError:
        raise _missing(path) from None
    _check_size(path, size, records)
    if records == 0:
        return np.zeros(0, DTYPE)
    return np.memmap(copy or path, DTYPE, mode="r", shape=(records,))
