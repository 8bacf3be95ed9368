"""Input listing, opening and source fingerprints, for local paths and gs://, through Beam's FileSystems
(which also reads gzip and other compressed TFRecords). Output naming is the contract's: see
dataset_format/naming.py.
"""

from __future__ import annotations

import bz2
import dataclasses
import gzip
import io
import logging
import lzma
import os
import re
import zlib

from dataset_format import sniff, storage
from dataset_format.manifest import MANIFEST_NAME
from dataset_format.naming import is_tfrecord_name, output_name
from dataset_format.storage import absolute, basename, has_glob, is_remote
from dataset_format.tfds_info import INFO_NAME
from pipelines import tfrecord

log = logging.getLogger(__name__)

_READ_BUFFER = 1 << 20


class ConvertedInput(FileNotFoundError):
    """An input that is a converted output (it holds a manifest), not TFRecord shards: `path`."""

    def __init__(self, path: str, message: str):
        super().__init__(message)
        self.path = path


class Compression:
    """Beam's CompressionTypes (the same strings, which Beam's FileSystems takes), without importing Beam (~3 s)
    where no pipeline runs: `verify`, `status`, `plan`, a local listing."""
    AUTO, BZIP2, DEFLATE, GZIP, LZMA, UNCOMPRESSED, ZSTD = ("auto", "bzip2", "deflate", "gzip", "lzma", "uncompressed",
                                                           "zstd")
    _SUFFIXES = {".bz2": BZIP2, ".deflate": DEFLATE, ".gz": GZIP, ".zst": ZSTD, ".zstd": ZSTD, ".xz": LZMA,
                 ".lzma": LZMA}

    @classmethod
    def detect_compression_type(cls, path: str) -> str:
        """The compression a file's suffix names, as Beam's CompressionTypes.detect_compression_type."""
        lowered = path.lower()
        return next((kind for suffix, kind in cls._SUFFIXES.items() if lowered.endswith(suffix)), cls.UNCOMPRESSED)


def _filesystems():
    """Beam's FileSystems (gs:// listings and reads through Beam's client), imported when first needed."""
    from apache_beam.io.filesystems import FileSystems

    return FileSystems

@dataclasses.dataclass(frozen=True)
class InputFile:
    path: str
    size: int
    mtime: float
    generation: int | None = None  # a gs:// object's, as listed

    @property
    def fingerprint(self) -> str:
        """Changes whenever the file is rewritten: size and modification time; on gs://, size and generation (its
        `updated` time also moves when only its metadata changes: a storage-class move, `gcloud storage objects
        update`, which left its bytes as they were)."""
        if self.generation is not None:
            return f"size={self.size},generation={self.generation}"
        return self._sized_and_timed

    def matches(self, fingerprint: str) -> bool:
        """Whether a recorded fingerprint is this file's: its own, or (gs://) the size and `updated` time that
        earlier releases recorded."""
        return fingerprint in (self.fingerprint, self._sized_and_timed)

    @property
    def _sized_and_timed(self) -> str:
        return f"size={self.size},mtime={self.mtime:.6f}"

    @property
    def compression(self) -> str:
        return Compression.detect_compression_type(self.path)


def list_inputs(pattern: str) -> list[InputFile]:
    """Files matching `pattern`, sorted by path; raises if none. `pattern` is a file, a glob, or a directory (local,
    or a gs:// prefix): a directory converts the files directly in it whose names carry the `tfrecord` or
    `tfrecords` token (`train.tfrecord-00000-of-00004`, `part-0.tfrecords.gz`), hidden files and others skipped."""
    if not has_glob(pattern):
        in_directory = _directory_inputs(pattern)
        if in_directory is not None:
            return in_directory
        if not (_filesystems().exists(pattern) if is_remote(pattern) else os.path.exists(pattern)):
            _check_listable(_fixed_prefix(pattern))  # a file in a directory this user may not enter
            raise FileNotFoundError(f"input {pattern!r} does not exist; check the path (a file, a glob "
                                    "such as 'data/train-*', a directory, or a TFDS dataset directory)")
    files = _unhidden(_files(_match(pattern)) if is_remote(pattern) else _local_glob(pattern), pattern)
    if not files and not is_remote(pattern) and os.path.isfile(pattern):  # a name holding `[`: the file it names
        import glob as globlib

        files = _local_glob(globlib.escape(pattern))
    if not files:
        directory = _fixed_prefix(pattern)
        _check_listable(directory)  # a glob cannot see into a directory it may not read
        raise FileNotFoundError(f"no files match {pattern!r}; check the directory and the glob"
                                f"{_holds(directory, sorted(_names_in(directory)))}")
    if all(".array_record" in basename(f.path) for f in files):  # (each shard failed on it, one by one)
        raise ConvertedInput(pattern, f"input {pattern!r} names ArrayRecord files (e.g. {files[0].path!r}), converted "
                                      "already: load them as they are (loader.load), or pass the TFRecords they were "
                                      "converted from as --input")
    if has_glob(pattern):
        _warn_if_splits_mix(pattern, files[0].path.rsplit("/", 1)[0], files)
    return files


def list_files(directory: str) -> list[InputFile]:
    """Every file directly in `directory` (local, or a gs:// prefix), named and fingerprinted as `list_inputs` names
    them; [] when it does not exist."""
    if not is_remote(directory):
        return _local_directory(directory) if os.path.isdir(directory) else []
    return _files(_match(directory.rstrip("/") + "/*"))


def _unhidden(files: list[InputFile], pattern: str) -> list[InputFile]:
    """`files` less those a glob matched by accident: hidden files (`.part-0.crc`: a shell's `*` skips them) and
    markers (`_SUCCESS`: Hadoop's and Spark's hidden names), or files in such directories below the glob's fixed part
    (`**` reaching an output's `.shards/`, Spark's `_temporary/`), unless the glob names one (a part starting so)."""
    prefix = _fixed_prefix(pattern)
    prefix = "" if prefix == "." and not pattern.startswith("./") else prefix
    below = pattern[len(prefix):]
    hidden = {".", "_"} - {c for c in "._" if f"/{c}" in f"/{below}"}

    def seen(path: str) -> bool:
        parts = (path[len(prefix):] if path.startswith(prefix) else basename(path)).split("/")
        return not any(part[:1] in hidden for part in parts)

    kept = [f for f in files if seen(f.path)]
    if len(kept) < len(files):
        skipped = [basename(f.path) for f in files if f not in kept]
        _once(logging.INFO, "%s: %d hidden or marker file(s) skipped (e.g. %s); name them in the glob to convert "
              "them", pattern, len(skipped), skipped[0])
    return kept


def _names_in(directory: str) -> list[str]:
    """The base names of the files directly in `directory` (none when it cannot be listed), for an error."""
    from dataset_format import storage

    try:
        return list(storage.list_sizes(directory))
    except OSError:  # 403, a missing bucket: the error being built names the glob; the listing only adds a hint
        return []


def split_globs(directory: str, names: list[str], limit: int = 3) -> list[str]:
    """One glob per group of shards in `names` (the name up to its shard number: `train-00000-of-01024` ->
    `DIR/train-*`, `mnist-test.tfrecord-00000-of-00001` -> `DIR/mnist-test.tfrecord-*`), the first `limit`: what
    to convert one split at a time, where `DIR/*` would mix the splits."""
    prefixes = sorted(dict.fromkeys(m.group(1) for m in map(_SHARD_NUMBER.match, sorted(names)) if m),
                      key=lambda prefix: "train" not in prefix)  # the training split first, as the example
    return [f"{directory.rstrip('/')}/{prefix}*" for prefix in prefixes[:limit]]


_SHARD_NUMBER = re.compile(r"^([^.][^/]*?[-_.])\d")  # a name's part before its first number that follows - _ or .


def _holds(directory: str, names: list[str]) -> str:
    """'; DIR holds 2,048 files: a, b, c, ...: e.g. --input 'DIR/train-*'' for an error about `directory`."""
    if not names:
        return f"; {directory} holds no files" if directory not in (".", "") else ""
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    globs = split_globs(directory, names)
    hint = (f"; one --input per split, e.g. --input '{globs[0]}'" + (
        f" (and --input '{globs[1]}' into another --output)" if len(globs) > 1 else "")) if globs else ""
    return f"; {directory} holds {len(names):,} file(s): {shown}{hint}"


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

    if is_remote(pattern):
        from dataset_format import storage

        storage._client()  # no credentials: one line at once (Beam's client retries ~20 s, then lists anonymously)
    try:
        return _filesystems().match([pattern])[0].metadata_list
    except BeamIOError as e:
        if is_remote(pattern):
            from dataset_format import storage

            storage.list_sizes(pattern[: pattern.rfind("/")])  # raises the precise error: bucket, 403
        raise FileNotFoundError(f"cannot list input {pattern!r} ({str(e).splitlines()[0][:200]}); check the path "
                                "and your access to it") from e


def _files(metadata_list) -> list[InputFile]:
    files = [InputFile(m.path, m.size_in_bytes, m.last_updated_in_seconds) for m in metadata_list
             if not m.path.endswith("/") and (is_remote(m.path) or not os.path.isdir(m.path))]
    return sorted(with_generations(files), key=lambda f: f.path)


def with_generations(files: list[InputFile]) -> list[InputFile]:
    """`files`, gs:// ones with their objects' generations and sizes, as one listing of each directory finds them
    (a page a 1,000 objects; Beam's match gives neither); local ones as they are."""
    remote = [f.path for f in files if is_remote(f.path)]
    if not remote:
        return files
    found = storage.generations_of(remote)
    return [dataclasses.replace(f, size=found[f.path][0], generation=found[f.path][1]) if f.path in found else f
            for f in files]


def _tfds_versions(path: str) -> tuple[int, list[str]]:
    """TFDS dataset versions (directories holding a dataset_info.json) below `path` (local or gs://), at the first
    depth that has any: 1 for a dataset's directory (`mnist/` -> `mnist/3.0.1`), 2 for a data_dir (`mnist/3.0.1`),
    3 for a data_dir of datasets with configs (`wmt/de-en/1.0.0`). (depth, versions, each dataset's oldest first);
    (0, []) where there are none."""
    level = [path.rstrip("/")]
    for depth in (1, 2, 3):  # (an error's hint: at most _MAX_LISTED listings a level, one request each on gs://)
        children = [f"{d}/{name}" for d in level[:_MAX_LISTED] for name in sorted(storage.entries(d, 1000))]
        listed = {c: storage.entries(c, 1000) for c in children[:_MAX_LISTED]}
        # (TFDS builds a version in `incomplete.<id>_1.0.0` or `1.0.0.incomplete<id>`: a leftover, not a version)
        found = [c for c, names in listed.items() if INFO_NAME in names and "incomplete" not in basename(c)]
        if found:
            return depth, sorted(found, key=lambda d: (d[: d.rfind("/")], [
                (0, int(p), "") if p.isdigit() else (1, 0, p) for p in basename(d).split(".")]))
        level = [c for c, names in listed.items() if names]
    return 0, []


_MAX_LISTED = 64


def _tfds_hint(path: str) -> str | None:
    """The error for a directory above TFDS dataset versions (a dataset's, or a data_dir), naming one to pass."""
    depth, versions = _tfds_versions(path)
    if not versions:
        return None
    if depth == 1:
        return (f"input directory {path!r} is a TFDS dataset's directory: pass one version of it, which holds "
                f"dataset_info.json, e.g. --input {versions[-1]} (it has {', '.join(basename(v) for v in versions)})")
    base = path.rstrip("/") + "/"
    shown = ", ".join(v[len(base):] for v in versions[:4]) + (", ..." if len(versions) > 4 else "")
    return (f"input directory {path!r} holds TFDS datasets ({shown}): pass one version of one, which holds "
            f"dataset_info.json, e.g. --input {versions[-1]}")


def _local_glob(pattern: str) -> list[InputFile]:
    """The files local `pattern` matches (a file, or a glob: wildcards in any part, `**` across directories), named as
    the pattern names them (relative stays relative), one stat each. Beam's match finds nothing for a relative glob
    whose first part has a wildcard (`*raw/*.tfrecord`)."""
    import glob as globlib

    files = []
    for path in globlib.glob(pattern, recursive=True, include_hidden=True):  # (_unhidden says what it skips)
        try:
            stat = os.stat(path)
        except OSError:  # (gone since the listing)
            continue
        if not os.path.isdir(path):
            files.append(InputFile(path, stat.st_size, stat.st_mtime))
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
        hint = _tfds_hint(path)  # (a prefix whose objects are all deeper: a TFDS dataset's directory, a data_dir)
        if hint is not None:
            raise FileNotFoundError(hint)
        return None  # not a prefix with objects under it: a missing file, said by the caller
    tfrecords = [f for f in found if is_tfrecord_name(basename(f.path))]
    if not tfrecords:
        names = [basename(f.path) for f in found]
        if MANIFEST_NAME in names:
            raise ConvertedInput(path, f"input directory {path!r} is a converted output (it holds {MANIFEST_NAME}): "
                                       f"it needs no conversion; load it as it is (loader.load({path!r}), python -m "
                                       f"trainer data={path}), or pass the TFRecords it was converted from as --input")
        hint = _tfds_hint(path)
        if hint is not None:
            raise FileNotFoundError(hint)
        subdirs = [] if names or is_remote(path) else sorted(e.name for e in os.scandir(path) if e.is_dir())
        if subdirs:  # files only in subdirectories: `DIR/*` would match none of them
            raise FileNotFoundError(f"input directory {path!r} holds no files, only directories "
                                    f"({', '.join(subdirs[:4])}{', ...' if len(subdirs) > 4 else ''}); pass the one "
                                    f"holding the TFRecord files, or a glob of them, e.g. --input "
                                    f"'{path.rstrip('/')}/{subdirs[0]}/*'")
        globs = split_globs(path, names)
        whose = "one split's" if globs else "its"
        example = (f"e.g. --input '{globs[0]}'" + (f" and --input '{globs[1]}' into another --output"
                                                   if len(globs) > 1 else "")) if globs else \
            f"e.g. --input '{path.rstrip('/')}/*'"
        raise FileNotFoundError(f"input directory {path!r} holds no TFRecord files (names with 'tfrecord' or "
                                f"'tfrecords'{'; it has ' + ', '.join(names[:3]) if names else ''}); pass a glob of "
                                f"{whose} files instead, {example}")
    if len(tfrecords) < len(found):
        skipped = [basename(f.path) for f in found if f not in tfrecords]
        _once(logging.INFO, "%s: converting its %d TFRecord file(s); %d other file(s) skipped (e.g. %s)", path,
              len(tfrecords), len(skipped), skipped[0])
    _warn_if_splits_mix(path, path, tfrecords)
    return tfrecords


_SAID: set[tuple] = set()  # a conversion plans twice (before and under its lease): each line once


def _once(level: int, message: str, *args) -> None:
    if (message, args) not in _SAID:
        _SAID.add((message, args))
        log.log(level, message, *args)


def _warn_if_splits_mix(what: str, directory: str, files: list[InputFile]) -> None:
    """A warning when the files of one --input (a directory, or a glob in one directory) are several splits' shards
    (train-*, validation-*): they all go into one dataset."""
    if any(f.path.rsplit("/", 1)[0] != directory.rstrip("/") for f in files):
        return  # a glob across directories: its groups are not told by name
    groups = tuple(split_globs(directory, [basename(f.path) for f in files], limit=4))
    if len(groups) > 1:
        _once(logging.WARNING, "%s: its TFRecord files form %d groups (%s): they all go into one dataset; to keep "
              "splits apart, convert one glob per split into its own --output", what, len(groups),
              ", ".join(repr(g) for g in groups))


def check_output_outside(inputs: list[InputFile], pattern: str, output: str) -> None:
    """An output among the inputs would be read back as input on the next run: refuse it up front."""
    def within(path: str, where: str) -> bool:
        return path == where.rstrip("/") or path.startswith(where.rstrip("/") + "/")

    where = absolute(output)  # as the inputs are named
    inside = [f.path for f in inputs if within(f.path, where)]
    if not inside and not storage.is_remote(output):  # the same directory through a symbolic link
        real = os.path.realpath(where)
        inside = [f.path for f in inputs if not storage.is_remote(f.path) and within(os.path.realpath(f.path), real)]
    if not inside and has_glob(pattern):  # (a first run: the output's files are not there yet, the glob's reach is)
        regex = re.compile(storage.translate(absolute(pattern)))  # (local globs too read `**` recursively)
        future = [storage.join(where, name) for name in [MANIFEST_NAME, *(output_name(f.path) for f in inputs)]]
        inside = [path for path in future if regex.fullmatch(path)]
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


def source_compression(path: str) -> str:
    """How `path` is read: by its suffix (.gz, .deflate, .bz2, .xz/.lzma, .zst/.zstd), as Beam names it; a file
    named as uncompressed whose first bytes are a GZIP or zlib header and not a TFRecord frame's (tf.io's
    TFRecordWriter with "GZIP" or "ZLIB" adds no suffix) is read as such, with a log line."""
    named = Compression.detect_compression_type(path)
    if named != Compression.UNCOMPRESSED:
        return named
    head = storage.read_range(path, 0, 12, exact=False)  # gs://: 12 bytes, where a reader's first chunk is 16 MB
    if len(head) < 2 or sniff.is_tfrecord_header(head):
        return named
    if head[:3] == b"\x1f\x8b\x08":
        sniffed = Compression.GZIP
    elif head[0] & 0x0F == 8 and (head[0] << 8 | head[1]) % 31 == 0:  # a zlib header: deflate, its check bits
        sniffed = Compression.DEFLATE
    else:
        return named
    log.warning("%s: its bytes are %s-compressed though its name says uncompressed: read as %s (name such files "
                "*%s)", path, _KIND[sniffed], _KIND[sniffed], ".gz" if sniffed == Compression.GZIP else ".deflate")
    return sniffed


_KIND = {Compression.GZIP: "GZIP", Compression.DEFLATE: "zlib", Compression.BZIP2: "BZIP2",
         Compression.LZMA: "LZMA", Compression.ZSTD: "Zstandard"}
# what a damaged, cut or mislabelled stream raises while it is read (gzip.BadGzipFile is an OSError: named alone)
_STREAM_ERRORS = (zlib.error, EOFError, gzip.BadGzipFile, lzma.LZMAError)


def _raw(path: str, read_buffer: int | None = None):
    if not is_remote(path):
        return open(path, "rb", buffering=_READ_BUFFER)
    if read_buffer is not None:  # a read of the file's first part: ranges of this size, not Beam's 16 MB ones
        return storage.open_read(path, chunk_size=read_buffer)
    return _filesystems().open(path, compression_type=Compression.UNCOMPRESSED)


def open_source(path: str, compression: str | None = None, *, read_buffer: int | None = None):
    """Opens a (possibly compressed, possibly remote) TFRecord file for streaming reads; `compression` as
    source_compression(path) gives it (read here when not given). `read_buffer`: for a read of the file's first part
    only (a sample, a first record), the bytes each gs:// request asks for (else Beam's reader's 16 MB). A compressed
    stream that is damaged, cut short or not what its name says raises tfrecord.CompressedStreamError naming the file
    (GZIP, BZIP2 and LZMA are read by Python's own readers, which check the stream's end and its checksum: Beam's gzip
    reader ends a cut stream silently)."""
    compression = compression or source_compression(path)
    if compression == Compression.UNCOMPRESSED:
        return _raw(path, read_buffer)
    if compression == Compression.GZIP:
        stream = gzip.GzipFile(fileobj=_raw(path, read_buffer), mode="rb")
    elif compression == Compression.BZIP2:
        stream = bz2.BZ2File(_raw(path, read_buffer), mode="rb")
    elif compression == Compression.LZMA:
        stream = lzma.LZMAFile(_raw(path, read_buffer), mode="rb")
    elif compression in (Compression.DEFLATE, Compression.ZSTD):
        stream = _Decompressed(_raw(path, read_buffer), compression)
    else:
        raise ValueError(f"{path}: compression {compression!r} is not one of {sorted(_KIND)}")
    return _CheckedStream(stream, path, _KIND.get(compression, compression))


class _Decompressed:
    """A zlib or Zstandard stream (streams or frames one after another) decompressed from the file under it. A file
    that ends inside a stream raises EOFError, as Python's gzip, bz2 and lzma readers do: Beam's reader ended a cut
    stream silently, so a shard cut short converted to fewer records, or none, without a word. What one step
    decompresses is bounded (zlib: _MOST bytes; Zstandard: _PIECE bytes of input, at most ~32,768 times as many
    out): a small file that decompresses to gigabytes (a bomb) is never held whole."""

    _READ = 1 << 20  # bytes read from the file at a time
    _MOST = 4 << 20  # zlib: bytes decompressed at a step
    _PIECE = 512  # Zstandard: input bytes decompressed at a step (its 4-byte RLE blocks decode to 128 KiB each)

    def __init__(self, raw, compression: str):
        self.fileobj, self._compression = raw, compression
        self._decompressor = self._new()
        self._input, self._at = memoryview(b""), 0  # the file's bytes read, and how many were decompressed
        self._buffer, self._offset = b"", 0  # decompressed bytes, and how many of them were handed out
        self._position = 0  # decompressed bytes handed out in all
        self._within = False  # whether a stream has begun and not ended

    def _new(self):
        if self._compression == Compression.DEFLATE:
            return zlib.decompressobj()
        import zstandard

        return zstandard.ZstdDecompressor().decompressobj()

    def read(self, size: int = -1) -> bytes:
        parts, wanted = [], size
        while size < 0 or wanted > 0:
            available = len(self._buffer) - self._offset
            if not available:
                if not self._fill():
                    break
                continue
            take = available if size < 0 else min(wanted, available)
            parts.append(self._buffer[self._offset:self._offset + take])
            self._offset += take
            wanted -= take
        out = parts[0] if len(parts) == 1 else b"".join(parts)
        self._position += len(out)
        return out

    def _fill(self) -> bool:
        """One step's decompressed bytes into the buffer (perhaps none yet); False at the end of the file, where a
        stream must have ended."""
        if self._at >= len(self._input):
            data = self.fileobj.read(self._READ)
            if not data:
                if self._within:
                    raise EOFError(f"the file ends inside its {_KIND[self._compression]} stream (cut short: an "
                                   "unfinished copy or upload?)")
                return False
            self._input, self._at = memoryview(data), 0
        self._within = True
        decompressor = self._decompressor
        if self._compression == Compression.DEFLATE:
            chunk = self._input[self._at:]
            out = self._decompress(chunk, self._MOST)
        else:
            chunk = self._input[self._at:self._at + self._PIECE]
            out = self._decompress(chunk)
        if decompressor.eof:  # a stream ended: what follows is another stream's (concatenated), or nothing
            consumed = len(chunk) - len(decompressor.unused_data)  # (zlib's unconsumed_tail may hold them too)
            self._decompressor, self._within = self._new(), False
        else:
            consumed = len(chunk) - len(getattr(decompressor, "unconsumed_tail", b""))
        self._at += consumed
        self._buffer, self._offset = out, 0
        return True

    def _decompress(self, data, *most: int) -> bytes:
        try:
            return self._decompressor.decompress(data, *most)
        except zlib.error:
            raise
        except Exception as e:  # noqa: BLE001 - zstandard.ZstdError (not imported unless read)
            raise zlib.error(f"{type(e).__name__}: {e}") from e

    def tell(self) -> int:
        return self._position

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        self.fileobj.close()


class _CheckedStream(io.RawIOBase):
    """A decompressing reader whose stream errors name the file (tfrecord.CompressedStreamError); it closes the
    file under it."""

    def __init__(self, stream, path: str, kind: str):
        super().__init__()
        self._stream, self._path, self._kind = stream, path, kind
        self._fileobj = getattr(stream, "fileobj", None) or getattr(stream, "_fp", None)

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        try:
            return self._stream.read(size)
        except _STREAM_ERRORS as e:
            raise tfrecord.CompressedStreamError(self._path, self._position(), str(e) or type(e).__name__,
                                                 self._kind, cut=isinstance(e, EOFError)) from e

    def _position(self) -> int:
        try:
            return self._stream.tell()
        except (OSError, ValueError, *_STREAM_ERRORS):
            return 0

    def seekable(self) -> bool:
        return self._stream.seekable()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        try:
            return self._stream.seek(offset, whence)
        except _STREAM_ERRORS as e:
            raise tfrecord.CompressedStreamError(self._path, offset, str(e) or type(e).__name__, self._kind) from e

    def tell(self) -> int:
        return self._stream.tell()

    def close(self) -> None:
        if not self.closed:
            try:
                self._stream.close()
            finally:
                inner = self._fileobj
                if inner is not None and not getattr(inner, "closed", True):
                    inner.close()
        super().close()