"""Dynamic capacity factors (DynaMoE paper 000 §4.1, §5.2): each expert's capacity follows its observed demand.

Static capacity (GShard, Switch: ``C = α * tokens * k / n``, paper Eq. 4) is one factor for all experts for the
whole run: set high it pads every expert's buffer (compute, memory, bytes exchanged), set low it drops tokens.
Dynamic capacity sizes each expert's buffer from what the gate actually sends it, and changes the sizes only
between steps, through RECOMPILE (``recompile.py``), so the shapes stay static within a step.

* ``CapacityMeter`` (one per layer, on the hot path's side): per call, the gate's pre-capacity demand per expert
  (``Routing.demand``, device tensor, no sync) is max-accumulated; assignments cut by the capacity (demand - kept;
  GShard's random routing of second choices is not a capacity drop), assignments and buffer rows
  (host ints: the capacities are host lists) are summed. ``take()`` hands the step's values over and resets.
* ``DynamicCapacityPolicy`` (runs in the RECOMPILE trigger, off the training thread): per layer and expert, a
  moving average of the demand and of its squared deviation (weight ``DynamicSettings.smoothing`` on the past); target
  capacity = average + max(headroom x average, ``spread`` (2) x std), rounded up to a multiple of ``quantum`` and at
  least ``min_capacity``: the spread term covers batch-to-batch jitter, which a pure headroom does not when batches
  are small. Recompilations are bounded by asymmetry (paper §5.2: "a tolerable number of recompilations"):
  an expert whose smoothed demand exceeds its capacity (it would drop on average) is grown to its target at once,
  the others are left alone; capacities are shrunk only when the layer's rows exceed the targets' total by more
  than ``hysteresis`` AND ``min_interval`` steps have passed since the layer's last
  recompilation. So shrinking recompiles at most steps / min_interval times, growing only when the smoothed demand
  rises past the headroom, and jitter inside the band changes nothing.

  With ``--moe-capacity-policy quantile`` (q = ``DynamicSettings.quantile``, 0.9) the target is instead each expert's q-quantile of its demand over the last
  ``window`` steps (at least average x (1 + headroom)), and an expert grows as soon as that quantile
  exceeds its capacity. The average-based rule grows an expert only once it drops on AVERAGE, so an expert whose
  mean sits just under its capacity overflows on every above-average batch; at the same average factor that drops
  more than one flat static factor, which gives every expert the same slack. The quantile bounds each expert's
  overflow to about 1 - q of the steps whatever its demand's spread.

Demand is per source rank (capacity is per source rank in the capacity dispatch), maximised over the ranks of the
job so every rank applies the same capacities. "Average capacity factor" = buffer rows / assignments (1.0 = no
padding and nothing dropped on average).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import torch

from .settings import DynamicSettings

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
    """Moving average + spread + headroom, grow at once, shrink rarely (module docstring). ``decide`` is called in
    step order from the RECOMPILE trigger; it remembers what it decided (the capacities in force once its decisions
    have landed)."""

    def __init__(self, num_experts: int, headroom: float = 0.1, smoothing: float = 0.9, hysteresis: float = 0.25,
                 quantum: int = 8, min_capacity: int = 4, min_interval: int = 10, spread: float = 2.0,
                 quantile: float = 0.0, window: int = 32):
        self.num_experts, self.headroom, self.smoothing = num_experts, headroom, smoothing
        self.hysteresis, self.quantum, self.min_capacity = hysteresis, quantum, min_capacity
        self.min_interval, self.spread = min_interval, spread
        self.quantile, self.window = float(quantile), int(window)
        self.history: Dict[int, torch.Tensor] = {}       # layer -> [<= window, E] recent demand (quantile mode)
        self.average: Dict[int, torch.Tensor] = {}
        self.variance: Dict[int, torch.Tensor] = {}
        self.capacity: Dict[int, List[int]] = {}
        self.last_change: Dict[int, int] = {}            # layer -> step of its last decision
        self.calls: Dict[int, int] = {}
        self.decisions = 0

    @classmethod
    def from_config(cls, cfg, settings: DynamicSettings = DynamicSettings()) -> "DynamicCapacityPolicy":
        return cls(cfg.num_experts, settings.headroom, settings.smoothing, settings.hysteresis, settings.quantum,
                   cfg.min_capacity, settings.min_interval, settings.spread,
                   settings.quantile if cfg.capacity_policy == "quantile" else 0.0, settings.window)

    def state_dict(self) -> dict:
        return {"average": {k: v.clone() for k, v in self.average.items()},
                "variance": {k: v.clone() for k, v in self.variance.items()},
                "capacity": {k: list(v) for k, v in self.capacity.items()},
                "last_change": dict(self.last_change), "calls": dict(self.calls), "decisions": self.decisions,
                "history": {k: v.clone() for k, v in self.history.items()}}

    def load_state_dict(self, state: dict) -> None:
        def tensors(d):
            return {int(k): torch.as_tensor(v, dtype=torch.float64) for k, v in d.items()}
        self.average, self.variance = tensors(state["average"]), tensors(state.get("variance", {}))
        self.capacity = {int(k): [int(c) for c in v] for k, v in state["capacity"].items()}
        self.last_change = {int(k): int(v) for k, v in state.get("last_change", {}).items()}
        self.calls = {int(k): int(v) for k, v in state.get("calls", {}).items()}
        self.decisions = int(state.get("decisions", 0))
        self.history = tensors(state.get("history", {}))

    def target(self, average: torch.Tensor, std: Optional[torch.Tensor] = None) -> List[int]:
        """Per expert: average + max(headroom x average, spread x std), rounded up to the quantum, >= min_capacity."""
        std = torch.zeros_like(average) if std is None else std
        return self._rounded(average + torch.maximum(self.headroom * average, self.spread * std))

    def _rounded(self, need: torch.Tensor) -> List[int]:
        q = self.quantum
        return [max(int(math.ceil(float(n) / q - 1e-9)) * q, self.min_capacity) for n in need]

    def quantile_target(self, layer: int, average: torch.Tensor) -> List[int]:
        """Quantile mode: per expert, max(q-quantile of the recent demand, average x (1 + headroom)), rounded."""
        recent = self.history[layer]
        return self._rounded(torch.maximum(torch.quantile(recent, self.quantile, dim=0),
                                           average * (1.0 + self.headroom)))

    def decide(self, layer: int, demand: torch.Tensor, step: Optional[int] = None) -> Optional[List[int]]:
        """New capacities for `layer` from the demand [E] of step `step` (max over source ranks), or None."""
        demand = demand.to(torch.float64)
        self.calls[layer] = self.calls.get(layer, 0) + 1
        step = self.calls[layer] if step is None else int(step)
        prev = self.average.get(layer)
        if prev is None:
            avg, var = demand.clone(), torch.zeros_like(demand)
        else:
            s = self.smoothing
            avg = s * prev + (1.0 - s) * demand
            var = s * self.variance[layer] + (1.0 - s) * (demand - prev) ** 2
        self.average[layer], self.variance[layer] = avg, var
        if self.quantile > 0:
            past = self.history.get(layer, demand.new_zeros(0, demand.numel()))
            self.history[layer] = torch.cat([past, demand[None]])[-self.window:]
            target = self.quantile_target(layer, avg)
        else:
            target = self.target(avg, var.sqrt())
        current = self.capacity.get(layer)
        if current is None:
            new = target
        else:
            waste = (sum(current) > sum(target) * (1.0 + self.hysteresis)
                     and step - self.last_change.get(layer, step) >= self.min_interval)
            if self.quantile > 0:             # grow once the expert overflows in more than 1 - q of the steps
                short = [t > c for t, c in zip(target, current)]
            else:                             # grow once the expert drops on average
                short = [float(a) > c for a, c in zip(avg, current)]
            if waste:
                new = target                                   # shrink (and grow) every expert to its target
            elif any(short):
                new = [max(c, t) if sh else c for c, t, sh in zip(current, target, short)]   # grow the short ones
            else:
                return None
            if new == current:
                return None
        self.capacity[layer] = new
        self.last_change[layer] = step
        self.decisions += 1
        return new
