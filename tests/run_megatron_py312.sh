#!/usr/bin/env bash
# The Megatron tests in the environment a Megatron user of today installs: Python 3.12, torch==2.13.0 and
# megatron-core==0.19.2 from the registry (on 3.12 that torch is the CUDA build; it runs on CPU), the plugin with its
# megatron-lm extra. Runs the megatron-core tests (adapter, trainer, placement, dynamic, inference, peer, doctor)
# and Megatron-LM core_v0.19.0's pretrain_gpt.py (patch and launcher). Called by the README's test command after the
# main suite (Python 3.11, megatron-core 0.16.1, Megatron-LM core_v0.16.1).
#
#   MEGAMOE_PY312        the Python 3.12 interpreter (default: pyenv's 3.12.x, else python3.12 on PATH)
#   MEGAMOE_PY312_VENV   where the environment lives (default: ~/.cache/megamoe-plugin/venv-py312-mcore0.19.2);
#                        built when missing, reused when it already has these exact versions
#   MEGATRON_LM_DIR      Megatron-LM checkout(s) for test_megatron_lm.py (default: ../shared/megatron-lm/core_v0.19.0
#                        when present, else whatever the test finds)
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH=2.13.0
MCORE=0.19.2
VENV=${MEGAMOE_PY312_VENV:-$HOME/.cache/megamoe-plugin/venv-py312-mcore$MCORE}

is_py312() { [ -n "$1" ] && [ -x "$1" ] && "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; }

find_py312() {
  local p
  for p in "${MEGAMOE_PY312:-}" "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.12*/bin/python3.12 \
           "$(command -v python3.12 || true)"; do
    if is_py312 "$p"; then echo "$p"; return 0; fi
  done
  return 1
}

if ! "$VENV/bin/python" -c "
import importlib.metadata as m, sys
sys.exit(not (sys.version_info[:2] == (3, 12) and m.version('torch').split('+')[0] == '$TORCH'
              and m.version('megatron-core') == '$MCORE'))" 2>/dev/null; then
  PY312=$(find_py312) || { echo "run_megatron_py312.sh: no Python 3.12 found (set MEGAMOE_PY312)" >&2; exit 1; }
  echo "run_megatron_py312.sh: building $VENV with $PY312: torch==$TORCH megatron-core==$MCORE"
  rm -rf "$VENV"
  "$PY312" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "torch==$TORCH" "megatron-core==$MCORE"
fi
"$VENV/bin/python" -m pip install -q -e ".[megatron-lm]" pytest pytest-xdist

if [ -z "${MEGATRON_LM_DIR:-}" ] && [ -f ../shared/megatron-lm/core_v0.19.0/pretrain_gpt.py ]; then
  MEGATRON_LM_DIR=$(cd ../shared/megatron-lm/core_v0.19.0 && pwd)
  export MEGATRON_LM_DIR
fi
"$VENV/bin/python" -c "import sys, torch, megatron.core as m
print(f'run_megatron_py312.sh: Python {sys.version.split()[0]}, torch {torch.__version__}, megatron-core {m.__version__}; '
      'Megatron-LM: ${MEGATRON_LM_DIR:-found by the test}')" 2>/dev/null
# tests marked one_release check what runs the same on every Megatron release: the main suite runs them; two
# pytest-xdist workers, a file to a worker (its module fixtures run once), the longest files first (tests/conftest.py)
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -n 2 --dist loadfile -m "not one_release" \
  tests/test_megatron_lm_recipes.py tests/test_megatron_lm.py tests/test_megatron_trainer.py \
  tests/test_megatron_placement.py tests/test_megatron_router_parity.py tests/test_megatron_adapter.py \
  tests/test_megatron_doctor.py tests/test_megatron_dynamic.py tests/test_megatron_inference.py \
  tests/test_megatron_peer.py "$@"
