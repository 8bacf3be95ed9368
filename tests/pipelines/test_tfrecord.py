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
    assert e.value.record == offset // 18  # the records before it read whole
    assert f"shard.tfrecord: corrupt TFRecord at byte offset {offset}, record {offset // 18}: {reason}" in str(e.value)
    assert "--skip-corrupt" in str(e.value)


def test_skip_mode_reports_bad_data_and_keeps_the_rest():
    records = [b"r0", b"r1", b"r2", b"r3"]
    data = bytearray(_frames(records))
    data[18 + 12] ^= 0xFF  # payload of r1 (frames are 12 + 2 + 4 = 18 bytes)
    seen = []
    assert _read(bytes(data), on_corrupt=seen.append) == [b"r0", b"r2", b"r3"]
    assert seen == [tfrecord.Corruption(18, 18, "data CRC mismatch in a 2-byte record", records_before=1)]


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


@pytest.mark.parametrize("text", [b'{"text": "The cat sat on the mat."}\n' * 3, b"id,text\n1,hello\n2,world\n",
                                  b"The cat sat.\nA dog ran.\n"])
def test_text_is_named_as_another_format_even_when_skipping(text):
    """JSON lines given as input was "corrupt TFRecord at byte offset 0: length CRC mismatch", and --skip-corrupt,
    the fix it offered, converted it to an empty shard."""
    for on_corrupt in (None, lambda c: None):
        with pytest.raises(tfrecord.NotTFRecordError) as e:
            list(tfrecord.iter_records(io.BytesIO(text * 2), path="web.jsonl", on_corrupt=on_corrupt))
        head = (text * 2)[:12].decode()
        assert str(e.value) == (f"web.jsonl is not a TFRecord file: it begins with text ({head!r}...); convert reads "
                                "TFRecord files of tf.train.Example records: write the data as such (e.g. with "
                                "tf.io.TFRecordWriter, one Example a line or document) and convert those")
        assert isinstance(e.value, tfrecord.CorruptRecordError)  # fails the shard, as corruption does


def test_an_array_record_file_given_as_input_is_named_as_converted_data(tmp_path):
    """A glob over a converted directory (ArrayRecord shards) was "corrupt TFRecord at byte offset 0: length CRC
    mismatch", with --skip-corrupt as the fix."""
    from array_record.python.array_record_module import ArrayRecordWriter

    path = str(tmp_path / "text.array_record-00000-of-00001")
    writer = ArrayRecordWriter(path, "group_size:1")
    writer.write(b"a record")
    writer.close()
    for on_corrupt in (None, lambda c: None):
        with open(path, "rb") as f, pytest.raises(tfrecord.NotTFRecordError) as e:
            list(tfrecord.iter_records(f, path=path, on_corrupt=on_corrupt))
        assert str(e.value) == (f"{path} is an ArrayRecord file (converted already), not a TFRecord file: convert and "
                                "`pipelines tokenizer` read the TFRecord sources, so pass those as --input; the loader "
                                "and `python -m trainer.tokenizer` read converted data")


def test_a_damaged_first_header_of_binary_bytes_is_still_corruption():
    data = bytearray(tfrecord.encode_record(b"x" * 40) + tfrecord.encode_record(b"y" * 7))
    data[8] ^= 0xFF  # the length CRC
    with pytest.raises(tfrecord.CorruptRecordError, match="length CRC mismatch") as e:
        list(tfrecord.iter_records(io.BytesIO(bytes(data)), path="a.tfrecord"))
    assert not isinstance(e.value, tfrecord.NotTFRecordError)
    skipped = []
    assert list(tfrecord.iter_records(io.BytesIO(bytes(data)), path="a.tfrecord", on_corrupt=skipped.append)) == \
        [b"y" * 7]
