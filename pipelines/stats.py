"""A shard's feature statistics, gathered while it converts (dataset_format/manifest.py `FeatureStats`): each
integer feature's min and max, how many records carry each feature, and how many values a record holds (the fewest
and the most: whether the feature is one value, a fixed-length list or a list of varying length).

They cost no second pass: the records are parsed as they stream to the writer, a batch at a time, with NumPy when the
batch shares one layout (dataset_format/example_batch.py: ~0.5 us of CPU a 1 KB record) and with protobuf record by record
when it does not (optional features, lists of varying length), or when the records are large (a batch of a few
100 KB images: the batch parse's fixed cost per feature outweighs protobuf's 15 us a record). Records that are not
tf.train.Examples (raw bytes) get no statistics: the first one that does not parse ends the gathering.

    stats = ShardStats()
    for record in records:
        stats.add(record)
    stats.result()   # {"label": {"kind": "int64", "records": 719, "min": 0, "max": 9, "min_length": 1,
                     #            "max_length": 1}, ...} or None
"""

from __future__ import annotations

import numpy as np
from google.protobuf.message import DecodeError

from dataset_format.example_batch import parse_examples
from dataset_format.example_proto import example_class
from dataset_format.manifest import FeatureStats

BATCH_RECORDS = 2048  # records parsed at once (1 KB records: 0.53 us of CPU each at 2048, 0.66 at 512)
BATCH_BYTES = 2 << 20  # and at most about this many bytes (the batch parse copies them once)
MIN_BATCH = 64  # fewer records than this (over 32 KB each) go through protobuf one by one
_KINDS = {"int64_list": "int64", "float_list": "float", "bytes_list": "bytes"}


class ShardStats:
    """Accumulates the `FeatureStats` of the records given to `add`, in batches."""

    def __init__(self) -> None:
        self._stats: FeatureStats | None = {}
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._irregular = 0  # batches in a row that did not share one layout: after 2, record by record

    def add(self, record: bytes) -> None:
        if self._stats is None:
            return
        self._pending.append(record)
        self._pending_bytes += len(record)
        if len(self._pending) >= BATCH_RECORDS or self._pending_bytes >= BATCH_BYTES:
            self._flush()

    def result(self) -> FeatureStats | None:
        """The statistics of every record added (keys sorted); None when a record was not a tf.train.Example."""
        self._flush()
        return None if self._stats is None else dict(sorted(self._stats.items()))

    def _flush(self) -> None:
        records, self._pending, self._pending_bytes = self._pending, [], 0
        if not records or self._stats is None:
            return
        columns = parse_examples(records) if len(records) >= MIN_BATCH and self._irregular < 2 else None
        self._irregular = 0 if columns is not None else self._irregular + (len(records) >= MIN_BATCH)
        if columns is None:
            for record in records:
                if not self._add_one(record):
                    self._stats = None
                    return
            return
        for key, column in columns.items():
            width = column.shape[1] if isinstance(column, np.ndarray) and column.ndim == 2 else 1
            if isinstance(column, np.ndarray) and column.dtype == np.int64:
                self._note(key, "int64", len(records), width, int(column.min()), int(column.max()))
            else:
                self._note(key, "float" if isinstance(column, np.ndarray) and column.dtype.kind == "f" else "bytes",
                           len(records), width)

    def _add_one(self, record: bytes) -> bool:
        """One record's features, through protobuf; False when it is not a tf.train.Example."""
        try:
            example = example_class().FromString(record)
        except DecodeError:
            return False
        for key, feature in example.features.feature.items():
            which = feature.WhichOneof("kind")
            kind = _KINDS.get(which)
            if kind is None:
                continue  # a feature with no list at all: nothing to note
            values = getattr(feature, which).value
            if kind == "int64" and values:
                self._note(key, kind, 1, len(values), min(values), max(values))
            else:
                self._note(key, kind, 1, len(values))
        return True

    def _note(self, key: str, kind: str, records: int, length: int, low: int | None = None,
              high: int | None = None) -> None:
        """`records` records whose `key` holds `length` values each (of `kind`; integers `low`..`high`)."""
        stats = self._stats.get(key)
        if stats is None:
            stats = self._stats[key] = {"kind": kind, "records": 0, "min_length": length, "max_length": length}
        stats["records"] += records
        stats["min_length"] = min(stats["min_length"], length)
        stats["max_length"] = max(stats["max_length"], length)
        if stats["kind"] != kind:
            stats["kind"] = "mixed"
            stats.pop("min", None)
            stats.pop("max", None)
        elif low is not None:
            stats["min"] = min(stats.get("min", low), low)
            stats["max"] = max(stats.get("max", high), high)
