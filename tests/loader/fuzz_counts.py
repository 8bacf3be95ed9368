"""Mutation fuzzing of a pre-tokenized dataset's token counts (each shard's `SHARD.counts`), through packed loading.

The counts decide the packed layout before any record is read, so a damaged or crafted counts file must cost no more
memory or time than a true one and must never put a wrong token into a row. A seed dataset (3 shards of text
tokenised at conversion time) has its counts mutated, one mutation a case, and is loaded packed, for one epoch, with
a random seq_len and fit, in a child process. Each case is judged:

- crash: the child died of a signal;         - hang: no answer within the case timeout;
- memory: its peak RSS grew by over 1 GB;     - unnamed: an error that is not a ValueError naming a counts file or shard;
- wrong: a packed row whose tokens are not the ids of the pieces the layout put there (every row is checked
  against the records' true ids), or a piece past its record's end.

Cases are a pure function of (seed, case number):

    python -m tests.loader.fuzz_counts --cases 2000            # a long run
    python -m tests.loader.fuzz_counts --replay 17             # one case, in this process
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tests.loader.fuzz import error_outcome

REPO = Path(__file__).resolve().parents[2]
KINDS = ("extreme", "near", "random", "swap", "zero_all", "truncate", "extend")
EXTREMES = (0, 1, 2, 2**16, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1)
MEMORY_LIMIT_KB = 1 << 20
CASE_TIMEOUT = 60.0
MAX_RECORD_BYTES = 1 << 20  # what the loader is given: a count over 512Ki uint16 ids is refused before reading


def build(directory: Path) -> Path:
    """The seed: 150 documents of 1 to ~400 tokens, tokenised at conversion into 3 shards. Returns its directory."""
    from dataset_format import example_proto
    from dataset_format import tokenizer as tokenizers
    from pipelines import ConvertConfig, run_conversion
    from tests.conftest import write_tfrecord_shards

    rng = np.random.default_rng(5)
    words = ["data", "loader", "shard", "token", "row", "pack", "seed", "epoch", "batch", "host"]
    texts = [" ".join(words[w] for w in rng.integers(0, len(words), int(rng.integers(0, 120)))).encode()
             for _ in range(150)]
    records = [example_proto.encode_example({"text": t}) for t in texts]
    write_tfrecord_shards(directory / "raw", [records[:60], records[60:61], records[61:]])
    tok = tokenizers.train_bpe(texts, 300, str(directory / "tokenizer.json"))
    out = directory / "tokens"
    run_conversion(ConvertConfig(input=str(directory / "raw" / "*.tfrecord"), output=str(out), tokenizer=tok,
                                 text_key="text"), ["--direct_num_workers=1"])
    return out


def mutate(counts: list[np.ndarray], rng: np.random.Generator, kind: str) -> list[np.ndarray]:
    """One mutation of the shards' count columns (the file sizes change only for truncate and extend)."""
    out = [c.copy() for c in counts]
    s = int(rng.integers(0, len(out)))
    column = out[s]
    if kind == "truncate":
        out[s] = column[:int(rng.integers(0, len(column)))] if len(column) else column
    elif kind == "extend":
        out[s] = np.concatenate([column, rng.integers(0, 2**32, int(rng.integers(1, 4)), dtype=np.uint32)])
    elif kind == "zero_all":
        column[:] = 0
    elif kind == "swap":
        if len(column) > 1:  # (a one-record shard has nothing to swap: the case is the seed's counts)
            i, j = rng.choice(len(column), 2, replace=False)
            column[[i, j]] = column[[j, i]]
    elif len(column):
        for _ in range(int(rng.integers(1, 4))):
            i = int(rng.integers(0, len(column)))
            if kind == "extreme":
                column[i] = EXTREMES[int(rng.integers(0, len(EXTREMES)))]
            elif kind == "near":
                column[i] = max(0, int(column[i]) + int(rng.choice([-3, -2, -1, 1, 2, 3])))
            else:
                column[i] = int(rng.integers(0, 2**32))
    return out


def case_plan(seed: int, case: int) -> tuple[str, int, str, np.random.Generator]:
    rng = np.random.default_rng([seed, case, 31])
    return KINDS[int(rng.integers(0, len(KINDS)))], int(rng.integers(1, 80)), ("first", "best")[int(rng.integers(0, 2))], rng


class Child:
    """The child's side: the seed's true ids read once; one case at a time on a copy of the dataset."""

    def __init__(self, seed_dir: Path, work: Path):
        import loader

        self.data = work / "tokens"
        shutil.copytree(seed_dir, self.data)
        self.shards = sorted(self.data.glob("*.array_record"))
        self.counts = [np.fromfile(f"{p}.counts", "<u4") for p in self.shards]
        self.ids = [b["tokens"][0] for b in loader.load(str(self.data), batch_size=1, shuffle=False, num_epochs=1)]
        self.baseline_kb = None

    def run(self, seed: int, case: int) -> dict:
        import loader

        kind, seq_len, fit, rng = case_plan(seed, case)
        for path, column in zip(self.shards, mutate(self.counts, rng, kind)):
            _replace(f"{path}.counts", column)
        result = {"case": case, "kind": kind, "seq_len": seq_len, "fit": fit}
        try:
            batches = loader.load(str(self.data), batch_size=2, packing=loader.Packing(seq_len=seq_len, fit=fit),
                                  seed=case, num_epochs=1, max_record_bytes=MAX_RECORD_BYTES)
            wrong = self._check(batches)
            result["outcome"] = "wrong" if wrong else "rows"
            if wrong:
                result["detail"] = wrong
        except Exception as e:  # noqa: BLE001 - judged: a ValueError naming a shard, or a finding
            result["outcome"], result["detail"] = error_outcome(e, (ValueError,),
                                                                any(p.name in str(e) for p in self.shards))
        finally:
            for path, column in zip(self.shards, self.counts):
                _replace(f"{path}.counts", column)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        self.baseline_kb = peak if self.baseline_kb is None else self.baseline_kb
        if peak - self.baseline_kb > MEMORY_LIMIT_KB:
            result["outcome"], result["detail"] = "memory", f"peak RSS grew by {(peak - self.baseline_kb) // 1024} MB"
        return result

    def _check(self, batches) -> str | None:
        """Why a row is wrong (its tokens are not its pieces' ids), or None. Walks the plan beside the batches."""
        from loader.planning.packing import START

        at = START
        for k, batch in enumerate(batches):
            rows, at = batches.plan.batch_at(at)
            for r, (block, j) in enumerate(rows):
                col = 0
                for record, start, n in block.row(j):
                    ids = self.ids[record]
                    if start + n + 1 > len(ids):
                        return f"batch {k} row {r}: a piece of record {record} ends at {start + n + 1} of {len(ids)}"
                    if batch["tokens"][r, col:col + n].tolist() != ids[start:start + n].tolist() or \
                            batch["targets"][r, col:col + n].tolist() != ids[start + 1:start + n + 1].tolist():
                        return f"batch {k} row {r}: record {record}'s piece holds other tokens"
                    col += n
                if batch["segment_ids"][r, col:].any():
                    return f"batch {k} row {r}: tokens past its pieces"
        return None


def _replace(path: str, column: np.ndarray) -> None:
    """Writes a counts file as a conversion does: a new file renamed over the old (an earlier case's loader may still
    map the old one; truncating a mapped file in place would kill it with SIGBUS)."""
    column.astype("<u4").tofile(path + ".new")
    os.replace(path + ".new", path)


def child_main(seed_dir: str, seed: int, cases: list[int]) -> None:
    work = Path(tempfile.mkdtemp(prefix="fuzz-counts-"))
    os.environ["LOADER_INDEX_DIR"] = str(work / "index")
    try:
        child = Child(Path(seed_dir), work)
        for case in cases:
            print(json.dumps(child.run(seed, case)), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(cases: range, *, seed: int = 0, seed_dir: Path, timeout: float = CASE_TIMEOUT) -> dict:
    """Runs `cases` in one child process (restarted after a case that kills or hangs it); returns
    {"counts": {outcome: n}, "kinds": {kind: n}, "findings": [case results]}."""
    import collections

    counts: collections.Counter = collections.Counter()
    kinds: collections.Counter = collections.Counter()
    findings, todo = [], list(cases)
    code = ("import sys, json; from tests.loader.fuzz_counts import child_main; "
            "child_main(sys.argv[1], int(sys.argv[2]), json.loads(sys.stdin.readline()))")
    while todo:
        proc = subprocess.Popen([sys.executable, "-c", code, str(seed_dir), str(seed)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=str(REPO),
                                env=dict(os.environ, PYTHONPATH=str(REPO)), bufsize=1)
        proc.stdin.write(json.dumps(todo) + "\n")
        proc.stdin.close()
        hung, last, first = False, time.monotonic(), True  # the first answer waits for the child's start
        while todo:
            ready, _, _ = select.select([proc.stdout], [], [], 0.5)
            if not ready:
                if time.monotonic() - last > timeout + (120 if first else 0):
                    proc.kill()
                    hung = True
                    break
                continue
            line = proc.stdout.readline()
            if not line:
                break
            result = json.loads(line)
            last, first = time.monotonic(), False
            counts[result["outcome"]] += 1
            kinds[result["kind"]] += 1
            if result["outcome"] not in ("rows", "error"):
                findings.append(result)
            todo.remove(result["case"])
        code_ = proc.wait()
        if todo and (hung or code_ != 0):  # the child died or hung on todo[0]
            lost = todo.pop(0)
            outcome = "hang" if hung else "crash" if code_ < 0 else "harness"
            counts[outcome] += 1
            findings.append({"case": lost, "kind": case_plan(seed, lost)[0], "outcome": outcome,
                             "detail": f"return code {code_}"})
        elif todo:
            raise RuntimeError(f"the fuzz child ended with cases left: {todo[:5]}")
    return {"counts": dict(counts), "kinds": dict(kinds), "findings": findings}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=500, help="mutations to run (default 500)")
    p.add_argument("--seed", type=int, default=0, help="the run's seed: cases are a function of (seed, case)")
    p.add_argument("--replay", type=int, help="run this one case in this process and print its result")
    args = p.parse_args(argv)
    seed_dir = build(Path(tempfile.mkdtemp(prefix="fuzz-counts-seed-")))
    if args.replay is not None:
        work = Path(tempfile.mkdtemp(prefix="fuzz-counts-"))
        os.environ.setdefault("LOADER_INDEX_DIR", str(work / "index"))
        print(json.dumps(Child(seed_dir, work).run(args.seed, args.replay)))
        return 0
    started = time.monotonic()
    report = run(range(args.cases), seed=args.seed, seed_dir=seed_dir)
    report["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(report, indent=1))
    return 1 if report["findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
