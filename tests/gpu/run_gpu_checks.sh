#!/usr/bin/env bash
# The GPU checks in one bounded run, for a machine with one CUDA device (run from the repository root):
#   1. tests/gpu (bf16 grouped-GEMM layer vs fp32, the gate's side stream, expert buffering's copy stream,
#      CUDA-graph experts, the Megatron example trainer in bf16, the layer benchmark's smoke run);
#   2. `megamoe bench layer --device cuda --dtype bf16` on the CPU benchmark's shapes and a GPU-sized one, and a
#      profile of the GPU-sized one (tests/gpu/profile_layer.py);
#   3. Megatron-LM's pretrain_gpt.py (through the launcher, no patch) on the GPU in bf16 with the distributed
#      optimizer: megatron-core's own MoE layer, then the plugin's (plain top-k gate, dropless), same model.
#
#   bash tests/gpu/run_gpu_checks.sh OUTDIR [MEGATRON_LM_DIR]
#   (GPU_CHECK_SECONDS: the longest step's limit, default 150; BENCH_CONFIGS: default 1,2,3,gpu; SKIP_PROFILE=1)
#
# Without network access, put wheels of megatron-core (and pydantic for Megatron-LM's training code) in ./.whl:
# they are installed under /tmp/megamoe-site first. Each step has its own time limit; a failed step does not stop
# the next one; the exit status is the number of failed steps.
set -uo pipefail
OUTDIR=${1:?usage: run_gpu_checks.sh OUTDIR [MEGATRON_LM_DIR]}
MLM=${2:-}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/megamoe-site .whl/*.whl
  export PYTHONPATH=/tmp/megamoe-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
# megatron-core 0.16 without Transformer Engine reads an undefined name, te_general_gemm, in its router's CUDA path
# (0.17+ define it None), so its own MoE layer fails at the first step: these checks give it that None (a builtins
# entry, where a module's missing global falls back to), through a sitecustomize of this run only
if ! $PY -c "import transformer_engine" >/dev/null 2>&1; then
  mkdir -p /tmp/megamoe-te-none
  echo "import builtins; builtins.te_general_gemm = None" >/tmp/megamoe-te-none/sitecustomize.py
  export PYTHONPATH=/tmp/megamoe-te-none:$PYTHONPATH
  echo "no Transformer Engine: megatron-core's router given te_general_gemm = None (as megatron-core 0.17+ define it)"
fi
failed=0
step() {  # step NAME SECONDS CMD...: run, log to OUTDIR/NAME.log, count a failure
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUTDIR/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUTDIR/$name.log"
  echo "=== $name: exit $rc after $((SECONDS - t0))s"
  [ $rc -eq 0 ] || failed=$((failed + 1))
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$PY -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
      torch.cuda.get_device_name())"
$PY -c "import megatron.core as m; print('megatron-core', m.__version__)" || echo "megatron-core: not importable"

T=${GPU_CHECK_SECONDS:-150}            # the limit of the longest step; the others scale with it
step pytest_gpu "$T" $PY -m pytest -q -p no:cacheprovider -rs tests/gpu
step bench_layer $((T * 4 / 5)) $PY -m megamoe_plugin.cli bench layer --device cuda --dtype bf16 \
  --configs "${BENCH_CONFIGS:-1,2,3,gpu}" \
  --routing balanced,skewed --repeat 20 --output "$OUTDIR/bench_layer_cuda_bf16.md"
[ -n "${SKIP_PROFILE:-}" ] || step profile_layer $((T / 2)) $PY tests/gpu/profile_layer.py gpu balanced

if [ -n "$MLM" ] && [ -f "$MLM/pretrain_gpt.py" ]; then
  common=(--transformer-impl local --no-gradient-accumulation-fusion --no-persist-layer-norm
          --no-masked-softmax-fusion --no-rope-fusion --mock-data --tokenizer-type NullTokenizer --vocab-size 8192
          --num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024
          --micro-batch-size 8 --global-batch-size 8 --train-iters 40 --lr 1e-4 --log-interval 10
          --eval-iters 0 --eval-interval 100000 --bf16 --use-distributed-optimizer --swiglu --disable-bias-linear
          --num-experts 8 --moe-router-topk 2 --moe-aux-loss-coeff 0.01 --moe-token-dispatcher-type alltoall)
  launch=(env PYTHONPATH="$MLM:$PYTHONPATH" $PY -m torch.distributed.run --standalone --nproc-per-node 1
          -m megamoe_plugin.megatron_adapter.launch "$MLM/pretrain_gpt.py")
  step pretrain_gpt_megatron_moe $((T * 3 / 5)) "${launch[@]}" "${common[@]}"
  step pretrain_gpt_plugin_moe $((T * 3 / 5)) "${launch[@]}" "${common[@]}" --moe-plugin --moe-plugin-gate naive
  grep -h "elapsed time per iteration\|lm loss" "$OUTDIR"/pretrain_gpt_*.log | tail -n 12 || true
fi
echo "failed steps: $failed"
exit $failed
