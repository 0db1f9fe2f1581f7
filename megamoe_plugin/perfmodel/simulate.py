"""Routing-trace simulator: replay recorded [source rank x expert] counts through the cost model.

Owns ``simulate_trace`` (per-step predicted time of a recorded run on a target cluster), ``summarize`` and the two
helpers shared with the roofline: ``remap_counts`` (trace ranks -> target world size) and ``contiguous_placement``.

A trace (``megamoe_plugin.stats.load_trace``) holds ``counts`` [S, L, P, E]: per recorded step and MoE layer, the
kept tokens (assignments) each source rank sent to each expert. Every [P, E] slice is fed to
``CostModel.layer_time`` (paper 003 §3.1 Eq. 1 computation, §3.2 Eq. 2 all-to-all on the topology, §4.1 Eq. 7:
3 compute rounds + 4 all-to-all rounds for forward + backward; FlexMoE paper 001 Eqs. 7-9 when the cost model is
built that way and replicas need synchronising) and the per-layer breakdowns are summed per step. The results are
**model predictions** for the profile/topology given, not measurements; only the routing comes from the real run.

Target world size W != the trace's P: target rank w replays the source row ``w % P`` of the trace (so W = 2P doubles
the global batch with the same per-rank routing pattern; W < P keeps only the first W rows). Experts are placed in
contiguous blocks of E/W per rank (E must be divisible by W), unless ``placement_fn(step, layer, counts)`` returns
a placement (per expert, the list of ranks holding a replica) -- the hook through which placement policies
(FlexMoE's dynamic placements, FasterMoE's shadowing, ...) are evaluated on the same trace.

Planner mode: ``simulate_trace(..., planner=FlexMoEPlanner(...) | ShadowPlanner(...) | StaticPlanner())`` (or
``capacity_factor=`` for DeepSpeed-style static dispatch) hands the remapped counts to
``megamoe_plugin.perfmodel.placement_replay.simulate_placement``: one placement state per layer carried over the steps, the
planner deciding before every step from the previous step's counts, its moves' transfer time added to that step,
and per-step metrics (balance ratio, token and expert efficiency, replicas, moves, bytes moved; see there).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Union

import torch
from .placement_replay import simulate_placement
from ..stats import load_trace
from .cost import CostModel
from .network import Network

__all__ = ["contiguous_placement", "remap_counts", "simulate_trace", "summarize", "format_steps", "format_summary"]


def contiguous_placement(num_experts: int, world_size: int) -> List[List[int]]:
    """Expert e on rank e // (E/W): blocks of E/W consecutive experts per rank (FastMoE / expert parallelism)."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if num_experts % world_size:
        raise ValueError(f"{num_experts} experts cannot be placed in contiguous blocks over {world_size} ranks: the "
                         f"number of experts must be divisible by the world size (or pass a placement_fn)")
    per = num_experts // world_size
    return [[e // per] for e in range(num_experts)]


def remap_counts(counts: torch.Tensor, world_size: int) -> torch.Tensor:
    """[..., P, E] -> [..., W, E] with row w = source row w % P of the input (identity when W == P)."""
    P = counts.shape[-2]
    if world_size == P:
        return counts
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    rows = torch.arange(world_size) % P
    return counts.index_select(counts.dim() - 2, rows)


def _load(trace) -> dict:
    if isinstance(trace, (str, bytes)) or hasattr(trace, "__fspath__"):
        return load_trace(str(trace))
    if not isinstance(trace, dict) or "counts" not in trace:
        raise TypeError("trace must be a path given to load_trace or the dict it returns")
    return trace


def simulate_trace(trace: Union[str, dict], profile, shape, world_size: Optional[int] = None, topology=None,
                   placement_fn: Optional[Callable] = None, cost_model=None, planner=None,
                   **planner_options) -> List[Dict[str, float]]:
    """Predicted time of every recorded step on ``profile`` (or ``topology``, a ``megamoe_plugin.topology.Topology``
    whose network replaces the profile's; the profile still gives the GEMM throughput).

    Returns one dict per step, ``{step, compute, alltoall, sync, total}`` (seconds, summed over the trace's layers;
    ``step`` is the recorded training step). ``placement_fn(step, layer, counts)`` (counts: the [W, E] slice
    after remapping) may return a per-expert list of replica ranks, or None for the contiguous default.
    ``cost_model`` overrides both profile and topology (e.g. a calibrated one).

    ``planner`` (or ``capacity_factor=`` in ``planner_options``): the planner mode of the module docstring; the rows
    then also hold ``transfer`` (included in ``total``) and the metrics of ``placement_replay``.
    ``planner_options`` go to ``simulate_placement`` (slots_per_rank, max_replicas_per_rank, decide_on,
    capacity_factor, states)."""
    data = _load(trace)
    counts = torch.as_tensor(data["counts"])
    if counts.dim() != 4:
        raise ValueError(f"trace counts must be [S, L, P, E], got shape {tuple(counts.shape)}")
    S, L, P, E = counts.shape
    if E != shape.num_experts:
        raise ValueError(f"the trace has {E} experts, the layer shape {shape.num_experts}")
    W = world_size or (topology.num_ranks if topology is not None else P)
    if topology is not None and topology.num_ranks != W:
        raise ValueError(f"topology has {topology.num_ranks} ranks, world size is {W}")
    default = contiguous_placement(E, W) if placement_fn is None else None
    if cost_model is None:
        if topology is not None:
            cost_model = CostModel(Network.from_topology(topology), float(profile.gemm_tflops) * 1e12, shape)
        else:
            cost_model = profile.cost_model(shape, W)
    counts = remap_counts(counts, W)
    steps = [int(s) for s in torch.as_tensor(data.get("steps", torch.arange(S)))]
    if planner is not None or planner_options:
        if placement_fn is not None:
            raise ValueError("give either placement_fn or a planner, not both")
        return simulate_placement(counts, cost_model, planner, steps=steps, **planner_options)
    layers = list(data.get("layers", range(L)))
    out = []
    for s in range(S):
        row = {"step": steps[s], "compute": 0.0, "alltoall": 0.0, "sync": 0.0, "total": 0.0}
        for j in range(L):
            c = counts[s, j]
            placement = placement_fn(steps[s], layers[j], c) if placement_fn is not None else default
            if placement is None:
                placement = default if default is not None else contiguous_placement(E, W)
            bd = cost_model.layer_time(c, placement)
            row["compute"] += bd.compute
            row["alltoall"] += bd.alltoall
            row["sync"] += bd.sync
            row["total"] += bd.total
        out.append(row)
    return out


def summarize(results: Sequence[Dict[str, float]]) -> Dict[str, float]:
    """Mean per-step time and breakdown: steps, mean_{compute,alltoall,sync,total} (s), frac_{compute,alltoall,sync}
    (shares of the summed total), min_total, max_total; with planner rows also mean_/frac_transfer and the means of
    the metrics (mean_balance_ratio, mean_token_efficiency, mean_expert_efficiency, mean_replicas) and the sums
    moves, bytes_moved."""
    n = len(results)
    if n == 0:
        raise ValueError("no steps to summarize")
    parts = ("compute", "alltoall", "sync") + (("transfer",) if all("transfer" in r for r in results) else ())
    tot = {k: sum(r[k] for r in results) for k in parts + ("total",)}
    out = {"steps": n}
    out.update({f"mean_{k}": v / n for k, v in tot.items()})
    out.update({f"frac_{k}": (tot[k] / tot["total"] if tot["total"] > 0 else 0.0) for k in parts})
    for k in ("balance_ratio", "token_efficiency", "expert_efficiency", "replicas", "shadowed"):
        if all(k in r for r in results):
            out[f"mean_{k}"] = sum(r[k] for r in results) / n
    for k in ("moves", "bytes_moved"):
        if all(k in r for r in results):
            out[k] = sum(r[k] for r in results)
    out["min_total"] = min(r["total"] for r in results)
    out["max_total"] = max(r["total"] for r in results)
    return out


def format_steps(results: Sequence[Dict[str, float]]) -> str:
    """Per-step table in milliseconds."""
    head = f"{'step':>8}  {'compute ms':>11}  {'alltoall ms':>11}  {'sync ms':>9}  {'total ms':>10}"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r['step']:>8}  {r['compute'] * 1e3:>11.3f}  {r['alltoall'] * 1e3:>11.3f}  "
                     f"{r['sync'] * 1e3:>9.3f}  {r['total'] * 1e3:>10.3f}")
    return "\n".join(lines)


def format_summary(summary: Dict[str, float]) -> str:
    s = summary
    return (f"{s['steps']} step(s): mean {s['mean_total'] * 1e3:.3f} ms/step "
            f"(min {s['min_total'] * 1e3:.3f}, max {s['max_total'] * 1e3:.3f}); "
            f"compute {s['frac_compute']:.1%}, all-to-all {s['frac_alltoall']:.1%}, sync {s['frac_sync']:.1%}")
