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


def record_path(output: str, relative: str) -> str:
    return storage.join(storage.join(output, COMMITS_DIR), relative + ".json")


def write(output: str, entry: ShardEntry, corruptions: tuple[dict, ...]) -> None:
    storage.write_text(record_path(output, entry.path),
                       json.dumps({"entry": dataclasses.asdict(entry), "corruptions": list(corruptions)}))


def listed(output: str) -> set[str]:
    """Relative paths of the shards that have a commit record."""
    return {name[: -len(".json")] for name in storage.list_sizes(storage.join(output, COMMITS_DIR))
            if name.endswith(".json")}


def read(output: str, relatives: list[str]) -> dict[str, tuple[ShardEntry, tuple[dict, ...]]]:
    """relative path -> (entry, corruptions) of the given shards' records (read in parallel; unreadable ones are
    skipped: their shards are converted again)."""
    def one(relative: str):
        text = storage.read_text(record_path(output, relative))
        try:
            body = json.loads(text) if text else None
            return relative, (ShardEntry.from_json(body["entry"]), tuple(body["corruptions"])) if body else None
        except (ValueError, KeyError, TypeError):
            return relative, None

    with ThreadPoolExecutor(max_workers=16) as pool:
        return {r: v for r, v in pool.map(one, relatives) if v is not None}


def delete(output: str, relative: str) -> None:
    storage.delete_quietly(record_path(output, relative))
