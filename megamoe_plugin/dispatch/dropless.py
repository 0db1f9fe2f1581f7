"""Dropless dispatch = dynamic gating (paper 004 §V): sort, exchange sizes, exchange exactly the tokens.

1. One stable argsort of the T*k assignments by expert id (dropped assignments sort last and are cut off).
2. With expert parallelism: one all-to-all of the per-expert counts, then the tokens with an all-to-all-v whose
   splits are those counts; the received [source][expert] blocks are regrouped to [expert][source].
3. The ExpertBank computes contiguous groups of exactly the received sizes: no capacity, no padding, nothing
   dropped, no [tokens x experts x capacity] mask.
4. Combine reverses the exchange and sums each token's k outputs weighted by the gate, by index.
Every row movement is a gather, backward included (``comm.expand_rows``, ``comm.permute_rows``): the rows are a
permutation of the assignments, so no gradient has to be scatter-added.
Host synchronisation: with one rank none (the counts stay a device tensor; every assignment keeps a row, the
dropped ones sort last and the experts return zeros for them). With expert parallelism exactly one ``tolist`` of
the send and receive counts: the all-to-all-v needs its split sizes on the host (as Megatron's dispatcher does).
With dynamic placement the routing's ids are vExpert slots (``placement.runtime.SlotRouting``), P x W of them:
the same code, the "experts" are slots; a routing computed from every rank's counts (replicas) carries what this
rank receives (``recv_counts``), and the count exchange is skipped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch

from ..gates.base import Routing
from ..parallel import ExpertParallel
from .comm import (all_to_all, exchange_counts, expand_rows, inverse_permutation, permute_rows, regroup_index,
                   return_to_sources, weighted_combine)


@dataclass
class _State:
    position: torch.Tensor                 # [T, k] row of each assignment in the sorted buffer (n = dropped)
    order: Optional[torch.Tensor] = None   # [T * k] the assignment of each row, when every assignment has one
    regroup: Optional[torch.Tensor] = None  # [n_recv] [source][expert] -> [expert][source]
    unregroup: Optional[torch.Tensor] = None  # its inverse
    in_splits: Optional[List[int]] = None
    out_splits: Optional[List[int]] = None


class DroplessDispatcher:
    def __init__(self, num_experts: int, ep: ExpertParallel):
        if ep.layout_only and ep.size > 1:
            raise ValueError("dispatch needs a real expert-parallel process group, not a layout-only description")
        self.num_experts, self.ep = num_experts, ep
        self.num_local_experts = num_experts // ep.size

    def dispatch(self, x: torch.Tensor, routing: Routing) -> Tuple[torch.Tensor, Union[torch.Tensor, List[int]],
                                                                    _State]:
        """-> (rows sorted by local expert, tokens per local expert, state for combine). The counts are the
        routing's device tensor with one rank (rows then include the dropped tail), host ints otherwise."""
        T, k = routing.expert_ids.shape
        E, P = routing.counts.numel(), self.ep.size    # experts, or vExpert slots (placement/runtime.py)
        El = E // P
        order = torch.argsort(routing.masked_ids, stable=True)
        if P == 1:
            position = torch.empty(T * k, dtype=torch.long, device=x.device)
            position[order] = torch.arange(T * k, device=x.device)
            return expand_rows(x, order, k, position), routing.counts, _State(position.view(T, k), order=order)
        recv = getattr(routing, "recv_counts", None)                  # known from every rank's counts, or
        if recv is None:
            recv = exchange_counts(routing.counts, self.ep.group)      # exchanged
        host = torch.cat([routing.counts, recv]).tolist()              # the one host sync of the layer
        send_counts, recv_counts = host[:E], host[E:]
        n = sum(send_counts)
        order = order[:n]
        position = torch.full((T * k,), n, dtype=torch.long, device=x.device)
        position[order] = torch.arange(n, device=x.device)
        rows = expand_rows(x, order, k, position)
        in_splits = [sum(send_counts[r * El:(r + 1) * El]) for r in range(P)]
        out_splits = [sum(recv_counts[s * El:(s + 1) * El]) for s in range(P)]
        received = all_to_all(rows, out_splits, in_splits, self.ep.group)
        regroup = regroup_index(recv.view(P, El), sum(out_splits))
        tokens_per_expert = [sum(recv_counts[s * El + e] for s in range(P)) for e in range(El)]
        unregroup = inverse_permutation(regroup)
        return (permute_rows(received, regroup, unregroup), tokens_per_expert,
                _State(position.view(T, k), order if n == T * k else None, regroup, unregroup, in_splits,
                       out_splits))

    def combine(self, expert_output: torch.Tensor, state: _State, routing: Routing) -> torch.Tensor:
        y = expert_output
        if state.regroup is not None:
            y = return_to_sources(y, state.regroup, state.in_splits, state.out_splits, self.ep.group,
                                  state.unregroup)
        return weighted_combine(y, state.position, routing.weights, inverse=state.order)
