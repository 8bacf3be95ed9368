"""Resolving what the user passed into an ordered list of ArrayRecord shards with lengths.

Accepted sources:
- a directory written by `python -m pipelines convert` (its manifest.json: no shard is opened);
- a TFDS dataset version directory written with `--file_format=array_record` (its dataset_info.json,
  for one split), including our own TFDS conversions;
- a glob of ArrayRecord files (each opened once to read its record count).

Shard presence and sizes are checked against the manifest here (local shards: stat(2) on several threads at once;
gs://: one listing), so a missing or truncated shard fails before the epoch starts, naming the file.
"""

from __future__ import annotations

import dataclasses
import errno
import os

import numpy as np

from dataset_format import storage, tfds_info
from dataset_format.manifest import MANIFEST_NAME, ShardTable, merge_feature_stats
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
    # A pre-tokenized dataset's tokenizer, "PATH (sha256:16 hex digits)" from its manifest: the ids of datasets with
    # other tokenizers mean other tokens, so a mixture refuses them (loader/planning/mixture.py `concatenate`).
    tokenizer: str | None = None

    def __post_init__(self):
        if sum(self.lengths) == 0:
            raise ValueError(f"{self.location} has no records ({len(self.paths)} shard(s), all empty); "
                             "check that the conversion finished and that its input had records")

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
        return max(1, self.total_bytes // len(self)) if self.total_bytes else 1024

    @property
    def starts(self) -> np.ndarray:
        """Global index of each shard's first record."""
        return np.concatenate([[0], np.cumsum(self.lengths[:-1], dtype=np.int64)]).astype(np.int64)

    def where(self, index: int) -> str:
        """'SHARD: record i' for global record `index`, for errors."""
        starts = self.starts
        shard = int(np.searchsorted(starts, index, side="right") - 1)
        return f"{self.paths[shard]}: record {int(index - starts[shard])}"

    def where_all(self, indices: np.ndarray, shards_shown: int = 3, numbers_shown: int = 12) -> str:
        """'SHARD: records 3, 7-9; SHARD: records ...' for global records `indices`, for errors (a few shards and
        numbers, then how many more)."""
        starts = self.starts
        indices = np.unique(np.asarray(indices, dtype=np.int64))
        of_shard = np.searchsorted(starts, indices, side="right") - 1
        parts = []
        shards = np.unique(of_shard)
        for shard in shards[:shards_shown]:
            local = (indices[of_shard == shard] - starts[shard]).tolist()
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


def resolve(source: str, *, split: str | None = None, allow_incomplete: bool = False) -> ShardedSource:
    if _is_dir(source):
        manifest_path = storage.join(source, MANIFEST_NAME)
        if storage.exists(manifest_path):
            return _from_manifest(source, split, allow_incomplete)
        if storage.exists(storage.join(source, TFDS_INFO)):
            return _from_tfds_info(source, split or "train")
        below = _datasets_below(source)
        hint = f"; datasets below it: {', '.join(below)} (pass one of those)" if below else ""
        tfrecords = _tfrecords_in(source)
        if tfrecords and not below:
            hint = (f"; it holds TFRecord files ({tfrecords[0]}{', ...' if len(tfrecords) > 1 else ''}): convert them "
                    f"first: python -m pipelines convert --input {source} --output OUT")
        raise FileNotFoundError(f"{source} has neither {MANIFEST_NAME} nor {TFDS_INFO}; pass a directory written "
                                "by `python -m pipelines convert` or `tfds build --file_format=array_record`, or a "
                                f"glob of ArrayRecord files{hint}")
    return _from_glob(source)


def token_info(source: str) -> dict | None:
    """A pre-tokenized dataset's `tokens` manifest section (dtype, vocab_size, tokenizer...); None for other data."""
    if not _is_dir(source) or not storage.exists(storage.join(source, MANIFEST_NAME)):
        return None
    path = storage.join(source, MANIFEST_NAME)
    return ShardTable.from_json(_read_text(path), path=path).tokens


def _tfrecords_in(directory: str) -> list[str]:
    """The TFRecord file names directly in local `directory` (sorted), for the error when one is passed to load."""
    if storage.is_remote(directory):
        return []
    try:
        return sorted(e.name for e in os.scandir(directory) if e.is_file() and is_tfrecord_name(e.name))
    except OSError:
        return []


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


def _from_manifest(root: str, split: str | None, allow_incomplete: bool) -> ShardedSource:
    path = storage.join(root, MANIFEST_NAME)
    table = ShardTable.from_json(_read_text(path), path=path)
    if not table.complete and not allow_incomplete:
        raise ValueError(f"{path}: the conversion is incomplete ({len(table.failed)} shard(s) failed, e.g. "
                         f"{table.failed[0]['source']}); fix and re-run the conversion, or pass "
                         "allow_incomplete=True (python -m trainer: allow_incomplete=true) to load the shards that "
                         "converted")
    names, records, sizes, stats = table.paths, table.records, table.bytes, table.feature_stats
    if table.kind == "tfds":
        split = split or "train"
        keep = [i for i, s in enumerate(table.splits) if s == split]
        if not keep:
            raise ValueError(f"{path}: no shards for split {split!r}; the splits are {sorted(set(table.splits))}")
        names, records, sizes, stats = (tuple(column[i] for i in keep) for column in (names, records, sizes, stats))
    elif split is not None:
        raise ValueError(f"split={split!r} was given but {root} is not a TFDS dataset; leave split unset")
    prefix = storage.join(root, "")  # one join: 100k shards paid ~0.5 s for joining each
    paths = [prefix + name for name in names]
    found, versions = _stat(paths, missing=f"is listed in {MANIFEST_NAME} but missing; re-run `python -m pipelines "
                            "convert` (it recreates missing shards) or restage the data")
    wrong = np.flatnonzero(found != np.asarray(sizes, dtype=np.int64))
    if len(wrong):
        i = int(wrong[0])
        raise ValueError(f"{paths[i]} is {found[i]} bytes but {MANIFEST_NAME} says {sizes[i]}; the file is truncated "
                         "or was replaced (by a conversion that rewrites this output and has not finished?): let that "
                         "conversion finish, re-run it, or restage the data")
    features = root if table.kind == "tfds" and storage.exists(storage.join(root, FEATURES_NAME)) else None
    tokens = table.tokens.get("dtype") if table.tokens else None
    return ShardedSource(tuple(paths), records, "manifest", features, sizes, versions, tokens,
                         feature_stats=merge_feature_stats(stats), tokenizer=tokenizer_identity(table.tokens))


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


def _from_glob(pattern: str) -> ShardedSource:
    paths = storage.glob(pattern)
    if not paths:
        raise FileNotFoundError(f"no files match {pattern!r}; check the path and the glob{near_path(pattern)}")
    sidecar = next((p for p in paths if storage.basename(p) in _SIDECARS), None)
    if sidecar is not None:  # a glob over a converted (or TFDS) directory: the directory is what to pass
        directory = sidecar[: -len(storage.basename(sidecar))].rstrip("/") or "."
        raise ValueError(f"{pattern!r} matches {sidecar}, the dataset's metadata, not an ArrayRecord shard: pass the "
                         f"directory itself ({directory}), which also keeps its record counts and split names")
    from loader.format.arrayrecord import TFRecordFileError

    try:
        return of_files(paths, missing="vanished while the glob was read; check nothing is deleting shards")
    except TFRecordFileError:
        if len(paths) > 1:
            raise ValueError(f"{pattern!r} matches TFRecord files, not ArrayRecord: convert them first (python -m "
                             f"pipelines convert --input '{pattern}' --output DIR), then load DIR") from None
        raise


_SIDECARS = frozenset({MANIFEST_NAME, TFDS_INFO, FEATURES_NAME, "report.json"})


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
        details: dict[str, tuple[int, int]] = {}
        for directory in sorted({p.rsplit("/", 1)[0] for p in paths}):
            details.update({f"{directory}/{name}": d for name, d in storage.list_generations(directory).items()})
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

