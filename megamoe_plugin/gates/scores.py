"""Router scores and the top-k choice: the math of megatron-core's ``topk_routing_with_score_function`` (0.19), in
dense [T, k] form (no [T, E] routing map is built).

- ``expert_scores``: softmax (fp32), sigmoid or sqrt(softplus) of the logits, [T, E] fp32;
- ``topk_ids``: the k best experts of each token, optionally group-limited (DeepSeek-V2/V3: the experts form
  ``num_groups`` equal groups, a group's score is the sum of its top k / ``group_topk`` scores, the token chooses
  among the experts of its ``group_topk`` best groups);
- ``combine_weights``: the chosen experts' weights. softmax with normalisation and k > 1: softmax over the k chosen
  logits (equal to the full softmax renormalised); otherwise (pre-softmax, which megatron-core requires for k = 1):
  the full softmax's probabilities; sigmoid /
  sqrtsoftplus: the chosen scores, divided by their sum when k > 1 and normalisation is on; then the top-k
  scaling factor; cast to the logits' dtype;
- ``aux_loss_scores``: the scores the balance losses use (softmax, or sigmoid / sqrtsoftplus normalised over all
  experts) and the router's unconstrained top-k on them;
- ``sinkhorn`` and ``quantile_select``: the two balancing rules that choose the experts themselves (S-BASE's
  Sinkhorn normalisation; quantile balancing's dual update of a per-expert bias).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def expert_scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """[T, E] fp32 scores of every expert."""
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1, dtype=torch.float32)
    if score_function == "sigmoid":
        return torch.sigmoid(logits.float())
    if score_function == "sqrtsoftplus":
        return F.softplus(logits.float()).sqrt()
    raise ValueError(f"unknown score function {score_function!r}")


def topk_ids(scores: torch.Tensor, k: int, num_groups: int = 0, group_topk: int = 0) -> torch.Tensor:
    """[T, k] ids of the k highest scores per row (descending), limited to the ``group_topk`` best groups."""
    if group_topk:
        T, E = scores.shape
        grouped = scores.view(T, num_groups, E // num_groups)
        per_group = k // group_topk
        group_scores = (grouped.amax(dim=-1) if per_group == 1 else                      # [T, G]
                        grouped.topk(per_group, dim=-1)[0].sum(dim=-1))
        chosen = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]          # [T, group_topk]
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
        scores = scores.masked_fill(~allowed.repeat_interleave(E // num_groups, dim=1), float("-inf"))
    return torch.topk(scores, k=k, dim=-1).indices


def combine_weights(logits: torch.Tensor, scores: torch.Tensor, ids: torch.Tensor, score_function: str,
                    normalize: bool, scaling_factor: float = 0.0) -> torch.Tensor:
    """[T, k] weights of the chosen experts, in the logits' dtype (module docstring)."""
    if score_function == "softmax":
        if normalize and ids.shape[1] > 1:
            w = torch.softmax(logits.gather(1, ids), dim=-1, dtype=torch.float32)
        else:
            w = scores.gather(1, ids)
    else:
        w = scores.gather(1, ids)
        if normalize and ids.shape[1] > 1:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor:
        w = w * scaling_factor
    return w.type_as(logits)


def aux_loss_scores(logits: torch.Tensor, scores: torch.Tensor, score_function: str, k: int,
                    topk: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(scores [T, E] fp32 summing to 1 per token, their top-k ids [T, k]): what the balance losses measure.
    ``topk``: those ids when the caller has them (a choice by the same scores, unconstrained)."""
    if score_function != "softmax":
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    return scores, topk if topk is not None else torch.topk(scores, k=k, dim=-1).indices


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """Sinkhorn normalisation of exp(cost) to (approximately) doubly stochastic (S-BASE); iterates until the column
    scaling changes by less than ``tol`` on average (one host read per iteration, as megatron-core)."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), device=cost.device, dtype=cost.dtype)
    eps, error, d1_old = 1e-8, 1e9, d1
    while error > tol:
        d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


def sinkhorn_select(logits: torch.Tensor, k: int, training: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(ids [T, k], weights [T, k]): in training the top-k of the Sinkhorn-normalised logits, else of the
    activations; the weights are the activations (sigmoid for k = 1, softmax otherwise) at the chosen experts,
    not renormalised."""
    act = torch.sigmoid(logits) if k == 1 else torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
    if training:
        with torch.no_grad():
            ids = torch.topk(sinkhorn(logits.float()), k=k, dim=1).indices
    else:
        ids = torch.topk(act, k=k, dim=1).indices
    return ids, act.gather(1, ids)


def quantile_select(logits: torch.Tensor, k: int, beta: torch.Tensor, update: bool
                    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Quantile balancing's dual coordinate-descent step on fp32 logits [m, E]: the top-k of logits - beta, and
    (when ``update``) each expert's column quantile that would give it m * k / E tokens."""
    num_tokens, num_experts = logits.shape
    top = (logits - beta).topk(k + 1, dim=1)
    ids = top.indices[:, :-1]
    if not update:
        return ids, None
    if (num_tokens * k) % num_experts:
        raise ValueError(f"quantile balancing needs tokens x top-k ({num_tokens} x {k}) divisible by the "
                         f"{num_experts} experts")
    col_target = num_tokens * k // num_experts
    alpha = top.values[:, -1:]
    return ids, (logits - alpha).topk(col_target + 1, dim=0).values[-1].contiguous()
