"""EPLB, DeepSeek's expert-parallel load balancer (DeepSeek-V3 report; used at run time by vLLM and SGLang), written
here from its published description, as a baseline and a policy beside FlexMoE and shadowing.

Given each expert's load (a moving average of its token counts) and ``P x S`` physical slots (S per rank):

1. **replicate**: every expert gets one slot; each remaining slot goes to the expert with the highest load per
   replica (``load / replicas``; ties to the lower id), at most one replica per rank of its node;
2. **pack onto nodes, then ranks** (hierarchical, when the experts split evenly over the nodes): experts are packed
   onto nodes by balanced greedy packing of their loads (heaviest first, each to the lightest node that still has
   room for E / nodes experts), each node's experts are replicated into the node's slots (step 1), and the replicas
   (weight ``load / replicas``) are packed onto the node's ranks the same way (S replicas per rank, never two of
   one expert on a rank). Without an even split: one node (global balancing). One slot of the cluster (the last
   rank's) stays free: the moves below reorder full ranks through it;
3. **execute** with the FlexMoE machinery: the target table is matched to the current placement (each target rank
   is given to the current rank that already holds most of its experts) and reached by Expand / Shrink / Migrate
   moves (``moves_to``), which carry parameters and optimizer state.

``EPLBPlanner`` reruns this every call (the policy calls it every ``--moe-placement-interval`` steps) from an
exponential moving average of the counts, and keeps a new table only when the cost model predicts it is faster
than the current placement by more than the moves' transfer time amortised over the interval: on balanced
routing it stays idle.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from .state import Move, PlacementError, PlacementState, model_state_bytes

__all__ = ["replicate_by_load", "balanced_packing", "eplb_table", "moves_to", "nodes_from_bandwidth",
           "EPLBPlanner"]


def replicate_by_load(load: Sequence[float], slots: int, max_replicas: Optional[int] = None) -> List[int]:
    """Replicas per expert for ``slots`` slots: one each, then each extra slot to the highest load per replica
    (among experts below ``max_replicas``)."""
    load = [float(x) for x in load]
    cap = max_replicas or slots
    if not len(load) <= slots <= cap * len(load):
        raise ValueError(f"{slots} slots cannot hold {len(load)} experts at 1..{cap} replicas each")
    count = [1] * len(load)
    for _ in range(slots - len(load)):
        e = max((i for i in range(len(load)) if count[i] < cap), key=lambda i: (load[i] / count[i], -i))
        count[e] += 1
    return count


def balanced_packing(weights: Sequence[float], capacities: Sequence[int],
                     labels: Optional[Sequence[int]] = None) -> List[int]:
    """The pack of each item: heaviest first (ties: lower index), each to the lightest pack (ties: lower pack) that
    still has room (``capacities[p]`` items) and, with ``labels``, holds no item of the same label yet. With labels,
    the items whose label repeats (an expert's replicas) go first, heaviest first: placed last, they could find the
    only packs with room already holding their expert."""
    if len(weights) != sum(capacities):
        raise ValueError(f"{len(weights)} items do not fill packs of {list(capacities)}")
    repeats = {} if labels is None else {lab: list(labels).count(lab) for lab in labels}
    order = sorted(range(len(weights)), key=lambda i: (labels is not None and repeats[labels[i]] == 1,
                                                       -float(weights[i]), i))
    total, size = [0.0] * len(capacities), [0] * len(capacities)
    held: List[set] = [set() for _ in capacities]
    pack = [-1] * len(weights)
    for i in order:
        ok = [p for p in range(len(capacities))
              if size[p] < capacities[p] and (labels is None or labels[i] not in held[p])]
        if not ok:
            raise PlacementError("balanced packing: no pack has room for an item without repeating its expert")
        p = min(ok, key=lambda q: (total[q], q))
        pack[i] = p
        total[p] += float(weights[i])
        size[p] += 1
        if labels is not None:
            held[p].add(labels[i])
    return pack


def eplb_table(load: Sequence[float], nodes: Sequence[Sequence[int]], slots_per_rank: int,
               keep_free: int = 1) -> List[List[int]]:
    """The target slot table: for every rank (in rank order) the experts of its slots. ``nodes``: the ranks of each
    node. ``keep_free`` slots (on the last ranks) stay empty: moving to the table needs one free slot to reorder
    full ranks through (there is no swap primitive)."""
    load = [float(x) for x in load]
    num_experts = len(load)
    ranks = sorted(r for node in nodes for r in node)
    if ranks != list(range(len(ranks))):
        raise ValueError(f"nodes {nodes} do not cover ranks 0..P-1 once each")
    if len({len(n) for n in nodes}) != 1 or num_experts % len(nodes):
        nodes = [ranks]                                  # global balancing
    capacity = {r: slots_per_rank for r in ranks}
    for r in sorted(ranks, reverse=True)[:keep_free]:
        capacity[r] -= 1
    per_node = num_experts // len(nodes)
    node_of_expert = balanced_packing(load, [per_node] * len(nodes)) if len(nodes) > 1 else [0] * num_experts
    table: List[List[int]] = [[] for _ in ranks]
    for k, node in enumerate(nodes):
        experts = [e for e in range(num_experts) if node_of_expert[e] == k]
        count = replicate_by_load([load[e] for e in experts], sum(capacity[r] for r in node), len(node))
        items = [e for e, c in zip(experts, count) for _ in range(c)]
        weights = [load[e] / c for e, c in zip(experts, count) for _ in range(c)]
        pack = balanced_packing(weights, [capacity[r] for r in node], labels=items)
        for e, p in zip(items, pack):
            table[node[p]].append(e)
    return [sorted(t) for t in table]


def _match_ranks(state: PlacementState, table: List[List[int]], nodes: Sequence[Sequence[int]]) -> List[List[int]]:
    """``table`` with its rows permuted within each node so that each target row lands on the current rank that
    already holds most of its experts (greedy, largest overlap first): fewer moves, same balance."""
    out = [None] * len(table)
    for node in nodes:
        free_rows, free_ranks = list(node), list(node)
        pairs = sorted(((len(set(table[row]) & set(state.slots_of(r))), row, r) for row in node for r in node),
                       key=lambda x: (-x[0], x[1], x[2]))
        for _, row, r in pairs:
            if row in free_rows and r in free_ranks:
                out[r] = table[row]
                free_rows.remove(row)
                free_ranks.remove(r)
    return out


def moves_to(state: PlacementState, target: List[List[int]], nbytes: int) -> List[Move]:
    """Moves that turn ``state`` (a copy is changed, not ``state``) into one holding ``target[r]`` on every rank r:
    Expand where a slot is free, Shrink where another replica survives, Migrate to break a cycle of full ranks."""
    s = state.copy()
    moves: List[Move] = []

    def missing(r):
        return [e for e in target[r] if not s.count(e, r)]

    def extra(r):
        return [e for e in s.slots_of(r) if e is not None and e not in target[r]]

    for _ in range(4 * s.num_ranks * s.slots_per_rank + 4):
        progress = False
        for r in range(s.num_ranks):                      # expands into free slots
            for e in missing(r):
                if s.free_slots(r):
                    moves.append(s.expand(e, r, src=min(s.ranks_of(e)), state_bytes=nbytes))
                    progress = True
        for r in range(s.num_ranks):                      # drop what is not wanted and survives elsewhere
            for e in extra(r):
                if s.num_replicas(e) > 1:
                    moves.append(s.shrink(e, r))
                    progress = True
        if not any(missing(r) or extra(r) for r in range(s.num_ranks)):
            return moves
        if progress:
            continue
        # every rank that needs an expert is full of last replicas: migrate one last replica to its target rank
        for r in range(s.num_ranks):
            for e in extra(r):
                dst = next((q for q in range(s.num_ranks) if e in missing(q) and s.free_slots(q)), None)
                if dst is not None:
                    moves.append(s.migrate(e, r, dst, state_bytes=nbytes))
                    progress = True
                    break
            if progress:
                break
        if not progress:
            # a full cycle with no free slot anywhere: park one last replica on any rank with room
            r, e = next((r, e) for r in range(s.num_ranks) for e in extra(r))
            dst = next((q for q in range(s.num_ranks) if s.free_slots(q) and not s.count(e, q)), None)
            if dst is None:
                raise PlacementError("EPLB: no free slot anywhere to reorder the experts through")
            moves.append(s.migrate(e, r, dst, state_bytes=nbytes))
    raise PlacementError("EPLB: the target placement was not reached")


def nodes_from_bandwidth(bw: torch.Tensor) -> List[List[int]]:
    """Ranks grouped into nodes: ranks joined by at least half the fastest link's bandwidth are on one node."""
    p = bw.shape[0]
    off = bw.clone().float()
    off.fill_diagonal_(0)
    fast = float(off.max()) if p > 1 else 0.0
    nodes: List[List[int]] = []
    for r in range(p):
        for node in nodes:
            if all(float(off[r, q]) >= 0.5 * fast for q in node):
                node.append(r)
                break
        else:
            nodes.append([r])
    return nodes


class EPLBPlanner:
    """EPLB (module docstring) between optimizer steps. ``plan(state, counts) -> moves``.

    cost_model: a ``perfmodel.cost.CostModel`` (its network: the nodes; its shape: a move's bytes). decay: weight
    of the history in the counts' moving average. horizon: steps a transfer is amortised over. min_gain: the least
    fraction of the layer's step a new table must save, net of its transfers. ``last`` after a call: triggered,
    time_before / time_after (predicted s), transfer_time, moves."""

    def __init__(self, cost_model, decay: float = 0.5, horizon: float = 10.0, nodes=None, min_gain: float = 0.0):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        if not 0.0 <= min_gain < 1.0:
            raise ValueError(f"min_gain must be in [0, 1), got {min_gain}")
        self.cm, self.decay, self.horizon, self.nodes, self.min_gain = \
            cost_model, float(decay), float(horizon), nodes, float(min_gain)
        self.average: Optional[torch.Tensor] = None
        self.last: dict = {}

    def plan(self, state: PlacementState, counts) -> List[Move]:
        c = state._counts(counts)
        self.average = c.clone() if self.average is None else self.decay * self.average + (1 - self.decay) * c
        nodes = self.nodes or nodes_from_bandwidth(self.cm.network.bandwidth_matrix()[:state.num_ranks,
                                                                                      :state.num_ranks])
        nbytes = model_state_bytes(self.cm.shape)
        load = self.average.sum(0).tolist()
        before = self.cm.layer_time(self.average, state.placement()).total
        for groups in (nodes, [list(range(state.num_ranks))]):   # hierarchical; else balanced over all ranks
            try:
                moves = moves_to(state, _match_ranks(state, eplb_table(load, groups, state.slots_per_rank), groups),
                                 nbytes)
                break
            except (PlacementError, ValueError):          # no table without two replicas of an expert on a rank
                continue
        else:
            moves = []
        after = self.cm.layer_time(self.average, state.copy().apply(moves).placement()).total
        transfer = sum(self.cm.move_time(m.nbytes, m.src, m.dst) for m in moves if m.communicates)
        pays = bool(moves) and after + transfer / self.horizon < before * (1.0 - self.min_gain)
        self.last = {"triggered": pays, "time_before": before, "time_after": after if pays else before,
                     "transfer_time": transfer if pays else 0.0, "moves": len(moves) if pays else 0}
        return moves if pays else []
