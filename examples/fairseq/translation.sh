#!/usr/bin/env bash
# A tiny MoE transformer (encoder-decoder) trained with fairseq on CPU on a synthetic parallel corpus, then decoded
# with fairseq-generate (beam 4) and scored with BLEU.
#
#   1. python -m megamoe_plugin.data.parallel: 2000/100/50 sentence pairs of letters a..z; the target is the source
#      reversed with every letter shifted by one ("a b c" -> "d c b") -> WORK/text/{train,valid,test}.{src,tgt}
#   2. fairseq-preprocess --source-lang src --target-lang tgt --joined-dictionary -> WORK/data-bin
#   3. trains moe_transformer_tiny (64/128, 2+2 layers, the 2nd encoder and 2nd decoder layer MoE FFNs) with
#      moe_label_smoothed_cross_entropy -> WORK/checkpoints
#      NPROC=1: fairseq-train; NPROC>1: torchrun + megamoe_plugin.fairseq_adapter.launch (gloo), experts sharded over ranks
#   4. fairseq-generate on checkpoint_best.pt, test split, one process: prints a few S/T/H lines and the BLEU line
#      (inference is dropless unless --moe-eval-capacity-token-fraction says otherwise)
#
#   examples/fairseq/translation.sh                          # -> ./runs/fairseq-translation
#   UPDATES=300 examples/fairseq/translation.sh /tmp/mt
#   NPROC=2 GATE=switch examples/fairseq/translation.sh /tmp/mt-ep2
#
# Env: NPROC (1), UPDATES (600), EXPERTS (4), GATE (gshard), SHOW (5: hypotheses printed).
# Arguments after the work dir go to fairseq-train (any fairseq or MoE flag; `megamoe options` lists the MoE ones).
# Steps whose output exists are skipped; fairseq-train resumes from WORK/checkpoints/checkpoint_last.pt, so
# delete WORK (or its checkpoints/) to start over.
set -euo pipefail

WORK=${1:-./runs/fairseq-translation}
shift || true
NPROC=${NPROC:-1}
UPDATES=${UPDATES:-600}
EXPERTS=${EXPERTS:-4}
GATE=${GATE:-gshard}
SHOW=${SHOW:-5}

source "$(dirname "$0")/common.sh"      # install checks, USER_DIR, TEXT/DATA/CKPT, fairseq_train

echo "== 1/4 synthetic parallel corpus -> $TEXT"
if [ ! -s "$TEXT/test.tgt" ]; then
    python -m megamoe_plugin.data.parallel "$TEXT"
fi
paste -d '\t' <(head -n 2 "$TEXT/train.src") <(head -n 2 "$TEXT/train.tgt") | sed 's/\t/  ->  /'

echo "== 2/4 fairseq-preprocess -> $DATA"
if [ ! -s "$DATA/dict.src.txt" ]; then
    fairseq-preprocess --source-lang src --target-lang tgt \
        --trainpref "$TEXT/train" --validpref "$TEXT/valid" --testpref "$TEXT/test" \
        --destdir "$DATA" --joined-dictionary --workers 2
fi

echo "== 3/4 train moe_transformer_tiny ($EXPERTS experts, gate $GATE, $UPDATES updates, $NPROC process(es))"
TRAIN_ARGS=("$DATA" --user-dir "$USER_DIR" --task translation --arch moe_transformer_tiny
    --criterion moe_label_smoothed_cross_entropy --label-smoothing 0.1 --share-all-embeddings
    --cpu --optimizer adam --lr 0.005 --max-tokens 2000
    --moe-expert-count "$EXPERTS" --moe-gate "$GATE"
    --log-format simple --log-interval 50
    --save-dir "$CKPT" --no-epoch-checkpoints --max-update "$UPDATES")
fairseq_train "${TRAIN_ARGS[@]}" "$@"

echo "== 4/4 fairseq-generate $CKPT/checkpoint_best.pt (test split, beam 4)"
fairseq-generate "$DATA" --user-dir "$USER_DIR" --path "$CKPT/checkpoint_best.pt" --cpu \
    --gen-subset test --beam 4 --batch-size 64 > "$WORK/generate.log" 2>&1 \
    || { cat "$WORK/generate.log" >&2; exit 1; }
# S = source, T = reference, H = hypothesis (with its score); full output: WORK/generate.log
grep -E "^[STH]-" "$WORK/generate.log" | head -n $((3 * SHOW))
grep -E "^Generate test with beam" "$WORK/generate.log" | sed 's/^.*| //'
