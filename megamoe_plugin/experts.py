"""ExpertBank: the FFN experts that live on one rank, computed as one grouped operation.

Weights are stacked per slot: ``w1`` [E_local, H, F'] (F' = 2F for swiglu), ``w2`` [E_local, F, H], optional biases
``b1`` [E_local, F'] and ``b2`` [E_local, H]. One expert is one index along dim 0 of every parameter (and of every
optimizer state tensor shaped like it), so copying, replicating or moving an expert with its optimizer state
(FlexMoE vExperts, paper 001 §3.2-3.3) is a slice copy: see ``expert_state`` / ``load_expert_state``.

Tokens arrive sorted by local expert in contiguous groups of sizes ``tokens_per_expert`` (host ints known from
the dispatcher's count exchange). ``GroupedExpertFFN`` is a hand-written autograd function: a loop over experts
(never over tokens); each expert's fc1 -> activation -> fc2 (and backward) runs back to back while its rows are in
cache, writing into slices of preallocated output and gradient buffers (``expert_forward`` / ``expert_backward``;
the smart schedule, dispatch/smart.py, runs them chunk by chunk, adding up each chunk's weight gradients). On CPU,
many small groups run side by side on "lanes" (one thread each) instead of one after another with intra-op
threads: small GEMMs parallelise poorly inside, well across experts (``cpu_expert_lanes``; 0 = automatic). CPU
GEMMs go to oneDNN's linear kernel or BLAS (``cpu_gemm``): on this project's machines (AMD EPYC, MKL) oneDNN is
markedly faster for fp32.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


# --- activations, per expert, written into preallocated slices ----------------------------------------------------
def _act_into(h: torch.Tensor, out: torch.Tensor, activation: str) -> None:
    if activation == "gelu":
        torch.ops.aten.gelu.out(h, out=out)
    elif activation == "relu":
        torch.clamp_min(h, 0, out=out)
    else:
        gate, up = h.chunk(2, dim=-1)
        torch.mul(F.silu(gate), up, out=out)


def _act_backward(da: torch.Tensor, h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "gelu":
        return torch.ops.aten.gelu_backward(da, h)
    if activation == "relu":
        return da * (h > 0)
    gate, up = h.chunk(2, dim=-1)
    return torch.cat([torch.ops.aten.silu_backward(da * up, gate), da * F.silu(gate)], dim=-1)


# --- GEMM backends on CPU: BLAS (torch.mm, MKL here) or oneDNN's linear kernel -----------------------------------
_ONEDNN_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None


def onednn_available() -> bool:
    return _ONEDNN_LINEAR is not None


def _use_onednn(x: torch.Tensor, mode: str) -> bool:
    """'auto': oneDNN for fp32/bf16 on CPU where the kernel exists (measured on this project's AMD EPYC machines:
    10-40% faster than MKL's sgemm for the expert shapes); 'onednn' insists; 'blas' never."""
    if mode == "blas" or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if not onednn_available():
        if mode == "onednn":
            raise RuntimeError("--moe-cpu-gemm=onednn: this torch build has no oneDNN linear kernel")
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


def _lanes_for(x: torch.Tensor, groups, w1: torch.Tensor, requested: int) -> int:
    if x.device.type != "cpu" or len(groups) < 2:
        return 1
    threads = torch.get_num_threads()
    if requested:
        return max(1, min(requested, threads, len(groups)))
    mean_rows = sum(t - s for _, s, t in groups) / len(groups)
    small = mean_rows * w1.shape[1] * w1.shape[2] < SMALL_GROUP_FLOPS
    return min(threads, len(groups)) if small and threads > 1 else 1


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


def check_input_dtype(x: torch.Tensor, bank: "ExpertBank", where: str) -> None:
    """A clear error at the MoE layer's entry instead of a oneDNN / matmul failure deep inside: the tokens and
    the experts' weights must have one dtype (the model is cast as a whole, e.g. --bf16 or model.to(dtype))."""
    if x.dtype != bank.w1.dtype:
        raise TypeError(f"{where}: input dtype {x.dtype} but the expert weights are {bank.w1.dtype}; cast the "
                        f"model to the input's dtype (model.to({x.dtype}), or the trainer's --bf16 / --fp16 flag) or "
                        f"the input to {bank.w1.dtype}")


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


class ExpertBank(nn.Module):
    """The experts of one rank. ``forward(x, tokens_per_expert)`` with x sorted into contiguous groups."""

    def __init__(self, num_local_experts: int, hidden_size: int, ffn_hidden_size: int, activation: str = "gelu",
                 bias: bool = False, init_std: float = 0.02, dtype: Optional[torch.dtype] = None, device=None,
                 cpu_lanes: int = 0, cpu_gemm: str = "auto"):
        super().__init__()
        fc1_out = 2 * ffn_hidden_size if activation == "swiglu" else ffn_hidden_size
        kw = {"dtype": dtype, "device": device}
        self.num_local_experts, self.hidden_size, self.ffn_hidden_size = num_local_experts, hidden_size, ffn_hidden_size
        self.activation, self.cpu_lanes, self.cpu_gemm = activation, cpu_lanes, cpu_gemm
        self.w1 = nn.Parameter(torch.empty(num_local_experts, hidden_size, fc1_out, **kw))
        self.w2 = nn.Parameter(torch.empty(num_local_experts, ffn_hidden_size, hidden_size, **kw))
        self.b1 = nn.Parameter(torch.zeros(num_local_experts, fc1_out, **kw)) if bias else None
        self.b2 = nn.Parameter(torch.zeros(num_local_experts, hidden_size, **kw)) if bias else None
        nn.init.normal_(self.w1, std=init_std)
        nn.init.normal_(self.w2, std=init_std)
        for p in self.parameters():
            p.expert = True          # fairseq skips these in the data-parallel all-reduce
            p.allreduce = False      # Megatron reduces these over the expert-data-parallel group

    placement = None    # a placement.runtime.PlacementRuntime when experts can be replicated, moved or shadowed

    def weights(self) -> List[Optional[torch.Tensor]]:
        """[w1, w2, b1, b2] as this step computes with them: the parameters, or with a non-trivial placement the
        replica-synchronised slots plus this step's shadow copies (placement/runtime.py)."""
        if self.placement is None or self.placement.trivial:
            return [self.w1, self.w2, self.b1, self.b2]
        return self.placement.expert_weights(self)

    def forward(self, x: torch.Tensor, tokens_per_expert: List[int]) -> torch.Tensor:
        # zero tokens still go through the function: every parameter gets a (zero) gradient on every rank
        return GroupedExpertFFN.apply(x, *self.weights(), list(tokens_per_expert),
                                      self.activation, self.cpu_lanes, self.cpu_gemm)

    # --- slot API: one expert = one index along dim 0 -------------------------------------------------------
    def expert_params(self) -> Dict[str, nn.Parameter]:
        return {n: p for n, p in self.named_parameters()}

    def expert_state(self, slot: int, optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[str, torch.Tensor]:
        """Copies of one expert's parameters and (if given) the optimizer state tensors shaped like them."""
        out = {n: p.detach()[slot].clone() for n, p in self.expert_params().items()}
        if optimizer is not None:
            for n, p in self.expert_params().items():
                for key, val in optimizer.state.get(p, {}).items():
                    if torch.is_tensor(val) and val.shape == p.shape:
                        out[f"{n}/{key}"] = val[slot].clone()
        return out

    @torch.no_grad()
    def load_expert_state(self, slot: int, state: Dict[str, torch.Tensor],
                          optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        for n, p in self.expert_params().items():
            p[slot].copy_(state[n])
            if optimizer is not None:
                for key, val in optimizer.state.get(p, {}).items():
                    if torch.is_tensor(val) and val.shape == p.shape and f"{n}/{key}" in state:
                        val[slot].copy_(state[f"{n}/{key}"])
