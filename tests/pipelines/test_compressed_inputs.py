"""Compressed TFRecord inputs: read by their suffix, or by their first bytes when a GZIP or zlib file has no suffix
(tf.io.TFRecordWriter adds none); a stream that is damaged, cut short or not what its name says fails its shard
with a line naming the file, even with --skip-corrupt, and the other shards convert."""

from __future__ import annotations

import bz2
import gzip
import io
import json
import logging
import random
import re
import zlib

import pytest

from pipelines import paths, tfrecord
from tests.conftest import run_cli


def _records(n: int = 400) -> list[bytes]:
    rng = random.Random(0)
    words = [f"w{i}" for i in range(300)]
    return [" ".join(rng.choices(words, k=60)).encode() for _ in range(n)]  # compressible, as text is


def _frames(records) -> bytes:
    buf = io.BytesIO()
    tfrecord.write_records(buf, records)
    return buf.getvalue()


def _read(path) -> list[bytes]:
    with paths.open_source(str(path)) as f:
        return list(tfrecord.iter_records(f, path=str(path)))


def test_compressed_inputs_by_suffix_and_by_their_first_bytes(tmp_path, caplog):
    records = _records()
    raw = _frames(records)
    files = {"a.tfrecord.gz": gzip.compress(raw), "b.tfrecord.bz2": bz2.compress(raw),
             "c.tfrecord": gzip.compress(raw), "d.tfrecord": zlib.compress(raw), "e.tfrecord": raw}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="pipelines.paths"):
        assert all(_read(tmp_path / name) == records for name in files)
    assert [paths.source_compression(str(tmp_path / n)) for n in files] == ["gzip", "bzip2", "gzip", "deflate",
                                                                            "uncompressed"]
    warned = [r.getMessage() for r in caplog.records]
    assert any(m.endswith("c.tfrecord: its bytes are GZIP-compressed though its name says uncompressed: read as "
                          "GZIP (name such files *.gz)") for m in warned), warned
    assert any(m.endswith("d.tfrecord: its bytes are zlib-compressed though its name says uncompressed: read as "
                          "zlib (name such files *.deflate)") for m in warned), warned


def test_a_tfrecord_whose_first_bytes_look_like_gzip_is_read_as_a_tfrecord(tmp_path):
    """A record of 0x088B1F bytes: its frame starts 1f 8b 08, GZIP's signature; its length CRC settles it."""
    records = [b"x" * 0x088B1F, b"next"]
    path = tmp_path / "big.tfrecord"
    path.write_bytes(_frames(records))
    assert path.read_bytes()[:3] == b"\x1f\x8b\x08"
    assert paths.source_compression(str(path)) == "uncompressed" and _read(path) == records


@pytest.mark.parametrize("name,damage,reason,misnamed", [
    # the stream's CRC-32 (its trailer's first 4 bytes); a flip inside the data is found by a record's own CRC first
    ("flipped.tfrecord.gz", lambda gz: gz[:-8] + bytes([gz[-8] ^ 0xFF]) + gz[-7:], r"CRC check failed", False),
    ("cut.tfrecord.gz", lambda gz: gz[: len(gz) // 2], r"Compressed file ended before the end-of-stream marker",
     False),
    ("plain.tfrecord.gz", None, r"Not a gzipped file", True),  # only a stream that gave nothing may be misnamed
])
def test_a_damaged_or_mislabelled_stream_names_the_file(tmp_path, name, damage, reason, misnamed):
    raw = _frames(_records())
    gz = gzip.compress(raw)
    path = tmp_path / name
    path.write_bytes(raw if damage is None else damage(gz))
    hint = "; a file that is not GZIP-compressed needs a name without its suffix (the suffix says how it is read)"
    with pytest.raises(tfrecord.CompressedStreamError,
                       match=rf"^{path}: its GZIP stream does not decompress after [\d,]+ bytes of TFRecord data: "
                             rf".*{reason}.*\. Re-create or re-copy this shard{re.escape(hint) if misnamed else ''}$"):
        _read(path)


@pytest.mark.parametrize("suffix, kind", [(".gz", "GZIP"), (".zst", "Zstandard")])
def test_a_damaged_stream_fails_its_shard_and_the_others_convert_even_with_skip_corrupt(tmp_path, suffix, kind):
    """(A Zstandard stream cut short converted to fewer records, or none, without a word: Beam's reader.)"""
    import zstandard

    records = _records()
    compress = gzip.compress if suffix == ".gz" else zstandard.ZstdCompressor().compress
    whole = compress(_frames(records))
    src = tmp_path / "in"
    src.mkdir()
    (src / f"good.tfrecord{suffix}").write_bytes(whole)
    (src / f"cut.tfrecord{suffix}").write_bytes(whole[: len(whole) // 2])  # its first records decompress: none kept
    out = tmp_path / "out"
    proc = run_cli("convert", "--input", str(src), "--output", str(out), "--skip-corrupt")
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith(f"FAILED: {src}/cut.tfrecord{suffix}: its {kind} stream "
                                                           "does not decompress after"), proc.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert [(s["path"], s["records"]) for s in manifest["shards"]] == [("good.array_record", len(records))]
    assert not (out / "cut.array_record").exists()


@pytest.mark.parametrize("suffix, compress, kind", [
    (".zst", lambda raw: __import__("zstandard").ZstdCompressor().compress(raw), "Zstandard"),
    (".deflate", zlib.compress, "zlib"),
])
@pytest.mark.parametrize("cut", [3, "half"])
def test_a_zstd_or_zlib_stream_cut_short_fails_its_shard(tmp_path, suffix, compress, kind, cut):
    """Beam's reader ended a cut Zstandard or zlib stream silently: a shard missing its last 3 bytes converted to 0
    records, exit 0, and verify --deep passed; cut in half, --skip-corrupt kept half and called it one bad record."""
    records = _records(3000)
    whole = compress(_frames(records))
    path = tmp_path / f"cut.tfrecord{suffix}"
    path.write_bytes(whole[:-3] if cut == 3 else whole[: len(whole) // 2])
    with pytest.raises(tfrecord.CompressedStreamError,
                       match=rf"^{path}: its {kind} stream does not decompress after [\d,]+ bytes of TFRecord data: "
                             rf"the file ends inside its {kind} stream \(cut short: an unfinished copy or upload\?\)\. "
                             r"Re-create or re-copy this shard$"):
        _read(path)
    (tmp_path / f"two.tfrecord{suffix}").write_bytes(whole + whole)  # streams one after another: both read
    assert _read(tmp_path / f"two.tfrecord{suffix}") == records + records


@pytest.mark.parametrize("suffix", [".zst", ".deflate"])
def test_a_small_file_that_decompresses_to_gigabytes_is_never_held_whole(tmp_path, suffix):
    """A decompression bomb: 64 streams of 16 MiB of zeros (1 GiB, a few hundred KB on disk). Read 1 MB of it at a
    time, the reader held each read's whole output (~1 GiB for the Zstandard file); a step's output is bounded now,
    and the zeros are no TFRecord frame (a length CRC mismatch), said at once."""
    import tracemalloc

    import zstandard

    zeros = bytes(16 << 20)
    stream = zstandard.ZstdCompressor().compress(zeros) if suffix == ".zst" else zlib.compress(zeros, 9)
    path = tmp_path / f"bomb.tfrecord{suffix}"
    path.write_bytes(stream * 64)
    del zeros
    assert path.stat().st_size < 2 << 20
    tracemalloc.start()
    try:
        with pytest.raises(tfrecord.CorruptRecordError, match="length CRC mismatch"):
            _read(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 48 << 20, f"{peak:,} bytes held"
    with paths.open_source(str(path)) as f:  # read to its end in steps: 1 GiB out, bounded memory
        tracemalloc.start()
        try:
            total = sum(len(f.read(1 << 20)) for _ in range(1024))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert total == 64 * (16 << 20) and peak < 48 << 20, f"{peak:,} bytes held"
