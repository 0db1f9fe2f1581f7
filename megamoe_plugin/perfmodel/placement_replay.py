"""Placement policies replayed through a routing trace on the performance model (``perfmodel.simulate``'s planner
mode), the per-step metrics of FlexMoE §5.4, and a deterministic skewed, drifting synthetic trace.

``simulate_placement(counts [S, L, W, E], cost_model, planner)``: one ``PlacementState`` per MoE layer, starting
from contiguous blocks. Before step s (s >= 1) the planner sees step s-1's counts of each layer (the runtime's
after-step hook decides from the last step's counts, it cannot see the next batch's routing):

* a placement planner (``FlexMoEPlanner``, ``StaticPlanner``: ``plan(state, counts) -> [Move]``): its moves are
  applied to the layer's state, which carries over to the following steps; their transfer time
  ``CostModel.move_time(nbytes, src, dst)``, summed (executed one after the other between the steps, blocking; a
  conservative bound: FlexMoE overlaps them with training on a side stream) is added to step s's time. Step s then
  costs ``CostModel.layer_time(counts_s, state.placement())`` per layer.
* a shadowing planner (``ShadowPlanner``, ``plan(state, counts) -> [expert]``): the experts it picks are shadowed
  during step s only: ``CostModel.shadow_layer_time(counts_s, shadowed, state.placement())`` (their broadcast
  and gradient reduce are inside the step's ``sync``). ``decide_on="current"`` lets it choose from step s's own
  counts instead, as FasterMoE does (it selects after the gate's count exchange, within the iteration).
* ``capacity_factor`` (no planner): DeepSpeed/GShard-style static expert parallelism with capacity: each source
  rank p sends every expert a buffer of cap_p = ceil(cf * A_p / E) tokens (A_p: its assignments), padded, and drops
  what does not fit (``gates.base`` computes the same capacity).

Per step (summed over layers unless said otherwise): ``compute``, ``alltoall``, ``sync`` (replica all-reduce, or
shadowing broadcast + reduce), ``transfer`` (moves before the step), ``total`` (all four), and

* ``balance_ratio``: paper 001 Eq. 6 after routing (max over ranks of the tokens a rank computes / the mean),
  mean over layers;
* ``token_efficiency`` (paper 001 §5.4: "the fraction of input tokens that are processed by the expert network"):
  processed assignments / routed assignments; 1 for every dropless strategy (static, shadowing, FlexMoE), < 1
  with ``capacity_factor``;
* ``expert_efficiency`` (§5.4: "the meaningful computation of GPUs"): processed assignments / (P x the largest
  number of token slots one rank computes), i.e. the share of the synchronous step's expert computation that is
  useful; = 1 / balance ratio when dropless, and counts the padding with capacity. Aggregated over layers as a
  ratio of sums;
* ``replicas``: vExperts beyond one per expert (FlexMoE), or shadowed experts x (P - 1) (shadowing), summed over
  layers; ``shadowed``: experts shadowed; ``moves``: Move records executed before the step; ``bytes_moved``: their
  model-state bytes (shadowing: parameters broadcast + gradients reduced, 2 x (P - 1) x expert parameter bytes per
  shadowed expert).

All times are model predictions for the cost model's cluster; only the routing comes from the trace.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from ..placement.state import PlacementState
from ..stats import TRACE_SCHEMA

__all__ = ["simulate_placement", "layer_metrics", "synthetic_trace", "write_trace", "capacity_counts"]

ROW_KEYS = ("step", "compute", "alltoall", "sync", "transfer", "total", "balance_ratio", "token_efficiency",
            "expert_efficiency", "replicas", "shadowed", "moves", "bytes_moved")


def layer_metrics(rank_load: torch.Tensor, processed: float, routed: float, slots_max: Optional[float] = None):
    """(balance ratio, token efficiency, expert-efficiency numerator, denominator) of one layer step.
    rank_load [P]: tokens each rank computes; slots_max: the largest per-rank computed slots (padding included;
    default rank_load.max())."""
    P = rank_load.numel()
    total = float(rank_load.sum())
    mx = float(rank_load.max()) if slots_max is None else float(slots_max)
    ratio = float(rank_load.max()) * P / total if total > 0 else 1.0
    tok = processed / routed if routed > 0 else 1.0
    return ratio, tok, processed, P * mx


def capacity_counts(counts: torch.Tensor, capacity_factor: float):
    """(kept [P, E], padded [P, E]) of GShard/DeepSpeed capacity dispatch: cap_p = ceil(cf * A_p / E) per source
    rank and expert; kept = min(counts, cap), padded = cap everywhere (the fixed-size buffers that are sent and
    computed)."""
    c = torch.as_tensor(counts).to(torch.float64)
    E = c.shape[1]
    cap = torch.ceil(float(capacity_factor) * c.sum(1) / E)
    return torch.minimum(c, cap[:, None]), cap[:, None].expand_as(c).clone()


def simulate_placement(counts: torch.Tensor, cost_model, planner=None, steps: Optional[Sequence[int]] = None,
                       slots_per_rank: Optional[int] = None, max_replicas_per_rank: int = 1,
                       decide_on: str = "previous", capacity_factor: Optional[float] = None,
                       states: Optional[List[PlacementState]] = None,
                       smoothing: float = 0.0) -> List[Dict[str, float]]:
    """Replay counts [S, L, W, E] (W = the cost model's ranks) with ``planner`` (None: static). Returns one row per
    step with ``ROW_KEYS`` (module docstring). ``states``: initial per-layer states (default contiguous blocks with
    ``slots_per_rank``); they are copied, the caller's are not changed. ``smoothing`` a in [0, 1): the planner
    sees an exponential moving average of the past steps' counts, seen_s = a seen_{s-1} + (1 - a) counts_{s-1}
    (0 = the last step's counts only); it damps decisions when the routing changes faster than moves pay back."""
    c_all = torch.as_tensor(counts).to(torch.float64)
    if c_all.dim() != 4:
        raise ValueError(f"counts must be [S, L, W, E], got {tuple(c_all.shape)}")
    S, L, W, E = c_all.shape
    if W != cost_model.num_ranks:
        raise ValueError(f"counts have {W} ranks, the cost model {cost_model.num_ranks}")
    if decide_on not in ("previous", "current"):
        raise ValueError(f"decide_on must be 'previous' or 'current', got {decide_on!r}")
    if capacity_factor is not None and planner is not None:
        raise ValueError("capacity_factor models static DeepSpeed-style dispatch: give no planner with it")
    shadows = bool(getattr(planner, "shadows", False))
    if not 0.0 <= float(smoothing) < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
    if decide_on == "current" and not shadows:
        raise ValueError("decide_on='current' is for shadowing (chosen within the iteration); placement moves "
                         "are decided from the previous step")
    if states is None:
        states = [PlacementState(E, W, slots_per_rank, max_replicas_per_rank) for _ in range(L)]
    else:
        if len(states) != L:
            raise ValueError(f"{len(states)} states for {L} layers")
        states = [s.copy() for s in states]
    steps = list(range(S)) if steps is None else [int(x) for x in steps]
    param_bytes = cost_model.shape.expert_param_bytes
    rows = []
    seen_avg: List[Optional[torch.Tensor]] = [None] * L
    for s in range(S):
        row = dict.fromkeys(ROW_KEYS, 0.0)
        row["step"] = steps[s]
        ratios, tok_num, tok_den, eff_num, eff_den = [], 0.0, 0.0, 0.0, 0.0
        for j in range(L):
            c = c_all[s, j]
            state = states[j]
            shadowed: List[int] = []
            if s > 0:
                prev = c_all[s - 1, j]
                seen_avg[j] = prev if seen_avg[j] is None else smoothing * seen_avg[j] + (1 - smoothing) * prev
            if planner is not None and shadows:
                seen = c if decide_on == "current" else seen_avg[j]
                shadowed = list(planner.plan(state, seen)) if seen is not None else []
            elif planner is not None and s > 0:
                moves = planner.plan(state, seen_avg[j])
                state.apply(moves)
                row["moves"] += len(moves)
                for m in moves:
                    if m.communicates:
                        row["transfer"] += cost_model.move_time(m.nbytes, m.src, m.dst)
                        row["bytes_moved"] += m.nbytes
            routed = float(c.sum())
            if capacity_factor is not None:
                kept, padded = capacity_counts(c, capacity_factor)
                bd = cost_model.layer_time(padded, state.placement())
                load = state.rank_loads(kept)
                slots = state.rank_loads(padded).max()
                ratio, tok, num, den = layer_metrics(load, float(kept.sum()), routed, slots)
            elif shadowed:
                bd = cost_model.shadow_layer_time(c, shadowed, state.placement())
                keep = torch.ones(E, dtype=torch.bool)
                keep[shadowed] = False
                rest = c.clone()
                rest[:, ~keep] = 0.0
                load = state.rank_loads(rest) + c[:, ~keep].sum(1)
                ratio, tok, num, den = layer_metrics(load, routed, routed)
                row["shadowed"] += len(shadowed)
                row["replicas"] += len(shadowed) * (W - 1)
                row["bytes_moved"] += 2 * (W - 1) * param_bytes * len(shadowed)
            else:
                bd = cost_model.layer_time(c, state.placement())
                ratio, tok, num, den = layer_metrics(state.rank_loads(c), routed, routed)
            row["replicas"] += state.total_replicas - E
            for k in ("compute", "alltoall", "sync"):
                row[k] += getattr(bd, k)
            ratios.append(ratio)
            tok_num += tok * routed
            tok_den += routed
            eff_num += num
            eff_den += den
        row["total"] = row["compute"] + row["alltoall"] + row["sync"] + row["transfer"]
        row["balance_ratio"] = sum(ratios) / len(ratios) if ratios else 1.0
        row["token_efficiency"] = tok_num / tok_den if tok_den > 0 else 1.0
        row["expert_efficiency"] = eff_num / eff_den if eff_den > 0 else 1.0
        for k in ("replicas", "shadowed", "moves", "bytes_moved"):
            row[k] = int(row[k])
        rows.append(row)
    return rows


# --- synthetic trace ---------------------------------------------------------------------------------------------
def synthetic_trace(num_ranks: int, num_experts: int, steps: int, layers: int = 1, tokens_per_rank: int = 4096,
                    top_k: int = 2, skew: float = 1.2, drift: float = 0.05, noise: float = 0.1,
                    seed: int = 0) -> dict:
    """A skewed, slowly drifting routing trace in ``stats.load_trace``'s format (counts [S, L, P, E] int32).

    Expert popularity is Zipf(``skew``) over a ranking that rotates by ``drift`` positions per step (continuous:
    the popularity of rank position x is interpolated between (1 + floor(x))^-skew and (1 + ceil(x))^-skew), each
    layer starts from its own offset, and every source rank perturbs the shares by a log-normal factor of spread
    ``noise`` (its own data). Each (step, layer, rank) row holds ``tokens_per_rank * top_k`` assignments exactly
    (largest remainder). Deterministic for a seed."""
    P, E, S, L = int(num_ranks), int(num_experts), int(steps), int(layers)
    g = torch.Generator().manual_seed(int(seed))
    total = int(tokens_per_rank) * int(top_k)
    zipf = torch.arange(1, E + 1, dtype=torch.float64).pow(-float(skew))
    perm = [torch.randperm(E, generator=g) for _ in range(L)]         # which expert is hot, per layer
    counts = torch.zeros(S, L, P, E, dtype=torch.int32)
    for s in range(S):
        for j in range(L):
            pos = (torch.arange(E, dtype=torch.float64) - s * float(drift) - 0.37 * j) % E
            lo = pos.floor().long() % E
            hi = (lo + 1) % E
            w = pos - pos.floor()
            pop = (1 - w) * zipf[lo] + w * zipf[hi]
            pop = pop[torch.argsort(perm[j])]                          # expert perm[j][i] gets position i
            f = torch.exp(float(noise) * torch.randn(P, E, generator=g, dtype=torch.float64))
            share = pop[None, :] * f
            share = share / share.sum(1, keepdim=True) * total
            base = share.floor()
            short = (total - base.sum(1)).round().long()
            order = torch.argsort(share - base, dim=1, descending=True, stable=True)
            add = torch.zeros_like(base)
            for p in range(P):
                add[p, order[p, :int(short[p])]] = 1.0
            counts[s, j] = (base + add).to(torch.int32)
    return {"schema": "megamoe-trace/1", "world_size": P, "num_experts": E, "top_k": int(top_k),
            "steps": torch.arange(S), "layers": list(range(L)), "counts": counts}


def write_trace(trace: dict, path: str) -> str:
    """Write a merged trace dict (``load_trace``'s format) as the per-rank shards ``<path>.rank<r>`` that
    ``stats.TraceRecorder`` writes, so ``load_trace(path)`` reads it back. Returns path."""
    import os

    counts = torch.as_tensor(trace["counts"])
    S, L, P, E = counts.shape
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    for r in range(P):
        torch.save({"schema": TRACE_SCHEMA, "rank": r, "world_size": P, "num_experts": E,
                    "top_k": int(trace.get("top_k") or 1), "layers": list(trace.get("layers", range(L))),
                    "steps": torch.as_tensor(trace.get("steps", torch.arange(S))),
                    "counts": counts[:, :, r].to(torch.int32).contiguous()}, f"{path}.rank{r}")
    return path
