"""FasterMoE dynamic shadowing (paper 003 §4.1): which experts to replicate on every worker for one iteration.

Algorithm 1 (SelectShadowExperts), generalised from the paper's one expert per worker to any placement: sort the
experts by their global load (descending, ties to the lower id, experts without tokens skipped); shadow the next
one while the predicted latency of the iteration keeps dropping, stop at the first that does not help.

* ``shadow_search(counts, latency)``: the algorithm itself over any latency function ``latency(shadowed_list)``
  (``perfmodel.roofline`` uses it with the smart-schedule latency too; it was moved here from roofline.py);
* ``select_shadow_experts(counts, cost_model, placement)``: Alg. 1 with the latencies of the cost model:
  Eq. 7 (no expert shadowed) = ``CostModel.layer_time(counts, placement).total`` (3 compute rounds + 4
  all-to-all rounds on the topology, + replica synchronisation of a FlexMoE placement), Eq. 8 (r experts shadowed)
  = ``CostModel.shadow_layer_time(counts, shadowed, placement).total`` (their tokens computed where they are, the
  remaining all-to-all, and per shadowed expert a broadcast of its parameters + a reduce of its gradients over the
  ring of all workers, i.e. Eq. 8's 2 r 2 alpha H^2 / W_net on the network). Eqs. 9-10 are the conditions under
  which Eq. 8 < Eq. 7; comparing the two predictions directly covers them.
* ``ShadowPlanner``: the per-step policy object (``plan(state, counts) -> experts to shadow next step``).

Deterministic: every rank given the same global counts selects the same experts (the paper: "as matrix T always
has to be available across all workers, no extra communication is introduced").
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

from .state import resolve_cost_model

__all__ = ["shadow_search", "select_shadow_experts", "ShadowPlanner"]


def shadow_search(counts, latency: Callable[[List[int]], float],
                  max_shadow: Optional[int] = None, min_gain: float = 0.0) -> Tuple[List[int], float]:
    """Algorithm 1 over experts with a latency function: returns (shadowed expert ids in the order chosen,
    predicted latency with them). ``counts`` [..., E]: loads are summed over all leading dims. ``min_gain``: an
    expert is shadowed only if it lowers the predicted latency by at least this fraction (0 = the paper's rule;
    a few percent keeps the planner idle where the gain is within the model's error)."""
    c = torch.as_tensor(counts)
    load = c.double().reshape(-1, c.shape[-1]).sum(0)
    order = [int(e) for e in torch.argsort(load, descending=True, stable=True) if load[e] > 0]
    if max_shadow is not None:
        order = order[:max_shadow]
    chosen: List[int] = []
    c_min = latency(chosen)
    for e in order:
        t = latency(chosen + [e])
        if t < c_min * (1.0 - min_gain):
            c_min, chosen = t, chosen + [e]
        else:
            break
    return chosen, c_min


def select_shadow_experts(counts, cost_model, placement=None, max_shadow: Optional[int] = None,
                          min_gain: float = 0.0) -> List[int]:
    """Algorithm 1 with Eq. 7 / Eq. 8 predicted by ``cost_model`` (a ``perfmodel.cost.CostModel``) for counts
    [P, E] under ``placement`` (per expert its ranks; None = contiguous blocks). Returns the experts to shadow
    (possibly empty)."""
    c = torch.as_tensor(counts).to(torch.float64)
    cache = {}

    def latency(shadowed):
        key = tuple(shadowed)
        if key not in cache:
            cache[key] = (cost_model.shadow_layer_time(c, shadowed, placement) if shadowed
                          else cost_model.layer_time(c, placement)).total
        return cache[key]

    return shadow_search(c, latency, max_shadow, min_gain)[0]


class ShadowPlanner:
    """FasterMoE shadowing as a per-step policy: ``plan(state, counts)`` returns the experts to shadow for the next
    iteration, chosen by Alg. 1 on ``counts`` [P, E] (the last step's global counts, as the after-step hook sees
    them) with the cost model's latencies under ``state``'s placement (None: contiguous blocks).

    cost_model: a ``CostModel``, or a factory ``f(num_ranks) -> CostModel`` called once per world size.
    Shadowing moves no expert for good: the runtime broadcasts the chosen experts' parameters at the start of the
    iteration and reduces their gradients to the owner (the first replica) at the end."""

    shadows = True          # tells the simulator this planner's plan is a set of shadowed experts, not moves

    def __init__(self, cost_model, max_shadow: Optional[int] = None, min_gain: float = 0.0):
        self._cost = cost_model
        self._cache = {}
        self.max_shadow = max_shadow
        self.min_gain = min_gain

    def cost_model(self, num_ranks: int):
        return resolve_cost_model(self._cost, self._cache, num_ranks)

    def plan(self, state, counts) -> List[int]:
        c = torch.as_tensor(counts).to(torch.float64)
        P = c.shape[0] if state is None else state.num_ranks
        placement = None if state is None else state.placement()
        return select_shadow_experts(c, self.cost_model(P), placement, self.max_shadow, self.min_gain)
