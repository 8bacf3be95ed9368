"""TFDS dataset directories: find their TFRecord shards and write the ArrayRecord twin's metadata.

Converting a TFDS dataset version directory (the metadata and naming: dataset_format/tfds_info.py) gives a
directory that `tfds.builder_from_directory(OUT)` loads: the same metadata files, `fileFormat` set to
`array_record`, and each split's `shardLengths` set to the records actually written. No TensorFlow import.
"""

from __future__ import annotations

import dataclasses
import json

from dataset_format import storage
from dataset_format.storage import basename
from dataset_format.naming import output_template
from dataset_format.tfds_info import INFO_NAME, read_info, shard_name
from pipelines import paths
from pipelines.paths import InputFile


@dataclasses.dataclass(frozen=True)
class TfdsShard:
    split: str
    file: InputFile
    expected_records: int


def is_tfds_dir(path: str) -> bool:
    return not any(c in path for c in "*?[") and storage.exists(storage.join(path, INFO_NAME))


def list_shards(directory: str) -> list[TfdsShard]:
    """Every TFRecord shard of every split, in split order then shard order."""
    info = read_info(directory)
    file_format = info.get("fileFormat", "tfrecord")
    if file_format != "tfrecord":
        raise ValueError(f"{storage.join(directory, INFO_NAME)} says fileFormat={file_format!r}; only "
                         "TFRecord datasets need converting")
    from apache_beam.io.filesystems import FileSystems

    listing = {m.path: m for m in FileSystems.match([storage.join(directory, "*")])[0].metadata_list}
    shards = []
    for split in info.get("splits", []):
        template = split.get("filepathTemplate") or ""
        if "/" in template:
            raise ValueError(f"{storage.join(directory, INFO_NAME)}: split {split['name']!r} keeps its shards in "
                             f"subdirectories (filepathTemplate {template!r}), which the conversion does not read; "
                             "convert each split's shards as a glob instead (--input 'DIR/SUBDIR/*')")
        lengths = [int(n) for n in split.get("shardLengths", [])]
        for index, length in enumerate(lengths):
            name = shard_name(info, split, "tfrecord", index, len(lengths))
            path = storage.join(directory, name)
            meta = listing.get(path)
            if meta is None:
                raise FileNotFoundError(f"{path} is listed in {INFO_NAME} (split {split['name']!r}, shard "
                                        f"{index}) but does not exist; re-download or rebuild the dataset")
            shards.append(TfdsShard(split["name"], InputFile(path, meta.size_in_bytes,
                                                             meta.last_updated_in_seconds), length))
    if not shards:
        raise ValueError(f"{storage.join(directory, INFO_NAME)} lists no shards; the dataset is empty")
    files = paths.with_generations([s.file for s in shards])
    return [dataclasses.replace(s, file=f) for s, f in zip(shards, files)]


def write_metadata(source_dir: str, out_dir: str, shard_lengths: dict[str, list[int]]) -> None:
    """Copies the metadata files and writes `dataset_info.json` for the ArrayRecord shards."""
    info = read_info(source_dir)
    shard_names = {basename(s.file.path) for s in list_shards(source_dir)}
    for name in storage.list_sizes(source_dir):
        if name in shard_names or name == INFO_NAME or name.startswith("."):
            continue
        data = storage.read_bytes(storage.join(source_dir, name))
        if data is not None:
            storage.write_bytes(storage.join(out_dir, name), data)
    info["fileFormat"] = "array_record"
    for split in info.get("splits", []):
        template = split.get("filepathTemplate")
        if template and "{FILEFORMAT}" not in template:  # the shards' names as the conversion writes them
            split["filepathTemplate"] = output_template(template)
        lengths = shard_lengths.get(split["name"])
        if lengths is None and not split.get("shardLengths"):
            lengths = []  # a split of no shards (TFDS reads it as empty): none to convert
        elif lengths is None:
            raise ValueError(f"split {split['name']!r} of {source_dir} has no converted shards")
        split["shardLengths"] = [str(n) for n in lengths]
    storage.write_text(storage.join(out_dir, INFO_NAME), json.dumps(info, indent=2))
