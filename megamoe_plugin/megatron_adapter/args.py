"""Megatron flags for the plugin: render ``MoEConfig`` into ``--moe-plugin-*`` flags, map Megatron's own MoE flags
onto it, and validate the combination before any model is built.

Options whose meaning Megatron already has keep Megatron's flag (``SHARED``/``DERIVED`` below: ``--num-experts``,
``--moe-router-topk``, ``--expert-model-parallel-size``, ``--moe-aux-loss-coeff``, ...). Every other ``MoEConfig``
option becomes ``--moe-plugin-<name>``; ``--moe-plugin`` switches the plugin on. ``--moe-layer-freq`` keeps its
Megatron meaning (which layers are MoE): the spec builder swaps exactly the MoE layers Megatron's spec has.

Errors are ``ConfigError`` (a ValueError) whose text names the flag as the user typed it, e.g.
``--moe-router-topk=2: the switch gate routes each token to 1 expert; use --moe-router-topk=1``.

Usable with Megatron-LM's parser (``extra_args_provider=moe_plugin_extra_args()``) and with any argparse parser
that has Megatron's flag names (``examples/megatron`` adds the subset it understands with
``core_args.add_megatron_core_args``). ``config_from_megatron(src)`` also reads a ``TransformerConfig``.
"""
from __future__ import annotations

import argparse
import re
from typing import Any, Callable, Dict, Optional

from ..config import MOVING_PLACEMENTS, ConfigError, MoEConfig, flag, iter_options

PLUGIN_PREFIX = "--moe-plugin-"

# MoEConfig field -> Megatron attribute with the same meaning (argparse dest; TransformerConfig field).
SHARED: Dict[str, str] = {
    "num_experts": "num_experts",
    "top_k": "moe_router_topk",
    "expert_parallel_size": "expert_model_parallel_size",
    "expert_ffn_hidden_size": "moe_ffn_hidden_size",
    "jitter_eps": "moe_input_jitter_eps",
    "z_loss_coeff": "moe_z_loss_coeff",
    "aux_loss_coeff": "moe_aux_loss_coeff",
    "capacity_factor": "moe_expert_capacity_factor",
    "init_std": "init_method_std",
}
# MoEConfig fields derived from Megatron flags of another meaning or spelling: (the Megatron flag, how it decides).
DERIVED: Dict[str, tuple] = {
    "dispatch": ("--moe-expert-capacity-factor", "unset = dropless dispatch; a factor = capacity dispatch"),
    "activation": ("--swiglu", "given = swiglu experts, else gelu"),
    "expert_bias": ("--disable-bias-linear", "given = experts without biases"),
    "gate_fp32": ("--moe-router-dtype", "fp32 = the gate's logits and softmax in fp32"),
    "normalize_top_k": ("--moe-router-pre-softmax", "given = the k probabilities are not renormalised"),
    "world_size": ("the launcher's world size", "WORLD_SIZE of torchrun / the job"),
}
# How core error messages that name a derived option with a value read on a Megatron command line.
_DERIVED_PHRASES = {"--moe-dispatch capacity": "--moe-expert-capacity-factor <factor> (capacity dispatch)",
                    "--moe-dispatch dropless": "no --moe-expert-capacity-factor (dropless dispatch)"}
# Megatron settings the plugin cannot honour: (attribute, predicate that is True when the value is unsupported,
# flag, why). Checked only with --moe-plugin.
UNSUPPORTED = [
    ("expert_tensor_parallel_size", lambda v: v not in (None, 1), "--expert-tensor-parallel-size",
     "the plugin's experts are not tensor-parallel; use --expert-tensor-parallel-size 1 (with TP>1 each "
     "tensor-parallel rank routes its own sequence-parallel shard)"),
    ("moe_router_score_function", lambda v: v not in (None, "softmax"), "--moe-router-score-function",
     "the plugin's gates use softmax scores"),
    ("moe_router_num_groups", lambda v: v not in (None, 0, 1), "--moe-router-num-groups",
     "group-limited routing is not a plugin gate"),
    ("moe_router_enable_expert_bias", bool, "--moe-router-enable-expert-bias",
     "aux-loss-free expert bias is not a plugin gate"),
    ("moe_router_topk_scaling_factor", lambda v: v not in (None, 1, 1.0), "--moe-router-topk-scaling-factor",
     "not supported by the plugin's gates"),
    ("moe_router_dtype", lambda v: v == "fp64", "--moe-router-dtype", "the plugin's gates compute in fp32 at most"),
    ("moe_latent_size", lambda v: v not in (None, 0), "--moe-latent-size", "latent MoE projections are not supported"),
    ("moe_token_dispatcher_type", lambda v: v not in (None, "alltoall", "allgather"), "--moe-token-dispatcher-type",
     "the plugin replaces the token dispatcher; leave it at alltoall"),
    ("moe_shared_expert_overlap", bool, "--moe-shared-expert-overlap",
     "the plugin's dispatcher does not overlap shared experts with communication"),
    ("squared_relu", bool, "--squared-relu", "expert activations are gelu (default) or --swiglu"),
    ("quick_geglu", bool, "--quick-geglu", "expert activations are gelu (default) or --swiglu"),
]


def plugin_flag(name: str) -> str:
    return PLUGIN_PREFIX + name.replace("_", "-")


def megatron_flag(name: str) -> str:
    """How a MoEConfig option is spelled on a Megatron command line."""
    if name in SHARED:
        return "--" + SHARED[name].replace("_", "-")
    if name in DERIVED:
        return DERIVED[name][0]
    return plugin_flag(name)


def plugin_options():
    """The MoEConfig options that get their own --moe-plugin-* flag."""
    return [o for o in iter_options() if o["name"] not in SHARED and o["name"] not in DERIVED]


def add_moe_plugin_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the plugin's argument group (rendered from MoEConfig) to a Megatron argparse parser."""
    group = parser.add_argument_group("megamoe-plugin", "MoE plugin (megamoe_plugin); Megatron's own MoE flags "
                                      "(--num-experts, --moe-router-topk, ...) keep their meaning")
    group.add_argument("--moe-plugin", action="store_true",
                       help="Use megamoe_plugin's router, dispatch and experts in Megatron's MoE layers.")
    for o in plugin_options():
        kw: Dict[str, Any] = {"dest": "moe_plugin_" + o["name"], "default": o["default"], "help": o["help"]}
        if o["type"] is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = o["type"]
            if o["choices"]:
                kw["choices"] = list(o["choices"])
        group.add_argument(plugin_flag(o["name"]), **kw)
    return parser


def moe_plugin_extra_args(other: Optional[Callable] = None) -> Callable:
    """An ``extra_args_provider`` for Megatron-LM's ``pretrain()`` adding our flags after ``other``'s."""
    def provider(parser):
        if other is not None:
            parser = other(parser) or parser
        return add_moe_plugin_args(parser)
    return provider


def spell(text: str) -> str:
    """Rewrite the core's --moe-<name> spellings in a message into the Megatron command line's spellings."""
    names = {flag(o["name"]): megatron_flag(o["name"]) for o in iter_options()}
    for core, megatron in _DERIVED_PHRASES.items():
        text = text.replace(core, megatron)
    return re.sub(r"--moe-[a-z0-9-]+", lambda m: names.get(m.group(0), m.group(0)), text)


def _translate(err: ConfigError) -> ConfigError:
    return ConfigError("megamoe-plugin: " + spell(str(err)))


def _get(src, *names, default=None):
    for n in names:
        if hasattr(src, n):
            return getattr(src, n)
    return default


def config_from_megatron(src, world_size: Optional[int] = None, **overrides) -> MoEConfig:
    """MoEConfig from Megatron's parsed args (or a TransformerConfig plus ``overrides`` for plugin options)."""
    d: Dict[str, Any] = {}
    for o in plugin_options():
        d[o["name"]] = _get(src, "moe_plugin_" + o["name"], default=o["default"])
    num_experts = _get(src, "num_experts", "num_moe_experts")
    if not num_experts:
        raise ConfigError("megamoe-plugin: --moe-plugin needs --num-experts (an MoE model)")
    d["num_experts"] = num_experts
    d["top_k"] = _get(src, "moe_router_topk", default=2)
    d["expert_parallel_size"] = _get(src, "expert_model_parallel_size", default=1) or 1
    d["expert_ffn_hidden_size"] = _get(src, "moe_ffn_hidden_size") or 0
    d["jitter_eps"] = _get(src, "moe_input_jitter_eps") or 0.0
    d["z_loss_coeff"] = _get(src, "moe_z_loss_coeff") or 0.0
    lb = _get(src, "moe_router_load_balancing_type", default="aux_loss")
    lb = lb if isinstance(lb, (list, tuple)) else [lb]
    coeff = _get(src, "moe_aux_loss_coeff", default=0.0)
    if isinstance(coeff, (list, tuple)):
        if len(coeff) != 1:
            raise ConfigError(f"megamoe-plugin: --moe-aux-loss-coeff={coeff}: the plugin takes one coefficient")
        coeff = coeff[0]
    if len(lb) != 1 or lb[0] not in ("aux_loss", "none"):
        raise ConfigError(f"megamoe-plugin: --moe-router-load-balancing-type={' '.join(lb)}: the plugin's gates use "
                          "their own balance loss (aux_loss, or the topology-aware loss of --moe-plugin-gate "
                          "ta_moe); use aux_loss or none")
    d["aux_loss_coeff"] = 0.0 if lb[0] == "none" else float(coeff or 0.0)
    cf = _get(src, "moe_expert_capacity_factor")
    d["dispatch"] = "dropless" if cf is None else "capacity"
    if cf is not None:
        d["capacity_factor"] = cf
    d["init_std"] = _get(src, "init_method_std", default=0.02)
    gated = bool(_get(src, "swiglu", "gated_linear_unit", default=False))
    d["activation"] = "swiglu" if gated else "gelu"
    d["expert_bias"] = bool(_get(src, "add_bias_linear", default=False))
    d["gate_fp32"] = _get(src, "moe_router_dtype") == "fp32"
    d["normalize_top_k"] = not bool(_get(src, "moe_router_pre_softmax", default=False))
    if world_size is None:
        world_size = _get(src, "world_size")
    d["world_size"] = world_size or 0
    d.update(overrides)
    try:
        return MoEConfig(**d)
    except ConfigError as e:
        raise _translate(e) from None


def _check_distributed_optimizer_placement(args, cfg: MoEConfig) -> None:
    """Placement with Megatron's distributed optimizer: a move carries the part of an expert's fp32 main copy and
    Adam moments each data-parallel rank holds (placement/optim_state.py), so training works with it. Two things
    around it do not:

    * ``--overlap-param-gather`` all-gathers the updated parameters only at the next forward, so a move between
      steps would send stale weights;
    * checkpoints: the experts' weights are saved by logical expert id and load back into the first placement,
      so the optimizer state must be saved the same way, through the model's sharded tensors. Only the
      distributed optimizer's ``fully_reshardable`` format (``--dist-ckpt-optim-fully-reshardable``, with
      ``--ckpt-format torch_dist``) does that; its default ``dp_reshardable`` and the legacy ``--ckpt-format
      torch`` store its flat buffers in this run's slot layout, which would load into the wrong experts."""
    if cfg.slots_per_rank <= cfg.num_local_experts:
        return                   # shadowing copies experts inside the step and moves nothing between steps
    name = f"--use-distributed-optimizer with --moe-plugin-placement={cfg.placement}"
    if _get(args, "overlap_param_gather", default=False):
        raise ConfigError(f"megamoe-plugin: {name} and --overlap-param-gather: the parameters are all-gathered "
                          "only at the next forward, so experts moved between steps would carry stale weights; "
                          "drop --overlap-param-gather")
    saves = _get(args, "save", default=None) or _get(args, "load", default=None)
    fmt = _get(args, "ckpt_format", default="torch_dist")
    if saves and (fmt != "torch_dist" or not _get(args, "dist_ckpt_optim_fully_reshardable", default=False)):
        raise ConfigError(f"megamoe-plugin: {name} and --save/--load: experts are checkpointed by logical expert "
                          "id, and only the distributed optimizer's fully reshardable format saves their optimizer "
                          f"state the same way; add --dist-ckpt-optim-fully-reshardable (--ckpt-format={fmt} "
                          "must be torch_dist)")


def validate_moe_plugin_args(args) -> Optional[MoEConfig]:
    """Check the plugin flags against Megatron's; with --moe-plugin, store and return the MoEConfig
    (``args.moe_plugin_config``). Call after Megatron's own argument validation, before building the model."""
    if not getattr(args, "moe_plugin", False):
        given = [plugin_flag(o["name"]) for o in plugin_options()
                 if _get(args, "moe_plugin_" + o["name"], default=o["default"]) != o["default"]]
        if given:
            raise ConfigError(f"megamoe-plugin: {', '.join(given)} given without --moe-plugin")
        return None
    for attr, unsupported, flag_name, why in UNSUPPORTED:
        value = getattr(args, attr, None)
        if unsupported(value):
            raise ConfigError(f"megamoe-plugin: {flag_name}={value!r} with --moe-plugin: {why}")
    tp = _get(args, "tensor_model_parallel_size", default=1) or 1
    if tp > 1 and not _get(args, "sequence_parallel", default=False):
        raise ConfigError(f"megamoe-plugin: --tensor-model-parallel-size={tp} with --moe-plugin needs "
                          "--sequence-parallel (each tensor-parallel rank routes its own sequence shard)")
    cfg = config_from_megatron(args)
    if not _get(args, "skip_train", default=False):
        from ..inference.deploy import refuse_in_training
        refuse_in_training(cfg, "Megatron (evaluate a checkpoint with --skip-train)", spell=plugin_flag)
    if cfg.assignment_cache and tp > 1:
        raise ConfigError(f"megamoe-plugin: --moe-plugin-assignment-cache with --tensor-model-parallel-size={tp}: "
                          "sequence-parallel MoE layers see a shard of each sample's tokens, which the cache's "
                          "(sample, position) keys do not describe; use TP=1 or no cache")
    if cfg.assignment_cache and _get(args, "moe_layer_recompute", default=False):
        raise ConfigError("megamoe-plugin: --moe-plugin-assignment-cache with --moe-layer-recompute: the recomputed "
                          "forward would refresh the cache twice; drop one of the two")
    if cfg.local_gates:
        if tp > 1:
            raise ConfigError(f"megamoe-plugin: --moe-plugin-gate-sync={cfg.gate_sync} with --tensor-model-parallel-size="
                              f"{tp}: tensor-parallel ranks all-reduce the router's gradients; use TP=1 or all")
        if _get(args, "use_distributed_optimizer", default=False):
            raise ConfigError(f"megamoe-plugin: --moe-plugin-gate-sync={cfg.gate_sync} with --use-distributed-optimizer: "
                              "its parameter shards are all-gathered after every step, which would give every rank "
                              "one owner's gate; drop one of the two")
    if _get(args, "use_distributed_optimizer", default=False) and cfg.placement in MOVING_PLACEMENTS:
        _check_distributed_optimizer_placement(args, cfg)
    if cfg.placement_overlap_sync and _get(args, "overlap_grad_reduce", default=False):
        raise ConfigError("megamoe-plugin: --moe-plugin-placement-overlap-sync and --overlap-grad-reduce: the "
                          "replicated experts' gradients are complete only at the end of the backward pass, after "
                          "Megatron's overlapped buckets have started reducing them; drop one of the two")
    from ..gates import gate_warnings
    from ..notices import warn_once
    from ..placement import build_placement_policy
    try:
        build_placement_policy(cfg)       # an unknown or unimportable policy fails now, not after the model
        for text in gate_warnings(cfg):
            warn_once(spell(text))
    except ConfigError as e:
        raise _translate(e) from None
    args.moe_plugin_config = cfg
    return cfg
