"""Expert capacity: how many rows an expert takes per source rank, and which assignments keep a row.

``capacity_from_factor``: ceil(tokens * k / E * factor) (megatron-core's ``get_capacity`` in its order of
operations, so the ceiling agrees to the last bit), at least ``min_capacity``; the same for every expert.

``apply_capacity`` keeps, per expert, the first ``capacity[e]`` assignments in a priority order and gives each
kept one its slot (its position in the expert's buffer):

- ``choice`` (GShard §2.2, fairseq's moe branch, DeepSpeed): all first choices in token order, then all second
  choices, ...;
- ``position`` (megatron-core ``--moe-token-drop-policy position``): token order;
- ``probs`` (megatron-core's default): the highest combine weights first.

Positions come from stable argsorts of the T*k assignments, so no [T, E] or [T, E, C] mask is built.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch


def masked_expert_ids(expert_ids: torch.Tensor, kept: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Flattened (token-major) expert ids with unkept assignments replaced by the sentinel `num_experts`."""
    return torch.where(kept, expert_ids, num_experts).reshape(-1)


def capacity_from_factor(factor: float, num_tokens: int, top_k: int, num_experts: int, min_capacity: int
                         ) -> List[int]:
    """Per-expert capacity ceil(T * k / E * factor), at least `min_capacity`, the same for every expert."""
    c = max(int(math.ceil((num_tokens * top_k / num_experts) * factor)), min_capacity)
    return [c] * num_experts


def apply_capacity(expert_ids: torch.Tensor, kept: torch.Tensor, capacity: Sequence[int], policy: str = "choice",
                   weights: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(kept [T, k], slot [T, k]): which assignments keep a row under ``policy`` and each one's position in its
    expert's buffer (below the expert's capacity when kept). Already-unkept assignments claim no slot.
    ``weights`` [T, k]: the combine weights (policy ``probs``)."""
    if policy == "choice":
        return _keep_in_order(expert_ids, kept, capacity, choice_major=True)
    if policy not in ("probs", "position"):
        raise ValueError(f"unknown drop policy {policy!r}")
    if len(set(capacity)) > 1:                 # per-expert capacities (dynamic capacity): a sort per priority
        if policy == "probs":
            return _keep_by_weight(expert_ids, kept, capacity, weights)
        return _keep_in_order(expert_ids, kept, capacity, choice_major=False)
    mask = _megatron_capacity_mask(expert_ids, kept, len(capacity), capacity[0], policy, weights)
    kept = kept & mask.gather(1, expert_ids)
    return kept, _slots(expert_ids, kept, len(capacity))


def _megatron_capacity_mask(expert_ids, kept, E: int, cap: int, policy: str, weights) -> torch.Tensor:
    """megatron-core's ``apply_router_token_dropping`` for one capacity shared by every expert, as a dense [T, E]
    mask: per expert, the ``cap`` tokens of its column (the weights, or the 0/1 routing map) that ``torch.topk``
    returns, ties included; every token when ``cap`` >= T."""
    T = expert_ids.shape[0]
    if cap >= T:
        return torch.ones(T, E, dtype=torch.bool, device=expert_ids.device)
    if policy == "probs":
        if weights is None:
            raise ValueError("drop policy 'probs' needs the combine weights")
        values = torch.zeros(T, E, dtype=weights.dtype, device=weights.device)
        values.scatter_(1, expert_ids, (weights * kept).detach())
    else:
        values = torch.zeros(T, E, dtype=torch.int32, device=expert_ids.device)
        values.scatter_(1, expert_ids, kept.to(torch.int32))
    chosen = torch.topk(values, k=cap, dim=0, sorted=False).indices
    return torch.zeros(T, E, dtype=torch.bool, device=expert_ids.device).scatter_(0, chosen, True)


def _slots(expert_ids, kept, num_experts: int) -> torch.Tensor:
    """Each kept assignment's position among its expert's kept assignments, in token order."""
    flat = masked_expert_ids(expert_ids, kept, num_experts)
    return _positions(flat, torch.argsort(flat, stable=True), num_experts).view_as(expert_ids)


def _positions(flat: torch.Tensor, order: torch.Tensor, num_experts: int) -> torch.Tensor:
    counts = torch.bincount(flat, minlength=num_experts + 1)
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.empty_like(flat)
    pos[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    return pos


def _keep_in_order(expert_ids, kept, capacity, choice_major: bool):
    T, k = expert_ids.shape
    num_experts = len(capacity)
    cap = torch.tensor(list(capacity) + [0], dtype=torch.long, device=expert_ids.device)
    ids, kp = (expert_ids.t(), kept.t()) if choice_major else (expert_ids, kept)
    flat = masked_expert_ids(ids, kp, num_experts)
    pos = _positions(flat, torch.argsort(flat, stable=True), num_experts)
    new_kept = pos < cap[flat]
    if choice_major:
        return new_kept.view(k, T).t() & kept, pos.view(k, T).t()
    return new_kept.view(T, k) & kept, pos.view(T, k)


def _keep_by_weight(expert_ids, kept, capacity, weights):
    if weights is None:
        raise ValueError("drop policy 'probs' needs the combine weights")
    num_experts = len(capacity)
    cap = torch.tensor(list(capacity) + [0], dtype=torch.long, device=expert_ids.device)
    flat = masked_expert_ids(expert_ids, kept, num_experts)
    by_weight = torch.argsort(weights.detach().reshape(-1).float(), descending=True, stable=True)
    pos = _positions(flat, by_weight[torch.argsort(flat[by_weight], stable=True)], num_experts)
    new_kept = (pos < cap[flat]).view_as(kept) & kept
    return new_kept, _slots(expert_ids, new_kept, num_experts)


def capacity_mask_counts(expert_ids, kept, capacity: Sequence[int], policy: str, weights,
                         padding: Optional[torch.Tensor], kept_counts: torch.Tensor) -> torch.Tensor:
    """Rows per expert when every expert is padded to its capacity, as megatron-core counts them for the expert
    bias (its routing map is then the whole capacity mask: ``capacity`` rows, or all T when the capacity exceeds
    T, less padding tokens). For the ``choice`` policy or per-expert capacities: ``kept_counts``."""
    if policy == "choice" or len(set(capacity)) > 1:
        return kept_counts
    mask = _megatron_capacity_mask(expert_ids, kept, len(capacity), capacity[0], policy, weights)
    if padding is not None:
        mask = mask & ~padding.unsqueeze(1)
    return mask.sum(0)
