"""Staging a remote dataset (gs://...) to local disk before training.

The loader reads gs:// directly (loader/fetch/remote.py: batched range requests, chunk caches); staging gives
local-disk speed where the dataset fits on the host's disk. `stage` copies the shards listed in the manifest (or
dataset_info.json) in parallel through google-cloud-storage (checksums checked, transient errors
retried: dataset_format/storage.py), checks each copy's size against the metadata, and skips files
already staged from the same version of their source (`DIR/.staged.json`: dataset_format/staged.py), so an
interrupted staging resumes where it stopped and a dataset converted again in place is copied again where it
changed. Metadata files are copied last, and a re-stage that copies anything removes the copy's metadata
first, so a directory with a manifest is a complete one.

    local = loader.stage("gs://bucket/digits/train", "/mnt/disks/data/digits/train")
    batches = loader.load(local, batch_size=256)

Alternative: mount the bucket with gcsfuse (docs/staging.md) and load from the mount point.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import time

from dataset_format import staged, storage, tfds_info
from dataset_format.manifest import COUNTS_SUFFIX, MANIFEST_NAME, Manifest
from dataset_format.suggest import near_path

log = logging.getLogger(__name__)

RECORD_EVERY = 10.0  # seconds between writes of the staged record while copying (a kill loses at most this much)


@dataclasses.dataclass(frozen=True)
class StageResult:
    directory: str
    copied: int
    skipped: int
    bytes_copied: int
    seconds: float


def stage(source: str, local_dir: str, *, parallelism: int = 8) -> StageResult:
    """Copies the dataset at `source` (gs:// or local) into `local_dir`; returns what it did. Interrupted (Ctrl-C,
    an error), it stops after the copies under way and records every file copied, for the next stage to skip."""
    if parallelism < 1:
        raise ValueError(f"parallelism={parallelism}: files copied at once must be >= 1 (the default is 8)")
    source = _normalised(source)
    _check_apart(source, local_dir)
    started = time.monotonic()
    found = staged.versions(source)
    listing = {name: size for name, (size, _) in found.items()}
    if not listing:
        raise FileNotFoundError(f"{source} is empty or does not exist; check the path (a directory written by "
                                f"`python -m pipelines convert` or tfds build){near_path(source)}")
    shards, metadata = _plan(source, listing)
    os.makedirs(local_dir, exist_ok=True)
    recorded_source, copied = staged.read(local_dir)
    if recorded_source != source:  # another source, or none recorded: no copy here is known to be of this one
        copied = {}
    todo = [(name, size) for name, size in shards.items()
            if _local_size(local_dir, name) != size or copied.get(name) != found[name][1]]
    total = sum(size for _, size in todo)
    log.info("staging %s -> %s: %d file(s) to copy (%.1f MB), %d already staged", source, local_dir, len(todo),
             total / 1e6, len(shards) - len(todo))
    if todo:  # the copy is incomplete until its metadata is back: a reader refuses it meanwhile
        for name in (MANIFEST_NAME, tfds_info.INFO_NAME):
            if os.path.exists(os.path.join(local_dir, name)):
                os.remove(os.path.join(local_dir, name))
    done_bytes, recorded = 0, time.monotonic()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=parallelism)
    futures = {pool.submit(_copy, f"{source}/{name}", local_dir, name, size, found[name][1]): name
               for name, size in todo}
    try:
        for i, future in enumerate(concurrent.futures.as_completed(futures), 1):
            done_bytes += future.result()
            name = futures[future]
            copied[name] = found[name][1]  # the version listed before the copy: if it changed meanwhile, the
            # next stage sees another version and copies it again
            elapsed = max(time.monotonic() - started, 1e-9)
            log.info("[%d/%d] %s staged (%.1f of %.1f MB, %.1f MB/s)", i, len(todo), name, done_bytes / 1e6,
                     total / 1e6, done_bytes / 1e6 / elapsed)
            if time.monotonic() - recorded > RECORD_EVERY:
                staged.write(local_dir, source, copied)
                recorded = time.monotonic()
    finally:  # (a Ctrl-C or a failed copy: the queued copies are dropped, those under way finish and are recorded)
        pool.shutdown(wait=True, cancel_futures=True)
        for future, name in futures.items():
            if future.done() and not future.cancelled() and future.exception() is None:
                copied[name] = found[name][1]
        staged.write(local_dir, source, {n: v for n, v in copied.items() if n in shards})
    for name in metadata:  # last: their presence marks a complete copy
        _copy(f"{source}/{name}", local_dir, name, listing[name], found[name][1])
    return StageResult(local_dir, len(todo), len(shards) - len(todo), done_bytes, time.monotonic() - started)


def _normalised(source: str) -> str:
    """The source as the staged record keeps it: without a trailing slash, a local one absolute and its links resolved
    (`v1/`, `./v1`, `/data/v1` and a link to it are one source, whose copies a resumed stage skips)."""
    return storage.resolved(source.rstrip("/") or "/")


def _check_apart(source: str, local_dir: str) -> None:
    """The copy is neither the source nor inside it: a stage removes the copy's metadata before it copies (the
    source's own manifest, when they are one directory) and writes into it."""
    if storage.is_remote(source):
        return
    if os.path.exists(local_dir) and not os.path.isdir(local_dir):
        raise ValueError(f"local_dir {local_dir} is a file: name a directory to copy the dataset into")
    here, there = os.path.realpath(source), os.path.realpath(local_dir)
    if there == here or there.startswith(here.rstrip(os.sep) + os.sep):
        raise ValueError(f"local_dir {local_dir} is {'the source itself' if there == here else 'inside the source'} "
                         f"({source}): name another directory, e.g. {source.rstrip('/')}-staged")


def _plan(source: str, listing: dict[str, int]) -> tuple[dict[str, int], list[str]]:
    """Shard name (and each shard's token counts) -> expected size, and the metadata files to copy after them."""
    if MANIFEST_NAME in listing:
        path = storage.join(source, MANIFEST_NAME)
        manifest = Manifest.from_json(storage.read_text(path), path=path)
        shards = {e.path: e.bytes for e in manifest.shards}
    elif tfds_info.INFO_NAME in listing:
        info = tfds_info.read_info(source)
        if info.get("fileFormat") != "array_record":
            raise ValueError(f"{source}/{tfds_info.INFO_NAME} says fileFormat={info.get('fileFormat', 'tfrecord')!r}; "
                             "convert it first (python -m pipelines convert)")
        shards = {n: s for n, s in listing.items() if ".array_record-" in n}
    else:
        raise FileNotFoundError(f"{source} has neither {MANIFEST_NAME} nor {tfds_info.INFO_NAME}; stage a converted "
                                "dataset directory")
    missing = [n for n in shards if n not in listing]
    if missing:
        raise FileNotFoundError(f"{source}/{missing[0]} is listed in the metadata but missing from the bucket "
                                f"({len(missing)} missing); re-run the conversion")
    wrong = [n for n, size in shards.items() if listing[n] != size]
    if wrong:
        raise ValueError(f"{source}/{wrong[0]} is {listing[wrong[0]]} bytes but the manifest says {shards[wrong[0]]}; "
                         "re-run the conversion")
    # a pre-tokenized corpus's token counts beside each shard: copied with the shards, and skipped as they are when
    # staged already (as metadata, each re-stage copied them all again, one at a time)
    shards.update({n: size for n, size in listing.items() if n.endswith(COUNTS_SUFFIX) and
                   n[:-len(COUNTS_SUFFIX)] in shards})
    metadata = sorted((n for n in listing if n not in shards and not n.startswith(".")),
                      key=lambda n: n == MANIFEST_NAME)  # the manifest goes last of all
    return shards, metadata


def _local_size(local_dir: str, name: str) -> int | None:
    try:
        return os.path.getsize(os.path.join(local_dir, name))
    except OSError:
        return None


def _copy(remote: str, local_dir: str, name: str, size: int, version: str) -> int:
    """Copies `remote` as `name`, of the `version` listed: a gs:// object rewritten since is an error (the copy
    would mix two versions of the dataset)."""
    generation = int(version) if storage.is_remote(remote) and version.isdigit() else None
    try:
        return storage.download(remote, os.path.join(local_dir, name), expected_size=size, generation=generation)
    except storage.ObjectChanged as e:
        raise OSError(f"{remote} was rewritten while it was being staged (generation {e.listed} when listed): the "
                      "dataset is changing; stage again once its writer is done (it copies only what changed)"
                      ) from None
