"""Resuming a packed mixture deep into its stream: with the state's anchors against laying out from the start.

    .venv/bin/python benchmarks/packed_resume_bench.py [--docs 1e8] [--data-dir DIR] [--batch 130000]

A packed mixture of two pre-tokenized corpora of short documents (`--docs` and a tenth of it; made as in
packing_scale_bench.py, reused from `--data-dir`), weights 0.7 / 0.3, rows of 1,024 tokens, 8 rows a batch. A state
at global batch `--batch` (by default about half an epoch of the larger corpus) is restored into a fresh loader, and
the first batch taken:
- from the start (the anchor; what a state without anchors, saved by an earlier version, does): each component's
  row stream is laid out block by block from its first block, to find the block holding its next row;
- ours: the state holds each component's (block, first row), so the layout starts there.
Both give the same batch (checked). Reported: seconds to the first batch after set_state, blocks laid out, ratio.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from packing_scale_bench import make_corpus  # (beside this script)


def _resume(data: dict, state: dict) -> tuple[float, int, dict]:
    import loader
    from loader.planning import packing

    laid_out = []
    real = packing.Layout.rows_in

    def counted(self, epoch, b):
        laid_out.append((epoch, b))
        return real(self, epoch, b)

    packing.Layout.rows_in = counted
    try:
        started = time.perf_counter()
        it = iter(loader.load(data, weights={"web": 0.7, "code": 0.3}, batch_size=8, seed=0,
                              packing=loader.Packing(seq_len=1024)))
        it.set_state(state)
        batch = next(it)
        return time.perf_counter() - started, len(laid_out), batch
    finally:
        packing.Layout.rows_in = real


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--docs", type=float, default=1e8, help="documents of the larger component")
    p.add_argument("--data-dir", default=None, help="where the corpora are written and kept (default: a temp dir)")
    p.add_argument("--batch", type=int, default=130_000, help="the global batch the state resumes at")
    args = p.parse_args()

    import tempfile

    import loader

    root = Path(args.data_dir or tempfile.mkdtemp(prefix="packed-resume-"))
    docs = int(args.docs)
    data = {"web": make_corpus(root, docs), "code": make_corpus(root, docs // 10)}
    it = iter(loader.load(data, weights={"web": 0.7, "code": 0.3}, batch_size=8, seed=0,
                          packing=loader.Packing(seq_len=1024)))
    state = it.get_state()
    state = {**state, "next_batch": args.batch, "mixture": it._plan.state(args.batch)}
    state.pop("anchors")
    old_s, old_blocks, old_batch = _resume(data, state)  # no anchors: from each stream's start
    it = iter(loader.load(data, weights={"web": 0.7, "code": 0.3}, batch_size=8, seed=0,
                          packing=loader.Packing(seq_len=1024)))
    it.set_state(state)
    anchored = it.get_state()  # (laying out from the start once more, to learn the anchors)
    new_s, new_blocks, new_batch = _resume(data, anchored)
    assert all(np.array_equal(old_batch[k], new_batch[k]) for k in old_batch), "the two resumes differ"
    rows = anchored["mixture"]["components"]
    print(f"mixture of {docs:,} + {docs // 10:,} documents, resumed at global batch {args.batch:,} "
          f"(rows taken: web {rows['web']['rows']:,}, code {rows['code']['rows']:,}; anchors {anchored['anchors']})")
    print("| resume | first batch after set_state | blocks laid out |")
    print("| --- | ---: | ---: |")
    print(f"| from the start (a state without anchors) | {old_s:.2f} s | {old_blocks:,} |")
    print(f"| from the state's anchors (ours) | {new_s:.3f} s | {new_blocks:,} |")
    print(f"ours is {old_s / new_s:.0f}x faster")


if __name__ == "__main__":
    main()
