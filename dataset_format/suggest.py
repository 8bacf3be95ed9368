"""The close names of misspelt ones, for error messages: "did you mean steps?" (one unknown name), "did you mean
packing for packng, seq_len for seq_length?" (several)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence

from dataset_format import storage


def did_you_mean(unknown: Sequence[str], known: Iterable[str], cutoff: float = 0.6) -> str:
    """The phrase for `unknown` names against `known` ones; "" when none is close (difflib's ratio below `cutoff`)."""
    known = list(known)
    close = {name: match[0] for name in unknown
             if (match := difflib.get_close_matches(name, known, n=1, cutoff=cutoff))}
    if not close:
        return ""
    guesses = list(close.values()) if len(unknown) == 1 else [f"{m} for {name}" for name, m in close.items()]
    return f"did you mean {', '.join(guesses)}?"


def near_path(path: str) -> str:
    """"; did you mean DIR/train?" when a path (local or gs://) without a glob names nothing but is close to an entry
    of its directory (a misspelt dataset directory); else ""."""
    if storage.has_glob(path):
        return ""
    parent, _, name = path.rstrip("/").rpartition("/")
    if storage.is_remote(path) and parent.rstrip("/") in ("gs:", ""):
        return ""  # a bucket name: its parent is no directory
    close = difflib.get_close_matches(name, storage.entries(parent), n=2)
    return f"; did you mean {' or '.join(storage.join(parent, c) if parent else c for c in close)}?" if close else ""
