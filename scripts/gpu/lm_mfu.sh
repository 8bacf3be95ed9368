#!/usr/bin/env bash
# Where the LM of lm_attention.sh (width 1024, depth 8, seq 1024, bf16, packed, streamed, attention=auto) spends a
# step on a GPU host, and what moves its MFU:
#   profile     batch 64: the trainer's log (its initialisation time too) and a device profile of 5 steps
#               (profile_steps=), summarised by python -m trainer.profile_report; the trace comes back as profile.tgz
#   no_triton   the same with XLA_FLAGS=--xla_gpu_enable_triton_gemm=false (cuBLAS for every matrix multiply)
#   keep_elem   a copy of the trainer whose blocks keep their LayerNorm and GELU outputs for the backward pass
#               instead of recomputing them (more memory, fewer elementwise passes)
#   b256        batch 256
#   combined    batch 256 with both of the above (no Triton GEMMs, LayerNorm and GELU outputs kept)
# Prepare as lm_attention.sh does (bash scripts/gpu/lm_attention.sh prepare), then there:
#   bash scripts/gpu/lm_mfu.sh  -> $OUT/lm_mfu.tgz after each run (~5 min; each run starts in ~30 s)
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=scripts/gpu/common.sh
source scripts/gpu/common.sh
OUT=${OUT:-/tmp/lm_mfu} ARCHIVE=lm_mfu LIMIT=${LIMIT:-120}
on_the_host "$OUT"
common="data=$PWD/.gpu/lm_tok task=lm model=transformer_lm packing=true seq_len=1024 width=1024 depth=8 heads=16
        dtype=bfloat16 log_every=25 checkpoint_every=100000"
run profile batch_size=64 steps=50 profile_steps=5 profile_skip=20
python3 -m trainer.profile_report /tmp/lm_mfu_profile/profile --top 40 > "$OUT/profile.txt" 2>&1 || true
head -30 "$OUT/profile.txt"
tar czf "$OUT/profile.tgz" -C /tmp/lm_mfu_profile profile && pack lm_mfu
XLA_FLAGS=--xla_gpu_enable_triton_gemm=false run no_triton batch_size=64 steps=75
# the variant: each block's LayerNorms and MLP as plain calls (no inner nn.remat)
rm -rf /tmp/exp && mkdir /tmp/exp && cp -r trainer /tmp/exp/ && ln -s "$PWD/loader" "$PWD/dataset_format" /tmp/exp/
python3 - <<'PY'
p = "/tmp/exp/trainer/models.py"
s = open(p).read()
s = s.replace("q, k, v = nn.remat(_normed_projections, policy=jax.checkpoint_policies.save_only_these_names(\n"
              "            *attention_names))(self, x)", "q, k, v = _normed_projections(self, x)")
s = s.replace('mlp = nn.remat(_normed_mlp, policy=jax.checkpoint_policies.save_only_these_names("mlpwi"))',
              "mlp = _normed_mlp")
assert "nn.remat(_normed" not in s
open(p, "w").write(s)
PY
grep -n "_normed_projections(self, x)\|mlp = _normed_mlp" /tmp/exp/trainer/models.py >> "$OUT/gpu.txt"
run keep_elem /tmp/exp batch_size=64 steps=75
run b256 batch_size=256 steps=50
XLA_FLAGS=--xla_gpu_enable_triton_gemm=false run combined /tmp/exp batch_size=256 steps=50
