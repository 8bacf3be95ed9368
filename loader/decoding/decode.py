"""Turning raw records into arrays, without TensorFlow.

- `tf.train.Example` records -> {feature: np.ndarray}; a feature holding one value in every record becomes a scalar
  (by the manifest's feature statistics: a list feature stays an array in a record that holds one value).
- TFDS datasets -> their own FeaturesDict (`deserialize_example_np`: images decoded, labels as ints).
A batch of decoded records is collated into {feature: array stacked on a new first axis}; a batch of
Examples that share one layout is decoded straight into those columns (`dataset_format.example_batch`).
"""

from __future__ import annotations

import bisect
import itertools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dataset_format import storage
from dataset_format.example_batch import parse_examples
from dataset_format.example_proto import decode_example, example_class
from dataset_format.manifest import list_features
from dataset_format.tfds_info import FEATURES_NAME
from dataset_format.wire import varint

Decoder = Callable[[bytes], Any]


_KINDS = {"int64_list": np.int64, "float_list": np.float32, "bytes_list": object}


def _select(decoded: dict, keys: tuple[str, ...]) -> dict:
    missing = [k for k in keys if k not in decoded]
    if missing:
        raise KeyError(f"no feature {missing[0]!r} in this record; its features are {sorted(decoded)}")
    return {k: decoded[k] for k in keys}


def is_sequence_example(record: bytes) -> bool:
    """Whether `record`'s top level holds field 2 (a SequenceExample's feature_lists; a tf.train.Example has field 1
    only). Reads the top-level fields' tags and lengths only, each bounded by the record's size."""
    pos, n = 0, len(record)
    try:
        while pos < n:
            tag, pos = varint(record, pos)
            if tag >> 3 == 2 and tag & 7 == 2:
                return True
            if tag & 7 != 2:
                return False  # not a message of length-delimited fields: not for this check to judge
            length, pos = varint(record, pos)
            if length > n - pos:
                return False
            pos += length
    except ValueError:  # a cut or overlong varint
        return False
    return False


KIND_CHECKS = 64  # records of each decoder checked for the feature_lists of a tf.train.SequenceExample


class ExampleDecoder:
    """tf.train.Example bytes -> {feature: np.ndarray} (int64, float32, or object array of bytes).

    A feature's value is a scalar where the record holds one value, unless the feature is in `lists` (the conversion
    saw records with another count of values: `dataset_format.manifest.list_features`): then an array of shape [1], so
    that a feature's rank never depends on the record or the batch.
    `keys`: decode only these features (the others, ragged or text, are skipped and never collated)."""

    _unchecked = KIND_CHECKS  # (class defaults: a decoder pickled by a process of an earlier version has none)
    _lists: frozenset[str] = frozenset()

    def __init__(self, keys: tuple[str, ...] | None = None, lists: frozenset[str] = frozenset()):
        self._keys = tuple(sorted(keys)) if keys else None
        self._lists = frozenset(lists)

    def _check_kind(self, records: Sequence[bytes]) -> None:
        """The first KIND_CHECKS records seen: a tf.train.SequenceExample would decode as its context alone, silently
        (one whose feature_lists are empty has the bytes of a tf.train.Example: one record does not tell)."""
        records = records[: self._unchecked]
        self._unchecked -= len(records)
        if any(is_sequence_example(r) for r in records):
            raise ValueError("these records are tf.train.SequenceExample (they have feature_lists), which decoding "
                             "as tf.train.Example would cut to their context features: pass decode= a function that "
                             "parses them (e.g. with tf.io.parse_single_sequence_example), or decode=None for the "
                             "bytes")

    def __call__(self, record: bytes) -> dict[str, np.ndarray]:
        if self._unchecked:
            self._check_kind((record,))
        lists = self._lists
        decoded = {k: (v[0] if v.shape == (1,) and k not in lists else v) for k, v in decode_example(record).items()}
        return _select(decoded, self._keys) if self._keys else decoded

    def decode_batch(self, records: Sequence[bytes]) -> dict[str, Any] | None:
        """`collate([self(r) for r in records])`, column by column; None when the batch is not uniform
        (features or lengths differ between records): then decode record by record.

        Records sharing one wire layout parse all at once with NumPy (`parse_examples`); the others
        (e.g. map entries in another order) parse with protobuf, then build the columns."""
        if self._unchecked:
            self._check_kind(records)
        columns = parse_examples(records)
        if columns is None:
            columns = self._protobuf_columns(records, self._keys)
        elif self._keys:
            columns = _select(columns, self._keys) if all(k in columns for k in self._keys) else None
        return columns if columns is None or not self._lists else self._as_lists(columns)

    def _as_lists(self, columns: dict[str, Any]) -> dict[str, Any]:
        """`columns` with each of `lists` that holds one value a record as [N, 1] (the batch parse gives [N])."""
        for key in self._lists.intersection(columns):
            column = columns[key]
            if isinstance(column, list):  # bytes, one value a record
                stacked = np.empty((len(column), 1), dtype=object)
                stacked[:, 0] = column
                columns[key] = stacked
            elif column.ndim == 1:
                columns[key] = column[:, None]
        return columns

    @staticmethod
    def _protobuf_columns(records: Sequence[bytes], keys: tuple[str, ...] | None = None) -> dict[str, Any] | None:
        parse = example_class().FromString
        features = [parse(r).features.feature for r in records]
        first = features[0]
        out = {}
        for key in keys or sorted(first):
            if key not in first:
                return None
            kind = first[key].WhichOneof("kind")
            if kind is None:
                return None
            try:
                values = [getattr(f[key], kind).value for f in features] if all(key in f for f in features) else None
            except AttributeError:
                return None
            if values is None:
                return None
            # A record whose `key` holds another kind has an empty `kind` list here, so the width check
            # below also catches mixed kinds (no per-record WhichOneof: ~20% of the decode).
            width = len(values[0])
            if width == 0 or any(len(v) != width for v in values):
                return None
            if width == 1:
                column = [v[0] for v in values]
                out[key] = column if kind == "bytes_list" else np.array(column, dtype=_KINDS[kind])
            else:
                flat = itertools.chain.from_iterable(values)  # ~1.4x faster than a list of lists
                out[key] = np.fromiter(flat, dtype=_KINDS[kind], count=len(values) * width).reshape(len(values), width)
        if keys is None and any(len(f) != len(first) for f in features):
            return None
        return out


class TfdsDecoder:
    """Decodes with the FeaturesDict saved beside a TFDS dataset (features.json); built lazily per process.

    `encoded`: features left as TFDS stored them (an Image feature's PNG/JPEG bytes), for a map function that decodes
    them itself, faster (loader.decoding.images decodes only a crop's window)."""

    def __init__(self, features_dir: str, keys: tuple[str, ...] | None = None, encoded: tuple[str, ...] = ()):
        self._features_dir = features_dir
        self._keys = tuple(sorted(keys)) if keys else None
        self._encoded = tuple(encoded)
        self._features = None
        self._decoders = None

    def __getstate__(self):
        return {**self.__dict__, "_features": None, "_decoders": None}

    def __call__(self, record: bytes) -> dict[str, Any]:
        if self._features is None:
            with _TFDS_FIRST_USE:  # one thread imports TFDS (TensorFlow) and builds the features; the loader's threads
                if self._features is None:  # importing it at once hung in a lock of the import, every thread waiting
                    self._load_features()
        decoded = self._features.deserialize_example_np(record, decoders=self._decoders)
        return _select(decoded, self._keys) if self._keys else decoded

    def _load_features(self) -> None:
        from tensorflow_datasets.core.features import features_dict

        features = features_dict.FeaturesDict.from_config(_local_metadata(self._features_dir))
        if self._encoded:
            from tensorflow_datasets.core.decode import base

            missing = [name for name in self._encoded if name not in features]
            if missing:
                raise KeyError(f"no feature {missing[0]!r} in this TFDS dataset; its features are "
                               f"{sorted(features.keys())}")
            self._decoders = {name: base.SkipDecoding() for name in self._encoded}
        self._features = features


_TFDS_FIRST_USE = threading.Lock()


def _local_metadata(features_dir: str) -> str:
    """`features_dir` itself when local; else a local copy of its features.json and label files. TFDS would read
    gs:// through TensorFlow's file system, which a training host need not have (and which ignores the emulator)."""
    if not storage.is_remote(features_dir):
        return features_dir
    import tempfile

    local = tempfile.mkdtemp(prefix="tfds-features-")
    for name in storage.list_sizes(features_dir):
        if name == FEATURES_NAME or name.endswith(".labels.txt"):
            storage.download(storage.join(features_dir, name), os.path.join(local, name))
    return local


class TokenDecoder:
    """A pre-tokenized record (`python -m pipelines convert --tokenizer`): the token ids of one document, little-endian
    integers of the manifest's type, as {"tokens": ids}."""

    def __init__(self, dtype: str):
        self.dtype = np.dtype(dtype).newbyteorder("<")
        if self.dtype.kind not in "iu":
            raise ValueError(f"token ids of type {dtype!r}: the manifest's tokens.dtype must be an integer type")

    def __call__(self, record: bytes) -> dict[str, np.ndarray]:
        if len(record) % self.dtype.itemsize:
            raise ValueError(f"{len(record)} bytes are not a whole number of {self.dtype.name} token ids")
        return {"tokens": np.frombuffer(record, self.dtype)}


def make_decoder(decode: str | Decoder | None, features_dir: str | None,
                 features: tuple[str, ...] | None = None, encoded: tuple[str, ...] = (),
                 tokens_dtype: str | None = None, lists: frozenset[str] = frozenset()) -> Decoder | None:
    """The decoder for `decode=`; `features` keeps only those features of each decoded record; `encoded` features
    of a TFDS dataset stay encoded (a map function's `encoded_features`, e.g. loader.decoding.images.RandomResizedCrop);
    `tokens_dtype`: the source is pre-tokenized, its records token ids of that type; `lists`: tf.Example features that
    stay arrays in a record holding one value (ExampleDecoder)."""
    if tokens_dtype is not None and decode == "auto":
        if features is not None and set(features) - {"tokens"}:
            raise ValueError(f"this dataset is pre-tokenized: its records hold only 'tokens' (asked for features "
                             f"{sorted(features)})")
        return TokenDecoder(tokens_dtype)
    if features is not None and (decode is None or callable(decode)):
        raise ValueError("features= selects features of decoded records: use decode='auto', 'example' or 'tfds' "
                         "(a decode function can drop features itself)")
    if decode is None or callable(decode):
        return decode
    if decode == "auto":
        return TfdsDecoder(features_dir, features, encoded) if features_dir else ExampleDecoder(features, lists)
    if decode == "example":
        return ExampleDecoder(features, lists)
    if decode == "tfds":
        if not features_dir:
            raise ValueError("decode='tfds' needs a TFDS dataset (features.json beside the shards); this source has "
                             "none: use decode='example', a function, or None for raw bytes")
        return TfdsDecoder(features_dir, features, encoded)
    raise ValueError(f"decode={decode!r} is not one of 'auto', 'example', 'tfds', None or a function")


class ComponentDecoder:
    """A mixture whose components' records decode differently (a TFDS dataset beside tf.Example corpora): record i
    of the mixture's source goes to the decoder of the component holding it (`decoder_at`)."""

    def __init__(self, decoders: Sequence[Decoder], lengths: Sequence[int]):
        self._decoders = list(decoders)
        self._ends = np.cumsum(lengths).tolist()

    def at(self, index: int) -> Decoder:
        return self._decoders[bisect.bisect_right(self._ends, int(index))]

    def __call__(self, record: bytes):
        raise TypeError("a mixture's records decode by component: call decoder_at(decoder, index)(record)")


def decoder_at(decoder: Decoder, index: int) -> Decoder:
    """The decoder of global record `index`: `decoder` itself, or its component's for a ComponentDecoder."""
    return decoder.at(index) if isinstance(decoder, ComponentDecoder) else decoder


def source_decoder(decode: str | Decoder | None, source, features: tuple[str, ...] | None = None,
                   encoded: tuple[str, ...] = ()) -> Decoder | None:
    """make_decoder for `source` (a ShardedSource): one decoder per component when a mixture's components decode
    differently (decode='auto': a TFDS component through its features.json, the others as tf.Examples)."""
    dirs, lists = source.component_features, list_features(source.feature_stats)
    if dirs is None or decode != "auto":
        return make_decoder(decode, source.features_dir, features, encoded, source.tokens_dtype, lists)
    return ComponentDecoder([make_decoder(decode, d, features, encoded, source.tokens_dtype, lists) for d in dirs],
                            source.component_lengths)


def _uneven_features(items: Sequence[dict]) -> None:
    """Raises for a batch whose records do not all have the same features, naming the first such feature."""
    counts: dict[str, int] = {}
    for item in items:
        for k in item:
            counts[k] = counts.get(k, 0) + 1
    name, have = next((k, n) for k, n in counts.items() if n < len(items))
    raise ValueError(
        f"feature {name!r} is in {have} of this batch's {len(items)} records: a feature that some records lack "
        "cannot be batched; leave it out with features= (the others), or give every record a value for it in "
        "decode= or map_fn (`python -m loader inspect DIR` shows how many records have each feature)")


def collate(items: Sequence[Any]) -> Any:
    """Stacks a batch: dicts feature by feature, arrays/scalars on a new first axis; else a list."""
    first = items[0]
    if isinstance(first, dict):
        keys = first.keys()
        if any(item.keys() != keys for item in items):
            _uneven_features(items)
        return {k: collate([item[k] for item in items]) for k in first}
    if isinstance(first, (np.ndarray, np.generic, int, float, bool)):
        try:
            return np.stack([np.asarray(item) for item in items])
        except ValueError:  # ragged: shapes differ
            return list(items)
    return list(items)
