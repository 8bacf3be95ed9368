#!/usr/bin/env bash
# Feeding a GPU (docs/feeding-accelerators.md): ResNet-50, bf16, 224, batch 256, strategy=mirrored, on ImageNet-like
# JPEG photos (~60 KB), images/s and data-wait per 50-step period for
#   held       in_memory_batches=8: batches held on the device, the GPU's bound
#   auto       data_workers=auto (the default on a GPU host), streamed from the loader
#   w15        data_workers=15, streamed
# and the loader alone, paced like that step (37.6 ms a batch of 256 on an H200), with auto and with 15 workers.
# Goal: streamed >= 0.97x held, data-wait < 2% in every 50-step period after the first.
# Two steps:
#   here (needs Beam): bash scripts/gpu/feed.sh prepare   -> .gpu/ (wheels, 500 photos converted: git ignores
#                      .gpu/; carry it)
#   there:             bash scripts/gpu/feed.sh           -> $OUT/feed.tgz after each run (~6 min)
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=scripts/gpu/common.sh
source scripts/gpu/common.sh
if [ "${1:-}" = prepare ]; then
  PY=${PY:-.venv/bin/python}
  wheels
  $PY -c "from pipelines.demo import write_photo_tfrecords; write_photo_tfrecords('.gpu/photos-in', 500, num_shards=4)"
  $PY -m pipelines convert --input ".gpu/photos-in/photos-train.*" --output .gpu/photos
  rm -rf .gpu/photos-in
  exit 0
fi
OUT=${OUT:-/tmp/feed} ARCHIVE=feed LIMIT=${LIMIT:-150}
on_the_host "$OUT"
common="data=.gpu/photos model=resnet50 image_size=224 batch_size=256 dtype=bfloat16 strategy=mirrored
        num_classes=1000 image_key=image/encoded label_key=image/class/label log_every=50 checkpoint_every=100000"
run held in_memory_batches=8 steps=300
run auto data_workers=auto steps=500
run w15 data_workers=15 steps=500
for workers in auto 15; do
  timeout 120 python3 -m loader bench .gpu/photos --batch_size 256 --step-time 0.0376 --workers $workers \
    --map images:224 --start 100 --batches 800 > "$LOGS/bench_$workers.log" 2>&1 || echo "bench $workers: exit $?" >> "$LOGS/gpu.txt"
  sed "s/^/bench $workers: /" "$LOGS/bench_$workers.log" | grep -v Warn | head -8
  pack feed
done
