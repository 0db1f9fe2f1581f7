"""The dispatchers' row movements (dispatch/comm.py): ``expand_rows`` and ``permute_rows`` give the same values and
the same gradients as plain indexing under autograd (whose backward scatter-adds), with every assignment kept and
with some left out, for top-1 and top-k; ``weighted_combine`` with the inverse permutation equals it without."""
import pytest
import torch

from megamoe_plugin.dispatch.comm import (expand_rows, inverse_permutation, permute_rows, weighted_combine)


def _routing(T, k, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 5, (T, k), generator=g)
    order = torch.argsort(ids.reshape(-1), stable=True)
    position = inverse_permutation(order)
    return order, position


@pytest.mark.parametrize("k", [1, 2, 3])
def test_expand_rows_matches_indexing(k):
    T, H = 37, 6
    order, position = _routing(T, k, seed=k)
    x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    ref_x = x.detach().clone().requires_grad_()
    dy = torch.randn(T * k, H, dtype=torch.float64)
    out = expand_rows(x, order, k, position)
    ref = ref_x[order // k]
    assert torch.equal(out, ref)
    out.backward(dy)
    ref.backward(dy)
    assert torch.allclose(x.grad, ref_x.grad, atol=1e-12)
    # a token's gradient is the sum of its k assignments' (hand-checked on token 0)
    rows_of_0 = [int(position[j]) for j in range(k)]
    assert torch.allclose(x.grad[0], dy[rows_of_0].sum(0))


def test_expand_rows_with_assignments_left_out():
    T, k, H = 20, 2, 4
    order, position = _routing(T, k, seed=7)
    kept = order[:29]                                     # the last 11 assignments have no row (dropped)
    x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    ref_x = x.detach().clone().requires_grad_()
    dy = torch.randn(29, H, dtype=torch.float64)
    expand_rows(x, kept, k, position).backward(dy)
    ref_x[kept // k].backward(dy)
    assert torch.allclose(x.grad, ref_x.grad, atol=1e-12)


def test_permute_rows_and_combine_with_inverse():
    T, k, H = 15, 2, 5
    order, position = _routing(T, k, seed=3)
    rows = torch.randn(T * k, H, dtype=torch.float64, requires_grad=True)
    w = torch.rand(T, k, dtype=torch.float64, requires_grad=True)
    ref_rows, ref_w = rows.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    dy = torch.randn(T, H, dtype=torch.float64)
    y = weighted_combine(rows, position.view(T, k), w, inverse=order)
    ref = weighted_combine(ref_rows, position.view(T, k), ref_w)
    assert torch.allclose(y, ref)
    y.backward(dy)
    ref.backward(dy)
    assert torch.allclose(rows.grad, ref_rows.grad) and torch.allclose(w.grad, ref_w.grad)
    p = permute_rows(rows, order, position)
    assert torch.equal(p, rows.detach()[order])
    perm_grad = torch.autograd.grad(p, rows, dy.repeat(k, 1))[0]
    assert torch.equal(perm_grad, dy.repeat(k, 1)[position])


def test_combine_with_fewer_rows_than_assignments_ignores_the_inverse():
    """Experts that return rows for the kept assignments only (a static expert graph of fixed group sizes): the
    dropped tail's assignments (weight 0) point past the rows, and the combine equals the one without inverse."""
    T, k, H = 10, 2, 3
    order, position = _routing(T, k, seed=5)
    rows = torch.randn(14, H, dtype=torch.float64)               # 6 assignments dropped: no rows for them
    w = torch.rand(T, k, dtype=torch.float64)
    w.view(-1)[order[14:]] = 0.0
    y = weighted_combine(rows, position.view(T, k), w, inverse=order)
    assert torch.allclose(y, weighted_combine(rows, position.view(T, k), w))
