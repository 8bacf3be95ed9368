"""Tokenising at conversion time: each record's text becomes its token ids, stored compactly, with a count column.

`python -m pipelines convert --tokenizer PATH --text-key KEY` writes, for each shard, records that are the token ids
of one document each (little-endian, the narrowest unsigned type the vocabulary fits: uint16 for up to 65,536 ids)
and a `.counts` file beside it (one little-endian uint32 per record: the ids in it), which the loader memory-maps to
pack without reading the corpus (loader/planning/counts.py). The manifest's `tokens` section names the tokenizer (its
file's SHA-256), the vocabulary size, the id type and the text key; a shard is converted again when any of them changes.

Texts are tokenised a batch at a time through the tokenizer library's batch call, which runs in native threads on
every core (Hugging Face `tokenizers`' encode_batch, SentencePiece's num_threads).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import hashlib
import os
import re
import tempfile
from collections.abc import Iterable, Iterator

import numpy as np

from dataset_format import storage
from dataset_format.example_proto import example_class
from dataset_format.manifest import COUNTS_SUFFIX, token_dtype

BATCH = 2048  # texts per batch call of the tokenizer


class TextKeyError(ValueError):
    """A record without the text feature to tokenise: names the shard, the record (`index`, among the records read)
    and the keys it has."""

    def __init__(self, message: str, index: int | None = None):
        super().__init__(message)
        self.index = index


@dataclasses.dataclass(frozen=True)
class TokenizeSpec:
    """How a conversion tokenises: pickled to every worker, which loads the tokenizer once."""

    tokenizer: str  # a Hugging Face tokenizer.json or a SentencePiece .model (local or gs://)
    text_key: str
    sha256: str
    vocab_size: int
    add_bos: bool | None = None  # None: as the tokenizer does by default
    add_eos: bool = False

    @classmethod
    def of(cls, tokenizer: str, text_key: str, add_bos: bool | None = None, add_eos: bool = False) -> TokenizeSpec:
        """Reads the tokenizer once (its hash and vocabulary): a missing or unreadable file fails here, at launch. A
        directory (a Hugging Face model's) is taken as the tokenizer file in it (dataset_format.tokenizer)."""
        from dataset_format.tokenizer import TokenizerError, tokenizer_file  # noqa: PLC0415 - as load() imports it

        tokenizer = storage.absolute(tokenizer_file(tokenizer, "--tokenizer "))  # verify may run from elsewhere
        data = storage.read_bytes(tokenizer)
        if data is None:
            raise FileNotFoundError(f"--tokenizer {tokenizer}: no such file; pass a Hugging Face tokenizer.json or a "
                                    "SentencePiece .model")
        spec = cls(tokenizer, text_key, hashlib.sha256(data).hexdigest(), 0, add_bos, add_eos)
        try:
            loaded = spec.load()
        except TokenizerError as e:  # its lines name the trainer's keys (tokenizer=, add_bos=): here they are flags
            text = re.sub(r"\btokenizer=", "--tokenizer ", str(e))
            raise TokenizerError(re.sub(r"\badd_(bos|eos)=(\w+)", r"--add-\1 \2", text)) from None
        return dataclasses.replace(spec, vocab_size=int(loaded.vocab_size))

    @property
    def dtype(self) -> str:
        return token_dtype(self.vocab_size)

    @property
    def identity(self) -> str:
        """What a shard's manifest entry records of the tokenisation; a change converts the shard again."""
        return f"sha256:{self.sha256[:16]} key:{self.text_key} bos:{self.add_bos} eos:{self.add_eos}"

    def manifest(self) -> dict:
        """The manifest's `tokens` section."""
        return {"dtype": self.dtype, "vocab_size": self.vocab_size, "tokenizer": self.tokenizer,
                "tokenizer_sha256": self.sha256, "text_key": self.text_key, "add_bos": self.add_bos,
                "add_eos": self.add_eos, "counts": COUNTS_SUFFIX}

    def load(self):
        """The tokenizer, loaded once per process (every shard a worker converts shares it; a gs:// file is
        downloaded once)."""
        return _loaded(self)


@functools.lru_cache(maxsize=4)
def _loaded(spec: TokenizeSpec):
    """The tokenizer of `spec` (a local copy first when it is on gs://). Both libraries encode from many threads."""
    from dataset_format import tokenizer as tokenizers  # noqa: PLC0415 - its libraries: the [convert] install

    path = spec.tokenizer
    if storage.is_remote(path):
        suffix = os.path.splitext(path)[1]
        fd, local = tempfile.mkstemp(prefix="tokenizer-", suffix=suffix)
        os.close(fd)
        storage.download(path, local)
        path = local
    options = {} if spec.add_bos is None else {"add_bos": spec.add_bos}
    if spec.add_eos:
        options["add_eos"] = True
    return tokenizers.load(path, **options)


@functools.lru_cache(maxsize=4)
def _spec(tokenizer: str, text_key: str, add_bos: bool | None, add_eos: bool) -> TokenizeSpec:
    return TokenizeSpec.of(tokenizer, text_key, add_bos, add_eos)


def spec_for(config) -> TokenizeSpec | None:
    """The conversion's tokenisation (read once per process), or None when it copies records."""
    if config.tokenizer is None:
        return None
    return _spec(config.tokenizer, config.text_key, config.add_bos, config.add_eos)


def check_first_record(config, tasks, *, shards: int = 8) -> None:
    """Before anything is written: the first record of the shards to convert (up to `shards` of them, past empty
    ones) must hold the text to tokenise. A --text-key that names no feature failed every shard one by one, and the
    manifest of an output that had converted then listed none of them."""
    spec = spec_for(config)
    if spec is None:
        return
    from pipelines import paths, tfrecord

    for task in list(tasks)[:shards]:
        try:
            with paths.open_source(task.source.path, read_buffer=1 << 20) as f:  # a first record, not 16 MB
                record = next(tfrecord.iter_records(f, path=task.source.path), None)
        except tfrecord.CorruptRecordError:
            continue  # a damaged first frame: the conversion says so of that shard (no scan for the next frame here)
        if record is None:
            continue
        try:
            record_text(example_class(), record, spec.text_key, task.source.path, 0)
        except TextKeyError as e:
            raise ValueError(f"{e} (checked before converting: nothing was written)") from None
        return


def record_text(example, record: bytes, text_key: str, source: str, index: int) -> bytes:
    """Record `index` of `source`'s text: its `text_key` feature, one bytes value, read from the message parsed by
    `example` (example_class(); directly: 1.8 us a record against 8 us for a whole decode_example). A record that is
    not a tf.Example, lacks the feature or holds other than one text is a TextKeyError naming the file and record."""
    try:
        parsed = example.FromString(record)
    except Exception as e:  # noqa: BLE001 - named with the record
        raise TextKeyError(f"{source}: record {index} is not a tf.Example ({type(e).__name__}: {e}); the tokenizer "
                           "reads the text of tf.Example records", index) from e
    features = parsed.features.feature
    if text_key not in features:
        raise TextKeyError(f"{source}: record {index} has no feature {text_key!r} (it has {sorted(features)}); pass "
                           "its text feature as --text-key", index)
    feature = features[text_key]
    kind = feature.WhichOneof("kind")
    values = feature.bytes_list.value if kind == "bytes_list" else ()
    if len(values) != 1:
        what = f"{len(values)} texts" if kind == "bytes_list" else (kind or "no values").replace("_list", "s")
        raise TextKeyError(f"{source}: record {index}'s {text_key!r} holds {what}, not one text; pass a feature "
                           "holding one string as --text-key", index)
    return values[0]


def _utf8(text: bytes) -> bool:
    if text.isascii():  # (most texts: a scan in C, no decode)
        return True
    try:
        text.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


class Tokenize:
    """Records (serialized tf.Examples) in, token-id records out, a batch at a time; `counts` collects the lengths."""

    def __init__(self, spec: TokenizeSpec, source: str):
        self._spec, self._source = spec, source
        self._tokenizer = spec.load()
        self._example = example_class()
        self._dtype = np.dtype(spec.dtype)
        self.counts: list[np.ndarray] = []
        self._seen = 0
        self.not_utf8: list[int] = []  # records whose text is not UTF-8 (the tokenizer reads U+FFFD for its bad bytes)

    def __call__(self, records: Iterable[bytes]) -> Iterator[bytes]:
        """Token-id records for `records`, in order. The tokenizer's batch call (native threads, the GIL released)
        runs on a thread while this one reads, parses and writes the neighbouring batches."""
        pending = None  # (future ids, records in it) of the batch being tokenised
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize") as pool:
            batch: list[bytes] = []
            for record in itertools.chain(records, [None]):
                if record is not None:
                    batch.append(record)
                if len(batch) == BATCH or (record is None and batch):
                    texts = [record_text(self._example, r, self._spec.text_key, self._source, self._seen + i)
                             for i, r in enumerate(batch)]
                    self.not_utf8 += [self._seen + i for i, t in enumerate(texts) if not _utf8(t)]
                    self._seen += len(batch)
                    future = pool.submit(self._tokenizer.encode_batch, texts)
                    if pending is not None:
                        yield from self._finish(pending)
                    pending, batch = future, []
            if pending is not None:
                yield from self._finish(pending)

    def _finish(self, future) -> Iterator[bytes]:
        ids = future.result()
        counts = np.fromiter(map(len, ids), np.int64, len(ids))
        flat = np.concatenate(ids) if len(ids) else np.zeros(0, np.int64)  # one pass for the batch, not per record
        if len(flat) and (int(flat.max()) >= self._spec.vocab_size or int(flat.min()) < 0):
            bad = int(flat.max()) if int(flat.max()) >= self._spec.vocab_size else int(flat.min())
            raise ValueError(f"{self._spec.tokenizer}: produced id {bad}, outside its vocabulary of "
                             f"{self._spec.vocab_size}; the tokenizer file is inconsistent")
        self.counts.append(counts.astype(np.uint32))
        data = flat.astype(self._dtype, copy=False).tobytes()
        ends = (np.cumsum(counts) * self._dtype.itemsize).tolist()
        start = 0
        for end in ends:
            yield data[start:end]
            start = end

    def total(self) -> int:
        """The token ids of the records tokenised so far."""
        return int(sum(int(c.sum()) for c in self.counts))

    def counts_bytes(self) -> bytes:
        return np.concatenate(self.counts).astype("<u4").tobytes() if self.counts else b""
