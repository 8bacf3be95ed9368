"""Input listing, opening and source fingerprints, for local paths and gs://, through Beam's FileSystems
(which also reads gzip and other compressed TFRecords). Output naming is the contract's: see
dataset_format/naming.py.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems

from dataset_format.naming import is_tfrecord_name, output_name
from dataset_format.storage import basename, has_glob, is_remote

log = logging.getLogger(__name__)

_READ_BUFFER = 1 << 20


@dataclasses.dataclass(frozen=True)
class InputFile:
    path: str
    size: int
    mtime: float

    @property
    def fingerprint(self) -> str:
        """Changes whenever the file is rewritten: size and modification time (GCS: `updated`)."""
        return f"size={self.size},mtime={self.mtime:.6f}"

    @property
    def compression(self) -> str:
        return CompressionTypes.detect_compression_type(self.path)


def list_inputs(pattern: str) -> list[InputFile]:
    """Files matching `pattern`, sorted by path; raises if none. `pattern` is a file, a glob, or a directory (local,
    or a gs:// prefix): a directory converts the files directly in it whose names carry the `tfrecord` or
    `tfrecords` token (`train.tfrecord-00000-of-00004`, `part-0.tfrecords.gz`), hidden files and others skipped."""
    if not has_glob(pattern):
        in_directory = _directory_inputs(pattern)
        if in_directory is not None:
            return in_directory
        if not FileSystems.exists(pattern):
            _check_listable(_fixed_prefix(pattern))  # a file in a directory this user may not enter
            raise FileNotFoundError(f"input {pattern!r} does not exist; check the path (a file, a glob "
                                    "such as 'data/train-*.tfrecord', a directory, or a TFDS dataset directory)")
    files = _files(_match(pattern))
    if not files:
        _check_listable(_fixed_prefix(pattern))  # a glob cannot see into a directory it may not read
        raise FileNotFoundError(f"no files match {pattern!r}; check the directory and the glob")
    return files


def _fixed_prefix(pattern: str) -> str:
    """The directory part of `pattern` before its first glob character."""
    head = pattern[: min(i for i in (pattern.find(c) for c in "*?[") if i >= 0)] if has_glob(pattern) else pattern
    return head[: head.rfind("/") + 1] or "."


def _check_listable(directory: str) -> None:
    if not is_remote(directory) and os.path.isdir(directory) and not os.access(directory, os.R_OK | os.X_OK):
        raise PermissionError(f"input directory {directory!r} cannot be listed (permission denied); grant read "
                              f"access to it (e.g. chmod a+rx {directory!r}) or run as a user who can")


def check_readable(files: list[InputFile]) -> None:
    """Local inputs this process may not read fail the plan, before anything is written (a worker would fail
    on them mid-run). gs:// access is checked by the listing itself (a 403 names the bucket)."""
    unreadable = [f.path for f in files if not is_remote(f.path) and not os.access(f.path, os.R_OK)]
    if unreadable:
        more = f" and {len(unreadable) - 1} more" if len(unreadable) > 1 else ""
        raise PermissionError(f"input {unreadable[0]!r}{more} cannot be read (permission denied); grant read "
                              f"access (e.g. chmod a+r {unreadable[0]!r}) or leave it out of --input")


def _match(pattern: str) -> list:
    """Beam's match of `pattern`; a listing that fails (a missing bucket, no permission) is one line naming it."""
    from apache_beam.io.filesystem import BeamIOError

    try:
        return FileSystems.match([pattern])[0].metadata_list
    except BeamIOError as e:
        if is_remote(pattern):
            from dataset_format import storage

            storage.list_sizes(pattern[: pattern.rfind("/")])  # raises the precise error: bucket, 403
        raise FileNotFoundError(f"cannot list input {pattern!r} ({str(e).splitlines()[0][:200]}); check the path "
                                "and your access to it") from e


def _files(metadata_list) -> list[InputFile]:
    files = [InputFile(m.path, m.size_in_bytes, m.last_updated_in_seconds) for m in metadata_list
             if not m.path.endswith("/") and (is_remote(m.path) or not os.path.isdir(m.path))]
    return sorted(files, key=lambda f: f.path)


def _local_directory(path: str) -> list[InputFile]:
    """The files directly in local directory `path`, named as Beam's match of `path/*` names them, with one stat
    each where Beam's match takes three (docs/benchmarks.md, "Planning")."""
    directory = path.rstrip("/") or "/"
    files = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if not entry.is_dir():
                stat = entry.stat()
                files.append(InputFile(os.path.join(directory, entry.name), stat.st_size, stat.st_mtime))
    return sorted(files, key=lambda f: f.path)


def _directory_inputs(path: str) -> list[InputFile] | None:
    """The TFRecord files of directory `path` (see list_inputs); None when `path` is not a directory."""
    if not is_remote(path) and not os.path.isdir(path):
        return None
    _check_listable(path)
    found = _files(_match(path.rstrip("/") + "/*")) if is_remote(path) else _local_directory(path)
    if is_remote(path) and not found:
        return None  # not a prefix with objects under it: a missing file, said by the caller
    tfrecords = [f for f in found if is_tfrecord_name(basename(f.path))]
    if not tfrecords:
        names = [basename(f.path) for f in found[:3]]
        raise FileNotFoundError(f"input directory {path!r} holds no TFRecord files (names with 'tfrecord' or "
                                f"'tfrecords'{'; it has ' + ', '.join(names) if names else ''}); pass a glob of "
                                f"its files instead, e.g. --input '{path.rstrip('/')}/*'")
    if len(tfrecords) < len(found):
        skipped = [basename(f.path) for f in found if f not in tfrecords]
        log.info("%s: converting its %d TFRecord file(s); %d other file(s) skipped (e.g. %s)", path, len(tfrecords),
                 len(skipped), skipped[0])
    return tfrecords


def check_output_outside(inputs: list[InputFile], pattern: str, output: str) -> None:
    """An output among the inputs would be read back as input on the next run: refuse it up front."""
    prefix = output.rstrip("/") + "/"
    inside = [f.path for f in inputs if f.path.startswith(prefix) or f.path == output.rstrip("/")]
    if inside:
        raise ValueError(f"--output {output!r} is inside --input {pattern!r} (it matches {inside[0]!r}); the "
                         "converted shards would be read as inputs next time: choose an --output outside the input")


def output_names(sources: list[str]) -> dict[str, str]:
    """{source: its output shard's name}; two inputs mapping to one name would overwrite each other: refused."""
    names: dict[str, str] = {}
    seen: dict[str, str] = {}
    for source in sources:
        name = names[source] = output_name(source)
        if name in seen:
            raise ValueError(f"inputs {seen[name]!r} and {source!r} would both be written as {name!r}; "
                             "convert them into separate output directories")
        seen[name] = source
    return names


def open_source(path: str):
    """Opens a (possibly compressed, possibly remote) TFRecord file for streaming reads."""
    compression = CompressionTypes.detect_compression_type(path)
    if not is_remote(path) and compression == CompressionTypes.UNCOMPRESSED:
        return open(path, "rb", buffering=_READ_BUFFER)
    return FileSystems.open(path, compression_type=compression)
