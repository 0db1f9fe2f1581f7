"""Real gloo process groups: expert-parallel equality (EP=1/2/4), the Hir node budget, topology measurement."""
import torch
import torch.distributed as dist

from conftest import run_distributed
from megamoe_plugin import MoEConfig, MoELayer, Topology


def _ep_equal(rank, world, group, ep_size, dispatch, gate, k):
    """EP layer on `group` vs the full layer (EP=1) on this rank's tokens: outputs and all gradients equal."""
    base = MoEConfig(num_experts=8, top_k=k, gate=gate, dispatch=dispatch, capacity_factor=0.75,
                     second_expert_policy="all", world_size=world)
    torch.manual_seed(123)
    full = MoELayer(base, 16, 24).double()
    ep_layer = MoELayer(base.replace(expert_parallel_size=ep_size), 16, 24, ep_group=group).double()
    me, per = dist.get_rank(group), 8 // ep_size
    with torch.no_grad():
        ep_layer.gate.weight.copy_(full.gate.weight)
        ep_layer.experts.w1.copy_(full.experts.w1[me * per:(me + 1) * per])
        ep_layer.experts.w2.copy_(full.experts.w2[me * per:(me + 1) * per])
    torch.manual_seed(1000 + rank)
    T = 20 + 7 * rank                                              # uneven token counts per rank
    x = torch.randn(T, 16, dtype=torch.float64)
    g = torch.randn(T, 16, dtype=torch.float64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = full(xa), ep_layer(xb)
    assert (ya - yb).abs().max() < 1e-10, (dispatch, ep_size)
    if dispatch == "capacity":
        assert int(ep_layer.last_routing.dropped) == int(full.last_routing.dropped)
    ((ya * g).sum() + full.aux_loss).backward()
    ((yb * g).sum() + ep_layer.aux_loss).backward()
    assert (xa.grad - xb.grad).abs().max() < 1e-10
    assert (full.gate.weight.grad - ep_layer.gate.weight.grad).abs().max() < 1e-10
    for name in ("w1", "w2"):
        ref = getattr(full.experts, name).grad.clone()
        dist.all_reduce(ref, group=group)                          # experts see every rank's tokens in EP
        got = getattr(ep_layer.experts, name).grad
        assert (ref[me * per:(me + 1) * per] - got).abs().max() < 1e-10, name


def _hir_budget(rank, world):
    topo = "[[0,1],[2,3]]"
    cfg = MoEConfig(gate="hir", num_experts=8, top_k=1, world_size=world, expert_parallel_size=4,
                    topology=topo, topology_bandwidth_gbps="100,25")
    torch.manual_seed(0)
    layer = MoELayer(cfg, 16, 24, ep_group=dist.group.WORLD)
    with torch.no_grad():                      # every token prefers experts 6, 7 (rank 3, node 1)
        layer.gate.weight[6:] += 2.0
    torch.manual_seed(rank)
    T = 200
    x = torch.rand(T, 16) + 0.2
    layer(x).sum().backward()
    r = layer.last_routing
    node_of_expert = torch.tensor([Topology.parse(topo).node_of(e // 2) for e in range(8)])
    my_node = rank // 2
    cross = int(((node_of_expert[r.expert_ids] != my_node) & r.kept).sum())
    budget = layer.gate.budget(T)
    assert budget == int(100 * 25 / (2 * 100) / 100 * T) == 25   # L = W_net / (M W_local) * B
    assert cross <= budget
    per_node = torch.tensor([cross])
    dist.all_reduce(per_node)                                      # both nodes' cross traffic
    node_cross = torch.zeros(2, dtype=torch.long)
    node_cross[my_node] = cross
    dist.all_reduce(node_cross)
    assert int(node_cross.max()) <= 2 * budget                     # M workers x L tokens per node
    if my_node == 0:
        assert cross == budget                 # node 0 wanted node 1's experts: exactly L keep them
        assert int(r.kept.sum()) == T          # the rest re-selected locally, nothing dropped


def _measure(rank, world):
    topo = Topology.parse("[[0,1],[2,3]]").measure(large_bytes=1 << 16, iters=2)
    assert all(b > 0 for b in topo.bandwidth_gbps) and all(a >= 0 for a in topo.latency_us)
    gathered = [None] * world
    dist.all_gather_object(gathered, (topo.bandwidth_gbps, topo.latency_us))
    assert all(gv == gathered[0] for gv in gathered)               # every rank got the same numbers


def _all_checks(rank, world):
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ep2 = pairs[rank // 2]
    for dispatch in ("dropless", "capacity"):
        for gate, k in (("naive", 2), ("switch", 1)):
            _ep_equal(rank, world, dist.group.WORLD, 4, dispatch, gate, k)
            _ep_equal(rank, world, ep2, 2, dispatch, gate, k)
    _hir_budget(rank, world)
    _measure(rank, world)


def test_four_gloo_processes():
    run_distributed(_all_checks, 4)
