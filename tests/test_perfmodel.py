"""Performance model core: Network (paper 003 §3.2), CostModel (paper 003 §3.1/§4.1, paper 001 §3.4), profiles.

Every expected value is worked out by hand in the test (edge by edge, from the documented numbers), never by
calling the code under test a second way.
"""
import json
import math
import time

import pytest
import torch

from megamoe_plugin import Topology
from megamoe_plugin.perfmodel import (PROFILES, Breakdown, CostModel, HardwareProfile, LayerShape, Network,
                                      get_profile)

GB = 1e9


def approx(x, rel=1e-9, abs=1e-15):
    return pytest.approx(x, rel=rel, abs=abs)


# --- 2 nodes x 2 GPUs tree -------------------------------------------------------------------------------------
def tree2x2(lat=(0.0, 0.0)):
    """[[0,1],[2,3]], 10 GB/s rank <-> node switch, 1 GB/s node switch <-> top; switches 4, 5 (nodes), 6 (top)."""
    return Network.from_topology(Topology.parse("[[0,1],[2,3]]", bandwidth_gbps=[10, 1], latency_us=list(lat)))


def test_tree_paths_and_latency_match_topology():
    net = tree2x2(lat=(1.0, 5.0))
    assert net.num_ranks == 4
    assert net.path(0, 1) == [(0, 4), (4, 1)]
    assert net.path(0, 3) == [(0, 4), (4, 6), (6, 5), (5, 3)]
    assert net.path(2, 2) == []
    # alpha of a pair = the topology's alpha of its level: 1 us intra-node, 5 us inter-node
    assert net.path_latency(0, 1) == approx(1e-6)
    assert net.path_latency(1, 2) == approx(5e-6)
    assert net.p2p_time(2e9, 0, 1) == approx(2e9 / 10e9 + 1e-6)
    assert net.p2p_time(2e9, 3, 0) == approx(2e9 / 1e9 + 5e-6)
    assert net.p2p_time(0, 3, 0) == 0.0 and net.p2p_time(5.0, 2, 2) == 0.0
    assert net.bandwidth(4, 6) == 1e9 and net.bandwidth(6, 4) == 1e9 and net.bandwidth(0, 4) == 10e9


def test_tree_alltoallv_by_hand():
    net = tree2x2(lat=(1.0, 5.0))
    T = torch.tensor([[9, 4, 2, 1],          # the diagonal (9) must be ignored
                      [3, 0, 0, 5],
                      [1, 0, 9, 2],
                      [0, 6, 1, 0]], dtype=torch.float64) * GB
    lt = net.link_traffic(T)
    want = {
        (0, 4): 4 + 2 + 1, (4, 0): 3 + 1 + 0,   # rank 0 up: everything it sends; down: everything it receives
        (1, 4): 3 + 0 + 5, (4, 1): 4 + 0 + 6,
        (2, 5): 1 + 0 + 2, (5, 2): 2 + 0 + 1,
        (3, 5): 0 + 6 + 1, (5, 3): 1 + 5 + 2,
        (4, 6): 2 + 1 + 0 + 5, (6, 5): 2 + 1 + 0 + 5,   # node 0 -> node 1: 0->2, 0->3, 1->2, 1->3
        (5, 6): 1 + 0 + 0 + 6, (6, 4): 1 + 0 + 0 + 6,   # node 1 -> node 0: 2->0, 2->1, 3->0, 3->1
    }
    assert set(lt) == set(want)
    for e, w in want.items():
        assert lt[e] == approx(w * GB), e
    # max T/W: intra links at most 10 GB over 10 GB/s = 1 s; node 0's uplink 8 GB over 1 GB/s = 8 s; + 5 us
    assert net.alltoallv_time(T) == approx(8.0 + 5e-6)


def test_tree_alltoallv_directed():
    net = tree2x2()
    T = torch.zeros(4, 4, dtype=torch.float64)
    T[0, 2] = T[1, 3] = 3 * GB          # node 0 -> node 1: 6 GB through (4, 6)
    T[2, 0] = 1 * GB                    # node 1 -> node 0: 1 GB through (5, 6) and (6, 4)
    lt = net.link_traffic(T)
    assert lt[(4, 6)] == approx(6 * GB) and lt[(6, 4)] == approx(1 * GB)
    assert lt[(5, 6)] == approx(1 * GB) and lt[(6, 5)] == approx(6 * GB)
    assert lt[(0, 4)] == approx(3 * GB) and lt[(4, 0)] == approx(1 * GB)
    # directed: 6 s; an undirected link would carry 7 GB and give 7 s
    assert net.alltoallv_time(T) == approx(6.0)
    assert net.alltoallv_time(T.t()) == approx(6.0)
    assert net.alltoallv_time(torch.zeros(4, 4)) == 0.0
    assert net.alltoallv_time(torch.eye(4) * 1e9) == 0.0    # only self traffic
    with pytest.raises(ValueError):
        net.alltoallv_time(torch.zeros(3, 3))
    with pytest.raises(ValueError):
        net.alltoallv_time(-torch.ones(4, 4))


def test_ring_allreduce_broadcast_reduce_on_tree():
    net = tree2x2(lat=(1.0, 5.0))
    S = 4 * GB
    # ring 0 -> 1 -> 2 -> 3 -> 0: each sends 2(n-1)/n S = 1.5 S; inter-node hops 1->2 and 3->0, one per uplink
    assert net.allreduce_time(S) == approx(1.5 * S / 1e9 + 2 * 3 * 5e-6)
    # ring 0 -> 2 -> 1 -> 3 -> 0: all 4 hops cross, node 0's uplink carries 0->2 and 1->3: 3 S
    assert net.allreduce_time(S, [0, 2, 1, 3]) == approx(3 * S / 1e9 + 6 * 5e-6)
    # inside one node: 2 ranks, each sends S to the other over 10 GB/s links, hop latency 1 us
    assert net.allreduce_time(S, [0, 1]) == approx(S / 10e9 + 2 * 1e-6)
    assert net.allreduce_time(S, [3]) == 0.0
    # broadcast chain 0 -> 1 -> 2 -> 3: S on each link, the one inter-node hop is the bottleneck
    assert net.broadcast_time(S) == approx(S / 1e9 + 3 * 5e-6)
    assert net.reduce_time(S) == approx(S / 1e9 + 3 * 5e-6)
    # chain 0 -> 2 -> 1 -> 3: node 0's uplink carries 0->2 and 1->3 (2 S), node 1's uplink 2->1 (S)
    assert net.broadcast_time(S, [0, 2, 1, 3]) == approx(2 * S / 1e9 + 3 * 5e-6)
    with pytest.raises(ValueError):
        net.allreduce_time(S, [0, 0, 1])


def test_directed_asymmetric_link_and_reduce_direction():
    net = Network(2)
    net.add_link(0, 1, 4e9, duplex=False)
    net.add_link(1, 0, 1e9, duplex=False)
    assert net.p2p_time(8e9, 0, 1) == approx(2.0) and net.p2p_time(8e9, 1, 0) == approx(8.0)
    assert net.broadcast_time(8e9, [0, 1]) == approx(2.0)     # 0 -> 1
    assert net.reduce_time(8e9, [0, 1]) == approx(8.0)        # 1 -> 0, towards the root
    assert net.allreduce_time(8e9, [0, 1]) == approx(8.0)     # both directions, S each: the slow one binds


def test_paths_prefer_widest_bottleneck_among_shortest():
    # 0 and 1 joined through either of two switches (2 hops each): the wider one wins
    net = Network(2)
    a, b = net.add_vertex("narrow"), net.add_vertex("wide")
    net.add_link(0, a, 1e9)
    net.add_link(a, 1, 1e9)
    net.add_link(0, b, 5e9)
    net.add_link(b, 1, 3e9)
    assert net.path(0, 1) == [(0, b), (b, 1)]
    assert net.p2p_time(3e9, 0, 1) == approx(1.0)
    # a direct link (1 hop) beats them even though it is narrower
    net.add_link(0, 1, 0.5e9)
    assert net.path(0, 1) == [(0, 1)]


# --- ring inside a node ----------------------------------------------------------------------------------------
def ring4(nodes=1, lat=0.0):
    """4 GPUs, ring edges 0-1: 10, 1-2: 20, 2-3: 30, 3-0: 40 GB/s."""
    return Network.hierarchical(nodes, 4, "ring", intra_bandwidth=25e9, nic_bandwidth=5e9, intra_latency=lat,
                                nic_latency=0.0, ring_bandwidths=[10e9, 20e9, 30e9, 40e9])


def test_ring_paths_shorter_way_and_widest():
    net = ring4(lat=1e-6)
    assert net.path(0, 1) == [(0, 1)] and net.path(0, 3) == [(0, 3)]
    # 0 -> 2: via 1 bottleneck min(10, 20) = 10, via 3 min(40, 30) = 30 -> via 3
    assert net.path(0, 2) == [(0, 3), (3, 2)]
    assert net.path(2, 0) == [(2, 3), (3, 0)]
    # 1 -> 3: via 2 min(20, 30) = 20, via 0 min(10, 40) = 10 -> via 2
    assert net.path(1, 3) == [(1, 2), (2, 3)]
    assert net.path(3, 1) == [(3, 2), (2, 1)]
    assert net.p2p_time(6e9, 0, 2) == approx(6e9 / 30e9 + 2e-6)
    assert net.p2p_time(6e9, 1, 3) == approx(6e9 / 20e9 + 2e-6)
    assert net.p2p_time(6e9, 1, 0) == approx(6e9 / 10e9 + 1e-6)


def test_ring_alltoall_by_hand():
    net = ring4()
    T = torch.ones(4, 4, dtype=torch.float64) * GB
    T[0, :] = 2 * GB                            # rank 0 sends 2 GB to each, the others 1 GB
    lt = net.link_traffic(T)
    # routes: 0->2 = 0,3,2; 2->0 = 2,3,0; 1->3 = 1,2,3; 3->1 = 3,2,1; the rest direct
    want = {
        (0, 1): 2,              # 0->1
        (1, 0): 1,              # 1->0
        (1, 2): 1 + 1,          # 1->2, 1->3
        (2, 1): 1 + 1,          # 2->1, 3->1
        (2, 3): 1 + 1 + 1,      # 1->3, 2->0, 2->3
        (3, 2): 2 + 1 + 1,      # 0->2, 3->1, 3->2
        (3, 0): 1 + 1,          # 2->0, 3->0
        (0, 3): 2 + 2,          # 0->2, 0->3
    }
    assert set(lt) == set(want)
    for e, w in want.items():
        assert lt[e] == approx(w * GB), e
    # T/W: (0,1) 2/10 = 0.2 s is the max ((3,2) 4/30, (0,3) 4/40, (1,2) 2/20, ...)
    assert net.alltoallv_time(T) == approx(0.2)


def test_ring_in_multi_node_stays_on_ring():
    net = ring4(nodes=2)
    assert net.num_ranks == 8
    assert net.path(0, 2) == [(0, 3), (3, 2)]              # not through the NIC (also 2 hops)
    assert net.path(4, 6) == [(4, 7), (7, 6)]
    p = net.path(0, 5)
    assert len(p) == 4 and p[0][0] == 0 and p[-1][1] == 5
    assert all(net.bandwidth(*e) == 5e9 for e in p)          # GPU -> NIC -> top -> NIC -> GPU at the NIC's rate
    # every rank of node 0 sends 1 GB to its partner in node 1: 4 GB through node 0's NIC uplink at 5 GB/s
    T = torch.zeros(8, 8)
    for i in range(4):
        T[i, i + 4] = GB
    assert net.alltoallv_time(T) == approx(4 / 5)
    # an 8-GPU ring: 0 -> 4 is 4 ring hops but only 2 through the NIC vertex; intra-node traffic keeps to NVLink
    big = Network.hierarchical(2, 8, "ring", intra_bandwidth=25e9, nic_bandwidth=100e9)
    assert big.path(0, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert big.path(9, 14) == [(9, 8), (8, 15), (15, 14)]


# --- computation: Eq.1 and FlexMoE Eq.7 --------------------------------------------------------------------------
def test_compute_time_eq1_and_tps():
    shape = LayerShape(hidden=8, ffn=16, num_experts=4)
    net = tree2x2()
    cm = CostModel(net, [1e12, 2e12, 1e12, 4e12], shape)
    tokens = torch.tensor([100, 300, 50, 700])
    # 4 B H ffn / P: 4*8*16 = 512 FLOPs per token; 100*512/1e12, 300*512/2e12, 50*512/1e12, 700*512/4e12
    per = [5.12e-8, 7.68e-8, 2.56e-8, 8.96e-8]
    assert cm.compute_time(tokens) == approx(max(per))
    assert cm.compute_time(tokens.float()) == approx(8.96e-8)
    # one throughput for all: the most loaded rank, 700 * 512 / 1e12
    assert CostModel(net, 1e12, shape).compute_time(tokens) == approx(3.584e-7)
    # TPS (FlexMoE Eq.7): 100/100, 300/200, 50/50, 700/1000 -> 1.5 s
    cm_tps = CostModel(net, 1e12, shape, tokens_per_second=[100, 200, 50, 1000])
    assert cm_tps.compute_time(tokens) == approx(1.5)
    assert CostModel(net, 1e12, shape, tokens_per_second=350.0).compute_time(tokens) == approx(2.0)
    with pytest.raises(ValueError):
        cm.compute_time([1, 2, 3])


def test_layer_shape():
    s = LayerShape(hidden=1024, ffn=4096, num_experts=16, bytes_per_element=2)
    assert s.expert_param_bytes == 2 * 1024 * 4096 * 2
    assert s.token_bytes == 2048
    assert s.layer_param_bytes == 16 * 2 * 1024 * 4096 * 2


# --- layer_time: placement, replicas, Eq.9 -----------------------------------------------------------------------
SHAPE = LayerShape(hidden=64, ffn=128, num_experts=4, bytes_per_element=2)   # token 128 B, expert 32768 B
COUNTS = torch.tensor([[30, 10, 0, 0],
                       [20, 0, 10, 0],
                       [0, 0, 10, 10],
                       [20, 10, 0, 10]])


def test_layer_time_default_placement():
    cm = CostModel(tree2x2(), 1e12, SHAPE)
    # expert e on rank e: loads 70, 20, 20, 20; traffic = COUNTS off the diagonal
    b = cm.layer_time(COUNTS)
    assert isinstance(b, Breakdown)
    comp = 4 * 70 * 64 * 128 / 1e12
    # node 0 -> node 1: 0->2 0, 0->3 0, 1->2 10, 1->3 0 = 10 tokens; node 1 -> node 0: 2->0 0, 2->1 0, 3->0 20,
    # 3->1 10 = 30 tokens over 1 GB/s; rank 0's downlink 20 + 20 = 40 tokens over 10 GB/s
    a2a = 30 * 128 / 1e9
    assert b.compute == approx(3 * comp)
    assert b.alltoall == approx(4 * a2a)
    assert b.sync == 0.0
    assert b.total == approx(3 * comp + 4 * a2a)
    assert b.as_dict() == {"compute": b.compute, "alltoall": b.alltoall, "sync": b.sync, "total": b.total}


def test_layer_time_replicated_expert():
    placement = [[0, 2], [1], [2], [3]]
    cm = CostModel(tree2x2(), 1e12, SHAPE, sync_bps={(2, 0): 4e9})
    # expert 0: 30 + 20 + 0 + 20 = 70 tokens over 2 replicas -> 35 each. Rank 0 keeps its own 30 (room 5), rank 2
    # has none of its own (room 35); the 20 of rank 1 and the 20 of rank 3 split 5:35 -> 2.5 to rank 0, 17.5 to 2
    want = torch.tensor([[30.0, 10.0, 0.0, 0.0],
                         [2.5, 0.0, 17.5 + 10, 0.0],
                         [0.0, 0.0, 10.0, 10.0],
                         [2.5, 10.0, 17.5, 10.0]], dtype=torch.float64)
    assert torch.allclose(cm.route(COUNTS, placement), want)
    b = cm.layer_time(COUNTS, placement)
    # loads: rank 0 35, rank 1 20, rank 2 35 + 20 = 55, rank 3 20
    comp = 4 * 55 * 64 * 128 / 1e12
    # node 0 -> node 1: 1->2 27.5 tokens; node 1 -> node 0: 3->0 2.5 + 3->1 10 = 12.5; rank 2 downlink
    # 27.5 + 17.5 = 45 tokens over 10 GB/s. Max: 27.5 * 128 B / 1 GB/s
    a2a = 27.5 * 128 / 1e9
    sync = 32768 / 4e9          # Eq.9 with the profiled BPS of group (0, 2)
    assert b.compute == approx(3 * comp)
    assert b.alltoall == approx(4 * a2a)
    assert b.sync == approx(sync)
    assert b.total == approx(3 * comp + 4 * a2a + sync)
    assert cm.replica_sync_time(cm.placement_matrix(placement)) == approx(sync)
    assert cm.shadow_layer_time(COUNTS, [1], placement).sync >= sync
    # shadowing: per shadowed expert one measured broadcast and one reduce (1 GB/s, 100 us each)
    shadowing = CostModel(tree2x2(), 1e12, SHAPE, bcast=(1e9, 1e-4))
    eq8 = 2 * (1e-4 + 32768 / 1e9)
    assert shadowing.shadow_sync_time([1]) == approx(eq8)
    assert shadowing.shadow_sync_time([1, 3, 3]) == approx(2 * eq8)
    assert shadowing.shadow_layer_time(COUNTS, [1]).sync == approx(eq8)
    assert shadowing.layer_time(COUNTS).sync == 0.0
    # without a profiled BPS: ring all-reduce over (0, 2), each sends S to the other across the 1 GB/s uplinks
    b2 = CostModel(tree2x2(), 1e12, SHAPE).layer_time(COUNTS, placement)
    assert b2.sync == approx(32768 / 1e9)
    assert CostModel(tree2x2(), 1e12, SHAPE).sync_time(32768, [0, 1]) == approx(32768 / 10e9)


def test_route_locality_and_vexperts():
    cm = CostModel(tree2x2(), 1e12, SHAPE)
    # expert 0 replicated on all 4 ranks, every source has 10 of its tokens: all stay local
    c = torch.tensor([[10, 0, 0, 0]] * 4)
    r = cm.route(c, [[0, 1, 2, 3], [1], [2], [3]])
    assert torch.allclose(r, torch.eye(4, dtype=torch.float64) * 10)
    # two vExperts of expert 0 on rank 0, one on rank 3: capacity 30 / 3 = 10 per vExpert -> rank 0 takes 20
    c = torch.tensor([[0, 0, 0, 0], [30, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    r = cm.route(c, [[0, 0, 3], [1], [2], [3]])
    assert r[1, 0] == approx(20.0) and r[1, 3] == approx(10.0)
    with pytest.raises(ValueError):
        cm.route(torch.ones(4, 3))          # default placement: 3 experts on 4 ranks
    with pytest.raises(ValueError):
        cm.route(torch.ones(4, 4), [[0], [1], [2], [9]])


def test_move_time():
    cm = CostModel(tree2x2(lat=(1.0, 5.0)), 1e12, SHAPE)
    assert cm.move_time(3 * 32768, 1, 2) == approx(3 * 32768 / 1e9 + 5e-6)
    assert cm.move_time(3 * 32768, 1, 1) == 0.0


# --- the papers' worked examples ---------------------------------------------------------------------------------
JOHNNY_PCIE, JOHNNY_NIC, JOHNNY_GEMM = 12e9, 6.25e9, 112e12 * 0.9   # documented in profiles.py
JOHNNY_LAT_INTRA, JOHNNY_LAT_NIC = 5e-6, 10e-6


def _johnny_counts(k, m):
    """16 ranks x 16 experts (expert e on rank e): every rank sends k tokens to expert 0 and keeps m for its own."""
    c = torch.zeros(16, 16)
    c[:, 0] += k
    c += torch.eye(16) * m
    return c


def test_fastermoe_shadowing_pays_when_tokens_outweigh_parameters():
    """Paper 003 §4.1: shadowing popular expert 0 on johnny. Eq.9 (B_max > r alpha H) holds: moving its tokens
    costs more than broadcasting + reducing its parameters, and shadowing wins."""
    H, ffn = 1024, 4096                       # alpha = 4
    shape = LayerShape(H, ffn, 16)
    cm = get_profile("johnny").cost_model(shape)
    k, m = 1024, 256
    c = _johnny_counts(k, m)
    B_max = 16 * k + m                        # rank 0
    r, alpha = 1, ffn // H
    assert B_max > r * alpha * H              # Eq.9
    tb, S = 2 * H, 2 * alpha * H * H * 2      # token and expert bytes (fp16)
    flop = 4 * alpha * H * H                  # per token, Eq.1
    plain = cm.layer_time(c)
    # compute: rank 0 holds B_max tokens; all-to-all: node 1's 8 ranks send k tokens each to rank 0 through node
    # 1's 6.25 GB/s NIC (8k tokens) - rank 0's PCIe downlink carries 15k at 12 GB/s, less time; inter-node latency
    assert plain.compute == approx(3 * flop * B_max / JOHNNY_GEMM)
    assert plain.alltoall == approx(4 * (8 * k * tb / JOHNNY_NIC + JOHNNY_LAT_NIC))
    assert 15 * k * tb / JOHNNY_PCIE < 8 * k * tb / JOHNNY_NIC
    shadow = cm.shadow_layer_time(c, [0])
    # every rank computes its own k + m tokens; nothing moves; broadcast + reduce of S over the chain 0..15: S on
    # every link, the 7 -> 8 hop crosses both NICs; 15 hops x the largest hop latency (10 us, inter-node)
    assert shadow.compute == approx(3 * flop * (k + m) / JOHNNY_GEMM)
    assert shadow.alltoall == 0.0
    assert shadow.sync == approx(2 * (S / JOHNNY_NIC + 15 * JOHNNY_LAT_NIC))
    assert plain.alltoall > shadow.sync       # sending tokens costs more than moving the parameters
    assert shadow.total < plain.total


def test_fastermoe_shadowing_does_not_pay_when_balanced():
    """Mild skew: Eq.9 and Eq.10 both fail, and the model keeps the plain expert parallelism."""
    H, ffn = 1024, 4096
    shape = LayerShape(H, ffn, 16)
    cm = get_profile("johnny").cost_model(shape)
    k, m = 16, 1024
    c = _johnny_counts(k, m)
    alpha, r = ffn // H, 1
    B_max, B_max_shadow = 16 * k + m, k + m
    assert not B_max > r * alpha * H                                     # Eq.9 fails
    P_over_W = JOHNNY_GEMM / (JOHNNY_NIC / 2)                            # FLOP/s over elements/s
    assert not 3 * (B_max - B_max_shadow) * alpha * H / (r * alpha * H - B_max) > P_over_W   # Eq.10 fails
    plain, shadow = cm.layer_time(c), cm.shadow_layer_time(c, [0])
    flop, tb = 4 * alpha * H * H, 2 * H
    assert plain.total == approx(3 * flop * B_max / JOHNNY_GEMM + 4 * (8 * k * tb / JOHNNY_NIC + JOHNNY_LAT_NIC))
    assert plain.total < shadow.total


def test_ddl_data_parallel_allreduce_vs_expert_parallel():
    """Paper 003 §3.3: data parallelism all-reduces 2 N alpha H^2 elements per MoE layer; on a uniform network
    (one switch, W per GPU link, no latency) ring all-reduce takes 2(n-1)/n * S / W."""
    n, W = 8, 10e9
    net = Network.from_topology(Topology(list(range(n)), bandwidth_gbps=[W / 1e9], latency_us=[0.0]))
    H, alpha, N = 1024, 4, 8
    shape = LayerShape(H, alpha * H, N)
    S = 2 * N * alpha * H * H * 2             # fp16 bytes
    assert shape.layer_param_bytes == S
    dp = net.allreduce_time(S)
    assert dp == approx(2 * (n - 1) / n * S / W)
    # expert parallelism with B tokens per worker, uniform routing: each GPU link carries B (n-1)/n tokens
    B = 4096
    cm = CostModel(net, 1e14, shape)
    counts = torch.full((n, N), B / N)
    ep = cm.alltoall_time(cm.route(counts))
    assert ep == approx(B * (n - 1) / n * H * 2 / W)
    # DP moves 2(n-1)/n S, EP 4 all-to-alls of B(n-1)/n tokens: ratio 2 S / (4 B H bytes) = 2 N alpha H / (2 B)
    assert dp / (4 * ep) == approx(2 * N * alpha * H / (2 * B))


# --- profiles ----------------------------------------------------------------------------------------------------
DOCUMENTED = {
    # name: (ranks, gemm TFLOPS, set of link bandwidths in B/s)
    "johnny": (16, 112 * 0.9, {12e9, 6.25e9}),
    "trevor": (64, 125 * 0.9, {50e9, 25e9, 12.5e9}),
    "flexmoe-a100": (64, 312 * 0.9, {300e9, 200e9}),
}


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_profiles_build_documented_networks(name, tmp_path):
    ranks, tflops, bws = DOCUMENTED[name]
    prof = get_profile(name)
    assert prof.name == name and "assumption" in prof.source.lower() and "§5.1" in prof.source
    assert prof.gemm_tflops == approx(tflops)
    net = prof.network()
    assert net.num_ranks == ranks == prof.nodes * prof.gpus_per_node
    assert set(net.edge_bandwidths.tolist()) == bws
    topo = prof.topology()
    assert topo.num_ranks == ranks
    cm = prof.cost_model(LayerShape(1024, 4096, ranks))
    assert cm.num_ranks == ranks and float(cm.gemm_flops[0]) == approx(tflops * 1e12)
    # JSON round trip, by path too
    path = tmp_path / f"{name}.json"
    prof.save(str(path))
    assert json.loads(path.read_text())["name"] == name
    back = HardwareProfile.load(str(path))
    assert back == prof
    assert get_profile(str(path)) == prof
    assert HardwareProfile.from_dict(prof.to_dict()) == prof


def test_profile_details():
    j = get_profile("johnny").network()
    # intra-node pair: PCIe 12 GB/s, 5 us; inter-node: the 6.25 GB/s NIC, 10 us
    assert j.p2p_time(12e9, 0, 7) == approx(1.0 + 5e-6)
    assert j.p2p_time(6.25e9, 0, 8) == approx(1.0 + 10e-6)
    t = get_profile("trevor").network()
    # alternate edges bonded: 0-1 50, 1-2 25, 2-3 50, 3-0 25 GB/s, in every node
    for base in (0, 60):
        assert t.bandwidth(base + 0, base + 1) == 50e9 and t.bandwidth(base + 1, base + 2) == 25e9
        assert t.bandwidth(base + 2, base + 3) == 50e9 and t.bandwidth(base + 3, base + 0) == 25e9
    assert t.p2p_time(12.5e9, 0, 4) == approx(1.0 + 10e-6)
    a = get_profile("flexmoe-a100").network()
    assert a.p2p_time(300e9, 0, 7) == approx(1.0 + 2e-6)
    # smaller worlds: 2 ranks of trevor are ring neighbours on the bonded edge; 6 ranks = a node and a half
    assert get_profile("trevor").network(2).p2p_time(50e9, 0, 1) == approx(1.0 + 2e-6)
    t6 = get_profile("trevor").network(6)
    assert t6.num_ranks == 6 and t6.p2p_time(12.5e9, 1, 5) == approx(1.0 + 10e-6)
    with pytest.raises(ValueError):
        get_profile("no-such-cluster")
    # get_profile hands out copies
    p = get_profile("johnny")
    p.nodes = 5
    assert PROFILES["johnny"].nodes == 2


@pytest.mark.serial                     # a wall-clock bound
def test_64_rank_alltoall_is_fast():
    torch.manual_seed(0)
    t0 = time.perf_counter()
    net = get_profile("flexmoe-a100").network()
    T = torch.rand(64, 64, dtype=torch.float64) * 1e6
    first = net.alltoallv_time(T)
    t1 = time.perf_counter()
    for _ in range(10):
        again = net.alltoallv_time(T)
    t2 = time.perf_counter()
    assert t1 - t0 < 0.5          # building every route once + one evaluation
    assert (t2 - t1) / 10 < 0.05
    assert again == first and math.isfinite(first) and first > 0
    # hand check: the busiest NIC (per node, both directions) over 200 GB/s, or a GPU link over 300 GB/s
    node = torch.arange(64) // 8
    cross = T * (node[:, None] != node[None, :])
    out_node = torch.stack([cross[node == n].sum() for n in range(8)])
    in_node = torch.stack([cross[:, node == n].sum() for n in range(8)])
    off = T - torch.diag(torch.diag(T))
    busiest = max(float(out_node.max()) / 200e9, float(in_node.max()) / 200e9,
                  float(off.sum(1).max()) / 300e9, float(off.sum(0).max()) / 300e9)
    assert first == approx(busiest + 10e-6)


def test_shared_compute_pool_bounds_compute_by_total_work():
    """CPU ranks sharing one machine: the busiest rank alone at the solo rate, or all the work at the pool's rate."""
    from megamoe_plugin.perfmodel.cost import CostModel, LayerShape
    from megamoe_plugin.perfmodel.network import Network
    shape = LayerShape(hidden=4, ffn=8, num_experts=4, bytes_per_element=4)
    net = Network.hierarchical(1, 4, "switch", 1e9, 1e9)
    solo, pool = 100.0, 200.0
    m = CostModel(net, solo, shape, shared_gemm_flops=pool)
    f = shape.flops_per_token
    assert m.compute_time([10, 10, 10, 10]) == pytest.approx(f * 40 / pool)          # balanced: the pool binds
    assert m.compute_time([40, 0, 0, 0]) == pytest.approx(f * 40 / solo)             # one busy rank: alone
    assert CostModel(net, solo, shape).compute_time([10, 10, 10, 10]) == pytest.approx(f * 10 / solo)
