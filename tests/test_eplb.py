"""EPLB (placement/eplb.py), DeepSeek's expert-parallel load balancer: replica counts and packing on hand-made
loads checked against values worked out by hand, the moves reach the target table without ever dropping an
expert's last replica, and the planner stays idle on balanced routing and acts on skewed routing."""
import random

import pytest
import torch

from megamoe_plugin.perfmodel.cost import LayerShape
from megamoe_plugin.perfmodel.profiles import get_profile
from megamoe_plugin.placement.eplb import (EPLBPlanner, balanced_packing, eplb_table, moves_to, nodes_from_bandwidth,
                                           replicate_by_load)
from megamoe_plugin.placement.state import PlacementError, PlacementState


def test_replicas_go_to_the_highest_load_per_replica():
    # 6/1 -> e0 gets the 4th slot (6/2 = 3); 3 == 3/1 ties to the lower id -> e0 again (6/3 = 2)
    assert replicate_by_load([6, 3, 1], 5) == [3, 1, 1]
    assert replicate_by_load([6, 3, 1], 5, max_replicas=2) == [2, 2, 1]
    assert replicate_by_load([1, 1], 2) == [1, 1]
    with pytest.raises(ValueError):
        replicate_by_load([1, 1, 1], 2)


def test_balanced_packing_by_hand():
    # heaviest first into the lightest pack with room: 9 -> p0, 7 -> p1, 4 -> p1 (7 < 9), 2 -> p0 (9 < 11)
    assert balanced_packing([4, 9, 2, 7], [2, 2]) == [1, 0, 0, 1]
    # labels: the two replicas of expert 5 (weight 5 each) must not share a pack
    assert balanced_packing([5, 5, 1, 1], [2, 2], labels=[5, 5, 1, 2]) == [0, 1, 0, 1]


def test_hierarchical_table_by_hand():
    """8 experts, 2 nodes x 2 ranks, 3 slots per rank, one slot kept free (the last rank's).
    Nodes: 0 (100) -> n0, 4 (40) -> n1, then 1, 2, 3 (10 each) -> n1 (lighter), 5, 6, 7 -> n0 (n1 is full).
    Node 0 (6 slots: 0, 5, 6, 7): the extra slots go to 0 (100 -> 50) and, 0 being at one replica per rank, to 5.
    Packing 0, 0 (50), 6, 7 (10), 5, 5 (5): r0 {0, 6, 5}, r1 {0, 7, 5}.
    Node 1 (5 slots: 1, 2, 3, 4): the extra slot to 4 (40 -> 20); 4, 4, then 1 -> r2, 2 -> r3, 3 -> r2 (r3 is full)."""
    table = eplb_table([100, 10, 10, 10, 40, 10, 10, 10], [[0, 1], [2, 3]], 3)
    assert table == [[0, 5, 6], [0, 5, 7], [1, 3, 4], [2, 4]]


def test_even_and_uneven_node_splits():
    """Even: 6 experts over 2 nodes (3 each): 0 (8) -> n0, 1, 2, 3 -> n1, 4, 5 -> n0; node 0's 4 slots give 0 a
    second replica, node 1's 3 slots (one kept free) none.
    Uneven: 4 experts over 3 one-rank nodes: global balancing over the 5 slots (one kept free): 0 gets a second
    replica; packing 0, 0 (4), 1, 2, 3 (1) into capacities 2, 2, 1: r0 {0, 2}, r1 {0, 3}, r2 {1}."""
    even = eplb_table([8, 1, 1, 1, 1, 1], [[0, 1], [2, 3]], 2)
    assert sorted(e for row in even for e in row) == [0, 0, 1, 2, 3, 4, 5]
    assert 0 in even[0] and 0 in even[1] and {1, 2, 3} == set(even[2] + even[3])
    assert eplb_table([8, 1, 1, 1], [[0], [1], [2]], 2) == [[0, 2], [0, 3], [1]]


def test_nodes_from_bandwidth():
    bw = torch.tensor([[0, 100, 1, 1], [100, 0, 1, 1], [1, 1, 0, 100], [1, 1, 100, 0]], dtype=torch.float)
    assert nodes_from_bandwidth(bw) == [[0, 1], [2, 3]]


@pytest.mark.parametrize("seed", range(6))
def test_moves_reach_the_target_and_keep_every_expert(seed):
    rng = random.Random(seed)
    experts, ranks, slots = 8, 4, 3
    state = PlacementState(experts, ranks, slots)
    for _ in range(3):
        load = [rng.choice([1, 2, 5, 40]) for _ in range(experts)]
        target = eplb_table(load, [[0, 1], [2, 3]], slots)
        moves = moves_to(state, target, nbytes=1000)
        check = state.copy()
        for mv in moves:
            check.apply([mv])
            assert all(check.num_replicas(e) >= 1 for e in range(experts))     # never the last replica
        assert [sorted(e for e in check.slots_of(r) if e is not None) for r in range(ranks)] == target
        state = check


def _planner_and_counts(skewed: bool):
    profile = get_profile("flexmoe-a100")
    profile.gemm_tflops = 1e-3                  # compute-bound: balancing pays for these experts
    cm = profile.cost_model(LayerShape(256, 512, 8), world_size=4)
    counts = torch.full((4, 8), 512.0)
    if skewed:
        counts[:, 0] = 4096.0
    return EPLBPlanner(cm, decay=0.0, horizon=10.0, nodes=[[0, 1], [2, 3]]), counts


def test_planner_idle_on_balanced_routing():
    planner, counts = _planner_and_counts(skewed=False)
    assert planner.plan(PlacementState(8, 4, 3), counts) == []
    assert planner.last["triggered"] is False and planner.last["moves"] == 0


def test_planner_acts_on_skewed_routing_and_predicts_a_gain():
    planner, counts = _planner_and_counts(skewed=True)
    state = PlacementState(8, 4, 3)
    moves = planner.plan(state, counts)
    assert moves and planner.last["triggered"]
    after = state.copy().apply(moves)
    assert after.num_replicas(0) >= 2                                       # the hot expert is replicated
    assert after.balance_ratio(counts) < state.balance_ratio(counts)
    assert planner.last["time_after"] + planner.last["transfer_time"] / 10.0 < planner.last["time_before"]


def test_a_full_cluster_cannot_be_reordered():
    state = PlacementState(4, 2, 2)                                         # no spare slot anywhere
    with pytest.raises(PlacementError):
        moves_to(state, [[2, 3], [0, 1]], nbytes=1)


def test_inference_eplb_placement_by_hand():
    """Loads 8..1 on experts 0..7, 4 devices in 2 nodes. Nodes (4 experts each, heaviest first into the lighter):
    8 -> n0, 7 -> n1, 6 -> n1, 5 -> n0, 4 -> n0 (tie 13/13), 3 -> n1, 2 -> n1, 1 -> n0: n0 {0, 3, 4, 7},
    n1 {1, 2, 5, 6}. Devices of n0: 0 -> d0, 3 -> d1, 4 -> d1 (5 < 8), 7 -> d0; of n1: 1 -> d2, 2 -> d3,
    5 -> d3 (6 < 7), 6 -> d2."""
    from megamoe_plugin.inference.balance import eplb_placement, greedy_placement
    loads = torch.tensor([[8, 7, 6, 5, 4, 3, 2, 1]], dtype=torch.float64).numpy()
    assert eplb_placement(loads, 4, nodes=2) == [0, 2, 3, 1, 1, 3, 2, 0]
    assert eplb_placement(loads, 4, nodes=1) == greedy_placement(loads, 4)     # one node, no redundancy: greedy
    with pytest.raises(ValueError):
        eplb_placement(loads, 4, nodes=3)


def test_eplb_keeps_a_table_only_above_the_minimum_predicted_gain():
    """The same load and cost model: a table predicted to save a little is kept with min_gain 0 and dropped when the
    saving is below min_gain of the step (the policies' 5%: gains within the model's error do not pay a move)."""
    from megamoe_plugin.perfmodel.cost import LayerShape
    from megamoe_plugin.perfmodel.profiles import get_profile
    from megamoe_plugin.placement import PlacementState
    from megamoe_plugin.placement.eplb import EPLBPlanner

    profile = get_profile("flexmoe-a100")
    profile.gemm_tflops = 1e-3                       # compute dominates: balancing can pay
    cm = profile.cost_model(LayerShape(64, 128, 4), world_size=2)
    state = PlacementState(4, 2, 3, max_replicas_per_rank=1)
    counts = torch.tensor([[600.0, 250.0, 100.0, 50.0]] * 2)         # expert 0 hot: a replica saves ~30%
    eager = EPLBPlanner(cm, horizon=1e9)
    moves = eager.plan(state, counts)
    gain = 1 - eager.last["time_after"] / eager.last["time_before"]
    assert moves and 0 < gain < 0.5, eager.last
    strict = EPLBPlanner(cm, horizon=1e9, min_gain=min(0.99, gain * 1.5))
    assert strict.plan(state, counts) == [] and strict.last["moves"] == 0


def test_replicas_are_packed_first_and_the_planner_falls_back_to_global_packing():
    """Loads where heaviest-first packing strands an expert's second replica (the only rank with room already holds
    its first): replicas go first, so every rank holds distinct experts. A node split that cannot hold its share
    (2 nodes of one 3-slot rank for 2 experts each) falls back to packing over all ranks instead of failing."""
    from megamoe_plugin.perfmodel.cost import LayerShape
    from megamoe_plugin.perfmodel.profiles import get_profile
    from megamoe_plugin.placement import PlacementState
    from megamoe_plugin.placement.eplb import EPLBPlanner, eplb_table

    table = eplb_table([72.2, 86.2, 72.5, 100.0], [[0, 1]], 3)           # expert 3 gets the redundant slot
    assert sorted(e for row in table for e in row) == [0, 1, 2, 3, 3]
    assert all(len(set(row)) == len(row) for row in table) and sorted(map(len, table)) == [2, 3]
    profile = get_profile("flexmoe-a100")
    profile.gemm_tflops = 1e-3
    cm = profile.cost_model(LayerShape(64, 128, 4), world_size=2)
    planner = EPLBPlanner(cm, horizon=1e9, nodes=[[0], [1]])
    moves = planner.plan(PlacementState(4, 2, 3, max_replicas_per_rank=1),
                         torch.tensor([[600.0, 250.0, 100.0, 50.0]] * 2))
    assert moves and planner.last["moves"] == len(moves)
