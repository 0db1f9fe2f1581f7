"""DynamicRuntime: dynamic capacity and sample-assignment caching of one model, driven by RECOMPILE (paper 000).

One per model (all its MoE layers), called by the trainer adapters once per optimizer step:

    runtime.after_step(step)      # on every rank, after optimizer.step()

which (1) reduces the step's per-layer metrics over the job (one MAX and one SUM all-reduce of a small
[rows, E + 4] tensor: rows are global layer ids, so pipeline stages with different layers fit one tensor),
(2) hands them to RECOMPILE's trigger thread (``recompile.Recompiler.record``) and (3) applies at the boundary
of step ``step + 1`` the decisions computed from the metrics of step ``step - Δ_launch``: new per-expert
capacities (``layer.set_expert_capacity``, and a re-compile / re-capture of static-shape expert graphs) and
caching on/off. The trigger itself (the capacity policy and the cache policy) runs on the worker thread with
host copies; the training thread never waits for it unless it is late (``waits``).

``metrics()`` gives what the adapters log: average capacity factor, dropped fraction, recompilations, RECOMPILE
waits, caching on/off, the last epoch's fraction of tokens not reassigned, and the number of layer calls that used
cached assignments.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from .assignment_cache import AssignmentCache, CachePolicy
from .capacity import DynamicCapacityPolicy, capacity_metrics
from .recompile import Recompiler
from .settings import DynamicSettings

__all__ = ["DynamicRuntime", "dynamic_enabled", "format_metrics"]


def dynamic_enabled(cfg) -> bool:
    return cfg.dynamic_capacity or cfg.assignment_cache


def format_metrics(metrics: Dict[str, float]) -> str:
    """Progress-line fragment: average capacity factor, dropped fraction, recompilations, caching ('' if none)."""
    parts = []
    if "avg_capacity_factor" in metrics:
        parts.append(f"cf {metrics['avg_capacity_factor']:.2f} drop {metrics.get('dropped_fraction', 0.0):.3f}")
    if "recompilations" in metrics:
        parts.append(f"recompiles {int(metrics['recompilations'])}")
    if "cache_on" in metrics:
        stable = metrics.get("cache_stable_fraction")
        parts.append(f"cache {'on' if metrics['cache_on'] else 'off'}"
                     + (f" kept {stable:.3f}" if stable is not None else ""))
    return " ".join(parts)


class DynamicRuntime:
    def __init__(self, cfg, layers: Dict[int, Any], group=None, cache: Optional[AssignmentCache] = None,
                 device=None, positions: int = 0, settings: DynamicSettings = DynamicSettings()):
        """`layers`: this rank's MoE layers by GLOBAL layer id (modules with ``plan`` and ``set_expert_capacity``);
        `group`: the ranks that must agree (default: the whole job); `cache`: the model's assignment cache (made
        here from the config when --moe-assignment-cache is on and none is given, keyed by `positions` per sample:
        the trainer's sequence length); `settings`: the dynamic capacity's and RECOMPILE's constants."""
        self.cfg, self.layers, self.group = cfg, dict(layers), group
        self.E = cfg.num_experts
        first = next(iter(self.layers.values()), None)
        self.device = device or (next(first.parameters()).device if first is not None else torch.device("cpu"))
        self.capacity_policy = DynamicCapacityPolicy.from_config(cfg, settings) if cfg.dynamic_capacity else None
        if cfg.assignment_cache and cache is None:
            if positions <= 0:
                raise ValueError("megamoe-plugin: --moe-assignment-cache needs the trainer's sequence length "
                                 "(positions per sample)")
            cache = AssignmentCache(cfg.top_k, positions, cfg.num_experts)
        self.cache = cache if cfg.assignment_cache else None
        self.cache_policy = CachePolicy.from_config(cfg) if self.cache is not None else None
        for lid, layer in self.layers.items():
            layer.plan.feature("dynamic").attach(lid, self.cache)
        rows = torch.tensor([max(self.layers, default=-1) + 1], dtype=torch.float64, device=self.device)
        if self._distributed:
            dist.all_reduce(rows, op=dist.ReduceOp.MAX, group=group)
        self.rows = int(rows.item())
        self.recompiler = Recompiler(self._trigger, self._apply, settings.delta_launch)
        self._lock = threading.Lock()
        self._last: Dict[str, float] = {}
        self.recompilations = 0                  # capacity decisions applied (layers x times)

    @property
    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1

    # --- training thread -----------------------------------------------------------------------------------------
    def after_step(self, step: int) -> bool:
        """End of optimizer step `step` (1-based): record its metrics, then apply what is due before step+1."""
        width = self.E + 4
        high = torch.zeros(self.rows, width, dtype=torch.float64, device=self.device)   # MAX-reduced
        low = torch.zeros(self.rows, 5, dtype=torch.float64, device=self.device)        # SUM-reduced
        cache_counts = self.cache.take_counts() if self.cache is not None else {}
        for lid, layer in self.layers.items():
            meter = layer.plan.capacity_meter.take(self.device)
            high[lid, : self.E] = meter[: self.E]
            high[lid, self.E + 3] = meter[self.E + 3]
            low[lid, :3] = meter[self.E:self.E + 3]
            if lid in cache_counts:
                low[lid, 3:] = cache_counts[lid].to(self.device)
        if self._distributed:
            dist.all_reduce(high, op=dist.ReduceOp.MAX, group=self.group)
            dist.all_reduce(low, group=self.group)
        epoch = self.cache.epoch if self.cache is not None else 0
        self.recompiler.record(step, {"high": high, "low": low, "epoch": epoch})
        return self.recompiler.boundary(step + 1)

    def _apply(self, decision: Dict[str, Any]) -> None:
        for lid, capacity in decision.get("capacity", {}).items():
            if lid in self.layers:
                self.layers[lid].set_expert_capacity(capacity)
                self.layers[lid].plan.recompile_graphs()
            self.recompilations += 1
        if "cache" in decision and self.cache is not None:
            self.cache.active = bool(decision["cache"])

    # --- RECOMPILE trigger (worker thread; host tensors) -------------------------------------------------------
    def _trigger(self, step: int, m: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        high, low = m["high"], m["low"]
        decision: Dict[str, Any] = {}
        rows_used = [r for r in range(self.rows) if low[r, 1] > 0]
        if self.capacity_policy is not None:
            caps = {}
            for r in rows_used:
                c = self.capacity_policy.decide(r, high[r, : self.E], step)
                if c is not None:
                    caps[r] = c
            if caps:
                decision["capacity"] = caps
        summary: Dict[str, float] = {}
        if rows_used:
            total = low[rows_used, :3].sum(0)
            row = torch.cat([torch.zeros(self.E, dtype=torch.float64), total])
            summary.update(capacity_metrics(row, self.E))
        if self.cache_policy is not None:
            stable, compared = float(low[:, 3].sum()), float(low[:, 4].sum())
            switch = self.cache_policy.update(int(m["epoch"]), stable, compared)
            if switch is not None:
                decision["cache"] = switch
            frac = self.cache_policy.last_fraction
            if frac is not None:
                summary["cache_stable_fraction"] = frac
        with self._lock:
            self._last = summary
        return decision or None

    # --- reporting ---------------------------------------------------------------------------------------------
    def metrics(self) -> Dict[str, float]:
        with self._lock:
            out = dict(self._last)
        if self.capacity_policy is not None:
            out["recompilations"] = float(self.recompilations)
            caps = [c for layer in self.layers.values() for c in (layer.plan.expert_capacity or [])]
            if caps:
                out["capacity_max"] = float(max(caps))
        out["recompile_waits"] = float(self.recompiler.waits)
        if self.cache is not None:
            out["cache_on"] = float(self.cache.active)
            out["cached_calls"] = float(self.cache.cached_calls)
        return out

    def cache_history(self):
        """(epoch, fraction of tokens not reassigned or None, caching on after it) per closed epoch (Fig. 10)."""
        return list(self.cache_policy.history) if self.cache_policy is not None else []

    # --- checkpoints ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Capacities in force, the policies' state, the cache, and the RECOMPILE decisions computed but not yet
        applied (``pending``: a resumed run applies them at the same boundaries). Waits for the triggers still
        running first, so the policies are complete and not being written while they are read."""
        pending = self.recompiler.drain()
        out: Dict[str, Any] = {"capacity": {lid: layer.plan.expert_capacity for lid, layer in self.layers.items()},
                               "pending": pending}
        if self.capacity_policy is not None:
            out["capacity_policy"] = self.capacity_policy.state_dict()
            out["recompilations"] = self.recompilations
        if self.cache is not None:
            out["cache"] = self.cache.state_dict()
            out["cache_policy"] = self.cache_policy.state_dict()
        return out

    def load_state_dict(self, state: dict, keep_cache: bool = True) -> int:
        """Restore ``state_dict``; what this run does not use (dynamic capacity off, no cache, or `keep_cache`
        False: the sample indices may mean other samples now) is dropped, also from the pending decisions.
        Returns how many pending decisions were restored (the adapters log it)."""
        use_capacity = self.capacity_policy is not None
        use_cache = self.cache is not None and keep_cache and "cache" in state
        if use_capacity:
            for lid, cap in state.get("capacity", {}).items():
                if int(lid) in self.layers:
                    self.layers[int(lid)].set_expert_capacity(cap)
                    self.layers[int(lid)].plan.recompile_graphs()
            if "capacity_policy" in state:
                self.capacity_policy.load_state_dict(state["capacity_policy"])
            self.recompilations = int(state.get("recompilations", 0))
        if use_cache:
            self.cache.load_state_dict(state["cache"])
            self.cache_policy.load_state_dict(state["cache_policy"])
        keep = {"capacity"} if use_capacity else set()
        keep |= {"cache"} if use_cache else set()
        pending = {int(step): [(s, {k: v for k, v in (d or {}).items() if k in keep} or None) for s, d in results]
                   for step, results in state.get("pending", {}).items()}
        self.recompiler.restore(pending)
        return sum(d is not None for results in pending.values() for _, d in results)

    def close(self) -> None:
        self.recompiler.close()
