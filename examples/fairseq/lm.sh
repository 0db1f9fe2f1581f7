#!/usr/bin/env bash
# A tiny MoE transformer language model trained with fairseq on CPU, on the embedded real-text corpus (the Python
# stdlib's sources and docs, read from this machine at run time), then scored with fairseq-eval-lm.
#
#   1. writes the corpus as text (WORK/text/{train,valid,test}.txt, about 2 MB in all)
#   2. fairseq-preprocess --only-source (whitespace tokens, 8000-word dictionary) -> WORK/data-bin
#   3. trains moe_transformer_lm_tiny (64/128, 2 layers, the 2nd an MoE FFN) with moe_cross_entropy -> WORK/checkpoints
#      NPROC=1: fairseq-train; NPROC>1: torchrun + megamoe_plugin.fairseq_adapter.launch (gloo), experts sharded over ranks
#   4. fairseq-eval-lm on checkpoint_best.pt, test split, one process: prints loss and perplexity
#
#   examples/fairseq/lm.sh                                   # -> ./runs/fairseq-lm
#   UPDATES=60 examples/fairseq/lm.sh /tmp/lm
#   NPROC=2 EXPERTS=8 GATE=switch examples/fairseq/lm.sh /tmp/lm-ep2
#   examples/fairseq/lm.sh /tmp/lm-cap --moe-dispatch capacity --moe-capacity-factor 1.25
#   NPROC=2 examples/fairseq/lm.sh /tmp/lm-flexmoe --moe-placement flexmoe   # experts moved between steps (README)
#
# Env: NPROC (1), UPDATES (200), EXPERTS (4), GATE (gshard), MAX_BYTES (2000000, corpus cap).
# Arguments after the work dir go to fairseq-train (any fairseq or MoE flag; `megamoe options` lists the MoE ones).
# Steps whose output exists are skipped; fairseq-train resumes from WORK/checkpoints/checkpoint_last.pt, so
# delete WORK (or its checkpoints/) to start over.
set -euo pipefail

WORK=${1:-./runs/fairseq-lm}
shift || true
NPROC=${NPROC:-1}
UPDATES=${UPDATES:-200}
EXPERTS=${EXPERTS:-4}
GATE=${GATE:-gshard}
MAX_BYTES=${MAX_BYTES:-2000000}

source "$(dirname "$0")/common.sh"      # install checks, USER_DIR, TEXT/DATA/CKPT, fairseq_train

echo "== 1/4 corpus -> $TEXT"
if [ ! -s "$TEXT/test.txt" ]; then
    python -c '
import sys
from megamoe_plugin.data.corpus import write_text_splits
for name, path in write_text_splits(sys.argv[1], formats=("txt",), max_bytes=int(sys.argv[2])).items():
    print(path)
' "$TEXT" "$MAX_BYTES"
fi
wc -c "$TEXT"/{train,valid,test}.txt

echo "== 2/4 fairseq-preprocess -> $DATA"
if [ ! -s "$DATA/dict.txt" ]; then
    fairseq-preprocess --only-source \
        --trainpref "$TEXT/train.txt" --validpref "$TEXT/valid.txt" --testpref "$TEXT/test.txt" \
        --destdir "$DATA" --nwordssrc 8000 --workers 2
fi

echo "== 3/4 train moe_transformer_lm_tiny ($EXPERTS experts, gate $GATE, $UPDATES updates, $NPROC process(es))"
TRAIN_ARGS=("$DATA" --user-dir "$USER_DIR" --task language_modeling --arch moe_transformer_lm_tiny
    --criterion moe_cross_entropy --cpu --optimizer adam --lr 0.002
    --tokens-per-sample 128 --batch-size 16
    --moe-expert-count "$EXPERTS" --moe-gate "$GATE"
    --log-format simple --log-interval 20
    --save-dir "$CKPT" --no-epoch-checkpoints --max-update "$UPDATES")
fairseq_train "${TRAIN_ARGS[@]}" "$@"

echo "== 4/4 fairseq-eval-lm $CKPT/checkpoint_best.pt (test split)"
fairseq-eval-lm "$DATA" --user-dir "$USER_DIR" --path "$CKPT/checkpoint_best.pt" --cpu \
    --gen-subset test --tokens-per-sample 128 --batch-size 16 > "$WORK/eval-lm.log" 2>&1 \
    || { cat "$WORK/eval-lm.log" >&2; exit 1; }
# the last two lines: "Evaluated N tokens in ..." and "Loss (base 2): X, Perplexity: Y" (full log: WORK/eval-lm.log)
grep -E "Evaluated .* tokens|Perplexity" "$WORK/eval-lm.log" | sed 's/^.*eval_lm[: |]*//'
