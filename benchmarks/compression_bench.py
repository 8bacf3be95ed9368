"""Compression benchmark: the converter's default (snappy) against zstd:3 (array_record's and TFDS's default).

    .venv/bin/python benchmarks/compression_bench.py                 # 30,000 records of each kind
    .venv/bin/python benchmarks/compression_bench.py --records 5000  # quicker

ArrayRecord files for training are written with group_size:1 (one record per chunk) so that any record
can be read alone; every random read then decompresses one small chunk. This writes the same records
with each compression and reads them back in a random order, in batched `read(indices)` calls with the
loader's reader options, in this one run. Reported per kind of record: file size / record bytes, records/s
and CPU microseconds per record (all threads), and the ratios snappy / zstd:3 (size, read speed).
Record kinds: 1 KB of 6-bit random bytes (the loader benchmark's records), the digits demo's Examples,
text-like Examples (words from a 3,000-word vocabulary), and 4 KB of random bytes (like JPEG/PNG).
Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

COMPRESSIONS = ("uncompressed", "snappy", "zstd:1", "zstd:3")


def record_kinds(rng: np.random.Generator) -> dict:
    from dataset_format.example_proto import encode_example

    words = [bytes(rng.integers(97, 123, int(k), dtype=np.uint8)) for k in rng.integers(2, 9, 3000)]
    return {
        "1 KB, 6-bit random": lambda i: encode_example(
            {"data": rng.integers(32, 96, 1000, dtype=np.uint8).tobytes(), "label": i}),
        "digits Example": lambda i: encode_example({"image": rng.integers(0, 17, 64) * 15, "label": i % 10}),
        "text Example": lambda i: encode_example(
            {"text": b" ".join(words[j] for j in rng.integers(0, 3000, 150)), "label": i % 2}),
        "4 KB random (JPEG-like)": lambda i: encode_example({"jpeg": rng.bytes(4000), "label": i}),
    }


def measure(path: str, records: list[bytes], compression: str, order: np.ndarray) -> dict:
    from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

    RANDOM_ACCESS = "readahead_buffer_size:0,max_parallelism:0"  # ArrayRecord's reader for random reads

    writer = ArrayRecordWriter(path, f"group_size:1,{compression}")
    for record in records:
        writer.write(record)
    writer.close()
    reader = ArrayRecordReader(path, RANDOM_ACCESS)
    wall, cpu = time.perf_counter(), time.process_time()
    for start in range(0, len(order), 4096):
        reader.read(order[start:start + 4096].tolist())
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    reader.close()
    size = os.path.getsize(path)
    os.remove(path)
    return {"size": size / sum(map(len, records)), "records_per_s": len(records) / wall,
            "cpu_us": cpu / len(records) * 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=30_000)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    work = tempfile.mkdtemp(prefix="compression-bench-")
    print(f"{'records':24s} {'compression':13s} {'size':>6s} {'records/s':>10s} {'CPU us/rec':>10s}")
    for kind, make in record_kinds(rng).items():
        records = [make(i) for i in range(args.records)]
        order = rng.permutation(args.records)
        results = {c: measure(os.path.join(work, "bench.array_record"), records, c, order) for c in COMPRESSIONS}
        for c, r in results.items():
            print(f"{kind:24s} {c:13s} {r['size']:5.2f}x {r['records_per_s']:10,.0f} {r['cpu_us']:10.2f}")
        snappy, zstd = results["snappy"], results["zstd:3"]
        print(f"{kind:24s} snappy / zstd:3: size {snappy['size'] / zstd['size']:.2f}x, read speed "
              f"{snappy['records_per_s'] / zstd['records_per_s']:.2f}x", flush=True)
    os.rmdir(work)


if __name__ == "__main__":
    main()
