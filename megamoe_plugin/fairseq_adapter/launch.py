"""Run ``fairseq-train`` under ``torchrun`` (any device, CPU included).

fairseq's own torchrun support derives the rank's device from ``torch.cuda.device_count()``, and its CPU default
is a world of 1, so ``torchrun ... fairseq-train --cpu`` starts independent single-process runs. This launcher
reads torchrun's RANK / WORLD_SIZE / LOCAL_RANK and hands fairseq the explicit flags it needs
(``--distributed-world-size --distributed-rank --distributed-init-method env:// --distributed-no-spawn
--device-id``), then runs fairseq-train unchanged:

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


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    sys.argv = ["fairseq-train"] + argv + distributed_flags()
    from fairseq_cli.train import cli_main
    cli_main()


if __name__ == "__main__":
    main()
