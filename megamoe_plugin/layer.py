"""MoELayer: x[..., H] -> y[..., H] = gate -> dispatch -> experts -> combine, with aux losses and statistics.

The framework-agnostic layer the adapters wrap. After each forward, ``aux_loss`` holds the sum of the gate's aux
losses (already scaled by their coefficients, differentiable) and ``aux_losses`` the named parts; the layer's
``StatsSink`` has the call's counts. ``collect_aux_loss(model)`` sums the aux losses of every MoELayer of a
model (what a training loop adds to its task loss).

Capacity: in ``capacity`` mode each expert's capacity comes from ``capacity_factor`` (or
``eval_capacity_factor`` at inference, where 0 means dropless), unless ``set_expert_capacity`` fixed a
per-expert vector (dynamic capacity, DynaMoE paper 000 §4.1, changes it between steps).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.nn as nn

from .config import ConfigError, MoEConfig, flag
from .dispatch import CapacityDispatcher, DroplessDispatcher
from .experts import ExpertBank
from .gates import build_gate, capacity_from_factor
from .parallel import expert_parallel
from .stats import StatsSink


class MoELayer(nn.Module):
    def __init__(self, cfg: MoEConfig, hidden_size: int, ffn_hidden_size: Optional[int] = None,
                 ep_group=None, topology=None, layer_id: int = 0, stats: Optional[StatsSink] = None,
                 dtype: Optional[torch.dtype] = None, device=None):
        super().__init__()
        self.cfg, self.hidden_size, self.layer_id = cfg, hidden_size, layer_id
        self.ep = expert_parallel(ep_group)
        if self.ep.size != cfg.expert_parallel_size:
            raise ConfigError(f"{flag('expert_parallel_size')}={cfg.expert_parallel_size} but the expert-parallel "
                              f"group has {self.ep.size} rank(s)")
        ffn = cfg.expert_ffn_hidden_size or ffn_hidden_size
        if not ffn:
            raise ConfigError(f"{flag('expert_ffn_hidden_size')}: no FFN hidden size given")
        self.gate = build_gate(cfg, hidden_size, ep=self.ep, topology=topology)
        self.experts = ExpertBank(cfg.num_local_experts, hidden_size, ffn, cfg.activation, cfg.expert_bias,
                                  cfg.init_std, dtype=dtype, device=device, cpu_lanes=cfg.cpu_expert_lanes,
                                  cpu_gemm=cfg.cpu_gemm)
        if device is not None:
            self.gate.to(device)
        self.dropless = DroplessDispatcher(cfg.num_experts, self.ep)
        self.capacity_dispatch = CapacityDispatcher(cfg.num_experts, self.ep)
        self.stats = stats if stats is not None else StatsSink()
        self.expert_capacity: Optional[List[int]] = None
        self.aux_loss: torch.Tensor = torch.zeros(())
        self.aux_losses = {}
        self.last_routing = None

    # --- capacity ------------------------------------------------------------------------------------------------
    def set_expert_capacity(self, capacity: Optional[Sequence[int]]) -> None:
        """Fix each expert's capacity (per source rank), or None to go back to the capacity factor."""
        if capacity is not None:
            capacity = [int(c) for c in capacity]
            if len(capacity) != self.cfg.num_experts or min(capacity) < 0:
                raise ValueError(f"expert capacity needs {self.cfg.num_experts} non-negative ints, got {capacity}")
        self.expert_capacity = capacity

    def capacity_for(self, num_tokens: int) -> Optional[List[int]]:
        """Per-expert capacity for this call, or None for dropless dispatch."""
        cfg = self.cfg
        if cfg.dispatch != "capacity" or (not self.training and cfg.eval_capacity_factor == 0):
            return None
        if self.expert_capacity is not None:
            return self.expert_capacity
        factor = cfg.capacity_factor if self.training else cfg.eval_capacity_factor
        return capacity_from_factor(factor, num_tokens, cfg.top_k, cfg.num_experts, cfg.min_capacity)

    def _source_capacities(self, num_tokens: int, device) -> Optional[List[List[int]]]:
        """Capacity vector of every rank of the expert-parallel group (None when fixed, hence equal)."""
        if not self.ep.enabled or self.expert_capacity is not None:
            return None
        mine = torch.tensor([num_tokens], device=device)
        parts = [torch.empty_like(mine) for _ in range(self.ep.size)]
        torch.distributed.all_gather(parts, mine, group=self.ep.group)
        return [self.capacity_for(t) for t in torch.cat(parts).tolist()]

    # --- forward -------------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if shape[-1] != self.hidden_size:
            raise ValueError(f"MoELayer expects hidden size {self.hidden_size}, got input of shape {tuple(shape)}")
        tokens = x.reshape(-1, self.hidden_size)
        capacity = self.capacity_for(tokens.shape[0])
        routing = self.gate(tokens, capacity=capacity)
        if capacity is None:
            expert_in, tokens_per_expert, state = self.dropless.dispatch(tokens, routing)
            dispatcher = self.dropless
        else:
            expert_in, tokens_per_expert, state = self.capacity_dispatch.dispatch(
                tokens, routing, capacity, self._source_capacities(tokens.shape[0], tokens.device))
            dispatcher = self.capacity_dispatch
        expert_out = self.experts(expert_in, tokens_per_expert)
        y = dispatcher.combine(expert_out, state, routing)
        self.aux_losses = routing.aux_losses
        self.aux_loss = routing.aux_loss()
        self.last_routing = routing
        self.stats.record(self.layer_id, routing)
        return y.view(shape)


def moe_layers(model: nn.Module) -> List[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def collect_aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum of the aux losses of every MoELayer's last forward (0 when there is none)."""
    losses = [m.aux_loss for m in moe_layers(model)]
    return sum(losses) if losses else torch.zeros(())
