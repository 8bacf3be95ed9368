"""Which chunks a bounded cache of a gs:// dataset should keep: the loader's policy against the best any cache could do.

    .venv/bin/python benchmarks/cache_policy_bench.py                      # 200,000 chunks, 1 and 8 hosts
    .venv/bin/python benchmarks/cache_policy_bench.py --chunks 20000 --hosts 1

The loader reads every record once an epoch, each epoch in a new permutation (loader/permutation.py), and each
record is one chunk of its shard (group_size 1). A cache of K of the N chunks' bytes is measured over `--epochs`
epochs by the chunks it serves (hits) in each epoch after the first, for three policies on the same permutations:

- ours: the fixed set (loader/reader.py `_ChunkCache`): the first K chunks read are kept, none evicted;
- least recently used: what a general-purpose cache (a page cache, gcsfuse's file cache) does;
- Belady: on a miss, evict the chunk whose next read is furthest in the future. It reads the whole plan ahead, as
  only the loader can (its plan is a pure function of the seed), and is optimal: no policy serves more hits.

`--hosts N`: host 0 of N, which reads 1/N of each epoch (a cache holds chunks of the whole dataset: a record read
on this host is read on another in the next epoch, most likely).

Reported: each policy's share of each later epoch served from the cache, and ours over Belady's.
Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import collections
import heapq

import numpy as np

from loader.permutation import Permutation

NEVER = np.iinfo(np.int64).max


def reads(chunks: int, epochs: int, seed: int, hosts: int = 1) -> np.ndarray:
    """The chunks in the order host 0 of `hosts` reads them: epoch e is the permutation of (seed, e), of which each
    host reads every `hosts`-th position (its rows of each global batch)."""
    return np.concatenate([Permutation(chunks, seed, e)(np.arange(0, chunks, hosts)) for e in range(epochs)])


def next_reads(order: np.ndarray) -> np.ndarray:
    """For each read, when its chunk is read next (NEVER: not again)."""
    following = np.full(len(order), NEVER, dtype=np.int64)
    last: dict[int, int] = {}
    for t in range(len(order) - 1, -1, -1):
        c = int(order[t])
        following[t] = last.get(c, NEVER)
        last[c] = t
    return following


def fixed_set(order: np.ndarray, capacity: int) -> np.ndarray:
    kept: set[int] = set()
    hit = np.zeros(len(order), dtype=bool)
    for t, c in enumerate(order.tolist()):
        if c in kept:
            hit[t] = True
        elif len(kept) < capacity:
            kept.add(c)
    return hit


def least_recently_used(order: np.ndarray, capacity: int) -> np.ndarray:
    kept: collections.OrderedDict = collections.OrderedDict()
    hit = np.zeros(len(order), dtype=bool)
    for t, c in enumerate(order.tolist()):
        if c in kept:
            hit[t] = True
            kept.move_to_end(c)
        else:
            kept[c] = None
            if len(kept) > capacity:
                kept.popitem(last=False)
    return hit


def belady(order: np.ndarray, capacity: int) -> np.ndarray:
    following = next_reads(order)
    due: dict[int, int] = {}  # chunk kept -> its next read
    furthest: list[tuple[int, int]] = []  # (-next read, chunk), stale entries skipped
    hit = np.zeros(len(order), dtype=bool)
    for t, c in enumerate(order.tolist()):
        hit[t] = c in due
        due[c] = int(following[t])
        heapq.heappush(furthest, (-due[c], c))
        while len(due) > capacity:
            n, victim = heapq.heappop(furthest)
            if due.get(victim) == -n:
                del due[victim]
    return hit


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunks", type=int, default=200_000)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--shares", type=float, nargs="+", default=[0.1, 0.25, 0.5, 0.75],
                   help="cache sizes, as shares of the dataset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hosts", type=int, nargs="+", default=[1, 8],
                   help="hosts sharing the dataset: host 0 reads 1/hosts of it")
    args = p.parse_args()
    for hosts in args.hosts:
        order = reads(args.chunks, args.epochs, args.seed, hosts)
        per_epoch = len(order) // args.epochs
        print(f"\n{args.chunks:,} chunks, {args.epochs} epochs, host 0 of {hosts} ({per_epoch:,} reads an epoch); the "
              "share of host 0's reads in each epoch after the first served from its cache:")
        print("| cache / dataset | ours (fixed set) | least recently used | Belady (optimal) | ours / Belady |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for share in args.shares:
            capacity = int(share * args.chunks)
            served = {}
            for name, policy in (("ours", fixed_set), ("lru", least_recently_used), ("belady", belady)):
                hit = policy(order, capacity).reshape(args.epochs, per_epoch)[1:]
                served[name] = hit.mean(axis=1)
            line = " | ".join(", ".join(f"{v:.3f}" for v in served[n]) for n in ("ours", "lru", "belady"))
            ratio = served["ours"].sum() / max(served["belady"].sum(), 1e-12)
            print(f"| {share:.2f} | {line} | {ratio:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
