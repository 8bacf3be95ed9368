#!/usr/bin/env bash
# The LM of docs/training.md's "Device memory: attention and remat" (width 1024, depth 8, heads 16, seq_len 1024,
# bf16, packed, a pre-tokenized corpus with a BPE of 1,024) on a GPU host: tokens/s and MFU for
#   anchor     the trainer of 5c575e8 (flax's attention, [B, H, S, S]), batches held on the device (its log has
#              ex/s: x 1024 for tokens/s)
#   dense      attention=dense, batches held on the device
#   in_memory  attention=auto, batches held on the device
#   streamed   attention=auto, batches streamed from the loader, default memory fraction
#   blockwise  attention=blockwise, streamed (the fallback where cuDNN does not run)
#   b256       attention=auto, streamed, batch_size=256
# Two steps:
#   here (needs Beam): bash scripts/gpu/lm_attention.sh prepare   -> .gpu/ (wheels, the corpus; add .gpu/ to
#                      .git/info/exclude and carry it)
#   there:             bash scripts/gpu/lm_attention.sh            -> $OUT/lm_attention.tgz after each run (~8 min)
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=scripts/gpu/common.sh
source scripts/gpu/common.sh
if [ "${1:-}" = prepare ]; then
  PY=${PY:-.venv/bin/python}
  wheels
  $PY -m pipelines make-demo --kind text --output .gpu/text
  $PY -m pipelines convert --input ".gpu/text/text-train.*" --output .gpu/text/train
  $PY -m trainer.tokenizer .gpu/text/train --kind bpe --vocab_size 1024 --output .gpu/tokenizer.json
  $PY -m pipelines convert --input ".gpu/text/text-train.*" --output .gpu/lm_tok --tokenizer .gpu/tokenizer.json \
    --text-key text --add-eos
  rm -rf .gpu/text .gpu/prev && mkdir -p .gpu/prev && git archive 5c575e8 trainer | tar -x -C .gpu/prev
  exit 0
fi
OUT=${OUT:-/tmp/lm_attention}
on_the_host "$OUT"
common="data=.gpu/lm_tok task=lm model=transformer_lm packing=true seq_len=1024 width=1024 depth=8 heads=16
        dtype=bfloat16 steps=${STEPS:-150} log_every=50 checkpoint_every=100000"
run() {
  name=$1; shift
  # shellcheck disable=SC2086
  timeout "${LIMIT:-180}" python3 -m trainer $common workdir="/tmp/lm_$name" "$@" > "$OUT/$name.log" 2>&1 \
    || echo "$name: exit $?" >> "$OUT/gpu.txt"
  grep -E "attention:|step compiled|MFU|step [0-9]+/|error|Out of memory" "$OUT/$name.log" | sed "s/^/$name: /" || true
  tar czf "$OUT/lm_attention.tgz" -C "$OUT" --exclude lm_attention.tgz .
}
PYTHONPATH=$PWD/.gpu/prev:$PYTHONPATH run anchor batch_size=64 in_memory_batches=8
run dense batch_size=64 in_memory_batches=8 attention=dense
run in_memory batch_size=64 in_memory_batches=8
run streamed batch_size=64
run blockwise batch_size=64 attention=blockwise
run b256 batch_size=256
