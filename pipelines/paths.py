"""Input listing, opening and source fingerprints, for local paths and gs://, through Beam's FileSystems
(which also reads gzip and other compressed TFRecords). Output naming is the contract's: see
dataset_format/naming.py.
"""

from __future__ import annotations

import dataclasses

from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems

from dataset_format.naming import output_name
from dataset_format.storage import has_glob, is_remote

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


def open_source(path: str):
    """Opens a (possibly compressed, possibly remote) TFRecord file for streaming reads."""
    compression = CompressionTypes.detect_compression_type(path)
    if not is_remote(path) and compression == CompressionTypes.UNCOMPRESSED:
        return open(path, "rb", buffering=_READ_BUFFER)
    return FileSystems.open(path, compression_type=compression)
