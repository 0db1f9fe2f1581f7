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

* Megatron's distributed optimizer (``DistributedOptimizer``, ZeRO-1 over the (expert-)data-parallel group):
  each rank holds one contiguous range of every parameter's flattened elements (``_get_model_param_range_map``):
  its fp32 main copy and the optimizer state of that range. An expert slot is the flat range
  ``[slot * n, (slot + 1) * n)`` of the bank parameter; ``slot_state_views`` returns the part of it this rank
  holds. The ranks of an expert-parallel group share their data-parallel rank and hold identical layers, so the
  two ends of a move hold the same part of the slot: a move sends it point to point as it sends a row.

fairseq's flat fp32 ``FP16Optimizer`` is refused by name: one expert's rows are not a slice of a local tensor there.
"""
from __future__ import annotations

import itertools
from typing import Iterator, List, Optional, Tuple

import torch

__all__ = ["optimizer_levels", "param_state_tensors", "slot_state_views", "check_optimizer_supported", "sharded_range",
           "master_of", "is_sharding"]

def optimizer_levels(optimizer) -> Iterator[object]:
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
    for o in optimizer_levels(optimizer):
        if is_sharding(o) and getattr(getattr(o, "ddp_config", None), "overlap_param_gather", False):
            raise ValueError("megamoe-plugin placement: --overlap-param-gather leaves the model's parameters stale "
                             "until the next forward, when experts move; drop --overlap-param-gather to move experts")
        fp32 = getattr(o, "fp32_params", None)
        if torch.is_tensor(fp32) or (isinstance(fp32, dict) and fp32):
            raise ValueError("megamoe-plugin placement: fairseq's FP16Optimizer keeps one flat fp32 copy of all "
                             "parameters; use --fp16-no-flatten-grads or --memory-efficient-fp16 to move experts")


def master_of(level, param) -> Optional[torch.Tensor]:
    """The fp32 master copy a mixed-precision wrapper at ``level`` keeps of ``param`` (None when it keeps none)."""
    mg, fg = getattr(level, "float16_groups", None), getattr(level, "fp32_from_float16_groups", None)  # Megatron
    p16s, p32s = getattr(level, "fp16_params", None), getattr(level, "fp32_params", None)            # fairseq
    pairs = itertools.chain((pair for g16, g32 in zip(mg or (), fg or ()) for pair in zip(g16, g32)),
                            zip(p16s, p32s) if isinstance(p16s, list) and isinstance(p32s, list) else ())
    return next((p32 for p16, p32 in pairs if p16 is param), None)         # stops at the first match


def is_sharding(level) -> bool:
    """Megatron's distributed optimizer (by its interface: parameter ranges and main-parameter groups)."""
    return hasattr(level, "model_param_group_index_map") and hasattr(level, "_get_model_param_range_map")


def sharded_range(optimizer, param) -> Optional[Tuple[object, int, int]]:
    """(the optimizer level, start, end) of ``param``'s flat elements that a sharding optimizer keeps on this rank;
    None when no sharding optimizer holds ``param``."""
    for level in optimizer_levels(optimizer):
        if is_sharding(level) and param in getattr(level, "model_param_group_index_map", {}):
            r = level._get_model_param_range_map(param)["param"]
            return level, int(r.start), int(r.end)
    return None


def _sharded_state(level, param) -> List[torch.Tensor]:
    """The distributed optimizer's 1-D tensors for this rank's range of ``param``: its main copy, then the optimizer
    state of that copy, by state key."""
    group, order = level.model_param_group_index_map[param]
    main = level.optimizer.param_groups[group]["params"][order]
    state = level.optimizer.state.get(main) or {}
    return [main] + [state[k] for k in sorted(state, key=str) if torch.is_tensor(state[k])
                     and state[k].shape == main.shape]


def slot_state_views(optimizer, param: torch.Tensor, slot: int) -> List[torch.Tensor]:
    """Views of everything the optimizer keeps for row ``slot`` of ``param`` on this rank (``param_state_tensors``
    rows; with a sharding optimizer, the part of the slot's flat range in this rank's shard, possibly none)."""
    held = sharded_range(optimizer, param) if optimizer is not None else None
    if held is None:
        return [t[slot] for t in param_state_tensors(optimizer, param)]
    level, start, end = held
    n = param[0].numel()
    lo, hi = max(start, slot * n), min(end, (slot + 1) * n)
    if lo >= hi:
        return []
    return [t[lo - start:hi - start] for t in _sharded_state(level, param)]


def param_state_tensors(optimizer, param: torch.Tensor) -> List[torch.Tensor]:
    """Tensors shaped like ``param`` that the optimizer keeps for it, in a fixed order: the fp32 master copy (if
    any), then the optimizer state of the tensor it updates, by state key. Empty when the optimizer has no state for
    it yet (before the first step) or ``optimizer`` is None."""
    if optimizer is None:
        return []
    out: List[torch.Tensor] = []
    key = param
    for level in optimizer_levels(optimizer):
        master = master_of(level, param)
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
