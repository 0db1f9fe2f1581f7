"""MoE-of-predictors heads: cooperation vs specification loss, and hierarchical MoEs (DynaMoE paper 000).

This module owns the MoE whose experts *predict* (each chosen expert emits its own prediction over C classes, the
MoE output is the gate-weighted mixture of them), the two losses Jacobs et al. (1991) give for training it, and the
nesting of such MoEs as experts of an outer one.  Pure PyTorch; it never imports megatron or fairseq.

- §2.1, Eq. 1, the *cooperation* loss L(y, sum_i g_i O_i): the loss of the MoE's aggregated output.  Each expert's
  gradient depends on the other experts' predictions.
- §2.1, Eq. 2, the *specification* loss sum_i g_i L(y, O_i): every chosen expert is scored on its own prediction,
  so its gradient depends on its prediction alone.
- Appendix A: the specification loss needs all k predictions of a token, not the aggregate.  ``ExpertPredictions``
  is that pair of outputs: its ``preds`` are AggregateSpec's concatenated predictions, :func:`aggregate` is
  Aggregate's output (the model's prediction, for accuracy or the cooperation loss).
- §2.1 (Jordan & Jacobs 1993) and Appendix A, Figure 11: hierarchical MoEs, an MoE as an expert of an outer MoE.
  :func:`flatten_nested` turns an outer choice i with inner predictions (weights w_j) into leaves weighted
  g_i * w_j, so either loss applies to the whole tree; with ``inner_loss="cooperation"`` each inner MoE presents
  its aggregate as one prediction instead (inner cooperation, outer specification, as Figure 11 allows).

Convention: ``preds`` are logits or log-probabilities (the losses apply ``log_softmax``, which leaves
log-probabilities unchanged), O_i = softmax(preds_i) are *probabilities*, so sum_i g_i O_i is a proper mixture
distribution when the weights sum to 1 (Jacobs et al. 1991); with L the negative log-likelihood, Eq. 1 is the
mixture NLL -log sum_i g_i O_i[y] and Eq. 2 the gate-weighted cross-entropy sum_i g_i (-log O_i[y]).  The weights
are used as the gate gives them (the naive gate renormalises the top-k, k > 1, to sum to 1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import MoEConfig
from ..gates import build_gate

__all__ = ["LOSS_KINDS", "ExpertPredictions", "flatten_nested", "log_aggregate", "aggregate", "cooperation_loss",
           "specification_loss", "moe_predictor_loss", "PredictorMoE", "hierarchical"]

LOSS_KINDS = ("cooperation", "specification")


def _check_kind(kind: str, name: str) -> None:
    if kind not in LOSS_KINDS:
        raise ValueError(f"{name}={kind!r}: unknown MoE predictor loss; expected one of {', '.join(LOSS_KINDS)}")


@dataclass
class ExpertPredictions:
    """The chosen experts' predictions of T tokens (AggregateSpec's output, Appendix A).

    preds [T, k, C] logits or log-probabilities of each chosen expert; weights [T, k] their gate weights (0 where an
    assignment was dropped); expert_ids [T, k] long (leaf ids in a flattened hierarchy: outer_id * E_inner +
    inner_id); aux_loss: the gates' aux losses of the call (scaled, differentiable), None when not from a module.
    """
    preds: torch.Tensor
    weights: torch.Tensor
    expert_ids: torch.Tensor
    aux_loss: Optional[torch.Tensor] = None

    def __post_init__(self):
        if self.preds.dim() != 3:
            raise ValueError(f"preds must be [T, k, C], got shape {tuple(self.preds.shape)}")
        if tuple(self.weights.shape) != tuple(self.preds.shape[:2]):
            raise ValueError(f"weights shape {tuple(self.weights.shape)} must be preds' [T, k] "
                             f"{tuple(self.preds.shape[:2])}")
        if tuple(self.expert_ids.shape) != tuple(self.preds.shape[:2]):
            raise ValueError(f"expert_ids shape {tuple(self.expert_ids.shape)} must be preds' [T, k] "
                             f"{tuple(self.preds.shape[:2])}")

    @property
    def num_tokens(self) -> int:
        return self.preds.shape[0]

    @property
    def top_k(self) -> int:
        return self.preds.shape[1]

    @property
    def num_classes(self) -> int:
        return self.preds.shape[2]


def flatten_nested(weights: torch.Tensor, expert_ids: torch.Tensor, inner: ExpertPredictions,
                   inner_num_experts: int) -> ExpertPredictions:
    """Outer choices (weights g [T, k1], ids [T, k1]) of inner MoEs -> the tree's leaves [T, k1*k2, C].

    ``inner`` holds one row per outer assignment, token-major (row t*k1 + i is token t's choice i), each with k2
    predictions and weights w.  Leaf (i, j) gets weight g_i * w_ij and id outer_id * inner_num_experts + inner_id.
    Composes: ``inner`` may itself be a flattened hierarchy.
    """
    T, k1 = weights.shape
    if tuple(expert_ids.shape) != (T, k1):
        raise ValueError(f"expert_ids shape {tuple(expert_ids.shape)} must match weights' {(T, k1)}")
    if inner.num_tokens != T * k1:
        raise ValueError(f"inner has {inner.num_tokens} rows; expected one per outer assignment, T*k1 = {T * k1}")
    if inner_num_experts < 1:
        raise ValueError(f"inner_num_experts={inner_num_experts!r}: must be >= 1")
    k2, C = inner.top_k, inner.num_classes
    leaf_w = weights.unsqueeze(-1) * inner.weights.view(T, k1, k2)
    leaf_ids = expert_ids.unsqueeze(-1) * inner_num_experts + inner.expert_ids.view(T, k1, k2)
    return ExpertPredictions(inner.preds.reshape(T, k1 * k2, C), leaf_w.reshape(T, k1 * k2),
                             leaf_ids.reshape(T, k1 * k2), inner.aux_loss)


def _log_weights(weights: torch.Tensor) -> torch.Tensor:
    """log g with log 0 = -inf exactly (a dropped assignment is no part of the mixture); the clamp keeps the unused
    branch finite so the gradient has no NaN (it is 0 at g = 0).  A token whose weights are all 0 has no mixture:
    its cooperation loss is inf (the PredictorMoE's dropless gate never drops)."""
    logs = torch.log(weights.clamp_min(torch.finfo(weights.dtype).tiny))
    return torch.where(weights > 0, logs, torch.full_like(logs, -math.inf))


def log_aggregate(p: ExpertPredictions) -> torch.Tensor:
    """log sum_i g_i softmax(O_i): the log of the mixture [T, C], by logsumexp (stable)."""
    return torch.logsumexp(_log_weights(p.weights).unsqueeze(-1) + F.log_softmax(p.preds, dim=-1), dim=1)


def aggregate(p: ExpertPredictions) -> torch.Tensor:
    """The MoE output sum_i g_i O_i [T, C] with O_i = softmax(preds_i) (the paper's Aggregate): a mixture of
    probability distributions, a proper distribution when the weights sum to 1."""
    return (p.weights.unsqueeze(-1) * torch.softmax(p.preds, dim=-1)).sum(1)


def _targets(p: ExpertPredictions, target: torch.Tensor, ignore_index: int):
    y = target.reshape(-1)
    if y.numel() != p.num_tokens:
        raise ValueError(f"target has {y.numel()} elements (shape {tuple(target.shape)}); the predictions are of "
                         f"{p.num_tokens} tokens")
    valid = y != ignore_index
    return torch.where(valid, y, 0).long(), valid


def _masked_mean(per_token: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean over the non-ignored tokens (0, still differentiable, when every token is ignored)."""
    return (per_token * valid).sum() / valid.sum().clamp_min(1)


def _target_log_probs(p: ExpertPredictions, y: torch.Tensor) -> torch.Tensor:
    """log softmax(O_i)[y] of every chosen expert, [T, k]."""
    idx = y.view(-1, 1, 1).expand(-1, p.top_k, 1)
    return F.log_softmax(p.preds, dim=-1).gather(2, idx).squeeze(2)


def cooperation_loss(p: ExpertPredictions, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Eq. 1: L(y, sum_i g_i O_i) with L the NLL of the mixture, -log sum_i g_i softmax(O_i)[y] (by logsumexp over
    log g_i + log_softmax), averaged over the tokens whose target is not ``ignore_index``."""
    y, valid = _targets(p, target, ignore_index)
    nll = -torch.logsumexp(_log_weights(p.weights) + _target_log_probs(p, y), dim=1)
    return _masked_mean(nll, valid)


def specification_loss(p: ExpertPredictions, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Eq. 2 (AggregateSpec): sum_i g_i L(y, O_i) with L each chosen expert's own cross-entropy -log
    softmax(O_i)[y]; uses all k predictions, not the aggregate; averaged over the non-ignored tokens."""
    y, valid = _targets(p, target, ignore_index)
    per_token = -(p.weights * _target_log_probs(p, y)).sum(1)
    return _masked_mean(per_token, valid)


def moe_predictor_loss(p: ExpertPredictions, target: torch.Tensor, kind: str,
                       ignore_index: int = -100) -> torch.Tensor:
    """``kind`` = "cooperation" (Eq. 1) or "specification" (Eq. 2)."""
    _check_kind(kind, "kind")
    fn = cooperation_loss if kind == "cooperation" else specification_loss
    return fn(p, target, ignore_index)


_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu}


class PredictorMoE(nn.Module):
    """An MoE head whose experts predict: x [..., H] -> gate (the core's, top-k) -> each chosen expert's prediction
    over ``num_classes`` on its own tokens only -> :class:`ExpertPredictions` of the T = x[..., 0].numel() tokens.

    Leaf experts are Linear H -> C (``expert_hidden=0``) or MLPs H -> expert_hidden -> C, stacked as [E, ...]
    weights.  With ``inner`` (a factory of PredictorMoE) every expert is itself an MoE (hierarchical, §2.1): with
    ``inner_loss="specification"`` the result is the flattened tree (k * k_inner leaves, weights g_i * w_ij, so
    the loss applies to every leaf); with ``"cooperation"`` each inner MoE presents one prediction, the log of its
    mixture, so an outer specification loss sees k predictions (Figure 11's mixed losses).

    The hot path: one stable argsort of the assignments by expert id, then a loop over experts (never tokens),
    each on its contiguous group; one host sync (the group sizes).  ``assigned`` [T, k] routes by given expert ids
    (the gate still gives the weights and aux losses), e.g. a fixed assignment.  After a call ``aux_loss`` holds
    the gates' aux losses (outer + inner, scaled, differentiable), as the core MoELayer's.
    """

    def __init__(self, hidden_size: int, num_classes: int, num_experts: int, top_k: int = 1, *,
                 expert_hidden: int = 0, activation: str = "gelu", gate: str = "naive",
                 normalize_top_k: bool = True, aux_loss_coeff: float = 0.0, init_std: float = 0.02,
                 inner: Optional[Callable[[], "PredictorMoE"]] = None, inner_loss: str = "specification"):
        super().__init__()
        for name, v in (("hidden_size", hidden_size), ("num_classes", num_classes), ("num_experts", num_experts)):
            if v < 1:
                raise ValueError(f"{name}={v!r}: must be >= 1")
        if expert_hidden < 0:
            raise ValueError(f"expert_hidden={expert_hidden!r}: must be >= 0 (0 = one Linear H -> C)")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation={activation!r}: expected one of {', '.join(_ACTIVATIONS)}")
        _check_kind(inner_loss, "inner_loss")
        self.hidden_size, self.num_classes, self.num_experts, self.top_k = hidden_size, num_classes, num_experts, top_k
        self.expert_hidden, self.activation, self.inner_loss = expert_hidden, activation, inner_loss
        self.gate = build_gate(MoEConfig(num_experts=num_experts, top_k=top_k, gate=gate,
                                         normalize_top_k=normalize_top_k, aux_loss_coeff=aux_loss_coeff,
                                         z_loss_coeff=0.0), hidden_size)
        torch.nn.init.normal_(self.gate.weight, std=init_std)
        self.aux_loss: torch.Tensor = torch.zeros(())
        if inner is not None:
            self.inner = nn.ModuleList(inner() for _ in range(num_experts))
            for m in self.inner:
                if not isinstance(m, PredictorMoE):
                    raise ValueError(f"inner factory made a {type(m).__name__}; expected a PredictorMoE")
                if (m.hidden_size, m.num_classes) != (hidden_size, num_classes):
                    raise ValueError(f"inner MoE is H={m.hidden_size}, C={m.num_classes}; the outer is "
                                     f"H={hidden_size}, C={num_classes}")
                if (m.preds_per_token, m.leaf_experts) != (self.inner[0].preds_per_token, self.inner[0].leaf_experts):
                    raise ValueError("the inner factory made MoEs of different shapes (top_k or nesting)")
            return
        self.inner = None
        dims = [hidden_size, expert_hidden, num_classes] if expert_hidden else [hidden_size, num_classes]
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList()
        for fan_in, fan_out in zip(dims[:-1], dims[1:]):   # nn.Linear's init, per expert
            bound = 1.0 / math.sqrt(fan_in)
            self.weights.append(nn.Parameter(torch.empty(num_experts, fan_in, fan_out).uniform_(-bound, bound)))
            self.biases.append(nn.Parameter(torch.empty(num_experts, fan_out).uniform_(-bound, bound)))

    @property
    def leaf_experts(self) -> int:
        """Distinct prediction ids of the output (the leaves of the flattened tree; an inner MoE presenting its
        aggregate counts as one)."""
        if self.inner is None or self.inner_loss == "cooperation":
            return self.num_experts
        return self.num_experts * self.inner[0].leaf_experts

    @property
    def preds_per_token(self) -> int:
        """k of the output ExpertPredictions: top_k, times the inner MoE's when its leaves are flattened."""
        if self.inner is None or self.inner_loss == "cooperation":
            return self.top_k
        return self.top_k * self.inner[0].preds_per_token

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Leaf expert ``e`` on its tokens x [n, H] -> logits [n, C]."""
        act = _ACTIVATIONS[self.activation]
        h = x
        for layer, (w, b) in enumerate(zip(self.weights, self.biases)):
            if layer:
                h = act(h)
            h = torch.addmm(b[e], h, w[e])
        return h

    def _inner_forward(self, e: int, x: torch.Tensor) -> ExpertPredictions:
        sub = self.inner[e](x)
        if self.inner_loss == "cooperation":      # the inner MoE's aggregate as one prediction
            n = x.shape[0]
            return ExpertPredictions(log_aggregate(sub).unsqueeze(1), x.new_ones(n, 1),
                                     torch.zeros(n, 1, dtype=torch.long, device=x.device), sub.aux_loss)
        return sub

    def forward(self, x: torch.Tensor, assigned: Optional[torch.Tensor] = None) -> ExpertPredictions:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"input's last dim is {x.shape[-1]}; this PredictorMoE has hidden_size "
                             f"{self.hidden_size}")
        x2 = x.reshape(-1, self.hidden_size)
        routing = self.gate(x2, assigned=assigned)
        routing.join()
        T, k = routing.expert_ids.shape
        flat = routing.masked_ids                               # [T*k], E for dropped assignments (sort last)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts + 1).tolist()
        n_kept = sum(counts[: self.num_experts])
        src = x2.index_select(0, torch.div(order[:n_kept], k, rounding_mode="floor"))
        outs: List = []
        start = 0
        for e in range(self.num_experts):
            n = counts[e]
            if n:
                rows = src[start:start + n]
                outs.append(self.expert_forward(e, rows) if self.inner is None else self._inner_forward(e, rows))
            start += n
        aux = routing.aux_loss()
        kept_rows = order[:n_kept]
        if self.inner is None:
            preds = x2.new_zeros(T * k, self.num_classes)
            if outs:
                preds = preds.index_copy(0, kept_rows, torch.cat(outs))
            result = ExpertPredictions(preds.view(T, k, self.num_classes), routing.weights, routing.expert_ids, aux)
        else:
            k2 = 1 if self.inner_loss == "cooperation" else self.inner[0].preds_per_token
            preds = x2.new_zeros(T * k, k2, self.num_classes)
            w = x2.new_zeros(T * k, k2)
            ids = torch.zeros(T * k, k2, dtype=torch.long, device=x2.device)
            if outs:
                preds = preds.index_copy(0, kept_rows, torch.cat([o.preds for o in outs]))
                w = w.index_copy(0, kept_rows, torch.cat([o.weights for o in outs]))
                ids = ids.index_copy(0, kept_rows, torch.cat([o.expert_ids for o in outs]))
                aux = aux + sum(o.aux_loss for o in outs)
            inner_e = self.inner[0].leaf_experts if self.inner_loss == "specification" else 1
            result = flatten_nested(routing.weights, routing.expert_ids, ExpertPredictions(preds, w, ids), inner_e)
            result.aux_loss = aux
        self.aux_loss = aux
        return result

    def extra_repr(self) -> str:
        kind = (f"inner={self.inner_loss}" if self.inner is not None
                else f"expert_hidden={self.expert_hidden}, activation={self.activation}")
        return (f"hidden_size={self.hidden_size}, num_classes={self.num_classes}, num_experts={self.num_experts}, "
                f"top_k={self.top_k}, {kind}")


def hierarchical(hidden_size: int, num_classes: int, outer_experts: int, inner_experts: int,
                 outer_top_k: int = 1, inner_top_k: int = 1, *, inner_loss: str = "specification",
                 **kwargs) -> PredictorMoE:
    """A two-level PredictorMoE: ``outer_experts`` inner MoEs of ``inner_experts`` leaf experts each.
    ``kwargs`` (expert_hidden, activation, gate, normalize_top_k, aux_loss_coeff, init_std) go to every level."""
    def make_inner() -> PredictorMoE:
        return PredictorMoE(hidden_size, num_classes, inner_experts, inner_top_k, **kwargs)
    return PredictorMoE(hidden_size, num_classes, outer_experts, outer_top_k, inner=make_inner,
                        inner_loss=inner_loss, **kwargs)
