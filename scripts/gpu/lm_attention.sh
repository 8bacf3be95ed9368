#!/usr/bin/env bash
# The LM of docs/training.md's "Device memory: attention and remat" (width 1024, depth 8, heads 16, seq_len 1024,
# bf16, packed, a pre-tokenized corpus with a BPE of 1,024) on a GPU host: tokens/s and MFU for
#   anchor     the trainer (and loader) of 5c575e8 (flax's attention, [B, H, S, S]), batches held on the device
#              (its log has ex/s: x 1024 for tokens/s)
#   dense      attention=dense, batches held on the device
#   in_memory  attention=auto, batches held on the device
#   streamed   attention=auto, batches streamed from the loader, default memory fraction
#   blockwise  attention=blockwise, streamed (the fallback where cuDNN does not run)
#   b256       attention=auto, streamed, batch_size=256
# Two steps:
#   here (needs Beam): bash scripts/gpu/lm_attention.sh prepare   -> .gpu/ (wheels, the corpus: git ignores
#                      .gpu/; carry it)
#   there:             bash scripts/gpu/lm_attention.sh            -> $OUT/lm_attention.tgz after each run (~8 min)
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=scripts/gpu/common.sh
source scripts/gpu/common.sh
if [ "${1:-}" = prepare ]; then
  PY=${PY:-.venv/bin/python}
  wheels
  $PY -m pipelines make-demo --kind text --output .gpu/text
  $PY -m pipelines tokenizer --input ".gpu/text/text-train.*" --kind bpe --vocab_size 1024 --output .gpu/tokenizer.json
  $PY -m pipelines convert --input ".gpu/text/text-train.*" --output .gpu/lm_tok --tokenizer .gpu/tokenizer.json \
    --text-key text --add-eos
  # the anchor's project as it was (its trainer, and the loader that trainer imports), its C extensions built there
  rm -rf .gpu/text .gpu/prev && mkdir -p .gpu/prev
  git archive 5c575e8 trainer loader dataset_format setup.py pyproject.toml | tar -x -C .gpu/prev
  git rev-parse --short HEAD > .gpu/revision  # what gpu.txt names (write it again after a later commit)
  exit 0
fi
OUT=${OUT:-/tmp/lm_attention} ARCHIVE=lm_attention
on_the_host "$OUT"
common="data=$PWD/.gpu/lm_tok task=lm model=transformer_lm packing=true seq_len=1024 width=1024 depth=8 heads=16
        dtype=bfloat16 steps=${STEPS:-150} log_every=50 checkpoint_every=100000"
(cd .gpu/prev && python3 setup.py -q build_ext --inplace)
# the must-show runs first, so a run cut short by the host's time still returns them
[ -n "${SKIP_ANCHOR:-}" ] || run anchor .gpu/prev batch_size=64 in_memory_batches=8  # the anchor's own trainer and loader (its directory first)
run streamed batch_size=64
run b256 batch_size=256
run in_memory batch_size=64 in_memory_batches=8
run dense batch_size=64 in_memory_batches=8 attention=dense
run blockwise batch_size=64 attention=blockwise
