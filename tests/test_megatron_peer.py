"""megatron-core's MoELayer built by megamoe_plugin.megatron_adapter.peer, run on CPU through the
shims of megamoe_plugin.megatron_adapter.cpu_compat, checked against a naive per-token reference.

megatron-core 0.16.1 routing defaults (router.py / moe_utils.topk_routing_with_score_function):
moe_router_score_function="softmax", moe_router_pre_softmax=False -> top-k is taken on the
logits and the probabilities are a softmax over the k selected logits, i.e. the full
softmax restricted to the top-k experts and renormalised to sum 1.
"""

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")

from megamoe_plugin.megatron_adapter import cpu_compat  # noqa: E402
from megamoe_plugin.megatron_adapter.peer import (  # noqa: E402
    build_megatron_moe_layer,
    load_expert_weights,
    load_router_weight,
)

S, B, H, FF, E, K = 16, 2, 32, 64, 4, 2


def _reference(x, wg, w1, w2, top_k):
    """Naive MoE: softmax over router logits -> top-k -> renormalise, each token through
    its chosen experts in a Python loop."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = torch.softmax(tokens @ wg.t(), dim=-1)
    top_p, top_e = torch.topk(probs, top_k, dim=-1)
    top_p = top_p / top_p.sum(dim=-1, keepdim=True)
    rows = []
    for t in range(tokens.shape[0]):
        acc = torch.zeros(tokens.shape[-1], dtype=tokens.dtype)
        for j in range(top_k):
            e = int(top_e[t, j])
            acc = acc + top_p[t, j] * (F.gelu(tokens[t] @ w1[e]) @ w2[e])
        rows.append(acc)
    return torch.stack(rows).reshape(x.shape), top_e


@pytest.fixture(scope="module")
def layer():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = build_megatron_moe_layer(
            H, FF, E, K, activation="gelu", dtype=torch.float32, seed=0
        )
    # On a CUDA machine the shims are a no-op and megatron runs natively on the GPU
    # (not exercised here: this project's test machines are CPU-only).
    return layer.cuda() if torch.cuda.is_available() else layer


def test_shims_installed():
    if torch.cuda.is_available():
        pytest.skip("shims are a no-op with CUDA")
    assert cpu_compat.install_cpu_shims() is True
    assert cpu_compat.cpu_shims_installed()
    labels = cpu_compat.applied_shims()
    for letter in "acdfg":
        assert any(lab.startswith(letter + ":") for lab in labels), (letter, labels)
    from megatron.core.transformer.moe import moe_utils

    assert hasattr(moe_utils, "te_general_gemm")  # (e): defined (None) even without TE
    # idempotent: a second call patches nothing twice
    assert cpu_compat.install_cpu_shims() is True
    assert cpu_compat.applied_shims() == labels


def test_megatron_moe_layer_matches_reference(layer):
    g = torch.Generator().manual_seed(1234)
    w1 = torch.randn(E, H, FF, generator=g) / H**0.5
    w2 = torch.randn(E, FF, H, generator=g) / FF**0.5
    wg = torch.randn(E, H, generator=g)
    x = torch.randn(S, B, H, generator=g)
    grad_out = torch.randn(S, B, H, generator=g)

    load_expert_weights(layer, w1, w2)
    load_router_weight(layer, wg)
    layer.zero_grad(set_to_none=True)

    # megatron forward + backward
    dev = layer.router.weight.device
    xm = x.clone().to(dev).requires_grad_(True)
    out, bias = layer(xm)
    assert bias is None
    assert out.shape == (S, B, H)
    (out * grad_out.to(dev)).sum().backward()
    out = out.detach().cpu()

    # naive reference forward + backward on copies of the same weights
    xr = x.clone().requires_grad_(True)
    w1r, w2r, wgr = (t.clone().requires_grad_(True) for t in (w1, w2, wg))
    ref, top_e = _reference(xr, wgr, w1r, w2r, K)
    (ref * grad_out).sum().backward()

    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xm.grad.cpu(), xr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.router.weight.grad.cpu(), wgr.grad, rtol=1e-5, atol=1e-5)

    used = set(top_e.flatten().tolist())
    assert len(used) >= 2
    for e, expert in enumerate(layer.experts.local_experts):
        g1 = expert.linear_fc1.weight.grad
        g2 = expert.linear_fc2.weight.grad
        if e in used:
            # gradients reach the expert weights (non-zero) and equal the reference's
            assert g1 is not None and g2 is not None
            assert g1.abs().sum() > 0 and g2.abs().sum() > 0
            torch.testing.assert_close(g1.cpu(), w1r.grad[e].t(), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(g2.cpu(), w2r.grad[e].t(), rtol=1e-5, atol=1e-5)
        else:
            assert g1 is None or g1.abs().sum() == 0


def test_load_weights_layout_and_shape_checks(layer):
    w1 = torch.arange(E * H * FF, dtype=torch.float32).reshape(E, H, FF)
    w2 = -torch.arange(E * FF * H, dtype=torch.float32).reshape(E, FF, H)
    load_expert_weights(layer, w1, w2)
    expert = layer.experts.local_experts[2]
    assert torch.equal(expert.linear_fc1.weight.cpu(), w1[2].t())  # megatron stores [out, in]
    assert torch.equal(expert.linear_fc2.weight.cpu(), w2[2].t())
    with pytest.raises(ValueError):
        load_expert_weights(layer, w1.transpose(1, 2), w2)
    with pytest.raises(ValueError):
        load_router_weight(layer, torch.zeros(H, E))


def test_cpu_rng_tracker_and_masks():
    if torch.cuda.is_available():
        pytest.skip("shims are a no-op with CUDA")
    cpu_compat.install_cpu_shims()
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.utils import get_default_causal_mask

    with torch.random.fork_rng(devices=[]):
        mrandom.model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0)
        tracker = mrandom.get_cuda_rng_tracker()
        torch.manual_seed(7)
        before = torch.get_rng_state()
        with tracker.fork():
            a = torch.rand(4)
        # the default (CPU) stream is restored and untouched by the fork
        assert torch.equal(torch.get_rng_state(), before)
        with tracker.fork():
            b = torch.rand(4)
        assert not torch.equal(a, b)  # the forked stream advanced
        mrandom.model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0)
        with tracker.fork():
            assert torch.equal(torch.rand(4), a)  # reproducible from the seed

    mask = get_default_causal_mask(4)
    assert mask.device.type == "cpu"
    assert torch.equal(mask, torch.triu(torch.ones(4, 4, dtype=torch.bool), diagonal=1))


def test_single_process_group_leaves_no_file_behind(tmp_path):
    """The one-process group the peer layer (and the example trainer) create needs no rendezvous file: nothing is
    left in the temporary directory even by a process that ends without tearing the group down (killed, or
    os._exit)."""
    code = ("import torch.distributed as dist\n"
            "from megamoe_plugin.megatron_adapter.peer import ensure_megatron_parallel_state\n"
            "ensure_megatron_parallel_state()\n"
            "assert dist.get_world_size() == 1\n"
            "import os; os._exit(0)\n")
    env = dict(os.environ, TMPDIR=str(tmp_path))
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == []
