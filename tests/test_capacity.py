"""Capacity mode drops exactly what GShard's priority rule drops, pads with zeros, and reports the count."""
import torch

from megamoe_plugin import MoEConfig, MoELayer
from megamoe_plugin.gates import apply_capacity


def reference_drop(ids, kept, capacity):
    """Python loop: first choices of all tokens in order, then second choices; a full expert drops."""
    T, k = ids.shape
    used = [0] * len(capacity)
    out = torch.zeros_like(kept)
    slot = torch.full_like(ids, -1)
    for j in range(k):
        for t in range(T):
            if kept[t, j]:
                e = int(ids[t, j])
                if used[e] < capacity[e]:
                    out[t, j] = True
                    slot[t, j] = used[e]
                used[e] += 1
    return out, slot


def test_drop_rule_matches_reference_with_per_expert_capacities():
    g = torch.Generator().manual_seed(3)
    for trial in range(20):
        T, k, E = 50, 2, 5
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        kept = torch.rand(T, k, generator=g) > 0.1
        cap = torch.randint(0, 25, (E,), generator=g).tolist()
        got_kept, got_slot = apply_capacity(ids, kept, cap)
        want_kept, want_slot = reference_drop(ids, kept, cap)
        assert torch.equal(got_kept, want_kept)
        assert torch.equal(got_slot[want_kept], want_slot[want_kept])


def test_layer_reports_drops_and_pads_with_zeros():
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, top_k=2, gate="naive", dispatch="capacity", capacity_factor=1.0)
    layer = MoELayer(cfg, 8, 16)
    layer.set_expert_capacity([3, 0, 7, 2])
    x = torch.randn(20, 8)
    routing = layer.gate(x, capacity=layer.capacity_for(20))
    _, want_slot = reference_drop(routing.expert_ids, torch.ones_like(routing.kept), [3, 0, 7, 2])
    want_kept, _ = reference_drop(routing.expert_ids, torch.ones_like(routing.kept), [3, 0, 7, 2])
    assert torch.equal(routing.kept, want_kept)
    assert int(routing.dropped) == 40 - int(want_kept.sum())
    assert routing.counts.tolist() == [int((routing.expert_ids[want_kept] == e).sum()) for e in range(4)]
    buf, sizes, state = layer.capacity_dispatch.dispatch(x, routing, [3, 0, 7, 2])
    assert sizes == [3, 0, 7, 2] and buf.shape == (12, 8)
    starts = [0, 3, 3, 10]
    for e, c in enumerate([3, 0, 7, 2]):
        n = int(routing.counts[e])
        for s in range(c):
            row = buf[starts[e] + s]
            if s < n:        # the token that holds this slot
                t, j = ((routing.expert_ids == e) & routing.kept & (want_slot == s)).nonzero()[0].tolist()
                assert torch.equal(row, x[t])
            else:            # padding
                assert torch.count_nonzero(row) == 0
    # dropped assignments contribute nothing: a token with all choices dropped gets exactly zero output
    y = layer(x)
    none_kept = ~layer.last_routing.kept.any(1)
    assert none_kept.any() and torch.count_nonzero(y[none_kept]) == 0


def test_eval_is_dropless_by_default_and_capacity_factor_at_eval():
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, top_k=2, gate="naive", dispatch="capacity", capacity_factor=0.5)
    layer = MoELayer(cfg, 8, 16).eval()
    layer(torch.randn(30, 8))
    assert int(layer.last_routing.dropped) == 0
    layer = MoELayer(cfg.replace(eval_capacity_factor=0.5), 8, 16).eval()
    layer(torch.randn(30, 8))
    assert int(layer.last_routing.dropped) > 0
