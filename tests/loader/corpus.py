"""The committed corpus of crafted ArrayRecord files (tests/fixtures/fuzz/arrayrecord/): one file per way a shard
crashed the loader, allocated what it does not hold, or gave wrong or missing records, with what loading it must
give. Regenerate with `python -m tests.loader.corpus` (the files are gzipped: mostly 64 KiB blocks of padding).

tests/loader/test_fuzz.py loads each in a child process and checks the expectation.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import tempfile
from pathlib import Path

from tests.loader import forge

DIRECTORY = Path(__file__).resolve().parents[1] / "fixtures" / "fuzz" / "arrayrecord"
EXPECTED = "expected.json"


def _write(path: Path, records: list[bytes], options: str = "group_size:1,uncompressed") -> bytearray:
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(path), options)
    for r in records:
        writer.write(r)
    writer.close()
    return bytearray(path.read_bytes())


def _records(n: int = 10) -> list[bytes]:
    return [b"record %d" % i for i in range(n)]


def _first_chunk(data: bytearray, **fields) -> None:
    """Changes header fields of the first record's chunk WITHOUT recomputing hashes (damage, not forgery)."""
    header = bytearray(forge.read_logical(data, 64, 40))
    for name, value in fields.items():
        at = {"data_size": 8, "decoded_size": 32}[name]
        header[at:at + 8] = value.to_bytes(8, "little")
    forge.write_logical(data, 64, bytes(header))


def build(work: Path) -> dict[str, tuple[bytes, dict]]:
    """name -> (file bytes, expectation). An expectation: {"check_hashes": bool, "error": substring} or
    {"check_hashes": bool, "records": count, "sha256": of the records joined}."""
    out = {}

    data = _write(work / "a", _records())
    _, sizes, values = forge.footer(bytes(data))
    entries = forge.footer_entries(values, sizes) + [forge.footer_entries(values, sizes)[0]]
    wrapped = [(sizes[0] - (1 << 40)) % (1 << 64), sizes[1] + (1 << 40)] + sizes[2:] + [sizes[0]]
    forge.rewrite_footer(data, entries, wrapped)
    out["footer-sizes-wrap-2-64"] = (data, {"check_hashes": True, "error": "is not a whole ArrayRecord file"})

    data = _write(work / "b", _records())
    _, sizes, values = forge.footer(bytes(data))
    entries = forge.footer_entries(values, sizes)
    fields = forge.parse_entry(entries[4])
    entries[4] = forge.entry(fields[1], fields[2], 2)
    forge.rewrite_footer(data, entries)
    out["footer-record-count-changed"] = (data, {"check_hashes": True, "error": "record counts that disagree"})

    data = _write(work / "c", _records())
    _, sizes, values = forge.footer(bytes(data))
    entries = forge.footer_entries(values, sizes)
    entries[3], entries[4] = entries[4], entries[3]
    forge.rewrite_footer(data, entries)
    out["footer-offsets-out-of-order"] = (data, {"check_hashes": True, "error": "do not increase"})

    grouped = [b"r%03d" % i for i in range(500)]
    data = _write(work / "d", grouped, "group_size:8,snappy")
    out["group-size-8-500-records"] = (data, {"check_hashes": True, "records": 500,
                                              "sha256": hashlib.sha256(b"".join(grouped)).hexdigest()})

    data = _write(work / "e", _records())
    forge.put_chunk(data, 64, forge.simple_chunk([1 << 40], b"record 0"), num_records=1, decoded_size=1 << 40)
    out["chunk-claims-1-tb-hashes-recomputed"] = (data, {"check_hashes": True, "error": "record 0 cannot be read"})

    data = _write(work / "f", _records())
    _first_chunk(data, decoded_size=(1 << 64) - 1)
    out["chunk-size-2-64-no-hash-check"] = (data, {"check_hashes": False, "error": "record 0 cannot be read"})

    data = _write(work / "g", _records())
    short = forge.simple_chunk([3], b"rec")  # a shorter chunk in record 0's place; the rest of its span left as was
    forge.put_chunk(data, 64, short, num_records=1, decoded_size=3)
    out["chunk-shorter-than-its-span"] = (data, {"check_hashes": True, "error": "ends before its span"})

    data = _write(work / "h", _records())
    out["truncated-to-one-block"] = (data[:65536], {"check_hashes": True, "error": "is not a whole ArrayRecord file"})
    return out


def main() -> None:
    DIRECTORY.mkdir(parents=True, exist_ok=True)
    expected = {}
    with tempfile.TemporaryDirectory() as work:
        for name, (data, expectation) in build(Path(work)).items():
            with gzip.GzipFile(DIRECTORY / f"{name}.array_record.gz", "wb", mtime=0) as f:
                f.write(bytes(data))
            expected[name] = expectation
    (DIRECTORY / EXPECTED).write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(expected)} files to {DIRECTORY}")


if __name__ == "__main__":
    main()
