"""Layer-spec substitution: put the plugin into the MoE layers of any Megatron GPT spec, nothing else changes.

``moe_plugin_spec(spec, cfg)`` takes what Megatron's GPT spec functions return (a layer ``ModuleSpec``, a
``TransformerBlockSubmodules`` with ``layer_specs`` as ``get_gpt_decoder_block_spec`` gives with
``--moe-layer-freq``, or a list of layer specs) and returns a copy in which every MoE ``mlp`` is
``PluginMoELayer`` with ``PluginRouter`` and ``PluginExperts``; the MoE layer's shared experts, attention, norms
and dense layers are kept as they were. Both spec styles work: megatron-core 0.16's ``ModuleSpec(module=MoELayer,
submodules=MoESubmodules(...))`` and 0.19+'s ``functools.partial(MoELayer, submodules=...)`` (the substitute is
built in the style it replaces).

Megatron-LM's ``pretrain_gpt.py`` builds its model one of two ways, and each has a wrapper:

- ``moe_plugin_gpt_builder(builder)`` wraps ``gpt_builders.gpt_builder`` (core_v0.16: ``pretrain_gpt.py`` hands it
  to ``model_provider``): with ``--moe-plugin`` the spec the builder passes to ``GPTModel`` is substituted;
- ``moe_plugin_model_config(args, model_cfg)`` wraps the ``GPTModelConfig`` that ``gpt_config_from_args`` makes
  (core_v0.19: ``pretrain(full_config, ...)`` builds the model with ``GPTModelBuilder`` from that config): its
  ``transformer_layer_spec`` becomes a function that resolves the spec Megatron would have used (the config's own,
  ``--spec``, or ``default_layer_spec``) and substitutes it.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable

from megatron.core.transformer.moe.moe_layer import BaseMoELayer, MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from ..config import MoEConfig
from .compat import make_spec, spec_parts
from .layer import PluginExperts, PluginMoELayer, PluginRouter

# megatron-core 0.16's TransformerLayer passes its process groups only to the exact MoELayer class and warns for any
# other mlp class; PluginMoELayer then takes the same groups from parallel_state (MoELayer's own fallback).
class _QuietUnknownMlp(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Unknown MLP type" not in record.getMessage()


logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_QuietUnknownMlp())


def _is_moe(cls) -> bool:
    return isinstance(cls, type) and issubclass(cls, BaseMoELayer)


def plugin_mlp_spec(mlp, cfg: MoEConfig):
    """The plugin's replacement for one MoE ``mlp`` spec (or ``mlp`` unchanged when it is not an MoE layer)."""
    cls, sub, params, style = spec_parts(mlp)
    if not _is_moe(cls) or cls is PluginMoELayer:
        return mlp
    # router: a partial (every release calls it); experts: a ModuleSpec (0.16 passes it to build_module, 0.19 calls it)
    submodules = MoESubmodules(experts=ModuleSpec(module=PluginExperts, params={"plugin_config": cfg}),
                               shared_experts=getattr(sub, "shared_experts", None),
                               router=functools.partial(PluginRouter, plugin_config=cfg))
    return make_spec(PluginMoELayer, submodules, {**params, "plugin_config": cfg}, style)


# where a multi-token-prediction layer keeps its transformer layer: 0.16's name, 0.19's name
_MTP_LAYER_FIELDS = ("transformer_layer", "mtp_model_layer")


def _layer_spec(spec, cfg: MoEConfig):
    sub = getattr(spec, "submodules", None)
    if sub is None or not dataclasses.is_dataclass(sub):
        return spec
    if hasattr(sub, "mlp"):
        new_mlp = plugin_mlp_spec(sub.mlp, cfg)
        return spec if new_mlp is sub.mlp else dataclasses.replace(spec, submodules=dataclasses.replace(sub, mlp=new_mlp))
    for name in _MTP_LAYER_FIELDS:               # an MTP layer: the MoE layer is inside its transformer layer
        inner = getattr(sub, name, None)
        if inner is not None:
            new = _layer_spec(inner, cfg)
            return spec if new is inner else dataclasses.replace(spec, submodules=dataclasses.replace(sub, **{name: new}))
    return spec


def moe_plugin_spec(spec: Any, cfg: MoEConfig) -> Any:
    """A copy of a GPT layer spec / block spec / list of layer specs with the plugin in every MoE layer."""
    if isinstance(spec, (list, tuple)):
        return type(spec)(_layer_spec(s, cfg) for s in spec)
    if hasattr(spec, "layer_specs"):
        return dataclasses.replace(spec, layer_specs=[_layer_spec(s, cfg) for s in spec.layer_specs])
    return _layer_spec(spec, cfg)


def _plugin_config(args) -> MoEConfig:
    """The MoEConfig Megatron-LM's argument validation stored on ``args`` (validated now when it has not run)."""
    cfg = getattr(args, "moe_plugin_config", None)
    if cfg is None:
        from .args import validate_moe_plugin_args
        cfg = validate_moe_plugin_args(args)
    return cfg


def moe_plugin_gpt_builder(builder: Callable) -> Callable:
    """Wrap Megatron-LM's ``gpt_builder(args, pre_process, post_process, ...)``: with ``args.moe_plugin`` the
    ``transformer_layer_spec`` it passes to ``GPTModel`` goes through ``moe_plugin_spec`` first."""
    if getattr(builder, "_megamoe_wrapped", False):
        return builder

    @functools.wraps(builder)
    def wrapped(args, *a, **kw):
        if not getattr(args, "moe_plugin", False):
            return builder(args, *a, **kw)
        cfg = _plugin_config(args)
        g = builder.__globals__
        real = g["GPTModel"]

        def plugin_gpt_model(*ma, **mkw):
            mkw["transformer_layer_spec"] = moe_plugin_spec(mkw["transformer_layer_spec"], cfg)
            if mkw.get("mtp_block_spec") is not None:           # the MTP block's MoE layer too
                mkw["mtp_block_spec"] = moe_plugin_spec(mkw["mtp_block_spec"], cfg)
            return real(*ma, **mkw)

        g["GPTModel"] = plugin_gpt_model
        try:
            return builder(args, *a, **kw)
        finally:
            g["GPTModel"] = real

    wrapped._megamoe_wrapped = True
    return wrapped


def _resolve_layer_spec(original, model_cfg, vp_stage):
    """The layer spec ``GPTModelBuilder.build_model`` would use for ``original`` (None, a spec, or a function of
    the model config and optionally ``vp_stage``)."""
    import inspect
    if original is None:
        from megatron.training.models.gpt import default_layer_spec
        return default_layer_spec(model_cfg, vp_stage)
    if isinstance(original, ModuleSpec) or not callable(original) or hasattr(original, "layer_specs"):
        return original
    if "vp_stage" in inspect.signature(original).parameters:
        return original(model_cfg, vp_stage=vp_stage)
    return original(model_cfg)


def moe_plugin_model_config(args, model_cfg):
    """With ``args.moe_plugin``: ``model_cfg`` (a ``GPTModelConfig``) whose layer spec has the plugin in every MoE
    layer, resolved when the model is built. Without it, or when already wrapped, ``model_cfg`` unchanged."""
    if not getattr(args, "moe_plugin", False):
        return model_cfg
    original = model_cfg.transformer_layer_spec
    if getattr(original, "_megamoe_wrapped", False):
        return model_cfg
    cfg = _plugin_config(args)

    def plugin_layer_spec(config, vp_stage=None):
        return moe_plugin_spec(_resolve_layer_spec(original, config, vp_stage), cfg)

    plugin_layer_spec._megamoe_wrapped = True
    model_cfg.transformer_layer_spec = plugin_layer_spec
    _substitute_mtp_spec(cfg)
    return model_cfg


def _substitute_mtp_spec(cfg: MoEConfig) -> None:
    """core_v0.19's ``GPTModelBuilder`` makes the MTP block's spec from Megatron's own layer specs
    (``megatron.training.models.gpt.mtp_block_spec``): wrap that function so the MTP layer's MoE layer is the
    plugin's too."""
    try:
        from megatron.training.models import gpt as gpt_models
    except ImportError:
        return
    original = getattr(gpt_models.mtp_block_spec, "_megamoe_original", gpt_models.mtp_block_spec)

    @functools.wraps(original)
    def plugin_mtp_block_spec(*args, **kwargs):
        spec = original(*args, **kwargs)
        return None if spec is None else moe_plugin_spec(spec, cfg)

    plugin_mtp_block_spec._megamoe_original = original
    gpt_models.mtp_block_spec = plugin_mtp_block_spec


def moe_plugin_config_builder(make_config: Callable) -> Callable:
    """Wrap Megatron-LM's ``gpt_config_from_args(args, ...)`` so the config it returns goes through
    ``moe_plugin_model_config`` (what the no-patch launcher installs on core_v0.19)."""
    if getattr(make_config, "_megamoe_wrapped", False):
        return make_config

    @functools.wraps(make_config)
    def wrapped(args, *a, **kw):
        return moe_plugin_model_config(args, make_config(args, *a, **kw))

    wrapped._megamoe_wrapped = True
    return wrapped
