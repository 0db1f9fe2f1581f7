"""Dynamic shapes between steps (DynaMoE paper 000).

- ``recompile``: the RECOMPILE mechanism (§3, Appendix B): triggers run off the training thread, their decisions
  land at a step boundary Δ_launch steps later.
- ``capacity``: dynamic per-expert capacity factors (§4.1, §5.2): demand meter; policy: moving average + spread, grow
  at once, shrink at most every ``DynamicSettings.min_interval`` steps.
- ``assignment_cache``: sample-assignment caching (§4.2, §5.3) and its on/off policy.
- ``static_graph``: torch.compile / CUDA-graph expert graphs re-built when the capacities change.
- ``settings``: ``DynamicSettings``, the constants of both (not trainer flags).
- ``runtime``: ``DynamicRuntime``, one per model, what the adapters call after each optimizer step.
- ``predictors``: MoE-of-predictors heads with cooperation / specification loss, hierarchical MoE (§2.1, App. A).
"""
from .assignment_cache import AssignmentCache, CachePolicy
from .capacity import CapacityMeter, DynamicCapacityPolicy
from .predictors import (LOSS_KINDS, PredictorMoE, cooperation_loss, hierarchical, moe_predictor_loss,
                         specification_loss)
from .recompile import Recompiler
from .runtime import DynamicRuntime, dynamic_enabled, format_metrics
from .settings import DynamicSettings
from .static_graph import StaticExpertGraph

__all__ = ["AssignmentCache", "CachePolicy", "CapacityMeter", "DynamicCapacityPolicy", "DynamicRuntime", "DynamicSettings",
           "Recompiler", "StaticExpertGraph", "dynamic_enabled", "format_metrics", "LOSS_KINDS", "PredictorMoE",
           "cooperation_loss", "hierarchical", "moe_predictor_loss", "specification_loss"]
