#!/usr/bin/env bash
# Regenerates the routing traces shipped in megamoe_plugin/data/traces/, which `megamoe reproduce <paper>`
# reads so every table can be remade without retraining. Each is a small MoE GPT trained on CPU on the embedded
# multi-domain real-text corpus (the Python standard library's sources and docs), through one of the trainers:
#
#   megatron_gpt.rank{0,1}   Megatron adapter (examples/megatron/pretrain_moe_gpt.py): 2 gloo ranks, EP=2,
#                            4 MoE layers x 16 experts, gshard top-2, 200 iterations; training forwards
#   fairseq_lm.rank{0,1}     fairseq adapter (fairseq-train --user-dir, moe_transformer_lm_tiny): 2 ranks, EP=2,
#                            16 experts, gshard top-2, 200 updates; training forwards
#   deploy_small.rank0       `megamoe train` (16 experts, naive top-2, 4 MoE layers, 300 steps), then `megamoe trace`
#                            over held-out text in 16-token batches (inference routing, paper 004)
#
# About 10 minutes on 2 cores. Checkpoints go to $WORK (not shipped).
#   examples/reproduce/make_traces.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-megamoe_plugin/data/traces}
WORK=${WORK:-/tmp/megamoe-traces}
mkdir -p "$OUT" "$WORK"
export OMP_NUM_THREADS=1

if [ -z "${SKIP_MEGATRON:-}" ]; then
echo "== Megatron adapter"
rm -rf "$WORK/megatron" "$OUT"/megatron_gpt.rank*
torchrun --standalone --nproc-per-node 2 examples/megatron/pretrain_moe_gpt.py --num-layers 4 --hidden-size 128 \
  --num-attention-heads 4 --seq-length 128 --micro-batch-size 4 --global-batch-size 8 --num-experts 16 \
  --moe-router-topk 2 --moe-aux-loss-coeff 0.01 --lr 1e-3 --lr-warmup-iters 20 --train-iters 200 \
  --expert-model-parallel-size 2 --moe-plugin --moe-plugin-gate gshard --moe-plugin-second-expert-policy all \
  --moe-plugin-trace-path "$OUT/megatron_gpt" --save "$WORK/megatron" --log-interval 50 \
  --data-cache-path "$WORK/megatron-data"
fi

echo "== fairseq adapter"
rm -rf "$WORK/fairseq-ck" "$OUT"/fairseq_lm.rank*
if [ ! -d "$WORK/fairseq-bin" ]; then
  python -c "from megamoe_plugin.data.corpus import write_text_splits; write_text_splits('$WORK/fairseq-raw', formats=('txt',), max_bytes=2_000_000)"
  python -m fairseq_cli.preprocess --only-source --trainpref "$WORK/fairseq-raw/train.txt" \
    --validpref "$WORK/fairseq-raw/valid.txt" --destdir "$WORK/fairseq-bin" --nwordssrc 4000 --workers 1
fi
torchrun --standalone --nproc-per-node 2 -m megamoe_plugin.fairseq_adapter.launch "$WORK/fairseq-bin" \
  --user-dir "$(megamoe fairseq-user-dir)" --task language_modeling --arch moe_transformer_lm_tiny \
  --moe-expert-count 16 --moe-gate gshard --moe-expert-parallel-size 2 --criterion moe_cross_entropy --cpu \
  --distributed-backend gloo --ddp-backend legacy_ddp \
  --optimizer adam --lr 0.001 --tokens-per-sample 128 --batch-size 4 --max-update 200 --log-interval 50 \
  --log-format simple --save-dir "$WORK/fairseq-ck" --no-epoch-checkpoints --seed 1 --clip-norm 1.0 \
  --moe-trace-path "$OUT/fairseq_lm"

echo "== megamoe train + megamoe trace (inference routing)"
rm -f "$OUT"/deploy_small.rank*
megamoe train --moe-num-experts 16 --moe-top-k 2 --moe-gate naive --moe-every 1 --steps 300 --log-interval 100 \
  --save "$WORK/core.pt"
megamoe trace --checkpoint "$WORK/core.pt" --trainer core --out "$OUT/deploy_small" --batches 600 --batch-size 1 \
  --seq-len 16

ls -la "$OUT"
