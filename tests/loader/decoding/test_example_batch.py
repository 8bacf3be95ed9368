import numpy as np
import pytest

from dataset_format.example_proto import encode_example
from loader.decoding.decode import ExampleDecoder, collate
from dataset_format.example_batch import parse_examples


def assert_same_columns(fast, slow):
    assert list(fast) == list(slow)
    for key in slow:
        if isinstance(slow[key], list):
            assert isinstance(fast[key], list) and fast[key] == slow[key], key
        else:
            assert fast[key].dtype == slow[key].dtype and fast[key].shape == slow[key].shape, key
            np.testing.assert_array_equal(fast[key], slow[key])


def per_record(records):
    decoder = ExampleDecoder()
    return collate([decoder(r) for r in records])


def test_fixed_records_parse_to_fixed_columns():
    records = [encode_example({"label": 3, "pixels": [0, 127, 128, 300], "score": [0.5, -2.0], "id": b"a",
                               "pair": [200, 5]}),
               encode_example({"label": -1, "pixels": [1, 2, 3, 2**62], "score": [1.25, 0.0], "id": b"bc",
                               "pair": [5, 200]})]
    columns = parse_examples(records)
    assert list(columns) == ["id", "label", "pair", "pixels", "score"]  # sorted, whatever the writer's order
    assert columns["pair"].tolist() == [[200, 5], [5, 200]]  # same byte sizes, not one byte a value
    assert columns["label"].dtype == np.int64 and columns["label"].tolist() == [3, -1]
    assert columns["pixels"].dtype == np.int64
    assert columns["pixels"].tolist() == [[0, 127, 128, 300], [1, 2, 3, 2**62]]
    assert columns["score"].dtype == np.float32 and columns["score"].tolist() == [[0.5, -2.0], [1.25, 0.0]]
    assert columns["id"] == [b"a", b"bc"]


@pytest.mark.parametrize("seed", range(6))
def test_random_layouts_match_record_by_record_decoding(seed):
    """Every kind, one or many values, varints of 1 to 10 bytes (negatives are 10), any bytes lengths."""
    rng = np.random.default_rng(seed)
    widths = rng.integers(1, 5, size=4)
    big = int(rng.integers(1, 63))

    def example(i):
        return encode_example({
            "ints": rng.integers(-(2**big), 2**big, size=widths[0]),
            "small": rng.integers(0, 128, size=widths[1]),
            "floats": rng.standard_normal(widths[2]).astype(np.float32),
            "blobs": [rng.bytes(int(rng.integers(0, 300))) for _ in range(widths[3])],
            "label": int(i),
        })

    records = [example(i) for i in range(int(rng.integers(1, 70)))]
    assert_same_columns(parse_examples(records), per_record(records))


def unpacked_floats(key: bytes, values: list[float]) -> bytes:
    """An Example whose float list is written unpacked (tag 0x0D per value): valid, but not our layout."""
    float_list = b"".join(b"\x0d" + np.float32(v).tobytes() for v in values)
    feature = b"\x12" + bytes([len(float_list)]) + float_list
    entry = b"\x0a" + bytes([len(key)]) + key + b"\x12" + bytes([len(feature)]) + feature
    features = b"\x0a" + bytes([len(entry)]) + entry
    return b"\x0a" + bytes([len(features)]) + features


def int64_runs(key: bytes, *runs: bytes) -> bytes:
    """An Example whose int64 list is written as several packed runs (valid: protobuf appends them)."""
    int64_list = b"".join(b"\x0a" + bytes([len(run)]) + run for run in runs)
    feature = b"\x1a" + bytes([len(int64_list)]) + int64_list
    entry = b"\x0a" + bytes([len(key)]) + key + b"\x12" + bytes([len(feature)]) + feature
    features = b"\x0a" + bytes([len(entry)]) + entry
    return b"\x0a" + bytes([len(features)]) + features


def test_other_valid_encodings_are_left_to_protobuf():
    decoder = ExampleDecoder()
    records = [unpacked_floats(b"f", [1.5, 2.5]), unpacked_floats(b"f", [3.0, 4.0])]
    assert parse_examples(records) is None
    assert decoder.decode_batch(records)["f"].tolist() == [[1.5, 2.5], [3.0, 4.0]]  # protobuf reads it
    records = [int64_runs(b"n", b"\x01", b"\x02"), int64_runs(b"n", b"\x03", b"\x04")]
    assert parse_examples(records) is None
    assert decoder.decode_batch(records)["n"].tolist() == [[1, 2], [3, 4]]


def swapped_entries(record: bytes) -> bytes:
    """The same Example with its two (short) map entries in the other order."""
    features = record[2:]
    first = features[:2 + features[1]]
    features = features[len(first):] + first
    return record[:2] + features


@pytest.mark.parametrize("records", [
    [encode_example({"a": 1}), encode_example({"b": 1})],  # other key
    [encode_example({"a": 1, "b": 2}), swapped_entries(encode_example({"a": 1, "b": 2}))],  # other order
    [encode_example({"a": [1, 2]}), encode_example({"a": [1, 2, 3]})],  # other width
    [encode_example({"a": [1, 2]}), encode_example({"a": [1.5, 2.5]})],  # other kind
    [encode_example({"a": 1}), encode_example({"a": 1, "b": 2})],  # more features
    [encode_example({"a": []}), encode_example({"a": []})],  # empty lists: no width
    [encode_example({"a": b"x"}), encode_example({"a": [b"x", b"y"]})],  # other bytes width
    [encode_example({}), encode_example({})],  # no features
], ids=["key", "order", "width", "kind", "count", "empty", "bytes-width", "none"])
def test_differing_layouts_are_left_to_record_by_record_decoding(records):
    assert parse_examples(records) is None


@pytest.mark.parametrize("damage", [
    lambda r: r[:-1],  # truncated
    lambda r: r + b"\x00",  # trailing byte
    lambda r: b"\x12" + r[1:],  # not an Example's field
    lambda r: r[:2] + b"\xff" * 12 + r[14:],  # an over-long varint
    lambda r: r[:5] + b"\xff\xfe" + r[7:],  # a key that is not UTF-8
], ids=["truncated", "trailing", "tag", "varint", "utf8"])
def test_invalid_records_return_none_never_wrong_values(damage):
    good = encode_example({"key": b"value", "n": [5, 6]})
    assert parse_examples([good, damage(good)]) is None
    assert parse_examples([damage(good), good]) is None


def test_repeated_key_is_left_to_protobuf():
    one = encode_example({"a": 1})
    features = one[2:] + one[2:]  # the same map entry twice: protobuf keeps the last
    record = b"\x0a" + bytes([len(features)]) + features
    assert parse_examples([record, record]) is None


def test_decode_batch_uses_protobuf_for_uniform_batches_in_another_order():
    records = [encode_example({"a": i, "b": [i, i]}) for i in range(4)]
    records[1] = swapped_entries(records[1])
    assert parse_examples(records) is None
    columns = ExampleDecoder().decode_batch(records)
    assert columns["a"].tolist() == [0, 1, 2, 3] and columns["b"].tolist() == [[0, 0], [1, 1], [2, 2], [3, 3]]
