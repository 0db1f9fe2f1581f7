"""The experts' activations, forward and backward, shared by both kernels and the baselines.

Ungated: ``gelu``, ``relu``, ``squared_relu`` (relu(h)^2, Nemotron). Gated (fc1 has 2F outputs [gate | linear]):
``swiglu`` = silu(gate) * (linear + offset), ``quick_geglu`` = quick_gelu(gate) * (linear + offset) with
quick_gelu(z) = z * sigmoid(1.702 z) (gpt-oss). A gated activation may clamp gate to <= c and linear to [-c, c]
first (megatron-core's ``activation_func_clamp_value``, gpt-oss: 7) and add an offset to the linear half
(``glu_linear_offset``, gpt-oss: 1).

An activation travels through the kernels as one hashable string (a cache key of the kernel choice): the name,
or ``name(offset=O,clamp=C)`` from ``activation_spec``.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

GATED = ("swiglu", "quick_geglu")


class _Spec(NamedTuple):
    name: str
    offset: float
    clamp: float


def activation_spec(name: str, offset: float = 0.0, clamp: float = 0.0) -> str:
    """The string the kernels take for ``name`` with a gated activation's offset and clamp."""
    if not offset and not clamp:
        return name
    return f"{name}(offset={float(offset)!r},clamp={float(clamp)!r})"


@functools.lru_cache(maxsize=None)
def _parse(spec: str) -> _Spec:
    if "(" not in spec:
        return _Spec(spec, 0.0, 0.0)
    name, args = spec[:-1].split("(", 1)
    kv = dict(part.split("=") for part in args.split(","))
    return _Spec(name, float(kv.get("offset", 0.0)), float(kv.get("clamp", 0.0)))


def is_gated(spec: str) -> bool:
    return _parse(spec).name in GATED


def _quick_gelu(z: torch.Tensor) -> torch.Tensor:
    return z * torch.sigmoid(1.702 * z)


def _quick_gelu_backward(dz: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(1.702 * z)
    return dz * (s + 1.702 * z * s * (1.0 - s))


def _halves(h: torch.Tensor, spec: _Spec):
    gate, lin = h.chunk(2, dim=-1)
    if spec.clamp:
        gate, lin = gate.clamp(max=spec.clamp), lin.clamp(-spec.clamp, spec.clamp)
    return gate, lin + spec.offset if spec.offset else lin


def activation(h: torch.Tensor, name: str) -> torch.Tensor:
    spec = _parse(name)
    if spec.name == "gelu":
        return F.gelu(h)
    if spec.name == "relu":
        return F.relu(h)
    if spec.name == "squared_relu":
        return F.relu(h).square()
    gate, lin = _halves(h, spec)
    return (F.silu(gate) if spec.name == "swiglu" else _quick_gelu(gate)) * lin


def activation_into(h: torch.Tensor, out: torch.Tensor, name: str) -> None:
    """``activation`` written into a preallocated slice."""
    spec = _parse(name)
    if spec.name == "gelu":
        torch.ops.aten.gelu.out(h, out=out)
    elif spec.name == "relu":
        torch.clamp_min(h, 0, out=out)
    elif spec.name == "swiglu" and not spec.clamp and not spec.offset:
        gate, up = h.chunk(2, dim=-1)
        torch.mul(F.silu(gate), up, out=out)
    else:
        out.copy_(activation(h, name))


def activation_backward(da: torch.Tensor, h: torch.Tensor, name: str) -> torch.Tensor:
    """d activation(h) / dh applied to ``da``."""
    spec = _parse(name)
    if spec.name == "gelu":
        return torch.ops.aten.gelu_backward(da, h)
    if spec.name == "relu":
        return da * (h > 0)
    if spec.name == "squared_relu":
        return da * 2.0 * F.relu(h)
    raw_gate, raw_lin = h.chunk(2, dim=-1)
    gate, lin = _halves(h, spec)
    if spec.name == "swiglu":
        dgate, act = torch.ops.aten.silu_backward(da * lin, gate), F.silu(gate)
    else:
        dgate, act = _quick_gelu_backward(da * lin, gate), _quick_gelu(gate)
    dlin = da * act
    if spec.clamp:          # the clamp passes the gradient only where it did not clip
        dgate = dgate * (raw_gate <= spec.clamp)
        dlin = dlin * (raw_lin.abs() <= spec.clamp)
    return torch.cat([dgate, dlin], dim=-1)
