"""DDL-Roofline (FasterMoE paper 003 §3.3, Eqs. 3-6), its strategy points, the Fig. 5 plot, the routing-trace
simulator and the ``megamoe perf`` commands.

Eqs. 3-6 are checked against numbers worked out by hand. The strategy points are checked against the paper's
qualitative claims on a uniform network (one switch, equal links): data parallelism has the smallest R_CC when
alpha*H >> B, model parallelism sits between it and expert parallelism, synchronous points never beat the
semi-ideal curve, skewed expert parallelism falls well below it, shadowing (Algorithm 1) raises P-bar of a skewed
load, smart scheduling moves a point above the semi-ideal curve but never above the ideal polyline. The simulator
is checked against a hand sum of CostModel.layer_time over the layers of every step.
"""
import contextlib
import io
import math
import sys
from types import SimpleNamespace

import pytest
import torch

from megamoe_plugin.perfmodel import roofline as rl

try:
    from megamoe_plugin.perfmodel.cost import CostModel, LayerShape
    from megamoe_plugin.perfmodel.network import Network
    from megamoe_plugin.perfmodel.profiles import PROFILES, HardwareProfile, get_profile
    HAVE_API = True
except ImportError as err:          # the shared perfmodel API (network/cost/profiles) is written by another issue
    HAVE_API, API_ERR = False, str(err)

needs_api = pytest.mark.skipif(not HAVE_API, reason="megamoe_plugin.perfmodel network/cost/profiles not available: "
                                                    + ("" if HAVE_API else API_ERR))

H, FFN = 1024, 2048


# --- Eqs. 3-6 by hand -----------------------------------------------------------------------------------------------
def test_equations_by_hand():
    assert rl.r_cc(2.0, 4.0) == 0.5                                     # Eq. 3
    assert rl.r_cc(1.0, 0.0) == math.inf
    assert rl.p_ideal(100.0, 0.5) == 50.0                               # Eq. 5: P min(1, R)
    assert rl.p_ideal(100.0, 3.0) == 100.0
    assert rl.p_semi_ideal(100.0, 1.0) == 50.0                          # Eq. 6: P R / (R + 1)
    assert rl.p_semi_ideal(100.0, 3.0) == 75.0
    assert rl.p_semi_ideal(100.0, 0.25) == pytest.approx(20.0)
    assert rl.p_semi_ideal(100.0, math.inf) == 100.0
    # Eq. 4: 12 alpha H^2 sum B_w / (N Lat): H=1024, alpha=2, 4 workers x 1000 tokens, 2 ms
    flops = 12 * 2 * 1024 ** 2 * 4000
    assert rl.mlp_flops(1024, 2048, 4000) == flops
    assert rl.mlp_flops(1024, alpha=2, tokens=4000) == flops
    assert rl.p_bar(flops, 4, 2e-3) == pytest.approx(flops / 8e-3)
    assert rl.p_bar(None, 4, 2e-3, hidden=1024, alpha=2, tokens=4000) == pytest.approx(flops / 8e-3)
    with pytest.raises(ValueError):
        rl.p_bar(None, 4, 1.0)


def test_synthetic_counts():
    c = rl.synthetic_counts(3, 4, 10, 0.0)
    assert c.tolist() == [[3, 3, 2, 2]] * 3                          # 2.5 each: the remainder goes to the first
    c = rl.synthetic_counts(2, 8, 1000, 1.5)
    assert c.sum(1).tolist() == [1000, 1000] and bool((c[0, :-1] >= c[0, 1:]).all()) and c[0, 0] > 300


def test_algorithm1_greedy_stops_at_first_non_improvement():
    counts = torch.tensor([[1, 5, 9, 2]])
    seen = []

    def latency(shadowed):                       # improves for the 1st (expert 2) and 2nd (expert 1), not the 3rd
        seen.append(list(shadowed))
        return {0: 10.0, 1: 7.0, 2: 6.0, 3: 6.5}[len(shadowed)]

    chosen, c = rl.select_shadow_experts(counts, latency)
    assert chosen == [2, 1] and c == 6.0
    assert seen == [[], [2], [2, 1], [2, 1, 3]]  # descending load order, stopped after the first failure


# --- strategy points on a uniform network ---------------------------------------------------------------------------
def uniform_profile(nodes=1, gpus=8):
    return HardwareProfile(name="uniform", description="one switch, equal links (test)", source="test numbers",
                           nodes=nodes, gpus_per_node=gpus, gemm_tflops=100.0, intra="switch",
                           intra_bandwidth_gbps=100.0, ring_bandwidths_gbps=None, nic_bandwidth_gbps=100.0,
                           intra_latency_us=0.0, nic_latency_us=0.0, bytes_per_element=2)


def by_label(points):
    return {p.label: p for p in points}


@needs_api
def test_points_uniform_load_follow_the_paper():
    prof = uniform_profile()
    shape = LayerShape(H, FFN, 8, bytes_per_element=2)
    counts = rl.synthetic_counts(8, 8, 512, 0.0)                   # alpha*H = 2048 >> B = 512 per worker
    pts = by_label(rl.roofline_points(prof, shape, counts))
    dp, dpo, mp, ep = (pts[rl.LABELS[k]] for k in ("dp", "dp_overlap", "mp", "ep"))
    assert dp.r_cc < mp.r_cc < ep.r_cc                          # §3.3: DP poorest R_CC, MP more, EP large
    assert dpo.p_bar > dp.p_bar                                 # overlapping the all-reduce with backward helps
    for p in pts.values():
        assert p.p_bar <= p.ideal * (1 + 1e-9), p.label          # nothing beats the ideal polyline (Eq. 5)
        assert p.lat_e2e >= max(p.lat_comp, p.lat_comm) * (1 - 1e-9)
        assert p.source.startswith("model prediction")
    for p in (dp, mp, ep, pts[rl.LABELS["shadow"]]):               # synchronous: at most semi-ideal (Eq. 6)
        assert p.p_bar <= p.semi_ideal * (1 + 1e-9), p.label
    # balanced: EP is exactly on the semi-ideal curve, and shadowing finds nothing worth replicating
    assert ep.p_bar == pytest.approx(ep.semi_ideal, rel=1e-6)
    assert pts[rl.LABELS["shadow"]].detail["shadowed_mean"] == 0
    # hand checks against the cost model
    cost = prof.cost_model(shape, 8)
    bd = cost.layer_time(counts)
    assert ep.lat_comp == pytest.approx(bd.compute) and ep.lat_e2e == pytest.approx(bd.total)
    assert ep.flops == 12 * H * FFN * 8 * 512 and ep.workers == 8 and ep.peak == 100e12
    net = prof.network(8)
    assert dp.lat_comm == pytest.approx(net.allreduce_time(8 * shape.expert_param_bytes, list(range(8))))
    assert mp.lat_comm == pytest.approx(2 * net.allreduce_time(8 * 512 * H * 2, list(range(8))))
    assert dpo.lat_e2e == pytest.approx(dp.lat_comp / 3 + max(2 * dp.lat_comp / 3, dp.lat_comm))


@needs_api
def test_zero_stages_follow_their_collectives():
    prof = uniform_profile()
    shape = LayerShape(H, FFN, 8, bytes_per_element=2)
    counts = rl.synthetic_counts(8, 8, 512, 0.0)
    pts = by_label(rl.roofline_points(prof, shape, counts, include=["zero1", "zero2", "zero3", "dp", "ep"]))
    z1, z2, z3, dp, ep = (pts[rl.LABELS[k]] for k in ("zero1", "zero2", "zero3", "dp", "ep"))
    ar = prof.network(8).allreduce_time(8 * shape.expert_param_bytes, list(range(8)))
    comp = dp.lat_comp
    # hand-written stage formulas: 1 = compute then one all-reduce's traffic; 2 = reduce-scatter under the
    # backward, all-gather after; 3 = all-gather before forward and backward, reduce-scatter under the backward
    assert z1.lat_e2e == pytest.approx(comp + ar)
    assert z2.lat_e2e == pytest.approx(comp / 3 + max(2 * comp / 3, ar / 2) + ar / 2)
    assert z3.lat_e2e == pytest.approx(ar / 2 + comp / 3 + ar / 2 + max(2 * comp / 3, ar / 2))
    assert z3.lat_comm == pytest.approx(1.5 * ar)
    assert z3.lat_e2e > z1.lat_e2e >= z2.lat_e2e                    # §5.4: stage 3 slowest, stage 2 fastest
    assert ep.lat_e2e < z3.lat_e2e                                  # Fig. 10: expert parallelism beats ZeRO-3


@needs_api
def test_points_skewed_load_shadowing_and_smart():
    prof = uniform_profile()
    shape = LayerShape(H, FFN, 8, bytes_per_element=2)
    counts = rl.synthetic_counts(8, 8, 16384, 2.0)               # expert 0 gets ~2/3 of every rank's tokens
    pts = by_label(rl.roofline_points(prof, shape, counts))
    ep, sh, sm, fm = (pts[rl.LABELS[k]] for k in ("ep", "shadow", "smart", "fastermoe"))
    assert ep.p_bar < 0.5 * ep.semi_ideal                          # far below the semi-ideal curve
    assert ep.r_cc > 1                                             # ... with a large R_CC (imbalanced compute)
    assert sh.detail["shadowed_mean"] >= 1
    assert sh.p_bar > 1.5 * ep.p_bar                               # arrow (1): shadowing raises P-bar
    # (its R_CC may move either way here: shadowing also removes the hot expert's all-to-all traffic)
    assert sm.p_bar >= ep.p_bar and sm.r_cc == pytest.approx(ep.r_cc)   # arrow (2): same R_CC, higher P-bar
    assert fm.p_bar >= sm.p_bar * (1 - 1e-9) and fm.p_bar > ep.p_bar    # Algorithm 1 on the smart latency
    assert fm.detail["shadowed_mean"] >= 1
    for p in pts.values():
        assert p.p_bar <= p.ideal * (1 + 1e-9), p.label


@needs_api
def test_smart_schedule_beats_semi_ideal_on_two_nodes():
    prof = uniform_profile(nodes=2, gpus=4)
    shape = LayerShape(H, FFN, 8, bytes_per_element=2)
    counts = rl.synthetic_counts(8, 8, 4096, 0.0)
    pts = by_label(rl.roofline_points(prof, shape, counts, include=["ep", "smart"]))
    ep, sm = pts[rl.LABELS["ep"]], pts[rl.LABELS["smart"]]
    assert sm.p_bar > sm.semi_ideal and sm.p_bar > ep.p_bar
    assert sm.lat_e2e >= max(sm.lat_comp, sm.lat_comm) * (1 - 1e-9)


@needs_api
def test_trace_counts_aggregate_over_slices():
    prof = uniform_profile()
    shape = LayerShape(H, FFN, 8, bytes_per_element=2)
    a, b = rl.synthetic_counts(8, 8, 256, 0.0), rl.synthetic_counts(8, 8, 1024, 1.0)
    both = torch.stack([a, b])[None]                                 # [S=1, L=2, P, E]
    pa, pb, pab = (by_label(rl.roofline_points(prof, shape, c, include=["ep"]))[rl.LABELS["ep"]]
                   for c in (a, b, both))
    assert pab.lat_e2e == pytest.approx(pa.lat_e2e + pb.lat_e2e)
    assert pab.flops == pytest.approx(pa.flops + pb.flops)
    assert pab.p_bar == pytest.approx((pa.flops + pb.flops) / (8 * (pa.lat_e2e + pb.lat_e2e)))


@needs_api
def test_plot_writes_png(tmp_path):
    prof = get_profile("johnny")
    shape = LayerShape(H, FFN, 16, bytes_per_element=prof.bytes_per_element)
    pts = rl.roofline_points(prof, shape, rl.synthetic_counts(16, 16, 1024, 1.2))
    out = rl.plot_roofline(pts, pts[0].peak, str(tmp_path / "roofline.png"))
    data = open(out, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    table = rl.format_points(pts)
    assert all(p.label in table for p in pts)


# --- simulator ------------------------------------------------------------------------------------------------------
def small_trace():
    """load_trace format: S=3 steps x L=2 layers x P=2 ranks x E=4 experts."""
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 200, (3, 2, 2, 4), generator=g, dtype=torch.int32)
    counts[1, 0, :, 0] += 1500                                    # a hot expert in one step/layer
    return {"schema": "megamoe-trace/1", "world_size": 2, "num_experts": 4, "top_k": 2,
            "steps": torch.tensor([10, 11, 12]), "layers": [1, 3], "counts": counts}


def hand_sum(cost, counts, rows, placement=None):
    out = []
    for s in range(counts.shape[0]):
        tot = dict(compute=0.0, alltoall=0.0, sync=0.0, total=0.0)
        for l in range(counts.shape[1]):
            bd = cost.layer_time(counts[s, l][rows], placement)
            for k in tot:
                tot[k] += getattr(bd, k)
        out.append(tot)
    return out


@needs_api
def test_simulate_equals_hand_sum_of_layer_time():
    from megamoe_plugin.perfmodel.simulate import simulate_trace, summarize
    prof = uniform_profile(nodes=1, gpus=2)
    shape = LayerShape(256, 512, 4, bytes_per_element=2)
    tr = small_trace()
    res = simulate_trace(tr, prof, shape)
    want = hand_sum(prof.cost_model(shape, 2), tr["counts"], [0, 1])
    assert [r["step"] for r in res] == [10, 11, 12]
    for r, w in zip(res, want):
        assert set(r) == {"step", "compute", "alltoall", "sync", "total"}
        for k in w:
            assert r[k] == pytest.approx(w[k])
    assert res[1]["total"] > res[0]["total"]                       # the hot step costs more
    s = summarize(res)
    assert s["steps"] == 3 and s["mean_total"] == pytest.approx(sum(w["total"] for w in want) / 3)
    assert s["frac_compute"] + s["frac_alltoall"] + s["frac_sync"] == pytest.approx(1.0)


@needs_api
def test_simulate_world_size_remap_and_placement_hook():
    from megamoe_plugin.perfmodel.simulate import remap_counts, simulate_trace
    prof = uniform_profile(nodes=1, gpus=4)
    shape = LayerShape(256, 512, 4, bytes_per_element=2)
    tr = small_trace()
    assert remap_counts(tr["counts"], 4)[0, 0].tolist() == tr["counts"][0, 0][[0, 1, 0, 1]].tolist()
    res = simulate_trace(tr, prof, shape, world_size=4)
    cost = prof.cost_model(shape, 4)
    want = hand_sum(cost, tr["counts"], [0, 1, 0, 1])                # rank w replays source row w % P
    for r, w in zip(res, want):
        assert r["total"] == pytest.approx(w["total"]) and r["compute"] == pytest.approx(w["compute"])
    # placement hook: called with (step, layer id, remapped [W, E] counts); its placement is the one used
    calls = []
    placement = [[0, 1, 2, 3], [1], [2], [3]]                       # expert 0 replicated everywhere

    def fn(step, layer, counts):
        calls.append((step, layer, tuple(counts.shape)))
        return placement

    res = simulate_trace(tr, prof, shape, world_size=4, placement_fn=fn)
    assert calls == [(s, l, (4, 4)) for s in (10, 11, 12) for l in (1, 3)]
    want = hand_sum(cost, tr["counts"], [0, 1, 0, 1], placement)
    for r, w in zip(res, want):
        assert r["total"] == pytest.approx(w["total"]) and r["sync"] == pytest.approx(w["sync"])


@needs_api
def test_simulate_on_a_topology():
    from megamoe_plugin.perfmodel.simulate import simulate_trace
    from megamoe_plugin.topology import Topology
    topo = Topology([[0, 1], [2, 3]], bandwidth_gbps=[50.0, 5.0], latency_us=[2.0, 10.0])
    prof = uniform_profile()
    shape = LayerShape(256, 512, 4)
    res = simulate_trace(small_trace(), prof, shape, topology=topo)       # W = the topology's 4 ranks
    cost = CostModel(Network.from_topology(topo), prof.gemm_tflops * 1e12, shape)
    want = hand_sum(cost, small_trace()["counts"], [0, 1, 0, 1])
    assert [r["total"] for r in res] == pytest.approx([w["total"] for w in want])
    with pytest.raises(ValueError, match="topology"):
        simulate_trace(small_trace(), prof, shape, world_size=2, topology=topo)


@needs_api
def test_simulate_rejects_indivisible_experts():
    from megamoe_plugin.perfmodel.simulate import simulate_trace
    prof = uniform_profile(nodes=1, gpus=3)
    with pytest.raises(ValueError, match="divisible"):
        simulate_trace(small_trace(), prof, LayerShape(256, 512, 4), world_size=3)
    with pytest.raises(ValueError, match="experts"):
        simulate_trace(small_trace(), prof, LayerShape(256, 512, 8), world_size=2)


def write_trace(path, steps=2, E=4, P=2):
    """Two 'ranks' in-process: TraceRecorder fed Routing-like objects (only .counts is read), then flushed."""
    from megamoe_plugin.stats import TraceRecorder
    g = torch.Generator().manual_seed(1)
    for rank in range(P):
        rec = TraceRecorder(str(path), rank=rank, world_size=P, num_experts=E, top_k=1)
        for s in range(steps):
            for layer in (0, 1):
                rec(layer, SimpleNamespace(counts=torch.randint(0, 300, (E,), generator=g)))
            rec.next_step()
        rec.flush()
    return str(path)


@needs_api
def test_simulate_from_recorded_trace_path(tmp_path):
    from megamoe_plugin.perfmodel.simulate import simulate_trace
    from megamoe_plugin.stats import load_trace
    path = write_trace(tmp_path / "trace")
    prof = uniform_profile(nodes=1, gpus=2)
    shape = LayerShape(256, 512, 4)
    res = simulate_trace(path, prof, shape)
    want = hand_sum(prof.cost_model(shape, 2), load_trace(path)["counts"], [0, 1])
    assert [r["step"] for r in res] == [0, 1]
    assert [r["total"] for r in res] == pytest.approx([w["total"] for w in want])


# --- CLI ------------------------------------------------------------------------------------------------------------
def run_cli(argv):
    from megamoe_plugin.cli import main
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    return rc, buf.getvalue()


@needs_api
def test_cli_profiles():
    rc, out = run_cli(["perf", "profiles"])
    assert rc == 0
    for name in PROFILES:
        assert name in out
    assert "source" in out and "gemm_tflops" in out


@needs_api
def test_cli_roofline(tmp_path):
    png = tmp_path / "r.png"
    rc, out = run_cli(["perf", "roofline", "--profile", "johnny", "--hidden", "1024", "--ffn", "2048",
                       "--experts", "16", "--tokens-per-rank", "1024", "--skew", "1.2", "--out", str(png)])
    assert rc == 0 and "MODEL PREDICTIONS" in out and "johnny" in out
    for label in rl.LABELS.values():
        assert label in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_api
def test_cli_roofline_and_simulate_from_trace(tmp_path):
    path = write_trace(tmp_path / "trace", steps=3)
    rc, out = run_cli(["perf", "roofline", "--profile", "johnny", "--hidden", "256", "--trace", path])
    assert rc == 0 and "trace" in out and "R_CC" in out
    rc, out = run_cli(["perf", "simulate", path, "--profile", "trevor", "--world-size", "4", "--hidden", "256",
                       "--ffn", "512", "--json", str(tmp_path / "sim.json")])
    assert rc == 0 and "MODEL PREDICTIONS" in out and "trevor" in out and "ms/step" in out
    assert len([l for l in out.splitlines() if l.strip().split(" ")[0] in ("0", "1", "2")]) == 3
    assert (tmp_path / "sim.json").exists()


def test_cli_calibrate_hook_without_module(monkeypatch, capsys):
    from megamoe_plugin.perfmodel import cli
    monkeypatch.setitem(sys.modules, "megamoe_plugin.perfmodel.calibrate", None)   # as if it did not exist
    assert cli.main(["calibrate"]) == 2
    assert "not available" in capsys.readouterr().err
