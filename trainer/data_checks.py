"""Before step 1: what the task's features hold over the whole dataset, not only its first batch.

A label out of range in a record the first batch did not hold (ImageNet's 1-based labels 1..1000 with
num_classes=1000, where label 1000 is rare) trains silently wrong or turns the loss NaN steps later. So the range of each
feature the task names in `ranged_features` is checked over every record of the training data (each component of a
mixture) and of eval_data, before the model is compiled:

- from the manifest, where the conversion recorded it (dataset_format/manifest.py FeatureStats): no record is read;
- otherwise (a manifest written before statistics were recorded, a TFDS array_record directory, a glob of shards) by
  a counted pass that decodes only that feature (loader.load(features=(key,))), with a progress line every
  PROGRESS_SECONDS. A TFDS ClassLabel with the task's class count holds valid ids by construction and is not counted.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

import numpy as np

from trainer.config import TrainConfig
from trainer.sources import Source, raw_first_record

log = logging.getLogger(__name__)

COUNT_BATCH = 4096  # records a batch of the counted pass
PROGRESS_SECONDS = 10.0


@dataclasses.dataclass(frozen=True)
class FeatureRange:
    low: int
    high: int
    records: int  # records that carry the feature
    total: int  # records of the data
    counted: bool  # read record by record (False: from the manifest)

    def where(self, data: str) -> str:
        """' over the 1,281,167 records of DATA (its manifest)', for the task's error."""
        how = "counted" if self.counted else "its manifest"
        return f" over the {self.total:,} records of {data} ({how})"


def check_records(config: TrainConfig, sources: Sequence[Source], key: str) -> None:
    """Each of `sources` (the config's `key`) holds records: one line naming the key, before anything is compiled (an
    empty eval_data was found by the first evaluation, after the step had compiled and trained)."""
    for source in sources:
        try:
            source.resolved  # noqa: B018 - resolved here first, for this line
        except ValueError as e:
            part = f" (mixture component {source.name!r})" if source.name is not None else ""
            text = str(e)
            said = text.startswith(source.path.rstrip("/"))  # the loader's line begins with the path: not twice
            raise ValueError(f"{key}={text}" if said and not part else f"{key}={source.path}{part}: {text}") from None


def check_features(task, config: TrainConfig, sources: Sequence[Source], key: str) -> None:
    """Each of `sources` (the config's `key`) has the features the task reads, by its first record: one line naming
    the key, the missing feature and the source's own features, before anything is compiled (eval_data with other
    feature names failed at the first evaluation, after training, with the loader's advice on features=)."""
    for source in sources:
        try:
            record = raw_first_record(source)
        except (ValueError, FileNotFoundError) as e:  # the loader's own line (no manifest, ...), the component named
            if source.name is None:
                raise
            raise type(e)(f"mixture component {source.name!r}: {e}") from e
        missing = [f for f in task.features if f not in record]
        if missing:
            part = f" (mixture component {source.name!r})" if source.name is not None else ""
            raise ValueError(f"task reads feature {missing[0]!r}, which {key}={source.path}{part} does not have; its "
                             f"features are {sorted(record)}: data= and eval_data= need the same names (set "
                             "image_key= / label_key= / text_key= to names both have, or convert it with them)")


class Unlabelled(ValueError):
    """A TFDS split whose ClassLabel holds -1, TFDS's "no label": not a range an offset or another setting fits."""


def check_ranges(task, config: TrainConfig, sources: Sequence[Source]) -> None:
    """Each of the task's `ranged_features` over each source (trainer/sources.py: its path, split and TFDS feature
    specs), checked by the task's `check_range`; a mixture component's error names it, and sources whose ranges no
    one setting of the task fits (label_offset= applies to all) are one line naming each range."""
    for source in sources:
        try:
            _check_source(task, config, source)
        except (ValueError, FileNotFoundError) as e:
            if len(sources) > 1 and not isinstance(e, Unlabelled):
                _sources_disagree(task, sources)
            if source.name is None:
                raise
            raise type(e)(f"mixture component {source.name!r}: {e}") from e


def _sources_disagree(task, sources: Sequence[Source]) -> None:
    """Raises, for sources (a mixture's components, data= beside eval_data=) that hold a ranged feature in different
    ranges, naming each and the one setting that fits them all: label_offset= applies to every source, so each
    source's own hint (an offset for it alone) moved another out of range."""
    if not hasattr(task, "num_classes") or not hasattr(task, "label_offset"):
        return
    for feature in getattr(task, "ranged_features", ()):
        ranges = list(dict.fromkeys((s.name or s.path, r.low, r.high) for s in sources
                                    if (r := feature_range(s, feature)) is not None))
        if len({(low, high) for _, low, high in ranges}) < 2:
            continue
        low, high = min(lo for _, lo, _ in ranges), max(hi for _, _, hi in ranges)
        shift, classes = task.label_offset, task.num_classes
        if 0 <= low + shift and high + shift < classes:
            continue
        if low >= 0 and high - low + 1 > classes:
            fits = f"label_offset=0 num_classes={high + 1}"
        else:
            fits = f"label_offset={-low} num_classes={max(classes, high - low + 1)}"
        said = ", ".join(f"{who!r} {lo}..{hi}" for who, lo, hi in ranges)
        what = "the mixture's components" if all(s.name for s in sources) else "the run's data (data=, eval_data=)"
        raise ValueError(f"{what} hold {feature!r} in different ranges ({said}), and label_offset={shift} applies to "
                         f"every one of them: {fits} puts them all in range; if they do not share one set of "
                         "classes, relabel one (convert it with its labels shifted) instead")


def _check_source(task, config: TrainConfig, source: Source) -> None:
    data = source.path
    for feature in getattr(task, "ranged_features", ()):
        spec = source.specs.get(feature, {})
        if source.resolved.feature_stats is None and _valid_by_construction(spec, task):
            log.info("%r of %s: a ClassLabel of %d classes, each label in range (or -1, TFDS's \"no label\", which "
                     "only a full pass would find: it has no recorded ranges)", feature, data, spec["num_classes"])
            continue
        found = feature_range(source, feature)
        if found is not None:
            log.info("%r holds %d..%d%s", feature, found.low, found.high, found.where(data))
            if spec.get("type") == "ClassLabel" and found.low == -1:
                raise Unlabelled(f"label_key={feature!r} holds {found.low}..{found.high}{found.where(data)}: -1 is a "
                                 f"TFDS ClassLabel's \"no label\", so split {source.split!r} has unlabelled records "
                                 "(imagenet2012's test split has only those); train and evaluate on labelled splits "
                                 "(eval_data= reads the test split unless eval_split= names another, e.g. "
                                 "eval_split=validation)")
            task.check_range(feature, found.low, found.high, found.where(data))


def _valid_by_construction(spec: dict, task) -> bool:
    """A TFDS ClassLabel encodes ids 0..num_classes-1 (and -1 for a record without a label): nothing to count when
    the task trains on exactly those and the dataset recorded no ranges (a TFDS-prepared ArrayRecord dataset)."""
    return (spec.get("type") == "ClassLabel" and spec.get("num_classes") == getattr(task, "num_classes", None)
            and not getattr(task, "label_offset", 0))


def feature_range(of: Source, feature: str) -> FeatureRange | None:
    """The min and max of integer feature `feature` over every record of `of`: the manifest's, or counted. None
    when it holds no integers (the first-record check names that)."""
    source, data = of.resolved, of.path
    if source.feature_stats is None:
        return _count(of, data, feature)
    stats = source.feature_stats.get(feature)
    if stats is None or stats["kind"] != "int64" or "min" not in stats:
        return None
    # (a slice's: the range over its shards' every record, which holds its own)
    return FeatureRange(stats["min"], stats["max"], stats["records"], sum(source.records_in_files), counted=False)


def _count(of: Source, data: str, feature: str) -> FeatureRange | None:
    """One pass over `feature` alone, with a progress line every PROGRESS_SECONDS."""
    source = of.resolved
    total = len(source)
    why = ("its manifest has no feature ranges (`python -m pipelines convert --force` records them)"
           if source.kind == "manifest" else f"a {source.kind} source has no recorded ranges")
    log.info("checking %r over the %s records of %s: %s; reading that feature alone", feature, f"{total:,}", data, why)
    batches = of.load(batch_size=COUNT_BATCH, shuffle=False, num_epochs=1, drop_remainder=False, shard_index=0,
                      shard_count=1, features=(feature,))
    low = high = None
    seen = 0
    started = last = time.monotonic()
    for batch in batches:
        values = np.asarray(batch[feature])
        if values.dtype.kind not in "iu":
            return None
        if values.size:
            low = int(values.min()) if low is None else min(low, int(values.min()))
            high = int(values.max()) if high is None else max(high, int(values.max()))
        seen += len(values)
        now = time.monotonic()
        if now - last >= PROGRESS_SECONDS:
            rate = seen / (now - started)
            log.info("checking %r: %s of %s records (%.0f%%), %.0f s left", feature, f"{seen:,}", f"{total:,}",
                     100 * seen / total, (total - seen) / rate if rate else 0.0)
            last = now
    if low is None:
        return None
    log.info("counted %r over the %s records of %s in %.1f s", feature, f"{seen:,}", data, time.monotonic() - started)
    return FeatureRange(low, high, seen, total, counted=True)
