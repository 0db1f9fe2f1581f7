"""The grouped-GEMM expert kernel equals the per-expert loop (every gate, dropless and capacity, one and two
ranks, forward and backward), handles bf16 alignment and a dropped tail, and the one-rank layer reads nothing
back to the host; --moe-expert-kernel and the CPU lane budget."""
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from conftest import run_distributed
from megamoe_plugin import MoEConfig, MoELayer
from megamoe_plugin.config import ConfigError
from megamoe_plugin.experts import ExpertBank, choice, grouped, lane_budget

GATE_K = {"naive": 3, "switch": 1, "gshard": 2, "hir": 2, "ta_moe": 2}
pytestmark = pytest.mark.skipif(not grouped.available(), reason="this torch has no grouped GEMM")


def _pair(cfg, H=16, F=24, dtype=torch.float32, seed=0, group=None, bias=False):
    """Two layers with identical weights, one per kernel."""
    layers = []
    for kernel in ("loop", "grouped_mm"):
        torch.manual_seed(seed)
        layer = MoELayer(cfg.replace(expert_kernel=kernel, linear_bias=bias), H, F, ep_group=group).to(dtype).train()
        if bias:
            with torch.no_grad():
                torch.manual_seed(seed + 1)
                layer.experts.b1.normal_(); layer.experts.b2.normal_()
        layers.append(layer)
    return layers


def _fwd_bwd(layer, x, g):
    x = x.clone().requires_grad_()
    y = layer(x)
    (y * g).sum().backward()
    grads = {"x": x.grad}
    grads.update({n: p.grad for n, p in layer.named_parameters() if p.grad is not None})
    return y.detach(), grads


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _compare(cfg, T=40, tol=1e-5, group=None, seed=0, bias=False, dtype=torch.float32):
    loop, gmm = _pair(cfg, group=group, seed=seed, bias=bias, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 10)
    x = torch.randn(T, 16, generator=g).to(dtype)
    dy = torch.randn(T, 16, generator=g).to(dtype)
    torch.manual_seed(seed + 20)               # the same draws for random routing policies and jitter
    y1, g1 = _fwd_bwd(loop, x, dy)
    torch.manual_seed(seed + 20)
    y2, g2 = _fwd_bwd(gmm, x, dy)
    assert torch.equal(loop.last_routing.expert_ids, gmm.last_routing.expert_ids)
    assert torch.equal(loop.last_routing.kept, gmm.last_routing.kept)
    assert _rel(y2, y1) < tol
    assert set(g1) == set(g2) and "experts.w1" in g1
    for name in g1:
        assert _rel(g2[name], g1[name]) < tol, name
    return loop.last_routing


@pytest.mark.parametrize("gate", sorted(GATE_K))
@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_grouped_mm_equals_loop_one_rank(gate, dispatch):
    topo = gate in ("hir", "ta_moe")
    cfg = MoEConfig(num_experts=6, top_k=GATE_K[gate], gate=gate, dispatch=dispatch, capacity_factor=0.6,
                    world_size=4 if topo else 1, topology="[[0,1],[2,3]]" if topo else "")
    r = _compare(cfg, bias=gate == "naive")
    if dispatch == "capacity":
        assert int(r.dropped) > 0          # the padded / dropped rows are part of what is compared


def test_grouped_mm_equals_loop_with_dropped_tail_dropless():
    # gshard's random second-expert policy drops assignments in dropless mode: they sit at the tail of the rows
    cfg = MoEConfig(num_experts=4, top_k=2, gate="gshard", second_expert_policy="random")
    r = _compare(cfg, T=64, bias=True)
    assert int(r.dropped) > 0


def test_bank_tail_rows_are_zero_and_add_no_gradient():
    torch.manual_seed(0)
    bank = ExpertBank(3, 8, 12, "swiglu", bias=True, kernel="grouped_mm")
    with torch.no_grad():
        bank.b1.normal_(); bank.b2.normal_()
    x = torch.randn(10, 8, requires_grad=True)
    counts = torch.tensor([3, 0, 4])                       # rows 7..9 belong to no expert
    y = bank(x, counts)
    y.sum().backward()
    assert torch.count_nonzero(y[7:]) == 0 and torch.count_nonzero(x.grad[7:]) == 0
    # the bias gradient of an expert is the sum over its rows of dL/dy = 1: expert 2 has 4 rows, expert 1 none
    assert torch.equal(bank.b2.grad, torch.tensor([[3.0] * 8, [0.0] * 8, [4.0] * 8]))
    # by hand, expert 0's rows: silu(x w1_gate + b) * (x w1_up + b) @ w2 + b2
    h = x[:3].detach() @ bank.w1[0].detach() + bank.b1[0].detach()
    ref = (torch.nn.functional.silu(h[:, :12]) * h[:, 12:]) @ bank.w2[0].detach() + bank.b2[0].detach()
    assert torch.allclose(y[:3].detach(), ref, rtol=1e-5, atol=1e-6)


def test_garbage_in_the_kernels_tail_rows_reaches_no_result(monkeypatch):
    """The grouped kernel leaves the rows after the last group undefined (uninitialised memory on a GPU): with
    NaN written there by every product, the outputs and every gradient are still finite and equal the clean run."""
    def run():
        torch.manual_seed(0)
        bank = ExpertBank(3, 8, 12, "gelu", bias=True, kernel="grouped_mm")
        x = torch.randn(10, 8, requires_grad=True)
        y = bank(x, torch.tensor([3, 0, 4]))                # rows 7..9 belong to no expert
        (y * torch.arange(80.0).view(10, 8)).sum().backward()
        return [y.detach(), x.grad] + [p.grad for p in bank.parameters()]

    clean = run()
    real = grouped._gmm

    def poisoned(a, b, offs):
        out = real(a, b, offs)
        if out.dim() == 2:                                  # [rows, N]: the rows after offs[-1] are the tail
            out[int(offs[-1]):] = float("nan")
        return out
    monkeypatch.setattr(grouped, "_gmm", poisoned)
    dirty = run()
    for a, b in zip(dirty, clean):
        assert torch.isfinite(a).all() and torch.equal(a, b)


@pytest.mark.parametrize("H,F,act", [(12, 20, "gelu"), (16, 24, "swiglu"), (13, 7, "relu")])
def test_bf16_grouped_mm_within_bf16_tolerance_of_fp32(H, F, act):
    # H=12/13 and F=20/7 are not multiples of 8: torch's CPU bf16 grouped GEMM refuses them unpadded
    torch.manual_seed(0)
    bank32 = ExpertBank(4, H, F, act, bias=True, kernel="loop")
    with torch.no_grad():
        bank32.b1.normal_(std=0.1); bank32.b2.normal_(std=0.1)
    bank16 = ExpertBank(4, H, F, act, bias=True, kernel="grouped_mm").to(torch.bfloat16)
    bank16.load_state_dict({k: v.to(torch.bfloat16) for k, v in bank32.state_dict().items()})
    counts = [5, 0, 9, 6]
    x = torch.randn(20, H)
    dy = torch.randn(20, H)
    x32, x16 = x.clone().requires_grad_(), x.to(torch.bfloat16).requires_grad_()
    y32, y16 = bank32(x32, counts), bank16(x16, torch.tensor(counts))
    (y32 * dy).sum().backward()
    (y16 * dy.to(torch.bfloat16)).sum().backward()
    assert y16.dtype == torch.bfloat16 and bank16.w1.grad.dtype == torch.bfloat16
    assert _rel(y16, y32) < 3e-2 and _rel(x16.grad, x32.grad) < 3e-2
    for name in ("w1", "w2", "b1", "b2"):
        assert _rel(getattr(bank16, name).grad, getattr(bank32, name).grad) < 3e-2, name


def test_bf16_layer_grouped_mm_close_to_fp32_loop():
    cfg = MoEConfig(num_experts=6, top_k=2, gate="naive")
    torch.manual_seed(3)
    ref = MoELayer(cfg.replace(expert_kernel="loop"), 16, 24).train()
    torch.manual_seed(3)
    low = MoELayer(cfg.replace(expert_kernel="grouped_mm"), 16, 24).to(torch.bfloat16).train()
    x = torch.randn(48, 16)
    y_ref = ref(x)
    y_low = low(x.to(torch.bfloat16))
    assert torch.equal(ref.last_routing.expert_ids, low.last_routing.expert_ids)
    assert _rel(y_low, y_ref) < 3e-2


def test_bf16_loop_kernel_runs_on_any_cpu_and_stays_close_to_fp32():
    """The loop kernel in bf16 with its CPU GEMM library chosen automatically: oneDNN where its linear kernel runs bf16 on this CPU (it
    needs AVX-512 or AMX), BLAS otherwise; either way forward and backward run and stay within bf16's error."""
    from megamoe_plugin.experts.loop import onednn_available
    cfg = MoEConfig(num_experts=6, top_k=2, gate="naive", expert_kernel="loop")
    torch.manual_seed(5)
    ref = MoELayer(cfg, 16, 24).train()
    torch.manual_seed(5)
    low = MoELayer(cfg, 16, 24).to(torch.bfloat16).train()
    x = torch.randn(48, 16)
    xr, xl = x.clone().requires_grad_(), x.to(torch.bfloat16).requires_grad_()
    y_ref, y_low = ref(xr), low(xl)
    y_ref.square().sum().backward()
    y_low.float().square().sum().backward()
    assert _rel(y_low, y_ref) < 3e-2 and _rel(xl.grad, xr.grad) < 5e-2
    assert _rel(low.experts.w1.grad, ref.experts.w1.grad) < 5e-2
    assert isinstance(onednn_available(torch.bfloat16), bool)


def test_onednn_forced_where_it_cannot_run_the_dtype_names_the_flag(monkeypatch):
    """A CPU whose oneDNN cannot create the bf16 primitive (stood in for by the per-dtype probe's answer, since
    this machine's CPU is what it is): auto falls back to BLAS, a forced onednn says why and what to use."""
    from megamoe_plugin.experts import loop
    if loop._ONEDNN_LINEAR is None:
        pytest.skip("this torch build has no oneDNN linear kernel")
    monkeypatch.setitem(loop._ONEDNN_RUNS, torch.bfloat16, False)
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert loop._use_onednn(x, "auto") is False
    assert loop._use_onednn(x.float(), "auto") is loop.onednn_available(torch.float32)
    with pytest.raises(RuntimeError, match="cpu_gemm='onednn': oneDNN's linear kernel does not run "
                                           "torch.bfloat16 on this CPU"):
        loop._use_onednn(x, "onednn")


class _NoHostReads:
    """Fail on any tensor -> host read (tolist / item / bool / int / float) inside the block."""

    NAMES = ("tolist", "item", "__bool__", "__int__", "__float__")

    def __enter__(self):
        self.saved = {n: getattr(torch.Tensor, n) for n in self.NAMES}

        def refuse(name):
            def f(self, *a, **k):
                raise AssertionError(f"host read: Tensor.{name}")
            return f
        for n in self.NAMES:
            setattr(torch.Tensor, n, refuse(n))
        return self

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
@pytest.mark.parametrize("gate", ["naive", "switch", "gshard"])
def test_one_rank_layer_reads_nothing_back_to_the_host(gate, dispatch):
    cfg = MoEConfig(num_experts=6, top_k=GATE_K[gate], gate=gate, dispatch=dispatch, expert_kernel="grouped_mm",
                    second_expert_policy="all")
    torch.manual_seed(0)
    layer = MoELayer(cfg, 16, 24).train()
    x = torch.randn(32, 16, requires_grad=True)
    layer(x)                                  # first call: any one-time set-up may read what it likes
    with _NoHostReads():
        y = layer(x)
        (y.sum() + layer.aux_loss).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_loop_kernel_reads_counts_once():
    # the loop kernel needs the group sizes on the host: exactly one read (a CPU tensor: no device sync)
    cfg = MoEConfig(num_experts=6, top_k=2, gate="naive", expert_kernel="loop")
    layer = MoELayer(cfg, 16, 24)
    calls = []
    orig = torch.Tensor.tolist

    def counting(self):
        calls.append(tuple(self.shape))
        return orig(self)
    torch.Tensor.tolist = counting
    try:
        layer(torch.randn(20, 16))
    finally:
        torch.Tensor.tolist = orig
    assert calls == [(6,)]


def _ep_worker(rank, world):
    torch.manual_seed(100 + rank)              # each rank its own tokens
    for gate in sorted(GATE_K):
        topo = gate in ("hir", "ta_moe")
        for dispatch in ("dropless", "capacity"):
            cfg = MoEConfig(num_experts=4, top_k=GATE_K[gate] if gate != "naive" else 2, gate=gate,
                            dispatch=dispatch, capacity_factor=0.8, expert_parallel_size=2, world_size=2,
                            topology="[[0],[1]]" if topo else "")
            _compare(cfg, T=24 + 4 * rank, group=dist.group.WORLD, seed=rank)


def test_grouped_mm_equals_loop_two_ranks():
    run_distributed(_ep_worker, 2)


def test_auto_kernel_needs_the_margin_to_leave_the_loop(monkeypatch):
    x, w1, w2 = torch.randn(64, 8), torch.randn(2, 8, 16), torch.randn(2, 16, 8)
    for timing, want in (([(1.0, 0.95)] * 2, "loop"), ([(1.0, 0.5)] * 2, "grouped_mm"), ([(1.0, 1.5)] * 2, "loop"),
                         # a quota pause inflated the loop's wall time; its CPU time shows the loop is faster
                         ([(3.0, 1.2), (0.6, 0.6)], "loop")):
        choice.forget_decisions()
        monkeypatch.setattr(choice, "_time_both", lambda *a, t=timing: t)
        assert choice.choose_kernel("auto", x, w1, w2, "gelu", False) == want
    monkeypatch.setattr(choice, "_time_both", lambda *a: (_ for _ in ()).throw(AssertionError("measured twice")))
    assert choice.choose_kernel("auto", x, w1, w2, "gelu", False) == "loop"     # cached per shape
    # placement and shadowing change the expert count and the rows of a rank: no new measurement
    assert choice.choose_kernel("auto", torch.randn(700, 8), torch.randn(5, 8, 16), torch.randn(5, 16, 8),
                                "gelu", False) == "loop"
    assert choice.choose_kernel("loop", x, w1, w2, "gelu", False) == "loop"
    assert choice.choose_kernel("grouped_mm", x, w1, w2, "gelu", False) == "grouped_mm"
    choice.forget_decisions()


def test_auto_kernel_on_cuda_leaves_the_grouped_gemm_only_for_a_clearly_faster_loop(monkeypatch):
    """On a GPU the decision is the CUDA-event timing's: the loop only at <= LOOP_MARGIN_CUDA of the grouped GEMM's
    time, once per card and shape, with the first call's row bucket (at most MAX_TIMING_ROWS_CUDA) on the call's
    device. (The device itself is faked: the tensors' device type is all the decision reads.)"""
    seen = []
    monkeypatch.setattr(choice, "grouped_mm_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake card")
    x = SimpleNamespace(device=torch.device("cuda", 0), shape=(40000, 8), dtype=torch.bfloat16)
    w1, w2 = torch.randn(8, 8, 16), torch.randn(8, 16, 8)
    for timing, want in (((1.0, 1.0), "grouped_mm"), ((0.96, 1.0), "grouped_mm"), ((0.94, 1.0), "loop")):
        choice.forget_decisions()
        monkeypatch.setattr(choice, "_time_both", lambda *a, t=timing: seen.append(a) or [t])
        assert choice.choose_kernel("auto", x, w1, w2, "gelu", False) == want
        assert choice.choose_kernel("auto", x, w1, w2, "gelu", False) == want        # cached: timed once
    assert len(seen) == 3 and seen[0][7] == choice.MAX_TIMING_ROWS_CUDA and seen[0][10] == x.device
    assert choice.choose_kernel("grouped_mm", x, w1, w2, "gelu", False) == "grouped_mm"

    def refuses(*a):
        raise RuntimeError("grouped_mm: unsupported dtype")
    choice.forget_decisions()
    monkeypatch.setattr(choice, "_time_both", refuses)
    warned = []
    monkeypatch.setattr(choice, "cuda_fallback", lambda err, x: warned.append(str(err)))
    assert choice.choose_kernel("auto", x, w1, w2, "gelu", False) == "loop" and warned
    choice.forget_decisions()


def test_auto_kernel_times_a_bounded_number_of_rows(monkeypatch):
    """The synthetic timing runs on the first call's experts and at most MAX_TIMING_ROWS rows, however many the
    call has (a capped rank pays for every timed pass)."""
    seen = []
    monkeypatch.setattr(choice, "_time_both", lambda *a: seen.append(a) or [(1.0, 2.0)] * 2)
    choice.forget_decisions()
    x, w1, w2 = torch.randn(9000, 8), torch.randn(3, 8, 16), torch.randn(3, 16, 8)
    assert choice.choose_kernel("auto", x, w1, w2, "gelu", False) == "loop"
    assert len(seen) == 1 and seen[0][0] == 3 and seen[0][7] == 2048 == choice.MAX_TIMING_ROWS
    choice.forget_decisions()
    choice.choose_kernel("auto", torch.randn(100, 8), w1, w2, "gelu", False)
    assert seen[1][7] == 128                     # a small call: its own row bucket
    choice.forget_decisions()


def test_auto_kernel_measures_both_clocks_on_real_kernels():
    """The real measurement returns (loop, grouped) seconds by wall clock and by CPU time, all positive."""
    if not grouped.available():
        pytest.skip("this torch has no grouped GEMM")
    clocks = choice._time_both(4, 16, 32, 32, torch.float32, "gelu", False, 64, 1, "auto")
    assert len(clocks) == 2 and all(len(c) == 2 and min(c) > 0 for c in clocks)


def test_grouped_mm_refused_clearly_when_torch_lacks_it(monkeypatch):
    monkeypatch.setattr(choice, "grouped_mm_available", lambda: False)
    x, w1, w2 = torch.randn(4, 8), torch.randn(2, 8, 16), torch.randn(2, 16, 8)
    with pytest.raises(RuntimeError, match="--moe-expert-kernel=grouped_mm"):
        choice.choose_kernel("grouped_mm", x, w1, w2, "gelu", False)
    assert choice.choose_kernel("auto", x, w1, w2, "gelu", False) == "loop"


def test_expert_kernel_flag_is_validated():
    with pytest.raises(ConfigError, match="--moe-expert-kernel"):
        MoEConfig(num_experts=4, expert_kernel="cutlass").validate()


def test_lane_budget_shares_the_cores_among_the_node_ranks(monkeypatch):
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        assert lane_budget() == 4
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        assert lane_budget() == 2
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
        assert lane_budget() == 1
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})   # taskset to one core
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        assert lane_budget() == 1
    finally:
        torch.set_num_threads(threads)


def test_lanes_follow_the_budget(monkeypatch):
    from megamoe_plugin.experts.loop import _lanes_for
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
        x, w1 = torch.randn(64, 8), torch.randn(4, 8, 16)
        groups = [(e, 16 * e, 16 * e + 16) for e in range(4)]
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        assert _lanes_for(x, groups, w1, 0) == 2
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")             # two ranks on these two cores: one lane each
        assert _lanes_for(x, groups, w1, 0) == 1
        assert _lanes_for(x, groups, w1, 2) == 2                # an explicit lane count is obeyed
    finally:
        torch.set_num_threads(threads)
