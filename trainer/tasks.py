"""Tasks: what the trainer reads from the data, what the model is built with, and what it optimises and reports.

`task=classification` and `task=lm` (next-token prediction) are built in; `task=package.module:attr` names your own:
`attr(config, specs)` must return an object with the members of `Task` below (`specs`: the data's TFDS feature
metadata, `{}` for plain Examples); `preprocess(record)`, `augment(record, rng)` (training only, instead of
preprocess; rng: a numpy Generator seeded per record, see loader.load's random_map_fn) and `weights` are optional:

    @dataclasses.dataclass(frozen=True)
    class Regression:
        features = ("vec", "target")
        def model_kwargs(self): return {"num_classes": 1}          # the model's constructor arguments
        def inputs(self, batch): return batch["vec"]               # in the jitted step: the model's input
        def losses(self, outputs, batch): return (outputs[:, 0] - batch["target"]) ** 2   # per example, [B]
        def metrics(self, outputs, batch): return {"abs_error": jnp.abs(outputs[:, 0] - batch["target"])}

    def make(config, specs): return Regression()                   # task=my_pkg.tasks:make

Only the features a task names are decoded, collated and placed on the devices: a dataset's other features (text,
ragged lists, other images) are never touched.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from loader.decoding import images
from trainer import imports
from trainer.config import TrainConfig
from trainer.models import images_to_float

log = logging.getLogger(__name__)


@runtime_checkable
class Task(Protocol):
    features: Sequence[str]  # the data features the task reads

    def model_kwargs(self) -> dict[str, Any]:
        """Keyword arguments the model is built with (`model=` names a class or a function taking them)."""

    def inputs(self, batch: dict[str, jax.Array]) -> Any:
        """The model's input, computed inside the jitted step from the task's features."""

    def losses(self, outputs: jax.Array, batch: dict[str, jax.Array]) -> jax.Array:
        """Per-example losses, shape [batch] (summed over what the example counts for, see `weights`); training
        minimises their sum over the sum of the weights, eval reports that as eval_loss."""

    def metrics(self, outputs: jax.Array, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """Per-example values, shape [batch] each, summed like `losses`; eval reports eval_<name> = their sum over
        the eval data / the sum of the weights."""

    # Optional:
    # def preprocess(self, record: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    #     """On the host, per decoded record (only the task's features), before batching: e.g. tokenise, pad."""
    # def weights(self, batch) -> jax.Array:
    #     """What each example counts for in the averages, shape [batch] (default 1 each; lm: its tokens)."""
    # def training_losses(self, outputs, batch) -> jax.Array:
    #     """The per-example losses training minimises, where they differ from `losses`, which evaluation reports
    #     (classification with label_smoothing: against smoothed labels)."""
    # def tokens(self, batch) -> jax.Array:
    #     """In the jitted step: the batch's real tokens; the log then has tokens/s (and MFU: trainer/throughput.py)."""
    # def check(self, batch: dict[str, np.ndarray]) -> None:
    #     """On the host, the first record (a batch of one, before the model is built) and the first training batch
    #     (this host's rows, before step 1): raise ValueError naming the key, the values and the fix for data the
    #     task cannot train on (e.g. labels outside 0..num_classes-1, a label feature that holds images)."""
    # def check_outputs(self, outputs, batch_size: int, model: str) -> None:
    #     """Before anything compiles, the model's outputs for the first record as jax.ShapeDtypeStructs: raise
    #     ValueError naming `model`, the shape it gives and the shape the task takes."""
    # ranged_features: Sequence[str]   # integer features whose range over the whole dataset `check_range` checks
    # def check_range(self, feature: str, low: int, high: int, where: str) -> None:
    #     """Before step 1, the min and max of `feature` over every record of the data (`where` names it and how the
    #     range was learnt: trainer/data_checks.py): raise ValueError naming the range and the fix."""


class RecordRangeError(ValueError):
    """Labels out of range in a record or a batch: its fix is a guess from a few values (Program.build checks the
    whole data's range, which names the right one, before saying this)."""


def check(task: Task, batch: dict[str, Any]) -> None:
    """The task's check of a batch (its `check`, when it has one), on this host's rows."""
    if hasattr(task, "check"):
        task.check({k: _local(v) for k, v in batch.items() if k in task.features})


def _local(array) -> np.ndarray:
    """This host's rows of a batch array (a global jax.Array spans hosts: only its addressable shards are here)."""
    if isinstance(array, jax.Array) and not array.is_fully_addressable:
        return np.concatenate([np.asarray(s.data).reshape(-1, *array.shape[1:]) for s in array.addressable_shards])
    return np.asarray(array)


def preprocess(task: Task):
    """The task's per-record function for evaluation (and for training when it has no `augment`), or None."""
    return getattr(task, "preprocess", None)


def weights(task: Task, batch) -> jax.Array:
    """The task's per-example weights, or ones."""
    if hasattr(task, "weights"):
        return task.weights(batch)
    first = batch[task.features[0]]
    return jnp.ones(first.shape[:1], jnp.float32)


@dataclasses.dataclass(frozen=True)
class Classification:
    """Softmax cross-entropy over `label_key` (plus `label_offset`: ImageNet's 1-based labels take -1) from
    `image_key`; reports accuracy."""

    image_key: str
    label_key: str
    num_classes: int
    image_size: int | None = None  # encoded images (JPEG/PNG bytes, or a TFDS Image): decode and crop to this
    label_offset: int = 0  # added to each label before it is checked and trained on
    label_smoothing: float = 0.0  # training's targets: (1 - this) x the one-hot label + this / num_classes
    max_pixels: int = images.MAX_IMAGE_PIXELS  # an image declaring more is an error before it decodes

    @classmethod
    def from_config(cls, config: TrainConfig, specs: dict[str, dict]) -> Classification:
        for key in (config.image_key, config.label_key):
            if specs and key not in specs:
                text = ("pre-tokenized text" if specs.get("tokens", {}).get("type") == "Tokens" else
                        f"text in {config.text_key!r}" if config.text_key in specs else None)
                also = f", or task=lm: the data is {text}" if text else ""
                raise ValueError(f"task reads feature {key!r}, which the data does not have; its features are "
                                 f"{sorted(specs)} (set image_key= / label_key={also})")
        labelled = specs.get(config.label_key, {}).get("num_classes")
        if config.num_classes is not None and labelled is not None and config.num_classes != labelled:
            raise ValueError(f"num_classes={config.num_classes} but the data's ClassLabel {config.label_key!r} has "
                             f"{labelled} classes; leave num_classes unset to use the data's")
        num_classes = config.num_classes or labelled
        if num_classes is None:
            raise ValueError(f"the data has no ClassLabel metadata for {config.label_key!r} (not a TFDS dataset, or "
                             "another feature type): pass num_classes=N")
        if config.num_classes is None:
            log.info("num_classes=%d: the data's ClassLabel %r", num_classes, config.label_key)
        return cls(config.image_key, config.label_key, num_classes, config.image_size, config.label_offset,
                   config.label_smoothing, config.max_pixels)

    @property
    def features(self) -> tuple[str, ...]:
        return (self.image_key, self.label_key)

    @property
    def ranged_features(self) -> tuple[str, ...]:
        return (self.label_key,)

    def model_kwargs(self) -> dict[str, Any]:
        return {"num_classes": self.num_classes}

    @property
    def augment(self):
        """Training, with image_size: decode, Inception crop to image_size, random flip (loader.decoding.images)."""
        if self.image_size is None:
            return None
        return images.RandomResizedCrop(self.image_key, size=self.image_size, output=self.image_key,
                                        max_pixels=self.max_pixels)

    @property
    def preprocess(self):
        """Evaluation (and the model's sample), with image_size: decode, resize, central crop to image_size."""
        if self.image_size is None:
            return None
        return images.CenterCrop(self.image_key, size=self.image_size, output=self.image_key,
                                 max_pixels=self.max_pixels)

    def inputs(self, batch):
        return images_to_float(batch[self.image_key])

    def check(self, batch: dict[str, np.ndarray]) -> None:
        """Refused before the model is built (on the first record) and before step 1 (on the first batch): an input
        with no dimensions per example, a label that is not one integer per example, and labels outside
        0..num_classes-1 (they train silently wrong: their one-hot is all zeros)."""
        inputs, labels = np.asarray(batch[self.image_key]), np.asarray(batch[self.label_key])
        if inputs.ndim < 2:
            raise ValueError(f"image_key={self.image_key!r} holds one number per example, not an image or a vector; "
                             "set image_key= to the image (or feature-vector) feature")
        if labels.ndim > 1:
            raise ValueError(f"label_key={self.label_key!r} holds arrays of shape {labels.shape[1:]} per example, "
                             "not one class id; set label_key= to the integer label feature")
        if not labels.size or not np.issubdtype(labels.dtype, np.integer):
            if labels.size:
                raise ValueError(f"label_key={self.label_key!r} holds {labels.dtype} values, not integer class ids; "
                                 "set label_key= to the integer label feature")
            return
        try:
            self.check_range(self.label_key, int(labels.min()), int(labels.max()), "")
        except ValueError as e:  # a few records' range: the whole data's says more (trainer/program.py)
            raise RecordRangeError(str(e)) from None

    def check_range(self, feature: str, low: int, high: int, where: str) -> None:
        """Labels `low`..`high` (as stored; `where`: over which records, e.g. " over the 1,281,167 records of DIR")
        must be class ids 0..num_classes-1 once `label_offset` is added: an id outside trains silently wrong (an
        all-zero one-hot) or makes the loss NaN. The error names the range and the fix."""
        shift = self.label_offset
        first, last = low + shift, high + shift
        if 0 <= first and last < self.num_classes:
            return
        shifted = f" ({first}..{last} with label_offset={shift})" if shift else ""
        fits = last - first < self.num_classes  # an offset alone would bring them into range
        if first >= 1 and last == self.num_classes:
            hint = f"1-based labels: pass label_offset={shift - 1}"
        elif first > 0 and fits:
            hint = f"pass label_offset={shift - first} to start them at 0, or num_classes={last + 1}"
        elif first >= 0:
            hint = f"set num_classes={last + 1} (or check label_key=)"
        elif fits:
            hint = f"class ids must not be negative: pass label_offset={shift - first}"
        else:
            hint = "class ids must not be negative, and they span more than num_classes: check label_key="
        raise ValueError(f"label_key={feature!r} holds {low}..{high}{where}{shifted}, outside 0..{self.num_classes - 1} "
                         f"(num_classes={self.num_classes}): {hint}")

    def check_outputs(self, outputs, batch_size: int, model: str) -> None:
        """Logits [batch, num_classes]: fewer made the loss NaN, more trained silently, a tuple failed in optax."""
        _check_output_shape(outputs, (batch_size, self.num_classes), model,
                            f"[batch, num_classes={self.num_classes}] logits: its last layer has num_classes units "
                            "(it is built with num_classes=), after pooling")

    def labels(self, batch):
        """The batch's class ids (its labels plus label_offset), as int32, inside the jitted step."""
        return batch[self.label_key].astype(jnp.int32) + self.label_offset

    def losses(self, outputs, batch):
        return optax.softmax_cross_entropy_with_integer_labels(outputs, self.labels(batch))

    def training_losses(self, outputs, batch):
        """Cross-entropy against the labels smoothed by label_smoothing (the labels themselves without it)."""
        if not self.label_smoothing:
            return self.losses(outputs, batch)
        targets = optax.smooth_labels(jax.nn.one_hot(self.labels(batch), self.num_classes), self.label_smoothing)
        return optax.softmax_cross_entropy(outputs, targets)

    def metrics(self, outputs, batch):
        return {"accuracy": (jnp.argmax(outputs, -1) == self.labels(batch)).astype(jnp.float32)}


def _check_output_shape(outputs, expected: tuple[int, ...], model: str, what: str) -> None:
    """Raises unless `outputs` (shapes only) is one array of shape `expected`."""
    if not hasattr(outputs, "shape"):
        kind = f"a {type(outputs).__name__} of {len(outputs)}" if isinstance(outputs, (tuple, list, dict)) else \
            type(outputs).__name__
        raise ValueError(f"{model} returns {kind}, not one array: the task takes {what}; return the logits alone")
    if tuple(outputs.shape) != tuple(expected):
        raise ValueError(f"{model} gives outputs of shape {tuple(outputs.shape)} for a batch of {expected[0]}, not "
                         f"{tuple(expected)}: the task takes {what}")


PAD, BOS = 0, 1  # byte-level vocabulary: PAD, BOS, then byte b is token b + BYTE_OFFSET
BYTE_OFFSET = 2
BYTE_VOCAB = 256 + BYTE_OFFSET


@dataclasses.dataclass(frozen=True)
class LanguageModel:
    """Next-token prediction over a token-sequence feature `text_key`, padded to `seq_len` with a mask.

    A bytes/string feature is read as UTF-8 bytes (vocabulary 256 + PAD + BOS; eval also reports bits per byte),
    or tokenised by `tokenizer=` (a SentencePiece .model or a Hugging Face tokenizer.json: dataset_format/tokenizer.py), with
    BOS / EOS as `add_bos=` / `add_eos=` ask; an int64 sequence feature is taken as token ids (vocab_size= from the
    config). An example longer than seq_len is cut to its first seq_len targets.
    """

    text_key: str
    seq_len: int
    vocab_size: int
    byte_level: bool
    tokenizer: Any = None
    pretokenized: bool = False  # the data is `convert --tokenizer` output: its records are token ids, counts beside

    @classmethod
    def from_config(cls, config: TrainConfig, specs: dict[str, dict]) -> LanguageModel:
        tokens = specs.get("tokens", {})
        if tokens.get("type") == "Tokens":  # a pre-tokenized dataset: its ids and vocabulary are the converter's
            if config.tokenizer is not None:
                raise ValueError(f"tokenizer={config.tokenizer} tokenises text, but the data is pre-tokenized (by "
                                 "`convert --tokenizer`); drop tokenizer=")
            if config.vocab_size is not None and config.vocab_size < tokens["vocab_size"]:
                raise ValueError(f"vocab_size={config.vocab_size} is below the data's vocabulary "
                                 f"({tokens['vocab_size']}, its manifest); leave vocab_size unset to take it")
            return cls("tokens", config.seq_len, config.vocab_size or tokens["vocab_size"], False, pretokenized=True)
        spec = specs.get(config.text_key)
        if specs and spec is None:
            raise ValueError(f"task reads feature {config.text_key!r}, which the data does not have; its features are "
                             f"{sorted(specs)} (set text_key=)")
        byte_level = spec is None or spec["type"] == "Text" or spec.get("dtype") in ("string", "bytes")
        if spec is not None and not byte_level and spec.get("dtype") not in ("int64", "int32", None):
            raise ValueError(f"task=lm needs a token-sequence feature (int64 ids, or text read as bytes), but "
                             f"{config.text_key!r} is {spec['type']} of {spec.get('dtype')}")
        if config.tokenizer is not None:
            from trainer import tokenizer

            if not byte_level:
                raise ValueError(f"tokenizer={config.tokenizer} tokenises text, but {config.text_key!r} holds token ids "
                                 "already; drop tokenizer= (and pass vocab_size=)")
            tok = tokenizer.load(config.tokenizer, add_bos=config.add_bos, add_eos=config.add_eos)
            if config.vocab_size is not None and config.vocab_size < tok.vocab_size:
                raise ValueError(f"vocab_size={config.vocab_size} is below the vocabulary of tokenizer="
                                 f"{config.tokenizer} ({tok.vocab_size}); leave vocab_size unset to take the "
                                 "tokenizer's")
            return cls(config.text_key, config.seq_len, config.vocab_size or tok.vocab_size, False, tok)
        vocab_size = BYTE_VOCAB if byte_level and config.vocab_size is None else config.vocab_size
        if byte_level and vocab_size < BYTE_VOCAB:  # (a byte past it was a NaN loss at the step that met it)
            raise ValueError(f"vocab_size={vocab_size} is below byte-level text's {BYTE_VOCAB} ids (PAD, BOS and a "
                             f"byte each: {config.text_key!r} holds text, read as bytes); drop vocab_size=, or pass "
                             "tokenizer=")
        if vocab_size is None:
            raise ValueError(f"{config.text_key!r} holds token ids: pass vocab_size=N (ids must be < N)")
        return cls(config.text_key, config.seq_len, vocab_size, byte_level)

    @property
    def features(self) -> tuple[str, ...]:
        return (self.text_key,)

    def model_kwargs(self) -> dict[str, Any]:
        return {"vocab_size": self.vocab_size, "max_len": self.seq_len}

    @property
    def packing(self):
        """Packed rows for training (`packing=true`): the loader packs this task's token ids into rows."""
        import loader

        if self.pretokenized:  # the converter's token counts: nothing to tokenise or count
            return loader.Packing(seq_len=self.seq_len)
        # The token counts are cached by what the ids depend on: the tokenizer file and options, or the byte encoding.
        key = self.tokenizer.identity if self.tokenizer is not None else f"lm:{'bytes' if self.byte_level else 'ids'}"
        return loader.Packing(self.text_key, self.seq_len, self.tokenize,
                              self.tokenize_batch if self.tokenizer is not None else None, cache_key=key)

    def tokenize_batch(self, values: list) -> list[np.ndarray]:
        """Many values' token ids: one call of the tokenizer (native threads, no GIL), or `tokenize` each."""
        if self.tokenizer is None:
            return [self.tokenize(v) for v in values]
        return self.tokenizer.encode_batch([_text(v) for v in values])

    def tokenize(self, value) -> np.ndarray:
        """The feature's token ids: the tokenizer's for text when there is one, else BOS + each byte + BYTE_OFFSET;
        the ids themselves for int sequences."""
        if isinstance(value, (bytes, str, np.bytes_)) or (isinstance(value, np.ndarray) and value.dtype == object):
            if self.tokenizer is not None:
                return self.tokenizer.encode_batch([_text(value)])[0]
            data = _text(value)
            return np.concatenate([[BOS], np.frombuffer(data, np.uint8).astype(np.int32) + BYTE_OFFSET])
        array = np.asarray(value)
        if array.dtype.kind not in "iu":
            raise ValueError(f"task=lm needs a token-sequence feature (int64 ids, or text read as bytes), but "
                             f"{self.text_key!r} holds {array.dtype} values")
        ids = array.astype(np.int32).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"{self.text_key!r} has token id {int(ids.max())} outside [0, vocab_size="
                             f"{self.vocab_size}); raise vocab_size")
        return ids

    def preprocess(self, record: dict) -> dict:
        """One example padded to a row of seq_len (cut to its first seq_len targets)."""
        ids = self.tokenize(record[self.text_key])
        ids = ids[: self.seq_len + 1]
        n = max(len(ids) - 1, 0)  # targets
        row = np.zeros((2, self.seq_len), np.int32)
        row[0, :n], row[1, :n] = ids[:-1], ids[1:]
        segment = (np.arange(self.seq_len) < n).astype(np.int32)
        return {"tokens": row[0], "targets": row[1], "segment_ids": segment,
                "positions": np.arange(self.seq_len, dtype=np.int32)}

    def inputs(self, batch):
        return {"tokens": batch["tokens"], "segment_ids": batch["segment_ids"], "positions": batch["positions"]}

    def weights(self, batch):
        return (batch["segment_ids"] > 0).sum(-1).astype(jnp.float32)

    def check_outputs(self, outputs, batch_size: int, model: str) -> None:
        shape = tuple(getattr(outputs, "shape", ()))
        length = shape[1] if len(shape) == 3 else "length"  # (the row's length: seq_len, or the sample's)
        _check_output_shape(outputs, (batch_size, length, self.vocab_size), model,
                            f"[batch, length, vocab_size={self.vocab_size}] next-token logits")

    def tokens(self, batch):
        """The batch's real tokens (padding left out): tokens/s and MFU in the training log (trainer/throughput.py)."""
        return (batch["segment_ids"] > 0).sum()

    def losses(self, outputs, batch):
        per_token = optax.softmax_cross_entropy_with_integer_labels(outputs.astype(jnp.float32), batch["targets"])
        return (per_token * (batch["segment_ids"] > 0)).sum(-1)

    def metrics(self, outputs, batch):
        if not self.byte_level:
            return {}
        return {"bits_per_byte": self.losses(outputs, batch) / np.log(2)}


def _text(value) -> bytes:
    """A text feature's bytes (a decoded tf.Example gives a one-element object array)."""
    if isinstance(value, np.ndarray):
        value = b"".join(value.tolist())
    return value.encode() if isinstance(value, str) else bytes(value)


TASKS = {"classification": Classification.from_config, "lm": LanguageModel.from_config}
_MEMBERS = ("features", "model_kwargs", "inputs", "losses", "metrics")


def make(config: TrainConfig, specs: dict[str, dict]) -> Task:
    """The task `config.task` names, built for data whose TFDS feature metadata is `specs`."""
    factory = imports.resolve(config.task, TASKS, "task")
    if not callable(factory):
        raise ValueError(f"task={config.task!r} is a {type(factory).__name__}, not a class or function")
    owner = getattr(factory, "__self__", None)  # a built-in task's class (TASKS holds its from_config)
    if config.packing and config.task in TASKS and owner is not None and not hasattr(owner, "packing"):
        raise _packing_refused(config)  # before the task reads the data (its own errors would come first)
    try:
        task = factory(config, specs)
    except TypeError as e:
        raise ValueError(f"task={config.task!r} cannot be called as {config.task.rpartition(':')[2]}(config, specs) "
                         f"({e}); see trainer/tasks.py") from e
    missing = [m for m in _MEMBERS if not hasattr(task, m)]
    if missing:
        raise ValueError(f"task={config.task!r} returned a {type(task).__name__} without {missing}; a task has "
                         f"{list(_MEMBERS)} (see trainer/tasks.py)")
    if isinstance(task.features, str) or not task.features:
        raise ValueError(f"task={config.task!r}: features must be a non-empty list of feature names "
                         f"(got {task.features!r})")
    packs = hasattr(type(task), "packing") or "packing" in getattr(task, "__dict__", {})  # (not computed here)
    if config.packing and not packs:
        raise _packing_refused(config)
    if packs and not config.packing and config.mode == "train":
        # a pre-tokenized corpus was converted for packing (its token counts beside it): leaving it off is a mistake
        say = log.warning if getattr(task, "pretokenized", False) else log.info
        say("task=%s packing=false: each example is cut to its first seq_len=%d tokens and padded (packing=true "
            "splits a longer one over rows and keeps every token)", config.task, config.seq_len)
    return task


def _packing_refused(config: TrainConfig) -> ValueError:
    return ValueError(f"packing=true needs a task that packs token sequences (task=lm); task={config.task!r} does not")
