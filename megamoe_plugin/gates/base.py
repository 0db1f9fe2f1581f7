"""Routing (what every gate returns), the Gate base class and the GShard capacity drop rule.

A gate maps tokens x[T, H] to a Routing: expert ids [T, k], combine weights [T, k], which of the T*k assignments
survive (``kept``), per-expert kept counts, the dropped count, and its aux losses (already scaled by their
coefficients). Subclasses implement ``select`` (which experts) and may override ``balance_loss``. The base class
owns what all gates share: fp32 logits, Switch-style multiplicative jitter (paper: Switch Transformer §2.2),
the router z-loss (ST-MoE), weight normalisation over the kept choices, and the capacity rule.

Capacity rule (GShard §2.2, the rule of fairseq's moe branch and DeepSpeed): each expert e has ``capacity[e]``
slots per source rank; assignments claim slots in priority order (all first choices in token order, then all
second choices, ...); an assignment whose position is >= capacity[e] is dropped. Positions come from one stable
argsort, so no dense [T, E] or [T, E, C] mask is built. Capacity is a per-expert list so that dynamic capacity
(DynaMoE) can change it between steps; ``Routing.demand`` keeps the pre-capacity assignments per expert (what
dynamic capacity sizes the buffers from).

Cached assignments (DynaMoE §4.2, ``dynamic/assignment_cache.py``): ``forward(x, capacity, assigned=ids)`` routes
by the given ids [T, k] instead of the gate's choice. Which assignments are kept, their buffer slots and the counts
come from those ids alone, so dispatch and the experts need nothing from the gate; the gate still computes its
logits (the combine weights are its probabilities at the assigned experts, so it keeps training), its balance loss
and its own choice (``Routing.gate_ids``, which refreshes the cache). On a GPU that gate work runs on a side stream,
concurrently with the dispatch and the experts; ``Routing.join()`` (called before the combine) waits for it.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import MoEConfig
from ..parallel import ExpertParallel


@dataclass
class Routing:
    expert_ids: torch.Tensor            # [T, k] long, global expert ids
    weights: torch.Tensor               # [T, k] combine weights (0 where dropped)
    kept: torch.Tensor                  # [T, k] bool
    counts: torch.Tensor                # [E] long, kept assignments per expert (this rank's tokens)
    dropped: torch.Tensor               # [] long, assignments dropped (capacity, random routing, no room)
    aux_losses: Dict[str, torch.Tensor] = field(default_factory=dict)
    slots: Optional[torch.Tensor] = None  # [T, k] long, position in the expert's capacity buffer (capacity mode)
    demand: Optional[torch.Tensor] = None  # [E] long, assignments per expert before the capacity cut (capacity mode)
    gate_ids: Optional[torch.Tensor] = None  # [T, k] the gate's own choice when expert_ids came from a cache
    side_stream: Any = None               # CUDA stream still computing the weights / aux losses (cached routing)

    def join(self) -> None:
        """Make the current stream wait for the gate's side stream (no-op on CPU or without caching)."""
        if self.side_stream is not None:
            torch.cuda.current_stream().wait_stream(self.side_stream)
            self.side_stream = None

    @property
    def chosen_ids(self) -> torch.Tensor:
        """The gate's own choice [T, k] (what an assignment cache stores and compares)."""
        return self.gate_ids if self.gate_ids is not None else self.expert_ids

    @cached_property
    def masked_ids(self) -> torch.Tensor:
        """[T*k] expert id of every assignment, token-major, with dropped ones set to E (they sort last).
        Computed once per call: the counts and the dropless dispatcher's argsort both read it."""
        return masked_expert_ids(self.expert_ids, self.kept, self.counts.numel())

    @property
    def top_k(self) -> int:
        return self.expert_ids.shape[1]

    def aux_loss(self) -> torch.Tensor:
        if not self.aux_losses:
            return self.weights.new_zeros(())
        return sum(self.aux_losses.values())


class Gate(nn.Module):
    """Linear router + shared machinery. Subclasses set ``top_k`` rules in ``select``."""

    def __init__(self, cfg: MoEConfig, hidden_size: int, ep: Optional[ExpertParallel] = None, topology=None):
        super().__init__()
        self.cfg = cfg
        self.num_experts = cfg.num_experts
        self.top_k = cfg.top_k
        self.ep = ep or ExpertParallel(None)
        self.topology = topology
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden_size))
        nn.init.normal_(self.weight, std=cfg.init_std)
        self.weight.megamoe_gate = True          # found by gate_sync.py (--moe-gate-sync local / average:K)

    # --- the gate's rules, asked before any model exists ------------------------------------------------------
    fixed_top_k: Optional[int] = None       # the only top-k this gate routes with (None: any)
    needs_topology = False                  # its routing reads the job's topology (nodes, link bandwidths)
    default_gate_sync = "all"               # what --moe-gate-sync auto means for this gate

    @classmethod
    def validate_config(cls, cfg: MoEConfig) -> None:
        """Raise ``ConfigError`` (naming the flag) for options this gate cannot work with; no topology, no
        environment (``MoEConfig.validate`` calls it)."""
        from ..config import ConfigError, flag
        if cls.fixed_top_k is not None and cfg.top_k != cls.fixed_top_k:
            raise ConfigError(f"{flag('top_k')}={cfg.top_k!r}: the {cfg.gate} gate routes each token to "
                              f"{cls.fixed_top_k} expert{'s' if cls.fixed_top_k > 1 else ''}; use {flag('top_k')}="
                              f"{cls.fixed_top_k} (or the naive "
                              f"gate for other k)")

    @classmethod
    def check_options(cls, cfg: MoEConfig, topology) -> List[str]:
        """Before any model exists: raise ``ConfigError`` (naming the flag) for settings this gate cannot work
        with, and return warnings for settings it accepts but that make it behave like another gate.
        ``topology`` is the job's Topology (``cfg.build_topology()``)."""
        return []

    def select(self, logits: torch.Tensor, probs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Return (expert_ids [T, k] long, kept [T, k] bool) from fp32 logits and probabilities [T, E]."""
        raise NotImplementedError

    def balance_loss(self, probs: torch.Tensor, expert_ids: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """Switch/GShard balance loss E * sum_e f_e * P_e with f_e the fraction of (pre-capacity) assignments."""
        return self.num_experts * (assignment_fractions(expert_ids, kept, self.num_experts) * probs.mean(0)).sum()

    # --- shared ------------------------------------------------------------------------------------------------
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.cfg.jitter_eps > 0:
            eps = self.cfg.jitter_eps
            x = x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
        if self.cfg.gate_fp32:
            return F.linear(x.float(), self.weight.float())
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor, capacity: Optional[Sequence[int]] = None,
                assigned: Optional[torch.Tensor] = None) -> Routing:
        if assigned is not None:
            return self._forward_assigned(x, capacity, assigned)
        logits, probs, ids, kept, aux = self._decide(x)
        return self._routing(x, ids, kept, capacity, probs, aux)

    def _decide(self, x: torch.Tensor):
        """logits, probabilities, the gate's choice (ids, kept) and its aux losses."""
        logits = self.logits(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        ids, kept = self.select(logits, probs)
        aux = {}
        if self.training and self.cfg.aux_loss_coeff > 0 and x.shape[0] > 0:
            aux["balance"] = self.cfg.aux_loss_coeff * self.balance_loss(probs, ids, kept)
        if self.training and self.cfg.z_loss_coeff > 0 and x.shape[0] > 0:
            aux["z"] = self.cfg.z_loss_coeff * torch.logsumexp(logits, dim=-1).square().mean()
        return logits, probs, ids, kept, aux

    def _cut(self, ids: torch.Tensor, kept: torch.Tensor, capacity: Optional[Sequence[int]]):
        """The capacity cut: (kept, slots, pre-cut demand per expert); no cut without capacity."""
        if capacity is None:
            return kept, None, None
        demand = torch.bincount(masked_expert_ids(ids, kept, self.num_experts),
                                minlength=self.num_experts + 1)[: self.num_experts]
        kept, slots = apply_capacity(ids, kept, capacity)
        return kept, slots, demand

    def _weights(self, probs: torch.Tensor, ids: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        weights = probs.gather(1, ids) * kept
        if self.cfg.normalize_top_k and ids.shape[1] > 1:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
        return weights

    def _routing(self, x, ids, kept, capacity, probs, aux) -> Routing:
        kept, slots, demand = self._cut(ids, kept, capacity)
        flat = masked_expert_ids(ids, kept, self.num_experts)
        counts = torch.bincount(flat, minlength=self.num_experts + 1)[: self.num_experts]
        dropped = kept.numel() - kept.sum()
        routing = Routing(ids, self._weights(probs, ids, kept).to(x.dtype), kept, counts, dropped, aux, slots,
                          demand)
        routing.__dict__["masked_ids"] = flat          # fill the cached property: no second pass
        return routing

    def _forward_assigned(self, x: torch.Tensor, capacity, assigned: torch.Tensor) -> Routing:
        """Route by cached ids: kept/slots/counts from the ids alone (the dispatch can start at once); the gate's
        logits, weights, aux losses and own choice on a side stream when on a GPU (module docstring)."""
        ids = assigned.to(torch.long)
        kept, slots, demand = self._cut(ids, torch.ones_like(ids, dtype=torch.bool), capacity)
        flat = masked_expert_ids(ids, kept, self.num_experts)
        counts = torch.bincount(flat, minlength=self.num_experts + 1)[: self.num_experts]
        side = None
        if x.is_cuda:
            side = _side_stream(x.device)
            side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            _, probs, gate_ids, _, aux = self._decide(x)
            weights = self._weights(probs, ids, kept).to(x.dtype)
        if side is not None:            # tensors made on the side stream, used on the current one
            for t in [weights, gate_ids, *aux.values()]:
                t.record_stream(torch.cuda.current_stream(x.device))
        routing = Routing(ids, weights, kept, counts, kept.numel() - kept.sum(), aux, slots, demand, gate_ids, side)
        routing.__dict__["masked_ids"] = flat
        return routing


_SIDE_STREAMS: Dict[Any, Any] = {}


def _side_stream(device):
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def masked_expert_ids(expert_ids: torch.Tensor, kept: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Flattened (token-major) expert ids with unkept assignments replaced by the sentinel `num_experts`."""
    return torch.where(kept, expert_ids, num_experts).reshape(-1)


def assignment_fractions(expert_ids: torch.Tensor, kept: torch.Tensor, num_experts: int) -> torch.Tensor:
    """f_e: fraction of the token's (kept) choices going to each expert, [E] float (no gradient)."""
    flat = masked_expert_ids(expert_ids, kept, num_experts)
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts].float()
    return counts / max(expert_ids.numel(), 1)


def apply_capacity(expert_ids: torch.Tensor, kept: torch.Tensor, capacity: Sequence[int]
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """GShard drop rule: return (kept, slot) where slot[t, j] is the assignment's position in its expert's buffer.

    Priority: choice 0 of every token in token order, then choice 1, ... Already-unkept assignments claim no slot.
    """
    T, k = expert_ids.shape
    num_experts = len(capacity)
    cap = torch.tensor(list(capacity) + [0], dtype=torch.long, device=expert_ids.device)
    flat = masked_expert_ids(expert_ids.t(), kept.t(), num_experts)      # choice-major priority order
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat[order]
    counts = torch.bincount(flat, minlength=num_experts + 1)
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.empty_like(flat)
    pos[order] = torch.arange(flat.numel(), device=flat.device) - starts[sorted_ids]
    new_kept = pos < cap[flat]
    return new_kept.view(k, T).t() & kept, pos.view(k, T).t()


def capacity_from_factor(factor: float, num_tokens: int, top_k: int, num_experts: int, min_capacity: int
                         ) -> List[int]:
    """Per-expert capacity ceil(factor * T * k / E), at least `min_capacity`, the same for every expert."""
    c = max(int(math.ceil(factor * num_tokens * top_k / num_experts)), min_capacity)
    return [c] * num_experts
