"""The manifest: one JSON file in a converted dataset directory, the contract with the loader.

`OUT/manifest.json` lists every output shard in reading order (sorted by source path)
with its record count and size, so that a reader learns the dataset's layout from one
small file instead of opening every shard. Each shard also carries its records' feature
statistics, gathered while it converted (`feature_stats`, below): what the trainer checks
labels against before step 1. See docs/dataset-format.md.

Both the converter (writing) and the loader (reading) import it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from typing import Any

from dataset_format import staged
from dataset_format.storage import join

MANIFEST_NAME = "manifest.json"
# Beside each shard of a pre-tokenized dataset: its records' token counts (pipelines/tokens.py writes them,
# loader/planning/counts.py reads them).
COUNTS_SUFFIX = ".counts"
FORMAT = "arrayrecord-platform/manifest"
FORMAT_VERSION = 1
TOKEN_DTYPES = ("<u1", "<u2", "<u4")  # pre-tokenized records: little-endian ids, the narrowest that holds the vocabulary


@dataclasses.dataclass(frozen=True)
class ShardEntry:
    """One output shard and where it came from."""

    path: str  # relative to the dataset directory
    source: str  # full path (local or gs://) of the TFRecord it was converted from
    records: int
    bytes: int  # size of the ArrayRecord file
    source_bytes: int
    source_fingerprint: str  # changes when the source is rewritten (size and mtime; gs://: size and generation)
    writer_options: str
    split: str | None = None  # TFDS split, when converted from a TFDS directory
    skipped_corrupt: int = 0  # corrupt frames skipped with --skip-corrupt (see report.json)
    tokens: str | None = None  # how its records were tokenised (pipelines/tokens.py TokenizeSpec.identity), if so
    token_count: int | None = None  # a tokenised shard: the token ids its records hold, together
    # Its records' features (`FeatureStats`); None: not recorded (records that are not tf.train.Examples, a
    # tokenised conversion, or a shard converted before statistics were recorded).
    feature_stats: dict[str, dict[str, Any]] | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ShardEntry:
        unknown = d.keys() - _ENTRY_FIELDS
        if unknown:
            raise ValueError(f"manifest shard entry has unknown keys {sorted(unknown)}: {d}")
        return cls(**d)


_ENTRY_FIELDS = frozenset(f.name for f in dataclasses.fields(ShardEntry))


@dataclasses.dataclass(frozen=True)
class Manifest:
    """The state of a converted dataset directory."""

    input: str  # the glob or TFDS directory that was converted
    kind: str  # "tfrecord" or "tfds"
    shards: tuple[ShardEntry, ...]
    tool_version: str
    failed: tuple[dict[str, Any], ...] = ()  # shards whose conversion failed: {source, error}
    # A pre-tokenized dataset: {"dtype", "vocab_size", "tokenizer", "tokenizer_sha256", "text_key", ...}
    # (docs/dataset-format.md); None: records are the source's own.
    tokens: dict[str, Any] | None = None
    skip_corrupt: bool = False  # converted with --skip-corrupt: a rerun that does not say otherwise keeps skipping

    @property
    def total_records(self) -> int:
        return sum(s.records for s in self.shards)

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    @property
    def total_tokens(self) -> int | None:
        """The token ids of a tokenised dataset (None: not tokenised, or a shard converted before they were counted)."""
        return total_tokens(s.token_count for s in self.shards)

    @property
    def complete(self) -> bool:
        """False when some source shard failed to convert: the directory lacks its records."""
        return not self.failed

    @property
    def feature_stats(self) -> dict[str, dict[str, Any]] | None:
        """Every shard's feature statistics merged (`merge_feature_stats`); None when a shard lacks them."""
        return merge_feature_stats(s.feature_stats for s in self.shards)

    def shard_paths(self, root: str) -> list[str]:
        """Absolute paths of the shards under dataset directory `root`, in reading order."""
        return [join(root, s.path) for s in self.shards]

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "tool_version": self.tool_version,
                "input": self.input,
                "kind": self.kind,
                "complete": self.complete,
                "totals": {
                    "shards": len(self.shards),
                    "records": self.total_records,
                    "bytes": self.total_bytes,
                },
                "shards": [dataclasses.asdict(s) for s in self.shards],
                "failed": list(self.failed),
                **({"tokens": self.tokens} if self.tokens is not None else {}),
                **({"skip_corrupt": True} if self.skip_corrupt else {}),
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str, *, path: str = MANIFEST_NAME) -> Manifest:
        d = _parsed(text, path)
        _shard_columns(d, path)  # (each entry's path, records and bytes: checked)
        try:
            shards = tuple(ShardEntry.from_json(s) for s in d["shards"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}; {DAMAGED}") from None
        manifest = cls(input=d["input"], kind=d["kind"], shards=shards,
                       tool_version=d["tool_version"], failed=tuple(d.get("failed", ())), tokens=_tokens(d, path),
                       skip_corrupt=d.get("skip_corrupt") is True)
        _check_totals(d, manifest.total_records, path)
        return manifest


@dataclasses.dataclass(frozen=True)
class ShardTable:
    """A manifest's shards as columns, what a reader needs, parsed without an object per shard (a reader of 100,000
    shards pays ~5 us for each ShardEntry)."""

    kind: str
    paths: tuple[str, ...]
    records: tuple[int, ...]
    bytes: tuple[int, ...]
    splits: tuple[str | None, ...]
    failed: tuple[dict[str, Any], ...] = ()
    tokens: dict[str, Any] | None = None
    feature_stats: tuple[dict[str, dict[str, Any]] | None, ...] = ()  # each shard's (ShardEntry.feature_stats)
    token_counts: tuple[int | None, ...] = ()  # each shard's (ShardEntry.token_count)

    @property
    def complete(self) -> bool:
        return not self.failed

    @classmethod
    def from_json(cls, text: str, *, path: str = MANIFEST_NAME) -> ShardTable:
        d = _parsed(text, path)
        shards = d["shards"]
        paths, records, sizes = _shard_columns(d, path)
        table = cls(d["kind"], paths, records, sizes, tuple(s.get("split") for s in shards),
                    tuple(d.get("failed", ())), _tokens(d, path), tuple(s.get("feature_stats") for s in shards),
                    tuple(s.get("token_count") for s in shards))
        _check_totals(d, sum(records), path)
        bad = next((c for c in table.token_counts if c is not None and (type(c) is not int or c < 0)), None)
        if bad is not None:
            raise ValueError(f"{path}: a shard's token_count is {bad!r}, not a count of tokens; {DAMAGED}")
        return table


# Feature statistics, one dict per feature of a shard's tf.train.Examples:
#   {"kind": "int64", "records": 1281, "min_length": 1, "max_length": 1, "min": 1, "max": 1000}
#   {"kind": "bytes", "records": 1281, "min_length": 1, "max_length": 1}    (and "float")
# `records` counts the records that have the feature; a shard whose records lack it has no entry for it.
# `min_length`/`max_length`: the fewest and most values a record holds (1 and 1: one value; equal: a fixed-length list;
# else a list of varying length); manifests written before they were recorded lack them. `min`/`max`: over every value
# of every record. A feature whose kind differs between shards merges to kind "mixed", without min and max.
FeatureStats = dict[str, dict[str, Any]]


def total_tokens(counts: Iterable[int | None]) -> int | None:
    """The sum of shards' token counts; None when there are none, or a shard's is unknown."""
    counts = list(counts)
    return sum(counts) if counts and None not in counts else None


def merge_feature_stats(parts: Iterable[FeatureStats | None]) -> FeatureStats | None:
    """Several shards' statistics as one (the `FeatureStats` of all their records); None if any part is None."""
    merged: FeatureStats = {}
    for part in parts:
        if part is None:
            return None
        for key, stats in part.items():
            into = merged.get(key)
            if into is None:
                merged[key] = dict(stats)
                continue
            into["records"] += stats["records"]
            if "min_length" in into and "min_length" in stats:
                into["min_length"] = min(into["min_length"], stats["min_length"])
                into["max_length"] = max(into["max_length"], stats["max_length"])
            else:  # a shard that did not record them: unknown for the whole
                into.pop("min_length", None)
                into.pop("max_length", None)
            if into["kind"] != stats["kind"]:
                into["kind"] = "mixed"
                into.pop("min", None)
                into.pop("max", None)
            elif "min" in stats:
                into["min"] = min(into.get("min", stats["min"]), stats["min"])
                into["max"] = max(into.get("max", stats["max"]), stats["max"])
    return dict(sorted(merged.items()))


def list_features(stats: FeatureStats | None) -> frozenset[str]:
    """The features whose records are known not to hold exactly one value each (lists, fixed-length or varying, and
    features some record leaves empty): decoded as arrays always, even in a record that holds one value."""
    return frozenset(key for key, s in (stats or {}).items()
                     if "min_length" in s and (s["min_length"], s["max_length"]) != (1, 1))


# What mends a damaged manifest: the rerun rebuilds it from the shards' commit records (pipelines/commits.py),
# converting only what is not whole; a rerun with the damaged one there stops at it.
DAMAGED = "the manifest was edited or damaged: delete it and re-run the conversion (it rebuilds the manifest)"


def redo(shard: str) -> str:
    """The fix for a converted shard that is damaged or stale, or whose file beside it is: a plain re-run keeps a shard
    whose size is the manifest's, and converts a missing one again. In a staged copy (`loader stage`), staging it
    again: the original may be whole."""
    source = staged.source_of(shard)
    if source is not None:
        return (f"delete {shard} and run `python -m loader stage {source} {os.path.dirname(os.path.abspath(shard))}` "
                f"again, which copies it again (the directory is a staged copy of {source}; if the original is "
                "damaged too, delete it there and re-run the conversion)")
    return f"delete {shard} and re-run the conversion, which converts it again"


def _parsed(text: str, path: str) -> dict[str, Any]:
    """The manifest's JSON, checked to be a manifest of this format version with the keys a reader needs."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); delete it and re-run the conversion") from e
    if not isinstance(d, dict):
        raise ValueError(f"{path}: not a conversion manifest (a JSON {type(d).__name__}, not an object)")
    if d.get("format") != FORMAT:
        raise ValueError(f"{path}: not a conversion manifest (format={d.get('format')!r}, "
                         f"expected {FORMAT!r})")
    if d.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: manifest format_version {d.get('format_version')!r} is not "
                         f"{FORMAT_VERSION}; re-run the conversion with this version of the tool")
    missing = [key for key in ("kind", "shards", "totals") if key not in d]
    if missing:
        raise ValueError(f"{path}: no {', '.join(map(repr, missing))}; {DAMAGED}")
    if not isinstance(d["shards"], list) or not isinstance(d["totals"], dict):
        raise ValueError(f"{path}: 'shards' is not a list or 'totals' not an object; {DAMAGED}")
    failed = d.get("failed", [])
    if not isinstance(failed, list) or not all(isinstance(f, dict) for f in failed):
        raise ValueError(f"{path}: 'failed' is not a list of objects; {DAMAGED}")
    return d


def _shard_columns(d: dict[str, Any], path: str) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
    """Each shard's path, records and bytes, checked: counts are whole numbers >= 0, and paths name files inside the
    dataset directory, once each (a path out of it would be read from wherever it points; one listed twice, read
    twice an epoch)."""
    try:
        paths = tuple(s["path"] for s in d["shards"])
        records = tuple(s["records"] for s in d["shards"])
        sizes = tuple(s["bytes"] for s in d["shards"])
    except KeyError as e:
        raise ValueError(f"{path}: a shard entry lacks {e}; {DAMAGED}") from None
    except TypeError:
        raise ValueError(f"{path}: a shard entry is not an object; {DAMAGED}") from None
    for name, column in (("records", records), ("bytes", sizes)):
        bad = next((i for i, v in enumerate(column) if type(v) is not int or v < 0), None)
        if bad is not None:
            raise ValueError(f"{path}: shard {bad}'s {name} is {column[bad]!r}, not a count; {DAMAGED}")
    bad = next((p for p in paths if not _inside(p)), None)
    if bad is not None:
        raise ValueError(f"{path}: a shard's path {bad!r} is not a file inside the dataset directory; {DAMAGED}")
    if len(set(paths)) != len(paths):
        seen: set[str] = set()
        twice = next(p for p in paths if p in seen or seen.add(p))
        raise ValueError(f"{path}: shard {twice!r} is listed more than once; {DAMAGED}")
    return paths, records, sizes


def _inside(relative: Any) -> bool:
    """A relative path of a file in the dataset directory or below: no '..', not absolute, no scheme, no empty part."""
    return (isinstance(relative, str) and relative != "" and not relative.startswith(("/", "\\"))
            and "://" not in relative and all(part not in ("", ".", "..") for part in relative.split("/")))


def _tokens(d: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The manifest's `tokens` section, checked: a dtype of unsigned integers and a vocabulary that fits it."""
    tokens = d.get("tokens")
    if tokens is None:
        return None
    dtype, vocab = tokens.get("dtype") if isinstance(tokens, dict) else None, None
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"{path}: tokens.dtype={dtype!r} is not one of {TOKEN_DTYPES}; the manifest was edited or "
                         "damaged, re-run the conversion")
    vocab = tokens.get("vocab_size")
    if not isinstance(vocab, int) or not 0 < vocab <= 1 << (8 * int(dtype[-1])):
        raise ValueError(f"{path}: tokens.vocab_size={vocab!r} does not fit tokens.dtype={dtype}; the manifest was "
                         "edited or damaged, re-run the conversion")
    return tokens


def token_dtype(vocab_size: int) -> str:
    """The narrowest unsigned type of TOKEN_DTYPES that holds ids below `vocab_size`."""
    for dtype in TOKEN_DTYPES:
        if vocab_size <= 1 << (8 * int(dtype[-1])):
            return dtype
    raise ValueError(f"a vocabulary of {vocab_size} ids does not fit 32 bits")


def _check_totals(d: dict[str, Any], records: int, path: str) -> None:
    if d["totals"].get("records") != records:
        raise ValueError(f"{path}: totals.records={d['totals'].get('records')} but the shards add up to "
                         f"{records}; {DAMAGED}")

