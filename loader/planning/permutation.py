"""An exact, keyed permutation of range(n) that is never materialised.

grain's index shuffle is not a bijection for some lengths (grain 0.2.11 and 0.2.18: for some lengths of the form
2^k + 1, k even and >= 16, one record never appears and another appears twice), so the loader uses its own: a balanced Feistel network over
the smallest power-of-four domain >= n, with cycle-walking to stay inside range(n).
Each Feistel network is a bijection of its domain, and cycle-walking a bijection restricted
to a subset is a bijection of that subset, so every epoch holds every record exactly once,
for every n. Memory is O(1) in n; evaluating a batch of positions is vectorised NumPy.

The round keys come from a cryptographic hash of (seed, epoch, round), so permutations for
different seeds and epochs are unrelated (unlike a seed+epoch scheme, where seed s in
epoch 1 equals seed s+1 in epoch 0).

    p = Permutation(n=1000, seed=0, epoch=3)
    p(np.arange(8))  # the record indices at positions 0..7 of that epoch
"""

from __future__ import annotations

import hashlib

import numpy as np

_ROUNDS = 6
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fast, well-mixing 64-bit hash."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


class Permutation:
    """The bijection range(n) -> range(n) for (seed, epoch)."""

    def __init__(self, n: int, seed: int, epoch: int):
        if n < 1:
            raise ValueError(f"cannot permute an empty dataset (got n={n})")
        if seed < 0 or epoch < 0:
            raise ValueError(f"seed and epoch must be >= 0 (got {seed=}, {epoch=})")
        self.n = n
        self._half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
        self._mask = np.uint64((1 << self._half_bits) - 1)
        # "loader.permutation" is the hash's domain, not a module path: renaming it would change every order.
        digest = hashlib.blake2b(f"loader.permutation:{seed}:{epoch}".encode(), digest_size=8 * _ROUNDS).digest()
        self._keys = np.frombuffer(digest, dtype="<u8").astype(np.uint64)

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        bits = np.uint64(self._half_bits)
        left, right = x >> bits, x & self._mask
        with np.errstate(over="ignore"):
            for key in self._keys:
                left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << bits) | right

    def _feistel_inverse(self, x: np.ndarray) -> np.ndarray:
        bits = np.uint64(self._half_bits)
        left, right = x >> bits, x & self._mask
        with np.errstate(over="ignore"):
            for key in self._keys[::-1]:
                left, right = right ^ (_mix(left ^ key) & self._mask), left
        return (left << bits) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """Maps positions (ints in [0, n)) to record indices, elementwise."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self.n):
            raise IndexError(f"positions must be in [0, {self.n})")
        x = positions.astype(np.uint64)
        out = self._feistel(x)
        outside = out >= np.uint64(self.n)
        while outside.any():  # cycle-walk: the domain is < 4n, so a few steps on average
            out[outside] = self._feistel(out[outside])
            outside = out >= np.uint64(self.n)
        return out.astype(np.int64)

    def inverse(self, records: np.ndarray) -> np.ndarray:
        """The position of each record (ints in [0, n)) in this epoch: `inverse(self(p)) == p`."""
        records = np.asarray(records, dtype=np.int64)
        if records.size and (records.min() < 0 or records.max() >= self.n):
            raise IndexError(f"records must be in [0, {self.n})")
        out = self._feistel_inverse(records.astype(np.uint64))
        outside = out >= np.uint64(self.n)
        while outside.any():  # the cycle walked backwards
            out[outside] = self._feistel_inverse(out[outside])
            outside = out >= np.uint64(self.n)
        return out.astype(np.int64)
