"""Protobuf's wire format, the little of it read by hand: a varint (ArrayRecord's footer metadata, the top-level tags
of a tf.Example or SequenceExample)."""

from __future__ import annotations

MAX_VARINT_BYTES = 10  # a 64-bit value takes at most 10 bytes; a longer run is damage, not a number


def varint(data: bytes, at: int) -> tuple[int, int]:
    """The varint at `data[at:]` and the offset after it; ValueError when it runs past the end or past 10 bytes."""
    value = 0
    for shift in range(0, 7 * MAX_VARINT_BYTES, 7):
        if at >= len(data):
            raise ValueError("a varint runs past the end")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
    raise ValueError(f"a varint longer than {MAX_VARINT_BYTES} bytes")
