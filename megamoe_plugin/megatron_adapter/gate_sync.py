"""``--moe-plugin-gate-sync local | average:K`` in Megatron (gate_sync.py explains what the modes mean).

Megatron's DDP reduces every dense gradient over the data-parallel group inside ``finalize_model_grads``; its
optimizer then clips by a norm it computes from its grad-norm gradient collector (compat.GRAD_NORM_METHODS). For
rank-local gates:

* ``keep_local_gate_grads(finalize)``: wraps ``finalize_model_grads``: each gate's ``main_grad`` (this rank's own,
  as backward left it) is set aside before the reduction and put back after it, so the optimizer updates each
  rank's gate with its own gradient (the reduction still carries the gate's few bytes; nothing else changes);
* ``identical_clip_norm(optimizer)``: in the optimizer's norm, every gate gradient stands in scaled so that the
  gates' share is the mean over data-parallel ranks of each rank's own: every rank clips by the same coefficient
  and the other, replicated, parameters stay identical;
* ``average`` every K steps: ``gate_sync.average_params`` over the data-parallel group, on the gate parameters
  and on their fp32 master copies when the optimizer keeps one.

The distributed optimizer (its shards are all-gathered after the step, overwriting every rank's gate with one
owner's) and tensor parallelism (tensor-parallel ranks all-reduce router gradients) are refused at validation.
"""
from __future__ import annotations

import functools
from typing import Callable, List

import torch
import torch.distributed as dist

from ..gate_sync import gate_params, local_grad_sq_norm
from .compat import grad_norm_method, wrap_grads_for_norm


def _dp_group():
    from megatron.core import parallel_state as ps
    return ps.get_data_parallel_group()


def keep_local_gate_grads(finalize: Callable) -> Callable:
    """``finalize_model_grads`` that leaves the gates' gradients as this rank's backward left them."""
    if getattr(finalize, "_megamoe_local_gates", False):
        return finalize

    @functools.wraps(finalize)
    def wrapped(model, *args, **kwargs):
        gates = [p for p in gate_params(model) if getattr(p, "main_grad", None) is not None]
        saved = [p.main_grad.detach().clone() for p in gates]
        out = finalize(model, *args, **kwargs)
        for p, g in zip(gates, saved):
            p.main_grad.copy_(g)
        return out

    wrapped._megamoe_local_gates = True
    return wrapped


def with_sender_bias_update(finalize: Callable) -> Callable:
    """``finalize_model_grads`` followed by the per-sender bias updates (TA-MoE by bias; megatron-core updates the
    shared expert bias itself and does not know these)."""
    if getattr(finalize, "_megamoe_sender_bias", False):
        return finalize
    from ..gates.balance import end_sender_batches

    @functools.wraps(finalize)
    def wrapped(model, *args, **kwargs):
        out = finalize(model, *args, **kwargs)
        chunks = model if isinstance(model, (list, tuple)) else [model]
        end_sender_batches([m for c in chunks for m in c.modules() if hasattr(m, "end_sender_batch")])
        return out

    wrapped._megamoe_sender_bias = True
    return wrapped


def _inner(optimizer) -> List[object]:
    chain = getattr(optimizer, "chained_optimizers", None)
    return list(chain) if chain else [optimizer]


def identical_clip_norm(model, optimizer) -> int:
    """Wrap the (chained) optimizers' grad-norm gradient collector (compat.GRAD_NORM_METHODS) so the gates count by the mean over ranks of
    each rank's squared norm. Idempotent; returns how many optimizers were wrapped."""
    gate_ids = {id(p) for p in gate_params(model)}
    wrapped = 0
    for opt in _inner(optimizer):
        if getattr(opt, "_megamoe_gate_norm", False) or grad_norm_method(opt) is None:
            continue
        masters = {}
        for g16, g32 in zip(getattr(opt, "float16_groups", None) or [],
                            getattr(opt, "fp32_from_float16_groups", None) or []):
            for p16, p32 in zip(g16, g32):
                if id(p16) in gate_ids:
                    masters[id(p32)] = True
        mine = [p for p in opt.get_parameters() if id(p) in gate_ids or id(p) in masters]
        if not mine:
            continue

        def norm_grads(grads, mine=mine):
            gate_grads = {id(g): g for p in mine for g in (p.grad, getattr(p, "decoupled_grad", None))
                          if g is not None}
            local = [g for g in grads if id(g) in gate_grads]
            if not local:
                return grads
            own = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in local]).pow(2).sum()
            mean = local_grad_sq_norm(local, _dp_group())                     # collective over data parallel
            scale = (mean / own.clamp_min(1e-30)).sqrt()
            return [g * scale.to(g) if id(g) in gate_grads else g for g in grads]

        wrap_grads_for_norm(opt, norm_grads)
        opt._megamoe_gate_norm = True
        wrapped += 1
    return wrapped


@torch.no_grad()
def average_gates(model, optimizer) -> None:
    """Average the gates (and their fp32 master copies) over the data-parallel group. Collective."""
    from ..gate_sync import average_params
    from ..placement.optim_state import param_state_tensors

    tensors = []
    for p in gate_params(model):
        tensors.append(p.data)
        state = param_state_tensors(optimizer, p)
        if state and state[0].shape == p.shape and state[0].dtype != p.dtype:     # an fp32 master copy
            tensors.append(state[0])
    if tensors and dist.is_initialized():
        average_params(tensors, _dp_group())
