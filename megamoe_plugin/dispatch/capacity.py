"""Capacity dispatch: GShard-style fixed per-expert buffers with drop and pad (static shapes).

Expert e owns ``capacity[e]`` rows per source rank (the gate's drop rule already decided who gets a slot);
the buffer of a rank is [sum(capacity), H] laid out by global expert, padding rows are zero. With expert
parallelism the buffers are exchanged with split sizes known from the capacities (no count exchange; when the
capacity derives from a factor and ranks hold different token counts, the layer first all-gathers the token
counts) and regrouped to [local expert][source]. Every expert computes all its rows, padding included, as GShard does, so the shapes
only change when the capacities do (DynaMoE sets per-expert capacities between steps). Scatter and gather are
by index: no [T, E, C] mask is built.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..gates.base import Routing
from ..parallel import ExpertParallel
from .comm import all_to_all, return_to_sources, gather_rows, regroup_index, weighted_combine


@dataclass
class _State:
    row: torch.Tensor                       # [T, k] buffer row of each assignment (R = dropped)
    regroup: Optional[torch.Tensor] = None
    splits: Optional[Tuple[List[int], List[int]]] = None


class CapacityDispatcher:
    def __init__(self, num_experts: int, ep: ExpertParallel):
        if ep.layout_only and ep.size > 1:
            raise ValueError("dispatch needs a real expert-parallel process group, not a layout-only description")
        self.num_experts, self.ep = num_experts, ep
        self.num_local_experts = num_experts // ep.size
        self._regroup_cache: Dict[tuple, torch.Tensor] = {}

    def dispatch(self, x: torch.Tensor, routing: Routing, capacity: Sequence[int],
                 source_capacities: Optional[Sequence[Sequence[int]]] = None
                 ) -> Tuple[torch.Tensor, List[int], _State]:
        """`capacity`: this rank's per-expert capacity; `source_capacities[s]`: the capacity vector rank s of the
        expert-parallel group uses (they differ when ranks hold different token counts); default: all equal."""
        T, k = routing.expert_ids.shape
        P, El, me = self.ep.size, self.num_local_experts, self.ep.rank
        capacity = list(capacity)
        total = sum(capacity)
        starts = torch.tensor([0] + capacity[:-1], device=x.device).cumsum(0)
        row = torch.where(routing.kept, starts[routing.expert_ids] + routing.slots, total).reshape(-1)
        source = torch.full((total + 1,), T, dtype=torch.long, device=x.device)
        source[row] = torch.arange(T * k, device=x.device) // k
        padded_x = torch.cat([x, x.new_zeros(1, x.shape[1])])
        buffer = gather_rows(padded_x, source[:total])
        if P == 1:
            return buffer, capacity, _State(row.view(T, k))
        local = [list(c[me * El:(me + 1) * El]) for c in (source_capacities or [capacity] * P)]
        in_splits = [sum(capacity[r * El:(r + 1) * El]) for r in range(P)]
        out_splits = [sum(c) for c in local]
        received = all_to_all(buffer, out_splits, in_splits, self.ep.group)
        regroup = self._regroup(local, x.device)
        tokens_per_expert = [sum(c[e] for c in local) for e in range(El)]
        return gather_rows(received, regroup), tokens_per_expert, _State(row.view(T, k), regroup,
                                                                         (in_splits, out_splits))

    def combine(self, expert_output: torch.Tensor, state: _State, routing: Routing) -> torch.Tensor:
        y = expert_output
        if state.regroup is not None:
            y = return_to_sources(y, state.regroup, *state.splits, self.ep.group)
        return weighted_combine(y, state.row, routing.weights)

    def _regroup(self, local: List[List[int]], device) -> torch.Tensor:
        key = (tuple(map(tuple, local)), str(device))
        if key not in self._regroup_cache:
            if len(self._regroup_cache) > 64:        # token counts that change every step: do not grow forever
                self._regroup_cache.clear()
            self._regroup_cache[key] = regroup_index(torch.tensor(local, device=device), sum(map(sum, local)))
        return self._regroup_cache[key]
