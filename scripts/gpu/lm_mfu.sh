#!/usr/bin/env bash
# Where the LM of lm_attention.sh (width 1024, depth 8, seq 1024, bf16, packed, streamed, attention=auto) spends a
# step on a GPU host, and what moves its MFU:
#   profile     batch 64 with the defaults: the trainer's log (remat=auto's choice too) and a device profile of 5
#               steps (profile_steps=), summarised by python -m trainer.profile_report (profile.txt); the trace comes
#               back as profile.tgz
#   defaults    batch 64 with the defaults (remat=auto: none where it fits; use_iota_embed=auto: one-hot tables)
#   before      remat=elementwise use_iota_embed=false: the defaults before they changed
#   no_triton   the defaults with XLA_FLAGS=--xla_gpu_enable_triton_gemm=false (cuBLAS for every matrix multiply)
#   fused_qkv   a copy of the trainer whose query, key and value projections are one matrix multiply of their three
#               kernels side by side (the parameters unchanged)
#   b256        batch 256 with the defaults
#   llama       batch 64 in Llama's layout: 4 key/value heads (grouped-query attention through cuDNN), SwiGLU of 2,816,
#               RMSNorm, rope (92M parameters)
# Prepare as lm_attention.sh does (bash scripts/gpu/lm_attention.sh prepare), then there:
#   bash scripts/gpu/lm_mfu.sh  -> $OUT/lm_mfu.tgz after each run (~6 min; each run starts in ~30 s; the most telling
#   first, so a run cut short by the host's time still returns them)
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=scripts/gpu/common.sh
source scripts/gpu/common.sh
OUT=${OUT:-/tmp/lm_mfu} ARCHIVE=lm_mfu LIMIT=${LIMIT:-120}
on_the_host "$OUT"
common="data=$PWD/.gpu/lm_tok task=lm model=transformer_lm packing=true seq_len=1024 width=1024 depth=8 heads=16
        dtype=bfloat16 log_every=25 checkpoint_every=100000"

variant() {  # variant DIR CHANGE...: a copy of this trainer in DIR with trainer/models.py changed (fused_qkv)
  local dir=$1
  shift
  rm -rf "$dir" && mkdir "$dir" && cp -r trainer "$dir/" && ln -s "$PWD/loader" "$PWD/dataset_format" "$dir/"
  python3 - "$dir/trainer/models.py" "$@" <<'PY'
import sys
path, changes = sys.argv[1], sys.argv[2:]
s = open(path).read()
edits = {
    "fused_qkv": [  # the query, key and value projections as one matrix multiply of the three kernels side by side
        ("        return self.query(x), self.key(x), self.value(x)\n",
         "        if self.is_initializing():\n"
         "            return self.query(x), self.key(x), self.value(x)\n"
         "        ps = [m.variables['params'] for m in (self.query, self.key, self.value)]\n"
         "        kernel = jnp.concatenate([p['kernel'] for p in ps], axis=1).astype(x.dtype)\n"
         "        bias = jnp.concatenate([p['bias'] for p in ps], axis=0).astype(x.dtype)\n"
         "        y = jnp.einsum('bsd,dhk->bshk', x, kernel) + bias\n"
         "        q, k = ps[0]['kernel'].shape[1], ps[1]['kernel'].shape[1]\n"
         "        return y[:, :, :q], y[:, :, q:q + k], y[:, :, q + k:]\n")],
}
for change in changes:
    for old, new in edits[change]:
        assert s.count(old) == 1, (change, old)
        s = s.replace(old, new)
open(path, "w").write(s)
print(path, "changed:", *changes)
PY
}

run profile batch_size=64 steps=50 profile_steps=5 profile_skip=20
python3 -m trainer.profile_report /tmp/lm_mfu_profile/profile --top 40 > "$LOGS/profile.txt" 2>&1 || true
head -30 "$LOGS/profile.txt"
tar czf "$OUT/profile.tgz" -C /tmp/lm_mfu_profile profile && pack lm_mfu
run defaults batch_size=64 steps=75
run before batch_size=64 steps=75 remat=elementwise use_iota_embed=false
XLA_FLAGS=--xla_gpu_enable_triton_gemm=false run no_triton batch_size=64 steps=75
variant /tmp/exp_fused fused_qkv >> "$LOGS/gpu.txt"
run fused_qkv /tmp/exp_fused batch_size=64 steps=75
run b256 batch_size=256 steps=50
run llama batch_size=64 steps=50 num_kv_heads=4 mlp_dim=2816 mlp_activations=silu,linear normalization=rmsnorm \
    position_embedding=rope
