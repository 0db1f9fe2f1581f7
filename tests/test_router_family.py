"""The core router family on known answers (no Megatron: tests/test_megatron_router_parity.py compares with
megatron-core itself): the expert bias chooses but does not weight; group-limited routing stays in its groups; the
sign update of the bias; drop policies; padding; the per-sequence loss of one sequence is the micro-batch loss."""
import pytest
import torch

from megamoe_plugin import MoEConfig, MoELayer
from megamoe_plugin.config import ConfigError
from megamoe_plugin.gates import build_gate
from megamoe_plugin.gates.balance import end_global_batch
from megamoe_plugin.gates.base import TokenBatch
from megamoe_plugin.gates.capacity import apply_capacity

H = 16


def _gate(**kw):
    torch.manual_seed(0)
    return build_gate(MoEConfig(**kw), H).train()


def test_expert_bias_chooses_but_never_weights():
    g = _gate(num_experts=8, top_k=2, score_function="sigmoid", router_expert_bias=True)
    x = torch.randn(64, H)
    with torch.no_grad():
        g.expert_bias[3] = 10.0                   # every token must now choose expert 3
    r = g(x)
    assert bool((r.expert_ids == 3).any(dim=1).all())
    s = torch.sigmoid(x @ g.weight.t())           # the weights are the unbiased scores, renormalised
    chosen = s.gather(1, r.expert_ids)
    torch.testing.assert_close(r.weights, chosen / chosen.sum(1, keepdim=True))


def test_group_limited_routing_stays_in_the_best_groups():
    g = _gate(num_experts=16, top_k=4, score_function="sigmoid", num_groups=4, group_topk=2)
    x = torch.randn(200, H)
    r = g(x)
    groups = r.expert_ids // 4
    assert max(len(set(row.tolist())) for row in groups) <= 2
    s = torch.sigmoid(x @ g.weight.t()).view(200, 4, 4)
    best_groups = s.topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices      # sum of each group's top-2
    for t in range(200):
        allowed = s[t, best_groups[t]].flatten()
        assert sorted(s[t].flatten()[r.expert_ids[t]].tolist()) == sorted(allowed.topk(4).values.tolist())


def test_bias_update_is_the_sign_of_the_load_error():
    g = _gate(num_experts=4, top_k=1, score_function="sigmoid", router_expert_bias=True, router_bias_update_rate=0.5)
    with torch.no_grad():
        g.local_tokens_per_expert.copy_(torch.tensor([4.0, 0.0, 2.0, 2.0]))
    end_global_batch([g])
    assert g.expert_bias.tolist() == [-0.5, 0.5, 0.0, 0.0]
    assert g.local_tokens_per_expert.tolist() == [0.0] * 4            # a new global batch counts afresh


def test_bias_counts_training_tokens_only():
    g = _gate(num_experts=4, top_k=2, score_function="sigmoid", router_expert_bias=True)
    g(torch.randn(10, H))
    assert g.local_tokens_per_expert.sum().item() == 20
    g.eval()
    g(torch.randn(10, H))
    with torch.no_grad():
        g.train()
        g(torch.randn(10, H))
    assert g.local_tokens_per_expert.sum().item() == 20


def test_drop_policies_keep_what_they_promise():
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [0, 3]])
    kept = torch.ones_like(ids, dtype=torch.bool)
    w = torch.tensor([[0.1, 0.9], [0.7, 0.3], [0.4, 0.6], [0.8, 0.2]])
    cap = [2, 2, 2, 2]
    probs, _ = apply_capacity(ids, kept, cap, "probs", w)
    assert probs[:, 0].tolist() == [False, True, False, True]          # expert 0 keeps its two highest weights
    choice, _ = apply_capacity(ids, kept, [1, 1, 1, 1], "choice")
    assert choice.tolist() == [[True, True], [False, True], [False, False], [False, True]]


def test_padding_counts_in_no_loss():
    cfg = dict(num_experts=4, top_k=2, load_balancing_type="aux_loss:0.1,seq_aux_loss:0.1", z_loss_coeff=0.1)
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(**cfg), H, 32, sequence_layout="bs")
    x = torch.randn(2, 6, H)
    pad = torch.zeros(12, dtype=torch.bool)
    pad[4:6] = True
    layer(x, padding=pad)
    with_pad = {k: v.item() for k, v in layer.aux_losses.items()}
    layer(x, padding=pad, select=None)
    x2 = x.clone()
    x2[0, 4:] = torch.randn(2, H) * 5                    # padding tokens changed: no loss may move
    layer(x2, padding=pad)
    assert {k: v.item() for k, v in layer.aux_losses.items()} == pytest.approx(with_pad)
    layer(x2)
    assert layer.aux_losses["z"].item() != pytest.approx(with_pad["z"])


def test_sequence_loss_of_one_sequence_is_the_micro_batch_loss():
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(num_experts=8, top_k=2, load_balancing_type="aux_loss:0.01,seq_aux_loss:0.01"),
                     H, 32, sequence_layout="bs")
    layer(torch.randn(1, 20, H))
    torch.testing.assert_close(layer.aux_losses["balance"], layer.aux_losses["seq_balance"])
    layer(torch.randn(4, 20, H))                              # four sequences: the mean of four losses
    assert layer.aux_losses["seq_balance"] > layer.aux_losses["balance"]


def test_token_batch_layouts():
    sb = TokenBatch.from_shape((3, 2), "sb")
    bs = TokenBatch.from_shape((2, 3), "bs")
    assert sb.sequence_of.tolist() == [0, 1, 0, 1, 0, 1] and bs.sequence_of.tolist() == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("kw,flag", [
    (dict(router_expert_bias=True), "--moe-router-expert-bias"),
    (dict(num_groups=4), "--moe-group-topk"),
    (dict(load_balancing_type="sinkhorn:0.1"), "--moe-load-balancing-type"),
    (dict(load_balancing_type="quantile_balancing", dispatch="capacity"), "--moe-load-balancing-type"),
    (dict(gate="gshard", score_function="sigmoid"), "--moe-second-expert-policy"),
    (dict(probs_on_input=True, top_k=2), "--moe-probs-on-input"),
    (dict(activation_clamp=7.0), "--moe-activation-clamp"),
    (dict(load_balancing_type="aux_loss,bogus"), "unknown type 'bogus'"),
])
def test_router_options_that_cannot_be_honoured_name_their_flag(kw, flag):
    with pytest.raises(ConfigError, match=flag):
        MoEConfig(num_experts=8, **kw)


def test_expert_bias_stays_fp32_through_a_cast_and_a_checkpoint():
    g = _gate(num_experts=4, top_k=2, score_function="sigmoid", router_expert_bias=True)
    with torch.no_grad():
        g.expert_bias.copy_(torch.tensor([1e-3, -2e-3, 3.0e-3, 0.0]))
    saved = {k: v.clone() for k, v in g.state_dict().items()}
    g = g.to(torch.bfloat16)                       # what a bf16 model wrapper does to buffers
    g.load_state_dict(saved)
    assert g.expert_bias.dtype == torch.float32 and torch.equal(g.expert_bias, saved["expert_bias"])
    assert g.state_dict()["expert_bias"].dtype == torch.float32


@pytest.mark.parametrize("gate,extra", [("switch", dict(top_k=1)), ("gshard", dict(second_expert_policy="all")),
                                        ("hir", dict(world_size=2, topology="[[0],[1]]")),
                                        ("ta_moe", dict(world_size=2, topology="[[0],[1]]",
                                                        topology_bandwidth_gbps="100,10"))])
def test_every_gate_composes_with_the_router_family(gate, extra):
    """sigmoid scores, the expert bias and the per-sequence loss under each of the plugin's gates: the gate's own
    loss stays its aux_loss, the per-sequence loss is megatron-core's, the bias counts every kept assignment."""
    cfg = MoEConfig(num_experts=4, gate=gate, score_function="sigmoid", router_expert_bias=True,
                    load_balancing_type="aux_loss:0.01,seq_aux_loss:0.001", **{"top_k": 2, **extra})
    torch.manual_seed(0)
    layer = MoELayer(cfg, H, 32).train()
    y = layer(torch.randn(3, 8, H))
    (y.sum() + layer.aux_loss).backward()
    assert set(layer.aux_losses) == {"balance", "seq_balance"}
    assert layer.gate.weight.grad.abs().sum() > 0
    assert layer.gate.local_tokens_per_expert.sum().item() == int(layer.last_routing.kept.sum())
