"""The router options' rules: ``--moe-load-balancing-type`` parsed, and the combinations of score function, groups,
expert bias, balancing, capacity and activation checked before any model exists (``MoEConfig.validate`` calls
``validate_router``). Kept apart from ``config.py`` so that file stays the list of options; imports nothing of
the project (``bad(name, message)`` is the config's error raiser).

What is refused, and why (a refused value names its flag):
- expert bias with softmax scores: the bias is added to scores that do not sum to one (sigmoid, sqrtsoftplus),
  as megatron-core requires;
- sinkhorn / quantile_balancing with a loss coefficient, with capacity, or with a gate other than topk: they
  choose the experts themselves (no gate rule can apply) and take no loss;
- group-limited routing with hir: both limit where a token may go, by different rules;
- gshard's random second expert with sigmoid / sqrtsoftplus: its keep probability 2 * p2 needs softmax weights;
- probs on input with top-k > 1 (as megatron-core);
- the gated activations' offset / clamp on an ungated activation.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple
from .gate_registry import gate_class

BALANCE_LOSSES = ("aux_loss", "seq_aux_loss", "global_aux_loss")
BALANCE_ROUTINGS = ("sinkhorn", "quantile_balancing")


def parse_balancing(text: str, default_coeff: float) -> Tuple[List[Tuple[str, float]], Optional[str]]:
    """``"aux_loss"`` / ``"aux_loss:0.01,seq_aux_loss:1e-4"`` / ``"none"`` / ``"sinkhorn"`` -> (losses as
    (type, coefficient) with coefficient > 0, the balancing routing or None). Raises ValueError."""
    losses: List[Tuple[str, float]] = []
    routing = None
    entries = [e.strip() for e in str(text).split(",") if e.strip()]
    if not entries:
        raise ValueError("must name at least one type (none for no balancing)")
    seen = set()
    for entry in entries:
        name, _, coeff_text = entry.partition(":")
        name = name.strip()
        if name in seen:
            raise ValueError(f"{name} is given twice")
        seen.add(name)
        if name == "none":
            if coeff_text:
                raise ValueError("none takes no coefficient")
            continue
        if name in BALANCE_ROUTINGS:
            if coeff_text:
                raise ValueError(f"{name} chooses the experts itself and takes no loss coefficient")
            routing = name
            continue
        if name not in BALANCE_LOSSES:
            raise ValueError(f"unknown type {name!r}; known: {', '.join(BALANCE_LOSSES + BALANCE_ROUTINGS)}, none")
        try:
            coeff = float(coeff_text) if coeff_text else float(default_coeff)
        except ValueError:
            raise ValueError(f"{entry!r}: the coefficient after ':' must be a number") from None
        if coeff < 0:
            raise ValueError(f"{entry!r}: the coefficient must be >= 0")
        if coeff > 0:
            losses.append((name, coeff))
    if routing is not None and len(entries) > 1:
        raise ValueError(f"{routing} is a routing rule of its own and cannot be combined with other types")
    return losses, routing


def validate_router(cfg, bad: Callable[[str, str], None]) -> None:
    """Raise (through ``bad``) for router option combinations that cannot be honoured (module docstring)."""
    try:
        losses, routing = parse_balancing(cfg.load_balancing_type, cfg.aux_loss_coeff)
    except ValueError as e:
        bad("load_balancing_type", str(e))
    if cfg.topk_scaling_factor < 0:
        bad("topk_scaling_factor", "must be >= 0 (0 = no scaling)")
    if cfg.router_bias_update_rate < 0:
        bad("router_bias_update_rate", "must be >= 0")
    if not 0.0 <= cfg.quantile_balancing_ema < 1.0:
        bad("quantile_balancing_ema", "must be in [0, 1)")
    if cfg.router_expert_bias and cfg.score_function == "softmax":
        bad("router_expert_bias", "aux-loss-free expert bias needs --moe-score-function sigmoid or sqrtsoftplus "
                                  "(as megatron-core): softmax scores already compete for one unit of mass")
    _validate_groups(cfg, bad)
    if routing is not None:
        if cfg.gate not in ("topk", "naive"):
            bad("load_balancing_type", f"{routing} chooses the experts itself; it runs with --moe-gate topk, not "
                                       f"{cfg.gate}")
        if cfg.dispatch == "capacity":
            bad("load_balancing_type", f"{routing} with capacity dispatch: megatron-core allows capacity only with "
                                       "aux_loss, seq_aux_loss, global_aux_loss or none")
        if routing == "quantile_balancing" and cfg.group_topk:
            bad("group_topk", "quantile_balancing chooses the experts by its own bias and cannot limit groups")
    if cfg.gate == "gshard" and cfg.second_expert_policy == "random" and cfg.score_function != "softmax":
        bad("second_expert_policy", f"random keeps the 2nd expert with probability 2 * p2, which needs softmax "
                                    f"weights; with --moe-score-function {cfg.score_function} use all")
    if cfg.probs_on_input and cfg.top_k != 1:
        bad("probs_on_input", f"multiplies the expert's input by the token's one weight: needs top-k 1, not "
                              f"{cfg.top_k} (as megatron-core)")
    gated = cfg.activation in ("swiglu", "quick_geglu")
    if not gated and cfg.glu_linear_offset != 0:
        bad("glu_linear_offset", f"applies to gated activations (swiglu, quick_geglu), not {cfg.activation}")
    if cfg.activation_clamp < 0:
        bad("activation_clamp", "must be >= 0 (0 = no clamp)")
    if not gated and cfg.activation_clamp > 0:
        bad("activation_clamp", f"applies to gated activations (swiglu, quick_geglu), not {cfg.activation}")


def _validate_groups(cfg, bad) -> None:
    if cfg.num_groups < 0 or cfg.group_topk < 0:
        bad("num_groups" if cfg.num_groups < 0 else "group_topk", "must be >= 0 (0 = no group-limited routing)")
    if not cfg.num_groups and not cfg.group_topk:
        return
    if getattr(gate_class(cfg.gate), "derives_groups", False):
        return                         # the gate's groups are the topology's nodes (its validate_config)
    if not cfg.group_topk or not cfg.num_groups:
        missing = "group_topk" if not cfg.group_topk else "num_groups"
        bad(missing, "group-limited routing needs both --moe-num-groups and --moe-group-topk")
    if cfg.num_experts % cfg.num_groups:
        bad("num_groups", f"must divide --moe-num-experts={cfg.num_experts} (equal groups)")
    if cfg.group_topk > cfg.num_groups:
        bad("group_topk", f"cannot exceed --moe-num-groups={cfg.num_groups}")
    per_group = cfg.num_experts // cfg.num_groups
    if cfg.top_k > cfg.group_topk * per_group:
        bad("top_k", f"{cfg.top_k} experts do not fit in {cfg.group_topk} groups of {per_group}")
    if cfg.top_k < cfg.group_topk:
        bad("group_topk", f"each chosen group is scored by its top (top-k / group-topk) experts: needs top-k "
                          f">= group-topk, not {cfg.top_k} < {cfg.group_topk}")
    if cfg.gate == "hir":
        bad("num_groups", "hir limits a token's cross-node assignments by its own budget; group-limited routing "
                          "is another limit: use one of the two")
