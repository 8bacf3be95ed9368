"""Conversion benchmark: our pipeline against array_record's Beam pipeline, tfds convert_format and a bare loop.

    .venv/bin/python benchmarks/convert_bench.py                      # 16 shards x 25,000 x 1 KB (~400 MB)
    .venv/bin/python benchmarks/convert_bench.py --shards 4 --records 5000 --skip-tfds   # quick

Builds one synthetic dataset laid out as a TFDS directory (`synthetic-train.tfrecord-XXXXX-of-YYYYY`,
`dataset_info.json`, `features.json`), so every contender converts the same files, then runs each as
its own process, one after the other, in this one run:

- ours: `python -m pipelines convert` on the glob (default local settings: a worker process per core),
  and on the TFDS directory;
- array_record's own `convert_tf_to_arrayrecord_disk(num_shards=N)` (its `..._match_shards` sibling no
  longer builds on Beam >= 2.67), once with Beam's defaults and once with the same worker processes as ours;
  the faster of the two is the anchor;
- `tfds convert_format --out_file_format array_record` on the TFDS directory;
- a bare single-process loop: our TFRecord framing reader feeding ArrayRecordWriter, nothing else.

Each is timed end to end (interpreter start included) with the peak RSS summed over its process tree.
All write `group_size:1` with zstd:3 (array_record's and TFDS's default; ours is told to, its own default
being snappy). Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
NAME = "synthetic"


def build_dataset(root: Path, shards: int, records: int, size: int) -> Path:
    """A TFDS-style directory of TFRecord shards holding tf.train.Examples with one bytes feature."""
    from dataset_format import example_proto
    from pipelines import tfrecord

    version_dir = root / NAME / "1.0.0"
    version_dir.mkdir(parents=True)
    rng = np.random.default_rng(0)
    payload = size - 16  # the Example wrapping adds ~16 bytes
    for shard in range(shards):
        # Bytes drawn from 64 values: compressible about like text, not like zeros.
        block = rng.integers(0, 64, size=(records, payload), dtype=np.uint8) + 32
        with open(version_dir / f"{NAME}-train.tfrecord-{shard:05d}-of-{shards:05d}", "wb") as f:
            tfrecord.write_records(f, (example_proto.encode_example({"data": row.tobytes()}) for row in block))
    info = {
        "name": NAME, "version": "1.0.0", "fileFormat": "tfrecord", "moduleName": "benchmarks.convert_bench",
        "splits": [{"name": "train", "shardLengths": [str(records)] * shards,
                    "numBytes": str(sum(p.stat().st_size for p in version_dir.iterdir())),
                    "filepathTemplate": "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}"}],
    }
    (version_dir / "dataset_info.json").write_text(json.dumps(info, indent=1))
    (version_dir / "features.json").write_text(json.dumps({
        "pythonClassName": "tensorflow_datasets.core.features.features_dict.FeaturesDict",
        "featuresDict": {"features": {"data": {
            "pythonClassName": "tensorflow_datasets.core.features.tensor_feature.Tensor",
            "tensor": {"shape": {}, "dtype": "string", "encoding": "none"}}}}}))
    return version_dir


def measure(label: str, cmd: list[str], env: dict | None = None) -> dict:
    """Runs `cmd`, polling its process tree's RSS; returns wall seconds and peak RSS in MB."""
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    root = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            tree = [root] + root.children(recursive=True)
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.05)
    seconds = time.monotonic() - started
    output = proc.stdout.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{label} failed (exit {proc.returncode}):\n{output[-3000:]}")
    print(f"  {label}: {seconds:.1f} s, peak RSS {peak / 2**20:,.0f} MB", flush=True)
    return {"label": label, "seconds": seconds, "peak_rss_mb": peak / 2**20}


def count_records(paths: list[Path]) -> int:
    from array_record.python.array_record_module import ArrayRecordReader

    total = 0
    for p in paths:
        r = ArrayRecordReader(str(p))
        total += r.num_records()
        r.close()
    return total


_ANCHOR = """
import sys
from apache_beam.options.pipeline_options import PipelineOptions
sys.argv = sys.argv[:1]  # array_record.beam.pipelines parses sys.argv when imported
from array_record.beam import pipelines
inp, out, n, extra = sys.argv_saved[1], sys.argv_saved[2], int(sys.argv_saved[3]), sys.argv_saved[4:]
pipelines.convert_tf_to_arrayrecord_disk(num_shards=n, args={"input": inp, "output": out},
                                         pipeline_options=PipelineOptions(extra)).run().wait_until_finish()
"""

_BARE = """
import glob, sys
from array_record.python.array_record_module import ArrayRecordWriter
from dataset_format.naming import output_name
from pipelines import tfrecord
inp, out = sys.argv[1], sys.argv[2]
for path in sorted(glob.glob(inp)):
    writer = ArrayRecordWriter(out + "/" + output_name(path), "group_size:1,zstd:3")
    with open(path, "rb", buffering=1 << 20) as f:
        for record in tfrecord.iter_records(f, path=path):
            writer.write(record)
    writer.close()
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--records", type=int, default=25_000, help="records per shard")
    p.add_argument("--size", type=int, default=1000, help="bytes per record")
    p.add_argument("--skip-tfds", action="store_true", help="skip tfds convert_format (~5k records/s)")
    p.add_argument("--workdir", default=None, help="where to build the data (default: a temp dir, removed)")
    args = p.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="convert-bench-"))
    total = args.shards * args.records
    print(f"building {args.shards} shards x {args.records:,} records x {args.size} B in {work} ...", flush=True)
    src = build_dataset(work / "in", args.shards, args.records, args.size)
    glob_pattern = str(src / f"{NAME}-train.tfrecord-*")
    megabytes = sum(p.stat().st_size for p in src.glob(f"{NAME}-train.tfrecord-*")) / 1e6
    print(f"input: {total:,} records, {megabytes:,.0f} MB; machine: {os.cpu_count()} cores\n", flush=True)

    runs = []
    out = work / "ours"
    runs.append(measure("ours (glob)", [PY, "-m", "pipelines", "convert", "--input", glob_pattern, "--output", str(out),
                                        "--compression", "zstd:3"]))
    assert count_records(sorted(out.glob("*.array_record-*"))) == total
    out = work / "ours-tfds"
    runs.append(measure("ours (TFDS dir)", [PY, "-m", "pipelines", "convert", "--input", str(src), "--output", str(out),
                                        "--compression", "zstd:3"]))
    assert count_records(sorted(out.glob("*.array_record-*"))) == total

    anchors = []
    for label, extra in (("array_record pipeline, Beam defaults", []),
                         ("array_record pipeline, 2 worker processes",
                          [f"--direct_num_workers={os.cpu_count()}", "--direct_running_mode=multi_processing"])):
        out = work / label.split(",")[1].strip().replace(" ", "-")
        out.mkdir()
        code = "import sys; sys.argv_saved = list(sys.argv)\n" + _ANCHOR
        anchors.append(measure(label, [PY, "-c", code, glob_pattern, str(out / "part"), str(args.shards), *extra]))
        assert count_records(sorted(out.glob("part*"))) == total
        runs.append(anchors[-1])

    out = work / "bare"
    out.mkdir()
    runs.append(measure("bare loop (1 process)", [PY, "-c", _BARE, glob_pattern, str(out)]))
    bare = runs[-1]
    assert count_records(sorted(out.glob("*"))) == total

    if not args.skip_tfds:
        copy = work / "tfds-copy" / NAME / "1.0.0"
        shutil.copytree(src, copy)
        runs.append(measure("tfds convert_format", [str(Path(PY).with_name("tfds")), "convert_format",
                                                    "--dataset_version_dir", str(copy),
                                                    "--out_file_format", "array_record"]))
        assert count_records(sorted(copy.glob("*.array_record-*"))) == total

    print(f"\n{'contender':45s} {'records/s':>11s} {'MB/s':>7s} {'peak RSS MB':>12s}")
    for r in runs:
        print(f"{r['label']:45s} {total / r['seconds']:>11,.0f} {megabytes / r['seconds']:>7,.1f} {r['peak_rss_mb']:>12,.0f}")
    ours = runs[0]
    anchor = min(anchors, key=lambda r: r["seconds"])
    print(f"\nours / array_record pipeline ({anchor['label'].split(', ')[1]}): "
          f"{anchor['seconds'] / ours['seconds']:.2f}x throughput, peak RSS {ours['peak_rss_mb'] / anchor['peak_rss_mb']:.2f}x")
    print(f"ours / bare loop: {bare['seconds'] / ours['seconds']:.2f}x throughput, "
          f"peak RSS {ours['peak_rss_mb'] / bare['peak_rss_mb']:.2f}x")
    if not args.skip_tfds:
        tfds_run = runs[-1]
        print(f"ours (TFDS dir) / tfds convert_format: {tfds_run['seconds'] / runs[1]['seconds']:.2f}x throughput")
    if not args.workdir:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
