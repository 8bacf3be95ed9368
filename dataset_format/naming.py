"""Shard naming: which ArrayRecord shard a TFRecord shard becomes (one output shard per input shard).

The token `tfrecord` (or `tfrecords`) in the input's base name becomes `array_record`; a name without it gets
`.array_record` appended. A compression suffix (`.gz`, `.bz2`, `.zst`, `.xz`, ...) is dropped first.

    mnist-train.tfrecord-00000-of-00004 -> mnist-train.array_record-00000-of-00004
    train-00003-of-00016.tfrecord       -> train-00003-of-00016.array_record
    part-0                              -> part-0.array_record
"""

from __future__ import annotations

import re

from dataset_format.storage import basename

_TOKEN = re.compile(r"(?<![A-Za-z0-9])tfrecords?(?![A-Za-z0-9])")
# every suffix the converter reads decompressed (pipelines/paths.py source_compression): the output is not compressed so
COMPRESSED_SUFFIXES = (".gz", ".gzip", ".zz", ".zlib", ".deflate", ".bz2", ".zst", ".zstd", ".xz", ".lzma")


def is_tfrecord_name(name: str) -> bool:
    """True for a base name with the `tfrecord`/`tfrecords` token: what a directory input converts."""
    return bool(_TOKEN.search(name)) and not name.startswith(".")


def output_name(source: str) -> str:
    """The ArrayRecord shard's base name for TFRecord shard `source` (see module doc)."""
    name = basename(source)
    for suffix in COMPRESSED_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return _with_token(name, "array_record")


def output_template(template: str) -> str:
    """A TFDS split's filepathTemplate without {FILEFORMAT} (`{SPLIT}-{SHARD_X_OF_Y}`), as the ArrayRecord shards'
    names follow it: named by `output_name`, their names hold {FILEFORMAT} where the TFRecords' hold `tfrecord`, or at
    their end (TFDS would otherwise look for shards named as the TFRecords are)."""
    return _with_token(template, "{FILEFORMAT}")


def _with_token(name: str, replacement: str) -> str:
    """`name` with its last `tfrecord(s)` token replaced by `replacement`; without one, `.replacement` appended."""
    matches = list(_TOKEN.finditer(name))
    if not matches:
        return f"{name}.{replacement}"
    last = matches[-1]
    return name[: last.start()] + replacement + name[last.end():]
