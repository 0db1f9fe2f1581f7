"""DynaMoE as a dispatch-core feature (dispatch/features.py), paper 000: per call, route by cached sample
assignments when the model's assignment cache is on (§4.2), meter the per-expert demand that dynamic capacity
follows (§4.1), run the capacity path's experts as a static-shape graph (``--moe-expert-graph``), and refresh the
cache with the gate's own choice after the combine.

State: ``meter`` (CapacityMeter), ``static_graph`` (StaticExpertGraph or None), ``layer_id`` and ``cache`` (set by
``DynamicRuntime`` through ``attach``)."""
from __future__ import annotations

from ..dispatch.features import LayerFeature, register_layer_feature
from .capacity import CapacityMeter
from .static_graph import StaticExpertGraph


class DynamicFeature(LayerFeature):
    def __init__(self, plan):
        cfg = plan.cfg
        self.meter = CapacityMeter(cfg.num_experts)
        self.static_graph = StaticExpertGraph(cfg.expert_graph) if cfg.expert_graph != "none" else None
        self.layer_id = None
        self.cache = None

    def attach(self, layer_id: int, cache=None) -> None:
        """This layer's global id and the model's assignment cache (``DynamicRuntime``)."""
        self.layer_id, self.cache = layer_id, cache

    def assigned(self, tokens, training, keys_shape, select):
        cache = self.cache
        if cache is None or not training or keys_shape is None:
            return None, None
        keys = cache.token_keys(keys_shape, tokens.device)
        if keys is not None and select is not None:
            keys = (keys[0].index_select(0, select), keys[1].index_select(0, select), keys[2])
        if keys is not None and cache.active and keys[2] and self.layer_id in cache.tables:
            cache.cached_calls += 1
            return cache.lookup(self.layer_id, keys[0]), keys
        return None, keys

    def routed(self, routing, capacity, training):
        if training:
            self.meter.record(routing, capacity)

    def run_experts(self, experts, x, counts, capacity):
        if self.static_graph is not None and capacity is not None:
            return self.static_graph(experts, x, counts)
        return None

    def finished(self, routing, keys):
        if keys is not None:
            self.cache.observe(self.layer_id, keys[0], keys[1], routing.chosen_ids)

    def recompile(self) -> None:
        if self.static_graph is not None:
            self.static_graph.recompile()


register_layer_feature("dynamic", DynamicFeature)
