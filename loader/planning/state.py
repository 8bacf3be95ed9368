"""What a saved loader state must agree with to be restored: its loader's state key (the dataset, the batch size, the
seed, ...). A key recorded only since some release (`LATER_KEYS`) is checked when the state has it: a state saved before
restores as it did then."""

from __future__ import annotations

# Keys a state saved by an earlier release lacks: "dataset", which records of which shards (ShardedSource.identity);
# a packed loader's "drop_remainder" (always True before).
LATER_KEYS = frozenset({"dataset", "drop_remainder"})


def unmatched(saved: dict, key: dict) -> dict:
    """{name: (saved, now)} for each entry of the state key `key` that the saved state contradicts."""
    return {k: (saved.get(k), v) for k, v in key.items()
            if saved.get(k) != v and not (k in LATER_KEYS and k not in saved)}


def check(saved: dict, key: dict, what: str, fix: str = "restore with the same dataset and options") -> None:
    """Raises naming each entry of `key` that the saved state contradicts: 'cannot restore WHAT: k: saved .., now ..;
    FIX'."""
    mismatched = unmatched(saved, key)
    if "dataset" in mismatched:  # (it names the record count)
        mismatched.pop("num_records", None)
    if mismatched:
        detail = ", ".join(f"{k}: saved {s!r}, now {n!r}" for k, (s, n) in mismatched.items())
        raise ValueError(f"cannot restore {what}: {detail}; {fix}")
