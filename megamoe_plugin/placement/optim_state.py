"""Where a trainer's optimizer keeps the state of one parameter: the tensors an expert move must carry along.

FlexMoE (paper 001 §3.3) moves an expert's *model states*: its parameters, their optimizer state (Adam's two
moments) and, with mixed precision, the fp32 master copy the optimizer updates. This module finds those tensors
for a model parameter without importing any trainer, by the shapes trainers' optimizers share:

* a ``torch.optim.Optimizer``: ``state[param]`` (tensors shaped like the parameter; scalars such as Adam's
  ``step`` are the same for every expert of the tensor and stay where they are);
* wrappers holding the torch optimizer in ``.optimizer`` (Megatron's ``FP32Optimizer`` and
  ``Float16OptimizerWithFloat16Params``, fairseq's ``FairseqOptimizer`` family), followed down;
* chains (Megatron's ``ChainedOptimizer``: ``.chained_optimizers``), each searched;
* fp32 master weights: Megatron's ``float16_groups`` / ``fp32_from_float16_groups``, fairseq's (non-flat)
  ``fp16_params`` / ``fp32_params``; the master is returned first and its own optimizer state follows.

Optimizers that shard or flatten the state across ranks (Megatron's distributed optimizer, fairseq's flat fp32
``FP16Optimizer``) are refused by name: one expert's rows are not a slice of a local tensor there.
"""
from __future__ import annotations

from typing import Iterator, List, Optional

import torch

__all__ = ["param_state_tensors", "check_optimizer_supported"]

def _levels(optimizer) -> Iterator[object]:
    """The optimizer and every wrapper/inner optimizer below it, depth first through chains."""
    seen = set()
    stack = [optimizer]
    while stack:
        o = stack.pop(0)
        if o is None or id(o) in seen:
            continue
        seen.add(id(o))
        yield o
        chained = getattr(o, "chained_optimizers", None)
        if chained:
            stack[:0] = list(chained)
            continue
        if not isinstance(o, torch.optim.Optimizer):
            inner = getattr(o, "optimizer", None)
            if inner is not None and inner is not o:
                stack.insert(0, inner)


def check_optimizer_supported(optimizer) -> None:
    """Raise a clear error for optimizers whose expert state cannot be moved row by row."""
    for o in _levels(optimizer):
        name = type(o).__name__
        if name == "DistributedOptimizer":
            raise ValueError("megamoe-plugin placement: Megatron's distributed optimizer shards expert state over "
                             "ranks (drop --use-distributed-optimizer to move experts)")
        fp32 = getattr(o, "fp32_params", None)
        if torch.is_tensor(fp32) or (isinstance(fp32, dict) and fp32):
            raise ValueError("megamoe-plugin placement: fairseq's FP16Optimizer keeps one flat fp32 copy of all "
                             "parameters; use --fp16-no-flatten-grads or --memory-efficient-fp16 to move experts")


def _master_of(level, param) -> Optional[torch.Tensor]:
    for model_groups, main_groups in (("float16_groups", "fp32_from_float16_groups"),):
        mg, fg = getattr(level, model_groups, None), getattr(level, main_groups, None)
        if mg and fg:
            for g16, g32 in zip(mg, fg):
                for p16, p32 in zip(g16, g32):
                    if p16 is param:
                        return p32
    p16s, p32s = getattr(level, "fp16_params", None), getattr(level, "fp32_params", None)
    if isinstance(p16s, list) and isinstance(p32s, list):
        for p16, p32 in zip(p16s, p32s):
            if p16 is param:
                return p32
    return None


def param_state_tensors(optimizer, param: torch.Tensor) -> List[torch.Tensor]:
    """Tensors shaped like ``param`` that the optimizer keeps for it, in a fixed order: the fp32 master copy (if
    any), then the optimizer state of the tensor it updates, by state key. Empty when the optimizer has no state for
    it yet (before the first step) or ``optimizer`` is None."""
    if optimizer is None:
        return []
    out: List[torch.Tensor] = []
    key = param
    for level in _levels(optimizer):
        master = _master_of(level, param)
        if master is not None and master.shape == param.shape:
            out.append(master)
            key = master
        if isinstance(level, torch.optim.Optimizer):
            st = level.state.get(key)
            if st:
                out += [st[k] for k in sorted(st, key=str)
                        if torch.is_tensor(st[k]) and st[k].shape == param.shape]
                return out
    return out
