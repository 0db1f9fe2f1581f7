#!/usr/bin/env python
"""Pretrain an MoE GPT on megatron-core alone (no Megatron-LM checkout), optionally with megamoe_plugin.

    # one process, CPU, the embedded real-text corpus, plugin on:
    python examples/megatron/pretrain_moe_gpt.py --num-experts 8 --moe-router-topk 2 --moe-plugin
    # two processes, expert parallel:
    torchrun --nproc-per-node 2 examples/megatron/pretrain_moe_gpt.py --num-experts 8 \
        --expert-model-parallel-size 2 --moe-plugin --moe-plugin-gate gshard

The trainer lives in the package (``megamoe_plugin.megatron_adapter.trainer``); this script is its command line.
Flags use Megatron-LM's names plus ``--moe-plugin-*``; ``-h`` lists them.
"""
import sys

from megamoe_plugin.megatron_adapter.trainer import main

if __name__ == "__main__":
    main(sys.argv[1:])
