"""`pad_remainder=True`: every batch this host hands out has its full `rows`, a short one (the last, with
drop_remainder=False; a host's share of it may be none) padded with rows of zeros, and `_mask` (big_vision's name)
saying which rows are real. Every batch then has one shape (one compile of an eval step), and every host places an
equal part of a global array (sharding=), as JAX needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

MASK_KEY = "_mask"


class PaddedBatches:
    """`next_batch()`'s batches (dicts of features), each padded to `rows` rows, with MASK_KEY."""

    def __init__(self, next_batch: Callable[[], Any], rows: int, zero_rows: Callable[[], Any]):
        self._next, self._rows, self._zero_rows = next_batch, rows, zero_rows
        self._empty: dict | None = None  # a batch of no rows, shaped as those before (for a host's empty share)

    def __call__(self) -> dict:
        batch = self._next()  # (StopIteration at the end)
        if isinstance(batch, list) and not batch:  # this host's share of a short last batch: none of its rows
            # shaped as the batches before; with none before (a resume at that batch), as the loader's batches are
            batch = self._empty if self._empty is not None else self._zero_rows()
        if not isinstance(batch, dict):
            raise TypeError(f"pad_remainder=True pads batches of features (a dict), and these are a "
                            f"{type(batch).__name__}: decode the records (decode='auto', or a map_fn that returns a "
                            "dict)")
        if MASK_KEY in batch:
            raise ValueError(f"the records have a feature named {MASK_KEY!r}, the key pad_remainder=True adds: rename "
                             "it, or leave it out with features=")
        n = len(next(iter(batch.values())))
        if self._empty is None:
            self._empty = {k: v[:0] for k, v in batch.items()}
        mask = np.zeros(self._rows, bool)
        mask[:n] = True
        if n < self._rows:
            batch = {k: _padded(v, self._rows - n) for k, v in batch.items()}
        return {**batch, MASK_KEY: mask}


def handed_out(next_batch: Callable[[], Any], pad: bool, rows: int,
               zero_rows: Callable[[], Any] | None = None) -> Callable[[], Any]:
    """An iterator's source of host batches: `next_batch`, or (pad_remainder=True) its batches padded to `rows`;
    `zero_rows()`: a batch of no rows shaped as the loader's (a packed loader's empty share is one already)."""
    return PaddedBatches(next_batch, rows, zero_rows or (lambda: [])) if pad else next_batch


def _padded(values, pad: int):
    """`values` (an array, or a list of a ragged or bytes feature) and `pad` rows of zeros (b"" or None in a list)."""
    if isinstance(values, list):
        blank = type(values[0])() if values and isinstance(values[0], (bytes, str)) else None
        return values + [blank] * pad
    values = np.asarray(values)
    return np.concatenate([values, np.zeros((pad, *values.shape[1:]), values.dtype)])
