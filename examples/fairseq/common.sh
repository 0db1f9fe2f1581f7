# Shared by lm.sh and translation.sh (sourced after WORK is set): checks the installation, sets USER_DIR and the
# work folders, and defines fairseq_train, which runs fairseq-train on NPROC processes.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
python -c "import megamoe_plugin" 2>/dev/null || pip install -q -e "$ROOT" --no-deps
python -c "import fairseq" 2>/dev/null || {
    echo "fairseq is not installed: pip install fairseq-fixed==0.12.3.1 --no-deps --no-build-isolation" >&2
    exit 1
}
USER_DIR=$(megamoe fairseq-user-dir 2>/dev/null || python -m megamoe_plugin.cli fairseq-user-dir)
mkdir -p "$WORK"
TEXT=$WORK/text
DATA=$WORK/data-bin
CKPT=$WORK/checkpoints

# fairseq_train ARGS...: one process with fairseq-train, or NPROC gloo processes with experts sharded over them
fairseq_train() {
    local start=$SECONDS
    if [ "$NPROC" -gt 1 ]; then
        # fairseq's own torchrun path gives every CPU rank a world of 1; the launcher passes the rank flags
        torchrun --standalone --nproc_per_node "$NPROC" -m megamoe_plugin.fairseq_adapter.launch "$@" \
            --distributed-backend gloo --ddp-backend legacy_ddp
    else
        fairseq-train "$@"
    fi
    echo "train: $((SECONDS - start)) s"
}
