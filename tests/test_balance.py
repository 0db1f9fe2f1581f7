"""Expert load balancing (paper 004 §VII): greedy and anti-correlation placements on hand-made and skewed traces,
Max Load / Avg Max Load, placement files, expert permutations that leave real MoE layers' outputs unchanged (EP=1,
EP=2 on gloo, the Megatron adapter's layer), and the `megamoe balance` CLI."""
import importlib.util
import json
import types

import numpy as np
import pytest
import torch
import torch.distributed as dist

from conftest import run_distributed
from megamoe_plugin import MoEConfig, MoELayer
from megamoe_plugin.inference.balance import (PlacementFileError, anticorrelation_placement,
                                              apply_expert_permutation, apply_placement_file, avg_max_load,
                                              evaluate_placements, greedy_placement, identity_placement, max_load,
                                              perm_to_placement, placement_to_perm, read_placement_file,
                                              write_placement_file)


# --- placements and metrics on hand-made data ------------------------------------------------------------------------
def test_max_load_and_avg_max_load_by_hand():
    loads = np.array([[3, 1, 0, 0],        # identity: device 0 = {0, 1} gets 4/4
                      [1, 1, 1, 1],        # 2/4 each
                      [0, 0, 0, 0]])       # no tokens: skipped
    assert max_load(loads, [0, 0, 1, 1], 2) == pytest.approx(1.0)
    assert avg_max_load(loads, [0, 0, 1, 1], 2) == pytest.approx(0.75)
    # {0, 2} / {1, 3}: batch 0 -> 3/4, batch 1 -> 1/2
    assert max_load(loads, [0, 1, 0, 1], 2) == pytest.approx(0.75)
    assert avg_max_load(loads, [0, 1, 0, 1], 2) == pytest.approx(0.625)
    with pytest.raises(ValueError, match="every device"):
        max_load(loads, [0, 0, 0, 1], 2)


def test_greedy_by_hand():
    # constant shares 0.4, 0.3, 0.2, 0.1: 0 -> d0, 1 -> d1 (0 < 0.4), 2 -> d1 (0.3 < 0.4), d1 full, 3 -> d0
    loads = np.tile([40, 30, 20, 10], (6, 1))
    assert greedy_placement(loads, 2) == [0, 1, 1, 0]
    # 8 experts, 4 devices, descending order 7..0: 7, 6, 5, 4 one per device, then 3 -> device of 4 (lightest) ...
    loads8 = np.tile(np.arange(1, 9), (3, 1))
    dev = greedy_placement(loads8, 4)
    assert dev == [0, 1, 2, 3, 3, 2, 1, 0]           # pairs (7,0), (6,1), (5,2), (4,3): 9 each
    assert max_load(loads8, dev, 4) == pytest.approx(9 / 36)


# two batch types: in A experts 0 and 3 are busy, in B experts 1 and 2. Averages 0.30, 0.28, 0.22, 0.20.
CORRELATED = np.array([[40, 18, 12, 30], [20, 38, 32, 10]] * 5)


def test_anticorrelation_by_hand():
    # greedy (averages only): 0 -> d0, 1 -> d1, 2 -> d1 (0.28 < 0.30), 3 -> d0: the busy-together pairs share a device
    assert greedy_placement(CORRELATED, 2) == [0, 1, 1, 0]
    assert max_load(CORRELATED, [0, 1, 1, 0], 2) == pytest.approx(0.70)
    assert avg_max_load(CORRELATED, [0, 1, 1, 0], 2) == pytest.approx(0.70)
    # anti-correlation: shares alternate between two values, so every Pearson correlation is +-1; S_01 = -1.
    # 0 -> d0; 1: d0 = 0.30 + 0.5 * (-1) = -0.2 < d1 = 0 -> d0 (full); 2, 3 -> d1
    dev = anticorrelation_placement(CORRELATED, 2)
    assert dev == [0, 0, 1, 1]
    assert max_load(CORRELATED, dev, 2) == pytest.approx(0.58)
    assert avg_max_load(CORRELATED, dev, 2) == pytest.approx(0.58)
    # weight 0 is the greedy rule
    assert anticorrelation_placement(CORRELATED, 2, weight=0.0) == [0, 1, 1, 0]


def _zipf_loads(seed, B=200, E=16, tokens=512, skew=1.2):
    """Per-batch token counts with Zipf-like popularity, the most popular experts having the lowest ids, so the
    identity placement (contiguous blocks) puts them all on device 0 (the paper's imbalance)."""
    rng = np.random.default_rng(seed)
    pop = 1.0 / np.arange(1, E + 1) ** skew
    out = np.zeros((B, E))
    for b in range(B):
        p = pop * rng.lognormal(0.0, 0.3, E)       # per-batch fluctuation
        out[b] = rng.multinomial(tokens, p / p.sum())
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("devices", [2, 4])
def test_balancing_skewed_trace_never_worse_than_identity(seed, devices):
    loads = _zipf_loads(seed)
    E = loads.shape[1]
    res = evaluate_placements(loads, devices)
    test = loads[len(loads) // 2:]
    # identity's held-out Max Load computed here: share of experts 0..E/D-1 etc., max over batches
    per = E // devices
    ident = np.stack([test[:, d * per:(d + 1) * per].sum(1) for d in range(devices)], 1) / test.sum(1, keepdims=True)
    assert res["identity"]["max_load"] == pytest.approx(ident.max())
    assert res["identity"]["avg_max_load"] == pytest.approx(ident.max(1).mean())
    for name in ("greedy", "anticorrelation"):
        dev = res[name]["placement"]
        assert np.bincount(dev, minlength=devices).tolist() == [per] * devices
        assert res[name]["max_load"] <= res["identity"]["max_load"]
        assert res[name]["avg_max_load"] <= res["identity"]["avg_max_load"]
        assert res[name]["max_load"] >= 1.0 / devices - 1e-12
    # the paper's effect: greedy cuts the worst device's share substantially
    assert res["greedy"]["avg_max_load"] < 0.8 * res["identity"]["avg_max_load"]


# --- permutations and placement files -----------------------------------------------------------------------------
def test_placement_perm_conversion():
    # device 0 gets experts {1, 3}, device 1 gets {0, 2}: slots 0, 1 on device 0 hold 1, 3
    assert placement_to_perm([1, 0, 1, 0], 2) == [1, 3, 0, 2]
    assert perm_to_placement([1, 3, 0, 2], 2) == [1, 0, 1, 0]
    assert identity_placement(6, 3) == [0, 0, 1, 1, 2, 2]
    assert placement_to_perm(identity_placement(6, 3), 3) == list(range(6))
    with pytest.raises(ValueError, match="permutation"):
        perm_to_placement([0, 0, 1, 2], 2)


def test_placement_file_round_trip_and_errors(tmp_path):
    path = str(tmp_path / "p.json")
    write_placement_file(path, {3: [1, 3, 0, 2], 7: [0, 1, 2, 3]}, {"num_devices": 2, "method": "greedy"})
    pf = read_placement_file(path, num_experts=4)
    assert pf.layers == {3: [1, 3, 0, 2], 7: [0, 1, 2, 3]} and pf.meta["num_devices"] == 2
    assert pf.num_experts == 4 and pf.perm(3) == [1, 3, 0, 2] and pf.perm(4) is None
    assert json.load(open(path))["schema"] == "megamoe-placement/1"

    def bad(obj, needle, **kw):
        p = tmp_path / "bad.json"
        p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
        with pytest.raises(PlacementFileError) as err:
            read_placement_file(str(p), **kw)
        assert "--moe-placement-file" in str(err.value) and str(p) in str(err.value)
        assert needle in str(err.value), str(err.value)

    good = {"schema": "megamoe-placement/1", "num_experts": 4, "layers": {"0": [1, 0, 3, 2]}}
    bad("{not json", "not valid JSON")
    bad(dict(good, schema="megamoe-placement/0"), "schema")
    bad(dict(good, layers={"0": [0, 0, 1, 2]}), "not a permutation")
    bad(dict(good, layers={"0": [0, 1, 2]}), "not a permutation")
    bad(dict(good, layers={"x": [0, 1, 2, 3]}), "not an integer")
    bad(dict(good, layers={"0": [0, 1, 2, True]}), "integer expert ids")
    bad(dict(good, layers={}), "non-empty")
    bad(dict(good, num_experts="4"), "num_experts")
    bad(good, "the model has 8", num_experts=8)
    with pytest.raises(PlacementFileError, match="no such file"):
        read_placement_file(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="permutation"):
        write_placement_file(path, {0: [0, 1, 1, 3]})


# --- applying a permutation to real layers ------------------------------------------------------------------------
GATES = [("switch", 1, "dropless", {"jitter_eps": 0.1}), ("gshard", 2, "dropless", {}),
         ("naive", 3, "dropless", {"z_loss_coeff": 1e-3}), ("gshard", 2, "capacity", {"capacity_factor": 0.7}),
         ("ta_moe", 2, "dropless", {"world_size": 4, "topology": "[[0,1],[2,3]]"})]
PERM = [5, 2, 0, 4, 1, 3]


def _grads(layer, x, seed, train):
    layer.train(train)
    torch.manual_seed(seed)                      # jitter / random routing draw the same numbers before and after
    x = x.clone().requires_grad_()
    y = layer(x)
    layer.zero_grad()
    g = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)
    ((y * g).sum() + layer.aux_loss).backward()
    return y.detach(), x.grad, layer.aux_loss.detach(), layer.last_routing


@pytest.mark.parametrize("gate,k,dispatch,extra", GATES)
def test_permutation_leaves_moelayer_outputs_unchanged(gate, k, dispatch, extra):
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=6, top_k=k, gate=gate, dispatch=dispatch, linear_bias=True, aux_loss_coeff=0.01,
                    **extra)
    layer = MoELayer(cfg, 10, 14).double()
    with torch.no_grad():
        layer.experts.b1.normal_(); layer.experts.b2.normal_()
    x = torch.randn(40, 10, dtype=torch.float64)
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    buffers = {n: b.clone() for n, b in layer.gate.named_buffers()}
    ref = {train: _grads(layer, x, 11, train) for train in (False, True)}
    grads_before = {n: p.grad.clone() for n, p in layer.named_parameters()}

    apply_expert_permutation(layer, PERM)

    idx = torch.tensor(PERM)
    for n, p in layer.named_parameters():       # moved, not copied in place of themselves
        assert torch.equal(p.detach(), before[n][idx]), n
        assert not torch.equal(p.detach(), before[n]), n
    for n, b in layer.gate.named_buffers():      # slot-location buffers (TA-MoE target) stay
        assert torch.equal(b, buffers[n]), n
    inverse = torch.argsort(idx)
    for train in (False, True):
        y, gx, aux, routing = _grads(layer, x, 11, train)
        y0, gx0, aux0, routing0 = ref[train]
        # the gate's probabilities are fp32 (softmax over the permuted columns sums in another order): 1e-6
        assert (y - y0).abs().max() < 1e-6, (gate, train)
        assert (gx - gx0).abs().max() < 1e-6
        assert (aux - aux0).abs() < 1e-6
        assert torch.equal(routing.expert_ids, inverse[routing0.expert_ids])
        assert torch.equal(routing.kept, routing0.kept)
    for n, p in layer.named_parameters():        # the last (train) gradients, permuted like the weights (fp32 sums)
        torch.testing.assert_close(p.grad, grads_before[n][idx], rtol=1e-6, atol=1e-6, msg=n)


def test_permutation_keeps_fixed_capacities_and_applies_by_file(tmp_path):
    torch.manual_seed(1)
    cfg = MoEConfig(num_experts=4, top_k=1, gate="naive", dispatch="capacity")
    model = torch.nn.ModuleDict({"a": MoELayer(cfg, 8, 12, layer_id=0), "b": MoELayer(cfg, 8, 12, layer_id=1)})
    model["a"].set_expert_capacity([1, 3, 0, 5])
    x = torch.randn(30, 8)
    model.eval()
    y0 = [model["a"](x), model["b"](x)]
    w_b = model["b"].experts.w1.detach().clone()
    path = str(tmp_path / "p.json")
    write_placement_file(path, {0: [3, 1, 0, 2]})
    assert apply_placement_file(model, path) == [0]
    assert model["a"].expert_capacity == [5, 3, 1, 0]
    assert torch.equal(model["b"].experts.w1, w_b)                   # layer 1 is not in the file
    assert torch.allclose(model["a"](x), y0[0], atol=1e-6) and torch.allclose(model["b"](x), y0[1])
    write_placement_file(path, {0: [0, 1, 2, 3], 9: [0, 1, 2, 3]})
    with pytest.raises(PlacementFileError, match="layer id"):
        apply_placement_file(model, path)
    assert apply_placement_file(model, read_placement_file(path), strict=False) == [0]
    with pytest.raises(ValueError, match="permutation"):
        apply_expert_permutation(model["a"], [0, 1, 2])


def _ep_permutation(rank, world):
    E = 8
    perm = [6, 1, 7, 0, 3, 5, 2, 4]              # both ranks send and keep some experts
    cfg = MoEConfig(num_experts=E, top_k=2, gate="gshard", world_size=world, expert_parallel_size=world,
                    second_expert_policy="all")
    torch.manual_seed(5)
    layer = MoELayer(cfg, 12, 16, ep_group=dist.group.WORLD).double().eval()
    torch.manual_seed(100 + rank)
    x = torch.randn(25 + 5 * rank, 12, dtype=torch.float64)

    def full(t):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts)

    w1, w2 = full(layer.experts.w1.detach()), full(layer.experts.w2.detach())
    with torch.no_grad():
        y0 = layer(x)
    apply_expert_permutation(layer, perm)
    idx = torch.tensor(perm)
    assert torch.equal(full(layer.experts.w1.detach()), w1[idx])
    assert torch.equal(full(layer.experts.w2.detach()), w2[idx])
    with torch.no_grad():
        y1 = layer(x)
    assert (y1 - y0).abs().max() < 1e-6


def test_permutation_with_expert_parallelism():
    run_distributed(_ep_permutation, 2)


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")
def test_permutation_on_megatron_layer():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megamoe_plugin.megatron_adapter.compat import build_mlp
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megamoe_plugin.inference.balance import moe_layers_by_id
    from megamoe_plugin.megatron_adapter.args import config_from_megatron
    from megamoe_plugin.megatron_adapter.peer import ensure_megatron_parallel_state
    from megamoe_plugin.megatron_adapter.spec import moe_plugin_spec

    ensure_megatron_parallel_state()
    torch.manual_seed(0)
    tc = TransformerConfig(num_layers=2, hidden_size=16, ffn_hidden_size=24, num_attention_heads=4, num_moe_experts=4,
                           moe_router_topk=2, use_cpu_initialization=True, add_bias_linear=False,
                           bias_dropout_fusion=False, gradient_accumulation_fusion=False, masked_softmax_fusion=False,
                           persist_layer_norm=False)
    cfg = config_from_megatron(tc, world_size=1, gate="naive", second_expert_policy="all")
    layer = build_mlp(moe_plugin_spec(get_gpt_layer_local_spec(num_experts=4), cfg).submodules.mlp, tc)
    layer.set_layer_number(2)
    layer.eval()
    assert list(moe_layers_by_id(torch.nn.ModuleList([layer]))) == [2]
    x = torch.randn(5, 2, 16)
    with torch.no_grad():
        y0, _ = layer(x)
    w1 = layer.experts.bank.w1.detach().clone()
    router = layer.router.gate.weight.detach().clone()
    apply_expert_permutation(layer, [2, 3, 0, 1])
    assert torch.equal(layer.experts.bank.w1, w1[[2, 3, 0, 1]])
    assert torch.equal(layer.router.gate.weight, router[[2, 3, 0, 1]])
    with torch.no_grad():
        y1, _ = layer(x)
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)


# --- the CLI -------------------------------------------------------------------------------------------------------
def test_cli_balance(tmp_path, capsys):
    from megamoe_plugin.inference.cli import main
    from megamoe_plugin.stats import TraceRecorder, load_trace
    E, steps = 8, 40
    path = str(tmp_path / "trace" / "routing")
    rng = np.random.default_rng(0)
    pop = 1.0 / np.arange(1, E + 1) ** 1.2               # popular experts 0, 1, ... all on device 0
    for rank in range(2):
        rec = TraceRecorder(path, rank=rank, world_size=2, num_experts=E, top_k=1)
        for s in range(steps):
            for lid in (0, 1):
                c = torch.from_numpy(rng.multinomial(200, pop / pop.sum()))
                rec(lid, types.SimpleNamespace(counts=c))
            rec.next_step()
        rec.flush()
    out = str(tmp_path / "placement.json")
    assert main(["balance", "--trace", path, "--devices", "2", "--out", out]) == 0
    text = capsys.readouterr().out
    rows = [l for l in text.splitlines() if l.startswith("| 0 ") or l.startswith("| 1 ")]
    assert len(rows) == 2
    pf = read_placement_file(out, num_experts=E)
    assert sorted(pf.layers) == [0, 1] and pf.meta["num_devices"] == 2
    counts = load_trace(path)["counts"].sum(2).double()
    test = counts[steps // 2:]
    for lid, perm in pf.layers.items():
        # the written placement's held-out Max Load, computed here from the trace, is below identity's
        dev = torch.tensor(perm_to_placement(perm, 2))
        share = torch.stack([test[:, lid, dev == d].sum(-1) for d in range(2)], -1) / test[:, lid].sum(-1, True)
        ident = torch.stack([test[:, lid, d * 4:(d + 1) * 4].sum(-1) for d in range(2)], -1) / test[:, lid].sum(-1, True)
        assert share.max() < ident.max()
        assert pf.meta["heldout"][str(lid)]["identity"]["max_load"] == pytest.approx(float(ident.max()))
    # the placement feeds the cache simulator
    assert main(["cache-sim", "--trace", path, "--devices", "2", "--sizes", "2", "--policies", "lifo",
                 "--placement-file", out]) == 0
    with pytest.raises(SystemExit) as err:
        main(["balance", "--help"])
    assert err.value.code == 0
