"""Megatron flags for the plugin: render ``MoEConfig`` into ``--moe-plugin-*`` flags, map Megatron's own MoE flags
onto it, and validate the combination before any model is built.

Options whose meaning Megatron already has keep Megatron's flag (``SHARED``/``DERIVED`` below: ``--num-experts``,
``--moe-router-topk``, ``--expert-model-parallel-size``, ``--moe-aux-loss-coeff``, ...). Every other ``MoEConfig``
option becomes ``--moe-plugin-<name>``; ``--moe-plugin`` switches the plugin on. ``--moe-layer-freq`` keeps its
Megatron meaning (which layers are MoE): the spec builder swaps exactly the MoE layers Megatron's spec has.

Errors are ``ConfigError`` (a ValueError) whose text names the flag as the user typed it, e.g.
``--moe-router-topk=2: the switch gate routes each token to 1 expert; use --moe-router-topk=1``.

An error every rank finds alike stops the run through ``exit_with_error``: one line from rank 0, the same exit
status on every rank.

Usable with Megatron-LM's parser (``extra_args_provider=moe_plugin_extra_args()``) and with any argparse parser
that has Megatron's flag names (``examples/megatron`` adds the subset it understands with
``core_args.add_megatron_core_args``). ``config_from_megatron(src)`` also reads a ``TransformerConfig``.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from typing import Any, Callable, Dict, NoReturn, Optional

from ..config import MOVING_PLACEMENTS, ConfigError, MoEConfig, flag, iter_options
from ..gate_registry import gate_class

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
    "score_function": "moe_router_score_function",
    "topk_scaling_factor": "moe_router_topk_scaling_factor",
    "num_groups": "moe_router_num_groups",
    "group_topk": "moe_router_group_topk",
    "router_expert_bias": "moe_router_enable_expert_bias",
    "router_bias_update_rate": "moe_router_bias_update_rate",
    "quantile_balancing_ema": "moe_router_quantile_balancing_ema",
    "load_balancing_type": "moe_router_load_balancing_type",
    "drop_policy": "moe_token_drop_policy",
    "pad_to_capacity": "moe_pad_expert_input_to_capacity",
    "probs_on_input": "moe_apply_probs_on_input",
    "glu_linear_offset": "glu_linear_offset",
    "activation_clamp": "activation_func_clamp_value",
}
# MoEConfig fields derived from Megatron flags of another meaning or spelling: (the Megatron flag, how it decides).
DERIVED: Dict[str, tuple] = {
    "dispatch": ("--moe-expert-capacity-factor", "unset = dropless dispatch; a factor = capacity dispatch"),
    "eval_capacity_factor": ("--moe-expert-capacity-factor", "the same factor in evaluation (Megatron drops there "
                                                             "too)"),
    "min_capacity": ("--moe-expert-capacity-factor", "no minimum capacity (as Megatron)"),
    "activation": ("--swiglu / --quick-geglu / --squared-relu", "the expert activation; default gelu"),
    "linear_bias": ("--disable-bias-linear", "given = a router and experts without biases (Megatron's have them "
                                             "by default)"),
    "router_dtype": ("--moe-router-dtype", "fp32 / fp64; unset = the model's dtype"),
    "normalize_top_k": ("--moe-router-pre-softmax", "given (softmax scores) = the full softmax's probabilities, "
                                                    "not renormalised"),
    "world_size": ("the launcher's world size", "WORLD_SIZE of torchrun / the job"),
}
# How core error messages that name a derived option with a value read on a Megatron command line.
_DERIVED_PHRASES = {"--moe-dispatch capacity": "--moe-expert-capacity-factor <factor> (capacity dispatch)",
                    "--moe-dispatch dropless": "no --moe-expert-capacity-factor (dropless dispatch)",
                    "--moe-pad-to-capacity": "--moe-pad-expert-input-to-capacity",
                    "--moe-score-function": "--moe-router-score-function"}
# Megatron settings the plugin cannot honour: (attribute, predicate that is True when the value is unsupported,
# flag, why). Checked only with --moe-plugin.
UNSUPPORTED = [
    ("expert_tensor_parallel_size", lambda v: v not in (None, 1), "--expert-tensor-parallel-size",
     "the plugin's experts are not tensor-parallel; use --expert-tensor-parallel-size 1 (with TP>1 each "
     "tensor-parallel rank routes its own sequence-parallel shard)"),
    ("moe_latent_size", lambda v: v not in (None, 0), "--moe-latent-size", "latent MoE projections are not supported"),
    ("moe_enable_routing_replay", bool, "--moe-enable-routing-replay",
     "the plugin's router does not record or replay routing decisions"),
    ("moe_router_force_load_balancing", bool, "--moe-router-force-load-balancing",
     "a benchmark-only mode (random logits) the plugin does not reproduce; benchmark without --moe-plugin"),
    ("moe_router_force_biased", lambda v: v is not None, "--moe-router-force-biased",
     "a benchmark-only mode (random logit bias) the plugin does not reproduce"),
    ("moe_router_padding_for_quantization", bool, "--moe-router-padding-for-quantization",
     "FP8 / FP4 padding of the routing map is not supported by the plugin's experts"),
    ("moe_router_padding_for_fp8", bool, "--moe-router-padding-for-fp8",
     "FP8 padding of the routing map is not supported by the plugin's experts"),
    ("moe_pad_experts_for_cuda_graph_inference", bool, "--moe-pad-experts-for-cuda-graph-inference",
     "CUDA-graph inference padding is not supported by the plugin's layer"),
]
# Megatron settings that change no math and that the plugin's own machinery replaces: named in the start-up line.
REPLACED = [
    ("moe_token_dispatcher_type", bool, "--moe-token-dispatcher-type", "the plugin's all-to-all-v dispatcher"),
    ("moe_shared_expert_overlap", bool, "--moe-shared-expert-overlap",
     "shared experts computed before the routed ones, not overlapped"),
    ("moe_router_fusion", bool, "--moe-router-fusion", "the router unfused"),
    ("moe_permute_fusion", bool, "--moe-permute-fusion", "permutation by index"),
    ("moe_grouped_gemm", bool, "--moe-grouped-gemm",
     "the plugin's experts, --moe-plugin-expert-kernel; checkpoints in Megatron's expert layout"),
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


def _balancing(src) -> tuple:
    """(load_balancing_type, aux_loss_coeff) of the core from Megatron's --moe-router-load-balancing-type (a type
    or a list) and --moe-aux-loss-coeff (a number or a list of one per type)."""
    kinds = _get(src, "moe_router_load_balancing_type", default="aux_loss")
    coeffs = _get(src, "moe_aux_loss_coeff", default=0.0)
    kinds = list(kinds) if isinstance(kinds, (list, tuple)) else [kinds]
    coeffs = list(coeffs) if isinstance(coeffs, (list, tuple)) else [coeffs] * len(kinds)
    if len(coeffs) != len(kinds):
        raise ConfigError(f"megamoe-plugin: --moe-aux-loss-coeff={coeffs}: give one coefficient per "
                          f"--moe-router-load-balancing-type ({' '.join(kinds)})")
    coeffs = [float(c or 0.0) for c in coeffs]
    parts = []
    for kind, c in zip(kinds, coeffs):
        if kind in ("sinkhorn", "quantile_balancing"):
            if c > 0:
                raise ConfigError(f"megamoe-plugin: --moe-router-load-balancing-type={kind} with --moe-aux-loss-coeff="
                                  f"{c}: {kind} balances by its routing and takes no aux loss; set the coefficient "
                                  "to 0 (megatron-core refuses it too)")
            parts.append(kind)
        elif kind != "none" and c > 0:
            parts.append(f"{kind}:{c!r}")
    return ",".join(parts) or "none", coeffs[0] if coeffs else 0.0


def _activation(src) -> str:
    """The expert activation of Megatron's flags (argparse) or config (activation_func, gated_linear_unit)."""
    if _get(src, "squared_relu", default=False):
        return "squared_relu"
    if _get(src, "quick_geglu", default=False):
        return "quick_geglu"
    if _get(src, "swiglu", default=False):
        return "swiglu"
    func = _get(src, "activation_func")
    name = getattr(func, "__name__", "gelu" if func is None else repr(func))
    gated = bool(_get(src, "gated_linear_unit", default=False))
    table = {("silu", True): "swiglu", ("quick_gelu", True): "quick_geglu", ("squared_relu", False): "squared_relu",
             ("gelu", False): "gelu", ("relu", False): "relu"}
    if (name, gated) not in table:
        raise ConfigError(f"megamoe-plugin: the expert activation {name}{' (gated)' if gated else ''} is not one of "
                          "the plugin's (gelu, relu, --swiglu, --quick-geglu, --squared-relu)")
    return table[(name, gated)]


def config_from_megatron(src, world_size: Optional[int] = None, **overrides) -> MoEConfig:
    """MoEConfig from Megatron's parsed args (or a TransformerConfig plus ``overrides`` for plugin options): every
    router option means what it means in megatron-core (docs/megatron.md has the table)."""
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
    d["load_balancing_type"], d["aux_loss_coeff"] = _balancing(src)
    d["score_function"] = _get(src, "moe_router_score_function", default="softmax") or "softmax"
    d["normalize_top_k"] = d["score_function"] != "softmax" or not _get(src, "moe_router_pre_softmax", default=False)
    d["topk_scaling_factor"] = float(_get(src, "moe_router_topk_scaling_factor") or 0.0)
    # the node-limited gates' M, kept where validation moved it out of megatron-core's way (below)
    group_topk = _get(src, "moe_router_group_topk") or getattr(src, "megamoe_node_limit", 0) or 0
    limited = _get(src, "moe_router_topk_limited_devices") or 0
    if not group_topk and limited:                     # megatron-core's deprecated spelling of device-limited routing
        group_topk, d["num_groups"] = limited, d["expert_parallel_size"]
    elif group_topk:
        d["num_groups"] = _get(src, "moe_router_num_groups") or 0
    d["group_topk"] = group_topk
    d["router_expert_bias"] = bool(_get(src, "moe_router_enable_expert_bias", default=False))
    d["router_bias_update_rate"] = float(_get(src, "moe_router_bias_update_rate", default=1e-3))
    d["quantile_balancing_ema"] = float(_get(src, "moe_router_quantile_balancing_ema") or 0.0)
    cf = _get(src, "moe_expert_capacity_factor")
    if cf is not None and cf < 0:                     # megatron-core: a negative factor means none
        cf = None
    d["dispatch"] = "dropless" if cf is None else "capacity"
    if cf is not None:
        d.update(capacity_factor=cf, eval_capacity_factor=cf, min_capacity=0)
    d["drop_policy"] = _get(src, "moe_token_drop_policy", default="probs") or "probs"
    d["pad_to_capacity"] = bool(_get(src, "moe_pad_expert_input_to_capacity", default=False))
    d["probs_on_input"] = bool(_get(src, "moe_apply_probs_on_input", default=False))
    d["activation"] = _activation(src)
    d["glu_linear_offset"] = float(_get(src, "glu_linear_offset") or 0.0)
    d["activation_clamp"] = float(_get(src, "activation_func_clamp_value") or 0.0)
    bias = bool(_get(src, "add_bias_linear", default=False))
    d["linear_bias"] = bias
    d["router_dtype"] = _get(src, "moe_router_dtype") or "input"
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
    from ..gates import gate_warnings
    from ..notices import warn_once
    if cfg.placement_overlap_sync and _get(args, "overlap_grad_reduce", default=False):
        # overlapped replica gradients are complete only at the end of the backward pass, after Megatron's
        # overlapped buckets have started reducing them: the synchronous reduce is the safe one here
        cfg = cfg.replace(placement_overlap_sync=False)
        if cfg.placement != "none":
            warn_once("--overlap-grad-reduce: the replicated and shadowed experts' gradients are reduced inside "
                      "the MoE layers' backward (--moe-plugin-placement-overlap-sync needs the whole backward "
                      "pass before Megatron reduces its buckets)", kind="note")
    from ..placement import build_placement_policy
    try:
        build_placement_policy(cfg)       # an unknown or unimportable policy fails now, not after the model
        for text in gate_warnings(cfg):
            warn_once(spell(text))
    except ConfigError as e:
        raise _translate(e) from None
    warn_once(startup_line(cfg, args), kind="note")
    args.moe_plugin_config = cfg
    if getattr(gate_class(cfg.gate), "derives_groups", False):
        # the node-limited gates read M from --moe-router-group-topk and take the groups from the topology;
        # megatron-core's own router (replaced) would ask for --moe-router-num-groups
        args.megamoe_node_limit, args.moe_router_group_topk = cfg.group_topk, None
    return cfg


def startup_line(cfg: MoEConfig, args) -> str:
    """One line saying what routes and what replaces Megatron's machinery (printed once, on rank 0)."""
    router = [cfg.gate, cfg.score_function, f"top-{cfg.top_k}"]
    if cfg.group_topk and getattr(gate_class(cfg.gate), "derives_groups", False):
        router.append(f"at most {cfg.group_topk} node{'s' if cfg.group_topk > 1 else ''} per token (nodes from "
                      "the topology)")
    elif cfg.group_topk:
        router.append(f"{cfg.group_topk} of {cfg.num_groups} groups")
    if cfg.router_expert_bias:
        router.append(f"expert bias (rate {cfg.router_bias_update_rate:g})")
    if cfg.topk_scaling_factor:
        router.append(f"scaling {cfg.topk_scaling_factor:g}")
    router.append(cfg.balance_routing or ", ".join(f"{k} {c:g}" for k, c in cfg.balance_losses) or "no balance loss")
    if cfg.z_loss_coeff:
        router.append(f"z-loss {cfg.z_loss_coeff:g}")
    dispatch = ("dropless" if cfg.dispatch == "dropless" else
                f"capacity {cfg.capacity_factor:g} ({cfg.drop_policy}{', padded' if cfg.pad_to_capacity else ''})")
    replaced = [f"{flag_name}={getattr(args, attr)!r} ({what})" for attr, given, flag_name, what in REPLACED
                if given(getattr(args, attr, None))]
    line = (f"MoE layers: the plugin's router [{', '.join(router)}], {dispatch} all-to-all-v dispatch over "
            f"EP={cfg.expert_parallel_size}, experts {cfg.activation}")
    if cfg.gate not in ("topk", "naive"):
        line += f" (the {cfg.gate} gate's own choice rule, not megatron-core's top-k)"
    return line + ("; same math as Megatron's, which it replaces: " + "; ".join(replaced) if replaced else "")


def exit_with_error(message: str, status: int = 2, grace_s: float = 30.0) -> NoReturn:
    """Stop a run on an error that every rank finds at the same point (the flags): rank 0 prints
    ``error: <message>`` on stderr and exits with ``status``, like argparse. The other ranks print nothing and
    wait up to ``grace_s`` before exiting with the same status: torchrun stops every rank as soon as one exits,
    so the first failure it sees is rank 0's, whose line is in the output, and not a silent rank that got there
    first while rank 0 was still printing Megatron's argument table."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    else:
        time.sleep(grace_s)
    raise SystemExit(status)
