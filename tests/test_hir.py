"""Hir gate (FasterMoE §4.3) on one rank's routing: budget, re-selection on the own node, top-2 without repeats."""
import torch

from megamoe_plugin import MoEConfig
from megamoe_plugin.gates import build_gate
from megamoe_plugin.parallel import ExpertParallel


def _gate(rank, k, bw="100,25"):
    cfg = MoEConfig(gate="hir", num_experts=8, top_k=k, world_size=4, expert_parallel_size=4,
                    topology="[[0,1],[2,3]]", topology_bandwidth_gbps=bw)
    return build_gate(cfg, 16, ep=ExpertParallel.layout(rank, [0, 1, 2, 3]))


def test_top2_budget_and_local_reselection():
    torch.manual_seed(0)
    gate = _gate(rank=1, k=2)                      # rank 1 is on node 0: experts 0-3 local, 4-7 remote
    with torch.no_grad():
        gate.weight[4:] += 1.5                     # remote experts are everyone's favourites
    x = torch.rand(300, 16) + 0.1
    r = gate(x)
    node_of_expert = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    remote = (node_of_expert[r.expert_ids] == 1) & r.kept
    L = int(100 * 25 / (2 * 100) / 100 * 300)      # W_net / (M W_local) * B, computed here independently
    assert gate.budget(300) == L
    assert int(remote.sum()) == L                  # exactly the budget is used: demand is far above it
    assert (r.expert_ids[:, 0] != r.expert_ids[:, 1]).all()
    assert bool(r.kept.all())
    # the L remote assignments kept are the highest-scoring remote choices of the plain top-2
    probs = torch.softmax(x @ gate.weight.t(), -1)
    plain = torch.topk(probs, 2, -1)
    plain_remote = node_of_expert[plain.indices] == 1
    scores = plain.values[plain_remote]
    threshold = torch.sort(scores, descending=True).values[L - 1]
    kept_scores = probs.gather(1, r.expert_ids)[remote]
    assert (kept_scores >= threshold - 1e-7).all()


def test_single_node_equals_naive_topk():
    cfg = MoEConfig(gate="hir", num_experts=8, top_k=2, world_size=2, topology="[0,1]")
    gate = build_gate(cfg, 16)
    x = torch.randn(50, 16)
    r = gate(x)
    want = torch.topk(torch.softmax(x @ gate.weight.t(), -1), 2, -1).indices
    assert torch.equal(r.expert_ids, want)
