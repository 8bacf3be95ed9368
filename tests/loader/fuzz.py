"""Mutation fuzzing of the loader's ArrayRecord reading, through `loader.load`, in child processes.

Seed shards (zstd, snappy and uncompressed, records of 0 bytes to 3 MB) are mutated, one mutation a case: bit flips,
byte sets, truncations, appended garbage, swapped or repeated 64 KiB blocks, and forged chunks and footers (fields
changed with riegeli's hashes recomputed, as anyone can). Each case loads the mutated shard with `check_hashes` on or
off and is judged:

- crash: the child died of a signal;         - hang: no answer within the case timeout;
- harness: the child exited on an error of the fuzzer itself (a bug to fix here);
- memory: its peak RSS grew by over 1 GB;     - unnamed: an error that is not ValueError/OSError naming the shard;
- wrong: with hashes on, records that differ from the seed's (forged cases exempt: a forged chunk is a valid chunk).

Cases are a pure function of (seed, case number), so any finding replays alone:

    python -m tests.loader.fuzz --cases 20000 --jobs 2          # the long run (docs/robustness.md)
    python -m tests.loader.fuzz --replay 1234                   # one case, in this process
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
KINDS = ("flip", "set", "truncate", "append", "swap_blocks", "repeat_block", "forge_chunk", "forge_footer")
FORGED = {"forge_chunk", "forge_footer"}
CODECS = ("zstd:3", "snappy", "uncompressed")
BLOCK = 1 << 16
NAME = "fuzzed.array_record"
CASE_TIMEOUT = 30.0
MEMORY_LIMIT_KB = 1 << 20  # 1 GB of peak RSS growth


def seed_records(codec_index: int) -> list[bytes]:
    """Records of 0 B to 3 MB, half random bytes, half repetitive (long copies for the codecs)."""
    rng = np.random.default_rng(1000 + codec_index)
    sizes = [0, 1, 17, 100, 1000, 5000, 40_000, 70_000, 3 << 20] + rng.integers(0, 3000, 30).tolist()
    rng.shuffle(sizes)
    return [rng.bytes(n) if i % 2 else (b"%d-" % i * (n // 3 + 1))[:n] for i, n in enumerate(sizes)]


def write_seeds(directory: Path) -> None:
    from array_record.python.array_record_module import ArrayRecordWriter

    for i, codec in enumerate(CODECS):
        writer = ArrayRecordWriter(str(directory / f"seed-{i}.array_record"), f"group_size:1,{codec}")
        for r in seed_records(i):
            writer.write(r)
        writer.close()


# ---------------------------------------------------------------- mutations


def _pick(rng: np.random.Generator, options: list[int]) -> int:
    """One of `options` (rng.choice would turn integers past 2^63 into floats)."""
    return options[int(rng.integers(0, len(options)))]


def mutate(data: bytes, rng: np.random.Generator, kind: str, offsets: list[int], footer_offset: int) -> bytes:
    """One mutation of a shard's bytes. `offsets`: its chunks' offsets; `footer_offset`: where its footer starts."""
    from tests.loader import forge

    out = bytearray(data)
    n = len(out)
    if kind == "flip":
        for _ in range(int(rng.integers(1, 4))):
            bit = int(rng.integers(0, n * 8))
            out[bit // 8] ^= 1 << (bit % 8)
    elif kind == "set":
        at = int(rng.integers(0, n))
        length = int(rng.integers(1, 64))
        out[at:at + length] = bytes([int(_pick(rng, [0, 0xFF, int(rng.integers(0, 256))]))]) * len(out[at:at + length])
    elif kind == "truncate":
        cut = int(rng.integers(0, n // BLOCK)) * BLOCK if rng.random() < 0.5 else int(rng.integers(0, n))
        del out[cut:]
    elif kind == "append":
        out += rng.bytes(_pick(rng, [1, 100, BLOCK, 2 * BLOCK]))
    elif kind in ("swap_blocks", "repeat_block"):
        blocks = n // BLOCK
        a, b = (int(x) for x in rng.integers(0, blocks, 2))
        block_a, block_b = bytes(out[a * BLOCK:(a + 1) * BLOCK]), bytes(out[b * BLOCK:(b + 1) * BLOCK])
        out[b * BLOCK:(b + 1) * BLOCK] = block_a
        if kind == "swap_blocks":
            out[a * BLOCK:(a + 1) * BLOCK] = block_b
    elif kind == "forge_chunk":
        _forge_chunk(out, rng, offsets, forge)
    elif kind == "forge_footer":
        _forge_footer(out, rng, footer_offset, forge)
    return bytes(out)


def _forge_chunk(out: bytearray, rng, offsets: list[int], forge) -> None:
    """A record's chunk with one field changed and both hashes recomputed."""
    i = int(rng.integers(0, len(offsets)))
    at = offsets[i]
    header, body = forge.chunk_at(out, at)
    way = rng.integers(0, 7)
    num_records, decoded = header["num_records"], header["decoded_size"]
    data_size = None
    if way == 0:
        decoded = int(_pick(rng, [0, decoded + 1, max(0, decoded - 1), 1 << 40, (1 << 63) + 1, (1 << 64) - 1]))
    elif way == 1:
        num_records = int(_pick(rng, [0, 2, 255, (1 << 56) - 1]))
    elif way == 2:  # a chunk shorter than its span, or running past it
        data_size = int(_pick(rng, [0, max(0, len(body) - 1), len(body) + 1, len(body) + 100_000, (1 << 64) - 1]))
    elif way == 3:  # a sizes blob naming other sizes
        body = forge.simple_chunk([int(_pick(rng, [0, decoded + 1, 1 << 40, (1 << 64) - 1]))], body[3:])
    elif way == 4:  # another compression byte
        body = bytes([int(_pick(rng, [0, ord("b"), ord("s"), ord("z"), int(rng.integers(0, 256))]))]) + body[1:]
    elif way == 5:  # random data of the same length
        body = rng.bytes(len(body))
    else:  # the chunk type
        forge.put_chunk(out, at, body, num_records=num_records, decoded_size=decoded,
                        chunk_type=int(_pick(rng, [0, ord("p"), ord("t"), ord("s"), int(rng.integers(0, 256))])))
        return
    forge.put_chunk(out, at, body, num_records=num_records, decoded_size=decoded, data_size=data_size)


def _forge_footer(out: bytearray, rng, footer_offset: int, forge) -> None:
    """The footer re-encoded (uncompressed, which any file may use) with one change, hashes recomputed."""
    from loader.format import _riegeli

    raw = bytes(out[footer_offset:len(out) - BLOCK])
    sizes, values = _riegeli.decode_chunk(raw, footer_offset, True, len(raw))
    sizes = np.frombuffer(sizes, "<u8").tolist()
    entries = forge.footer_entries(values, sizes)
    way = rng.integers(0, 6)
    k = int(rng.integers(1, len(entries)))
    fields = forge.parse_entry(entries[k])
    if way == 0:  # a record count
        entries[k] = forge.entry(fields[1], fields[2], int(_pick(rng, [0, 2, 8, (1 << 63) + 1])))
    elif way == 1:  # a chunk offset
        entries[k] = forge.entry(int(_pick(rng, [0, 24, 63, fields[1] + 1, fields[1] - 1, footer_offset, 1 << 62,
                                                 len(out)])), fields[2], 1)
    elif way == 2:  # sizes that wrap around 2^64
        j = int(rng.integers(0, len(sizes) - 1))
        delta = int(_pick(rng, [1 << 40, 1 << 63, 1]))
        sizes[j] = (sizes[j] - delta) % (1 << 64)
        sizes[j + 1] = (sizes[j + 1] + delta) % (1 << 64)
    elif way == 3:  # an entry dropped or repeated
        if rng.random() < 0.5:
            del entries[k], sizes[k]
        else:
            entries.insert(k, entries[k])
            sizes.insert(k, sizes[k])
    elif way == 4:  # decoded sizes
        entries[k] = forge.entry(fields[1], int(_pick(rng, [0, 1 << 40, (1 << 64) - 1])), 1)
    else:  # two entries swapped
        j = int(rng.integers(1, len(entries)))
        entries[j], entries[k] = entries[k], entries[j]
    if way not in (2, 3):
        sizes = [len(e) for e in entries]
    body = forge.simple_chunk(sizes, b"".join(entries))
    if footer_offset + 40 + len(body) + 64 < len(out) - BLOCK:  # it fits before the postscript's block
        forge.put_chunk(out, footer_offset, body, num_records=len(sizes), decoded_size=len(b"".join(entries)))


# ---------------------------------------------------------------- a case, in the child


def case_plan(seed: int, case: int, kinds: tuple[str, ...] = KINDS) -> tuple[int, str, bool, np.random.Generator]:
    rng = np.random.default_rng([seed, case])
    return int(rng.integers(0, len(CODECS))), kinds[int(rng.integers(0, len(kinds)))], bool(rng.random() < 0.7), rng


class Child:
    """The child's side: seeds read once, one case at a time."""

    def __init__(self, seeds: Path, work: Path, kinds: tuple[str, ...] = KINDS):
        from loader.format.arrayrecord import read_footer

        self.seeds = [(seeds / f"seed-{i}.array_record").read_bytes() for i in range(len(CODECS))]
        self.records = [seed_records(i) for i in range(len(CODECS))]
        footers = [read_footer(str(seeds / f"seed-{i}.array_record"), len(d)) for i, d in enumerate(self.seeds)]
        self.offsets = [f.offsets.tolist() for f in footers]
        self.footer_offsets = [f.footer_offset for f in footers]
        self.work = work
        self.kinds = kinds
        self.baseline_kb = None

    def run(self, seed: int, case: int) -> dict:
        import loader

        codec, kind, check, rng = case_plan(seed, case, self.kinds)
        data = mutate(self.seeds[codec], rng, kind, self.offsets[codec], self.footer_offsets[codec])
        directory = self.work / f"case-{case}"
        directory.mkdir()
        path = directory / NAME
        path.write_bytes(data)
        result = {"case": case, "codec": CODECS[codec], "kind": kind, "check": check}
        try:
            batches = loader.load(str(directory / "*.array_record"), batch_size=5, shuffle=False, num_epochs=1,
                                  decode=None, drop_remainder=False, check_hashes=check)
            got = [r for b in batches for r in b]
            result["outcome"] = "records"
            if check and kind not in FORGED and got != self.records[codec]:
                result["outcome"] = "wrong"
                result["detail"] = f"{len(got)} records, {sum(a != b for a, b in zip(got, self.records[codec]))} differ"
        except Exception as e:  # noqa: BLE001 - judged: a named ValueError/OSError, or a finding
            result["outcome"], result["detail"] = error_outcome(e, (ValueError, OSError), NAME in str(e))
        finally:
            path.unlink()
            directory.rmdir()
            for index in Path(os.environ["LOADER_INDEX_DIR"]).glob("*"):
                index.unlink()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if self.baseline_kb is None:
            self.baseline_kb = peak
        if peak - self.baseline_kb > MEMORY_LIMIT_KB:
            result["outcome"] = "memory"
            result["detail"] = f"peak RSS grew by {(peak - self.baseline_kb) // 1024} MB"
        return result


def error_outcome(e: BaseException, expected: tuple[type, ...], named: bool) -> tuple[str, str]:
    """(outcome, detail) of a case that raised: "error" for an expected type naming the file, else "unnamed"."""
    return ("error" if isinstance(e, expected) and named else "unnamed"), f"{type(e).__name__}: {e}"[:300]


def child_main(seeds: str, seed: int, kinds: list[str], cases: list[int]) -> None:
    work = Path(tempfile.mkdtemp(prefix="fuzz-"))
    os.environ["LOADER_INDEX_DIR"] = str(work / "index")
    child = Child(Path(seeds), work, tuple(kinds))
    for case in cases:
        print(json.dumps({"begin": case}), flush=True)
        print(json.dumps(child.run(seed, case)), flush=True)


# ---------------------------------------------------------------- the parent


def run(cases: range, *, seed: int = 0, jobs: int = 1, kinds: tuple[str, ...] = KINDS, seeds_dir: Path | None = None,
        timeout: float = CASE_TIMEOUT, env: dict | None = None, progress=None) -> dict:
    """Runs `cases` in `jobs` child processes; returns {"counts": {outcome: n}, "findings": [case results]}.
    A child that dies or hangs is restarted after the case it was running."""
    own = seeds_dir is None
    seeds_dir = Path(tempfile.mkdtemp(prefix="fuzz-seeds-")) if own else seeds_dir
    if own:
        write_seeds(seeds_dir)
    todo = [list(cases)[j::jobs] for j in range(jobs)]
    counts: collections.Counter = collections.Counter()
    by_kind: collections.Counter = collections.Counter()
    findings: list[dict] = []
    running = [_Worker(seeds_dir, seed, kinds, todo[j], timeout, env) for j in range(jobs) if todo[j]]
    done = 0
    while running:
        for worker in list(running):
            for result in worker.poll():
                counts[result["outcome"]] += 1
                by_kind[result["kind"]] += 1
                done += 1
                if result["outcome"] not in ("records", "error"):
                    findings.append(result)
                if progress and done % 500 == 0:
                    progress(done, counts)
            if worker.finished:
                running.remove(worker)
    return {"counts": dict(counts), "kinds": dict(by_kind), "findings": findings}


class _Worker:
    def __init__(self, seeds_dir: Path, seed: int, kinds: tuple[str, ...], cases: list[int], timeout: float,
                 env: dict | None):
        self.seeds_dir, self.seed, self.kinds, self.cases, self.timeout = seeds_dir, seed, kinds, list(cases), timeout
        self.env = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
        self.proc = None
        self.current = None
        self.finished = not self.cases
        self._start()

    def _start(self) -> None:
        if not self.cases:
            self.finished = True
            return
        code = "import sys, json; from tests.loader.fuzz import child_main; child_main(sys.argv[1], int(sys.argv[2]), " \
               "*json.loads(sys.stdin.readline()))"
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(self.seeds_dir), str(self.seed)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=self.env, cwd=str(REPO), text=True, bufsize=1)
        self.proc.stdin.write(json.dumps([self.kinds, self.cases]) + "\n")  # (too many cases for a command line)
        self.proc.stdin.close()
        self.last = time.monotonic()
        self.current = None

    def poll(self) -> list[dict]:
        results = []
        ready, _, _ = select.select([self.proc.stdout], [], [], 0.05)
        if ready:
            line = self.proc.stdout.readline()
            if line:
                message = json.loads(line)
                self.last = time.monotonic()
                if "begin" in message:
                    self.current = message["begin"]
                else:
                    results.append(message)
                    self.cases.remove(message["case"])
                    self.current = None
                return results
            code = self.proc.wait()  # end of output: the child ended
            if self.current is not None:  # a signal (return code -N) is a crash; an exit, the harness's own error
                results.append(self._lost(f"return code {code}", "crash" if code < 0 else "harness"))
            if not self.cases or code == 0:
                self.finished = True
            else:
                self._start()
            return results
        if self.current is not None and time.monotonic() - self.last > self.timeout:
            self.proc.kill()
            self.proc.wait()
            results.append(self._lost(f"no answer in {self.timeout:.0f} s", "hang"))
            self._start()
        return results

    def _lost(self, detail: str, outcome: str) -> dict:
        codec, kind, check, _ = case_plan(self.seed, self.current, self.kinds)
        self.cases.remove(self.current)
        return {"case": self.current, "codec": CODECS[codec], "kind": kind, "check": check, "outcome": outcome,
                "detail": detail}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=2000, help="mutations to run (default 2000)")
    p.add_argument("--first", type=int, default=0, help="the first case number (default 0)")
    p.add_argument("--seed", type=int, default=0, help="the run's seed: cases are a function of (seed, case)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="child processes at once")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=KINDS, help="mutations to draw from (default: all)")
    p.add_argument("--replay", type=int, help="run this one case in this process and print its result")
    p.add_argument("--json", help="write the summary and findings here")
    args = p.parse_args(argv)
    if args.replay is not None:
        seeds = Path(tempfile.mkdtemp(prefix="fuzz-seeds-"))
        write_seeds(seeds)
        work = Path(tempfile.mkdtemp(prefix="fuzz-"))
        os.environ.setdefault("LOADER_INDEX_DIR", str(work / "index"))
        print(json.dumps(Child(seeds, work, tuple(args.kinds)).run(args.seed, args.replay)))
        return 0
    started = time.monotonic()

    def progress(done, counts):
        print(f"{done} cases in {time.monotonic() - started:.0f} s: {dict(counts)}", file=sys.stderr, flush=True)

    report = run(range(args.first, args.first + args.cases), seed=args.seed, jobs=args.jobs, kinds=tuple(args.kinds),
                 progress=progress)
    report["seconds"] = round(time.monotonic() - started, 1)
    text = json.dumps(report, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 1 if report["findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
