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


def saved_by(state) -> str | None:
    """The kind of loader that saved `state` (what its get_state() returned), None when it is no loader's state."""
    if not isinstance(state, dict) or "next_batch" not in state:
        return None
    if "mixture" in state:
        return "a packed mixture" if "packing" in state else "a mixture"
    if "seq_len" in state:
        return "a packed loader of one source"
    return "a loader of one source" if "version" in state else None


def check_kind(state, kind: str, this: str) -> None:
    """Raises when `state` is not one `kind` of loader saved ("a mixture", ...): one line saying which saved it (a
    field by field comparison said "saved None" of every key)."""
    by = saved_by(state)
    if by == kind:
        return
    if by is None:
        keys = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"set_state() takes what get_state() returned; this is not a loader state ({keys})")
    raise ValueError(f"cannot restore {this} from a state saved by {by}: restore it into the loader that saved it "
                     "(the same sources, as a mixture or not, and packing= or not)")


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
