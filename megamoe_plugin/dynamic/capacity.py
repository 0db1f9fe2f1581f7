"""Dynamic capacity factors (DynaMoE paper 000 §4.1, §5.2): each expert's capacity follows its observed demand.

Static capacity (GShard, Switch: ``C = α * tokens * k / n``, paper Eq. 4) is one factor for all experts for the
whole run: set high it pads every expert's buffer (compute, memory, bytes exchanged), set low it drops tokens.
Dynamic capacity sizes each expert's buffer from what the gate actually sends it, and changes the sizes only
between steps, through RECOMPILE (``recompile.py``), so the shapes stay static within a step.

* ``CapacityMeter`` (one per layer, on the hot path's side): per call, the gate's pre-capacity demand per expert
  (``Routing.demand``, device tensor, no sync) is max-accumulated; assignments cut by the capacity (demand - kept;
  GShard's random routing of second choices is not a capacity drop), assignments and buffer rows
  (host ints: the capacities are host lists) are summed. ``take()`` hands the step's values over and resets.
* ``DynamicCapacityPolicy`` (runs in the RECOMPILE trigger, off the training thread): per layer, a moving average
  of the demand (weight ``capacity_smoothing`` on the past); target capacity = max(average, this step's demand) x
  (1 + headroom), rounded up
  to a multiple of ``capacity_quantum`` and at least ``min_capacity``. Hysteresis: it recompiles only when some
  expert's smoothed demand exceeds its capacity (it would drop on average) or some capacity exceeds its target by
  more than ``capacity_hysteresis`` (padding waste); a recompilation sets every expert of the layer to its target.
  Between the two bands nothing changes, which bounds the number of recompilations while demand only jitters.

Demand is per source rank (capacity is per source rank in the capacity dispatch), maximised over the ranks of the
job so every rank applies the same capacities. "Average capacity factor" = buffer rows / assignments (1.0 = no
padding and nothing dropped on average).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import torch

__all__ = ["CapacityMeter", "DynamicCapacityPolicy", "capacity_metrics"]


class CapacityMeter:
    """Per-layer accumulator of one step's capacity statistics (training calls only)."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.reset()

    def reset(self) -> None:
        self.demand: Optional[torch.Tensor] = None      # [E] max over this step's calls of the pre-cut demand
        self.dropped: Optional[torch.Tensor] = None     # [] assignments dropped by the capacity cut
        self.assignments = 0                             # T * k summed over calls
        self.rows = 0                                    # buffer rows (sum of capacities) summed over calls
        self.max_tokens = 0                              # largest call (tokens)
        self.calls = 0

    def record(self, routing, capacity: Optional[Sequence[int]]) -> None:
        if capacity is None or routing.demand is None:
            return
        d = routing.demand.detach()
        self.demand = d.clone() if self.demand is None else torch.maximum(self.demand, d)
        dr = (d.sum() - routing.counts.detach().sum()).to(torch.float64)   # cut by capacity (not by random routing)
        self.dropped = dr.clone() if self.dropped is None else self.dropped + dr
        T, k = routing.expert_ids.shape
        self.assignments += T * k
        self.rows += int(sum(capacity))
        self.max_tokens = max(self.max_tokens, T)
        self.calls += 1

    def take(self, device) -> torch.Tensor:
        """[E + 4] float64 on `device`: demand per expert (max), then dropped, assignments, rows (sums), then the
        largest call; resets. Zeros when the step had no capacity call."""
        out = torch.zeros(self.num_experts + 4, dtype=torch.float64, device=device)
        if self.calls:
            out[: self.num_experts] = self.demand.to(device=device, dtype=torch.float64)
            out[self.num_experts] = self.dropped.to(device=device, dtype=torch.float64)
            out[self.num_experts + 1:] = torch.tensor([self.assignments, self.rows, self.max_tokens],
                                                      dtype=torch.float64, device=device)
        self.reset()
        return out


def capacity_metrics(row: torch.Tensor, num_experts: int) -> Dict[str, float]:
    """Average capacity factor and dropped fraction from a (reduced) ``CapacityMeter.take`` row."""
    dropped, assignments, rows = (float(v) for v in row[num_experts:num_experts + 3])
    if assignments <= 0:
        return {}
    return {"avg_capacity_factor": rows / assignments, "dropped_fraction": dropped / assignments}


class DynamicCapacityPolicy:
    """Moving average + headroom with hysteresis (module docstring). ``decide`` is called in step order from the
    RECOMPILE trigger; it remembers what it decided (the capacities in force once its decisions have landed)."""

    def __init__(self, num_experts: int, headroom: float = 0.1, smoothing: float = 0.9, hysteresis: float = 0.25,
                 quantum: int = 8, min_capacity: int = 4):
        self.num_experts, self.headroom, self.smoothing = num_experts, headroom, smoothing
        self.hysteresis, self.quantum, self.min_capacity = hysteresis, quantum, min_capacity
        self.average: Dict[int, torch.Tensor] = {}
        self.capacity: Dict[int, List[int]] = {}
        self.decisions = 0

    @classmethod
    def from_config(cls, cfg) -> "DynamicCapacityPolicy":
        return cls(cfg.num_experts, cfg.capacity_headroom, cfg.capacity_smoothing, cfg.capacity_hysteresis,
                   cfg.capacity_quantum, cfg.min_capacity)

    def target(self, average: torch.Tensor) -> List[int]:
        q = self.quantum
        return [max(int(math.ceil(float(a) * (1.0 + self.headroom) / q - 1e-9)) * q, self.min_capacity)
                for a in average]

    def decide(self, layer: int, demand: torch.Tensor) -> Optional[List[int]]:
        """New capacities for `layer` from this step's demand [E] (max over source ranks), or None (no change)."""
        demand = demand.to(torch.float64)
        avg = self.average.get(layer)
        avg = demand.clone() if avg is None else self.smoothing * avg + (1.0 - self.smoothing) * demand
        self.average[layer] = avg
        target = self.target(torch.maximum(avg, demand))     # never below what this step needed
        current = self.capacity.get(layer)
        if current is not None:
            short = any(float(a) > c for a, c in zip(avg, current))
            wasteful = any(c > t * (1.0 + self.hysteresis) for c, t in zip(current, target))
            if not (short or wasteful) or target == current:
                return None
        self.capacity[layer] = target
        self.decisions += 1
        return target
