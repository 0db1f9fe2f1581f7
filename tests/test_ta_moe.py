"""TA-MoE: optimising only the gate under the topology loss moves the dispatch pattern toward c_hat."""
import torch

from megamoe_plugin import MoEConfig
from megamoe_plugin.gates import build_gate, target_dispatch_pattern
from megamoe_plugin.parallel import ExpertParallel


def _rank_fractions(routing, experts_per_rank, ranks):
    per_expert = routing.counts.double() / routing.counts.sum()
    return per_expert.view(ranks, experts_per_rank).sum(1)


def test_gate_training_moves_dispatch_toward_target():
    torch.manual_seed(0)
    cfg = MoEConfig(gate="ta_moe", num_experts=8, top_k=2, world_size=4, topology="[[0,1],[2,3]]",
                    topology_bandwidth_gbps="4,1", topology_latency_us="0,0", ta_moe_smoothing=0.0,
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


def _later_choice_gate(bias):
    cfg = MoEConfig(gate="ta_moe", num_experts=8, top_k=2, world_size=4, topology="[[0,1],[2,3]]",
                    topology_bandwidth_gbps="4,1", topology_latency_us="0,0", aux_loss_coeff=0.01,
                    expert_parallel_size=4, ta_moe_later_choice_bias=bias)
    return build_gate(cfg, 32, ep=ExpertParallel.layout(0, [0, 1, 2, 3]))


def test_later_choice_bias_keeps_the_first_choice_and_moves_the_second_on_node():
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(4096, 8), -1)
    plain, _ = _later_choice_gate(0.0).select(None, probs)
    biased, kept = _later_choice_gate(1.0).select(None, probs)
    assert kept.all()
    # the first choice is the router's argmax for every token, and the second is another expert
    assert torch.equal(biased[:, 0], probs.argmax(-1))
    assert (biased[:, 1] != biased[:, 0]).all()
    # rank 0 sits on node 0 with experts 0-3: random probabilities send half the second choices off-node, the
    # prior (4:1 links) far fewer
    off_plain = (plain[:, 1] >= 4).double().mean()
    off_biased = (biased[:, 1] >= 4).double().mean()
    assert 0.4 < off_plain < 0.6
    assert off_biased < 0.5 * off_plain
    # where one expert dominates a token's probabilities, the prior does not override it
    sharp = torch.full((1, 8), 0.001)
    sharp[0, 6], sharp[0, 7] = 0.6, 0.394
    ids, _ = _later_choice_gate(1.0).select(None, sharp / sharp.sum())
    assert ids.tolist() == [[6, 7]]


def _warmup_gate(warmup, bias=0.0):
    cfg = MoEConfig(gate="ta_moe", num_experts=8, top_k=2, world_size=4, topology="[[0,1],[2,3]]",
                    topology_bandwidth_gbps="4,1", topology_latency_us="0,0", aux_loss_coeff=1.0,
                    expert_parallel_size=4, ta_moe_smoothing=0.0, ta_moe_warmup=warmup,
                    ta_moe_later_choice_bias=bias, second_expert_policy="all")
    torch.manual_seed(0)
    return build_gate(cfg, 16, ep=ExpertParallel.layout(0, [0, 1, 2, 3]))


def test_warmup_moves_the_loss_from_gshard_to_the_topology_target():
    """Rank 0 on [[0,1],[2,3]] with 4:1 links, no smoothing: its per-expert target is 1/8 for its own two experts,
    1/4 for the same-node neighbour's and 1/16 for each of the other node's four (the paper's uneven pattern). Over
    a 4-call warm-up the weights are (1/8) / ((1 - r) / 8 + r * target) at r = calls / 4."""
    target = torch.tensor([1 / 8, 1 / 8, 1 / 4, 1 / 4] + [1 / 16] * 4, dtype=torch.float64)
    gate = _warmup_gate(4)
    gate.train()
    x = torch.randn(256, 16)

    def by_hand(routing, r):
        probs = torch.softmax(x @ gate.weight.detach().t(), -1).double()
        f = torch.bincount(routing.expert_ids.reshape(-1), minlength=8).double() / routing.expert_ids.numel()
        weight = (1 / 8) / ((1 - r) / 8 + r * target)
        return 8 * (weight * f * probs.mean(0)).sum()

    for calls in range(6):
        r = gate(x)
        want = by_hand(r, min(calls / 4, 1.0))
        assert torch.allclose(r.aux_losses["balance"].double(), want, rtol=1e-5), calls
    assert int(gate.warmup_calls) == 6
    gate.eval()
    gate(x)
    assert int(gate.warmup_calls) == 6                     # evaluation does not advance the warm-up
    # the count is saved with the model (a resumed run continues the ramp); without a warm-up nothing is added
    assert "warmup_calls" in gate.state_dict() and "warmup_calls" not in _warmup_gate(0).state_dict()
    gate.half()
    assert gate.warmup_calls.dtype == torch.int64


def test_warmup_starts_the_later_choice_prior_at_zero():
    torch.manual_seed(1)
    probs = torch.softmax(torch.randn(2048, 8), -1)
    gate = _warmup_gate(10, bias=1.0)
    plain = torch.topk(probs, 2, dim=-1).indices
    assert torch.equal(gate.select(None, probs)[0], plain)           # call 0: no prior yet
    gate.warmup_calls.fill_(10)
    ramped = gate.select(None, probs)[0]
    assert torch.equal(ramped, _warmup_gate(0, bias=1.0).select(None, probs)[0])
    assert (ramped[:, 1] >= 4).double().mean() < 0.5 * (plain[:, 1] >= 4).double().mean()
