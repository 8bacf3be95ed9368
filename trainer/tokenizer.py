"""Tokenizers for `task=lm tokenizer=PATH`: a SentencePiece model (`.model`) or a Hugging Face `tokenizer.json`.

    tok = tokenizer.load("spm.model")           # or "tokenizer.json"
    tok.vocab_size                              # the model's vocabulary: the LM's output size
    tok.encode_batch([b"def f():", b"x = 1"])  # [int32 ids, ...]: BOS first where the tokenizer has one

Both libraries tokenise a batch in native threads without the GIL (`tokenizers`' encode_batch; sentencepiece's
encode with num_threads), so the loader's packing pass hands them thousands of texts at a time. `train_bpe` and
`train_sentencepiece` build small tokenizers offline from texts; from a converted dataset's text feature:

    python -m trainer.tokenizer out/train --kind bpe --vocab_size 1024 --output tokenizer.json
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import numpy as np


class TokenizerError(ValueError):
    """A tokenizer file that is missing or of the wrong kind: one line naming the file and what was expected."""


def _texts(values: Sequence) -> list[str]:
    return [v.decode("utf-8", errors="replace") if isinstance(v, (bytes, np.bytes_)) else str(v) for v in values]


class _ByPath:
    """Pickled as its file's path (loader worker processes reopen the file rather than copy the native object)."""

    path: str

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])


class SentencePiece(_ByPath):
    def __init__(self, path: str):
        import sentencepiece

        self.path = path
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(path)
        except (OSError, RuntimeError) as e:
            raise TokenizerError(f"tokenizer={path} is not a SentencePiece model ({str(e).splitlines()[0]}); pass a "
                                 "SentencePiece .model file or a Hugging Face tokenizer.json") from None
        self.vocab_size = int(self._sp.GetPieceSize())
        self.bos_id = int(self._sp.bos_id())  # -1: none

    def encode_batch(self, values: Sequence) -> list[np.ndarray]:
        ids = self._sp.Encode(_texts(values), num_threads=os.cpu_count() or 1)
        prefix = [self.bos_id] if self.bos_id >= 0 else []
        return [np.asarray(prefix + list(i), np.int32) for i in ids]


class HuggingFace(_ByPath):
    def __init__(self, path: str):
        import tokenizers

        self.path = path
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on a bad file
            raise TokenizerError(f"tokenizer={path} is not a Hugging Face tokenizer.json ({str(e).splitlines()[0]}); "
                                 "pass a tokenizer.json or a SentencePiece .model file") from None
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode_batch(self, values: Sequence) -> list[np.ndarray]:
        """Ids with the tokenizer's own special tokens (its post-processor adds BOS/EOS where it defines them)."""
        return [np.asarray(e.ids, np.int32) for e in self._tok.encode_batch(_texts(values))]


def load(path: str) -> SentencePiece | HuggingFace:
    """The tokenizer in `path`: a `.json` file is a Hugging Face tokenizer, anything else a SentencePiece model."""
    if not os.path.isfile(path):
        raise TokenizerError(f"tokenizer={path} does not exist; pass a SentencePiece .model file or a Hugging Face "
                             "tokenizer.json")
    return HuggingFace(path) if path.endswith(".json") else SentencePiece(path)


def train_bpe(texts: Iterable[bytes | str], vocab_size: int, path: str) -> str:
    """A byte-level BPE (GPT-2 style, BOS `<s>` added to each text) trained on `texts`, saved as tokenizer.json."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_texts(list(texts)), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(path)
    return path


def train_sentencepiece(texts: Iterable[bytes | str], vocab_size: int, path: str) -> str:
    """A SentencePiece unigram model trained on `texts` without normalisation (decoding gives the text back byte for
    byte), written to `path` (ending in .model)."""
    import io

    import sentencepiece

    if not path.endswith(".model"):
        raise ValueError(f"path={path} must end in .model")
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.Train(sentence_iterator=iter(_texts(list(texts))), model_writer=model,
                                             vocab_size=vocab_size, pad_id=0, bos_id=1, eos_id=2, unk_id=3,
                                             byte_fallback=True, max_sentence_length=1 << 16,
                                             # keep every byte as written (code: newlines, runs of spaces)
                                             normalization_rule_name="identity", remove_extra_whitespaces=False,
                                             allow_whitespace_only_pieces=True, minloglevel=2)
    with open(path, "wb") as f:
        f.write(model.getvalue())
    return path


def main(argv: list[str] | None = None) -> int:
    """`python -m trainer.tokenizer SOURCE --kind bpe|sentencepiece --vocab_size N --output FILE [--text_key text]`:
    a tokenizer trained on the text of a converted dataset (anything loader.load takes)."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m trainer.tokenizer",
                                description="Train a tokenizer on the text feature of a converted dataset, offline.")
    p.add_argument("source", help="a converted dataset (directory, TFDS directory or glob)")
    p.add_argument("--kind", choices=("bpe", "sentencepiece"), default="bpe",
                   help="bpe: a byte-level BPE, a Hugging Face tokenizer.json; sentencepiece: a unigram .model")
    p.add_argument("--vocab_size", "--vocab-size", dest="vocab_size", type=int, default=1024)
    p.add_argument("--text_key", "--text-key", dest="text_key", default="text")
    p.add_argument("--output", required=True, help="the file to write (.json for bpe, .model for sentencepiece)")
    args = p.parse_args(argv)
    import loader

    try:
        batches = loader.load(args.source, batch_size=1024, shuffle=False, num_epochs=1, drop_remainder=False,
                              features=[args.text_key])
        texts = [bytes(t) for batch in batches for t in batch[args.text_key]]
        train = train_bpe if args.kind == "bpe" else train_sentencepiece
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        path = train(texts, args.vocab_size, args.output)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote a {args.kind} tokenizer of {args.vocab_size} tokens, trained on {len(texts):,} texts "
          f"({sum(map(len, texts)):,} bytes), to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
