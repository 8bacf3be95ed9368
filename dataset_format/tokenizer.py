"""Tokenizers: a SentencePiece model (`.model`) or a Hugging Face `tokenizer.json`, for the converter
(`python -m pipelines convert --tokenizer`) and the trainer (`task=lm tokenizer=PATH`) alike.

    tok = tokenizer.load("spm.model")           # or "tokenizer.json"
    tok.vocab_size                              # the model's vocabulary: the LM's output size
    tok.encode_batch([b"def f():", b"x = 1"])  # [int32 ids, ...]: BOS first where the tokenizer has one
    tokenizer.load("spm.model", add_eos=True)   # ... and EOS last (add_bos=, add_eos=: see `load`)

Both libraries tokenise a batch in native threads without the GIL (`tokenizers`' encode_batch; sentencepiece's
encode with num_threads), so the loader's packing pass hands them thousands of texts at a time. `train_bpe` and
`train_sentencepiece` build small tokenizers offline from texts; from a converted dataset's text feature:

    python -m trainer.tokenizer out/train --kind bpe --vocab_size 1024 --output tokenizer.json

`tokenizers` and `sentencepiece` are imported only where a tokenizer of their kind is used: the [convert] and [train]
installs have them, the base install (what the rest of dataset_format needs) does not.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Sequence

import numpy as np


class TokenizerError(ValueError):
    """A tokenizer file that is missing or of the wrong kind: one line naming the file and what was expected."""


def _texts(values: Sequence) -> list[str]:
    return [v.decode("utf-8", errors="replace") if isinstance(v, (bytes, np.bytes_)) else str(v) for v in values]


# How a tokenizer.json's BOS and EOS are found: a tokenizer_config.json beside it that names bos_token / eos_token
# (as the Hugging Face Hub ships them; null: none), else the first of these in its vocabulary. A SentencePiece
# model's are its bos_id() / eos_id().
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|endoftext|>")
EOS_NAMES = ("</s>", "<|end_of_text|>", "<eos>", "<|endoftext|>")


class _Tokenizer:
    """What both kinds share: BOS and EOS as asked, and pickling as the file's path (loader worker processes reopen
    the file rather than copy the native object).

    add_bos / add_eos: True puts one BOS first / one EOS last in each text's ids (kept where the tokenizer adds it
    itself, never doubled; a TokenizerError if it has none), False none (dropped where the tokenizer adds it), None
    what the tokenizer does itself (SentencePiece: BOS where the model has one, no EOS; tokenizer.json: its
    post-processor's special tokens, as they are)."""

    path: str
    bos_id: int | None  # None: the tokenizer has none
    eos_id: int | None

    def _ends(self, add_bos: bool | None, add_eos: bool | None, own: tuple[bool, bool], default: tuple[bool, bool],
              missing: dict[str, str], fix: str) -> None:
        """Sets what encode_batch cuts from the library's ids (`own`: the BOS / EOS the library adds itself) and
        adds around them, given `default`: what None means. `missing`: why a token is not there, `fix`: the way to
        give the tokenizer one."""
        self.add_bos, self.add_eos = add_bos, add_eos
        want = [default[i] if asked is None else asked for i, asked in enumerate((add_bos, add_eos))]
        for i, (name, token_id) in enumerate((("bos", self.bos_id), ("eos", self.eos_id))):
            if want[i] and token_id is None:
                raise TokenizerError(f"tokenizer={self.path} has no {name.upper()} token ({missing[name]}); set "
                                     f"add_{name}=false, or {fix.format(name=name, NAME=name.upper())}")
        self._cut = (int(own[0] and not want[0]), int(own[1] and not want[1]))
        self._prefix = [self.bos_id] if want[0] and not own[0] else []
        self._suffix = [self.eos_id] if want[1] and not own[1] else []

    def _finish(self, ids: Sequence[int]) -> np.ndarray:
        front, back = self._cut
        return np.asarray([*self._prefix, *ids[front: len(ids) - back], *self._suffix], np.int32)

    def __getstate__(self):
        return {"path": self.path, "add_bos": self.add_bos, "add_eos": self.add_eos}

    @property
    def identity(self) -> str:
        """The file's SHA-256 and the BOS/EOS options: what its ids depend on (a cache key for token counts)."""
        import hashlib

        with open(self.path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        return f"sha256:{digest} bos:{self.add_bos} eos:{self.add_eos}"

    def __setstate__(self, state):
        self.__init__(**state)


class SentencePiece(_Tokenizer):
    def __init__(self, path: str, add_bos: bool | None = None, add_eos: bool | None = None):
        import sentencepiece

        self.path = path
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(path)
        except (OSError, RuntimeError) as e:
            raise TokenizerError(f"tokenizer={path} is not a SentencePiece model ({str(e).splitlines()[0]}); pass a "
                                 "SentencePiece .model file or a Hugging Face tokenizer.json") from None
        self.vocab_size = int(self._sp.GetPieceSize())
        self.bos_id, self.eos_id = (int(i) if i >= 0 else None for i in (self._sp.bos_id(), self._sp.eos_id()))
        self._ends(add_bos, add_eos, own=(False, False), default=(self.bos_id is not None, False),
                   missing={"bos": "its bos_id() is -1", "eos": "its eos_id() is -1"},
                   fix="train it with {name}_id= set (train_sentencepiece gives bos_id=1, eos_id=2)")

    def encode_batch(self, values: Sequence) -> list[np.ndarray]:
        return [self._finish(i) for i in self._sp.Encode(_texts(values), num_threads=os.cpu_count() or 1)]


class HuggingFace(_Tokenizer):
    def __init__(self, path: str, add_bos: bool | None = None, add_eos: bool | None = None):
        import tokenizers

        self.path = path
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on a bad file
            raise TokenizerError(f"tokenizer={path} is not a Hugging Face tokenizer.json ({str(e).splitlines()[0]}); "
                                 "pass a tokenizer.json or a SentencePiece .model file") from None
        # ids below vocab_size: the count of its tokens, or past it where its ids leave gaps (a WordLevel vocabulary
        # may number its tokens as it likes; counted, its largest id was refused mid-conversion)
        ids = self._tok.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(int(self._tok.get_vocab_size(with_added_tokens=True)), max(ids, default=-1) + 1)
        named = _tokenizer_config(path)
        missing = {}
        for name, candidates in (("bos", BOS_NAMES), ("eos", EOS_NAMES)):
            key = f"{name}_token"
            if key in named:
                token = named[key]["content"] if isinstance(named[key], dict) else named[key]
                token_id = None if token is None else self._tok.token_to_id(token)
                missing[name] = (f"the tokenizer_config.json beside it sets {key} to null" if token is None else
                                 f"the tokenizer_config.json beside it names {key} {token!r}, not in its vocabulary")
            else:
                token_id = next((i for i in map(self._tok.token_to_id, candidates) if i is not None), None)
                missing[name] = f"none of {', '.join(candidates)} is in its vocabulary"
            setattr(self, f"{name}_id", token_id)
        # What the post-processor adds itself: a probe's ids with and without the special tokens.
        own, plain = self._tok.encode("a").ids, self._tok.encode("a", add_special_tokens=False).ids
        own_bos = self.bos_id is not None and own[:1] == [self.bos_id] and plain[:1] != [self.bos_id]
        own_eos = self.eos_id is not None and own[-1:] == [self.eos_id] and plain[-1:] != [self.eos_id]
        self._ends(add_bos, add_eos, own=(own_bos, own_eos), default=(own_bos, own_eos), missing=missing,
                   fix="name its {NAME} token as {name}_token in a tokenizer_config.json beside it")

    def encode_batch(self, values: Sequence) -> list[np.ndarray]:
        """Ids with the tokenizer's own special tokens (its post-processor's), BOS and EOS as asked."""
        return [self._finish(e.ids) for e in self._tok.encode_batch(_texts(values))]


def _tokenizer_config(path: str) -> dict:
    """The tokenizer_config.json beside a tokenizer.json ({} if none): where the Hub names bos_token, eos_token."""
    import json

    sidecar = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer_config.json")
    if not os.path.isfile(sidecar):
        return {}
    try:
        with open(sidecar) as f:
            named = json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{sidecar} (beside tokenizer={path}) is not JSON ({e}); fix or remove it") from None
    return named if isinstance(named, dict) else {}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.model")  # a directory's, in turn


def tokenizer_file(path: str, flag: str = "tokenizer=") -> str:
    """`path` when it is a file; in a directory (a Hugging Face model's, local or gs://) the first of TOKENIZER_FILES
    there, or its one `.model` file; `path` itself when it names nothing (the caller says so). `flag` names the
    option in errors."""
    from dataset_format import storage

    if storage.is_remote(path):
        names = set() if storage.exists(path) else set(storage.list_sizes(path))
    elif os.path.isdir(path):
        names = {e.name for e in os.scandir(path) if e.is_file()}
    else:
        names = set()
    if not names and not os.path.isdir(path):
        return path
    models = sorted(n for n in names if n.endswith(".model"))
    found = next((n for n in TOKENIZER_FILES if n in names), models[0] if len(models) == 1 else None)
    if found is None:
        raise TokenizerError(f"{flag}{path} is a directory without a tokenizer.json or one .model file (it holds "
                             f"{sorted(names)[:8]}); pass the tokenizer file itself")
    return storage.join(path, found)


def load(path: str, add_bos: bool | None = None, add_eos: bool | None = None) -> SentencePiece | HuggingFace:
    """The tokenizer in `path`: a `.json` file is a Hugging Face tokenizer, anything else a SentencePiece model; a
    directory holding one (a Hugging Face model's: tokenizer.json, tokenizer.model) is taken as that file.

    add_bos / add_eos: True: each text's ids begin with one BOS / end with one EOS (a TokenizerError naming the file
    if the tokenizer has none); False: none; None: as the tokenizer does itself (SentencePiece: BOS, no EOS;
    tokenizer.json: its post-processor's special tokens)."""
    path = tokenizer_file(path)
    if not os.path.isfile(path):
        raise TokenizerError(f"tokenizer={path} does not exist; pass a SentencePiece .model file or a Hugging Face "
                             "tokenizer.json")
    kind = HuggingFace if path.endswith(".json") else SentencePiece
    return kind(path, add_bos, add_eos)


BPE_LEAST = 259  # a byte-level BPE's tokens before any merge: the 256 bytes, <pad>, <s> and </s>


def train_bpe(texts: Iterable[bytes | str], vocab_size: int, path: str) -> str:
    """A byte-level BPE (GPT-2 style) trained on `texts`, saved as tokenizer.json: `<pad>` 0, `<s>` 1 (BOS, which its
    post-processor puts before each text) and `</s>` 2 (EOS, for add_eos=True), as train_sentencepiece numbers them."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
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
    try:
        sentencepiece.SentencePieceTrainer.Train(sentence_iterator=iter(_texts(list(texts))), model_writer=model,
                                                 vocab_size=vocab_size, pad_id=0, bos_id=1, eos_id=2, unk_id=3,
                                                 byte_fallback=True, max_sentence_length=1 << 16,
                                                 # keep every byte as written (code: newlines, runs of spaces)
                                                 normalization_rule_name="identity", remove_extra_whitespaces=False,
                                                 allow_whitespace_only_pieces=True, minloglevel=2)
    except RuntimeError as e:  # e.g. "Vocabulary size is too high (N). Please set it to a value <= M."
        said = str(e).strip().splitlines()[-1].rpartition("] ")[2]
        low, high = re.search(r"smaller than required_chars\. \d+ vs (\d+)", said), re.search(r"<= (\d+)", said)
        if low:  # its fix names a trainer flag (--character_coverage) that we do not pass through
            said = (f"the text's characters and the 256 byte pieces need at least {low[1]} (set vocab_size to "
                    f"{low[1]} or more)")
        elif high:
            said = f"this text gives at most {high[1]} pieces (set vocab_size to {high[1]} or less, or train on more text)"
        raise ValueError(f"sentencepiece cannot train vocab_size={vocab_size} on this text: {said}") from e
    with open(path, "wb") as f:
        f.write(model.getvalue())
    return path


# --- training from the command line: `python -m trainer.tokenizer` (a converted dataset) and `python -m pipelines
# tokenizer` (TFRecord shards) share the flags and the training below; each reads its own kind of input.
SUFFIXES = {"bpe": ".json", "sentencepiece": ".model"}  # the kind a trainer and the converter read from the suffix
MAX_BYTES = 100_000_000  # --max_bytes' default: MaxText's tokenizer trainer reads 10M characters; SentencePiece's
# guide suggests ~10M sentences. 100 MB trains either kind in minutes on one core.


def add_training_arguments(p) -> None:
    """The flags of a tokenizer-training command, on the argparse parser `p`."""
    p.add_argument("--kind", choices=tuple(SUFFIXES), default="bpe",
                   help="bpe: a byte-level BPE, a Hugging Face tokenizer.json; sentencepiece: a unigram .model")
    p.add_argument("--vocab_size", "--vocab-size", dest="vocab_size", type=int, default=1024,
                   help="the vocabulary to learn, special tokens included (default: 1024); from a small text bpe gives "
                   "fewer, and sentencepiece says the range it can give")
    p.add_argument("--text_key", "--text-key", dest="text_key", default="text",
                   help="the feature holding the text (default: text)")
    p.add_argument("--output", required=True, help="the file to write (.json for bpe, .model for sentencepiece)")
    p.add_argument("--max_bytes", "--max-bytes", dest="max_bytes", type=float, default=MAX_BYTES,
                   help=f"train on a sample of about this many bytes of text when the input holds more (default: "
                   f"{MAX_BYTES:.0e}; 0: all of it)")
    p.add_argument("--seed", type=int, default=0, help="the sample's seed (default: 0)")


def check_training_arguments(args) -> None:
    """ValueError naming the flag, before any text is read: the output's suffix, the sample's size."""
    suffix = SUFFIXES[args.kind]
    if not args.output.endswith(suffix):
        raise ValueError(f"--output {args.output} must end in {suffix} for --kind {args.kind} (the trainer and the "
                         f"converter tell a tokenizer's kind by its suffix: .json for bpe, .model for sentencepiece)")
    if not (math.isfinite(args.max_bytes) and args.max_bytes >= 0):
        raise ValueError(f"--max_bytes {args.max_bytes:g} must be a number of bytes >= 0 (0: all the text)")
    least = BPE_LEAST if args.kind == "bpe" else 1
    if args.vocab_size < least:
        why = f" (a bpe tokenizer holds the 256 bytes and {BPE_LEAST - 256} special tokens)" if least > 1 else ""
        raise ValueError(f"--vocab_size {args.vocab_size} must be >= {least}{why}")
    directory = os.path.dirname(os.path.abspath(args.output))
    if os.path.isdir(args.output):
        raise ValueError(f"--output {args.output} is a directory: name the tokenizer's file, e.g. "
                         f"{os.path.join(args.output, 'tokenizer' + suffix)}")
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:  # (a file where a directory should be)
        raise ValueError(f"--output {args.output}: its directory cannot be made ({e.strerror}: {e.filename})") from None


def train_and_report(args, texts: list[bytes], sampled: str = "") -> int:
    """Trains the tokenizer `args` asks for on `texts`, writes it and says so on stdout (`sampled`: how the texts were
    drawn, when they are a sample), with a note on stderr when the text gave fewer tokens than asked; exit status 0."""
    import sys

    train = train_bpe if args.kind == "bpe" else train_sentencepiece
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    path = train(texts, args.vocab_size, args.output)
    size = load(path).vocab_size
    print(f"wrote a {args.kind} tokenizer of {size:,} tokens, trained on {len(texts):,} texts "
          f"({sum(map(len, texts)):,} bytes{sampled}), to {path}")
    if size < args.vocab_size:
        print(f"note: this text gives a {args.kind} tokenizer {size:,} tokens, fewer than --vocab_size "
              f"{args.vocab_size} asked for; the converter and the trainer take the tokenizer's own size",
              file=sys.stderr)
    return 0
