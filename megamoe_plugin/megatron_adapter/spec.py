"""Layer-spec substitution: put the plugin into the MoE layers of any Megatron GPT spec, nothing else changes.

``moe_plugin_spec(spec, cfg)`` takes what Megatron's GPT spec functions return (a layer ``ModuleSpec``, a
``TransformerBlockSubmodules`` with ``layer_specs`` as ``get_gpt_decoder_block_spec`` gives with
``--moe-layer-freq``, or a list of layer specs) and returns a copy in which every MoE ``mlp`` is
``PluginMoELayer`` with ``PluginRouter`` and ``PluginExperts``; the MoE layer's shared experts, attention, norms
and dense layers are kept as they were. Both spec styles work: megatron-core 0.16's ``ModuleSpec(module=MoELayer,
submodules=MoESubmodules(...))`` and 0.19+'s ``functools.partial(MoELayer, submodules=...)`` (the substitute is
built in the style it replaces).

``moe_plugin_gpt_builder(builder)`` wraps Megatron-LM's ``gpt_builders.gpt_builder`` (what ``pretrain_gpt.py``
hands to ``model_provider``): with ``--moe-plugin`` the spec the builder passes to ``GPTModel`` is substituted.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable

from megatron.core.transformer.moe.moe_layer import BaseMoELayer, MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from ..config import MoEConfig
from .layer import PluginExperts, PluginMoELayer, PluginRouter

# megatron-core 0.16's TransformerLayer passes its process groups only to the exact MoELayer class and warns for any
# other mlp class; PluginMoELayer then takes the same groups from parallel_state (MoELayer's own fallback).
class _QuietUnknownMlp(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Unknown MLP type" not in record.getMessage()


logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_QuietUnknownMlp())


def _mlp_class_and_submodules(mlp):
    if isinstance(mlp, ModuleSpec):
        return mlp.module, mlp.submodules, dict(mlp.params or {}), "spec"
    if isinstance(mlp, functools.partial):
        kw = dict(mlp.keywords)
        return mlp.func, kw.pop("submodules", None), kw, "partial"
    return mlp, None, {}, "class"


def _is_moe(cls) -> bool:
    return isinstance(cls, type) and issubclass(cls, BaseMoELayer)


def plugin_mlp_spec(mlp, cfg: MoEConfig):
    """The plugin's replacement for one MoE ``mlp`` spec (or ``mlp`` unchanged when it is not an MoE layer)."""
    cls, sub, params, style = _mlp_class_and_submodules(mlp)
    if not _is_moe(cls) or cls is PluginMoELayer:
        return mlp
    shared = getattr(sub, "shared_experts", None)
    router = functools.partial(PluginRouter, plugin_config=cfg)
    if style == "partial":
        experts = functools.partial(PluginExperts, plugin_config=cfg)
        return functools.partial(PluginMoELayer, submodules=MoESubmodules(experts=experts, shared_experts=shared,
                                                                         router=router),
                                 plugin_config=cfg, **params)
    experts = ModuleSpec(module=PluginExperts, params={"plugin_config": cfg})
    return ModuleSpec(module=PluginMoELayer,
                      submodules=MoESubmodules(experts=experts, shared_experts=shared, router=router),
                      params={**params, "plugin_config": cfg})


def _layer_spec(spec, cfg: MoEConfig):
    sub = getattr(spec, "submodules", None)
    if sub is None or not hasattr(sub, "mlp"):
        return spec
    new_mlp = plugin_mlp_spec(sub.mlp, cfg)
    if new_mlp is sub.mlp:
        return spec
    return dataclasses.replace(spec, submodules=dataclasses.replace(sub, mlp=new_mlp))


def moe_plugin_spec(spec: Any, cfg: MoEConfig) -> Any:
    """A copy of a GPT layer spec / block spec / list of layer specs with the plugin in every MoE layer."""
    if isinstance(spec, (list, tuple)):
        return type(spec)(_layer_spec(s, cfg) for s in spec)
    if hasattr(spec, "layer_specs"):
        return dataclasses.replace(spec, layer_specs=[_layer_spec(s, cfg) for s in spec.layer_specs])
    return _layer_spec(spec, cfg)


def moe_plugin_gpt_builder(builder: Callable) -> Callable:
    """Wrap Megatron-LM's ``gpt_builder(args, pre_process, post_process, ...)``: with ``args.moe_plugin`` the
    ``transformer_layer_spec`` it passes to ``GPTModel`` goes through ``moe_plugin_spec`` first."""
    if getattr(builder, "_megamoe_wrapped", False):
        return builder

    @functools.wraps(builder)
    def wrapped(args, *a, **kw):
        if not getattr(args, "moe_plugin", False):
            return builder(args, *a, **kw)
        cfg = getattr(args, "moe_plugin_config", None)
        if cfg is None:
            from .args import validate_moe_plugin_args
            cfg = validate_moe_plugin_args(args)
        g = builder.__globals__
        real = g["GPTModel"]

        def plugin_gpt_model(*ma, **mkw):
            mkw["transformer_layer_spec"] = moe_plugin_spec(mkw["transformer_layer_spec"], cfg)
            return real(*ma, **mkw)

        g["GPTModel"] = plugin_gpt_model
        try:
            return builder(args, *a, **kw)
        finally:
            g["GPTModel"] = real

    wrapped._megamoe_wrapped = True
    return wrapped
