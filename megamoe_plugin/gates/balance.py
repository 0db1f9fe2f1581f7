"""Balance losses and the per-global-batch updates of the router's balancing state (megatron-core 0.19's math).

Losses (each returned already multiplied by its coefficient, differentiable through the scores):

- ``switch_loss`` (Switch Transformer; megatron-core ``switch_load_balancing_loss_func``):
  E * coeff / (k * N^2) * sum_e w_e * (sum of expert e's scores over this rank's tokens) * (tokens routed to e over
  the N tokens of the group). The counts are summed over the ranks that split one batch of sequences (tensor and
  context parallel: ``seq_group``), N is that group's token count, so each rank's loss is its share of the group's
  loss and the gradients (summed over those ranks, as the router weight's are) are the group loss's.
  ``w_e`` = 1 but for TA-MoE's reweighting (gates/ta_moe.py).
- aux_loss: one switch loss per micro-batch; seq_aux_loss (DeepSeek-V2/V3): one per sequence, averaged over the
  micro-batch's sequences; global_aux_loss: the counts summed over every rank of the global batch (``batch_group``)
  and averaged over the micro-batches of the step so far (``GlobalCounts``, reset once per global batch).
- ``z_loss`` (ST-MoE): mean over tokens of logsumexp(logits)^2, the coefficient divided by the ``seq_group`` size.
Padding tokens (a mask, True = padding) count in no loss.

Per-global-batch updates (``end_global_batch``: megatron-core runs the same in ``finalize_model_grads``, which finds
the gates' buffers by their megatron-core names; the plugin's other trainers call this function once per step):
- expert bias (aux-loss-free balancing, DeepSeek-V3): the tokens each expert received over the step, summed over the
  ``batch_group``; the bias moves by +rate for experts below the mean, -rate above (sign of the error);
- quantile balancing: the quantiles accumulated over the step's micro-batches, averaged over the data-parallel
  ranks, mixed with the previous bias by the EMA weight, centred;
- the global aux loss's counts are reset;
- the per-sender biases of the gates that steer dispatch toward a topology's target by bias (``end_sender_batches``,
  TA-MoE by bias in gates/ta_moe.py): not megatron-core's, so the Megatron adapter calls it after
  ``finalize_model_grads``.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist


def group_size(group) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    """Sum over ``group`` (no gradient: used on counts)."""
    if group_size(group) > 1:
        t = t.clone()
        dist.all_reduce(t, group=group)
    return t


def switch_loss(prob_sum: torch.Tensor, counts: torch.Tensor, total_tokens, top_k: int, num_experts: int,
                coeff: float, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """E * coeff / (k * N^2) * sum(w * prob_sum * counts) (prob_sum, counts: [..., E])."""
    terms = prob_sum * counts
    if weight is not None:
        terms = terms * weight
    return terms.sum() * (num_experts * coeff / (top_k * total_tokens * total_tokens))


def expert_counts(ids: torch.Tensor, num_experts: int, valid: Optional[torch.Tensor] = None,
                  sequence_of: Optional[torch.Tensor] = None, num_sequences: int = 1) -> torch.Tensor:
    """Assignments per expert [E] (or per sequence and expert [S, E]) of ids [T, k], padding tokens excluded; an
    id equal to ``num_experts`` (an assignment that was not kept) counts nowhere."""
    flat = ids.reshape(-1)
    if sequence_of is None and num_sequences > 1:
        raise ValueError("per-sequence counts of several sequences need each token's sequence")
    if sequence_of is not None:
        flat = flat + (sequence_of.unsqueeze(1).expand_as(ids).reshape(-1) * num_experts)
    size = num_experts * (num_sequences if sequence_of is not None else 1)
    w = None if valid is None else valid.unsqueeze(1).expand_as(ids).reshape(-1).to(torch.float32)
    counts = torch.bincount(flat, weights=w, minlength=size + 1)[:size].to(torch.float32)
    return counts.view(num_sequences, num_experts) if sequence_of is not None else counts


def sequence_prob_sums(scores: torch.Tensor, sequence_of: Optional[torch.Tensor], num_sequences: int) -> torch.Tensor:
    """[S, E]: each sequence's sum of scores (differentiable); ``sequence_of`` None: one sequence."""
    if sequence_of is None:
        return scores.sum(0, keepdim=True)
    return scores.new_zeros(num_sequences, scores.shape[1]).index_add(0, sequence_of, scores)


def z_loss(logits: torch.Tensor, coeff: float, padding: Optional[torch.Tensor] = None) -> torch.Tensor:
    z = torch.logsumexp(logits, dim=-1).square()
    if padding is None:
        return z.mean() * coeff
    valid = ~padding
    return (z * valid).sum() / torch.clamp(valid.sum(), min=1.0) * coeff


@torch.no_grad()
def end_global_batch(gates: Iterable, batch_group=None, data_group=None) -> None:
    """The once-per-global-batch updates of every gate's balancing state (module docstring). ``batch_group``: the
    ranks of the global batch (data x tensor x context parallel); ``data_group``: the data-parallel ranks (the
    quantile average). Call after the step's last backward, on every rank (collectives)."""
    gates = [g for g in gates if g.training]
    biased = [g for g in gates if getattr(g, "expert_bias", None) is not None and
              not getattr(g, "frozen_expert_bias", False)]
    if biased:
        counts = torch.stack([g.local_tokens_per_expert for g in biased])
        counts = all_reduce_sum(counts, batch_group)
        offset = counts.sum(dim=-1, keepdim=True) / counts.shape[-1] - counts
        for g, off in zip(biased, offset):
            g.expert_bias.add_(torch.sign(off) * g.cfg.router_bias_update_rate)
    quantile = [g for g in gates if getattr(g, "qb_beta_accum", None) is not None]
    if quantile:
        local = torch.stack([g.qb_beta_accum / g.qb_beta_count.clamp(min=1).to(g.qb_beta_accum.dtype)
                             for g in quantile])
        if group_size(data_group) > 1:
            dist.all_reduce(local, group=data_group)
            local = local / group_size(data_group)
        for g, avg in zip(quantile, local):
            ema = g.cfg.quantile_balancing_ema
            new = ema * g.qb_beta + (1.0 - ema) * avg
            g.qb_beta.copy_(new - new.mean(dim=-1, keepdim=True))
    end_sender_batches(gates)
    for g in gates:
        g.reset_global_batch_state()


@torch.no_grad()
def end_sender_batches(gates: Iterable) -> None:
    """The per-sender bias updates of the gates that steer dispatch by bias (TA-MoE by bias, gates/ta_moe.py);
    megatron-core's ``finalize_model_grads`` does not know them, the Megatron adapter calls this after it."""
    for g in gates:
        update = getattr(g, "end_sender_batch", None)
        if update is not None and g.training:
            update()
