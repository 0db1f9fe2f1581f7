"""Topology-aware routing on the aux-loss-free family: TA-MoE's target steered by a per-sender bias, and
node-limited routing with the nodes taken from the topology (gates/ta_moe.py, gates/node_limited.py)."""
import itertools

import pytest
import torch

from megamoe_plugin.config import ConfigError, MoEConfig
from megamoe_plugin.gate_sync import rank_state, rank_state_for, load_rank_state
from megamoe_plugin.gates import build_gate, gate_warnings
from megamoe_plugin.gates import ta_moe as ta_moe_gate
from megamoe_plugin.gates.balance import end_global_batch, end_sender_batches
from megamoe_plugin.parallel import ExpertParallel

TWO_BY_TWO = dict(num_experts=8, top_k=2, world_size=4, topology="[[0,1],[2,3]]", topology_bandwidth_gbps="4,1",
                  topology_latency_us="0,0", score_function="sigmoid", router_expert_bias=True,
                  load_balancing_type="none")


@pytest.fixture(autouse=True)
def unsmoothed_target(monkeypatch):
    """The gates of this file steer toward the unsmoothed target pattern (exact shares by hand)."""
    monkeypatch.setattr(ta_moe_gate, "SMOOTHING", 0.0)


def _bias_gates(rate=1e-3, hidden=32, **over):
    """Four senders (ranks 0-3 of one EP group) with one router weight and one shared expert bias, as on four
    data-parallel ranks after the bias's all-reduce."""
    gates = []
    for me in range(4):
        cfg = MoEConfig(gate="ta_moe", router_bias_update_rate=rate, **{**TWO_BY_TWO, **over})
        g = build_gate(cfg, hidden, ep=ExpertParallel.layout(me, [0, 1, 2, 3]))
        g.train()
        if gates:
            g.weight.data.copy_(gates[0].weight.data)
            g.expert_bias = gates[0].expert_bias                      # one replicated buffer
            g.local_tokens_per_expert = gates[0].local_tokens_per_expert
        gates.append(g)
    return gates


def _rank_shares(ids, experts_per_rank=2, ranks=4):
    return torch.bincount(ids.flatten() // experts_per_rank, minlength=ranks).float() / ids.numel()


def test_sender_bias_moves_each_senders_dispatch_to_the_papers_uneven_pattern():
    # paper 002 Table 1: on [[0,1],[2,3]] with a 4:1 bandwidth ratio, device 0 sends 1/4 to itself, 1/2 to its
    # node neighbour and 1/8 to each remote device
    torch.manual_seed(0)
    gates = _bias_gates()
    expected = torch.tensor([0.25, 0.5, 0.125, 0.125])
    first, late, load = None, [], []
    for step in range(200):
        shares = []
        for g in gates:
            r = g(torch.randn(256, 32))
            shares.append(_rank_shares(r.expert_ids))
        if first is None:
            first = shares[0]
        if step >= 150:
            late.append(shares[0])
            load.append(sum(shares) / 4)
        end_global_batch(gates[:1])                  # the shared expert bias moves once
        end_sender_batches(gates[1:])                # every sender's own bias
    late = torch.stack(late).mean(0)
    assert (first - expected).abs().max() > 0.15     # the router alone sends about evenly
    assert (late - expected).abs().max() < 0.04, late
    # senders meeting their rows load every rank equally (the pattern is doubly stochastic)
    assert (torch.stack(load).mean(0) - 0.25).abs().max() < 0.03
    # the sender bias favours the neighbour and penalises the remote ranks
    b = gates[0].sender_bias
    assert b[1] > b[0] > b[2] and b[0] > b[3] and abs(float(b.sum())) < 1e-5


def test_sender_bias_chooses_only_the_combine_weights_stay_the_scores():
    gate = _bias_gates()[0]
    gate.sender_bias.copy_(torch.tensor([0.0, 5.0, -5.0, -5.0]))
    x = torch.randn(64, 32)
    r = gate(x)
    assert (r.expert_ids // 2 == 1).all()            # the bias decided: every choice on rank 1
    scores = torch.sigmoid(x @ gate.weight.t())
    chosen = scores.gather(1, r.expert_ids)
    torch.testing.assert_close(r.weights, chosen / chosen.sum(-1, keepdim=True))
    gate.sender_bias.zero_()
    r0 = gate(x)
    assert not torch.equal(r0.expert_ids, r.expert_ids)


def test_sender_bias_is_per_rank_checkpoint_state():
    gates = _bias_gates()
    gates[2].sender_bias.copy_(torch.tensor([0.1, -0.2, 0.3, -0.2]))
    saved = [rank_state(g) for g in gates]
    fresh = _bias_gates()[2]
    load_rank_state(fresh, rank_state_for(saved, 2, 4))
    torch.testing.assert_close(fresh.sender_bias, torch.tensor([0.1, -0.2, 0.3, -0.2]))
    # another world size: the rows no longer apply, the bias starts from 0 (the gate weights still load)
    other = _bias_gates()[2]
    other.weight.data.zero_()
    load_rank_state(other, rank_state_for(saved[:2], 2, 4))
    assert float(other.sender_bias.abs().sum()) == 0.0
    assert float(other.weight.detach().abs().sum()) > 0
    assert "sender_bias" not in fresh.state_dict()          # not in the replicated state dict


def test_ta_moe_by_bias_needs_no_loss_and_syncs_its_gate_gradients():
    cfg = MoEConfig(gate="ta_moe", **TWO_BY_TWO)
    assert cfg.gate_sync_mode == ("all", 0) and cfg.per_rank_gate_state
    assert MoEConfig(gate="ta_moe", num_experts=8, world_size=4, topology="[[0,1],[2,3]]").gate_sync_mode[0] == "local"


def _node_gate(name, topology, M, k=2, E=8, rank=0):
    cfg = MoEConfig(gate=name, num_experts=E, top_k=k, group_topk=M, world_size=4, topology=topology,
                    score_function="sigmoid")
    return build_gate(cfg, 16, ep=ExpertParallel.layout(rank, [0, 1, 2, 3]))


def _nodes_used(ids, expert_node):
    return torch.tensor([len(set(expert_node[e] for e in row)) for row in ids.tolist()])


@pytest.mark.parametrize("name", ["node_limited", "node_limited_sender"])
@pytest.mark.parametrize("topology,node_of_rank", [("[[0,1],[2,3]]", [0, 0, 1, 1]), ("[[0,1],[2],[3]]", [0, 0, 1, 2])])
def test_node_limited_never_uses_more_than_m_nodes(name, topology, node_of_rank):
    expert_node = [node_of_rank[e // 2] for e in range(8)]
    for M, k, rank in itertools.product([1, 2], [2, 4], [0, 2]):
        if name == "node_limited_sender" and M == 1 and k == 4 and node_of_rank.count(node_of_rank[rank]) == 1:
            continue                               # a one-rank node holds 2 experts: refused below
        if name == "node_limited" and M == 1 and k == 4 and topology != "[[0,1],[2,3]]":
            continue
        gate = _node_gate(name, topology, M, k, rank=rank)
        ids = gate(torch.randn(300, 16)).expert_ids
        used = _nodes_used(ids, expert_node)
        assert int(used.max()) <= M
        assert ids.unique(dim=1).shape[1] == k      # k distinct experts per token
        if name == "node_limited_sender" and M == 1:
            assert all(expert_node[e] == node_of_rank[rank] for e in ids.flatten().tolist())


def test_node_limited_picks_deepseeks_nodes_and_the_sender_rule_its_own():
    gate = _node_gate("node_limited", "[[0,1],[2],[3]]", M=1, rank=0)
    sender = _node_gate("node_limited_sender", "[[0,1],[2],[3]]", M=1, rank=0)
    sender.weight.data.copy_(gate.weight.data)
    x = torch.randn(200, 16)
    scores = torch.sigmoid(x @ gate.weight.t())
    # by hand: experts 0-3 on node 0, 4-5 on node 1, 6-7 on node 2; a node scores its best two (k / M = 2)
    nodes = [[0, 1, 2, 3], [4, 5], [6, 7]]
    ids, ids_sender = gate(x).expert_ids, sender(x).expert_ids
    for t in range(200):
        node_score = [sorted(scores[t, n].tolist())[-2:] for n in nodes]
        best = max(range(3), key=lambda i: sum(node_score[i]))
        expect = sorted(nodes[best], key=lambda e: -scores[t, e])[:2]
        assert ids[t].tolist() == expect
        assert ids_sender[t].tolist() == sorted(nodes[0], key=lambda e: -scores[t, e])[:2]


def test_node_limited_options_are_checked_before_any_model():
    with pytest.raises(ConfigError, match="--moe-num-groups"):
        MoEConfig(gate="node_limited", num_groups=2, group_topk=1, world_size=4, topology="[[0,1],[2,3]]")
    with pytest.raises(ConfigError, match="--moe-group-topk"):
        MoEConfig(gate="node_limited", group_topk=-1, world_size=4, topology="[[0,1],[2,3]]")
    default = build_gate(MoEConfig(gate="node_limited_sender", world_size=4, topology="[[0,1],[2,3]]"), 16,
                         ep=ExpertParallel.layout(3, [0, 1, 2, 3]))
    assert default.node_limit == 1 and (default(torch.randn(50, 16)).expert_ids >= 4).all()   # M = 1 by default
    cfg = MoEConfig(gate="node_limited_sender", top_k=4, group_topk=1, world_size=4, topology="[[0,1],[2],[3]]")
    with pytest.raises(ConfigError, match="--moe-group-topk=1"):
        gate_warnings(cfg)
    one_node = MoEConfig(gate="node_limited", group_topk=1, world_size=4, topology="[0,1,2,3]")
    assert "one node" in gate_warnings(one_node)[0]


# --- end to end: megamoe train on 4 gloo ranks ------------------------------------------------------------------
TINY = ["--hidden", "64", "--layers", "2", "--heads", "2", "--ffn-hidden", "128", "--seq-len", "64",
        "--batch-size", "4", "--corpus-bytes", "300000", "--threads", "1", "--eval-interval", "0",
        "--eval-batches", "2", "--log-interval", "1", "--moe-every", "1", "--moe-num-experts", "8",
        "--moe-top-k", "2", "--moe-expert-parallel-size", "4", "--moe-topology", "[[0,1],[2,3]]",
        "--moe-topology-bandwidth-gbps", "4,1", "--moe-score-function", "sigmoid", "--moe-router-expert-bias",
        "--moe-load-balancing-type", "none", "--moe-router-bias-update-rate", "0.05"]


def _train_worker(rank, world, argv, out):
    import json
    import os
    from megamoe_plugin import train
    from megamoe_plugin.layer import moe_layers
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    res = train.main(argv)
    gate = moe_layers(res.model)[0].gate
    bias = gate.sender_bias.tolist() if hasattr(gate, "sender_bias") else None
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump({"loss": {h["step"]: h["loss"] for h in res.history}, "sender_bias": bias}, f)


def _train(tmp_path, tag, *argv):
    import json
    from conftest import run_distributed
    out = str(tmp_path / tag)
    run_distributed(_train_worker, 4, [*TINY, "--corpus-cache", str(tmp_path / "corpus"), *argv], out)
    return [json.load(open(f"{out}.rank{r}")) for r in range(4)]


@pytest.mark.slow
def test_megamoe_train_steers_by_sender_bias_and_resumes_it_exactly(tmp_path, single_process):
    ck = str(tmp_path / "ck")
    full = _train(tmp_path, "full", "--moe-gate", "ta_moe", "--steps", "8")
    biases = [torch.tensor(r["sender_bias"]) for r in full]
    # the senders favour their node neighbour (rank r ^ 1, target 1/2) over the remote ranks (1/8 each)
    margin = [float(b[r ^ 1] - b[[q for q in range(4) if q // 2 != r // 2]].mean()) for r, b in enumerate(biases)]
    assert sum(margin) / 4 > 0.05 and sum(m > 0 for m in margin) >= 3, biases
    _train(tmp_path, "first", "--moe-gate", "ta_moe", "--steps", "8", "--save", ck, "--exit-interval", "4")
    resumed = _train(tmp_path, "resumed", "--moe-gate", "ta_moe", "--steps", "8", "--resume", ck)
    assert sorted(resumed[0]["loss"]) == ["5", "6", "7", "8"]
    for step in ("5", "6", "7", "8"):         # the routing after the resume is the uninterrupted run's
        assert resumed[0]["loss"][step] == pytest.approx(full[0]["loss"][step], rel=1e-6)
    for a, b in zip(full, resumed):
        assert a["sender_bias"] == pytest.approx(b["sender_bias"], abs=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("gate", [["node_limited_sender", "--moe-group-topk", "1"], ["ta_moe"]])
def test_megamoe_train_with_placement_and_dynamic_capacity(tmp_path, single_process, gate):
    runs = _train(tmp_path, "run", "--moe-gate", *gate, "--steps", "6", "--moe-placement", "flexmoe",
                  "--moe-placement-interval", "2", "--moe-dispatch", "capacity", "--moe-capacity-policy", "dynamic")
    losses = [v for r in runs for v in r["loss"].values()]
    assert len(runs[0]["loss"]) == 6 and all(v == v and v < 20 for v in losses)
    if gate[0] == "ta_moe":                  # the kept assignments moved each sender's bias
        assert all(any(abs(v) > 0 for v in r["sender_bias"]) for r in runs)


def test_sender_bias_stays_fp32_when_the_model_is_cast():
    gate = _bias_gates()[0]
    gate.sender_bias.copy_(torch.tensor([0.0, 1e-3, -2e-3, 1e-3]))
    gate.to(torch.bfloat16)                   # as Megatron's Float16Module casts buffers
    gate(torch.randn(8, 32, dtype=torch.bfloat16))
    assert gate.sender_bias.dtype == torch.float32 and gate.rank_target.dtype == torch.float32
