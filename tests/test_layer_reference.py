"""Dropless and capacity layers equal a per-token reference, outputs and gradients, fp64 to 1e-10."""
import pytest
import torch

from conftest import reference_moe
from megamoe_plugin import MoEConfig, MoELayer
from megamoe_plugin.gates import registered_gates

GATE_K = {"naive": 3, "switch": 1, "gshard": 2, "hir": 2, "ta_moe": 2}


def _check(cfg, activation_bias=("gelu", False), T=37, H=12, F=20, seed=0, lanes=0):
    torch.manual_seed(seed)
    cfg = cfg.replace(activation=activation_bias[0], linear_bias=activation_bias[1])
    layer = MoELayer(cfg, H, F).double().train()
    layer.experts.cpu_lanes = lanes
    if layer.experts.b1 is not None:
        torch.nn.init.normal_(layer.experts.b1); torch.nn.init.normal_(layer.experts.b2)
    x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    r = layer.last_routing
    ref = reference_moe(x, r, layer.experts)
    assert (y - ref).abs().max() < 1e-10
    g = torch.randn_like(y)
    params = [x, layer.gate.weight] + list(layer.experts.parameters())
    got = torch.autograd.grad((y * g).sum(), params, retain_graph=True)
    want = torch.autograd.grad((ref * g).sum(), params, allow_unused=True)
    for name, a, b in zip(["x", "gate"] + [n for n, _ in layer.experts.named_parameters()], got, want):
        b = torch.zeros_like(a) if b is None else b
        assert (a - b).abs().max() < 1e-10, name
    return r


@pytest.mark.parametrize("gate", sorted(GATE_K))
@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_every_gate_matches_reference(gate, dispatch):
    topo = gate in ("hir", "ta_moe")
    cfg = MoEConfig(num_experts=6, top_k=GATE_K[gate], gate=gate, dispatch=dispatch, capacity_factor=0.6,
                    jitter_eps=0.1 if gate == "switch" else 0.0, z_loss_coeff=1e-3,
                    world_size=4 if topo else 1, topology="[[0,1],[2,3]]" if topo else "")
    r = _check(cfg)
    if dispatch == "dropless" and gate != "gshard":          # gshard's random routing may drop 2nd choices
        assert int(r.dropped) == 0
    if dispatch == "capacity":
        assert int(r.dropped) > 0                              # CF 0.6 must drop something


@pytest.mark.parametrize("act_bias", [("swiglu", False), ("relu", True), ("gelu", True)])
def test_activations_and_bias(act_bias):
    _check(MoEConfig(num_experts=4, top_k=2, gate="naive"), act_bias)
    _check(MoEConfig(num_experts=4, top_k=2, gate="naive", dispatch="capacity", capacity_factor=1.0), act_bias)


@pytest.mark.parametrize("lanes", [1, 2, 3])
def test_cpu_expert_lanes_match_reference(lanes):
    # experts spread over CPU lanes (threads) must compute exactly what the sequential loop computes
    torch.set_num_threads(2)
    cfg = MoEConfig(num_experts=6, top_k=2, gate="naive")
    _check(cfg, T=64, lanes=lanes)
    _check(cfg.replace(dispatch="capacity", capacity_factor=0.8), ("swiglu", True), T=64, lanes=lanes)


def test_all_builtin_gates_are_covered():
    assert set(GATE_K) <= set(registered_gates())


@pytest.mark.parametrize("act_bias", [("gelu", False), ("swiglu", True)])
@pytest.mark.parametrize("lanes", [1, 2])
def test_onednn_gemms_match_blas_in_fp32(act_bias, lanes):
    from megamoe_plugin.experts import onednn_available
    if not onednn_available():
        pytest.skip("this torch build has no oneDNN linear kernel")
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=6, top_k=2, gate="naive", activation=act_bias[0], linear_bias=act_bias[1])
    blas, dnn = MoELayer(cfg, 32, 48), MoELayer(cfg, 32, 48)
    for layer, gemm in ((blas, "blas"), (dnn, "onednn")):
        layer.experts.cpu_lanes, layer.experts.cpu_gemm = lanes, gemm
    dnn.load_state_dict(blas.state_dict())
    if act_bias[1]:
        with torch.no_grad():
            for layer in (blas, dnn):
                torch.manual_seed(1); layer.experts.b1.normal_(); layer.experts.b2.normal_()
    x = torch.randn(80, 32)
    outs = []
    for layer in (blas, dnn):
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.square().sum().backward()
        outs.append([y, xi.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*outs):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)
