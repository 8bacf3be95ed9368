"""`python -m trainer.tokenizer SOURCE --kind bpe|sentencepiece --vocab_size N --output FILE`: a tokenizer trained
offline on the text feature of a converted dataset, or on a uniform sample of its documents when the text runs past
--max_bytes (a corpus of a billion documents: the sample reads those documents only, wherever they are, through the
index). The tokenizers themselves are dataset_format/tokenizer.py (the converter uses them too); their names are
re-exported here.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from dataset_format import storage
from dataset_format.tokenizer import (HuggingFace, SentencePiece, TokenizerError, load, train_bpe,
                                      train_sentencepiece)

__all__ = ["HuggingFace", "SentencePiece", "TokenizerError", "load", "main", "sample_texts", "train_bpe",
           "train_sentencepiece"]

MAX_BYTES = 100_000_000  # --max_bytes' default: MaxText's tokenizer trainer reads 10M characters; SentencePiece's
# guide suggests ~10M sentences. 100 MB trains either kind in minutes on one core.
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
    """`python -m trainer.tokenizer SOURCE --kind bpe|sentencepiece --vocab_size N --output FILE [--text_key text]`:
    a tokenizer trained on the text of a converted dataset (anything loader.load takes)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m trainer.tokenizer",
                                description="Train a tokenizer on the text feature of a converted dataset, offline.")
    p.add_argument("source", help="a converted dataset (directory, TFDS directory or glob)")
    p.add_argument("--kind", choices=("bpe", "sentencepiece"), default="bpe",
                   help="bpe: a byte-level BPE, a Hugging Face tokenizer.json; sentencepiece: a unigram .model")
    p.add_argument("--vocab_size", "--vocab-size", dest="vocab_size", type=int, default=1024,
                   help="the vocabulary to learn, special tokens included (default: 1024); from a small text bpe gives "
                   "fewer, and sentencepiece says the range it can give")
    p.add_argument("--text_key", "--text-key", dest="text_key", default="text",
                   help="the feature holding the text (default: text)")
    p.add_argument("--output", required=True, help="the file to write (.json for bpe, .model for sentencepiece)")
    p.add_argument("--max_bytes", "--max-bytes", dest="max_bytes", type=float, default=MAX_BYTES,
                   help=f"train on a uniform sample of the documents of about this many bytes of text when the "
                   f"dataset holds more (default: {MAX_BYTES:.0e}; 0: all of it)")
    p.add_argument("--seed", type=int, default=0, help="the sample's seed (default: 0)")
    args = p.parse_args(argv)
    if args.max_bytes < 0:
        print(f"error: --max_bytes {args.max_bytes:g} must be >= 0 (0: all the text)", file=sys.stderr)
        return 2
    suffix = ".json" if args.kind == "bpe" else ".model"
    if not args.output.endswith(suffix):
        print(f"error: --output {args.output} must end in {suffix} for --kind {args.kind} (the trainer and the "
              f"converter tell a tokenizer's kind by its suffix: .json for bpe, .model for sentencepiece)",
              file=sys.stderr)
        return 2
    import loader

    try:
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
        train = train_bpe if args.kind == "bpe" else train_sentencepiece
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        path = train(texts, args.vocab_size, args.output)
        size = load(path).vocab_size
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sampled = (f": a uniform sample of the {documents:,} documents, --max_bytes {int(args.max_bytes)}"
               if len(texts) < documents else "")
    print(f"wrote a {args.kind} tokenizer of {size:,} tokens, trained on {len(texts):,} texts "
          f"({sum(map(len, texts)):,} bytes{sampled}), to {path}")
    if size < args.vocab_size:
        print(f"note: this text gives a {args.kind} tokenizer {size:,} tokens, fewer than --vocab_size "
              f"{args.vocab_size} asked for; the converter and the trainer take the tokenizer's own size",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
