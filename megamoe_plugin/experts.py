"""ExpertBank: the FFN experts that live on one rank, computed as one grouped operation.

Weights are stacked per slot: ``w1`` [E_local, H, F'] (F' = 2F for swiglu), ``w2`` [E_local, F, H], optional biases
``b1`` [E_local, F'] and ``b2`` [E_local, H]. One expert is one index along dim 0 of every parameter (and of every
optimizer state tensor shaped like it), so copying, replicating or moving an expert with its optimizer state
(FlexMoE vExperts, paper 001 §3.2-3.3) is a slice copy: see ``expert_state`` / ``load_expert_state``.

Tokens arrive sorted by local expert in contiguous groups of sizes ``tokens_per_expert`` (host ints known from
the dispatcher's count exchange). ``GroupedExpertFFN`` is a hand-written autograd function: a loop over experts
(never over tokens) of GEMMs written straight into preallocated output and gradient buffers, one activation over
all rows, and a batched-GEMM path when every group has the same size (capacity mode).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F


# --- activations: forward and backward over the whole [N, F'] buffer at once ------------------------------------
def _act_forward(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "gelu":
        return F.gelu(h)
    if activation == "relu":
        return F.relu(h)
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _act_backward(da: torch.Tensor, h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "gelu":
        return torch.ops.aten.gelu_backward(da, h)
    if activation == "relu":
        return da * (h > 0)
    gate, up = h.chunk(2, dim=-1)
    d_gate = torch.ops.aten.silu_backward(da * up, gate)
    return torch.cat([d_gate, da * F.silu(gate)], dim=-1)


class GroupedExpertFFN(torch.autograd.Function):
    """y[g] = act(x[g] @ w1[e] + b1[e]) @ w2[e] + b2[e] for each contiguous group g of expert e."""

    @staticmethod
    def forward(ctx, x, w1, w2, b1, b2, counts: List[int], activation: str):
        n_exp = w1.shape[0]
        equal = len(set(counts)) == 1 and counts[0] > 0
        h = x.new_empty(x.shape[0], w1.shape[2])
        if equal:
            c = counts[0]
            torch.bmm(x.view(n_exp, c, -1), w1, out=h.view(n_exp, c, -1))
            if b1 is not None:
                h.view(n_exp, c, -1).add_(b1.unsqueeze(1))
        else:
            for e, (s, t) in enumerate(_bounds(counts)):
                if t > s:
                    if b1 is None:
                        torch.mm(x[s:t], w1[e], out=h[s:t])
                    else:
                        torch.addmm(b1[e], x[s:t], w1[e], out=h[s:t])
        a = _act_forward(h, activation)
        y = x.new_empty(x.shape[0], w2.shape[2])
        if equal:
            torch.bmm(a.view(n_exp, c, -1), w2, out=y.view(n_exp, c, -1))
            if b2 is not None:
                y.view(n_exp, c, -1).add_(b2.unsqueeze(1))
        else:
            for e, (s, t) in enumerate(_bounds(counts)):
                if t > s:
                    if b2 is None:
                        torch.mm(a[s:t], w2[e], out=y[s:t])
                    else:
                        torch.addmm(b2[e], a[s:t], w2[e], out=y[s:t])
        ctx.save_for_backward(x, w1, w2, h, a)
        ctx.counts, ctx.activation, ctx.equal = counts, activation, equal
        ctx.has_bias = (b1 is not None, b2 is not None)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w1, w2, h, a = ctx.saved_tensors
        counts, equal = ctx.counts, ctx.equal
        n_exp = w1.shape[0]
        dy = dy.contiguous()
        da = torch.empty_like(a)
        gw1, gw2 = torch.empty_like(w1), torch.empty_like(w2)
        if equal:
            c = counts[0]
            dyv, av = dy.view(n_exp, c, -1), a.view(n_exp, c, -1)
            torch.bmm(dyv, w2.transpose(1, 2), out=da.view(n_exp, c, -1))
            torch.bmm(av.transpose(1, 2), dyv, out=gw2)
        else:
            for e, (s, t) in enumerate(_bounds(counts)):
                if t > s:
                    torch.mm(dy[s:t], w2[e].t(), out=da[s:t])
                    torch.mm(a[s:t].t(), dy[s:t], out=gw2[e])
                else:
                    gw2[e].zero_()
        dh = _act_backward(da, h, ctx.activation)
        del da
        dx = torch.empty_like(x)
        if equal:
            dhv = dh.view(n_exp, c, -1)
            torch.bmm(dhv, w1.transpose(1, 2), out=dx.view(n_exp, c, -1))
            torch.bmm(x.view(n_exp, c, -1).transpose(1, 2), dhv, out=gw1)
        else:
            for e, (s, t) in enumerate(_bounds(counts)):
                if t > s:
                    torch.mm(dh[s:t], w1[e].t(), out=dx[s:t])
                    torch.mm(x[s:t].t(), dh[s:t], out=gw1[e])
                else:
                    gw1[e].zero_()
        gb1 = _group_sums(dh, counts, n_exp) if ctx.has_bias[0] else None
        gb2 = _group_sums(dy, counts, n_exp) if ctx.has_bias[1] else None
        return dx, gw1, gw2, gb1, gb2, None, None


def _bounds(counts: Sequence[int]):
    s = 0
    for c in counts:
        yield s, s + c
        s += c


def _group_sums(g: torch.Tensor, counts: List[int], n_exp: int) -> torch.Tensor:
    seg = torch.repeat_interleave(torch.arange(n_exp, device=g.device), torch.tensor(counts, device=g.device))
    return g.new_zeros(n_exp, g.shape[1]).index_add_(0, seg, g)


class ExpertBank(nn.Module):
    """The experts of one rank. ``forward(x, tokens_per_expert)`` with x sorted into contiguous groups."""

    def __init__(self, num_local_experts: int, hidden_size: int, ffn_hidden_size: int, activation: str = "gelu",
                 bias: bool = False, init_std: float = 0.02, dtype: Optional[torch.dtype] = None, device=None):
        super().__init__()
        fc1_out = 2 * ffn_hidden_size if activation == "swiglu" else ffn_hidden_size
        kw = {"dtype": dtype, "device": device}
        self.num_local_experts, self.hidden_size, self.ffn_hidden_size = num_local_experts, hidden_size, ffn_hidden_size
        self.activation = activation
        self.w1 = nn.Parameter(torch.empty(num_local_experts, hidden_size, fc1_out, **kw))
        self.w2 = nn.Parameter(torch.empty(num_local_experts, ffn_hidden_size, hidden_size, **kw))
        self.b1 = nn.Parameter(torch.zeros(num_local_experts, fc1_out, **kw)) if bias else None
        self.b2 = nn.Parameter(torch.zeros(num_local_experts, hidden_size, **kw)) if bias else None
        nn.init.normal_(self.w1, std=init_std)
        nn.init.normal_(self.w2, std=init_std)
        for p in self.parameters():
            p.expert = True          # fairseq skips these in the data-parallel all-reduce
            p.allreduce = False      # Megatron reduces these over the expert-data-parallel group

    def forward(self, x: torch.Tensor, tokens_per_expert: List[int]) -> torch.Tensor:
        # zero tokens still go through the function: every parameter gets a (zero) gradient on every rank
        return GroupedExpertFFN.apply(x, self.w1, self.w2, self.b1, self.b2, list(tokens_per_expert),
                                      self.activation)

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
