"""OUT/report.json: what the conversion could not convert, so nothing is lost silently.

Lists each corrupt frame skipped with --skip-corrupt (source, byte offset, length, reason),
each shard that failed (source, error), and per converted shard the reconciliation
`frames read = records written + corrupt frames skipped`. Entries of shards kept from
earlier runs are carried over, so the report always describes the whole directory.
"""

from __future__ import annotations

import json

from dataset_format import storage

REPORT_NAME = "report.json"


def read(output: str) -> dict | None:
    text = storage.read_text(storage.join(output, REPORT_NAME))
    return None if text is None else json.loads(text)


def write(output: str, *, converted, failed: list[dict], kept_sources: set[str]) -> dict:
    previous = read(output) or {}
    this_run = {r.entry.source for r in converted}
    carried = [c for c in previous.get("corrupt_records", [])
               if c["source"] in kept_sources and c["source"] not in this_run]
    corrupt = carried + [c for r in converted for c in r.corruptions]
    shards = [s for s in previous.get("shards", []) if s["source"] in kept_sources and s["source"] not in this_run]
    shards += [{
        "source": r.entry.source,
        "output": r.entry.path,
        "records_written": r.entry.records,
        "corrupt_frames_skipped": len(r.corruptions),
        "corrupt_bytes_skipped": sum(c["length"] for c in r.corruptions),
    } for r in converted]
    body = {
        "corrupt_records": sorted(corrupt, key=lambda c: (c["source"], c["offset"])),
        "failed_shards": failed,
        "shards": sorted(shards, key=lambda s: s["source"]),
    }
    storage.write_text(storage.join(output, REPORT_NAME), json.dumps(body, indent=1))
    return body
