import io
import struct

import pytest

from pipelines import tfrecord


def _frames(records):
    return b"".join(tfrecord.encode_record(r) for r in records)


def _read(data, **kwargs):
    return list(tfrecord.iter_records(io.BytesIO(data), path="shard.tfrecord", **kwargs))


def test_round_trip_keeps_order_and_edge_sizes():
    records = [b"", b"a", b"\x00" * 3, b"z" * (3 << 20), b"last"]
    assert _read(_frames(records)) == records


def test_known_frame_bytes():
    # The frame TensorFlow's tf.io.TFRecordWriter writes for b"abc" (length, masked CRCs).
    frame = tfrecord.encode_record(b"abc")
    assert frame[:8] == struct.pack("<Q", 3)
    assert frame.hex() == "0300000000000000" "b099490e" "616263" "6e57f121"


@pytest.mark.parametrize(
    "mutate, offset, reason",
    [
        (lambda b: b[:30] + bytes([b[30] ^ 1]) + b[31:], 18, "data CRC mismatch"),  # 2nd record's payload
        (lambda b: b[:18] + b"\xff" + b[19:], 18, "length CRC mismatch"),  # 2nd record's length
        (lambda b: b[:-2], 36, "truncated record"),  # tail cut inside the 3rd record
        (lambda b: b[:40], 36, "truncated header"),  # tail cut inside the 3rd header
    ],
)
def test_corruption_raises_with_file_offset_and_reason(mutate, offset, reason):
    data = mutate(_frames([b"r0", b"r1", b"r2"]))  # 18-byte frames at offsets 0, 18, 36
    with pytest.raises(tfrecord.CorruptRecordError) as e:
        _read(data)
    assert e.value.offset == offset
    assert e.value.path == "shard.tfrecord"
    assert reason in str(e.value)
    assert f"shard.tfrecord: corrupt TFRecord at byte offset {offset}" in str(e.value)
    assert "--skip-corrupt" in str(e.value)


def test_skip_mode_reports_bad_data_and_keeps_the_rest():
    records = [b"r0", b"r1", b"r2", b"r3"]
    data = bytearray(_frames(records))
    data[18 + 12] ^= 0xFF  # payload of r1 (frames are 12 + 2 + 4 = 18 bytes)
    seen = []
    assert _read(bytes(data), on_corrupt=seen.append) == [b"r0", b"r2", b"r3"]
    assert seen == [tfrecord.Corruption(18, 18, "data CRC mismatch in a 2-byte record")]


def test_skip_mode_resyncs_after_a_broken_length():
    records = [b"r0", b"r1", b"r2", b"r3"]
    data = bytearray(_frames(records))
    data[18] ^= 0xFF  # length of r1: its frame boundary is lost
    seen = []
    assert _read(bytes(data), on_corrupt=seen.append) == [b"r0", b"r2", b"r3"]
    assert [(c.offset, c.length) for c in seen] == [(18, 18)]
    assert seen[0].reason.startswith("length CRC mismatch; skipped 18 bytes")


def test_skip_mode_reports_truncated_tail():
    data = _frames([b"r0", b"r1"])[:-3]
    seen = []
    assert _read(data, on_corrupt=seen.append) == [b"r0"]
    assert [(c.offset, c.length) for c in seen] == [(18, 15)]


def test_garbage_after_last_record_is_reported_not_ignored():
    data = _frames([b"r0"]) + b"\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a\x0b\x0c\x0d"
    with pytest.raises(tfrecord.CorruptRecordError, match="length CRC mismatch"):
        _read(data)
    seen = []
    assert _read(data, on_corrupt=seen.append) == [b"r0"]
    assert [(c.offset, c.length) for c in seen] == [(18, 13)]
