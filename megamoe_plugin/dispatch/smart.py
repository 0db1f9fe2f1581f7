"""Smart schedule (FasterMoE paper 003 §4.2): grouped pairwise exchange pipelined with the expert computation.

The expert-parallel ranks are split into n groups (``--moe-schedule smart``: one group per rank, which pipelines
the most and measured faster on the emulated cluster; ``smart:node`` one group per node of the topology, the paper's
grouping of closely connected workers; ``smart:N`` N groups). The two all-to-alls of a dropless MoE layer and the expert computation
between them become 3n fine-grained operations. In step j = 0..n-1 a worker of group i

- S_j: sends its tokens for the experts of group t = (i - j) mod n to them and receives the tokens of group
  f = (i + j) mod n for its own experts,
- C_j: computes its local experts on the tokens received from group f,
- R_j: sends those outputs back to group f and receives its own tokens' outputs from group t.

Step 0 is the worker's own group (the fastest links), step n-1 its ring neighbours ("fastest first and last").
Operations run as soon as their data is there: S_{j+1} is posted (asynchronous ``batch_isend_irecv``: gloo runs
it on its background threads, NCCL on its own stream) before C_j computes, R_j is posted right after C_j, and
the worker waits only for the S_j it is about to compute on and, at the very end, for all R. So the exchange of
the next group's tokens, and the return of the previous outputs, overlap the experts' computation.

``SmartExchange`` is one autograd function over dispatch-exchange + experts + return-exchange. Its backward runs
the same pipelined pattern: the gradients of the returned rows go to the expert owners (S), each owner runs the
expert backward on that chunk (C, adding the chunk's weight gradients to the ones of earlier chunks) and sends
the input gradients back (R).

Everything around the exchange is the dropless dispatcher's (dispatch/dropless.py): the same stable argsort, the
same count exchange (the one host sync), the same row buffer sorted by destination, the same regrouping to
[expert][source] before the expert GEMMs and the same ``weighted_combine``. A token's expert math is therefore
the same as in the plain schedule; only the GEMMs' row counts differ (a chunk holds one group's sources), and the
weight gradients are summed chunk by chunk. No loop over tokens; loops over groups, ranks and experts only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..config import ConfigError, MoEConfig, flag
from ..experts import _bounds, _lanes_for, _use_onednn, expert_backward, expert_forward
from ..gates.base import Routing
from ..parallel import ExpertParallel
from .comm import exchange_counts, gather_rows, regroup_index, weighted_combine


# --- groups --------------------------------------------------------------------------------------------------------
def schedule_groups(cfg: MoEConfig, ep: ExpertParallel, topology=None) -> List[List[int]]:
    """The n groups of expert-parallel ranks, in ring order. ``cfg.smart_groups`` 0: one group per rank; > 0: n
    blocks of consecutive ranks; -1: one group per node of the topology (``topology``, else
    ``cfg.build_topology()``), nodes in the order of their first expert-parallel rank."""
    P = ep.size
    if cfg.smart_groups >= 0:
        n = cfg.smart_groups or P
        if P % n:
            raise ConfigError(f"{flag('schedule')}={cfg.schedule}: {n} groups must divide the expert-parallel size {P}")
        g = P // n
        return [list(range(i * g, (i + 1) * g)) for i in range(n)]
    topo = topology if topology is not None else cfg.build_topology()
    nodes = {}
    for r in range(P):
        rank = ep.global_rank_of(r)
        if rank >= topo.num_ranks:
            raise ConfigError(f"{flag('topology')}={topo.spec()}: has no rank {rank} (expert-parallel rank {r}); "
                              f"use {flag('schedule')} smart or smart:N, or a topology of the whole job")
        nodes.setdefault(topo.node_of(rank), []).append(r)
    return list(nodes.values())


# --- the static plan of one call ---------------------------------------------------------------------------------
@dataclass
class _Chunk:
    start: int                          # rows of this group's sources in the received buffer
    end: int
    counts: List[int]                   # tokens per local expert (host ints)
    regroup: Optional[torch.Tensor]     # [source][expert] -> [expert][source] inside the chunk (None = identity)


@dataclass
class _Call:
    group: object
    me: int
    groups: List[List[int]]
    gi: int                             # my group
    send_off: List[int]                 # per EP rank: rows for it in the send buffer (sorted by destination)
    send_len: List[int]
    recv_off: List[int]                 # per EP rank: rows from it in the received buffer (grouped layout)
    recv_len: List[int]
    recv_total: int
    chunks: List[_Chunk]                # per group f
    trace: Optional[list] = None        # when a list: the order of the S/C/R operations (tests, debugging)

    @property
    def n(self) -> int:
        return len(self.groups)

    def target(self, j: int) -> int:   # t_{i,j}: the group my tokens go to in step j
        return (self.gi - j) % self.n

    def source(self, j: int) -> int:   # f_{i,j}: the group whose tokens I compute in step j
        return (self.gi + j) % self.n


def _post(ops: List[dist.P2POp]) -> Tuple[list, list]:
    """Post point-to-point ops asynchronously: (works to wait for before reading received data, send works)."""
    if not ops:
        return [], []
    works = dist.batch_isend_irecv(ops)
    if len(works) != len(ops):                 # coalesced (NCCL): one work for the lot
        return list(works), []
    return ([w for w, op in zip(works, ops) if op.op is dist.irecv],
            [w for w, op in zip(works, ops) if op.op is dist.isend])


def post_dispatch_step(call: _Call, send: torch.Tensor, recv: torch.Tensor, j: int, tag: int = 0,
                       copy_own: bool = True):
    """S_j: post the sends of my rows for group t_j's ranks and the receives of group f_j's rows for my experts
    (my own rows are copied, if `copy_own`). Returns (receive works, send works)."""
    t, f, me = call.target(j), call.source(j), call.me
    ops = []
    for d in call.groups[t]:
        if d != me and call.send_len[d]:
            ops.append(dist.P2POp(dist.isend, send[call.send_off[d]:call.send_off[d] + call.send_len[d]],
                                  group=call.group, tag=tag + j, group_peer=d))
    for s in call.groups[f]:
        if s == me:
            if call.recv_len[me] and copy_own:
                recv[call.recv_off[me]:call.recv_off[me] + call.recv_len[me]].copy_(
                    send[call.send_off[me]:call.send_off[me] + call.send_len[me]])
        elif call.recv_len[s]:
            ops.append(dist.P2POp(dist.irecv, recv[call.recv_off[s]:call.recv_off[s] + call.recv_len[s]],
                                  group=call.group, tag=tag + j, group_peer=s))
    return _post(ops)


def post_return_step(call: _Call, out: torch.Tensor, back: torch.Tensor, j: int, tag: int = 0):
    """R_j: post the sends of `out` (the answers for group f_j's rows, chunk layout) to their sources and the
    receives of my rows' answers from group t_j into `back` (laid out like the send buffer)."""
    t, f, me = call.target(j), call.source(j), call.me
    start = call.chunks[f].start
    ops = []
    for s in call.groups[f]:
        lo = call.recv_off[s] - start
        if s == me:
            if call.send_len[me]:
                back[call.send_off[me]:call.send_off[me] + call.send_len[me]].copy_(out[lo:lo + call.recv_len[me]])
        elif call.recv_len[s]:
            ops.append(dist.P2POp(dist.isend, out[lo:lo + call.recv_len[s]], group=call.group,
                                  tag=tag + call.n + j, group_peer=s))
    for d in call.groups[t]:
        if d != me and call.send_len[d]:
            ops.append(dist.P2POp(dist.irecv, back[call.send_off[d]:call.send_off[d] + call.send_len[d]],
                                  group=call.group, tag=tag + call.n + j, group_peer=d))
    return _post(ops)


def pipeline(call: _Call, send: torch.Tensor, width: int, compute: Callable[[int, torch.Tensor], torch.Tensor],
             tag: int = 0, trace: Optional[list] = None) -> torch.Tensor:
    """The grouped pairwise exchange of ``send`` (rows laid out by destination rank) with ``compute(f, chunk)``
    applied by the owners to the rows received from each group f; returns the answers [rows, width], laid out
    like ``send``. S_{j+1} is posted before C_j runs, R_j right after it; the only waits are for S_j's receives
    before C_j and for everything at the end. ``trace`` (a list) records the order of the operations."""
    n, me = call.n, call.me
    alone = call.groups[call.gi] == [me]       # my group is me: step 0 computes my own rows where they are
    recv = send.new_empty(call.recv_total, send.shape[1])
    back = send.new_empty(send.shape[0], width)
    s_recv, pending = [None] * n, []

    def post_s(j):
        s_recv[j], sent = post_dispatch_step(call, send, recv, j, tag, copy_own=not alone)
        pending.extend(sent)
        if trace is not None:
            trace.append(("S", j))

    post_s(0)
    for j in range(n):
        if j + 1 < n:
            post_s(j + 1)                       # the next group's rows travel while this chunk computes
        for w in s_recv[j]:
            w.wait()
        c = call.chunks[call.source(j)]
        if c.end == c.start:
            out = send.new_empty(0, width)
        elif j == 0 and alone:
            out = compute(call.gi, send[call.send_off[me]:call.send_off[me] + call.send_len[me]])
        else:
            out = compute(call.source(j), recv[c.start:c.end])
        if trace is not None:
            trace.append(("C", j))
        got, sent = post_return_step(call, out, back, j, tag)
        pending.extend(got + sent)
        if trace is not None:
            trace.append(("R", j))
    for w in pending:
        w.wait()
    return back


def _scatter_rows(y: torch.Tensor, regroup: Optional[torch.Tensor]) -> torch.Tensor:
    """Rows in [expert][source] order back to the chunk's [source][expert] layout."""
    if regroup is None:
        return y
    return torch.empty_like(y).index_copy_(0, regroup, y)


class SmartExchange(torch.autograd.Function):
    """rows [N, H] sorted by destination rank -> the experts' outputs for them [N, H], same layout, through the
    pipelined grouped pairwise exchange (forward and backward)."""

    @staticmethod
    def forward(ctx, rows, w1, w2, b1, b2, call: _Call, activation: str, lanes: int, gemm: str):
        onednn = _use_onednn(rows, gemm)
        keep = any(ctx.needs_input_grad[:5])
        saved = [None] * call.n

        def compute(f, chunk):
            c = call.chunks[f]
            x = chunk if c.regroup is None else chunk.index_select(0, c.regroup)
            groups = _bounds(c.counts)
            ln = _lanes_for(x, groups, w1, lanes)
            y, h, a = expert_forward(x, w1, w2, b1, b2, groups, activation, ln, onednn)
            if keep:
                saved[f] = (x, h, a, groups, ln)
            return _scatter_rows(y, c.regroup)

        back = pipeline(call, rows.contiguous(), w2.shape[2], compute, tag=0, trace=call.trace)
        ctx.call, ctx.saved, ctx.activation, ctx.onednn = call, saved, activation, onednn
        ctx.has_bias = (b1 is not None, b2 is not None)
        ctx.save_for_backward(w1, w2)
        return back

    @staticmethod
    def backward(ctx, dback):
        w1, w2 = ctx.saved_tensors
        call = ctx.call
        gw1, gw2 = torch.empty_like(w1), torch.empty_like(w2)
        gb1 = w1.new_empty(w1.shape[0], w1.shape[2]) if ctx.has_bias[0] else None
        gb2 = w2.new_empty(w2.shape[0], w2.shape[2]) if ctx.has_bias[1] else None
        seen = set()

        def compute(f, chunk):
            c = call.chunks[f]
            x, h, a, groups, ln = ctx.saved[f]
            dy = chunk if c.regroup is None else chunk.index_select(0, c.regroup)
            dx = expert_backward(dy, x, h, a, w1, w2, groups, ctx.activation, ln, ctx.onednn, gw1, gw2, gb1, gb2,
                                 accumulate=seen)
            seen.update(e for e, _, _ in groups)
            return _scatter_rows(dx, c.regroup)

        drows = pipeline(call, dback.contiguous(), w1.shape[1], compute, tag=2 * call.n, trace=call.trace)
        for e in range(w1.shape[0]):           # experts without tokens anywhere get zero gradients
            if e not in seen:
                for g in (gw1, gw2, gb1, gb2):
                    if g is not None:
                        g[e].zero_()
        ctx.saved = None
        return drows, gw1, gw2, gb1, gb2, None, None, None, None


# --- the dispatcher --------------------------------------------------------------------------------------------
class SmartDispatcher:
    """Dropless dispatch + experts + combine in one call, through the pipelined grouped pairwise exchange."""

    def __init__(self, num_experts: int, ep: ExpertParallel, groups: Sequence[Sequence[int]]):
        if ep.layout_only and ep.size > 1:
            raise ValueError("dispatch needs a real expert-parallel process group, not a layout-only description")
        flat = sorted(r for g in groups for r in g)
        if flat != list(range(ep.size)):
            raise ValueError(f"smart schedule groups {groups} must partition the expert-parallel ranks "
                             f"0..{ep.size - 1}")
        self.num_experts, self.ep = num_experts, ep
        self.num_local_experts = num_experts // ep.size
        self.groups = [list(g) for g in groups]
        self.group_of = {r: i for i, g in enumerate(self.groups) for r in g}
        self.trace: Optional[list] = None      # set to a list to record each call's operation order

    def plan(self, routing: Routing, device) -> tuple:
        """(order, send counts, the call's static plan): one stable argsort and one count exchange, as dropless."""
        E, P = routing.counts.numel(), self.ep.size    # experts, or vExpert slots (placement/runtime.py)
        El = E // P
        order = torch.argsort(routing.masked_ids, stable=True)
        recv = getattr(routing, "recv_counts", None)                  # known (replicas), or exchanged
        if recv is None:
            recv = exchange_counts(routing.counts, self.ep.group)
        host = torch.cat([routing.counts, recv]).tolist()              # the one host sync of the layer
        send_counts, recv_counts = host[:E], host[E:]
        send_len = [sum(send_counts[r * El:(r + 1) * El]) for r in range(P)]
        recv_len = [sum(recv_counts[s * El:(s + 1) * El]) for s in range(P)]
        send_off = [sum(send_len[:r]) for r in range(P)]
        recv_off, chunks, cursor = [0] * P, [], 0
        recv_mat = recv.view(P, El)
        for g in self.groups:
            start = cursor
            for s in g:
                recv_off[s] = cursor
                cursor += recv_len[s]
            counts = [sum(recv_counts[s * El + e] for s in g) for e in range(El)]
            regroup = None
            if El > 1 and len(g) > 1 and cursor > start:
                idx = torch.tensor(g, device=recv.device)
                regroup = regroup_index(recv_mat.index_select(0, idx), cursor - start).to(device)
            chunks.append(_Chunk(start, cursor, counts, regroup))
        call = _Call(self.ep.group, self.ep.rank, self.groups, self.group_of[self.ep.rank], send_off, send_len,
                     recv_off, recv_len, cursor, chunks, self.trace)
        return order, sum(send_counts), call

    def forward(self, x: torch.Tensor, routing: Routing, bank) -> torch.Tensor:
        """x [T, H] -> y [T, H]: the MoE layer's output for this rank's tokens (gate weights applied)."""
        T, k = routing.expert_ids.shape
        order, n, call = self.plan(routing, x.device)
        order = order[:n]
        position = torch.full((T * k,), n, dtype=torch.long, device=x.device)
        position[order] = torch.arange(n, device=x.device)
        rows = gather_rows(x, order // k)
        back = SmartExchange.apply(rows, *bank.weights(), call, bank.activation,
                                   bank.cpu_lanes, bank.cpu_gemm)
        return weighted_combine(back, position.view(T, k), routing.weights)
