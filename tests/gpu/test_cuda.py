"""GPU checks (run them on a machine with CUDA: ``python -m pytest -q tests/gpu``). Each is skipped without a CUDA
device, saying so. They cover the code paths that exist only on a GPU: the grouped-GEMM experts in bf16 against an
fp32 reference, the gate's side stream (cached assignments), expert buffering's copy stream and pinned host
memory, CUDA-graph expert graphs, the Megatron example trainer without the CPU shims, and the layer benchmark
against megatron-core."""
import os
import subprocess
import sys

import pytest
import torch

from megamoe_plugin import MoEConfig, MoELayer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the GPU checks did not run")]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CUDA = torch.device("cuda")


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def _layers(cfg, H=256, F=512, seed=0):
    """A bf16 layer and its fp32 reference holding the same (bf16-representable) weights: the gate sees equal
    logits in both (it computes in fp32), so both route alike and only the experts' arithmetic differs."""
    torch.manual_seed(seed)
    low = MoELayer(cfg, H, F).to(CUDA, torch.bfloat16).train()
    ref = MoELayer(cfg.replace(expert_kernel="loop"), H, F).to(CUDA).train()
    with torch.no_grad():
        for a, b in zip(ref.parameters(), low.parameters()):
            a.copy_(b.float())
    return ref, low


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_bf16_layer_forward_backward_against_fp32(dispatch, activation):
    cfg = MoEConfig(num_experts=8, top_k=2, gate="naive", dispatch=dispatch, activation=activation,
                    expert_kernel="grouped_mm")
    ref, low = _layers(cfg)
    x = torch.randn(1024, 256, device=CUDA).to(torch.bfloat16)          # bf16-representable inputs for both
    dy = torch.randn_like(x)
    xr, xl = x.float().requires_grad_(), x.clone().requires_grad_()
    yr, yl = ref(xr), low(xl)
    assert torch.equal(ref.last_routing.expert_ids, low.last_routing.expert_ids)
    (yr * dy.float()).sum().backward()
    (yl * dy).sum().backward()
    assert _rel(yl, yr) < 3e-2 and _rel(xl.grad, xr.grad) < 3e-2
    for (n, a), (_, b) in zip(low.experts.named_parameters(), ref.experts.named_parameters()):
        assert _rel(a.grad, b.grad) < 5e-2, n


def test_auto_kernel_times_both_kernels_on_the_card():
    """``--moe-expert-kernel auto`` on CUDA: both kernels timed with CUDA events (positive, finite), the choice
    cached per shape, and the layer under ``auto`` computes exactly what the chosen kernel computes."""
    import math

    from megamoe_plugin.experts import choice
    (loop_s, grouped_s), = choice._time_both(8, 256, 512, 512, torch.bfloat16, "gelu", False, 4096, 0, "auto", CUDA)
    assert 0 < loop_s < 1 and 0 < grouped_s < 1 and math.isfinite(loop_s + grouped_s)
    choice.forget_decisions()
    cfg = MoEConfig(num_experts=8, top_k=2, gate="naive")
    torch.manual_seed(0)
    auto = MoELayer(cfg, 256, 512).to(CUDA, torch.bfloat16)
    x = torch.randn(2048, 256, device=CUDA).to(torch.bfloat16)
    y = auto(x)
    picked = list(choice.decisions().values())
    assert len(picked) == 1 and picked[0] in ("grouped_mm", "loop")
    fixed = MoELayer(cfg.replace(expert_kernel=picked[0]), 256, 512).to(CUDA, torch.bfloat16)
    fixed.load_state_dict(auto.state_dict())
    assert torch.equal(fixed(x), y)
    print(f"auto on {torch.cuda.get_device_name()}: H256 F512 E8 -> {picked[0]} "
          f"(loop {loop_s * 1e3:.2f} ms, grouped {grouped_s * 1e3:.2f} ms)")


def test_gate_side_stream_with_cached_assignments():
    cfg = MoEConfig(num_experts=8, top_k=2, gate="naive")
    torch.manual_seed(0)
    layer = MoELayer(cfg, 64, 128).to(CUDA)
    x = torch.randn(512, 64, device=CUDA)
    plain = layer.gate(x)
    cached = layer.gate(x, assigned=plain.expert_ids)           # logits and weights on the side stream
    assert cached.side_stream is not None
    cached.join()
    assert torch.equal(cached.expert_ids, plain.expert_ids)
    assert torch.allclose(cached.weights, plain.weights)


def test_expert_buffering_copy_stream_and_pinned_memory():
    from megamoe_plugin.inference import disable_expert_buffering, enable_expert_buffering
    cfg = MoEConfig(num_experts=8, top_k=2, gate="naive", expert_kernel="loop")
    torch.manual_seed(0)
    layer = MoELayer(cfg, 64, 128).to(CUDA).eval()
    xs = [torch.randn(t, 64, device=CUDA) for t in (3, 64, 1, 200)]
    with torch.no_grad():
        ref = [layer(x) for x in xs]
        (buf,) = enable_expert_buffering(layer, 2, "lifo")
        assert all(t.is_pinned() for t in buf.host.values())
        out = [layer(x) for x in xs]
    torch.cuda.synchronize()
    for a, b in zip(out, ref):
        assert torch.equal(a, b)
    assert buf.misses > 0
    disable_expert_buffering(layer)


def test_cuda_graph_expert_graph_equals_eager():
    cfg = MoEConfig(num_experts=8, top_k=2, gate="naive", dispatch="capacity", capacity_factor=1.0)
    torch.manual_seed(0)
    eager = MoELayer(cfg, 64, 128).to(CUDA)
    torch.manual_seed(0)
    graphed = MoELayer(cfg.replace(expert_graph="cuda-graph"), 64, 128).to(CUDA)
    x = torch.randn(256, 64, device=CUDA)
    for _ in range(3):                                      # capture, then replay
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = eager(xa), graphed(xb)
        ya.sum().backward(); yb.sum().backward()
        assert _rel(yb, ya) < 1e-5 and _rel(xb.grad, xa.grad) < 1e-5
    assert graphed.plan.static_graph.builds == 1


def test_megatron_example_trainer_on_one_gpu(tmp_path):
    pytest.importorskip("megatron.core")
    cmd = [sys.executable, os.path.join(ROOT, "examples", "megatron", "pretrain_moe_gpt.py"), "--num-experts", "8",
           "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", "--train-iters", "5", "--log-interval", "1",
           "--bf16", "--moe-plugin", "--moe-plugin-gate", "gshard", "--moe-plugin-second-expert-policy", "all"]
    env = dict(os.environ, WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "iteration" in r.stdout and "cpu_compat" not in r.stdout


def test_bench_layer_cuda_bf16_against_megatron_core():
    from megamoe_plugin.bench.layer import main
    rows = main(["--device", "cuda", "--dtype", "bf16", "--configs", "1", "--routing", "balanced", "--repeat", "5"])
    got = {r["impl"]: r for r in rows}
    assert got["ours dropless"]["time"] > 0 and got["grouped GEMM floor"]["time"] > 0
    assert "megatron-core SequentialMLP" in got
