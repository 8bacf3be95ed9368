"""What a saved loader state must agree with to be restored: its loader's state key (the dataset, the batch size, the
seed, ...). A key recorded only since some release (`LATER_KEYS`) is checked when the state has it: a state saved before
restores as it did then."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# Keys a state saved by an earlier release lacks: "dataset", which records of which shards (ShardedSource.identity);
# a packed loader's "drop_remainder" (always True before) and "feature" (the feature its rows pack).
LATER_KEYS = frozenset({"dataset", "drop_remainder", "feature"})
# Keys a state restores across: another batch_size reads on from where the saved state stopped.
RESIZABLE_KEYS = frozenset({"batch_size"})


def unmatched(saved: dict, key: dict) -> dict:
    """{name: (saved, now)} for each entry of the state key `key` that the saved state contradicts."""
    return {k: (saved.get(k), v) for k, v in key.items()
            if saved.get(k) != v and k not in RESIZABLE_KEYS and not (k in LATER_KEYS and k not in saved)}


def check(saved: dict, key: dict, what: str, fix: str = "restore with the same dataset and options") -> None:
    """Raises naming each entry of `key` that the saved state contradicts: 'cannot restore WHAT: k: saved .., now ..;
    FIX'."""
    mismatched = unmatched(saved, key)
    if "dataset" in mismatched:  # (it names the record count)
        mismatched.pop("num_records", None)
    if mismatched:
        detail = ", ".join(f"{k}: saved {s!r}, now {n!r}{MEANING.get(k, '')}" for k, (s, n) in mismatched.items())
        raise ValueError(f"cannot restore {what}: {detail}; {fix}")


# What a mismatch of a key whose values are hashes means, said after them.
MEANING = {"counts": " (the documents' token counts differ: the data was tokenised again, by another tokenizer, or "
                     "is another dataset)"}


def said_new_batch_size(state: dict, batch_size: int) -> None:
    """One log line when a state saved with another batch size is restored (a loader continues its stream where the
    state stopped, in batches of the new size)."""
    saved = state.get("batch_size", (state.get("mixture") or {}).get("batch_size"))
    if saved is not None and saved != batch_size:
        log.info("restoring a state saved with batch_size=%d with batch_size=%d: batch %d and after continue where "
                 "it stopped, each record still read once an epoch", saved, batch_size, state["next_batch"])
