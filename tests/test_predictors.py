"""MoE-of-predictors heads (megamoe_plugin.dynamic.predictors): Eq. 1 / Eq. 2 by hand, the gradient independence of
the specification loss, hierarchical flattening, experts on their own tokens only, and the Figure 7 example."""
import importlib.util
import math
import os

import pytest
import torch

from megamoe_plugin.dynamic.predictors import (ExpertPredictions, PredictorMoE, aggregate, cooperation_loss,
                                               flatten_nested, hierarchical, log_aggregate, moe_predictor_loss,
                                               specification_loss)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tiny_case(seed=0, T=4, k=3, C=5):
    g = torch.Generator().manual_seed(seed)
    O = torch.randn(T, k, C, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.rand(T, k, generator=g, dtype=torch.float64) + 0.1
    w = (w / w.sum(1, keepdim=True)).detach().requires_grad_(True)
    y = torch.randint(0, C, (T,), generator=g)
    y[1] = -100                                  # one ignored token: the mean is over the other T - 1
    return O, w, y


def _hand_spec(O, w, y):
    """Eq. 2 with explicit loops: (1/N) sum_t sum_i g_ti * CE(y_t, O_ti), CE = log sum_c exp(O_tic) - O_ti,y."""
    total, n = 0.0, 0
    for t in range(O.shape[0]):
        if int(y[t]) == -100:
            continue
        n += 1
        for i in range(O.shape[1]):
            ce = torch.log(torch.exp(O[t, i]).sum()) - O[t, i, int(y[t])]
            total = total + w[t, i] * ce
    return total / n


def _hand_coop(O, w, y):
    """Eq. 1 with explicit loops: (1/N) sum_t -log sum_i g_ti * exp(O_ti,y) / sum_c exp(O_tic)."""
    total, n = 0.0, 0
    for t in range(O.shape[0]):
        if int(y[t]) == -100:
            continue
        n += 1
        mix = 0.0
        for i in range(O.shape[1]):
            mix = mix + w[t, i] * torch.exp(O[t, i, int(y[t])]) / torch.exp(O[t, i]).sum()
        total = total - torch.log(mix)
    return total / n


def _preds(O, w):
    return ExpertPredictions(O, w, torch.arange(O.shape[1]).expand(O.shape[0], -1))


def test_specification_loss_gradient_matches_eq2_by_hand():
    O, w, y = _tiny_case()
    loss = specification_loss(_preds(O, w), y)
    hand = _hand_spec(O, w, y)
    torch.testing.assert_close(loss, hand, rtol=1e-12, atol=1e-12)
    gO, gw = torch.autograd.grad(loss, (O, w))
    hO, hw = torch.autograd.grad(hand, (O, w))
    torch.testing.assert_close(gO, hO, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gw, hw, rtol=1e-10, atol=1e-12)
    # analytic: d/dO_ti = g_ti (softmax(O_ti) - onehot(y_t)) / N, d/dg_ti = CE_ti / N; 0 for the ignored token
    valid = y != -100
    N = int(valid.sum())
    yv = torch.where(valid, y, 0)
    onehot = torch.nn.functional.one_hot(yv, O.shape[2]).to(O.dtype).unsqueeze(1)
    sm = torch.softmax(O.detach(), -1)
    ce = -torch.log_softmax(O.detach(), -1).gather(2, yv.view(-1, 1, 1).expand(-1, O.shape[1], 1)).squeeze(2)
    m = valid.to(O.dtype)
    torch.testing.assert_close(gO, m.view(-1, 1, 1) * w.detach().unsqueeze(-1) * (sm - onehot) / N)
    torch.testing.assert_close(gw, m.view(-1, 1) * ce / N)
    assert gO[1].abs().max() == 0 and gw[1].abs().max() == 0         # the ignored token


def test_cooperation_loss_value_and_gradient_match_eq1_by_hand():
    O, w, y = _tiny_case(seed=1)
    p = _preds(O, w)
    loss = cooperation_loss(p, y)
    hand = _hand_coop(O, w, y)
    torch.testing.assert_close(loss, hand, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(loss, (O, w)), torch.autograd.grad(hand, (O, w))):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # the aggregate is the mixture sum_i g_i softmax(O_i): a distribution (weights sum to 1), its log by logsumexp
    mix = sum(w[:, i, None] * torch.softmax(O[:, i], -1) for i in range(O.shape[1]))
    torch.testing.assert_close(aggregate(p), mix)
    torch.testing.assert_close(aggregate(p).sum(-1), torch.ones(O.shape[0], dtype=O.dtype))
    torch.testing.assert_close(log_aggregate(p), torch.log(mix))
    # and the two losses differ (Jensen: coop <= spec when the weights sum to 1)
    assert loss.item() < specification_loss(p, y).item() - 1e-6


def test_loss_stable_for_extreme_logits_and_zero_weights():
    O = torch.tensor([[[200.0, -200.0], [-300.0, 300.0]]], requires_grad=True)
    w = torch.tensor([[1.0, 0.0]], requires_grad=True)      # second assignment dropped
    y = torch.tensor([1])
    for fn in (cooperation_loss, specification_loss):
        loss = fn(_preds(O, w), y)
        grads = torch.autograd.grad(loss, (O, w))
        assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)
    torch.testing.assert_close(cooperation_loss(_preds(O, w), y), torch.tensor(400.0))


@pytest.mark.parametrize("kind,independent", [("specification", True), ("cooperation", False)])
def test_expert_gradient_depends_on_other_experts_only_under_cooperation(kind, independent):
    O, w, y = _tiny_case(seed=2, k=2)
    y = torch.where(y == -100, 0, y)

    def grad_of_expert0(O_):
        O_ = O_.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(moe_predictor_loss(_preds(O_, w.detach()), y, kind), (O_,))
        return g[:, 0]

    base = grad_of_expert0(O)
    O2 = O.detach().clone()
    O2[:, 1] += torch.randn_like(O2[:, 1]) * 3.0          # perturb expert 1's prediction only
    moved = grad_of_expert0(O2)
    if independent:
        torch.testing.assert_close(moved, base, rtol=0, atol=0)
    else:
        assert (moved - base).abs().max() > 1e-3


def _moe(**kw):
    torch.manual_seed(0)
    return PredictorMoE(6, 7, 4, 2, expert_hidden=5, init_std=0.5, **kw).double()


class _CountingMoE(PredictorMoE):
    """Records how many rows each expert is run on (a real subclass, not a mock)."""

    def expert_forward(self, e, x):
        self.rows_seen[e] = self.rows_seen.get(e, 0) + x.shape[0]
        return super().expert_forward(e, x)


def test_experts_run_only_on_their_assigned_tokens():
    torch.manual_seed(0)
    m = _CountingMoE(6, 7, 4, 2, expert_hidden=5, init_std=0.5).double()
    m.rows_seen = {}
    x = torch.randn(3, 11, 6, dtype=torch.float64)
    p = m(x)
    x2 = x.reshape(-1, 6)
    routing = m.gate(x2)
    torch.testing.assert_close(p.weights, routing.weights)
    assert torch.equal(p.expert_ids, routing.expert_ids)
    # dense reference: every expert on every token, then pick each token's chosen ones
    dense = torch.stack([m.expert_forward(e, x2) for e in range(4)])              # [E, T, C]
    ref = dense[p.expert_ids, torch.arange(x2.shape[0]).unsqueeze(1)]               # [T, k, C]
    torch.testing.assert_close(p.preds, ref)
    counts = torch.bincount(p.expert_ids.flatten(), minlength=4)
    m.rows_seen = {}
    m(x)
    assert [m.rows_seen.get(e, 0) for e in range(4)] == counts.tolist()
    assert sum(m.rows_seen.values()) == x2.shape[0] * 2


def test_fixed_assignment_routes_by_given_ids():
    m = _moe()
    x = torch.randn(9, 6, dtype=torch.float64)
    ids = torch.stack([torch.arange(9) % 4, (torch.arange(9) + 1) % 4], 1)
    p = m(x, assigned=ids)
    assert torch.equal(p.expert_ids, ids)
    ref = torch.stack([torch.stack([m.expert_forward(int(e), x[t:t + 1])[0] for e in ids[t]]) for t in range(9)])
    torch.testing.assert_close(p.preds, ref)


def test_linear_experts_and_losses_backprop_into_gate_and_experts():
    torch.manual_seed(0)
    m = PredictorMoE(6, 7, 4, 2, expert_hidden=0, aux_loss_coeff=0.01).double()
    p = m(torch.randn(10, 6, dtype=torch.float64))
    assert p.preds.shape == (10, 2, 7) and m.aux_loss.item() > 0 and p.aux_loss is m.aux_loss
    (specification_loss(p, torch.randint(0, 7, (10,))) + p.aux_loss).backward()
    assert all(q.grad is not None and q.grad.abs().sum() > 0 for q in m.parameters())


@pytest.mark.parametrize("inner_top_k", [1, 2])
def test_hierarchical_2x2_flattens_to_products_of_outer_and_inner_weights(inner_top_k):
    torch.manual_seed(0)
    h = hierarchical(6, 7, 2, 2, outer_top_k=2, inner_top_k=inner_top_k, expert_hidden=5, init_std=0.5).double()
    x = torch.randn(8, 6, dtype=torch.float64)
    p = h(x)
    T, k1, k2 = 8, 2, inner_top_k
    assert p.preds.shape == (T, k1 * k2, 7)
    outer = h.gate(x)
    inner = [h.inner[e].gate(x) for e in range(2)]          # outer top-2 of 2: every token reaches both inner MoEs
    for t in range(T):
        for i in range(k1):
            e = int(outer.expert_ids[t, i])
            for j in range(k2):
                leaf = i * k2 + j
                f = int(inner[e].expert_ids[t, j])
                torch.testing.assert_close(p.weights[t, leaf], outer.weights[t, i] * inner[e].weights[t, j])
                assert int(p.expert_ids[t, leaf]) == e * 2 + f
                torch.testing.assert_close(p.preds[t, leaf], h.inner[e].expert_forward(f, x[t:t + 1])[0])
    if k2 == 2:                                             # normalised top-k at both levels: leaves sum to 1
        torch.testing.assert_close(p.weights.sum(1), torch.ones(T, dtype=torch.float64))
    # both losses reach the outer gate, the inner gates and the inner experts
    for kind in ("specification", "cooperation"):
        h.zero_grad(set_to_none=True)
        moe_predictor_loss(h(x), torch.randint(0, 7, (T,)), kind).backward()
        named = dict(h.named_parameters())
        for name in ("gate.weight", "inner.0.gate.weight", "inner.1.gate.weight", "inner.0.weights.0",
                     "inner.1.weights.1", "inner.0.biases.1"):
            assert named[name].grad is not None and named[name].grad.abs().sum() > 0, (kind, name)


def test_hierarchical_inner_cooperation_presents_one_prediction_per_inner_moe():
    torch.manual_seed(0)
    h = hierarchical(6, 7, 2, 2, outer_top_k=2, inner_top_k=2, inner_loss="cooperation", expert_hidden=5,
                     init_std=0.5).double()
    x = torch.randn(5, 6, dtype=torch.float64)
    p = h(x)
    outer = h.gate(x)
    assert p.preds.shape == (5, 2, 7) and torch.equal(p.expert_ids, outer.expert_ids)
    torch.testing.assert_close(p.weights, outer.weights)
    for i in range(2):
        sub = h.inner[int(outer.expert_ids[0, i])](x[:1])
        torch.testing.assert_close(p.preds[0, i], log_aggregate(sub)[0])
    # outer specification over the inner mixtures backprops into the inner gates
    specification_loss(p, torch.randint(0, 7, (5,))).backward()
    assert h.inner[0].gate.weight.grad.abs().sum() > 0 and h.gate.weight.grad.abs().sum() > 0


def test_flatten_nested_composes_and_checks_rows():
    g = torch.tensor([[0.25, 0.75]])
    ids = torch.tensor([[1, 0]])
    inner = ExpertPredictions(torch.randn(2, 3, 4), torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]),
                              torch.tensor([[0, 1, 2], [2, 1, 0]]))
    p = flatten_nested(g, ids, inner, 3)
    torch.testing.assert_close(p.weights, torch.tensor([[0.125, 0.075, 0.05, 0.075, 0.075, 0.6]]))
    assert p.expert_ids.tolist() == [[3, 4, 5, 2, 1, 0]]
    torch.testing.assert_close(p.preds[0], inner.preds.reshape(6, 4))
    with pytest.raises(ValueError, match="T\\*k1 = 4"):
        flatten_nested(torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.long), inner, 3)


def test_bad_values_raise_naming_them():
    O, w, y = _tiny_case()
    with pytest.raises(ValueError, match="'bogus'"):
        moe_predictor_loss(_preds(O, w), y, "bogus")
    with pytest.raises(ValueError, match="inner_loss='coop'"):
        hierarchical(6, 7, 2, 2, inner_loss="coop")
    with pytest.raises(ValueError, match="target has 3 elements"):
        specification_loss(_preds(O, w), y[:3])
    with pytest.raises(ValueError, match="activation='tanh'"):
        PredictorMoE(6, 7, 2, activation="tanh")


def test_spec_vs_coop_example_smoke(capsys):
    spec = importlib.util.spec_from_file_location("spec_vs_coop", os.path.join(ROOT, "examples", "dynamic",
                                                                               "spec_vs_coop.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.main(["--steps", "3", "--batch", "32", "--max-bytes", "200000", "--eval-tokens", "300",
                     "--hidden", "32", "--expert-hidden", "16"])
    out = capsys.readouterr().out
    assert "measured here on CPU" in out
    runs = {(r["run"], r["gate"], r["loss"]) for r in rows}
    assert runs == {("flat E=8 k=2", g, l) for g in ("learned", "fixed") for l in ("specification", "cooperation")} | {
        ("hier 2x4 k=2x2", "learned", "specification"), ("hier 2x4 k=2x2", "learned", "inner coop + outer spec")}
    for r in rows:
        assert all(math.isfinite(r[c]) for c in ("nll", "bits", "spec", "acc", "load", "seconds")), r
        assert 0.0 <= r["acc"] <= 1.0 and r["nll"] > 0
        assert f"{r['nll']:.4f}" in out
    assert len([line for line in out.splitlines() if line.startswith(("flat", "hier"))]) == 6
