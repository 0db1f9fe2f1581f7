"""Per-layer MoE metrics of the plugin's Megatron layers, reduced over all ranks and written to Megatron's writers.

Every ``PluginMoELayer`` records its kept counts and drops into one process-wide ``StatsSink`` keyed by Megatron's
(global, 1-based) layer number. ``collect_layer_metrics`` sums them over every rank (a collective on the default
group: pipeline stages own different layers, so a dense [layers x (experts + 3)] tensor is all-reduced) and returns
per layer: tokens per expert, dropped fraction, FlexMoE's balance ratio over the expert-parallel devices
(paper 001 Eq. 6) and the expert max/mean load. ``write_layer_metrics`` puts them on Megatron's tensorboard /
wandb writers under ``moe-plugin/``. The placement policy's metrics (``--moe-plugin-placement``; balance ratio,
replicas, moves, ...) go there as ``moe_placement/<key>`` (``write_placement_metrics``) and into the progress line
(``format_placement_metrics``).
"""
from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist

from ..dynamic.runtime import format_metrics as format_dynamic_metrics   # noqa: F401 (re-export)
from ..parallel import comm_device
from ..stats import layer_summary
from .layer import plugin_stats


def collect_layer_metrics(num_layers: int, num_experts: int, ep_size: int, reset: bool = True) -> Dict[int, dict]:
    """Collective over the default group when torch.distributed is initialised; call it on every rank."""
    sink = plugin_stats()
    table = torch.zeros(num_layers + 1, num_experts + 3, dtype=torch.float64)
    for layer, (counts, dropped, assignments, calls) in sink.totals().items():
        if 0 <= layer <= num_layers:
            table[layer, :num_experts] += counts.double().cpu()
            table[layer, num_experts:] += torch.tensor([dropped, float(assignments), float(calls)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        table = table.to(comm_device())
        dist.all_reduce(table)
        table = table.cpu()
    if reset:
        sink.reset()
    El = num_experts // max(ep_size, 1)
    owner = [e // El for e in range(num_experts)]
    out = {}
    for layer in range(num_layers + 1):
        row = table[layer]
        if row[num_experts + 1] == 0:
            continue
        out[layer] = layer_summary(row[:num_experts], float(row[num_experts]), float(row[num_experts + 1]),
                                   owner, ep_size, int(row[num_experts + 2]))
    return out


def write_layer_metrics(metrics: Dict[int, dict], iteration: int, writer=None, wandb_writer=None) -> None:
    scalars = {}
    for layer, m in metrics.items():
        base = f"moe-plugin/layer{layer}"
        scalars[f"{base}/balance_ratio"] = m["balance_ratio"]
        scalars[f"{base}/dropped_fraction"] = m["dropped_fraction"]
        scalars[f"{base}/expert_max_over_mean"] = m["expert_max_over_mean"]
        total = max(sum(m["tokens_per_expert"]), 1)
        for e, c in enumerate(m["tokens_per_expert"]):
            scalars[f"{base}/expert{e}_load"] = c / total
    if writer is not None:
        for k, v in scalars.items():
            writer.add_scalar(k, v, iteration)
    if wandb_writer is not None:
        wandb_writer.log(scalars, iteration)


def format_layer_metrics(metrics: Dict[int, dict]) -> str:
    """One short text fragment for a progress line per MoE layer: ``experts`` = the busiest expert's tokens over
    the mean (the imbalance a gate leaves, visible with one rank too), ``bal`` = the busiest rank's tokens over
    the mean (what expert parallelism and placement pay for; 1.00 with one rank), ``drop`` = dropped fraction."""
    return " | ".join(f"L{layer} experts {m['expert_max_over_mean']:.2f} bal {m['balance_ratio']:.2f} "
                      f"drop {m['dropped_fraction']:.3f}" for layer, m in sorted(metrics.items()))


def _write_scalars(prefix: str, metrics: Dict[str, float], iteration: int, writer=None, wandb_writer=None) -> None:
    scalars = {f"{prefix}/{k}": float(v) for k, v in metrics.items()}
    if writer is not None:
        for k, v in scalars.items():
            writer.add_scalar(k, v, iteration)
    if wandb_writer is not None and scalars:
        wandb_writer.log(scalars, iteration)


def write_placement_metrics(metrics: Dict[str, float], iteration: int, writer=None, wandb_writer=None) -> None:
    """The placement policy's metrics (``PluginStepHooks.placement_metrics``) as ``moe_placement/<key>``."""
    _write_scalars("moe_placement", metrics, iteration, writer, wandb_writer)


def format_placement_metrics(metrics: Dict[str, float]) -> str:
    """One short progress-line fragment: moves so far, replicas, shadowed experts, balance ratio of the last
    steps ('' without placement metrics)."""
    if not metrics:
        return ""
    moves = metrics.get("moves_total", metrics.get("moves", 0.0))
    return (f"placement moves {int(moves)} replicas {int(metrics.get('replicas', 0))} "
            f"shadowed {int(metrics.get('shadowed', 0))} balance {metrics.get('balance_ratio', 1.0):.2f}")


def write_dynamic_metrics(metrics: Dict[str, float], iteration: int, writer=None, wandb_writer=None) -> None:
    """DynaMoE's metrics (``PluginStepHooks.dynamic_metrics``) as ``moe_dynamic/<key>``."""
    _write_scalars("moe_dynamic", metrics, iteration, writer, wandb_writer)


