"""Expert placement between optimizer steps (FlexMoE paper 001 §3-§5, FasterMoE paper 003 §4.1).

* ``hooks``: the after-step hook and the policy registry every trainer adapter calls;
* ``state``: ``PlacementState`` (experts on vExpert slots), the Expand / Shrink / Migrate ``Move`` records, FlexMoE's
  token routing among replicas (Alg. 3, ``flexible_route``, also behind ``perfmodel.cost.CostModel.route``);
* ``flexmoe``: ``FlexMoEPlanner`` (balance-ratio trigger, Policy Maker Alg. 2, Migrate) and ``StaticPlanner``;
* ``shadow``: FasterMoE's shadow selection (Alg. 1) and ``ShadowPlanner``;
* ``runtime``: ``PlacementRuntime``, the live placement of one layer (tokens to vExpert slots, replica gradient
  all-reduce, shadow copies, moves carrying optimizer state); ``optim_state`` finds that state in trainers'
  optimizers; ``checkpoint`` saves and loads experts by logical id;
* ``policies``: ``--moe-placement flexmoe``, ``shadow`` and ``eplb``, run by the after-step hook;
* ``guard``: the pay-off guard that undoes a change the measured steps say lost; ``eplb``: DeepSeek's EPLB planner.

The planners replayed offline through routing traces on the performance model live in ``perfmodel.placement_replay``.

The planners are pure and deterministic (no process group): the runtime calls them on every rank with the same
global counts and executes the moves they return.

``flexmoe`` and ``shadow`` import the performance model, which imports ``state``; they are loaded on
first use of their names here (``from megamoe_plugin.placement import FlexMoEPlanner`` works).
"""
from .hooks import (AfterStepHook, StepContext, build_placement_policy, register_placement_policy,
                    registered_placement_policies)
from .state import Move, PlacementError, PlacementState, flexible_route, model_state_bytes
from .runtime import PlacementRuntime, apply_placement
from . import policies  # noqa: F401  (registers --moe-placement flexmoe and shadow)

_LAZY = {
    "FlexMoEPlanner": "flexmoe", "StaticPlanner": "flexmoe",
    "ShadowPlanner": "shadow", "select_shadow_experts": "shadow", "shadow_search": "shadow",
}

__all__ = ["AfterStepHook", "StepContext", "build_placement_policy", "register_placement_policy",
           "registered_placement_policies", "Move", "PlacementError", "PlacementState", "flexible_route",
           "model_state_bytes", "PlacementRuntime", "apply_placement"] + sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
