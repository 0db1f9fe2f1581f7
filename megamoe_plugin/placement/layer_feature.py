"""Placement as a dispatch-core feature (dispatch/features.py): maps each call's logical expert ids to vExpert
slots once experts are replicated, moved or shadowed (FlexMoE paper 001 §3.2, FasterMoE shadowing paper 003 §4.1).

The layer's ``PlacementRuntime`` (runtime.py) is this feature's state: ``plan.feature("placement").runtime``
(``DispatchPlan.placement`` for short). With the initial placement ``map_routing`` changes nothing."""
from __future__ import annotations

from ..dispatch.features import LayerFeature, register_layer_feature
from .runtime import PlacementRuntime, group_cache


class PlacementFeature(LayerFeature):
    def __init__(self, plan):
        cfg = plan.cfg
        self.runtime = PlacementRuntime(cfg.num_experts, plan.ep, cfg.slots_per_rank, edp_group=plan.edp_group,
                                        cache=group_cache(), overlap_sync=cfg.placement_overlap_sync)

    def map_routing(self, routing):
        slots = self.runtime.route_tokens(routing)          # also counts the call's tokens for the planners
        return None if self.runtime.trivial else slots


def _attach(plan):
    return None if plan.ep.layout_only else PlacementFeature(plan)


register_layer_feature("placement", _attach)
