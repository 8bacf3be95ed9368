"""`python -m trainer.tokenizer SOURCE --kind bpe|sentencepiece --vocab_size N --output FILE`: a tokenizer trained
offline on the text feature of a converted dataset, or on a uniform sample of its documents when the text runs past
--max_bytes: the sample reads those documents only, wherever they are, through the index
(benchmarks/tokenizer_sample_bench.py). `python -m pipelines tokenizer` trains one on TFRecord shards before any
conversion. The tokenizers themselves are dataset_format/tokenizer.py (the converter uses them too); their names are
re-exported here.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from dataset_format import storage
from dataset_format.tokenizer import (MAX_BYTES, HuggingFace, SentencePiece, TokenizerError, add_training_arguments,
                                      check_training_arguments, load, train_and_report, train_bpe, train_sentencepiece)

__all__ = ["HuggingFace", "SentencePiece", "TokenizerError", "load", "main", "sample_texts", "train_bpe",
           "train_sentencepiece"]

PROGRESS_SECONDS = 10.0


def sample_texts(source: str, text_key: str, max_bytes: int = MAX_BYTES, seed: int = 0) -> tuple[list[bytes], int]:
    """(texts, documents): the `text_key` of every document of `source` when they come to at most `max_bytes` (0: no
    limit), else of the documents a seeded global shuffle puts first, up to `max_bytes`: a uniform sample without
    replacement, the same for the same seed; and the documents `source` holds."""
    import loader

    batches = loader.load(source, batch_size=256, shuffle=True, seed=seed, num_epochs=1, drop_remainder=False,
                          features=[text_key])
    documents = len(batches.source)
    texts: list[bytes] = []
    size, reported = 0, time.monotonic()
    iterator = iter(batches)
    try:
        for batch in iterator:
            for text in batch[text_key]:
                texts.append(bytes(text))
                size += len(texts[-1])
                if max_bytes and size >= max_bytes:
                    return texts, documents
            if time.monotonic() - reported > PROGRESS_SECONDS:
                reported = time.monotonic()
                goal = f" of {max_bytes:,}" if max_bytes else ""
                print(f"read {len(texts):,} of {documents:,} documents, {size:,}{goal} bytes", file=sys.stderr)
    finally:
        iterator.close()
    return texts, documents


def main(argv: list[str] | None = None) -> int:
    """`python -m trainer.tokenizer SOURCE --kind bpe|sentencepiece --vocab_size N --output FILE [--text_key text]
    [--max_bytes N] [--seed S]`: a tokenizer trained on the text of a converted dataset (anything loader.load
    takes)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m trainer.tokenizer",
                                description="Train a tokenizer on the text feature of a converted dataset, offline.")
    p.add_argument("source", help="a converted dataset (directory, TFDS directory or glob)")
    add_training_arguments(p)
    args = p.parse_args(argv)
    import loader

    try:
        check_training_arguments(args)
        tokens = None if storage.has_glob(args.source) else loader.token_info(args.source)
        if tokens is not None:
            raise ValueError(f"{args.source} is pre-tokenized (by {tokens.get('tokenizer')}): its records are token "
                             "ids, not text; train on a conversion of the text without --tokenizer, or use that "
                             "tokenizer")
        first = next(iter(loader.load(args.source, batch_size=1, shuffle=False, num_epochs=1)), {})
        if args.text_key not in first:
            texts = [k for k, v in first.items() if np.asarray(v).dtype.kind in "SOU"]
            raise ValueError(f"{args.source} has no feature {args.text_key!r} (its features are {sorted(first)}); "
                             f"pass --text_key {texts[0] if texts else 'NAME'}")
        texts, documents = sample_texts(args.source, args.text_key, int(args.max_bytes), args.seed)
        sampled = (f": a uniform sample of the {documents:,} documents, --max_bytes {int(args.max_bytes)}"
                   if len(texts) < documents else "")
        return train_and_report(args, texts, sampled)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
