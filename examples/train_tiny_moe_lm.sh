#!/usr/bin/env bash
# The main job: a small MoE GPT language model trained on CPU on the embedded default corpus (the Python stdlib's
# sources and docs, byte-level). 4 blocks (hidden 128, 4 heads), blocks 1 and 3 MoE: 8 experts, gshard top-2,
# dropless dispatch, aux loss 0.01. Prints loss and the per-expert load of every MoE layer every 20 steps, evals
# on the valid split (perplexity, bits per byte), saves a checkpoint and a routing trace.
# About 40 s for the 200 steps on 2 cores.
#
#   examples/train_tiny_moe_lm.sh                                  # defaults
#   examples/train_tiny_moe_lm.sh --moe-dispatch capacity --moe-capacity-factor 1.25
#   examples/train_tiny_moe_lm.sh --steps 400 --resume runs/tiny_moe_lm/ckpt.pt   # continue a saved run
#   NPROC=2 examples/train_tiny_moe_lm.sh --moe-expert-parallel-size 2          # 2 processes (torchrun, gloo)
#
# Extra arguments go to `megamoe train` (see `megamoe train -h`; `megamoe options` lists the MoE options).
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import megamoe_plugin" 2>/dev/null || pip install -q -e . --no-deps
OUT=${OUT:-runs/tiny_moe_lm}
NPROC=${NPROC:-1}
mkdir -p "$OUT"
FLAGS=(--steps 200 --log-interval 20 --eval-interval 100 --save "$OUT/ckpt.pt" --trace "$OUT/trace")
if [ "$NPROC" -gt 1 ]; then
    exec torchrun --standalone --nproc-per-node "$NPROC" -m megamoe_plugin.train --threads 1 "${FLAGS[@]}" "$@"
fi
if command -v megamoe >/dev/null; then
    exec megamoe train "${FLAGS[@]}" "$@"
fi
exec python -m megamoe_plugin.cli train "${FLAGS[@]}" "$@"
