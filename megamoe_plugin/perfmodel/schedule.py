"""Predicted time of an MoE layer under the plain and the smart schedule (paper 003 FasterMoE §4.2, Fig. 8).

Owns the timeline model of the asynchronous fine-grained smart schedule (the implementation is
``megamoe_plugin/dispatch/smart.py``). The expert-parallel ranks form n groups; step j = 0..n-1 has three
operations: S_j (send tokens to group i - j, receive from group i + j), C_j (local experts on the received chunk)
and R_j (return the outputs).

- ``predict_schedule_times(S, C, R=None) -> (plain, smart)``: plain = the faithful sequential schedule of
  Fig. 8a (equal to the synchronous all-to-all / compute / all-to-all) = sum S + sum C + sum R; smart = the
  two-stream schedule of Fig. 8b: the communication stream runs S_0..S_{n-1} then R_0..R_{n-1}, the computation
  stream C_0..C_{n-1}, every operation starting when its stream is free and its inputs exist (C_j after S_j,
  R_j after C_j). R defaults to S (the return moves the same bytes back).
- ``schedule_timeline``: the same, as (op, step, start, end) intervals.
- ``step_traffic`` / ``step_times``: per-step token matrices and per-step times (S_j from
  ``CostModel.alltoall_time`` = ``Network.alltoallv_time`` of all groups' step-j pair traffic at once, C_j from
  ``CostModel.compute_time`` of the tokens each rank receives in that step, Eq.1 with the slowest rank) from a
  routing count matrix [P, E].
- ``predict_layer_schedule``: forward + backward of one layer (backward computation = 2x forward, the same
  exchanges), plain vs smart, from a count matrix and a CostModel.

The paper's upper bound of the speedup, (Lat_comm + Lat_comp) / max(Lat_comm, Lat_comp) (§5.5), is
``speedup_upper_bound``. Units: seconds.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch


def schedule_timeline(step_comm_times: Sequence[float], step_compute_times: Sequence[float],
                      step_return_times: Optional[Sequence[float]] = None) -> List[Tuple[str, int, float, float]]:
    """Fig. 8b: (op, step, start, end) of every S_j, C_j, R_j on two streams (communication, computation)."""
    S = [float(t) for t in step_comm_times]
    C = [float(t) for t in step_compute_times]
    R = S if step_return_times is None else [float(t) for t in step_return_times]
    if not (len(S) == len(C) == len(R)):
        raise ValueError(f"one time per step for S, C and R: got {len(S)}, {len(C)}, {len(R)}")
    if any(t < 0 for t in S + C + R):
        raise ValueError("times must be >= 0")
    ops, comm, comp, s_end, c_end = [], 0.0, 0.0, [], []
    for j, t in enumerate(S):                     # communication stream: S_0 .. S_{n-1}
        ops.append(("S", j, comm, comm + t))
        comm += t
        s_end.append(comm)
    for j, t in enumerate(C):                     # computation stream: C_j once S_j has arrived
        start = max(comp, s_end[j])
        ops.append(("C", j, start, start + t))
        comp = start + t
        c_end.append(comp)
    for j, t in enumerate(R):                     # then R_0 .. R_{n-1} on the communication stream, after C_j
        start = max(comm, c_end[j])
        ops.append(("R", j, start, start + t))
        comm = start + t
    return ops


def predict_schedule_times(step_comm_times: Sequence[float], step_compute_times: Sequence[float],
                           step_return_times: Optional[Sequence[float]] = None) -> Tuple[float, float]:
    """(plain, smart) latency of one exchange-compute-exchange phase from per-step times (see module docstring)."""
    ops = schedule_timeline(step_comm_times, step_compute_times, step_return_times)
    plain = sum(end - start for _, _, start, end in ops)
    smart = max((end for _, _, _, end in ops), default=0.0)
    return plain, smart


def speedup_upper_bound(comm: float, comp: float) -> float:
    """§5.5: (Lat_comm + Lat_comp) / max(Lat_comm, Lat_comp)."""
    top = max(comm, comp)
    return (comm + comp) / top if top > 0 else 1.0


def consecutive_groups(num_ranks: int, n: int) -> List[List[int]]:
    """n groups of consecutive ranks (the layout ``--moe-schedule smart:n`` gives)."""
    if n < 1 or num_ranks % n:
        raise ValueError(f"{n} groups do not divide {num_ranks} ranks")
    g = num_ranks // n
    return [list(range(i * g, (i + 1) * g)) for i in range(n)]


def rank_tokens(counts, num_ranks: Optional[int] = None) -> torch.Tensor:
    """[P, E] tokens source -> expert (experts in contiguous blocks per rank) -> [P, P] tokens source -> rank."""
    c = torch.as_tensor(counts).to(torch.float64)
    P = c.shape[0] if num_ranks is None else num_ranks
    E = c.shape[1]
    if E % P:
        raise ValueError(f"{E} experts do not split over {P} ranks")
    return c.view(c.shape[0], P, E // P).sum(-1)


def step_traffic(tokens: torch.Tensor, groups: Sequence[Sequence[int]]) -> List[torch.Tensor]:
    """Split [P, P] tokens src -> dst into the n steps of the grouped pairwise exchange: in step j a rank of
    group i sends to the ranks of group (i - j) mod n. Returns n matrices [P, P] summing to ``tokens``."""
    t = torch.as_tensor(tokens).to(torch.float64)
    n, P = len(groups), t.shape[0]
    group_of = torch.empty(P, dtype=torch.long)
    for i, g in enumerate(groups):
        group_of[list(g)] = i
    step = (group_of.view(P, 1) - group_of.view(1, P)) % n          # the step in which src sends to dst
    return [t * (step == j) for j in range(n)]


def step_times(counts, groups: Sequence[Sequence[int]], cost_model) -> Tuple[List[float], List[float]]:
    """Per-step forward times (S_j, C_j) of the smart schedule from routing counts [P, E] (or [P, P] rank
    tokens) with a ``perfmodel.CostModel``: S_j = all-to-all-v time of every group's step-j pair traffic over
    the network (R_j is the same bytes back), C_j = Eq.1 on the tokens each rank receives in step j."""
    c = torch.as_tensor(counts).to(torch.float64)
    P = cost_model.num_ranks
    tokens = c if c.shape == (P, P) else rank_tokens(c, P)
    comm, comp = [], []
    for t in step_traffic(tokens, groups):
        comm.append(cost_model.alltoall_time(t))
        comp.append(cost_model.compute_time(t.sum(0)))
    return comm, comp


def predict_layer_schedule(counts, groups: Sequence[Sequence[int]], cost_model,
                           overhead: float = 0.0) -> Dict[str, float]:
    """Forward + backward of one MoE layer, plain vs smart: the forward phase with per-step (S, C), the backward
    phase with (S, 2C) (two GEMMs per forward GEMM, the same exchanges), plus a fixed `overhead` (gate, sort,
    count exchange) that no schedule changes. Returns plain, smart, ratio and the per-step times."""
    comm, comp = step_times(counts, groups, cost_model)
    pf, sf = predict_schedule_times(comm, comp)
    pb, sb = predict_schedule_times(comm, [2 * c for c in comp])
    plain, smart = overhead + pf + pb, overhead + sf + sb
    return {"plain": plain, "smart": smart, "ratio": plain / smart if smart > 0 else 1.0,
            "step_comm": comm, "step_compute": comp}
