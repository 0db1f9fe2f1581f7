"""Autograd-correct collectives and row permutations used by the dispatchers.

- ``all_to_all(x, out_splits, in_splits, group)``: all-to-all-v of rows; its backward is the reverse exchange.
  Works on any torch.distributed backend with ``all_to_all_single`` (gloo on CPU, NCCL on GPU).
- ``gather_rows(x, index)``: x[index] whose backward adds gradients back with one ``index_add_`` (no dense masks).
- ``weighted_combine(rows, index, weights)``: y[t] = sum_j weights[t, j] * rows[index[t, j]] (dropped
  assignments have weight 0).
"""
from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits: List[int], in_splits: List[int], group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def _exchange(x, out_splits, in_splits, group):
    x = x.contiguous()
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


def all_to_all(x: torch.Tensor, out_splits: List[int], in_splits: List[int], group) -> torch.Tensor:
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """Every rank sends counts[P * n] (n per destination) and receives the P slices addressed to it."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        ctx.num_rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        out = grad.new_zeros((ctx.num_rows,) + tuple(grad.shape[1:]))
        return out.index_add_(0, index, grad.contiguous()), None


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return _GatherRows.apply(x, index)


def weighted_combine(rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y[t] = sum_j weights[t, j] * rows[index[t, j]]. Dropped assignments carry weight 0 and any index >=
    len(rows); they are pointed at row 0 (0 * row adds nothing, and their weight has no gradient path)."""
    T, k = index.shape
    if rows.shape[0] == 0:
        return rows.new_zeros(T, rows.shape[1]) + 0 * (rows.sum() + weights.sum())   # keep the graph
    picked = gather_rows(rows, index.reshape(-1).clamp(max=rows.shape[0] - 1))
    if k == 1:
        return picked * weights
    if picked.is_cuda:      # a [T] batch of 1 x k x H products runs on a slow batched-GEMM kernel on GPUs
        return (picked.view(T, k, rows.shape[1]) * weights.unsqueeze(-1)).sum(1)
    return torch.bmm(weights.unsqueeze(1), picked.view(T, k, rows.shape[1])).squeeze(1)


def regroup_index(counts: torch.Tensor, total: int) -> torch.Tensor:
    """Row order that turns blocks laid out [source][expert] (sizes counts[P, E], `total` rows, a host int
    the caller already has) into [expert][source]."""
    P, E = counts.shape
    flat = counts.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat                         # block starts in the [source][expert] layout
    order = torch.arange(P * E, device=counts.device).view(P, E).t().reshape(-1)
    lengths, block_starts = flat[order], starts[order]
    new_starts = torch.cumsum(lengths, 0) - lengths
    offsets = torch.repeat_interleave(block_starts - new_starts, lengths, output_size=total)
    return offsets + torch.arange(offsets.numel(), device=counts.device)


def return_to_sources(y: torch.Tensor, regroup: torch.Tensor, in_splits: List[int], out_splits: List[int],
                      group) -> torch.Tensor:
    """Undo a dispatch: [expert][source] rows back to [source][expert], then the reverse all-to-all-v."""
    inverse = torch.empty_like(regroup)
    inverse[regroup] = torch.arange(regroup.numel(), device=y.device)
    return all_to_all(gather_rows(y, inverse), in_splits, out_splits, group)
