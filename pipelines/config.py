"""The conversion's typed configuration: defaults in one place, validated on construction."""

from __future__ import annotations

import dataclasses
import os
import re

from dataset_format import storage

# grain reads ArrayRecord files written with group_size 1 only ("Grain requires group size 1"), so every
# random read decompresses one record's chunk: snappy reads 1.2-2.4x faster than zstd:3, whose files are 0-33%
# smaller (benchmarks/compression_bench.py, docs/benchmarks.md).
DEFAULT_COMPRESSION = "snappy"
# (zstd's levels run -131072..22, brotli's 0..11: check_writer_options has ArrayRecord's writer say so exactly)
COMPRESSION_NAME = re.compile(r"^(uncompressed|snappy|zstd:(-\d{1,6}|1?\d|2[0-2])|brotli:(\d|1[01]))$")
WRITER_OPTIONS = re.compile(r"^(.*,)?group_size:1(,.*)?$")


@dataclasses.dataclass(frozen=True)
class ConvertConfig:
    """What `python -m pipelines convert` does.

    input: a TFRecord file or glob (local or gs://), or a TFDS dataset version directory.
    output: the directory (local or gs://) that receives the ArrayRecord shards and manifest.
    compression: ArrayRecord chunk compression: zstd:N, brotli:N, snappy or uncompressed.
    writer_options: the full ArrayRecord writer options string; overrides `compression`.
    skip_corrupt: skip corrupt TFRecord frames (listed in OUT/report.json) instead of failing the shard.
    prune: delete outputs (and manifest entries) whose source no longer exists.
    force: convert every shard, even those the manifest says are up to date.
    tokenizer: a Hugging Face tokenizer.json or SentencePiece .model: write each record's `text_key` feature as its
        token ids, with a token count column (pipelines/tokens.py); None: copy the records as they are.
    add_bos, add_eos: with `tokenizer`, begin / end each document with the tokenizer's BOS / EOS id (None: as the
        tokenizer does by default).
    """

    input: str
    output: str
    compression: str = DEFAULT_COMPRESSION
    writer_options: str | None = None
    skip_corrupt: bool = False
    prune: bool = False
    force: bool = False
    tokenizer: str | None = None
    text_key: str = "text"
    add_bos: bool | None = None
    add_eos: bool = False

    def __post_init__(self):
        if not self.input:
            raise ValueError("input is empty; pass --input PATH_OR_GLOB_OR_TFDS_DIR")
        if not self.output:
            raise ValueError("output is empty; pass --output DIR")
        # A local input is recorded whole: a rerun from elsewhere, with the path spelt another way or through a symbolic
        object.__setattr__(self, "input", storage.resolved(self.input))  # link, finds its shards
        for name, value in (("writer_options", self.writer_options), ("tokenizer", self.tokenizer)):
            if value is not None and not value.strip():  # ("" kept no options, or read the working directory)
                raise ValueError(f"{name} is empty; leave --{name} out to keep the output's (its manifest's), or give "
                                 f"one{' (none: copy the records as they are)' if name == 'tokenizer' else ''}")
        if not COMPRESSION_NAME.match(self.compression):
            raise ValueError(f"compression={self.compression!r} is not one of zstd:N (N in -131072..22), brotli:N "
                             "(0..11), snappy, uncompressed")
        if self.tokenizer is not None and not self.text_key:
            raise ValueError("text_key is empty; pass --text-key FEATURE, the tf.Example feature holding the text")
        if self.tokenizer is None and (self.add_bos is not None or self.add_eos):
            raise ValueError("add_bos / add_eos shape tokenised documents: they need --tokenizer PATH")
        check_writer_options(self.resolved_writer_options,
                             "writer_options" if self.writer_options is not None else "compression")

    @property
    def resolved_writer_options(self) -> str:
        return self.writer_options or f"group_size:1,{self.compression}"


def check_writer_options(options: str, setting: str) -> None:
    """One line, before anything is converted, for writer options ArrayRecord's writer refuses (an unknown option, a
    level out of range: each shard's conversion failed inside Beam, hundreds of lines of tracebacks), or that set a
    group_size other than 1 (random access reads one record's chunk: grain refuses other files, and the loader reads
    them through ArrayRecord's slower reader). `setting`: the setting that gave them, for the message."""
    import tempfile

    from array_record.python.array_record_module import ArrayRecordWriter

    given = options if setting == "writer_options" else options.split(",", 1)[1]
    if not WRITER_OPTIONS.match(options.replace(" ", "")):
        groups = [p.strip() for p in options.split(",") if p.strip().startswith("group_size")]
        raise ValueError(f"{setting}={given!r} " + (f"sets {groups[-1]}" if groups else "sets no group_size")
                         + ": converted files hold one record a chunk (group_size:1), which random access needs; "
                         "put group_size:1 in it")
    with tempfile.TemporaryDirectory() as scratch:
        try:
            ArrayRecordWriter(os.path.join(scratch, "check.array_record"), options).close()
        except ValueError as e:
            raise ValueError(f"{setting}={given!r} is refused by ArrayRecord's writer: {e}") from None
