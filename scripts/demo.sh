#!/usr/bin/env bash
# The main job, end to end on a small real dataset (scikit-learn's digits), offline:
#   1. write digits as custom TFRecord shards, and build it as a TFDS dataset (TFRecord);
#   2. convert both to ArrayRecord with the Beam pipeline (DirectRunner, both cores);
#   3. re-run the conversion (incremental: nothing to do), verify record by record;
#   4. load globally shuffled batches with the loader, checkpoint its state and resume exactly.
# Output goes to ./demo_out (or $DEMO_OUT).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh
OUT=${DEMO_OUT:-demo_out}
PY=.venv/bin/python
rm -rf "$OUT"
echo "==> 1/5 writing the digits dataset as TFRecord shards and as a TFDS dataset"
$PY -m pipelines make-demo --output "$OUT/tfrecord" --num-shards 4
.venv/bin/tfds build pipelines/datasets/digits --data_dir "$OUT/tfds" --file_format=tfrecord --num_shards 4 \
  >"$OUT/tfds-build.log" 2>&1 || { cat "$OUT/tfds-build.log"; exit 1; }
echo "==> 2/5 converting to ArrayRecord"
for split in train test; do
  $PY -m pipelines convert --input "$OUT/tfrecord/digits-$split.tfrecord-*" --output "$OUT/array_record/custom/$split"
done
$PY -m pipelines convert --input "$OUT/tfds/digits/1.0.0" --output "$OUT/array_record/tfds/digits/1.0.0"
echo "==> 3/5 re-running: only new or changed shards are converted"
$PY -m pipelines convert --input "$OUT/tfrecord/digits-train.tfrecord-*" --output "$OUT/array_record/custom/train"
echo "==> 4/5 verifying every record against its source, and reading the TFDS output with tfds"
$PY -m pipelines verify --deep --output "$OUT/array_record/custom/train"
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
echo "==> 5/5 loading: globally shuffled batches, checkpointed and resumed"
$PY -m loader inspect "$OUT/array_record/custom/train"
$PY - "$OUT/array_record/custom/train" <<'PYEOF'
import json, sys
import loader
batches = loader.load(sys.argv[1], batch_size=32, seed=0)
it = iter(batches)
first = [next(it) for _ in range(3)]
state = json.dumps(it.get_state())
expected = [next(it)["label"].tolist() for _ in range(2)]
resumed = iter(loader.load(sys.argv[1], batch_size=32, seed=0))
resumed.set_state(json.loads(state))
assert [next(resumed)["label"].tolist() for _ in range(2)] == expected
print(f"first batch: image {first[0]['image'].shape}, labels {first[0]['label'][:12].tolist()} ...")
print(f"saved state {state}; resumed with identical batches")
PYEOF
echo "done: converted datasets are in $OUT/array_record"
