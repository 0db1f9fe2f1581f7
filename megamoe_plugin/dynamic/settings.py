"""DynamicSettings: the constants of DynaMoE's dynamic capacity and of RECOMPILE (paper 000 §4.1, §3).

They are not trainer flags: the defaults are the values the dynamic and capacity benchmarks ran with, and a run
that wants others (an ablation such as ``bench dynamic``'s ``spread=0``) passes its own ``DynamicSettings`` to
``DynamicRuntime``. The options a user chooses (``--moe-capacity-policy``, the assignment cache's) stay in
``MoEConfig``.
"""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class DynamicSettings:
    headroom: float = 0.2
    """Capacity = smoothed per-expert demand + max(headroom x that demand, spread x its smoothed deviation)."""
    spread: float = 2.0
    """Standard deviations of an expert's demand its capacity covers beyond the average (batch-to-batch jitter);
    0 = headroom only."""
    quantile: float = 0.9
    """``--moe-capacity-policy quantile``: each expert's capacity is this quantile of its demand."""
    window: int = 32
    """Quantile capacity: steps of demand history kept per expert."""
    smoothing: float = 0.7
    """Weight of the past in the moving average of each expert's demand (0 = the last step only)."""
    hysteresis: float = 0.25
    """Shrink a layer's capacities only when their total exceeds the targets' total by more than this fraction."""
    quantum: int = 8
    """Capacities are rounded up to a multiple of this (fewer distinct shapes, GEMM-friendly sizes)."""
    min_interval: int = 10
    """At least this many steps between two recompilations of a layer that only shrink capacities."""
    delta_launch: int = 1
    """RECOMPILE's Δ_launch: a decision computed from a step's metrics takes effect this many steps later (the
    trigger runs off the training thread meanwhile); 0 = before the next step (the loop waits)."""

    def __post_init__(self):
        checks = {"headroom": self.headroom >= 0, "spread": self.spread >= 0, "quantile": 0.0 < self.quantile < 1.0, "window": self.window >= 2,
                  "smoothing": 0.0 <= self.smoothing < 1.0, "hysteresis": self.hysteresis >= 0,
                  "quantum": self.quantum >= 1, "min_interval": self.min_interval >= 1,
                  "delta_launch": self.delta_launch >= 0}
        bad = [f"{name}={getattr(self, name)!r}" for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"DynamicSettings: invalid {', '.join(bad)} (see the field docstrings: "
                             f"{', '.join(f.name for f in fields(self))})")
