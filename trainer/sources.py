"""The run's data, resolved once: each source of `data=` and `eval_data=` with its split, its feature metadata and its
shards, and the first record as the task sees it.

    data = sources.resolve(config)            # every path's split and metadata, each read once
    task = tasks.make(config, data.shaping.specs)
    sample = sources.first_record(data.shaping, task)

Everything after it (the task, the model, the checks, the training and evaluation loaders) takes these values: a
source's manifest and shard listing are read once a run (`Source.resolved`), not by each of them (on gs://, a request
and a listing each), and every evaluation reads the records the run started with.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
from typing import Any

import numpy as np

import loader
from dataset_format import storage, tfds_info
from dataset_format.suggest import near_path
from loader.decoding.decode import collate
from loader.format.source import ShardedSource, shared_records, tokenizer_identity
from loader.planning.mixture import check_one_tokenizer
from trainer import tasks
from trainer.config import TrainConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Source:
    """One path of `data=` or `eval_data=`: its split (TFDS directories) and its feature metadata."""

    path: str
    split: str | None
    specs: dict[str, dict]  # TFDS feature metadata, or a pre-tokenized dataset's `tokens`; {} for other sources
    name: str | None = None  # a mixture component's name
    allow_incomplete: bool = False  # the config's: read a conversion with failed shards
    check_hashes: bool = True  # the config's, for each read of it
    max_record_bytes: int = 256 << 20  # the config's

    def load(self, **options):
        """loader.load of it, with the config's options for reading its shards."""
        return loader.load(self.resolved, check_hashes=self.check_hashes, max_record_bytes=self.max_record_bytes,
                           **options)

    @functools.cached_property
    def resolved(self) -> ShardedSource:
        """Its shards (its split's, sliced), resolved at first use and kept for the run; raises the loader's error
        naming the path."""
        return loader.resolve(self.path, split=self.split, allow_incomplete=self.allow_incomplete)


@dataclasses.dataclass(frozen=True)
class Sources:
    train: tuple[Source, ...]  # () for the sidecar evaluator, which reads eval_data only
    eval: tuple[Source, ...]  # () without eval_data

    @property
    def shaping(self) -> Source:
        """The source whose first record shapes the model: training's (the sidecar evaluator's: eval_data's); a
        mixture's components are alike, so its first."""
        return (self.train or self.eval)[0]


def resolve(config: TrainConfig) -> Sources:
    """Each source of the run, its metadata read once. The sidecar evaluator (mode=evaluate) reads eval_data only."""
    evaluating = config.mode == "evaluate"
    train = () if evaluating else tuple(
        _source(_existing("data", name, path), name, _split(config.split, path, "train"), config)
        for name, path in _named(config.data_source))
    evaluation = () if config.eval_source is None else tuple(
        _source(_existing("eval_data", name, path), name, _split(config.eval_split, path, "test"), config)
        for name, path in _named(config.eval_source))
    named = {_key(key, s.name, s.path): s for key, group in (("data", train), ("eval_data", evaluation)) for s in group}
    tokenized = {key: s.specs["tokens"]["tokenizer"] for key, s in named.items() if _pretokenized(s)}
    if tokenized and len(tokenized) < len(named):
        text = next(key for key in named if key not in tokenized)
        raise ValueError(f"{text} is not pre-tokenized but {next(iter(tokenized))} is: convert it with the same "
                         f"--tokenizer ({next(iter(tokenized.values()))}), or give only datasets of text")
    check_one_tokenizer({k: t for k, t in tokenized.items() if k.startswith("data")}, "the components of data=")
    check_one_tokenizer(tokenized, "the datasets of data= and eval_data=")
    for held in evaluation:
        for trained in (t for t in train if t.path == held.path):
            _warn_if_shared(held, trained)
    return Sources(train, evaluation)


def shards_seen(data: Sources) -> dict[str, dict]:
    """What this process reads of each source (every source resolved): its shard count, record count, and a digest
    of its identity (each shard's file name and records, wherever it lies), each shard's stored bytes and, on gs://,
    the generation listed (a local file's inode and times differ between hosts' copies of one conversion, so they are
    left out). The job's processes compare them (trainer/job.py same_data)."""
    seen = {}
    for key, group in (("data", data.train), ("eval_data", data.eval)):
        for source in group:
            shards = source.resolved
            versions = [v if storage.is_remote(p) else None
                        for p, v in zip(shards.paths, shards.shard_versions or (None,) * len(shards.paths))]
            made = [shards.identity, shards.shard_bytes, versions]
            digest = hashlib.sha256(json.dumps(made).encode()).hexdigest()[:16]
            seen[_key(key, source.name, source.path)] = {"shards": len(shards.paths), "records": len(shards),
                                                        "digest": digest}
    return seen


def _warn_if_shared(held: Source, trained: Source) -> None:
    """A warning when eval_data `held` holds records that training reads from `trained` (the same dataset): its
    figures are then not held out."""
    try:
        shared = shared_records(held.resolved, trained.resolved)
    except (ValueError, FileNotFoundError):  # (a source that does not resolve: its own error comes where it is used)
        return
    if shared:
        log.warning("eval_data=%s%s holds %s of the %s records training reads (data=%s%s): its figures are not held "
                    "out; hold part of one dataset out with split=[:95%%] eval_split=[95%%:]", held.path,
                    f" eval_split={held.split}" if held.split else "", f"{shared:,}",
                    f"{len(trained.resolved):,}", trained.path, f" split={trained.split}" if trained.split else "")


def _pretokenized(source: Source) -> bool:
    return source.specs.get("tokens", {}).get("type") == "Tokens"


def _key(key: str, name: str | None, path: str) -> str:
    """`data=PATH`, or `data component NAME=PATH`, for messages."""
    return f"{key}={path}" if name is None else f"{key} component {name}={path}"


def _existing(key: str, name: str | None, path: str) -> str:
    """`path` when it names something (a glob is matched later, by the loader); else an error naming `key` (and the
    mixture component) and the path, before the task reads metadata the path does not have."""
    if storage.has_glob(path) or storage.names_something(path):
        return path
    raise FileNotFoundError(f"{_key(key, name, path)}: no such file or directory{near_path(path)}")


def source_split(path: str, default: str | None) -> str | None:
    """TFDS sources (local or gs://) need a split; others must not get one."""
    return default if storage.exists(storage.join(path, tfds_info.INFO_NAME)) else None


def _split(given: str | None, path: str, default: str) -> str | None:
    """The split of `path`: `given` (where a part of it is a slice alone, "[:99%]", it slices a TFDS source's
    `default` split), else a TFDS source's `default`, else None."""
    named = source_split(path, default)
    if given is None or named is None:
        return given if given is not None else named
    return "+".join(named + part.strip() if part.strip().startswith("[") else part.strip() for part in given.split("+"))


def _source(path: str, name: str | None, split: str | None, config: TrainConfig) -> Source:
    return Source(path, split, _feature_specs(path), name, config.allow_incomplete, config.check_hashes,
                  config.max_record_bytes)


def _named(data: str | dict[str, str]) -> list[tuple[str | None, str]]:
    """A path as [(None, path)], a mixture as its [(name, path)]."""
    return list(data.items()) if isinstance(data, dict) else [(None, data)]


def _feature_specs(data: str) -> dict[str, dict]:
    """The TFDS feature metadata (features.json) of a dataset directory; a pre-tokenized dataset's `tokens` (its
    manifest's vocabulary); {} for other sources."""
    tokens = loader.token_info(data)  # (also of a glob over a pre-tokenized dataset's shards)
    if tokens is not None:
        return {"tokens": {"type": "Tokens", "dtype": tokens["dtype"], "vocab_size": int(tokens["vocab_size"]),
                           "tokenizer": tokenizer_identity(tokens)}}
    if storage.has_glob(data):
        return {}
    features = tfds_info.read_features(data)
    return tfds_info.feature_specs(features) if features else {}


def raw_first_record(source: Source) -> dict[str, np.ndarray]:
    """The first record of `source`, every feature decoded as it is stored, a batch of one ({} when it has none)."""
    return next(iter(source.load(batch_size=1, shuffle=False, shard_index=0, shard_count=1)), {})


def first_record(source: Source, task: Any) -> dict[str, np.ndarray]:
    """The first record of `source` as the task sees it, a batch of one (all features are decoded once, to name them
    if one is missing)."""
    data = source.path
    record = raw_first_record(source)
    missing = [f for f in task.features if f not in record]
    if missing:
        raise ValueError(f"task reads feature {missing[0]!r}, which {data} does not have; its features are "
                         f"{sorted(record)} (set image_key= / label_key= / text_key=, or the task's own keys)")
    _check_image_size(task, record, data)
    preprocess = tasks.preprocess(task)
    sample = {f: record[f] for f in task.features} if preprocess is None else \
        collate([preprocess({f: record[f][0] for f in task.features})])
    for name, value in sample.items():
        if not isinstance(value, np.ndarray) or value.dtype.kind not in "biuf":
            hint = " (encoded images: pass image_size=, e.g. image_size=224, to decode and crop them)" \
                if name == getattr(task, "image_key", None) else ""
            kind = type(value[0]).__name__ if isinstance(value, list) and value else type(value).__name__
            raise ValueError(f"feature {name!r} of {data} holds {kind} values, not numbers the model can take{hint}")
    tasks.check(task, sample)  # shapes and values the task cannot train on: named before the model is built
    return sample


def _check_image_size(task: Any, record: dict, data: str) -> None:
    """image_size= on a feature of numbers that is no image (digits' flat 64 pixels, a feature vector): one line
    naming the setting, where the crop's own error would blame the feature."""
    key, size = getattr(task, "image_key", None), getattr(task, "image_size", None)
    value = record.get(key) if size is not None else None
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf" and value.ndim - 1 not in (2, 3):
        raise ValueError(f"image_size={size} decodes and crops images, and feature {key!r} of {data} holds "
                         f"{value.dtype} arrays of shape {value.shape[1:]}, not pixels [H, W] or [H, W, C] or "
                         "encoded JPEG/PNG bytes: drop image_size= to train on it as it is, or set image_key= to "
                         "the image feature")
