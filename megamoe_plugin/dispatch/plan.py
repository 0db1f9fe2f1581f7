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
- dynamic placement (``placement``, a ``placement.runtime.PlacementRuntime``): once experts are replicated,
  moved or shadowed, the routing's logical ids become vExpert slot ids and the kept assignments go through the
  dropless exchange (or the smart one) over slots; capacity, when used, has already decided in the gate which
  assignments are kept. With the initial placement nothing changes.
- DynaMoE (paper 000, ``dynamic/``): ``route`` is the gate call of both the core layer and the adapters' layers:
  it reads a cached assignment when the model's assignment cache is on (``attach_dynamic``), meters the step's
  per-expert demand for dynamic capacity (``capacity_meter``) and, after the combine (``finish``), refreshes the
  cache with the gate's own choice; with ``expert_graph`` the capacity path's experts run as a static-shape graph
  that ``recompile_graphs`` rebuilds when the capacities change.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..config import MoEConfig
from ..gates.base import Routing, capacity_from_factor
from ..parallel import ExpertParallel
from .capacity import CapacityDispatcher
from .dropless import DroplessDispatcher
from .smart import SmartDispatcher, schedule_groups
from ..placement.runtime import PlacementRuntime, group_cache
from ..dynamic.capacity import CapacityMeter
from ..dynamic.static_graph import StaticExpertGraph


class DispatchPlan:
    def __init__(self, cfg: MoEConfig, ep: ExpertParallel, topology=None, edp_group=None):
        self.cfg, self.ep = cfg, ep
        self.dropless = DroplessDispatcher(cfg.num_experts, ep)
        self.capacity_dispatch = CapacityDispatcher(cfg.num_experts, ep)
        self.smart: Optional[SmartDispatcher] = None
        if cfg.schedule == "smart" and ep.enabled:
            self.smart = SmartDispatcher(cfg.num_experts, ep, schedule_groups(cfg, ep, topology))
        self.expert_capacity: Optional[List[int]] = None
        self.placement: Optional[PlacementRuntime] = None
        if not ep.layout_only:
            self.placement = PlacementRuntime(cfg.num_experts, ep, cfg.slots_per_rank, edp_group=edp_group,
                                              cache=group_cache(cfg.placement_group_cache))
        self.capacity_meter = CapacityMeter(cfg.num_experts)
        self.static_graph = StaticExpertGraph(cfg.expert_graph) if cfg.expert_graph != "none" else None
        self.layer_id: Optional[int] = None
        self.assignment_cache = None

    # --- DynaMoE: the gate call, assignment caching, metering -------------------------------------------------------
    def attach_dynamic(self, layer_id: int, cache=None) -> None:
        """Called by ``dynamic.runtime.DynamicRuntime``: this layer's global id and the model's assignment cache."""
        self.layer_id, self.assignment_cache = layer_id, cache

    def route(self, gate, tokens: torch.Tensor, training: bool, keys_shape=None, select=None):
        """The layer's gate call: (routing, capacity, token keys or None). `keys_shape`: the layer input's shape
        without the hidden dim (how the assignment cache's batch keys are laid out); `select`: indices of the
        tokens of that shape this call routes (fairseq drops padding)."""
        capacity = self.capacity_for(tokens.shape[0], training)
        keys, assigned = None, None
        cache = self.assignment_cache
        if cache is not None and training and keys_shape is not None:
            keys = cache.token_keys(keys_shape, tokens.device)
            if keys is not None and select is not None:
                keys = (keys[0].index_select(0, select), keys[1].index_select(0, select), keys[2])
            if keys is not None and cache.active and keys[2] and self.layer_id in cache.tables:
                assigned = cache.lookup(self.layer_id, keys[0])
                cache.cached_calls += 1
        routing = gate(tokens, capacity=capacity, assigned=assigned)
        if training:
            self.capacity_meter.record(routing, capacity)
        return routing, capacity, keys

    def finish(self, routing: Routing, keys) -> None:
        """After the combine: wait for the gate's side stream; refresh the assignment cache (training)."""
        routing.join()
        if keys is not None:
            self.assignment_cache.observe(self.layer_id, keys[0], keys[1], routing.chosen_ids)

    def run_experts(self, experts, expert_in: torch.Tensor, tokens_per_expert: List[int], capacity) -> torch.Tensor:
        """The experts on dispatched tokens; a capacity call with ``expert_graph`` runs the static-shape graph."""
        if self.static_graph is not None and capacity is not None:
            return self.static_graph(experts, expert_in, tokens_per_expert)
        return experts(expert_in, tokens_per_expert)

    def recompile_graphs(self) -> None:
        """The capacities changed: rebuild the static-shape expert graph for the new shapes (weights untouched)."""
        if self.static_graph is not None:
            self.static_graph.recompile()

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

    def dispatch(self, tokens: torch.Tensor, routing: Routing, capacity: Optional[List[int]], training: bool
                 ) -> Tuple[torch.Tensor, List[int], tuple]:
        """tokens [T, H] -> (expert input sorted by local expert, tokens per local expert, handle for combine)."""
        slots = self._slot_routing(routing)
        if slots is not routing:
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
        return self.smart.forward(tokens, self._slot_routing(routing), experts)

    def run(self, tokens: torch.Tensor, routing: Routing, capacity: Optional[List[int]], training: bool,
            experts) -> torch.Tensor:
        """tokens [T, H] -> the layer output [T, H]: dispatch, the ExpertBank `experts`, combine (the smart
        schedule's pipelined exchange when it applies)."""
        if self.uses_smart(capacity):
            return self.run_smart(tokens, routing, experts)
        expert_in, tokens_per_expert, handle = self.dispatch(tokens, routing, capacity, training)
        return self.combine(self.run_experts(experts, expert_in, tokens_per_expert, capacity), handle, routing)

    @staticmethod
    def combine(expert_out: torch.Tensor, handle: tuple, routing: Routing) -> torch.Tensor:
        dispatcher, state = handle
        routing.join()                      # the weights may still be in flight on the gate's side stream
        return dispatcher.combine(expert_out, state, routing)
