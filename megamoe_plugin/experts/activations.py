"""The experts' activations (gelu, relu, swiglu), forward and backward, shared by both kernels and the baselines.

``swiglu`` splits fc1's output in two halves [gate | up]: silu(gate) * up."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def activation(h: torch.Tensor, name: str) -> torch.Tensor:
    if name == "gelu":
        return F.gelu(h)
    if name == "relu":
        return F.relu(h)
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def activation_into(h: torch.Tensor, out: torch.Tensor, name: str) -> None:
    """``activation`` written into a preallocated slice."""
    if name == "gelu":
        torch.ops.aten.gelu.out(h, out=out)
    elif name == "relu":
        torch.clamp_min(h, 0, out=out)
    else:
        gate, up = h.chunk(2, dim=-1)
        torch.mul(F.silu(gate), up, out=out)


def activation_backward(da: torch.Tensor, h: torch.Tensor, name: str) -> torch.Tensor:
    """d activation(h) / dh applied to ``da``."""
    if name == "gelu":
        return torch.ops.aten.gelu_backward(da, h)
    if name == "relu":
        return da * (h > 0)
    gate, up = h.chunk(2, dim=-1)
    return torch.cat([torch.ops.aten.silu_backward(da * up, gate), da * F.silu(gate)], dim=-1)
