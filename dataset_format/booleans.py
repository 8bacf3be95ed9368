"""The words a boolean flag or config key takes, the same for every command (`convert --force on`,
`python -m trainer packing=true`): true, 1, yes, on / false, 0, no, off, in any case."""

from __future__ import annotations

TRUE = ("true", "1", "yes", "on")
FALSE = ("false", "0", "no", "off")


def parse(text: str) -> bool | None:
    """True or False for one of the words; None for anything else (the caller names the key and the words)."""
    lowered = text.strip().lower()
    return True if lowered in TRUE else False if lowered in FALSE else None
