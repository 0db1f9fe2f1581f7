"""A trivial placement policy for tests: records what the after-step hook saw, one JSON line per call.

Named on a command line as ``--moe-plugin-placement recording_policy:RecordingPolicy`` with this folder on
PYTHONPATH; writes to ``$MEGAMOE_RECORD_DIR/rank<r>.jsonl``.
"""
import json
import os

import torch.distributed as dist


class RecordingPolicy:
    def __init__(self, cfg):
        self.cfg = cfg
        self.dir = os.environ.get("MEGAMOE_RECORD_DIR", "")

    def __call__(self, ctx):
        rank = dist.get_rank() if dist.is_initialized() else 0
        banks = [getattr(m, "experts_bank", None) or getattr(m, "experts", None) for m in ctx.moe_layers]
        norms = [float(b.w1.detach().float().norm()) for b in banks if b is not None and hasattr(b, "w1")]
        opt = ctx.optimizer
        has_state = False
        for p in (banks[0].w1,) if banks and hasattr(banks[0], "w1") else ():
            # Megatron's ChainedOptimizer (dense + expert optimizers) asserts on `.optimizer`: look at its chain
            chain = getattr(opt, "chained_optimizers", None) or [opt]
            inners = [getattr(o, "optimizer", o) for o in chain]
            has_state = any(len(getattr(i, "state", {})) > 0 for i in inners)
        params = {}
        models = ctx.model if isinstance(ctx.model, (list, tuple)) else [ctx.model]
        for m in models:
            for n, p in m.named_parameters():
                params[n] = float(p.detach().float().norm())
        chain = getattr(opt, "chained_optimizers", None) or [opt]
        lrs = sorted({g["lr"] for o in chain for g in o.param_groups})
        rec = {"rank": rank, "param_norms": params, "iteration": ctx.iteration, "optimizer": type(opt).__name__,
               "lrs": lrs,
               "moe_layers": len(ctx.moe_layers), "expert_w1_norms": norms, "optimizer_has_state": has_state,
               "layer_numbers": [getattr(m, "layer_number", None) for m in ctx.moe_layers]}
        if self.dir:
            with open(os.path.join(self.dir, f"rank{rank}.jsonl"), "a") as f:
                f.write(json.dumps(rec) + "\n")
