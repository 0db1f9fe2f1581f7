"""The placement planning layer (megamoe_plugin.placement.{state,flexmoe,shadow}, perfmodel.placement_replay).

Hand-computed cases on a tiny network chosen so that every number is an integer number of seconds:
2 ranks behind one switch, every link 8 B/s, no latency; LayerShape(hidden=4, ffn=8): a token is 8 bytes (1 s over
a link), its forward is 4*4*8 = 128 FLOPs at 128 FLOP/s (1 s); an expert's parameters are 128 bytes (16 s over a
link) and its model states (bf16 params + fp32 master + 2 Adam moments: 14 B x 64 params) 896 bytes (112 s).
"""
import json

import pytest
import torch

from megamoe_plugin.perfmodel import CostModel, HardwareProfile, LayerShape, Network
from megamoe_plugin.placement import (FlexMoEPlanner, Move, PlacementError, PlacementState, ShadowPlanner,
                                      StaticPlanner, flexible_route, model_state_bytes, select_shadow_experts,
                                      shadow_search)
from megamoe_plugin.perfmodel.placement_replay import simulate_placement, synthetic_trace

SHAPE = LayerShape(4, 8, 2, bytes_per_element=2)
SKEWED = torch.tensor([[30., 2.], [40., 4.]])         # expert 0: 70 tokens, expert 1: 6


def tiny_cost(num_experts=2):
    return CostModel(Network.hierarchical(1, 2, "switch", 8.0, 8.0), 128.0,
                     LayerShape(4, 8, num_experts, bytes_per_element=2))


# --- state primitives ------------------------------------------------------------------------------------------------
def test_initial_state_is_contiguous_with_spare_slots():
    s = PlacementState(4, 2, 3)
    assert s.slots_of(0) == [0, 1, None] and s.slots_of(1) == [2, 3, None]
    assert s.placement() == [[0], [0], [1], [1]]
    assert s.replicas(2) == [1] and s.free_slots(0) == [2] and s.total_replicas == 4
    assert PlacementState(4, 2).slots_per_rank == 3                       # default: one spare slot per rank
    with pytest.raises(PlacementError, match="multiple of num_ranks"):
        PlacementState(3, 2)
    with pytest.raises(PlacementError, match="do not fit"):
        PlacementState(4, 2, 1)


def test_model_state_bytes():
    assert model_state_bytes(SHAPE) == 64 * (2 + 8 + 4) == 896
    assert model_state_bytes(LayerShape(4, 8, 2, bytes_per_element=4)) == 64 * (4 + 8)   # fp32: no master copy
    assert model_state_bytes(SHAPE, optimizer_states=0, master_weights=False) == 128


def test_expand_shrink_migrate_records_and_errors():
    s = PlacementState(4, 2, 3)
    mv = s.expand(0, 1, shape=SHAPE)
    assert mv == Move("expand", 0, src=0, dst=1, src_slot=0, dst_slot=2, nbytes=896) and mv.communicates
    assert s.replicas(0) == [0, 1] and s.placement()[0] == [0, 1] and s.slots_of(1) == [2, 3, 0]
    assert s.replica_groups() == [(0, (0, 1))]
    with pytest.raises(PlacementError, match="no free slot"):
        s.expand(1, 1)
    with pytest.raises(PlacementError, match="already holds"):
        PlacementState(4, 2, 3).expand(0, 0)
    with pytest.raises(PlacementError, match="holds no replica"):
        PlacementState(4, 2, 3).expand(0, 1, src=1)
    with pytest.raises(PlacementError, match="last replica"):
        s.shrink(1, 0)
    with pytest.raises(PlacementError, match="no replica there"):
        s.shrink(2, 0)
    mv = s.shrink(0, 1)
    assert mv == Move("shrink", 0, src=1, dst=None, src_slot=2, dst_slot=None, nbytes=0) and not mv.communicates
    assert s.replicas(0) == [0]
    mv = s.migrate(0, 0, 1, state_bytes=1000)
    assert mv == Move("migrate", 0, src=0, dst=1, src_slot=0, dst_slot=2, nbytes=1000)
    assert s.slots_of(0) == [None, 1, None] and s.placement()[0] == [1]
    with pytest.raises(PlacementError, match="both rank"):
        s.migrate(0, 1, 1)
    with pytest.raises(PlacementError, match="no replica there"):
        s.migrate(0, 0, 1)
    with pytest.raises(PlacementError, match="out of range"):
        s.expand(4, 0)
    with pytest.raises(PlacementError, match="out of range"):
        s.expand(0, 2)


def test_packed_vexperts_share_weights():
    s = PlacementState(2, 2, 2, max_replicas_per_rank=2)
    mv = s.expand(0, 0, shape=SHAPE)                 # a second vExpert on the rank that has the weights
    assert mv == Move("expand", 0, src=0, dst=0, src_slot=0, dst_slot=1, nbytes=0) and not mv.communicates
    assert s.replicas(0) == [0, 0] and s.ranks_of(0) == [0] and s.replica_groups() == []
    assert s.multiplicity().tolist() == [[2.0, 0.0], [0.0, 1.0]]
    with pytest.raises(PlacementError, match="no free slot"):
        s.expand(0, 0)


def test_apply_replays_moves_and_equality():
    s = PlacementState(4, 2, 3)
    moves = [s.expand(0, 1, shape=SHAPE), s.expand(3, 0, shape=SHAPE), s.shrink(0, 0), s.shrink(3, 1),
             s.migrate(1, 0, 1, shape=SHAPE)]
    assert s.slots_of(0) == [None, None, 3] and s.slots_of(1) == [2, 1, 0]
    assert moves[4] == Move("migrate", 1, src=0, dst=1, src_slot=1, dst_slot=1, nbytes=896)
    t = PlacementState(4, 2, 3).apply(moves)
    assert t == s and t.copy() == s and t is not s
    assert PlacementState(4, 2, 3) != s
    u = PlacementState(4, 2, 3)
    u.expand(1, 1)                                   # a different history: slots differ from what the moves name
    with pytest.raises(PlacementError):
        u.apply(moves)


def test_to_dict_round_trip():
    s = PlacementState(4, 2, 3, max_replicas_per_rank=2)
    s.expand(0, 1)
    d = json.loads(json.dumps(s.to_dict()))
    assert d["slots"] == [[0, 1, -1], [2, 3, 0]] and d["schema"] == "megamoe-placement/1"
    t = PlacementState.from_dict(d)
    assert t == s and t.placement() == s.placement() and t.max_replicas_per_rank == 2
    bad = dict(d, slots=[[0, -1, -1], [2, 3, 0]])      # expert 1 nowhere
    with pytest.raises(PlacementError, match="no replica"):
        PlacementState.from_dict(bad)
    with pytest.raises(PlacementError, match="schema"):
        PlacementState.from_dict(dict(d, schema="x"))


# --- Algorithm 3 routing ---------------------------------------------------------------------------------------------
def test_route_locality_first_then_remainder():
    s = PlacementState(2, 2, 2)
    s.expand(0, 1)                                   # expert 0 on both ranks: cap = 70 / 2 = 35 per vExpert
    r = s.route(SKEWED)
    assert r[0, 0].tolist() == [30, 0]               # source 0 keeps its 30 (< 35) on its own replica
    assert r[1, 0].tolist() == [5, 35]               # source 1 fills its own 35, the 5 left go to rank 0's room
    assert r[0, 1].tolist() == [0, 2] and r[1, 1].tolist() == [0, 4]
    assert s.rank_loads(SKEWED).tolist() == [35, 41]
    assert s.balance_ratio(SKEWED) == pytest.approx(41 / 38)
    assert PlacementState(2, 2, 2).balance_ratio(SKEWED) == pytest.approx(70 / 38)     # Eq. 6: [70, 6]
    assert PlacementState(2, 2, 2).balance_ratio(torch.zeros(2, 2)) == 1.0


def test_route_remainder_in_proportion_to_free_capacity():
    s = PlacementState(3, 3, 2)
    s.expand(0, 1)
    s.expand(0, 2)                                   # cap = 60 / 3 = 20
    c = torch.tensor([[0., 1, 1], [10, 1, 1], [50, 1, 1]])
    r = s.route(c)
    # own replicas: rank 0 takes 0, rank 1 takes 10, rank 2 takes 20; free room 20 (rank 0), 10 (rank 1), 0
    assert r[2, 0].tolist() == [20, 10, 20]
    assert r[1, 0].tolist() == [0, 10, 0] and r[0, 0].tolist() == [0, 0, 0]
    assert r[:, 0].sum(0).tolist() == [20, 20, 20]    # every vExpert ends with exactly its share


def test_route_even_split_over_vexperts_and_integer_rounding():
    s = PlacementState(2, 2, 3, max_replicas_per_rank=2)
    s.expand(0, 0)
    s.expand(0, 1)                                   # expert 0: two vExperts on rank 0, one on rank 1: cap 10
    c = torch.tensor([[0., 0.], [30., 0.]])
    r = s.route(c)                                   # the source (rank 1) keeps 10, rank 0 takes 2 x 10
    assert r[1, 0].tolist() == [20, 10]
    s3 = PlacementState(3, 3, 2)
    s3.expand(0, 1)
    s3.expand(0, 2)
    c3 = torch.zeros(3, 3)
    c3[0, 0] = 10                                    # 10 / 3 each: 3.33 kept, 3.33 + 3.33 sent
    assert s3.route(c3)[0, 0].tolist() == pytest.approx([10 / 3] * 3)
    ri = s3.route(c3, integer=True)
    assert ri.dtype == torch.long and ri[0, 0].tolist() == [4, 3, 3]   # ties: the lower rank gets the extra token
    assert torch.equal(ri.sum(-1), c3.long())


def test_costmodel_route_is_the_same_algorithm():
    cm = CostModel(Network.hierarchical(1, 3, "switch", 8.0, 8.0), 128.0, LayerShape(4, 8, 3))
    s = PlacementState(3, 3, 2)
    s.expand(0, 1)
    s.expand(2, 0)
    c = torch.tensor([[5., 1, 7], [9, 3, 0], [2, 8, 4]])
    assert torch.allclose(cm.route(c, s.placement()), s.route(c).sum(1))
    assert torch.allclose(flexible_route(c, s.multiplicity()), s.route(c))
    assert cm.layer_time(c, s.placement()) == cm.layer_time_matrix(c, s.multiplicity())


# --- FlexMoE planner -------------------------------------------------------------------------------------------------
def test_flexmoe_expands_the_hot_expert():
    cm = tiny_cost()
    # static: loads [70, 6] -> 3 x 70 compute + 4 x 40 s (source 1's 40 tokens on its link) = 370 s
    assert cm.layer_time(SKEWED).total == 370.0
    # expert 0 on both ranks: loads [35, 41] -> 123 + 4 x 5 + all-reduce of 128 B over 2 ranks (16 s) = 159 s;
    # + its transfer 896 B / 8 B/s = 112 s: 271 < 370
    state = PlacementState(2, 2, 2)
    planner = FlexMoEPlanner(cm, threshold=1.1)
    moves = planner.plan(state, SKEWED)
    assert moves == [Move("expand", 0, src=0, dst=1, src_slot=0, dst_slot=1, nbytes=896)]
    assert planner.last["time_before"] == 370.0 and planner.last["time_after"] == 159.0
    assert planner.last["transfer_time"] == 112.0 and planner.last["triggered"]
    assert state == PlacementState(2, 2, 2)          # the caller's state is untouched
    assert planner.plan(state.copy().apply(moves), SKEWED) == []       # balance 41/38 < 1.1: nothing more


def test_flexmoe_balanced_does_nothing():
    planner = FlexMoEPlanner(tiny_cost(), threshold=1.1)
    assert planner.plan(PlacementState(2, 2, 2), torch.tensor([[10., 10.], [10., 10.]])) == []
    assert not planner.last["triggered"] and planner.last["balance_before"] == 1.0


def test_flexmoe_transfer_cost_exceeding_gain_does_nothing():
    cm = tiny_cost()
    c = torch.tensor([[12., 2.], [16., 4.]])
    # static 3 x 28 + 4 x 16 = 148 s; expanded 3 x 20 + 4 x 2 + 16 = 84 s: gain 64 s < transfer 112 s
    assert cm.layer_time(c).total == 148.0
    planner = FlexMoEPlanner(cm, threshold=1.1)
    assert planner.plan(PlacementState(2, 2, 2), c) == []
    assert planner.last["triggered"]                  # it looked, and found no gain
    # amortised over 2 steps the move pays: 84 + 112 / 2 = 140 < 148
    assert FlexMoEPlanner(cm, threshold=1.1, horizon=2).plan(PlacementState(2, 2, 2), c) == [
        Move("expand", 0, src=0, dst=1, src_slot=0, dst_slot=1, nbytes=896)]


def test_flexmoe_shrink_then_expand_when_slots_are_full():
    cm = tiny_cost(num_experts=4)
    s = PlacementState(4, 2, 3)
    s.expand(2, 0)                                    # a cold expert's replica fills rank 0's spare slot
    c = torch.tensor([[1., 1., 1., 30.], [1., 1., 1., 30.]])   # expert 3 (rank 1) is hot; rank 0 is full
    moves = FlexMoEPlanner(cm, threshold=1.1, horizon=100).plan(s, c)
    # Alg. 2's pair: shrink the coldest replicated expert (2) where a slot is needed, expand the hot one there
    assert [(m.kind, m.expert, m.src, m.dst) for m in moves[:2]] == [("shrink", 2, 0, None), ("expand", 3, 1, 0)]
    t = s.copy().apply(moves)
    assert t.ranks_of(3) == [0, 1] and t.ranks_of(2) == [1]
    assert cm.layer_time(c, t.placement()).total < cm.layer_time(c, s.placement()).total


def test_flexmoe_migrate_reduces_sync_on_two_nodes():
    # 2 nodes x 2 ranks; links GPU-switch 64 B/s, node uplink 8 B/s. Expert 0 on ranks 0 and 2 (one per node):
    # its all-reduce sends 128 B each way over the uplinks: 16 s. On one node it costs 128 / 64 = 2 s.
    cm = CostModel(Network.hierarchical(2, 2, "switch", 64.0, 8.0), 128.0, LayerShape(4, 8, 4))
    s = PlacementState(4, 4, 2)
    s.expand(0, 2)
    zero = torch.zeros(4, 4)
    assert cm.layer_time(zero, s.placement()).sync == 16.0
    # the move crosses the uplink: 896 B / 8 B/s = 112 s; over 10 steps 2 + 11.2 < 16
    planner = FlexMoEPlanner(cm, horizon=10)
    moves = planner.plan(s, zero)
    assert moves == [Move("migrate", 0, src=0, dst=3, src_slot=0, dst_slot=1, nbytes=896)]   # ties: lowest src
    t = s.copy().apply(moves)
    assert t.ranks_of(0) == [2, 3] and cm.layer_time(zero, t.placement()).sync == 2.0
    assert not planner.last["triggered"]              # balanced (no tokens): Migrate alone ran (Alg. 1 line 11)
    assert FlexMoEPlanner(cm, horizon=1).plan(s, zero) == []      # 2 + 112 > 16


def test_flexmoe_is_deterministic():
    prof = HardwareProfile(name="u", nodes=2, gpus_per_node=4, gemm_tflops=100.0, intra_bandwidth_gbps=100.0,
                           nic_bandwidth_gbps=20.0)
    cm = prof.cost_model(LayerShape(256, 512, 8), 8)
    c = synthetic_trace(8, 8, 1, skew=1.5, tokens_per_rank=20000)["counts"][0, 0]
    a = FlexMoEPlanner(cm).plan(PlacementState(8, 8, 2), c)
    b = FlexMoEPlanner(cm).plan(PlacementState(8, 8, 2), c.clone())
    assert a == b and len(a) > 0


# --- FasterMoE shadowing ---------------------------------------------------------------------------------------------
def test_shadow_selection_reproduces_algorithm1_by_hand():
    cm = tiny_cost()
    # Eq. 7 (none shadowed): 370 s. Shadow expert 0 (the most loaded): its tokens stay where they are, loads
    # [30, 46] -> 138 + 4 x 2 (source 0's 2 tokens of expert 1) + broadcast 16 + reduce 16 = 178 s < 370: keep.
    # Then expert 1: loads [32, 44] -> 132 + 0 + 2 x 32 = 196 s > 178: stop.
    seen = {}

    def latency(shadowed):
        t = (cm.shadow_layer_time(SKEWED, shadowed) if shadowed else cm.layer_time(SKEWED)).total
        seen[tuple(shadowed)] = t
        return t

    chosen, best = shadow_search(SKEWED, latency)
    assert chosen == [0] and best == 178.0
    assert seen == {(): 370.0, (0,): 178.0, (0, 1): 196.0}
    assert select_shadow_experts(SKEWED, cm) == [0]
    assert ShadowPlanner(cm).plan(PlacementState(2, 2, 1), SKEWED) == [0]
    assert select_shadow_experts(torch.tensor([[10., 10.], [10., 10.]]), cm) == []


def test_roofline_uses_the_moved_algorithm():
    from megamoe_plugin.perfmodel import roofline
    assert roofline.select_shadow_experts is shadow_search


# --- simulation ------------------------------------------------------------------------------------------------------
def uniform_profile():
    return HardwareProfile(name="uniform", nodes=1, gpus_per_node=4, gemm_tflops=100.0, intra="switch",
                           intra_bandwidth_gbps=100.0, nic_bandwidth_gbps=100.0)


def trace_of(rows, steps=4):
    c = torch.tensor(rows, dtype=torch.int32)[None, None].expand(steps, 1, -1, -1).clone()
    return {"counts": c, "steps": torch.arange(steps), "layers": [0], "num_experts": c.shape[-1]}


def test_simulator_with_planners_skewed_and_balanced():
    from megamoe_plugin.perfmodel.simulate import simulate_trace, summarize
    prof, shape = uniform_profile(), LayerShape(256, 512, 4)
    cm = prof.cost_model(shape, 4)
    skewed = trace_of([[4000, 200, 200, 200]] * 4)
    static = simulate_trace(skewed, prof, shape, planner=StaticPlanner())
    flex = simulate_trace(skewed, prof, shape, planner=FlexMoEPlanner(cm))
    plain = simulate_trace(skewed, prof, shape)                         # the old path, no planner
    assert [r["total"] for r in static] == pytest.approx([r["total"] for r in plain])
    assert flex[0]["total"] == pytest.approx(static[0]["total"])        # step 0: nothing seen yet
    assert flex[1]["moves"] > 0 and flex[1]["transfer"] > 0 and flex[1]["bytes_moved"] > 0
    assert flex[1]["total"] == pytest.approx(flex[1]["compute"] + flex[1]["alltoall"] + flex[1]["sync"]
                                             + flex[1]["transfer"])
    assert summarize(flex)["mean_total"] < summarize(static)["mean_total"]
    assert flex[-1]["balance_ratio"] < static[-1]["balance_ratio"] and flex[-1]["replicas"] > 0
    for r in static + flex:
        assert r["token_efficiency"] == 1.0
        assert r["expert_efficiency"] == pytest.approx(1.0 / r["balance_ratio"])
    assert static[0]["balance_ratio"] == pytest.approx(4 * 16000 / 18400)   # Eq. 6: rank 0 computes 16000
    shadow = simulate_trace(skewed, prof, shape, planner=ShadowPlanner(cm))
    assert shadow[0]["shadowed"] == 0 and shadow[1]["shadowed"] >= 1     # decided from the previous step
    assert shadow[1]["replicas"] == 3 * shadow[1]["shadowed"] and shadow[1]["total"] < static[1]["total"]
    ds = simulate_trace(skewed, prof, shape, capacity_factor=1.0)
    assert ds[0]["token_efficiency"] == pytest.approx(4 * (1150 + 600) / 18400)   # cap 1150 per (rank, expert)

    balanced = trace_of([[1000] * 4] * 4)
    s_rows = simulate_trace(balanced, prof, shape, planner=StaticPlanner())
    f_rows = simulate_trace(balanced, prof, shape, planner=FlexMoEPlanner(cm))
    assert [r["total"] for r in f_rows] == [r["total"] for r in s_rows]
    assert sum(r["moves"] for r in f_rows) == 0


def test_simulate_placement_validates():
    cm = uniform_profile().cost_model(LayerShape(256, 512, 4), 4)
    c = trace_of([[1, 1, 1, 1]] * 4)["counts"]
    with pytest.raises(ValueError, match="previous step"):
        simulate_placement(c, cm, FlexMoEPlanner(cm), decide_on="current")
    with pytest.raises(ValueError, match="no planner"):
        simulate_placement(c, cm, StaticPlanner(), capacity_factor=1.0)
    with pytest.raises(ValueError, match="ranks"):
        simulate_placement(c[:, :, :2], cm, None)
    with pytest.raises(ValueError, match="smoothing"):
        simulate_placement(c, cm, StaticPlanner(), smoothing=1.0)


def test_simulate_smoothing_shows_the_planner_an_average():
    seen = []

    class Spy:
        def plan(self, state, counts):
            seen.append(counts.clone())
            return []

    cm = uniform_profile().cost_model(LayerShape(256, 512, 4), 4)
    c = torch.zeros(3, 1, 4, 4)
    c[0, 0, :, 0] = 100.0
    c[1, 0, :, 1] = 100.0
    simulate_placement(c, cm, Spy(), smoothing=0.75)
    assert len(seen) == 2                              # before steps 1 and 2
    assert seen[0][0].tolist() == [100, 0, 0, 0]       # the first average is step 0's counts
    assert seen[1][0].tolist() == [75, 25, 0, 0]       # 0.75 x step 0 + 0.25 x step 1


def test_synthetic_trace_is_deterministic_and_loads(tmp_path):
    from megamoe_plugin.perfmodel.placement_replay import write_trace
    from megamoe_plugin.stats import load_trace
    a = synthetic_trace(4, 8, 5, layers=2, tokens_per_rank=100, top_k=2, seed=3)
    b = synthetic_trace(4, 8, 5, layers=2, tokens_per_rank=100, top_k=2, seed=3)
    assert torch.equal(a["counts"], b["counts"]) and a["counts"].shape == (5, 2, 4, 8)
    assert bool((a["counts"].sum(-1) == 200).all())
    load = a["counts"][0, 0].sum(0).double()
    assert float(load.max() / load.mean()) > 2.0      # skewed
    back = load_trace(write_trace(a, str(tmp_path / "t")))
    assert torch.equal(back["counts"], a["counts"]) and back["top_k"] == 2


def test_bench_placement_runs_and_labels_predictions(capsys):
    from megamoe_plugin.bench import main as bench_main
    res = bench_main(["placement", "--targets", "johnny:16", "--steps", "3", "--tokens-per-rank", "256",
                      "--measure-procs", "0"])          # the measured part has its own test (test_bench.py)
    out = capsys.readouterr().out
    assert "MODEL PREDICTIONS" in out and "1.70x" in out and "1.30x" in out and "1.97x" in out
    (r,) = res
    assert r["profile"] == "johnny" and r["world_size"] == 16 and r["experts"] == 16
    labels = [row["label"] for row in r["rows"]]
    assert labels[0] == "static EP" and any(l.startswith("FlexMoE") for l in labels)
    assert any(l.startswith("shadowing") for l in labels)
    assert r["rows"][0]["speedup"] == 1.0 and all(row["mean_total"] > 0 for row in r["rows"])


def test_flexmoe_keeps_a_plan_only_above_the_minimum_predicted_gain():
    """FlexMoE on one hot expert: the plan it keeps with min_gain 0 predicts a saving g; with min_gain above g the
    same counts give no move at all (the policies use 5%: gains within the cost model's error do not pay)."""
    from megamoe_plugin.perfmodel.cost import LayerShape
    from megamoe_plugin.perfmodel.profiles import get_profile
    from megamoe_plugin.placement import PlacementState
    from megamoe_plugin.placement.flexmoe import FlexMoEPlanner

    profile = get_profile("flexmoe-a100")
    profile.gemm_tflops = 1e-3                       # compute dominates: balancing can pay
    cm = profile.cost_model(LayerShape(64, 128, 4), world_size=2)
    state = PlacementState(4, 2, 3, max_replicas_per_rank=1)
    counts = torch.tensor([[600.0, 250.0, 100.0, 50.0]] * 2)
    eager = FlexMoEPlanner(cm, threshold=1.0, horizon=1e9, migrate=False)
    assert eager.plan(state, counts)
    gain = 1 - eager.last["time_after"] / eager.last["time_before"]
    assert 0.05 < gain < 0.6, eager.last
    strict = FlexMoEPlanner(cm, threshold=1.0, horizon=1e9, migrate=False, min_gain=gain * 1.2)
    assert strict.plan(state, counts) == []
    with pytest.raises(ValueError, match="min_gain"):
        FlexMoEPlanner(cm, min_gain=1.0)
