"""DispatchPlan: per call, choose dropless or capacity dispatch, fix the capacities, run the exchange.

Shared by the core ``MoELayer`` and the trainer adapters (Megatron's token dispatcher wraps it), so the rules live
in one place:
- ``dispatch == "dropless"`` (dynamic gating, paper 004 §V), or capacity mode at inference with
  ``eval_capacity_factor == 0``: no capacity, nothing dropped.
- capacity mode: each expert's capacity comes from the capacity factor (GShard), unless ``set_expert_capacity``
  fixed a per-expert vector (dynamic capacity, DynaMoE paper 000 §4.1, changes it between steps).
- when ranks of the expert-parallel group hold different token counts, the factor gives each a different
  capacity vector; ``source_capacities`` all-gathers the counts so every rank knows the split sizes.
- ``schedule == "smart"`` (FasterMoE paper 003 §4.2, dispatch/smart.py): a dropless call with expert parallelism
  runs dispatch + experts + combine as one pipelined grouped pairwise exchange (``run``); with one rank, or a
  capacity call, it is the plain path.
- features (dispatch/features.py) attach at fixed points of a call: before the gate (cached assignments), after
  it (capacity metering), before the exchange (placement's logical experts -> vExpert slots: the kept assignments
  then go through the dropless exchange, or the smart one, over slots), instead of the bank's call (static expert
  graphs) and after the combine. The built-in ones are placement/ and dynamic/; this module imports neither.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..config import MoEConfig
from ..gates.base import Routing, capacity_from_factor
from ..parallel import ExpertParallel
from .capacity import CapacityDispatcher
from .dropless import DroplessDispatcher
from .features import LayerFeature, build_features
from .smart import SmartDispatcher, schedule_groups


class DispatchPlan:
    def __init__(self, cfg: MoEConfig, ep: ExpertParallel, topology=None, edp_group=None):
        self.cfg, self.ep, self.edp_group = cfg, ep, edp_group
        self.dropless = DroplessDispatcher(cfg.num_experts, ep)
        self.capacity_dispatch = CapacityDispatcher(cfg.num_experts, ep)
        self.smart: Optional[SmartDispatcher] = None
        if cfg.smart_schedule and ep.enabled:
            self.smart = SmartDispatcher(cfg.num_experts, ep, schedule_groups(cfg, ep, topology))
        self.expert_capacity: Optional[List[int]] = None
        self.features: List[LayerFeature] = build_features(self)

    def feature(self, name: str) -> Optional[LayerFeature]:
        """The attached feature registered under ``name`` (None when absent)."""
        return next((f for f in self.features if f.name == name), None)

    # shortcuts to the built-in features' state (None when the feature is not attached)
    @property
    def placement(self):
        f = self.feature("placement")
        return None if f is None else f.runtime

    @property
    def capacity_meter(self):
        f = self.feature("dynamic")
        return None if f is None else f.meter

    @property
    def static_graph(self):
        f = self.feature("dynamic")
        return None if f is None else f.static_graph

    # --- one call: the features' hooks at their fixed points ----------------------------------------------------
    def route(self, gate, tokens: torch.Tensor, training: bool, keys_shape=None, select=None, batch=None):
        """The layer's gate call: (routing, capacity, feature keys). `keys_shape`: the layer input's shape
        without the hidden dim; `select`: indices of the tokens of that shape this call routes (fairseq drops
        padding); `batch`: the tokens' sequences and padding (gates.base.TokenBatch). A feature may hand the gate
        the expert ids to route by (DynaMoE's cached assignments)."""
        capacity = self.capacity_for(tokens.shape[0], training)
        assigned, keys = None, {}
        for f in self.features:
            ids, k = f.assigned(tokens, training, keys_shape, select)
            if k is not None:
                keys[f.name] = k
            if ids is not None:
                assigned = ids
        routing = gate(tokens, capacity=capacity, assigned=assigned, batch=batch)
        for f in self.features:
            f.routed(routing, capacity, training)
        return routing, capacity, keys

    def finish(self, routing: Routing, keys) -> None:
        """After the combine: wait for the gate's side stream; the features' last hook."""
        routing.join()
        for f in self.features:
            f.finished(routing, (keys or {}).get(f.name))

    def run_experts(self, experts, expert_in: torch.Tensor, tokens_per_expert, capacity) -> torch.Tensor:
        """The experts on dispatched tokens (or a feature's replacement: a static-shape graph)."""
        for f in self.features:
            y = f.run_experts(experts, expert_in, tokens_per_expert, capacity)
            if y is not None:
                return y
        return experts(expert_in, tokens_per_expert)

    def recompile_graphs(self) -> None:
        """The capacities changed: features that compiled for the old shapes rebuild (weights untouched)."""
        for f in self.features:
            recompile = getattr(f, "recompile", None)
            if recompile is not None:
                recompile()

    def set_expert_capacity(self, capacity: Optional[Sequence[int]]) -> None:
        """Fix each expert's capacity (per source rank), or None to go back to the capacity factor."""
        if capacity is not None:
            capacity = [int(c) for c in capacity]
            if len(capacity) != self.cfg.num_experts or min(capacity) < 0:
                raise ValueError(f"expert capacity needs {self.cfg.num_experts} non-negative ints, got {capacity}")
        self.expert_capacity = capacity

    def capacity_for(self, num_tokens: int, training: bool) -> Optional[List[int]]:
        """Per-expert capacity for a call with `num_tokens` tokens, or None for dropless dispatch."""
        cfg = self.cfg
        if cfg.dispatch != "capacity" or (not training and cfg.eval_capacity_factor == 0):
            return None
        if self.expert_capacity is not None:
            return self.expert_capacity
        factor = cfg.capacity_factor if training else cfg.eval_capacity_factor
        return capacity_from_factor(factor, num_tokens, cfg.top_k, cfg.num_experts, cfg.min_capacity)

    def source_capacities(self, num_tokens: int, device, training: bool) -> Optional[List[List[int]]]:
        """Capacity vector of every rank of the expert-parallel group (None when fixed, hence equal)."""
        if not self.ep.enabled or self.expert_capacity is not None:
            return None
        mine = torch.tensor([num_tokens], device=device)
        parts = [torch.empty_like(mine) for _ in range(self.ep.size)]
        dist.all_gather(parts, mine, group=self.ep.group)
        return [self.capacity_for(t, training) for t in torch.cat(parts).tolist()]

    def padded(self, capacity: Optional[List[int]]) -> Optional[List[int]]:
        """The capacity the experts compute (static shapes: every expert its capacity of rows), or None when
        they compute the kept tokens only (dropless, or a capacity cut without padding)."""
        return capacity if self.cfg.pad_to_capacity else None

    def dispatch(self, tokens: torch.Tensor, routing: Routing, capacity: Optional[List[int]], training: bool
                 ) -> Tuple[torch.Tensor, List[int], tuple]:
        """tokens [T, H] -> (expert input sorted by local expert, tokens per local expert, handle for combine).
        ``capacity``: the padded capacity (``padded``), None for the dropless exchange of the kept tokens."""
        slots = self._slot_routing(routing)
        if slots is not None:              # experts moved / replicated / shadowed: dropless over the slots
            expert_in, tokens_per_expert, state = self.dropless.dispatch(tokens, slots)
            return expert_in, tokens_per_expert, (self.dropless, state)
        if capacity is None:
            expert_in, tokens_per_expert, state = self.dropless.dispatch(tokens, routing)
            return expert_in, tokens_per_expert, (self.dropless, state)
        expert_in, tokens_per_expert, state = self.capacity_dispatch.dispatch(
            tokens, routing, capacity, self.source_capacities(tokens.shape[0], tokens.device, training))
        return expert_in, tokens_per_expert, (self.capacity_dispatch, state)

    def _slot_routing(self, routing: Routing):
        """The routing over vExpert slots (or the routing itself while the placement is the initial one)."""
        return routing if self.placement is None else self.placement.route_tokens(routing)

    def uses_smart(self, capacity: Optional[List[int]]) -> bool:
        """Whether a call with this capacity (None = dropless) runs the smart schedule."""
        return self.smart is not None and capacity is None

    def run_smart(self, tokens: torch.Tensor, routing: Routing, experts) -> torch.Tensor:
        routing.join()
        slots = self._slot_routing(routing)
        return self.smart.forward(tokens, routing if slots is None else slots, experts)

    def run(self, tokens: torch.Tensor, routing: Routing, capacity: Optional[List[int]], training: bool,
            experts) -> torch.Tensor:
        """tokens [T, H] -> the layer output [T, H]: dispatch, the ExpertBank `experts`, combine (the smart
        schedule's pipelined exchange when it applies)."""
        capacity = self.padded(capacity)
        if self.cfg.probs_on_input:        # top-1: the token enters its expert already weighted
            routing.join()
            tokens = tokens * routing.weights
            routing = dataclasses.replace(routing, weights=routing.kept.to(routing.weights.dtype))
        if self.uses_smart(capacity):
            return self.run_smart(tokens, routing, experts)
        expert_in, tokens_per_expert, handle = self.dispatch(tokens, routing, capacity, training)
        expert_out = self.run_experts(experts, expert_in, tokens_per_expert, capacity)
        return self.combine(expert_out, handle, routing)

    def forward(self, gate, tokens: torch.Tensor, training: bool, experts, keys_shape=None, select=None,
                batch=None):
        """One MoE layer call, the sequence every trainer's layer runs: gate (``route``) -> dispatch -> experts
        -> combine (``run``) -> the features' last hook (``finish``). Returns (output [T, H], routing)."""
        routing, capacity, keys = self.route(gate, tokens, training, keys_shape, select, batch)
        y = self.run(tokens, routing, capacity, training, experts)
        self.finish(routing, keys)
        return y, routing

    @staticmethod
    def combine(expert_out: torch.Tensor, handle: tuple, routing: Routing) -> torch.Tensor:
        dispatcher, state = handle
        routing.join()                      # the weights may still be in flight on the gate's side stream
        return dispatcher.combine(expert_out, state, routing)
