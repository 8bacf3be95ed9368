"""Commit records (pipelines/commits.py): on gs:// a record also rides in its object's custom metadata, so that a
rerun after a crash reads many records from one listing instead of one request each."""

from __future__ import annotations

import pytest

from dataset_format import storage
from dataset_format.manifest import ShardEntry
from pipelines import commits


def _entry(i: int, output: str, name: str = "part") -> ShardEntry:
    return ShardEntry(f"{name}-{i:05d}.array_record", f"{output}-src/{name}-{i:05d}.tfrecord", records=i, bytes=10 * i,
                      source_bytes=20 * i, source_fingerprint=f"size={20 * i},mtime=1.0", writer_options="snappy")


def test_local_records_round_trip(tmp_path):
    out = str(tmp_path / "out")
    corrupt = ({"offset": 12, "reason": "bad crc"},)
    for i in range(3):
        commits.write(out, _entry(i, out), corrupt if i == 1 else ())
    (tmp_path / "out" / commits.COMMITS_DIR / "part-00002.array_record.json").write_text("{not json")
    assert commits.listed(out) == {f"part-{i:05d}.array_record" for i in range(3)}
    assert commits.read(out, [f"part-{i:05d}.array_record" for i in range(4)]) == {
        "part-00000.array_record": (_entry(0, out), ()),
        "part-00001.array_record": (_entry(1, out), corrupt)}  # the unreadable one converts again; 3 has none


@pytest.mark.gcs
def test_many_gcs_records_are_read_from_one_listing(faulty_gcs):
    bucket, front = faulty_gcs
    out = f"gs://{bucket}/out"
    n = commits.READ_ONE_BY_ONE_UP_TO + 6
    for i in range(n - 2):
        commits.write(out, _entry(i, out), ())
    big = tuple({"offset": o, "reason": "x" * 40} for o in range(200))  # past the 8 KiB of custom metadata
    commits.write(out, _entry(n - 2, out, "big"), big)
    old = _entry(n - 1, out, "old")  # written before records carried metadata: read from its object
    storage.write_text(commits.record_path(out, old.path), commits.encode(old, ())[0])
    relatives = [_entry(i, out).path for i in range(n - 2)] + [_entry(n - 2, out, "big").path, old.path]

    front.fail_next(403, times=n - 2, where=".shards%2Fpart-")  # reading any small record's object fails
    records = commits.read(out, relatives)

    assert records == {**{_entry(i, out).path: (_entry(i, out), ()) for i in range(n - 2)},
                       _entry(n - 2, out, "big").path: (_entry(n - 2, out, "big"), big), old.path: (old, ())}
    assert front.failed == []  # no small record was requested one by one: they all came from the listing
    front.faults.clear()
    assert commits.read(out, relatives[:3]) == {r: records[r] for r in relatives[:3]}  # few: one request each
