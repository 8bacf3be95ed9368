"""Which chunks a bounded cache of a gs:// dataset should keep: the loader's policy against the best any cache could do.

    .venv/bin/python benchmarks/cache_policy_bench.py                      # 200,000 chunks, 1 and 8 hosts
    .venv/bin/python benchmarks/cache_policy_bench.py --chunks 20000 --hosts 1

The loader reads every record once an epoch, each epoch in a new permutation (loader/planning/permutation.py), and each
record is one chunk of its shard (group_size 1). A cache of K of the N chunks' bytes is measured over `--epochs`
epochs by the chunks it serves (hits) in each epoch after the first, for three policies on the same permutations:

- ours, fixed set (loader/fetch/reader.py `_ChunkCache`, what one host uses): the first K chunks read, none evicted;
- ours, planned (loader/fetch/planned_cache.py, what each of several hosts uses): the chunks this host reads again
  soonest, by the plan's next reads (`BatchPlan.next_reads`, up to 2 epochs a host ahead), read group by read
  group (32 an epoch) as the loader calls it;
- least recently used: what a general-purpose cache (a page cache, gcsfuse's file cache) does;
- Belady: on a miss, evict the chunk whose next read is furthest in the future. It reads the whole plan ahead, as
  only the loader can (its plan is a pure function of the seed), and is optimal: no policy serves more hits.

`--hosts N`: host 0 of N, which reads its rows of each global batch (256 a batch), 1/N of each epoch (a record
read on this host is read on another in the next epoch, most likely).

Reported: each policy's share of each later epoch served from the cache, and ours over Belady's.
Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import collections
import heapq

import numpy as np

from loader.fetch.planned_cache import PlannedCache
from loader.planning.batches import BatchPlan

NEVER = np.iinfo(np.int64).max
ROWS = 256  # a host's rows of each global batch
GROUPS = 32  # read groups an epoch (a dataset much larger than a group, records_per_read=32768, as in use)


def plan_of(chunks: int, epochs: int, seed: int, hosts: int) -> BatchPlan:
    return BatchPlan(chunks, ROWS * hosts, seed, num_epochs=epochs, shard_index=0, shard_count=hosts)


def reads(plan: BatchPlan) -> tuple[np.ndarray, np.ndarray]:
    """(positions, chunks): host 0's reads in order."""
    positions = np.concatenate(plan.host_positions_range(0, plan.num_batches))
    return positions, plan.indices_at(positions)


def planned(plan: BatchPlan, capacity: int) -> np.ndarray:
    """The loader's planned cache, called read group by read group as loader/pipeline.py calls it."""
    from loader.pipeline import PLAN_HORIZON, PLAN_SLACK_GROUPS

    positions, order = reads(plan)
    cache = PlannedCache(capacity)  # each chunk 1 byte: capacity counts chunks
    horizon = min(2 * plan.shard_count, PLAN_HORIZON)
    hit = np.zeros(len(order), dtype=bool)
    size = max(ROWS, len(order) // plan.num_epochs // GROUPS)
    for at in range(0, len(order), size):
        group, where = order[at:at + size], positions[at:at + size]
        hit[at:at + len(group)] = [cache.get(c) is not None for c in group.tolist()]
        first, last = int(where.min()), int(where.max())
        cache.keep(group.tolist(), plan.next_reads(where, group, horizon), [b"x"] * len(group),
                   first - PLAN_SLACK_GROUPS * (last - first + 1))
    return hit


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
        plan = plan_of(args.chunks, args.epochs, args.seed, hosts)
        positions, order = reads(plan)
        epoch = positions // args.chunks
        print(f"\n{args.chunks:,} chunks, {args.epochs} epochs, host 0 of {hosts} (~{len(order) // args.epochs:,} reads "
              "an epoch); the share of host 0's reads in each epoch after the first served from its cache:")
        print("| cache / dataset | ours, fixed set | ours, planned | least recently used | Belady (optimal) | "
              "ours / Belady |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
        for share in args.shares:
            capacity = int(share * args.chunks)
            served = {}
            for name, policy in (("fixed", lambda: fixed_set(order, capacity)),
                                 ("planned", lambda: planned(plan, capacity)),
                                 ("lru", lambda: least_recently_used(order, capacity)),
                                 ("belady", lambda: belady(order, capacity))):
                hit = policy()
                served[name] = np.array([hit[epoch == e].mean() for e in range(1, args.epochs)])
            line = " | ".join(", ".join(f"{v:.3f}" for v in served[n]) for n in ("fixed", "planned", "lru", "belady"))
            ours = served["fixed" if hosts == 1 else "planned"]  # what the loader uses on this many hosts
            print(f"| {share:.2f} | {line} | {ours.sum() / max(served['belady'].sum(), 1e-12):.2f}x |", flush=True)


if __name__ == "__main__":
    main()
