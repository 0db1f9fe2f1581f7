"""A test "placement policy" that poisons one forward: after optimizer step $MEGAMOE_POISON_AT (default 2), the
next forward of MoE layer number $MEGAMOE_POISON_LAYER (index among the model's MoE layers, default the last) on
rank $MEGAMOE_POISON_RANK (default 0) gets a NaN in its input, once. Named as
``--moe-placement poison_policy:PoisonOnce`` (``--moe-plugin-placement`` in Megatron) with this folder on
PYTHONPATH."""
import os

import torch.distributed as dist


class PoisonOnce:
    def __init__(self, cfg):
        self.at = int(os.environ.get("MEGAMOE_POISON_AT", "2"))
        self.layer = int(os.environ.get("MEGAMOE_POISON_LAYER", "-1"))
        self.rank = int(os.environ.get("MEGAMOE_POISON_RANK", "0"))

    def __call__(self, ctx):
        rank = dist.get_rank() if dist.is_initialized() else 0
        if ctx.iteration != self.at or rank != self.rank:
            return
        handle = None

        def poison(module, args):
            handle.remove()
            x = args[0].clone()
            x.view(-1)[0] = float("nan")
            return (x,) + tuple(args[1:])

        handle = ctx.moe_layers[self.layer].register_forward_pre_hook(poison)
