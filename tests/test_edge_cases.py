"""Empty batches and all tokens routed to one expert, in both dispatch modes."""
import pytest
import torch

from conftest import reference_moe
from megamoe_plugin import MoEConfig, MoELayer


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_empty_batch(dispatch):
    layer = MoELayer(MoEConfig(num_experts=4, top_k=2, gate="gshard", dispatch=dispatch), 8, 16)
    x = torch.randn(0, 3, 8, requires_grad=True)
    y = layer(x)
    assert y.shape == (0, 3, 8)
    (y.sum() + layer.aux_loss).backward()
    assert layer.experts.w1.grad is not None and torch.count_nonzero(layer.experts.w1.grad) == 0
    assert int(layer.last_routing.dropped) == 0


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_all_tokens_to_one_expert(dispatch):
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, top_k=1, gate="switch", dispatch=dispatch, capacity_factor=1.0)
    layer = MoELayer(cfg, 8, 16).double()
    with torch.no_grad():
        layer.gate.weight.zero_()
        layer.gate.weight[2] = 50.0
    x = torch.rand(40, 8, dtype=torch.float64) + 0.5       # positive inputs: expert 2 wins everywhere
    y = layer(x)
    r = layer.last_routing
    assert (r.expert_ids == 2).all()
    if dispatch == "dropless":
        assert r.counts.tolist() == [0, 0, 40, 0] and int(r.dropped) == 0
    else:
        assert r.counts.tolist() == [0, 0, 10, 0] and int(r.dropped) == 30   # capacity = 40 * 1 / 4
    assert (y - reference_moe(x, r, layer.experts)).abs().max() < 1e-10
    y.sum().backward()
    assert torch.count_nonzero(layer.experts.w1.grad[[0, 1, 3]]) == 0
    assert torch.count_nonzero(layer.experts.w1.grad[2]) > 0
