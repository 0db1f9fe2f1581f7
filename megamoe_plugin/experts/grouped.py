"""The experts as grouped GEMMs (``torch.nn.functional.grouped_mm``): fc1 -> activation -> fc2 and its backward in
five grouped matrix products, the group boundaries a device tensor of offsets (no host synchronisation).

    h  = grouped_mm(x,  w1, offs)  (+ b1 of each row's group)        x [T, H], w1 [E, H, F'] -> h [T, F']
    a  = act(h)
    y  = grouped_mm(a,  w2, offs)  (+ b2)                             w2 [E, F, H]            -> y [T, H]
    backward:  da = grouped_mm(dy, w2^T, offs)      dW2 = grouped_mm(a^T, dy, offs)   ([E, F, H])
               dh = act'(h) da,   dx = grouped_mm(dh, w1^T, offs),   dW1 = grouped_mm(x^T, dh, offs)

This is the GPU path of the field (torchtitan's ``torch._grouped_mm``, Megatron's GroupedMLP / TE grouped linear):
one kernel launch per product for every expert at once. On CUDA the kernels take bf16/fp16 and accumulate in
fp32. On CPU torch 2.13 runs it in fp32 and bf16 but refuses bf16 operands whose rows are not a multiple of 16
bytes: ``GroupedExpertMM`` pads H and F to multiples of 8 elements inside (zeros: the padded products add
nothing) and slices the results back. Rows after the last group (assignments the gate dropped, kept at the tail
so that nobody has to read their number on the host) come out as zeros in the output and the input gradient and
add nothing to any weight or bias gradient; the kernel leaves such rows undefined, so the [rows, H] tensors that
leave this function (the output, the input gradient) and the incoming gradient are masked with a device
comparison, never a host read. The [rows, F] intermediates are not: the weight-gradient products sum over the
groups' rows only and the bias gradients send the tail to a discarded row, so their tail never reaches a
result, and masking them cost a pass over the largest tensors of the layer.

``offsets_from_counts(counts)`` turns per-expert counts (a device tensor) into the int32 cumulative ends the
kernel takes.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .activations import activation as _act, activation_backward as _act_backward, is_gated

_ALIGN = 8          # elements: 16 bytes of bf16 / fp16


def available() -> bool:
    return hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")


def _gmm(a: torch.Tensor, b: torch.Tensor, offs: Optional[torch.Tensor]) -> torch.Tensor:
    fn = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return fn(a, b, offs=offs)


def offsets_from_counts(counts: torch.Tensor) -> torch.Tensor:
    """[E] tokens per expert (any integer dtype, on the tokens' device) -> int32 cumulative group ends."""
    return torch.cumsum(counts.to(torch.int64), 0).to(torch.int32)


def _pad_to(n: int, dtype: torch.dtype, device) -> int:
    needs = dtype in (torch.bfloat16, torch.float16) and device.type == "cpu"
    return -(-n // _ALIGN) * _ALIGN if needs else n


def _pad(t: torch.Tensor, dims) -> torch.Tensor:
    """Zero-pad the trailing dims of ``t`` up to ``dims`` (a tuple aligned with t's last len(dims) dims)."""
    pads = []
    for have, want in zip(reversed(t.shape[-len(dims):]), reversed(dims)):
        pads += [0, want - have]
    return F.pad(t, pads) if any(pads) else t


def _group_ids(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """Per row the index of its group; rows after the last group get E (one past the experts)."""
    return torch.searchsorted(offs.to(torch.int64), torch.arange(rows, device=offs.device), right=True)


def _tail(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, 1] True for the rows after the last group."""
    return (torch.arange(rows, device=offs.device) >= offs[-1].to(torch.int64)).unsqueeze(1) if offs.numel() else \
        torch.ones(rows, 1, dtype=torch.bool, device=offs.device)


class GroupedExpertMM(torch.autograd.Function):
    """y = experts(x) for contiguous expert groups delimited by ``offs`` (module docstring)."""

    @staticmethod
    def forward(ctx, x, w1, w2, b1, b2, offs, activation: str):
        T, H = x.shape
        E, _, F1 = w1.shape
        Fh = w2.shape[1]
        swiglu = is_gated(activation)          # fc1 has two halves [gate | linear]
        Hp = _pad_to(H, x.dtype, x.device)
        Fp = _pad_to(Fh, x.dtype, x.device)
        F1p = 2 * Fp if swiglu else Fp
        xp = _pad(x, (Hp,))
        if swiglu and Fp != Fh:        # pad each half of fc1's output separately so chunk(2) keeps its meaning
            w1p = torch.cat([_pad(w1[..., :Fh], (Hp, Fp)), _pad(w1[..., Fh:], (Hp, Fp))], -1)
        else:
            w1p = _pad(w1, (Hp, F1p))
        w2p = _pad(w2, (Fp, Hp))
        gid = _group_ids(offs, T) if (b1 is not None or b2 is not None) else None
        tail = _tail(offs, T)
        h = _gmm(xp, w1p, offs)
        if b1 is not None:
            b1p = torch.cat([_pad(b1[..., :Fh], (Fp,)), _pad(b1[..., Fh:], (Fp,))], -1) if swiglu else _pad(b1, (F1p,))
            h = h + F.pad(b1p, (0, 0, 0, 1)).index_select(0, gid)        # the tail's "expert" E adds zeros
        a = _act(h, activation)
        y = _gmm(a, w2p, offs)
        if b2 is not None:
            y = y + F.pad(_pad(b2, (Hp,)), (0, 0, 0, 1)).index_select(0, gid)
        y = y.masked_fill_(tail, 0)
        ctx.save_for_backward(xp, w1p, w2p, h, a, offs, tail)
        ctx.dims, ctx.activation, ctx.has_bias, ctx.gid = (H, Fh, Hp, Fp, swiglu), activation, \
            (b1 is not None, b2 is not None), gid
        return y[:, :H] if Hp != H else y

    @staticmethod
    def backward(ctx, dy):
        xp, w1p, w2p, h, a, offs, tail = ctx.saved_tensors
        H, Fh, Hp, Fp, swiglu = ctx.dims
        E = w1p.shape[0]
        dy = _pad(dy.contiguous(), (Hp,)).masked_fill(tail, 0)
        da = _gmm(dy, w2p.transpose(1, 2), offs)
        dw2 = _gmm(a.t(), dy, offs)
        dh = _act_backward(da, h, ctx.activation)
        dx = _gmm(dh, w1p.transpose(1, 2), offs).masked_fill_(tail, 0)
        dw1 = _gmm(xp.t(), dh, offs)
        db1 = db2 = None
        if ctx.has_bias[0]:
            db1 = torch.zeros(E + 1, dh.shape[1], dtype=dh.dtype, device=dh.device).index_add_(0, ctx.gid, dh)[:E]
        if ctx.has_bias[1]:
            db2 = torch.zeros(E + 1, Hp, dtype=dy.dtype, device=dy.device).index_add_(0, ctx.gid, dy)[:E, :H]
        # back to the parameters' own shapes
        if swiglu and Fp != Fh:
            dw1 = torch.cat([dw1[:, :H, :Fh], dw1[:, :H, Fp:Fp + Fh]], -1)
            db1 = None if db1 is None else torch.cat([db1[:, :Fh], db1[:, Fp:Fp + Fh]], -1)
        else:
            F1 = 2 * Fh if swiglu else Fh
            dw1 = dw1[:, :H, :F1]
            db1 = None if db1 is None else db1[:, :F1]
        return dx[:, :H], dw1, dw2[:, :Fh, :H], db1, db2, None, None


def grouped_experts(x, w1, w2, b1, b2, counts: torch.Tensor, activation: str) -> torch.Tensor:
    """The experts on rows sorted into contiguous groups of ``counts`` (a device tensor, or a list)."""
    counts = torch.as_tensor(counts, device=x.device)
    return GroupedExpertMM.apply(x, w1, w2, b1, b2, offsets_from_counts(counts), activation)
