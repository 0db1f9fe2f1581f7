#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py on the emulated cluster (2 nodes x 2 fixed-speed ranks, inter-node links shaped),
# EP=4, a MoE GPT whose routing skews (switch top-1, no balance loss) on the embedded real-text corpus: static
# expert parallelism, then --moe-plugin-placement flexmoe, then shadow, runs interleaved round by round. Prints each
# run's median iteration time and final loss. Needs root (network namespaces, CPU cgroups) and a Megatron-LM
# checkout (MEGATRON_LM_DIR; default: ../shared/megatron-lm/core_v0.16.1 beside the repository).
#
#   bash examples/megatron/megatron_lm_cluster_placement.sh [OUT_DIR]
#
# Settings (environment): ITERS (60), MBS (micro-batch per rank, 32 sequences of 64 tokens = 2,048 tokens per rank),
# BANDWIDTH (100MB/s), ROUNDS (1), RUNS ("none flexmoe shadow").
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
MLM="${MEGATRON_LM_DIR:-$HERE/../shared/megatron-lm/core_v0.16.1}"
OUT="${1:-results/megatron_lm_cluster_placement}"
ITERS="${ITERS:-60}"; MBS="${MBS:-32}"; BANDWIDTH="${BANDWIDTH:-100MB/s}"; ROUNDS="${ROUNDS:-1}"
RUNS="${RUNS:-none flexmoe shadow}"
mkdir -p "$OUT"
[ -f "$MLM/pretrain_gpt.py" ] || { echo "no pretrain_gpt.py in $MLM (set MEGATRON_LM_DIR)" >&2; exit 2; }

# the embedded corpus as Megatron indexed datasets (written once into a cache folder)
DATA="$(python -c "
from megamoe_plugin.megatron_adapter.data import write_corpus_indexed
p = write_corpus_indexed('$OUT/data', 1000000, 0)
print(p['train'], p['valid'], p['test'])")"
read -r TRAIN VALID TEST <<< "$DATA"

ARGS=(--distributed-backend gloo --transformer-impl local --no-gradient-accumulation-fusion
      --no-persist-layer-norm --train-data-path "$TRAIN" --valid-data-path "$VALID" --test-data-path "$TEST"
      --tokenizer-type NullTokenizer --vocab-size 256 --num-layers 4 --hidden-size 256 --num-attention-heads 4
      --seq-length 64 --max-position-embeddings 64 --micro-batch-size "$MBS" --global-batch-size $((4 * MBS))
      --train-iters "$ITERS" --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 5
      --eval-interval "$ITERS" --eval-iters 4 --log-interval 1 --attention-dropout 0 --hidden-dropout 0
      --num-experts 16 --moe-ffn-hidden-size 512 --ffn-hidden-size 512 --moe-router-topk 1
      --moe-aux-loss-coeff 0 --moe-router-pre-softmax --expert-model-parallel-size 4 --moe-plugin
      --moe-plugin-gate switch)

for round in $(seq 1 "$ROUNDS"); do
  for run in $RUNS; do
    extra=()
    [ "$run" != none ] && extra=(--moe-plugin-placement "$run")
    log="$OUT/round$round-$run.log"
    echo "[megatron-lm cluster] round $round $run ..."
    OMP_NUM_THREADS=1 megamoe cluster run --nodes 2 --procs-per-node 2 --inter-node-bandwidth "$BANDWIDTH" \
      --log-dir "$OUT/round$round-$run-logs" --timeout 3600 -- \
      python -m megamoe_plugin.megatron_adapter.launch "$MLM/pretrain_gpt.py" "${ARGS[@]}" "${extra[@]}" > "$log" 2>&1 \
      || { echo "  failed: see $log" >&2; exit 1; }
  done
done

python - "$OUT" "$ROUNDS" $RUNS <<'EOF'
import glob, re, statistics, sys
out, rounds, runs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
it = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+).*?lm loss: (\S+) \|")
print(f"{'run':<8} {'median iteration ms (per round)':<34} {'vs none':>8} {'final lm loss':>14}")
med = {}
for run in runs:
    per_round, last = [], None
    for r in range(1, rounds + 1):
        # Megatron-LM prints its iteration lines on the last rank
        text = open(f"{out}/round{r}-{run}-logs/rank3.log", errors="replace").read()
        rows = [(int(i), float(ms), float(loss)) for i, ms, loss in it.findall(text)]
        per_round.append(statistics.median(ms for i, ms, _ in rows if i > 1))
        last = rows[-1][2]
    med[run] = statistics.median(per_round)
    base = med.get("none")
    print(f"{run:<8} {med[run]:>8.0f} ({', '.join(f'{m:.0f}' for m in per_round)})"
          f"{'':<{max(0, 24 - 2 - 6 * len(per_round))}} {(base / med[run] if base else 1.0):>7.2f}x {last:>14.4f}")
EOF
