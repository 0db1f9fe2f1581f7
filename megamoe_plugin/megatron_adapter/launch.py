"""Run an unmodified Megatron-LM ``pretrain_gpt.py`` with the plugin's hooks (no patch to apply).

    torchrun --nproc-per-node 2 -m megamoe_plugin.megatron_adapter.launch /path/to/Megatron-LM/pretrain_gpt.py \\
        <pretrain_gpt.py arguments, with --moe-plugin ...>

(``python -m megamoe_plugin.megatron_adapter.launch /path/to/Megatron-LM/pretrain_gpt.py ...`` takes the same arguments;
Megatron-LM itself expects torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.) On CPU, the exact
command line that trains a tiny MoE GPT on 2 gloo processes with EP=2 (``python -m torch.distributed.run`` is
torchrun)::

    CUDA_VISIBLE_DEVICES= PYTHONPATH=/path/to/Megatron-LM python -m torch.distributed.run --standalone \\
      --nproc-per-node 2 -m megamoe_plugin.megatron_adapter.launch /path/to/Megatron-LM/pretrain_gpt.py \\
      --distributed-backend gloo --transformer-impl local --no-gradient-accumulation-fusion \\
      --no-persist-layer-norm --mock-data --tokenizer-type NullTokenizer --vocab-size 128 \\
      --eval-interval 1000 --eval-iters 0 --num-layers 2 --hidden-size 64 --num-attention-heads 4 \\
      --seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 4 \\
      --train-iters 4 --lr 1e-3 --log-interval 1 --num-experts 4 --moe-router-topk 2 \\
      --expert-model-parallel-size 2 --moe-plugin --moe-plugin-gate gshard

It puts the script's directory first on ``sys.path`` (as ``python pretrain_gpt.py`` would), calls
``install_megatron_lm_hooks()`` (the ``--moe-plugin*`` flags, their validation, the after-step hook and metrics;
the CPU shims when there is no CUDA), wraps ``gpt_builders.gpt_builder`` with ``moe_plugin_gpt_builder`` (the
plugin's layer spec with ``--moe-plugin``) and runs the script as ``__main__`` with the remaining arguments.
patches/README.md explains each CPU flag and the patch alternative.
"""
from __future__ import annotations

import os
import runpy
import sys

USAGE = "usage: python -m megamoe_plugin.megatron_adapter.launch /path/to/Megatron-LM/pretrain_gpt.py [args...]"


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] in ("-h", "--help") and len(argv) == 1):
        print(USAGE + "\n\n" + __doc__)
        raise SystemExit(0 if argv else 2)
    script = os.path.abspath(argv[0])
    if not os.path.isfile(script):
        print(f"megamoe_plugin.megatron_adapter.launch: {argv[0]}: no such script\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)
    root = os.path.dirname(script)
    if root not in sys.path:
        sys.path.insert(0, root)
    sys.argv = [script] + argv[1:]

    from .megatron_lm import install_megatron_lm_hooks, wrap_gpt_builders
    install_megatron_lm_hooks()
    wrap_gpt_builders()
    _spawned_children_start_here(script)
    runpy.run_path(script, run_name="__main__")


def _spawned_children_start_here(script: str) -> None:
    """A process the script spawns (megatron-core's asynchronous checkpoint writer starts a multiprocessing
    manager) imports its parent's ``__main__`` first: the script, without the hooks installed above, which on a
    torch without triton or CUDA fails to import. Such children import this launcher instead (as
    ``__mp_main__``: the hooks, not the script's run)."""
    import multiprocessing.spawn as spawn

    original = spawn.get_preparation_data

    def preparation_data(name):
        data = original(name)
        if os.path.abspath(data.get("init_main_from_path", "")) == script:
            data.pop("init_main_from_path")
            data["init_main_from_name"] = __spec__.name if __spec__ is not None else __name__
        return data

    spawn.get_preparation_data = preparation_data


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__":            # a child the script spawned (_spawned_children_start_here)
    from .megatron_lm import install_megatron_lm_hooks
    install_megatron_lm_hooks()
