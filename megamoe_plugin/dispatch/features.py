"""The dispatch core's plug-in points: what a feature (placement, DynaMoE, ...) may do inside one MoE layer call.

The core calls every attached ``LayerFeature`` at five fixed points of a call, in attachment order:

    assigned(tokens, training, keys_shape, select) -> (expert ids to route by or None, token keys or None)
                                                    before the gate (DynaMoE: cached sample assignments)
    routed(routing, capacity, training)             after the gate (DynaMoE: capacity demand metering)
    map_routing(routing) -> routing                 before the exchange (placement: logical experts -> slots)
    run_experts(experts, x, counts, capacity) -> y or None
                                                    instead of the bank's own call (DynaMoE: static graphs)
    finished(routing, keys)                         after the combine (DynaMoE: refresh the assignment cache)

Features register a factory under a name with ``register_layer_feature``; the factory gets the layer's
``DispatchPlan`` and returns a feature or None (not wanted by this config). The built-in features live in their
own packages and register themselves when imported; ``BUILTIN_FEATURE_MODULES`` names them so that the core finds
them the way installed plug-ins are found (by module name, never by a static import: the core does not depend on
them). Feature state lives on the feature object (``plan.feature(name)``).
"""
from __future__ import annotations

import importlib
from typing import Callable, Dict, List, Optional, Tuple

import torch

BUILTIN_FEATURE_MODULES = ("megamoe_plugin.placement.layer_feature", "megamoe_plugin.dynamic.layer_feature")

_FACTORIES: Dict[str, Callable] = {}
_LOADED = False


class LayerFeature:
    """Base class: every hook is a no-op; a feature overrides the ones it needs."""

    name = "feature"

    def assigned(self, tokens: torch.Tensor, training: bool, keys_shape, select) -> Tuple[Optional[torch.Tensor],
                                                                                              object]:
        return None, None

    def routed(self, routing, capacity, training: bool) -> None:
        pass

    def map_routing(self, routing):
        return routing

    def run_experts(self, experts, x: torch.Tensor, counts, capacity) -> Optional[torch.Tensor]:
        return None

    def finished(self, routing, keys) -> None:
        pass


def register_layer_feature(name: str, factory: Callable) -> Callable:
    """``factory(plan) -> LayerFeature | None``; later registrations under a name replace earlier ones."""
    _FACTORIES[name] = factory
    return factory


def _load_builtins() -> None:
    global _LOADED
    if not _LOADED:
        _LOADED = True
        for module in BUILTIN_FEATURE_MODULES:
            importlib.import_module(module)


def build_features(plan) -> List[LayerFeature]:
    """The features the registered factories attach to ``plan`` (in registration order)."""
    _load_builtins()
    out = []
    for name, factory in list(_FACTORIES.items()):
        feature = factory(plan)
        if feature is not None:
            feature.name = name
            out.append(feature)
    return out

