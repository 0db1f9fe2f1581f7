"""fairseq flags for the plugin: ``MoEConfig`` rendered as fairseq dataclass fields, and back.

Options whose meaning fairseq's own ``moe`` branch already has keep its names (``RENAMED`` below):
``--moe-expert-count``, ``--moe-gate-loss-wt``, ``--moe-second-expert-policy``, ``--moe-gating-use-fp32``,
``--moe-eval-capacity-token-fraction`` (converted into our eval capacity factor), plus ``--moe-freq`` (every n-th
layer is MoE) and ``--moe-gate-loss-combine-method`` (criterion). The expert activation comes from fairseq's own
``--activation-fn``; the world size from fairseq's data-parallel group. Every other option is
``--moe-<name>`` as in ``megamoe options``; boolean options that default to True become ``--moe-no-<name>``
(fairseq's bool flags can only switch a default on or off).

``MOE_FIELDS`` is the list of (name, type, field) that models add to their dataclass (``moe_dataclass``) or
argparse parser (``add_moe_args``); ``config_from_fairseq(args)`` builds the validated ``MoEConfig`` and rewrites
the core's error messages into the fairseq spellings.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any, Dict, List, Tuple

from ..config import MOVING_PLACEMENTS, ConfigError, MoEConfig, flag, iter_options

# MoEConfig field -> fairseq (moe branch) option with the same meaning.
RENAMED: Dict[str, str] = {
    "num_experts": "moe_expert_count",
    "aux_loss_coeff": "moe_gate_loss_wt",
    "second_expert_policy": "moe_second_expert_policy",
    "eval_capacity_factor": "moe_eval_capacity_token_fraction",
}
# MoEConfig fields taken from fairseq's own settings (no flag of ours).
DERIVED: Dict[str, str] = {
    "activation": "--activation-fn",
    "world_size": "the data-parallel world size",
}
# fairseq's spelling differs in default or meaning: documented per option.
OVERRIDES: Dict[str, Tuple[Any, str]] = {
    "num_experts": (8, "Number of experts in each MoE layer (over all expert-parallel ranks)."),
    "gate": ("gshard", "Gate: gshard (fairseq's moe branch: top-2, random second expert) | topk (megatron-core's "
                       "router: every score function, groups, expert bias) | naive | switch | hir | ta_moe, or a "
                       "name added with @register_gate."),
    "router_dtype": ("input", "Data type of the router's logits and weights: fp32, fp64 or input (the model's; as "
                              "on fairseq's moe branch, where --moe-gating-use-fp32 turns fp32 on)."),
    "eval_capacity_factor": (0.0, "capacity mode, inference: capacity = this fraction of the tokens per expert; "
                                  "0 = dropless at inference (default), -1 = the training capacity."),
    "top_k": (0, "Experts chosen per token; 0 = the gate's own (switch 1, gshard 2, others 2)."),
    "expert_parallel_size": (0, "Ranks the experts are sharded over; 0 = all data-parallel ranks. "
                                "Must divide the data-parallel world size."),
}
ADAPTER_FIELDS: List[Tuple[str, type, Any, str]] = [
    ("moe_gating_use_fp32", bool, False, "fairseq's moe branch: the router in fp32 (= --moe-router-dtype fp32)."),
    ("moe_freq", int, 2, "Every moe_freq-th transformer layer (of the encoder and of the decoder) has an MoE FFN "
                         "(>= 1; a dense model is fairseq's own transformer_lm / transformer)."),
]


def fairseq_name(name: str) -> str:
    """The fairseq dataclass field (= argparse dest) of a MoEConfig option."""
    if name in RENAMED:
        return RENAMED[name]
    default = OVERRIDES.get(name, (None,))[0]
    for o in iter_options():
        if o["name"] == name and o["type"] is bool and o["default"] is True and default is None:
            return "moe_no_" + name
    return "moe_" + name


def fairseq_flag(name: str) -> str:
    if name in DERIVED:
        return DERIVED[name]
    return "--" + fairseq_name(name).replace("_", "-")


def moe_fields() -> List[Tuple[str, type, dataclasses.Field]]:
    """(dest, type, dataclasses.field) of every fairseq MoE option, in MoEConfig order, then the adapter's."""
    out = []
    for o in iter_options():
        name = o["name"]
        if name in DERIVED:
            continue
        default, help_text = OVERRIDES.get(name, (o["default"], o["help"]))
        if o["choices"]:
            help_text += f" Choices: {', '.join(o['choices'])}."
        dest = fairseq_name(name)
        if dest.startswith("moe_no_"):
            default, help_text = False, "Turn off: " + help_text
        out.append((dest, o["type"], dataclasses.field(default=default, metadata={"help": help_text})))
    for dest, typ, default, help_text in ADAPTER_FIELDS:
        out.append((dest, typ, dataclasses.field(default=default, metadata={"help": help_text})))
    return out


def moe_dataclass(base, name: str):
    """A dataclass `name` = `base` (a FairseqDataclass) + the MoE fields."""
    return dataclasses.make_dataclass(name, moe_fields(), bases=(base,))


def fill_moe_defaults(args) -> None:
    """Give every MoE option missing from `args` its default (architecture functions call this last)."""
    for dest, _, f in moe_fields():
        if getattr(args, dest, None) is None:
            setattr(args, dest, f.default)


def add_moe_args(parser: argparse.ArgumentParser) -> None:
    """Add the MoE flags to a legacy (argparse) fairseq model, without defaults (architectures set them)."""
    group = parser.add_argument_group("megamoe-plugin MoE")
    for dest, typ, f in moe_fields():
        kw: Dict[str, Any] = {"dest": dest, "help": f.metadata["help"], "default": None}
        if typ is bool:
            kw["action"] = "store_true"
        else:
            kw["type"] = typ
        group.add_argument("--" + dest.replace("_", "-"), **kw)


def spell(text: str) -> str:
    """Rewrite the core's --moe-<name> spellings in a message into fairseq's flag spellings."""
    names = {flag(o["name"]): fairseq_flag(o["name"]) for o in iter_options()}
    return re.sub(r"--moe-[a-z0-9-]+", lambda m: names.get(m.group(0), m.group(0)), text)


def _translate(err: ConfigError) -> ConfigError:
    return ConfigError("megamoe-plugin: " + spell(str(err)))


def _get(args, name, default=None):
    v = getattr(args, name, default)
    return default if v is None else v


def config_from_fairseq(args, world_size: int = 1) -> MoEConfig:
    """The MoEConfig of a fairseq model's args (argparse Namespace or omegaconf model config)."""
    d: Dict[str, Any] = {}
    for o in iter_options():
        name = o["name"]
        if name in DERIVED:
            continue
        dest = fairseq_name(name)
        if dest.startswith("moe_no_"):          # the fairseq flag switches a default-on option off
            d[name] = not _get(args, dest, False)
        else:
            d[name] = _get(args, dest, OVERRIDES.get(name, (o["default"],))[0])
    if _get(args, "moe_gating_use_fp32", False):
        d["router_dtype"] = "fp32"
    gate = d["gate"]
    if d["top_k"] in (0, "0"):
        d["top_k"] = 1 if gate == "switch" else 2
    if d["second_expert_policy"] == "sampling":
        raise ConfigError("megamoe-plugin: --moe-second-expert-policy=sampling is not supported; use random "
                          "(keep the 2nd expert with probability 2*p2, GShard) or all")
    frac = float(d["eval_capacity_factor"])
    if frac == -1:
        d["eval_capacity_factor"] = float(d["capacity_factor"])
    elif frac < 0:
        raise ConfigError(f"megamoe-plugin: --moe-eval-capacity-token-fraction={frac}: must be >= 0, or -1 "
                          "(the training capacity)")
    else:   # capacity = frac * tokens = CF * tokens * k / E  ->  CF = frac * E / k
        d["eval_capacity_factor"] = frac * int(d["num_experts"]) / max(int(d["top_k"]), 1)
    act = str(_get(args, "activation_fn", "relu"))
    if act not in ("relu", "gelu"):
        raise ConfigError(f"megamoe-plugin: --activation-fn={act}: MoE experts support relu and gelu")
    d["activation"] = act
    ep = int(d["expert_parallel_size"] or 0)
    d["expert_parallel_size"] = ep if ep > 0 else world_size
    d["world_size"] = world_size
    from ..gates import gate_warnings
    from ..notices import warn_once
    try:
        cfg = MoEConfig(**d)
        for text in gate_warnings(cfg):
            warn_once(spell(text))
        return cfg
    except ConfigError as e:
        raise _translate(e) from None


def moe_freq(args) -> int:
    f = int(_get(args, "moe_freq", 2))
    if f < 1:
        raise ConfigError(f"megamoe-plugin: --moe-freq={f}: must be >= 1 (every N-th layer has an MoE FFN; 0 would "
                          "build a model without experts: use fairseq's transformer_lm / transformer archs for a "
                          "dense model)")
    return f


def check_trainer_settings(cfg, moe: MoEConfig) -> None:
    """fairseq settings that cannot work with sharded experts; `cfg` is fairseq's full config. Raised at trainer
    construction, before the first step."""
    from ..inference.deploy import refuse_in_training
    refuse_in_training(moe, "fairseq-train")
    if moe.nonfinite == "skip":
        raise ConfigError("megamoe-plugin: --moe-nonfinite skip: fairseq-train stops on non-finite gradients "
                          "(FloatingPointError) outside --amp and cannot drop one update; use raise (the default: "
                          "stop naming the MoE layer) or off")
    dt, common = cfg.distributed_training, cfg.common
    if getattr(common, "model_parallel_size", 1) > 1:
        raise ConfigError("megamoe-plugin: --model-parallel-size > 1 with MoE layers is not supported (experts are "
                          "sharded over fairseq's data-parallel ranks)")
    if getattr(cfg.model, "checkpoint_activations", False) or getattr(cfg.model, "offload_activations", False):
        raise ConfigError("megamoe-plugin: --checkpoint-activations with MoE layers is not supported (the MoE "
                          "layer's all-to-all would run again in the recomputation)")
    half = "--fp16" if common.fp16 else "--bf16" if getattr(common, "bf16", False) else None
    memory_efficient = common.memory_efficient_fp16 or getattr(common, "memory_efficient_bf16", False)
    flat = half and not memory_efficient and not getattr(common, "fp16_no_flatten_grads", False)
    if flat and moe.placement in MOVING_PLACEMENTS:
        raise ConfigError(f"megamoe-plugin: --moe-placement {moe.placement} moves experts' rows and their "
                          f"optimizer state; {half} keeps one flat fp32 copy of all parameters: add "
                          f"--fp16-no-flatten-grads or use --memory-efficient-{half[2:]}")
    if moe.expert_parallel_size <= 1:
        return
    if dt.ddp_backend not in ("legacy_ddp", "no_c10d", "c10d", "pytorch_ddp"):
        raise ConfigError(f"megamoe-plugin: --ddp-backend={dt.ddp_backend} with experts sharded over "
                          f"{moe.expert_parallel_size} ranks: use legacy_ddp (or c10d)")
    if getattr(dt, "zero_sharding", "none") != "none":
        raise ConfigError("megamoe-plugin: --zero-sharding with sharded experts is not supported")
    if flat:
        raise ConfigError(f"megamoe-plugin: {half} flattens all parameters into one buffer, mixing experts of "
                          "different ranks; with sharded experts add --fp16-no-flatten-grads or use "
                          f"--memory-efficient-{half[2:]}")
    if getattr(cfg, "ema", None) is not None and cfg.ema.store_ema:
        raise ConfigError("megamoe-plugin: --store-ema with sharded experts is not supported")
