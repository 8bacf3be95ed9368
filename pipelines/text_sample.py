"""Text for training a tokenizer, read from TFRecord shards before any conversion (`python -m pipelines tokenizer`):
the tokenizer that `convert --tokenizer` needs then costs one pass over a sample, not a conversion of the whole
corpus first.

TFRecord has no index, so the sample is drawn by shard: up to MAX_SHARDS shards in a seeded random order, and the
first max_bytes / shards bytes of text of each, read in parallel. Sharded corpora (TFDS's, and most exports) spread
their documents over the shards at random, so this is close to a uniform sample; a corpus whose shards are sorted
(by source or time) is better converted first and sampled with `python -m trainer.tokenizer`, which draws documents
uniformly through the index.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from dataset_format import storage
from dataset_format.example_proto import example_class
from pipelines import paths, tfrecord
from pipelines.tokens import record_text

MAX_SHARDS = 1024  # shards a sample visits at most: each costs an open (a request on gs://)
MIN_READ_BUFFER = 256 << 10  # the least a gs:// request of a sample asks for
PROGRESS_SECONDS = 10.0


@dataclasses.dataclass
class Sample:
    texts: list[bytes]
    shards_read: int  # the shards it read from
    shards: int  # the shards the input holds
    per_shard: int  # the bytes of text it read at most from each (0: all of it)

    def describe(self, max_bytes: int) -> str:
        """How the texts were drawn, for the report line ("" when they are all of the input's)."""
        if not self.per_shard:
            return ""
        which = (f"each of the {self.shards:,} shards" if self.shards_read == self.shards else
                 f"each of {self.shards_read:,} of the {self.shards:,} shards, drawn at random")
        return f": the first ~{self.per_shard:,} bytes of text of {which}, --max_bytes {max_bytes}"


def sample_texts(pattern: str | list[str], text_key: str, max_bytes: int, seed: int = 0) -> Sample:
    """The `text_key` of the records of the TFRecord shards `pattern` names (a glob, a directory, a TFDS dataset
    directory, local or gs://; or a list of them, their shards together): all of them when max_bytes is 0, else the
    first ~max_bytes / shards bytes of each of up to MAX_SHARDS shards in a seeded random order (the same for the same
    seed). A record without the text is an error naming the shard and the record."""
    patterns = [pattern] if isinstance(pattern, str) else pattern
    files = list({f.path: f for p in patterns for f in paths.list_inputs(p)}.values())
    order = np.random.default_rng(seed).permutation(len(files))
    chosen = [files[i] for i in (order[:MAX_SHARDS] if max_bytes else order)]
    per_shard = -(-max_bytes // len(chosen)) if max_bytes else 0
    # gs://: ask for about a shard's share (its records' framing and other features besides), not 16 MB at a time
    read_buffer = min(max(2 * per_shard, MIN_READ_BUFFER), 16 << 20) if per_shard else None

    def read(file: paths.InputFile) -> tuple[list[bytes], bool]:
        """The shard's texts up to per_shard bytes, and whether it held more."""
        example, texts, size = example_class(), [], 0
        with paths.open_source(file.path, read_buffer=read_buffer) as f:
            records = tfrecord.iter_records(f, path=file.path)
            for index, record in enumerate(records):
                if per_shard and size >= per_shard:
                    return texts, True
                texts.append(bytes(record_text(example, record, text_key, file.path, index)))
                size += len(texts[-1])
        return texts, False

    threads = storage.PARALLEL_REQUESTS if storage.is_remote(chosen[0].path) else min(8, os.cpu_count() or 1)
    texts: list[bytes] = []
    cut = False  # whether any shard held more than it gave
    reported = time.monotonic()
    with ThreadPoolExecutor(threads, thread_name_prefix="sample") as pool:
        for done, (shard_texts, more) in enumerate(pool.map(read, chosen), 1):
            texts.extend(shard_texts)
            cut |= more
            if time.monotonic() - reported > PROGRESS_SECONDS:
                reported = time.monotonic()
                print(f"read {done:,} of {len(chosen):,} shards: {len(texts):,} texts", file=sys.stderr)
    whole = not cut and len(chosen) == len(files)  # every shard read to its end: all the text, not a sample
    return Sample(texts, len(chosen), len(files), 0 if whole else per_shard)
