#!/usr/bin/env bash
# The main job, end to end on a small real dataset (scikit-learn's digits), offline:
#   1. write digits as custom TFRecord shards, and build it as a TFDS dataset (TFRecord);
#   2. convert both to ArrayRecord with the Beam pipeline (DirectRunner, both cores);
#   3. re-run the conversion (incremental: nothing to do), verify record by record, report.
# Output goes to ./demo_out (or $DEMO_OUT).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh
OUT=${DEMO_OUT:-demo_out}
PY=.venv/bin/python
rm -rf "$OUT"
echo "==> 1/4 writing the digits dataset as TFRecord shards and as a TFDS dataset"
$PY -m pipelines make-demo --output "$OUT/tfrecord" --num-shards 4
.venv/bin/tfds build pipelines/datasets/digits --data_dir "$OUT/tfds" --file_format=tfrecord --num_shards 4 \
  >"$OUT/tfds-build.log" 2>&1 || { cat "$OUT/tfds-build.log"; exit 1; }
echo "==> 2/4 converting to ArrayRecord"
$PY -m pipelines convert --input "$OUT/tfrecord/digits-*.tfrecord-*" --output "$OUT/array_record/custom"
$PY -m pipelines convert --input "$OUT/tfds/digits/1.0.0" --output "$OUT/array_record/tfds/digits/1.0.0"
echo "==> 3/4 re-running: only new or changed shards are converted"
$PY -m pipelines convert --input "$OUT/tfrecord/digits-*.tfrecord-*" --output "$OUT/array_record/custom"
echo "==> 4/4 verifying every record against its source, and reading the TFDS output with tfds"
$PY -m pipelines verify --deep --output "$OUT/array_record/custom"
$PY -m pipelines verify --deep --output "$OUT/array_record/tfds/digits/1.0.0"
$PY - "$OUT/array_record/tfds/digits/1.0.0" <<'PYEOF' 2>/dev/null
import sys
import tensorflow_datasets as tfds
builder = tfds.builder_from_directory(sys.argv[1])
for split in ("train", "test"):
    source = builder.as_data_source(split)
    print(f"tfds.builder_from_directory(...).as_data_source({split!r}): {len(source)} records; "
          f"first label {source[0]['label']}, image {source[0]['image'].shape}")
PYEOF
echo "done: converted datasets are in $OUT/array_record"
