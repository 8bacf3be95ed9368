"""Resolving what the user passed into an ordered list of ArrayRecord shards with lengths.

Accepted sources:
- a directory written by `python -m pipelines convert` (its manifest.json: no shard is opened);
- a TFDS dataset version directory written with `--file_format=array_record` (its dataset_info.json,
  for one split), including our own TFDS conversions;
- a glob of ArrayRecord files (each opened once to read its record count).

Any of them may be sliced by records with TFDS's split syntax (`split="train[:99%]"`, `"train[-1000:]"`,
`"train[2shard:]"`; a source without named splits takes the slice alone, `split="[:99%]"`): a held-out part of one
corpus without a second conversion. A slice keeps the whole source's shards and index; the shards outside it hold none
of its records and the two at its ends part of theirs (`ShardedSource.offsets`).

Shard presence and sizes are checked against the manifest here (local shards: stat(2) on several threads at once;
gs://: one listing), so a missing or truncated shard fails before the epoch starts, naming the file.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import hashlib
import json
import os
import re

import numpy as np

from dataset_format import storage, tfds_info
from dataset_format.manifest import COUNTS_SUFFIX, MANIFEST_NAME, ShardTable, merge_feature_stats, total_tokens
from dataset_format.naming import is_tfrecord_name
from dataset_format.suggest import near_path
from dataset_format.tfds_info import FEATURES_NAME, INFO_NAME as TFDS_INFO
from loader.format import _riegeli


@dataclasses.dataclass(frozen=True)
class ShardedSource:
    paths: tuple[str, ...]
    lengths: tuple[int, ...]
    kind: str  # "manifest", "tfds" or "glob"
    features_dir: str | None = None  # a directory holding TFDS features.json, when there is one
    shard_bytes: tuple[int, ...] | None = None  # stored size of each shard, when known without opening them
    # What the index key holds of each shard besides its path and size: a token that changes whenever its content
    # may have (locally its inode, change and modification times; on gs://, the object's generation).
    shard_versions: tuple[int, ...] | None = None
    tokens_dtype: str | None = None  # a pre-tokenized dataset's token id type (loader/planning/counts.py)
    # A mixture of components whose records decode differently (a TFDS dataset beside tf.Example corpora): each
    # component's features directory (None: tf.Examples) and records; its decoder decodes each record as its own.
    component_features: tuple[str | None, ...] | None = None
    component_lengths: tuple[int, ...] | None = None
    # Its records' feature statistics from the manifest (dataset_format/manifest.py FeatureStats: each integer
    # feature's min and max, the records that carry each feature); None where they were not recorded.
    feature_stats: dict | None = None
    # A pre-tokenized dataset's token ids, over its shards' every record (a slice's are among them); None: unknown.
    token_count: int | None = None
    # A pre-tokenized dataset's tokenizer, "PATH (sha256:16 hex digits)" from its manifest: the ids of datasets with
    # other tokenizers mean other tokens, so a mixture refuses them (loader/planning/mixture.py `concatenate`).
    tokenizer: str | None = None
    # A slice (resolve's split="train[:99%]"): the record of each shard's file where the source's records of it begin,
    # and each file's whole record count (the files are checked against it). None: every record of every shard.
    offsets: tuple[int, ...] | None = None
    file_lengths: tuple[int, ...] | None = None

    def __post_init__(self):
        if sum(self.lengths) == 0:
            raise ValueError(f"{self.location} has no records ({len(self.paths)} shard(s), all empty); "
                             "check that the conversion finished and that its input had records")
        if (self.offsets is None) != (self.file_lengths is None):
            raise ValueError("a ShardedSource's offsets and file_lengths come together (ShardedSource.sliced)")

    @property
    def first_records(self) -> np.ndarray:
        """Per shard, the record of its file that is the source's first of it (int64; zeros unless sliced)."""
        return np.zeros(len(self.paths), np.int64) if self.offsets is None else np.asarray(self.offsets, np.int64)

    @property
    def records_in_files(self) -> tuple[int, ...]:
        """Each shard file's record count (its footer's): `lengths` unless the source is a slice."""
        return self.lengths if self.file_lengths is None else self.file_lengths

    @property
    def slice_bounds(self) -> list[list[int]] | None:
        """The runs [start, stop) of the shards' records (their every record, end to end) that a slice holds, in its
        order; None when whole. What a loader state holds of the slice it was saved on."""
        if self.offsets is None:
            return None
        runs: list[list[int]] = []
        for first, n in zip((self.file_starts + self.first_records).tolist(), self.lengths):
            if n and runs and runs[-1][1] == first:
                runs[-1][1] += n
            elif n:
                runs.append([first, first + n])
        return runs

    @property
    def slice_key(self) -> str:
        """'' for whole shards, else a digest of which records of them the source holds (for caches keyed by the
        shards' index key that hold a value per record of the source)."""
        if self.offsets is None:
            return ""
        return hashlib.sha256(np.asarray(self.offsets + self.lengths, "<i8").tobytes()).hexdigest()[:16]

    @functools.cached_property
    def identity(self) -> str:
        """Which records, in which order: '3 shards, 1,000 records, sha256:<16 hex>' of each shard's file name (not
        its directory: a copy elsewhere, local or gs://, is the same dataset), record count and the slice's part of
        it. What a loader state holds of its dataset, so a state restores onto no other."""
        rows = [[p.rsplit("/", 1)[-1], n, first, length] for p, n, first, length in
                zip(self.paths, self.records_in_files, self.first_records.tolist(), self.lengths)]
        digest = hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()[:16]
        return f"{len(self.paths)} shard{'s' if len(self.paths) != 1 else ''}, {len(self):,} records, sha256:{digest}"

    def sliced(self, start: int, stop: int, what: str = "") -> ShardedSource:
        """Records [start, stop) of this source (its shards end to end), over the same shards and index. `what` names
        the slice in the error for an empty one."""
        if self.component_lengths is not None:
            raise ValueError("slice each component of a mixture, not the mixture (resolve each with split=)")
        if not 0 <= start < stop <= len(self):
            raise ValueError(f"{what or f'records [{start}:{stop}]'} of {self.location} holds no records (it has "
                             f"{len(self):,}); check the slice")
        starts = self.starts
        lengths = np.asarray(self.lengths, np.int64)
        begin = np.clip(start, starts, starts + lengths)
        end = np.clip(stop, starts, starts + lengths)
        return dataclasses.replace(self, lengths=tuple((end - begin).tolist()),
                                   offsets=tuple((self.first_records + begin - starts).tolist()),
                                   file_lengths=self.records_in_files)

    def __len__(self) -> int:
        return int(sum(self.lengths))

    @property
    def location(self) -> str:
        """Where the records are, for messages: the first shard's directory (local or gs://)."""
        return self.paths[0].rsplit("/", 1)[0] if self.paths else "the source"

    @property
    def total_bytes(self) -> int | None:
        """Stored size of all shards, when known."""
        return sum(self.shard_bytes) if self.shard_bytes else None

    @property
    def mean_record_bytes(self) -> int:
        """Stored bytes per record (compressed: a lower bound of the decoded size); 1 KB if unknown."""
        return max(1, self.total_bytes // sum(self.records_in_files)) if self.total_bytes else 1024

    @property
    def starts(self) -> np.ndarray:
        """Global index of each shard's first record."""
        return _starts_of(self.lengths)

    @property
    def file_starts(self) -> np.ndarray:
        """Each shard's first record among its files' every record, end to end (`starts` unless sliced): how caches
        and a slice's state name records, the same for the whole and each slice of it."""
        return _starts_of(self.records_in_files)

    def path_of(self, index: int) -> str:
        """The shard that holds global record `index`."""
        return self.paths[int(np.searchsorted(self.starts, index, side="right")) - 1]

    def where(self, index: int) -> str:
        """'SHARD: record i' for global record `index`, for errors (i counts the records of the shard's file)."""
        return self.where_all(np.array([index]))

    def where_all(self, indices: np.ndarray, shards_shown: int = 3, numbers_shown: int = 12) -> str:
        """'SHARD: records 3, 7-9; SHARD: records ...' for global records `indices`, for errors (a few shards and
        numbers, then how many more)."""
        starts, first = self.starts, self.first_records
        indices = np.unique(np.asarray(indices, dtype=np.int64))
        of_shard = np.searchsorted(starts, indices, side="right") - 1
        parts = []
        shards = np.unique(of_shard)
        for shard in shards[:shards_shown]:
            local = (indices[of_shard == shard] - starts[shard] + first[shard]).tolist()
            runs: list[list[int]] = []
            for i in local:
                if runs and i == runs[-1][1] + 1:
                    runs[-1][1] = i
                else:
                    runs.append([i, i])
            named = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:numbers_shown])
            more = f" and {len(runs) - numbers_shown} more" if len(runs) > numbers_shown else ""
            parts.append(f"{self.paths[shard]}: record{'s' if len(local) > 1 else ''} {named}{more}")
        if len(shards) > shards_shown:
            parts.append(f"and records of {len(shards) - shards_shown} more shards")
        return "; ".join(parts)


def _starts_of(counts: tuple[int, ...]) -> np.ndarray:
    """Where each of runs of `counts` records begins when they are laid end to end (int64)."""
    return np.concatenate([[0], np.cumsum(counts[:-1], dtype=np.int64)]).astype(np.int64)


def shared_records(a: ShardedSource, b: ShardedSource) -> int:
    """How many records `a` and `b` both hold: the same shard file (by path) and the same records of it (a held-out
    slice against the training slice of one dataset: 0 when they are disjoint)."""
    def runs(source: ShardedSource) -> dict[str, list[tuple[int, int]]]:
        """Per shard, the disjoint runs of its records the source holds (a split of several parts may hold several
        runs of one shard, or one run twice)."""
        found: dict[str, list[tuple[int, int]]] = {}
        for path, first, n in zip(source.paths, source.first_records.tolist(), source.lengths):
            if n:
                found.setdefault(path, []).append((first, first + n))
        for path, spans in found.items():
            merged = []
            for first, end in sorted(spans):
                if merged and first <= merged[-1][1]:
                    merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
                else:
                    merged.append((first, end))
            found[path] = merged
        return found

    theirs = runs(b)
    return sum(max(0, min(end, e) - max(first, f))
               for path, spans in runs(a).items() if path in theirs
               for first, end in spans for f, e in theirs[path])


def resolve(source: str, *, split: str | None = None, allow_incomplete: bool = False) -> ShardedSource:
    """The shards of `source` (see module doc) with their record counts; `split`: a TFDS split's name (default
    "train" for TFDS datasets), optionally sliced ("train[:99%]"), or a slice alone ("[:99%]"); parts joined by '+'."""
    return _select(split, lambda name, given: _resolve_whole(source, name, allow_incomplete, given))


def select(source: ShardedSource, split: str | None) -> ShardedSource:
    """`source`, resolved already, sliced by `split`: slices alone ("[:99%]"; several joined by '+'). A split's name
    is refused: a resolved source holds one split already."""
    def whole(name: str | None, given: str | None) -> ShardedSource:
        if name is not None:
            raise ValueError(f"split={given!r} names a split, but {source.location} was resolved already and holds "
                             "one; leave the name out (a slice alone, e.g. split='[:99%]', takes part of its records), "
                             "or pass the path with split=")
        return source

    return _select(split, whole)


def _select(split: str | None, whole_of) -> ShardedSource:
    """The parts of `split` (TFDS's syntax, joined by '+'), each `whole_of(name, part as written)` sliced, end to
    end."""
    if split is None:
        return whole_of(None, None)
    if not isinstance(split, str):
        raise ValueError(f"split={split!r} is not text; pass {_SPLIT_FORMS}")
    parts = []
    for part in (p.strip() for p in split.split("+")):
        if not part:
            raise ValueError(f"split={split!r} has an empty part beside a '+'; pass {_SPLIT_FORMS}")
        name, selector = parse_split(part)
        whole = whole_of(name, part)
        if selector is not None:
            what = f"split={part!r}"
            whole = whole.sliced(*selector.bounds(whole.lengths, what), what)
        parts.append(whole)
    return parts[0] if len(parts) == 1 else joined(parts)


def joined(parts: list[ShardedSource]) -> ShardedSource:
    """Sources end to end (the parts of split="train+validation", a mixture's components): one source over their
    shards, in that order, the first's kind and features. Sizes and versions are known where every part's are; the
    feature statistics are None where a part has none (unknown, not partial)."""
    def column(name: str) -> tuple:
        return tuple(x for p in parts for x in getattr(p, name))

    sliced = any(p.offsets is not None for p in parts)
    return dataclasses.replace(
        parts[0], paths=column("paths"), lengths=column("lengths"),
        shard_bytes=column("shard_bytes") if all(p.shard_bytes for p in parts) else None,
        shard_versions=column("shard_versions") if all(p.shard_versions for p in parts) else None,
        feature_stats=merge_feature_stats(p.feature_stats for p in parts),
        token_count=total_tokens(p.token_count for p in parts),
        offsets=tuple(o for p in parts for o in p.first_records.tolist()) if sliced else None,
        file_lengths=column("records_in_files") if sliced else None)


def _resolve_whole(source: str, split: str | None, allow_incomplete: bool, given: str | None = None) -> ShardedSource:
    """The shards of `source`, of split `split` (a name, or None) where it has named splits; `given`: the split as the
    user wrote it, for messages."""
    given = given or split
    if _is_dir(source):
        manifest_path = storage.join(source, MANIFEST_NAME)
        if storage.exists(manifest_path):
            return _from_manifest(source, split, allow_incomplete, given)
        if storage.exists(storage.join(source, TFDS_INFO)):
            return _from_tfds_info(source, split or "train")
        below = _datasets_below(source)
        hint = f"; datasets below it: {', '.join(below)} (pass one of those)" if below else ""
        tfrecords = _tfrecords_in(source)
        if tfrecords and not below:
            named = is_tfrecord_name(tfrecords[0])  # (convert takes a directory of *.tfrecord* files, else a glob)
            prefixes = list(dict.fromkeys(m.group(1) if (m := re.match(r"^([^.][^/]*?[-_.])\d", name)) else ""
                                          for name in tfrecords))
            if len(prefixes) > 1 and all(prefixes):  # splits side by side (text-train.*, text-test.*): one dataset each
                first = prefixes[0]
                kinds = ", ".join(f"{k}*" for k in prefixes[:4]) + (", ..." if len(prefixes) > 4 else "")
                hint = (f"; it holds TFRecord files of {len(prefixes)} kinds ({kinds}): convert each to its own "
                        "directory first, e.g. "
                        f"python -m pipelines convert --input '{source.rstrip('/')}/{first}*' --output "
                        f"OUT/{re.sub(r'[-_.]?tfrecords?$', '', first.rstrip('-_.')) or 'DATASET'}")
            else:
                given = source if named else f"'{source.rstrip('/')}/{prefixes[0]}*'"
                hint = (f"; it holds TFRecord files ({tfrecords[0]}{', ...' if len(tfrecords) > 1 else ''}): convert "
                        f"them first: python -m pipelines convert --input {given} --output OUT")
        raise FileNotFoundError(f"{source} has neither {MANIFEST_NAME} nor {TFDS_INFO}; pass a directory written "
                                "by `python -m pipelines convert` or `tfds build --file_format=array_record`, or a "
                                f"glob of ArrayRecord files{hint}")
    if split is not None:
        raise ValueError(f"split={given!r} names a split, but {source!r} is a glob of files, which has none; leave the "
                         "name out (a slice alone, e.g. split='[:99%]', takes part of the files' records)")
    return _from_glob(source, allow_incomplete)


# TFDS's split syntax (tensorflow_datasets/core/splits.py): NAME, NAME[FROM:TO], with FROM and TO in records (negative:
# from the end), in percent of the records (rounded to the closest record) or in shards (NAME[2shard:] , NAME[3shard]).
_SPLIT = re.compile(r"^(?P<name>[\w-]*)(?:\[(?P<selector>[^\[\]]*)\])?$")
_BOUND = re.compile(r"^(?:(?P<value>-?[\d_]+(?:\.[\d_]*)?)(?P<unit>%|shard)?)?$")
_SPLIT_FORMS = ("a split's name ('train'), a slice of one ('train[:99%]', 'train[-1000:]', 'train[2shard:]'; TFDS's "
                "syntax), several joined by '+' ('train+validation') or, for a source without named splits, a slice "
                "alone ('[99%:]')")


@dataclasses.dataclass(frozen=True)
class Selector:
    """[start:stop] of a split, as written: bounds (None: open) in one unit, "abs" (records), "%" or "shard"."""

    start: float | int | None
    stop: float | int | None
    unit: str

    def bounds(self, lengths: tuple[int, ...], what: str) -> tuple[int, int]:
        """[start, stop) in records of shards of `lengths` (as TFDS reads the same slice); an error naming `what` if
        the slice holds no records or passes the records' end."""
        n = int(sum(lengths))
        ends = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        shards = len(lengths)

        def absolute(value, default: int, is_stop: bool) -> int:
            if value is None:
                return default
            if self.unit == "%":
                if not -100 <= value <= 100:  # (also an infinite one, from hundreds of digits)
                    raise ValueError(f"{what} passes the end of the records (a bound beyond 100%); check the slice")
                return int(round(value * n / 100.0))
            if self.unit == "shard":
                if value == 0 and is_stop:  # TFDS reads a stop of 0 shards as the split's end
                    return n
                if not -shards <= value <= shards:
                    raise ValueError(f"{what} names shard {value}, but there are {shards} shard(s); check the slice")
                return int(ends[value % shards if value < 0 else value])
            return int(value)

        start, stop = absolute(self.start, 0, False), absolute(self.stop, n, True)
        if abs(start) > n or abs(stop) > n:
            raise ValueError(f"{what} passes the end of the {n:,} records; check the slice")
        start, stop = start + n if start < 0 else start, stop + n if stop < 0 else stop
        if start >= stop:
            raise ValueError(f"{what} is records [{start}:{stop}] of {n:,}: no records; check the slice")
        return start, stop


def parse_split(split: str | None) -> tuple[str | None, Selector | None]:
    """(the split's name or None, its slice or None) of one part of `split` in TFDS's syntax (resolve takes several
    joined by '+'); a clear error for anything else."""
    if split is None:
        return None, None
    if "(" in split:
        raise ValueError(f"split={split!r}: percent bounds round to the closest record, as TFDS's default does; its "
                         "other rounding, (pct1_dropremainder), is not taken: drop the option")
    match = _SPLIT.match(split.strip())
    if match is None or not (match["name"] or match["selector"] is not None):
        raise ValueError(f"split={split!r} is not a split; pass {_SPLIT_FORMS}")
    name, selector = match["name"] or None, match["selector"]
    if selector is None:
        return name, None
    parts = [_BOUND.match(part.strip()) for part in selector.split(":")]
    if len(parts) > 2 or not all(parts) or not any(p["value"] for p in parts):
        raise ValueError(f"split={split!r} has a slice that does not read [FROM:TO]; pass {_SPLIT_FORMS}")
    units = {p["unit"] or "abs" for p in parts if p["value"]}
    if len(units) > 1:
        raise ValueError(f"split={split!r} mixes units ({', '.join(sorted(units))}); write both bounds in records, "
                         "in % or in shards")
    unit = units.pop()
    if len(parts) == 1 and unit != "shard":
        raise ValueError(f"split={split!r}: a single bound is a shard ('[3shard]'); for records write a slice "
                         "('[3:4]')")
    values = []
    for part in parts:
        text = (part["value"] or "").replace("_", "")
        if unit != "%" and "." in text:
            raise ValueError(f"split={split!r}: {'records' if unit == 'abs' else 'shards'} are whole numbers; a "
                             "fraction is written in % ('[:99.5%]')")
        values.append(None if not text else float(text) if unit == "%" else int(text))
    if len(values) == 1:  # NAME[3shard]: that shard alone
        values.append(values[0] + 1 if values[0] != -1 else None)
    return name, Selector(values[0], values[1], unit)


def token_info(source: str) -> dict | None:
    """A pre-tokenized dataset's `tokens` manifest section (dtype, vocab_size, tokenizer...), of its directory or of a
    glob over its shards; None for other data."""
    if storage.has_glob(source):
        converted = _converted_shards(storage.glob(source))
        return converted[2].tokens if converted is not None else None
    if not _is_dir(source) or not storage.exists(storage.join(source, MANIFEST_NAME)):
        return None
    path = storage.join(source, MANIFEST_NAME)
    return ShardTable.from_json(_read_text(path), path=path).tokens


def _tfrecords_in(directory: str, sniffed: int = 8) -> list[str]:
    """The TFRecord file names directly in local `directory` (sorted), for the error when one is passed to load: by
    name (`*.tfrecord*`), or by content for the first `sniffed` other files (ImageNet's `train-00000-of-01024`)."""
    from dataset_format.sniff import is_tfrecord_header

    if storage.is_remote(directory):
        return []
    try:
        files = sorted((e.name, e.path) for e in os.scandir(directory) if e.is_file() and not e.name.startswith("."))
    except OSError:
        return []
    named = [name for name, _ in files if is_tfrecord_name(name)]
    if named:
        return named
    found = []
    for name, path in files[:sniffed]:
        try:
            with open(path, "rb") as f:
                head = f.read(64)
            if is_tfrecord_header(head, os.path.getsize(path)):
                found.append(name)
        except OSError:
            continue
    return found


def _datasets_below(root: str, depth: int = 3, limit: int = 5) -> list[str]:
    """Directories up to `depth` levels below local `root` that hold a manifest or TFDS info (the first `limit`),
    for the error when a user passes their parent."""
    if storage.is_remote(root):
        return []
    found = []
    base = root.rstrip(os.sep).count(os.sep)
    for directory, subdirs, files in os.walk(root):
        subdirs.sort()
        if directory.count(os.sep) - base >= depth:
            subdirs.clear()
        if directory != root and (MANIFEST_NAME in files or TFDS_INFO in files):
            found.append(directory)
            subdirs.clear()
            if len(found) == limit:
                break
    return found


def _from_manifest(root: str, split: str | None, allow_incomplete: bool, given: str | None = None,
                   only: frozenset[str] | None = None, table: ShardTable | None = None) -> ShardedSource:
    """The shards `root`'s manifest lists (of `split`; `only`: those of these names, whatever their split); `table`:
    the manifest, when the caller has read it."""
    path = storage.join(root, MANIFEST_NAME)
    table = table or ShardTable.from_json(_read_text(path), path=path)
    if not table.complete and not allow_incomplete:
        raise ValueError(f"{path}: the conversion is incomplete ({len(table.failed)} shard(s) failed, e.g. "
                         f"{table.failed[0]['source']}); fix and re-run the conversion, or pass "
                         "allow_incomplete=True (python -m trainer: allow_incomplete=true; python -m loader bench: "
                         "--allow-incomplete) to load the shards that converted")
    names, records, sizes, stats = table.paths, table.records, table.bytes, table.feature_stats
    counts = table.token_counts or (None,) * len(names)
    keep = None
    if only is not None:
        keep = [i for i, name in enumerate(names) if name in only]
    elif table.kind == "tfds":
        split = split or "train"
        keep = [i for i, s in enumerate(table.splits) if s == split]
        if not keep:
            raise ValueError(f"{path}: no shards for split {split!r}; the splits are {sorted(set(table.splits))}")
    elif split is not None:
        raise ValueError(f"split={given or split!r} names a split, but {root} is not a TFDS dataset and has none; "
                         "leave the name out (a slice alone, e.g. split='[:99%]', takes part of its records)")
    if keep is not None:
        names, records, sizes, stats, counts = (tuple(column[i] for i in keep)
                                                for column in (names, records, sizes, stats, counts))
    prefix = storage.join(root, "")  # one join: 100k shards paid ~0.5 s for joining each
    paths = [prefix + name for name in names]
    found, versions = _stat(paths, missing=f"is listed in {MANIFEST_NAME} but missing; re-run `python -m pipelines "
                            "convert` (it recreates missing shards) or restage the data")
    wrong = np.flatnonzero(found != np.asarray(sizes, dtype=np.int64))
    if len(wrong):
        i = int(wrong[0])
        raise ValueError(f"{paths[i]} is {found[i]} bytes but {MANIFEST_NAME} says {sizes[i]}; the file was cut "
                         "short, appended to or replaced (by a conversion that rewrites this output and has not finished?): let that "
                         "conversion finish, re-run it, or restage the data")
    features = root if table.kind == "tfds" and storage.exists(storage.join(root, FEATURES_NAME)) else None
    tokens = table.tokens.get("dtype") if table.tokens else None
    return ShardedSource(tuple(paths), records, "manifest", features, sizes, versions, tokens,
                         feature_stats=merge_feature_stats(stats), tokenizer=tokenizer_identity(table.tokens),
                         token_count=total_tokens(counts) if tokens else None)


def tokenizer_identity(tokens: dict | None) -> str | None:
    """A pre-tokenized dataset's tokenizer as "PATH (sha256:...)", from its manifest's `tokens` section; None for
    other data. Two datasets whose ids mean the same tokens have the same digest (the path may differ)."""
    if not tokens:
        return None
    return f"{tokens.get('tokenizer')} (sha256:{str(tokens.get('tokenizer_sha256'))[:16]})"


def _from_tfds_info(root: str, split: str) -> ShardedSource:
    info = tfds_info.read_info(root)
    if info.get("fileFormat") != "array_record":
        raise ValueError(f"{storage.join(root, TFDS_INFO)} says fileFormat={info.get('fileFormat', 'tfrecord')!r}; convert it "
                         f"first: python -m pipelines convert --input {root} --output OUT")
    try:
        shards = tfds_info.split_shards(info, split, "array_record")
    except ValueError as e:
        raise ValueError(f"{storage.join(root, TFDS_INFO)}: {e}") from None
    paths = [storage.join(root, name) for name, _ in shards]
    found, versions = _stat(paths, missing=f"is listed in {TFDS_INFO} but missing; rebuild or re-download the dataset")
    return ShardedSource(tuple(paths), tuple(n for _, n in shards), "tfds", root, tuple(found.tolist()), versions)


def _from_glob(pattern: str, allow_incomplete: bool = False) -> ShardedSource:
    paths = storage.glob(pattern)
    if not paths:
        raise FileNotFoundError(f"no files match {pattern!r}; check the path and the glob{near_path(pattern)}")
    sidecar = next((p for p in paths if storage.basename(p) in _SIDECARS), None)
    if sidecar is not None:  # a glob over a converted (or TFDS) directory: the directory is what to pass
        directory = sidecar[: -len(storage.basename(sidecar))].rstrip("/") or "."
        raise ValueError(f"{pattern!r} matches {sidecar}, the dataset's metadata, not an ArrayRecord shard: pass the "
                         f"directory itself ({directory}), which also keeps its record counts and split names")
    converted = _converted_shards(paths)
    if converted is not None:  # shards of a converted directory: its manifest's, with their counts and tokenizer
        root, names, table = converted
        return _from_manifest(root, None, allow_incomplete, only=names, table=table)
    from loader.format.arrayrecord import TFRecordFileError

    try:
        return of_files(paths, missing="vanished while the glob was read; check nothing is deleting shards")
    except TFRecordFileError:
        if len(paths) > 1:
            raise ValueError(f"{pattern!r} matches TFRecord files, not ArrayRecord: convert them first (python -m "
                             f"pipelines convert --input '{pattern}' --output DIR), then load DIR") from None
        raise


_SIDECARS = frozenset({MANIFEST_NAME, TFDS_INFO, FEATURES_NAME, "report.json"})


def _converted_shards(paths: list[str]) -> tuple[str, frozenset[str], ShardTable] | None:
    """(directory, shard names, its manifest) when the glob's matches lie in one directory whose manifest lists them (a
    pre-tokenized shard's `.counts` file, matched beside it, left out): the glob then reads those shards as the
    directory does, not as bare files (which would lose the counts, the tokenizer and the feature ranges)."""
    directories = {p[: -len(storage.basename(p))] for p in paths}
    if len(directories) != 1:
        return None
    root = directories.pop().rstrip("/") or "."
    if not storage.exists(storage.join(root, MANIFEST_NAME)):
        return None
    path = storage.join(root, MANIFEST_NAME)
    table = ShardTable.from_json(_read_text(path), path=path)
    listed = set(table.paths)
    names = {storage.basename(p) for p in paths}
    names -= {n for n in names if n.endswith(COUNTS_SUFFIX) and n[: -len(COUNTS_SUFFIX)] in listed}
    if not names <= listed:
        return None
    return root, frozenset(names), table


def of_files(paths: list[str], missing: str = "does not exist; check the path") -> ShardedSource:
    """ArrayRecord files, numbered in the order given; each file's record count from its footer (two reads at its
    end, loader/format/arrayrecord.py)."""
    from loader.format.arrayrecord import read_footer

    if not paths:
        raise ValueError("no ArrayRecord files given; pass at least one path")
    sizes, versions = _stat(paths, missing=missing)
    lengths = []
    for p, size in zip(paths, sizes.tolist()):
        try:
            lengths.append(read_footer(p, size).num_records)
        except ValueError as e:  # (its type kept: a TFRecord file's error is told apart by _from_glob)
            raise type(e)(f"{e}; pass only ArrayRecord shards (check the glob or the list)") from None
    return ShardedSource(tuple(paths), tuple(lengths), "glob", None, tuple(sizes.tolist()), versions)


def _stat(paths: list[str], *, missing: str) -> tuple[np.ndarray, tuple[int, ...]]:
    """Each file's size (int64 array) and version, for the index key. Raises FileNotFoundError "<path> <missing>" for
    the first file that is not there.

    A version must change whenever the file's bytes may have: a size and a modification time do not (`cp -p`,
    `rsync -t` and `os.utime` put an mtime back, and ArrayRecord sizes are multiples of 64 KiB, so sizes collide).
    Locally it mixes the inode and the change time (which no user tool can set back) with the mtime; on gs:// it is
    the object's generation."""
    if paths and storage.is_remote(paths[0]):
        details = storage.generations_of(paths)
        for p in paths:
            if p not in details:
                raise FileNotFoundError(f"{p} {missing}")
        return (np.array([details[p][0] for p in paths], dtype=np.int64), tuple(details[p][1] for p in paths))
    sizes, mtimes, errnos, ctimes, inodes = (np.empty(len(paths), dtype=np.int64) for _ in range(5))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    _riegeli.stat_paths(paths, sizes, mtimes, errnos, cores, ctimes, inodes)
    failed = np.flatnonzero(errnos)
    if len(failed):
        i = int(failed[0])
        if errnos[i] == errno.ENOENT:
            raise FileNotFoundError(f"{paths[i]} {missing}")
        raise OSError(f"{paths[i]}: {os.strerror(int(errnos[i]))}; a shard must be a readable file")
    return sizes, tuple(_mix(mtimes, ctimes, inodes).tolist())


def _mix(*columns: np.ndarray) -> np.ndarray:
    """One int64 per row from several int64 columns (a multiply-xorshift mix: a change in any column changes it)."""
    with np.errstate(over="ignore"):
        out = np.zeros(len(columns[0]), dtype=np.uint64)
        for column in columns:
            out = (out ^ column.astype(np.uint64)) * np.uint64(0x9E3779B97F4A7C15)
            out ^= out >> np.uint64(29)
    return out.view(np.int64)


def _is_dir(path: str) -> bool:
    if any(c in path for c in "*?["):
        return False
    if not storage.is_remote(path):
        return os.path.isdir(path)
    return storage.exists(storage.join(path, MANIFEST_NAME)) or storage.exists(storage.join(path, TFDS_INFO))


def _read_text(path: str) -> str:
    text = storage.read_text(path)
    if text is None:
        raise FileNotFoundError(f"{path} does not exist")
    return text

