"""ExpertBank slot API: one expert's parameters and optimizer state move as a slice."""
import torch

from megamoe_plugin.experts import ExpertBank


def test_expert_state_moves_parameters_and_adam_moments():
    torch.manual_seed(0)
    src = ExpertBank(4, 8, 16, activation="swiglu", bias=True)
    dst = ExpertBank(4, 8, 16, activation="swiglu", bias=True)
    opt_src = torch.optim.Adam(src.parameters(), lr=0.1)
    opt_dst = torch.optim.Adam(dst.parameters(), lr=0.1)
    for bank, opt in ((src, opt_src), (dst, opt_dst)):
        y = bank(torch.randn(12, 8), [3, 4, 0, 5])
        y.square().sum().backward()
        opt.step()
    state = src.expert_state(1, opt_src)
    assert {"w1", "w2", "b1", "b2", "w1/exp_avg", "w1/exp_avg_sq", "b2/exp_avg"} <= set(state)
    before_other = dst.w1[0].detach().clone()
    dst.load_expert_state(3, state, opt_dst)
    for name in ("w1", "w2", "b1", "b2"):
        assert torch.equal(getattr(dst, name)[3], getattr(src, name)[1])
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt_dst.state[getattr(dst, name)][key][3], opt_src.state[getattr(src, name)][key][1])
    assert torch.equal(dst.w1[0], before_other)          # other slots untouched
    state["w1"].add_(1.0)                                 # a copy, not a view into the source
    assert not torch.equal(state["w1"], src.w1[1])


def test_idle_expert_gets_zero_gradient_and_parameters_are_marked():
    bank = ExpertBank(3, 4, 6)
    bank(torch.randn(5, 4), [2, 0, 3]).sum().backward()
    assert torch.count_nonzero(bank.w1.grad[1]) == 0 and torch.count_nonzero(bank.w1.grad[0]) > 0
    assert all(p.expert and p.allreduce is False for p in bank.parameters())
