"""TA-MoE: optimising only the gate under the topology loss moves the dispatch pattern toward c_hat."""
import torch

from megamoe_plugin import MoEConfig
from megamoe_plugin.gates import build_gate, target_dispatch_pattern
from megamoe_plugin.gates import ta_moe as ta_moe_gate
from megamoe_plugin.parallel import ExpertParallel


def _rank_fractions(routing, experts_per_rank, ranks):
    per_expert = routing.counts.double() / routing.counts.sum()
    return per_expert.view(ranks, experts_per_rank).sum(1)


def test_gate_training_moves_dispatch_toward_target(monkeypatch):
    monkeypatch.setattr(ta_moe_gate, "SMOOTHING", 0.0)           # the unsmoothed target, exactly
    torch.manual_seed(0)
    cfg = MoEConfig(gate="ta_moe", num_experts=8, top_k=2, world_size=4, topology="[[0,1],[2,3]]",
                    topology_bandwidth_gbps="4,1", topology_latency_us="0,0",
                    aux_loss_coeff=1.0, expert_parallel_size=4)
    gate = build_gate(cfg, 32, ep=ExpertParallel.layout(0, [0, 1, 2, 3]))
    target = target_dispatch_pattern(cfg.build_topology(), smoothing=0.0)[0]
    assert torch.allclose(gate.target.view(4, 2).sum(1).double(), target, atol=1e-6)
    opt = torch.optim.Adam(gate.parameters(), lr=0.02)
    data = torch.randn(1024, 32)

    def distance():
        with torch.no_grad():
            return float((_rank_fractions(gate(data), 2, 4) - target).abs().sum())

    before = distance()
    for step in range(300):
        x = data[torch.randint(0, 1024, (256,))]
        loss = gate(x).aux_losses["balance"]
        opt.zero_grad(); loss.backward(); opt.step()
    after = distance()
    assert after < 0.5 * before, (before, after)
    assert after < 0.15


def test_uniform_topology_gives_the_gshard_loss():
    torch.manual_seed(0)
    base = dict(num_experts=4, top_k=2, world_size=4, expert_parallel_size=4, aux_loss_coeff=1.0,
                second_expert_policy="all")
    ta = build_gate(MoEConfig(gate="ta_moe", topology="[0,1,2,3]", **base), 8, ep=ExpertParallel.layout(1, [0, 1, 2, 3]))
    x = torch.randn(64, 8)
    r = ta(x)
    probs = torch.softmax(x @ ta.weight.t(), -1)
    f = torch.bincount(r.expert_ids.reshape(-1), minlength=4).double() / r.expert_ids.numel()
    want = 4 * (f * probs.mean(0).double()).sum()
    assert torch.allclose(r.aux_losses["balance"].double(), want, atol=1e-6)


