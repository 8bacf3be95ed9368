"""Input listing, output naming and source fingerprints, for local paths and gs://.

Output naming (one output shard per input shard): the token `tfrecord` (or `tfrecords`)
in the input's base name becomes `array_record`; a name without it gets `.array_record`
appended. A compression suffix (`.gz`) is dropped first.

    mnist-train.tfrecord-00000-of-00004 -> mnist-train.array_record-00000-of-00004
    train-00003-of-00016.tfrecord       -> train-00003-of-00016.array_record
    part-0                              -> part-0.array_record
"""

from __future__ import annotations

import dataclasses
import re

from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems

from pipelines.storage import basename

_TOKEN = re.compile(r"(?<![A-Za-z0-9])tfrecords?(?![A-Za-z0-9])")
_GLOB_CHARS = re.compile(r"[*?\[]")
_COMPRESSED_SUFFIXES = (".gz", ".gzip", ".zz", ".zlib", ".deflate", ".bz2")


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


def output_name(source: str) -> str:
    """The ArrayRecord shard's base name for TFRecord shard `source` (see module doc)."""
    name = basename(source)
    for suffix in _COMPRESSED_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    matches = list(_TOKEN.finditer(name))
    if not matches:
        return name + ".array_record"
    last = matches[-1]
    return name[: last.start()] + "array_record" + name[last.end():]


def has_glob(path: str) -> bool:
    return bool(_GLOB_CHARS.search(path))


def list_inputs(pattern: str) -> list[InputFile]:
    """Files matching `pattern` (a path or a glob), sorted by path; raises if none."""
    if not has_glob(pattern) and not FileSystems.exists(pattern):
        raise FileNotFoundError(f"input {pattern!r} does not exist; check the path (a file, a glob "
                                "such as 'data/train-*.tfrecord', or a TFDS dataset directory)")
    result = FileSystems.match([pattern])[0]
    files = [InputFile(m.path, m.size_in_bytes, m.last_updated_in_seconds) for m in result.metadata_list]
    files = [f for f in files if not f.path.endswith("/")]
    if not files:
        raise FileNotFoundError(f"no files match {pattern!r}; check the directory and the glob")
    return sorted(files, key=lambda f: f.path)


def check_unique_outputs(sources: list[str]) -> None:
    """Two inputs mapping to one output name would overwrite each other: refuse up front."""
    seen: dict[str, str] = {}
    for source in sources:
        name = output_name(source)
        if name in seen:
            raise ValueError(f"inputs {seen[name]!r} and {source!r} would both be written as {name!r}; "
                             "convert them into separate output directories")
        seen[name] = source
