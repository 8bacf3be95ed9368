"""What a file's first bytes say it is: a TFRecord frame, or text. For the errors that name another format than the
one expected (a TFRecord file given to the loader, JSON lines given to the converter), not for parsing."""

from __future__ import annotations

import google_crc32c

_MASK_DELTA = 0xA282EAD8
HEAD_BYTES = 12  # what each check reads: a TFRecord frame's length and its masked CRC


def masked_crc32c(data: bytes | memoryview) -> int:
    """TFRecord's masked CRC-32C of `data`."""
    crc = google_crc32c.value(bytes(data))
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def is_tfrecord_header(head: bytes, size: int | None = None) -> bool:
    """Whether `head` (a file's first 12 bytes or more) begins with a TFRecord frame header whose length CRC holds,
    and, given the file's `size`, whose frame fits in it."""
    if len(head) < HEAD_BYTES:
        return False
    length = int.from_bytes(head[:8], "little")
    if int.from_bytes(head[8:12], "little") != masked_crc32c(head[:8]):
        return False
    return size is None or 16 + length <= size


# Every Riegeli file (ArrayRecord's container) begins with the same 64 bytes: a block header and the signature chunk.
RIEGELI_SIGNATURE = bytes.fromhex("83af70d10d884a3f" "0000000000000000" "4000000000000000" "91bac23c9287e1a9"
                                  "0000000000000000" "e19f13c0e9b1c372" "7300000000000000" "0000000000000000")


def is_array_record(head: bytes) -> bool:
    """Whether `head` (a file's first 12 bytes or more) begins as every ArrayRecord (Riegeli) file does."""
    n = min(len(head), len(RIEGELI_SIGNATURE))
    return n >= HEAD_BYTES and head[:n] == RIEGELI_SIGNATURE[:n]


def is_text(head: bytes) -> bool:
    """Whether `head` (a file's first 12 bytes) is all printable ASCII or whitespace: JSON lines, CSV, plain text. Never
    a TFRecord header (its length would be over 2 PB) nor an ArrayRecord file's first block."""
    return len(head) >= HEAD_BYTES and all(32 <= b < 127 or b in (9, 10, 13) for b in head[:HEAD_BYTES])
