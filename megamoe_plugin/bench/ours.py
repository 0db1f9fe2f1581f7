"""The layers every layer benchmark builds from the same router and expert weights, each as one forward+backward
step (CPU or a device, any dtype): ours (``ours``) and megatron-core's (``megatron_peer``)."""
from __future__ import annotations

import math

import torch

from ..config import MoEConfig
from ..layer import MoELayer


def ours(x, wg, w1, w2, k, dispatch="dropless", cf=1.0, cpu_gemm="auto", kernel="auto", device=None, dtype=None,
         router=None):
    """Our MoELayer with these weights (on `device` in `dtype` when given): (step, dispatch bytes, layer).
    ``router``: megatron-core router fields (layer_inputs.ROUTERS), read as ``--moe-plugin`` reads them."""
    E, H, F_ = w1.shape
    cfg = MoEConfig(num_experts=E, top_k=k, gate="naive", dispatch=dispatch, capacity_factor=cf, min_capacity=0,
                    aux_loss_coeff=0.0, expert_kernel=kernel)
    if router:
        from types import SimpleNamespace
        from ..megatron_adapter.args import config_from_megatron
        cfg = config_from_megatron(SimpleNamespace(num_experts=E, moe_router_topk=k, moe_router_dtype="fp32",
                                                   **router), world_size=1, expert_kernel=kernel)
    layer = MoELayer(cfg, H, F_)
    layer.experts.cpu_gemm = cpu_gemm
    with torch.no_grad():
        layer.gate.weight.copy_(wg); layer.experts.w1.copy_(w1); layer.experts.w2.copy_(w2)
    layer = layer.to(device=device, dtype=dtype)
    xin = x.detach().to(device=device, dtype=dtype).clone().requires_grad_()     # never the caller's x
    grad = torch.ones_like(xin)

    def step():
        for p in layer.parameters():
            p.grad = None
        xin.grad = None
        layer(xin).backward(grad)

    T = x.shape[0]
    if dispatch == "dropless":
        rows = T * k
    else:
        rows = E * max(int(math.ceil(cf * T * k / E)), 0)
    # token buffer sent to experts + the same rows gathered back for the combine; index vectors (int64)
    nbytes = 2 * rows * H * 4 + 3 * T * k * 8
    return step, nbytes, layer


def megatron_peer(x, wg, w1, w2, k, device=None, dtype=None, grouped=False, te=False, router=None):
    """megatron-core's MoELayer (SequentialMLP with these weights; GroupedMLP / TE experts with their own random
    init, for timing only), ``router``: its TransformerConfig router fields: (step, layer)."""
    from ..megatron_adapter.peer import build_megatron_moe_layer, load_expert_weights, load_router_weight
    E, H, F_ = w1.shape
    layer = build_megatron_moe_layer(H, F_, E, k, grouped_gemm=grouped, use_te=te,
                                     router=dict(router, moe_router_dtype="fp32") if router else None)
    if not (grouped or te):
        load_expert_weights(layer, w1, w2)
    load_router_weight(layer, wg)
    layer = layer.to(device=device, dtype=dtype)
    xin = x.detach().to(device=device, dtype=dtype).clone().view(x.shape[0], 1, H).requires_grad_()
    grad = torch.ones_like(xin)

    def step():
        for p in layer.parameters():
            p.grad = None
        xin.grad = None
        out, _ = layer(xin)
        out.backward(grad)
    return step, layer
