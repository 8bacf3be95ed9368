#!/usr/bin/env bash
# Where the LM of lm_attention.sh (width 1024, depth 8, seq 1024, bf16, packed, streamed, attention=auto) spends a
# step on a GPU host, and what moves its MFU:
#   profile     batch 64: the trainer's log (its initialisation time too) and a device profile of 5 steps
#               (profile_steps=), summarised by python -m trainer.profile_report; the trace comes back as profile.tgz
#   no_triton   the same with XLA_FLAGS=--xla_gpu_enable_triton_gemm=false (cuBLAS for every matrix multiply)
#   keep_elem   a copy of the trainer whose blocks keep their LayerNorm and GELU outputs for the backward pass
#               instead of recomputing them (more memory, fewer elementwise passes)
#   iota        use_iota_embed=true: the token and position embeddings as one-hot matrix multiplies (MaxText's
#               name; the backward pass is a matrix multiply, not a scatter-add of 65,536 rows into 1,024)
#   fused_qkv   a copy whose query, key and value projections are one matrix multiply of their three kernels side by
#               side (the parameters unchanged)
#   cublaslt    no_triton with XLA_FLAGS=--xla_gpu_enable_cublaslt=true (cuBLASLt, whose epilogues take bias and GELU)
#   combined64  batch 64 with no_triton, keep_elem, fused_qkv and iota (the must-show configuration's best guess)
#   combined    the same at batch 256
#   b256        batch 256
#   llama       batch 64 in Llama's layout: 4 key/value heads (grouped-query attention through cuDNN), SwiGLU of 2,816,
#               RMSNorm, rope (92M parameters)
# Prepare as lm_attention.sh does (bash scripts/gpu/lm_attention.sh prepare), then there:
#   bash scripts/gpu/lm_mfu.sh  -> $OUT/lm_mfu.tgz after each run (~8 min; each run starts in ~30 s; the most telling
#   first, so a run cut short by the host's time still returns them)
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=scripts/gpu/common.sh
source scripts/gpu/common.sh
OUT=${OUT:-/tmp/lm_mfu} ARCHIVE=lm_mfu LIMIT=${LIMIT:-120}
on_the_host "$OUT"
common="data=$PWD/.gpu/lm_tok task=lm model=transformer_lm packing=true seq_len=1024 width=1024 depth=8 heads=16
        dtype=bfloat16 log_every=25 checkpoint_every=100000"

variant() {  # variant DIR CHANGE...: a copy of this trainer in DIR with trainer/models.py changed (keep_elem)
  local dir=$1
  shift
  rm -rf "$dir" && mkdir "$dir" && cp -r trainer "$dir/" && ln -s "$PWD/loader" "$PWD/dataset_format" "$dir/"
  python3 - "$dir/trainer/models.py" "$@" <<'PY'
import sys
path, changes = sys.argv[1], sys.argv[2:]
s = open(path).read()
edits = {
    "keep_elem": [  # each block's LayerNorms and MLP as plain calls (no inner nn.remat)
        ("q, k, v = nn.remat(_normed_projections, policy=jax.checkpoint_policies.save_only_these_names(\n"
         "            *attention_names))(self, x, positions)", "q, k, v = _normed_projections(self, x, positions)"),
        ('mlp = nn.remat(_normed_mlp, policy=jax.checkpoint_policies.save_only_these_names("mlpwi"))',
         "mlp = _normed_mlp")],
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
python3 -m trainer.profile_report /tmp/lm_mfu_profile/profile --top 40 > "$OUT/profile.txt" 2>&1 || true
head -30 "$OUT/profile.txt"
tar czf "$OUT/profile.tgz" -C /tmp/lm_mfu_profile profile && pack lm_mfu
variant /tmp/exp_keep keep_elem >> "$OUT/gpu.txt"
variant /tmp/exp_fused fused_qkv >> "$OUT/gpu.txt"
variant /tmp/exp_all keep_elem fused_qkv >> "$OUT/gpu.txt"
no_triton=--xla_gpu_enable_triton_gemm=false
XLA_FLAGS=$no_triton run combined64 /tmp/exp_all batch_size=64 steps=75 use_iota_embed=true
XLA_FLAGS=$no_triton run no_triton batch_size=64 steps=75
XLA_FLAGS="$no_triton --xla_gpu_enable_cublaslt=true" run cublaslt batch_size=64 steps=75
run keep_elem /tmp/exp_keep batch_size=64 steps=75
run fused_qkv /tmp/exp_fused batch_size=64 steps=75
run iota batch_size=64 steps=75 use_iota_embed=true
XLA_FLAGS=$no_triton run combined /tmp/exp_all batch_size=256 steps=50 use_iota_embed=true
run llama batch_size=64 steps=50 num_kv_heads=4 mlp_dim=2816 mlp_activations=silu,linear normalization=rmsnorm \
    position_embedding=rope
run b256 batch_size=256 steps=50
