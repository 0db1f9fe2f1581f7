"""Checkpoints by logical expert id, whatever the placement (FlexMoE paper 001 §3.3: placement is a runtime
concern; nothing saved may depend on where experts were).

The ExpertBank of rank q holds ``slots_per_rank`` rows; the placement says which logical expert each row is
(several rows across ranks for a replicated expert, none for a free slot). A checkpoint holds one row per logical
expert, [E, ...], in expert order, written from the expert's *owner* (its first replica; replicas are identical).
Loading slices that back into any placement and any expert-parallel size: every slot gets its expert's row, free
slots get zeros.

* ``logical_from_gathered(rows, runtime)``: [P * slots, ...] (an all-gather/gather of every rank's bank tensor, in
  rank order) -> [E, ...];
* ``local_from_logical(full, runtime)``: [E, ...] -> this rank's [slots, ...];
* ``gather_logical(bank, runtime, optimizer)``: collective over the expert-parallel group, every rank gets
  {name: [E, ...]} for the bank's parameters and their optimizer state (``name/0``, ``name/1``, ... in
  ``optim_state.param_state_tensors`` order: master weights first, then the state by key);
* ``load_logical(bank, runtime, full, optimizer)``: the inverse, on every rank.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist

from .optim_state import param_state_tensors

__all__ = ["logical_from_gathered", "local_from_logical", "gather_logical", "load_logical"]


def logical_from_gathered(rows: torch.Tensor, runtime) -> torch.Tensor:
    index = torch.tensor(runtime.state.logical_rows(), dtype=torch.long, device=rows.device)
    return rows.index_select(0, index)


def local_from_logical(full: torch.Tensor, runtime, rank: Optional[int] = None) -> torch.Tensor:
    slots = runtime.state.slots_of(runtime.ep.rank if rank is None else rank)
    if full.shape[0] != runtime.num_experts:
        raise ValueError(f"expected [{runtime.num_experts}, ...] expert rows, got {tuple(full.shape)}")
    out = full.new_zeros((len(slots),) + tuple(full.shape[1:]))
    held = [(i, e) for i, e in enumerate(slots) if e is not None]
    if held:
        idx = torch.tensor([i for i, _ in held], device=full.device)
        src = torch.tensor([e for _, e in held], device=full.device)
        out.index_copy_(0, idx, full.index_select(0, src))
    return out


def _gather(t: torch.Tensor, runtime) -> torch.Tensor:
    if runtime.ep.size == 1:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(runtime.ep.size)]
    dist.all_gather(parts, t.detach().contiguous(), group=runtime.ep.group)
    return torch.cat(parts, 0)


def gather_logical(bank, runtime, optimizer=None) -> Dict[str, torch.Tensor]:
    """Collective over the expert-parallel group: the bank's parameters (and optimizer state) as [E, ...]."""
    out = {}
    for name, p in bank.named_parameters():
        out[name] = logical_from_gathered(_gather(p, runtime), runtime)
        for i, t in enumerate(param_state_tensors(optimizer, p)):
            out[f"{name}/{i}"] = logical_from_gathered(_gather(t, runtime), runtime)
    return out


@torch.no_grad()
def load_logical(bank, runtime, full: Dict[str, torch.Tensor], optimizer=None) -> None:
    """Write [E, ...] tensors (``gather_logical``'s format) into this rank's slots under its placement."""
    for name, p in bank.named_parameters():
        p.copy_(local_from_logical(full[name].to(p.dtype), runtime))
        for i, t in enumerate(param_state_tensors(optimizer, p)):
            if f"{name}/{i}" in full:
                t.copy_(local_from_logical(full[f"{name}/{i}"].to(t.dtype), runtime))
