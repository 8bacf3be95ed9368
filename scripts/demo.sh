#!/usr/bin/env bash
# The main job, end to end on a small real dataset (scikit-learn's digits), offline:
#   1. write digits as custom TFRecord shards, and build it as a TFDS dataset (TFRecord);
#   2. convert both to ArrayRecord with the Beam pipeline (DirectRunner, both cores);
#   3. re-run the conversion (incremental: nothing to do), verify record by record;
#   4. load globally shuffled batches with the loader, checkpoint its state and resume exactly;
#   5. train a CNN with strategy=mirrored on all local devices (8 simulated CPU devices without an
#      accelerator) and report eval accuracy (>= 95% expected).
# Output goes to ./demo_out (or $DEMO_OUT).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh
OUT=${DEMO_OUT:-demo_out}
PY=.venv/bin/python
rm -rf "$OUT"
echo "==> 1/6 writing the digits dataset as TFRecord shards and as a TFDS dataset"
$PY -m pipelines make-demo --output "$OUT/tfrecord" --num-shards 4
.venv/bin/tfds build pipelines/datasets/digits --data_dir "$OUT/tfds" --file_format=tfrecord --num_shards 4 \
  >"$OUT/tfds-build.log" 2>&1 || { cat "$OUT/tfds-build.log"; exit 1; }
echo "==> 2/6 converting to ArrayRecord"
for split in train test; do
  $PY -m pipelines convert --input "$OUT/tfrecord/digits-$split.tfrecord-*" --output "$OUT/array_record/custom/$split"
done
$PY -m pipelines convert --input "$OUT/tfds/digits/1.0.0" --output "$OUT/array_record/tfds/digits/1.0.0"
echo "==> 3/6 re-running: only new or changed shards are converted"
$PY -m pipelines convert --input "$OUT/tfrecord/digits-train.tfrecord-*" --output "$OUT/array_record/custom/train"
echo "==> 4/6 verifying every record against its source, and reading the TFDS output with tfds"
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
echo "==> 5/6 loading: globally shuffled batches, checkpointed and resumed"
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
echo "==> 6/6 training: CNN, strategy=mirrored"
if $PY -c 'import jax, sys; sys.exit(jax.default_backend() != "cpu")' 2>/dev/null; then
  echo "no accelerator: mirrored over 8 simulated CPU devices"
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
else
  echo "accelerator found: mirrored over its devices"
fi
$PY -m trainer data="$OUT/array_record/custom/train" eval_data="$OUT/array_record/custom/test" model=cnn \
  num_classes=10 strategy=mirrored steps=600 batch_size=64 learning_rate=0.002 log_every=100 eval_every=200 checkpoint_every=200 \
  workdir="$OUT/train" > "$OUT/train-summary.json"
$PY - "$OUT" <<'PYEOF'
import json, sys
out = sys.argv[1]
summary = json.load(open(f"{out}/train-summary.json"))["summary"]
manifest = json.load(open(f"{out}/array_record/custom/train/manifest.json"))
print("\n=== report ===")
print(f"data:      {manifest['totals']['records']:,} train records in {manifest['totals']['shards']} ArrayRecord shards")
print(f"training:  {summary['final_step']} steps, final loss {summary['loss']:.4f}, "
      f"{summary['examples_per_sec']:,.0f} examples/s, data wait {100 * summary['data_wait_fraction']:.1f}%")
print(f"eval:      accuracy {summary['eval_accuracy']:.4f} on {summary['eval_examples']} test images")
print(f"converted: {out}/array_record/custom/{{train,test}} (from {out}/tfrecord), "
      f"{out}/array_record/tfds/digits/1.0.0 (from the TFDS build in {out}/tfds)")
print(f"artifacts: {out}/train (metrics.jsonl, tensorboard/, checkpoints/)")
if summary["eval_accuracy"] < 0.95:
    sys.exit(f"eval accuracy {summary['eval_accuracy']:.4f} is below 0.95")
PYEOF
echo "done"
