"""Run ``fairseq-train`` under ``torchrun`` (any device, CPU included).

fairseq's own torchrun support derives the rank's device from ``torch.cuda.device_count()``, and its CPU default
is a world of 1, so ``torchrun ... fairseq-train --cpu`` starts independent single-process runs. This launcher
reads torchrun's RANK / WORLD_SIZE / LOCAL_RANK and hands fairseq the explicit flags it needs
(``--distributed-world-size --distributed-rank --distributed-init-method env:// --distributed-no-spawn
--device-id``; and ``--distributed-backend gloo`` when the run is on CPU and names no backend: fairseq's default,
NCCL, does not exist there), then runs fairseq-train unchanged:

    torchrun --nproc_per_node 2 -m megamoe_plugin.fairseq_adapter.launch data-bin --cpu --distributed-backend gloo \
        --ddp-backend legacy_ddp --user-dir $(megamoe fairseq-user-dir) --arch moe_transformer_lm_tiny ...
"""
import os
import sys


def distributed_flags(env=os.environ) -> list:
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return []
    return ["--distributed-world-size", env["WORLD_SIZE"], "--distributed-rank", env["RANK"],
            "--distributed-init-method", "env://", "--distributed-no-spawn",
            "--device-id", env.get("LOCAL_RANK", "0")]


def backend_flags(argv, cuda_available=None) -> list:
    """``--distributed-backend gloo`` for a CPU run (``--cpu`` or no CUDA) that names no backend."""
    if any(a == "--distributed-backend" or a.startswith("--distributed-backend=") for a in argv):
        return []
    if cuda_available is None:
        import torch
        cuda_available = torch.cuda.is_available()
    return ["--distributed-backend", "gloo"] if "--cpu" in argv or not cuda_available else []


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = distributed_flags()
    sys.argv = ["fairseq-train"] + argv + extra + (backend_flags(argv) if extra else [])
    from fairseq_cli.train import cli_main
    cli_main()


if __name__ == "__main__":
    main()
