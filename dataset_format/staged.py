"""A staged copy's record of where its files came from: `DIR/.staged.json`, written by `loader.stage`.

It names the source directory (gs:// or local) and, for each file copied, the version of the source file it was
copied from: a gs:// object's generation (it changes with every write, whatever the size), a local file's
modification time and inode. A re-stage copies a file again when its source's version is not the recorded one:
a dataset converted again in place keeps many shards' sizes (they are padded to 64 KiB blocks), so sizes alone
kept stale shards beside the new manifest. A reader's error for a damaged or stale file of a staged copy says to
stage it again, not to convert it again.

    {"source": "gs://bucket/tokens/web", "versions": {"train-00000-of-00004.array_record": "1732860000123456", ...}}
"""

from __future__ import annotations

import json
import os

from dataset_format import storage

STAGED_NAME = ".staged.json"


def versions(directory: str) -> dict[str, tuple[int, str]]:
    """Base name -> (size, version) of the files directly under `directory` (gs:// or local), from one listing."""
    if storage.is_remote(directory):
        return {name: (size, str(generation))
                for name, (size, generation) in storage.list_generations(directory).items()}
    try:
        return {e.name: (st.st_size, f"{st.st_mtime_ns}:{st.st_ino}") for e in os.scandir(directory) if e.is_file()
                for st in [e.stat()]}
    except (FileNotFoundError, NotADirectoryError):
        return {}


def read(local_dir: str) -> tuple[str | None, dict[str, str]]:
    """(the source, file -> the version copied) of the staged copy in `local_dir`; (None, {}) when it has no
    readable record (not a staged copy, or staged before records were kept: every file is then copied again)."""
    try:
        with open(os.path.join(local_dir, STAGED_NAME)) as f:
            record = json.load(f)
        source, copied = record["source"], record["versions"]
        if isinstance(source, str) and isinstance(copied, dict):
            return source, {str(k): str(v) for k, v in copied.items()}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None, {}


def write(local_dir: str, source: str, copied: dict[str, str]) -> None:
    """Records `copied` (file -> source version) for `source`, atomically (a write aside, then a rename)."""
    path = os.path.join(local_dir, STAGED_NAME)
    tmp = storage.temp_name(path)
    with open(tmp, "w") as f:
        json.dump({"source": source, "versions": dict(sorted(copied.items()))}, f, indent=0)
    os.replace(tmp, path)


def source_of(shard: str) -> str | None:
    """The source directory `shard`'s directory was staged from, when it is a staged copy (local paths only)."""
    if storage.is_remote(shard):
        return None
    source, _ = read(os.path.dirname(os.path.abspath(shard)))
    return source
