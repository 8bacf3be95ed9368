"""Per-shard commit records: what makes a conversion resumable after a crash anywhere.

Right after a shard's output is committed under its final name, its worker writes `OUT/.shards/<shard>.json`: the
manifest entry (source, fingerprint, writer options, records, bytes) and the corrupt frames it skipped. The
manifest is still the commit point for readers; the records are for the converter: a run that dies before its
manifest (launcher killed, a worker lost, a Dataflow job failed or cancelled) leaves them, and the next run keeps
every shard whose record matches its source and its file, converts only the rest, and rebuilds the manifest and
the report from the records. Readers never see them (dot-prefixed directory).
"""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor

from dataset_format import storage
from dataset_format.manifest import ShardEntry

COMMITS_DIR = ".shards"
INLINE_KEY = "record"
INLINE_LIMIT = 7 * 1024  # Cloud Storage allows 8 KiB of custom metadata an object
READ_ONE_BY_ONE_UP_TO = 64  # more records than this are read from a listing (gs://)


# In COMMITS_DIR, written before a shard's record is first removed (to replace its file): the output's runs keep
# commit records. Where it is, an output without records is one whose runs all stopped between removing a record and
# writing it again (every shard of a small split in flight at once), not one converted before records existed.
KEPT_MARK = "records-kept"


def mark_kept(output: str) -> None:
    """Writes KEPT_MARK unless it is there."""
    if not kept(output):
        storage.write_text(storage.join(storage.join(output, COMMITS_DIR), KEPT_MARK),
                           "this output's conversions keep a commit record per shard\n")


def kept(output: str) -> bool:
    return storage.exists(storage.join(storage.join(output, COMMITS_DIR), KEPT_MARK))


def record_path(output: str, relative: str) -> str:
    return storage.join(storage.join(output, COMMITS_DIR), relative + ".json")


def encode(entry: ShardEntry, corruptions: tuple[dict, ...]) -> tuple[str, dict[str, str] | None]:
    """A record's text, and the custom metadata its gs:// object carries: the same text when it fits, which
    listings return, so that a rerun after a crash reads 100,000 records in one listing, not 100,000 requests."""
    text = json.dumps({"entry": dataclasses.asdict(entry), "corruptions": list(corruptions)})
    return text, {INLINE_KEY: text} if len(text.encode()) <= INLINE_LIMIT else None


def write(output: str, entry: ShardEntry, corruptions: tuple[dict, ...]) -> None:
    text, metadata = encode(entry, corruptions)
    storage.write_text(record_path(output, entry.path), text, metadata=metadata)


def is_record(name: str) -> bool:
    """A commit record's name in a listing of the commits directory; not a temporary file a killed writer left
    (storage.temp_name: '.tmp-<id>-<name>.json')."""
    return name.endswith(".json") and not name.rsplit("/", 1)[-1].startswith(".tmp-")


def listing(output: str) -> dict[str, str | None]:
    """Shards with a commit record -> the record's text where the listing carries it (gs:// custom metadata), else
    None (local files, records too large to inline, records from before they were inlined)."""
    directory = storage.join(output, COMMITS_DIR)
    if storage.is_remote(output):
        return {name[: -len(".json")]: meta.get(INLINE_KEY) for name, meta in storage.list_metadata(directory).items()
                if is_record(name)}
    return {name[: -len(".json")]: None for name in storage.list_sizes(directory) if is_record(name)}


def listed(output: str) -> set[str]:
    """Relative paths of the shards that have a commit record."""
    return set(listing(output))


def read(output: str, relatives: list[str], known: dict[str, str | None] | None = None
         ) -> dict[str, tuple[ShardEntry, tuple[dict, ...]]]:
    """relative path -> (entry, corruptions) of the given shards' records (unreadable ones are skipped: their
    shards are converted again). Records inlined in `known` (a `listing` the caller has; on gs://, taken here when
    many records are wanted) are not requested; the others are read, in parallel on gs://."""
    if known is None and storage.is_remote(output) and len(relatives) > READ_ONE_BY_ONE_UP_TO:
        known = listing(output)
    inline = {r: text for r, text in (known or {}).items() if text is not None}

    def fetch(relative: str) -> tuple[str, str | None]:
        return relative, inline[relative] if relative in inline else storage.read_text(record_path(output, relative))

    rest = [r for r in relatives if r not in inline]
    if not storage.is_remote(output) or not rest:  # local reads are microseconds: a thread pool would cost more
        texts = list(map(fetch, relatives))
    else:
        with ThreadPoolExecutor(max_workers=storage.PARALLEL_REQUESTS) as pool:  # round trips: many at once
            texts = [fetch(r) for r in relatives if r in inline] + list(pool.map(fetch, rest))
    records = {}
    for relative, text in texts:
        try:
            body = json.loads(text) if text else None
            if body:
                records[relative] = ShardEntry.from_json(body["entry"]), tuple(body["corruptions"])
        except (ValueError, KeyError, TypeError):
            pass
    return records


def delete(output: str, relative: str) -> None:
    storage.delete_quietly(record_path(output, relative))


def remove(output: str, relative: str) -> None:
    """Deletes the shard's record before its file is written again; an error other than its absence is raised (a
    record left in place would describe a file that is no longer the one there)."""
    try:
        storage.delete(record_path(output, relative))
    except FileNotFoundError:
        pass
