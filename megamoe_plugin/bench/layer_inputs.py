"""The standard layer shapes and the inputs every layer benchmark feeds (CPU and GPU alike): a router whose top-k
follows per-token preferences drawn uniformly (balanced) or from a Zipf(1.2) popularity (skewed)."""
from __future__ import annotations

import math

import torch

CONFIGS = {
    "1": dict(H=512, F=2048, E=8, k=2, T=4096),
    "2": dict(H=256, F=1024, E=32, k=2, T=8192),
    "3": dict(H=512, F=1024, E=64, k=1, T=8192),
    "tiny": dict(H=64, F=128, E=8, k=2, T=512),
    "gpu": dict(H=2048, F=8192, E=8, k=2, T=16384),     # a GPU-sized layer: ~6.6 TFLOP per forward+backward

}


def router_fields(name: str, E: int, k: int) -> dict:
    """megatron-core TransformerConfig router fields of a named router (what a recipe's flags set): ``softmax``
    (megatron-core's default top-k, no loss: {}) or ``deepseek-v3`` (sigmoid scores, aux-loss-free expert bias,
    group-limited routing over 4 groups, scaling 2.5, the sequence-level balance loss)."""
    if name == "softmax":
        return {}
    if name == "deepseek-v3":
        return dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                    moe_router_num_groups=4, moe_router_group_topk=min(k, 2), moe_router_topk_scaling_factor=2.5,
                    moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4, moe_router_pre_softmax=False)
    raise ValueError(f"unknown router {name!r}; known: {', '.join(ROUTERS)}")


ROUTERS = ("softmax", "deepseek-v3")


def make_inputs(H, F, E, k, T, routing: str, seed: int = 0):
    """x, router weight and expert weights such that the router's top-k follows per-token preferences drawn
    uniformly (balanced) or from Zipf(1.2) popularity (skewed): x = noise + decreasing multiples of the
    preferred experts' (normalised) router rows."""
    g = torch.Generator().manual_seed(seed)
    pop = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** (1.2 if routing == "skewed" else 0.0)
    pref = torch.multinomial((pop / pop.sum()).expand(T, E), k, replacement=False, generator=g)   # [T, k]
    wg = torch.randn(E, H, generator=g) / math.sqrt(H)
    unit = wg / wg.norm(dim=1, keepdim=True) * math.sqrt(H)
    x = torch.randn(T, H, generator=g)
    for j in range(k):
        x = x + (4.0 - j) * unit[pref[:, j]]
    w1 = torch.randn(E, H, F, generator=g) * 0.02
    w2 = torch.randn(E, F, H, generator=g) * 0.02
    return x, wg, w1, w2


def route(x, wg, k):
    probs = torch.softmax(x @ wg.t(), -1)
    top = torch.topk(probs, k, -1)
    w = top.values / top.values.sum(-1, keepdim=True) if k > 1 else top.values
    return top.indices, w
