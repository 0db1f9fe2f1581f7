"""The loop kernel of the experts: one GEMM per expert (never per token), fc1 -> activation -> fc2 back to back.

``GroupedExpertFFN`` is a hand-written autograd function over contiguous expert groups whose sizes are host ints.
Each expert's fc1 -> activation -> fc2 (and backward) runs while its rows are in cache, writing into slices of
preallocated output and gradient buffers (``expert_forward`` / ``expert_backward``; the smart schedule,
dispatch/smart.py, runs them chunk by chunk, adding up each chunk's weight gradients). Rows after the last group
(assignments the gate dropped, kept at the tail so the dispatcher need not know their number) come out as zeros
in the output and in the input gradient.

On CPU, many small groups run side by side on "lanes" (one thread each) instead of one after another with
intra-op threads: small GEMMs parallelise poorly inside, well across experts (``ExpertBank.cpu_lanes``; 0 =
automatic, bounded by the cores this process may use shared among the node's ranks, ``lane_budget``). CPU GEMMs
go to oneDNN's linear kernel or BLAS (``cpu_gemm``): on this project's machines (AMD EPYC, MKL) oneDNN is
markedly faster for fp32. This is the right kernel on a CPU; on a GPU the grouped GEMM (experts/grouped.py) is.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .activations import activation_backward as _act_backward, activation_into as _act_into


# --- GEMM backends on CPU: BLAS (torch.mm, MKL here) or oneDNN's linear kernel -----------------------------------
_ONEDNN_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None


_ONEDNN_RUNS: Dict[torch.dtype, bool] = {}     # per dtype: whether oneDNN's linear kernel runs it on this CPU


def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN's linear kernel exists in this torch build and runs ``dtype`` on this CPU: a build can have
    the kernel while the CPU lacks the instructions for one dtype (bf16 needs AVX-512 or AMX; on an AVX2-only CPU
    oneDNN cannot create the primitive), so each dtype is tried once on a tiny GEMM."""
    if _ONEDNN_LINEAR is None:
        return False
    if dtype not in _ONEDNN_RUNS:
        try:
            _ONEDNN_LINEAR(torch.ones(2, 8, dtype=dtype), torch.ones(4, 8, dtype=dtype), None, "none", [], "")
            _ONEDNN_RUNS[dtype] = True
        except RuntimeError:
            _ONEDNN_RUNS[dtype] = False
    return _ONEDNN_RUNS[dtype]


def _use_onednn(x: torch.Tensor, mode: str) -> bool:
    """'auto': oneDNN for fp32/bf16 on CPU where its kernel runs that dtype (measured on this project's AMD EPYC
    machines: 10-40% faster than MKL's sgemm for the expert shapes), else BLAS; 'onednn' insists; 'blas' never."""
    if mode == "blas" or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if not onednn_available(x.dtype):
        if mode == "onednn":
            why = ("this torch build has no oneDNN linear kernel" if _ONEDNN_LINEAR is None
                   else f"oneDNN's linear kernel does not run {x.dtype} on this CPU")
            raise RuntimeError(f"cpu_gemm='onednn': {why}; use 'auto' or 'blas'")
        return False
    return True


def _mm(a: torch.Tensor, b: torch.Tensor, onednn: bool, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a @ b (+ bias) as a new tensor."""
    if onednn:
        return _ONEDNN_LINEAR(a, b.t(), bias, "none", [], "")
    return torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)


def _mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, onednn: bool,
             bias: Optional[torch.Tensor] = None) -> None:
    """out = a @ b (+ bias), out a slice of a preallocated buffer."""
    if onednn:
        out.copy_(_ONEDNN_LINEAR(a, b.t(), bias, "none", [], ""))
    elif bias is None:
        torch.mm(a, b, out=out)
    else:
        torch.addmm(bias, a, b, out=out)


def _bounds(counts: Sequence[int]) -> List[Tuple[int, int, int]]:
    """(expert, start row, end row) of every non-empty group."""
    out, s = [], 0
    for e, c in enumerate(counts):
        if c:
            out.append((e, s, s + c))
        s += c
    return out


# --- CPU expert lanes: small GEMMs run better side by side, one thread each, than one after another ------------
_POOL: Optional[ThreadPoolExecutor] = None
_POOL_SIZE = 0
SMALL_GROUP_FLOPS = 2.5e8     # below this many multiply-adds per group (x @ w1), lanes beat intra-op threads


def lane_budget() -> int:
    """Lanes one process may run: the cores it may use (its CPU affinity) shared among the ranks of its node
    (LOCAL_WORLD_SIZE), and no more than its intra-op threads. Lanes beyond that oversubscribe the cores: measured
    with 2-4 ranks on 2 cores, lanes ran 2.2-2.5x the GEMM floor while one expert after another stayed at
    1.0-1.4x."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local_ranks = 1
    return max(1, min(torch.get_num_threads(), cores // local_ranks))


def _lanes_for(x: torch.Tensor, groups, w1: torch.Tensor, requested: int) -> int:
    if x.device.type != "cpu" or len(groups) < 2:
        return 1
    threads = torch.get_num_threads()
    if requested:
        return max(1, min(requested, threads, len(groups)))
    budget = lane_budget()
    mean_rows = sum(t - s for _, s, t in groups) / len(groups)
    small = mean_rows * w1.shape[1] * w1.shape[2] < SMALL_GROUP_FLOPS
    return min(budget, len(groups)) if small and budget > 1 else 1


def _run_groups(fn, groups, lanes: int) -> None:
    """Call fn(e, s, t) for every group: in order, or spread over `lanes` CPU threads (balanced by rows) with
    single-threaded ops inside, restoring the process's intra-op thread count afterwards."""
    if lanes <= 1:
        for g in groups:
            fn(*g)
        return
    global _POOL, _POOL_SIZE
    if _POOL_SIZE < lanes:
        _POOL, _POOL_SIZE = ThreadPoolExecutor(max_workers=lanes, thread_name_prefix="megamoe-experts"), lanes
    buckets, load = [[] for _ in range(lanes)], [0] * lanes
    for g in sorted(groups, key=lambda g: g[1] - g[2]):          # largest first, to the least loaded lane
        i = load.index(min(load))
        buckets[i].append(g)
        load[i] += g[2] - g[1]
    threads, grad_mode = torch.get_num_threads(), torch.is_grad_enabled()   # grad mode is per thread

    def lane(bucket):
        with torch.set_grad_enabled(grad_mode):
            for g in bucket:
                fn(*g)

    torch.set_num_threads(1)
    try:
        for f in [_POOL.submit(lane, b) for b in buckets]:
            f.result()
    finally:
        torch.set_num_threads(threads)


def expert_forward(x, w1, w2, b1, b2, groups, activation: str, lanes: int, onednn: bool):
    """Forward of the contiguous expert groups `groups` (from ``_bounds``) of x: returns (y, h, a), h and a the
    fc1 output and the activation (what the backward needs). `lanes` as from ``_lanes_for``."""
    h = x.new_empty(x.shape[0], w1.shape[2])
    a = x.new_empty(x.shape[0], w2.shape[1])
    y = x.new_empty(x.shape[0], w2.shape[2])
    used = groups[-1][2] if groups else 0
    if used < x.shape[0]:            # the dropped tail: zero output (its h and a are never read)
        y[used:].zero_()

    def expert(e, s, t):
        _mm_into(x[s:t], w1[e], h[s:t], onednn, None if b1 is None else b1[e])
        _act_into(h[s:t], a[s:t], activation)
        _mm_into(a[s:t], w2[e], y[s:t], onednn, None if b2 is None else b2[e])

    _run_groups(expert, groups, lanes)
    return y, h, a


def expert_backward(dy, x, h, a, w1, w2, groups, activation: str, lanes: int, onednn: bool,
                    gw1, gw2, gb1=None, gb2=None, accumulate=None) -> torch.Tensor:
    """Backward of ``expert_forward``: returns dx and writes the weight gradients of the experts in `groups` into
    gw1/gw2/gb1/gb2 (overwriting them, or adding to them for the experts in the set `accumulate`: the smart
    schedule's later chunks). Experts absent from `groups` are left alone."""
    dx = torch.empty_like(x)
    used = groups[-1][2] if groups else 0
    if used < x.shape[0]:
        dx[used:].zero_()
    acc = accumulate or ()

    def expert(e, s, t):
        da = _mm(dy[s:t], w2[e].t(), onednn)
        add = e in acc
        if add:
            gw2[e].addmm_(a[s:t].t(), dy[s:t])
        else:
            torch.mm(a[s:t].t(), dy[s:t], out=gw2[e])      # weight gradients: BLAS was as fast and needs no copy
        dh = _act_backward(da, h[s:t], activation)
        _mm_into(dh, w1[e].t(), dx[s:t], onednn)
        if add:
            gw1[e].addmm_(x[s:t].t(), dh)
        else:
            torch.mm(x[s:t].t(), dh, out=gw1[e])
        if gb1 is not None:
            if add:
                gb1[e].add_(dh.sum(0))
            else:
                torch.sum(dh, 0, out=gb1[e])
        if gb2 is not None:
            if add:
                gb2[e].add_(dy[s:t].sum(0))
            else:
                torch.sum(dy[s:t], 0, out=gb2[e])

    _run_groups(expert, groups, lanes)
    return dx


class GroupedExpertFFN(torch.autograd.Function):
    """y[g] = act(x[g] @ w1[e] + b1[e]) @ w2[e] + b2[e] for each contiguous group g of expert e.

    Each expert's fc1 -> activation -> fc2 (and its backward) runs back to back while its rows are hot in cache,
    writing into slices of preallocated buffers (no concatenation)."""

    @staticmethod
    def forward(ctx, x, w1, w2, b1, b2, counts: List[int], activation: str, lanes: int, gemm: str):
        groups = _bounds(counts)
        onednn = _use_onednn(x, gemm)
        lanes = _lanes_for(x, groups, w1, lanes)
        y, h, a = expert_forward(x, w1, w2, b1, b2, groups, activation, lanes, onednn)
        ctx.save_for_backward(x, w1, w2, h, a)
        ctx.groups, ctx.activation, ctx.lanes, ctx.onednn = groups, activation, lanes, onednn
        ctx.has_bias = (b1 is not None, b2 is not None)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w1, w2, h, a = ctx.saved_tensors
        dy = dy.contiguous()
        gw1, gw2 = torch.empty_like(w1), torch.empty_like(w2)
        gb1 = w1.new_empty(w1.shape[0], w1.shape[2]) if ctx.has_bias[0] else None
        gb2 = w2.new_empty(w2.shape[0], w2.shape[2]) if ctx.has_bias[1] else None
        busy = {e for e, _, _ in ctx.groups}
        for e in range(w1.shape[0]):             # experts without tokens get zero gradients (only those are filled)
            if e not in busy:
                for g in (gw1, gw2, gb1, gb2):
                    if g is not None:
                        g[e].zero_()
        dx = expert_backward(dy, x, h, a, w1, w2, ctx.groups, ctx.activation, ctx.lanes, ctx.onednn,
                             gw1, gw2, gb1, gb2)
        return dx, gw1, gw2, gb1, gb2, None, None, None, None


