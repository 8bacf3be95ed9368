"""The close names of misspelt ones, for error messages: "did you mean steps?" (one unknown name), "did you mean
packing for packng, seq_len for seq_length?" (several)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence


def did_you_mean(unknown: Sequence[str], known: Iterable[str]) -> str:
    """The phrase for `unknown` names against `known` ones; "" when none is close."""
    known = list(known)
    close = {name: match[0] for name in unknown if (match := difflib.get_close_matches(name, known, n=1))}
    if not close:
        return ""
    guesses = list(close.values()) if len(unknown) == 1 else [f"{m} for {name}" for name, m in close.items()]
    return f"did you mean {', '.join(guesses)}?"
