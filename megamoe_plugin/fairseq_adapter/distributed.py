"""Expert parallelism inside fairseq's data parallelism: process groups, expert gradients, gradient clipping.

fairseq has one data-parallel (DP) group. The plugin shards each MoE layer's experts over expert-parallel (EP)
groups of ``--moe-expert-parallel-size`` consecutive DP ranks (default: all of them); ranks with the same position
in their EP group hold the same experts and form an expert-data-parallel (EDP) group.

Gradients (``sync_expert_grads``, called right after fairseq's own all-reduce): expert parameters carry
``param.expert = True``, so fairseq's legacy DDP skips them (and c10d DDP ignores them through
``_ddp_params_and_buffers_to_ignore``). An expert's gradient already sums the contributions of every token of its
EP group (they reached it through the all-to-all); the plugin sums it over the EDP group and divides by the DP
size, which is exactly what DDP does to a shared parameter (fairseq then multiplies all gradients by
DP size / sample size).

Clipping (``clip_grad_norm_``): fairseq's own clipper leaves expert gradients out of the norm. This one computes
the true global norm: shared parameters once, plus every expert once (squared norms summed over the EP group),
the same value on every rank. With dynamic placement (``--moe-placement flexmoe``) an expert may have replicas
in several slots, each holding its full (all-reduced) gradient: each slot's row is weighted by 1 / replicas (free
slots 0, ``PlacementRuntime.slot_weights``), so the norm, and hence clipping, does not change with the placement.
"""
from __future__ import annotations

import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

_GROUPS: Dict[tuple, Tuple[object, object]] = {}
_ACTIVE: Optional[Tuple[object, object, int]] = None   # (ep group, edp group, dp size) of the model being trained
_PLACED: Dict[int, Tuple[weakref.ref, object]] = {}    # id(expert param) -> (weak ref to it, its PlacementRuntime)


def expert_groups(ep_size: int, dp_ranks: Optional[List[int]] = None) -> Tuple[object, object]:
    """(EP group, EDP group) of this rank for EP size `ep_size` over the DP ranks (default: the whole world).
    Collective on first use for a given size: every rank must call it. (None, None) when not distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        if ep_size > 1:
            raise RuntimeError(f"expert parallel size {ep_size} needs torch.distributed to be initialised")
        return None, None
    ranks = list(dp_ranks) if dp_ranks is not None else list(range(dist.get_world_size()))
    key = (ep_size, tuple(ranks))
    if key in _GROUPS:
        return _GROUPS[key]
    world, me = len(ranks), dist.get_rank()
    if world % ep_size:
        raise ValueError(f"expert parallel size {ep_size} does not divide the data-parallel size {world}")
    ep_group = edp_group = None
    for g in range(world // ep_size):                      # EP groups: consecutive blocks
        members = ranks[g * ep_size:(g + 1) * ep_size]
        grp = dist.group.WORLD if members == list(range(dist.get_world_size())) else dist.new_group(members)
        if me in members:
            ep_group = grp
    for i in range(ep_size):                               # EDP groups: same position in every block
        members = ranks[i::ep_size]
        grp = dist.new_group(members) if len(members) > 1 else None
        if me in members:
            edp_group = grp
    if ep_size == 1:
        ep_group = None
    _GROUPS[key] = (ep_group, edp_group)
    return ep_group, edp_group


def activate(ep_group, edp_group, dp_size: int) -> None:
    """Record the groups of the model this process trains (one MoE model per process)."""
    global _ACTIVE
    _ACTIVE = (ep_group, edp_group, dp_size)


def register_expert_placement(param: torch.Tensor, runtime) -> None:
    """Say which layer's placement lays out the rows of an expert parameter (or of the optimizer's fp32 copy of
    one): the clipper weights its rows by the replicas of their experts."""
    for key in [k for k, (ref, _) in _PLACED.items() if ref() is None]:
        del _PLACED[key]
    _PLACED[id(param)] = (weakref.ref(param), runtime)


def placement_of(param: torch.Tensor):
    """The PlacementRuntime registered for ``param``, or None."""
    entry = _PLACED.get(id(param))
    return entry[1] if entry is not None and entry[0]() is param else None


def _expert_sq_norm(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm of an expert gradient, every logical expert once (replicated rows weighted 1/replicas)."""
    rt = placement_of(param)
    if rt is None or rt.trivial or grad.dim() == 0 or grad.shape[0] != rt.slots_per_rank:
        return torch.linalg.vector_norm(grad, dtype=torch.float32) ** 2
    return rt.grad_sq_norm(grad, dtype=torch.float32)


def expert_params(module: torch.nn.Module) -> List[torch.nn.Parameter]:
    """Expert parameters (``param.expert``); gates that stay on their rank carry ``expert`` too, so fairseq's DDP
    leaves them alone, but are not experts."""
    return [p for p in module.parameters() if getattr(p, "expert", False) and p.requires_grad
            and not getattr(p, "megamoe_gate", False)]


@torch.no_grad()
def sync_expert_grads(module: torch.nn.Module) -> None:
    """Sum expert gradients over the EDP group and divide by the DP size (see the module docstring)."""
    if _ACTIVE is None:
        return
    _, edp_group, dp_size = _ACTIVE
    grads = [p.grad for p in expert_params(module) if p.grad is not None]
    if not grads:
        return
    if edp_group is not None:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=edp_group)
        torch._foreach_copy_(grads, [t.view_as(g) for t, g in zip(flat.split([g.numel() for g in grads]), grads)])
    if dp_size > 1:
        torch._foreach_div_(grads, float(dp_size))


@torch.no_grad()
def clip_grad_norm_(params, max_norm, aggregate_norm_fn=None, fallback=None) -> torch.Tensor:
    """fairseq's ``utils.clip_grad_norm_`` with expert gradients in the norm (every expert counted once)."""
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    gates = [p.grad for p in params if getattr(p, "grad", None) is not None and getattr(p, "megamoe_gate", False)
             and hasattr(p, "expert")]
    expert_params_ = [p for p in params if getattr(p, "grad", None) is not None and hasattr(p, "expert")
                      and not getattr(p, "megamoe_gate", False)]
    experts = [p.grad for p in expert_params_]
    if _ACTIVE is None or not experts:
        return fallback(params, max_norm, aggregate_norm_fn)
    shared = [p.grad for p in params if getattr(p, "grad", None) is not None and not hasattr(p, "expert")]
    dev = experts[0].device
    shared_norm = (torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32)
                                                          for g in shared])).to(dev)
                   if shared else torch.zeros((), device=dev))
    if aggregate_norm_fn is not None:
        shared_norm = aggregate_norm_fn(shared_norm)
    expert_sq = torch.stack([_expert_sq_norm(p, p.grad) for p in expert_params_]).sum()
    ep_group = _ACTIVE[0]
    if ep_group is not None:
        dist.all_reduce(expert_sq, group=ep_group)
    if gates:           # local gates: the mean over ranks of each rank's own share, identical everywhere
        from ..gate_sync import local_grad_sq_norm
        expert_sq = expert_sq + local_grad_sq_norm(gates, dist.group.WORLD).to(expert_sq)
    total = torch.sqrt(shared_norm.float() ** 2 + expert_sq)
    if max_norm > 0:
        coef = (float(max_norm) / (total + 1e-6)).clamp_(max=1)
        torch._foreach_mul_(shared + experts + gates, coef.to(experts[0].dtype))
    return total
