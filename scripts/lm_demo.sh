#!/usr/bin/env bash
# The second demo: a byte-level language model on text that ships with Python (the standard library's sources):
#   1. write 4 MB of stdlib sources as TFRecord shards of tf.train.Example (`text`: passages of whole lines);
#   2. convert them to ArrayRecord with the Beam pipeline;
#   3. train a decoder-only Transformer (task=lm, model=transformer_lm) over all local devices;
#   4. report eval bits per byte beside the unigram entropy of the same bytes (the model must beat it clearly);
#   5. train a byte-level BPE tokenizer offline on the training text and the same LM over its tokens, packed
#      (tokenizer=tokenizer.json packing=true), and report its bits per byte too.
# Output goes to ./demo_out/lm (or $DEMO_OUT/lm). ~5 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh
OUT=${DEMO_OUT:-demo_out}/lm
PY=.venv/bin/python
rm -rf "$OUT"
echo "==> 1/4 writing the standard library's sources as TFRecord shards"
$PY -m pipelines make-demo --kind text --output "$OUT/tfrecord" --num-shards 4
echo "==> 2/4 converting to ArrayRecord"
for split in train test; do
  $PY -m pipelines convert --input "$OUT/tfrecord/text-$split.tfrecord-*" --output "$OUT/array_record/$split"
done
echo "==> 3/4 training a byte-level Transformer LM (task=lm, model=transformer_lm)"
export XLA_FLAGS="${XLA_FLAGS:---xla_force_host_platform_device_count=8}"
strategy=mirrored
$PY -m trainer data="$OUT/array_record/train" eval_data="$OUT/array_record/test" task=lm model=transformer_lm \
  seq_len=256 strategy=$strategy steps=300 batch_size=16 learning_rate=0.003 log_every=50 eval_every=150 \
  checkpoint_every=150 workdir="$OUT/train" > "$OUT/train-summary.json"
$PY - "$OUT" <<'PYEOF'
import json, sys
import loader
from pipelines.demo import unigram_bits_per_byte
out = sys.argv[1]
summary = json.load(open(f"{out}/train-summary.json"))["summary"]
test = loader.load(f"{out}/array_record/test", batch_size=256, shuffle=False, num_epochs=1, drop_remainder=False)
unigram = unigram_bits_per_byte(text for batch in test for text in batch["text"])
print("\n=== report ===")
print(f"training:  {summary['final_step']} steps, final loss {summary['loss']:.4f} nats/token, "
      f"{summary['examples_per_sec']:,.0f} passages/s")
print(f"eval:      {summary['eval_bits_per_byte']:.3f} bits per byte on {summary['eval_examples']} held-out passages "
      f"(eval_loss {summary['eval_loss']:.4f} nats per token)")
print(f"baseline:  {unigram:.3f} bits per byte, the unigram entropy of the same bytes")
print(f"artifacts: {out}/train (metrics.jsonl, tensorboard/, checkpoints/)")
if summary["eval_bits_per_byte"] > unigram - 1.0:
    sys.exit(f"eval {summary['eval_bits_per_byte']:.3f} bits per byte does not beat the unigram entropy {unigram:.3f} "
             "by a bit per byte")
PYEOF
echo "==> 4/4 a BPE tokenizer trained on the training text, and the LM over its tokens (packed rows)"
$PY -m trainer.tokenizer "$OUT/array_record/train" --kind bpe --vocab_size 1024 --output "$OUT/tokenizer/tokenizer.json"
$PY -m trainer data="$OUT/array_record/train" eval_data="$OUT/array_record/test" task=lm model=transformer_lm \
  tokenizer="$OUT/tokenizer/tokenizer.json" packing=true seq_len=256 strategy=$strategy steps=300 batch_size=16 \
  learning_rate=0.003 log_every=50 eval_every=150 checkpoint_every=150 workdir="$OUT/train-bpe" \
  > "$OUT/train-bpe-summary.json"
$PY - "$OUT" <<'PYEOF'
import json, math, sys
import loader
from trainer import tokenizer
out = sys.argv[1]
summary = json.load(open(f"{out}/train-bpe-summary.json"))["summary"]
tok = tokenizer.load(f"{out}/tokenizer/tokenizer.json")
test = [t for b in loader.load(f"{out}/array_record/test", batch_size=256, shuffle=False, num_epochs=1,
                               drop_remainder=False) for t in b["text"]]
targets = sum(len(ids) - 1 for ids in tok.encode_batch(test))  # each passage's tokens after BOS
bits = summary["eval_loss"] / math.log(2) * targets / sum(map(len, test))
print(f"bpe:       {tok.vocab_size} tokens, {sum(map(len, test)) / targets:.2f} bytes a token on the test text; "
      f"eval {bits:.3f} bits per byte ({summary['eval_loss']:.4f} nats per token)")
PYEOF
echo "done"
