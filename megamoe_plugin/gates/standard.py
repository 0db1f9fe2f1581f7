"""The standard gates: top-k (megatron-core's router), Switch (top-1) and GShard (top-2, random second expert).

- ``topk``: the base class's router unchanged (gates/base.py): every score function, group-limited routing,
  expert bias, sinkhorn and quantile balancing, Switch's balance loss. ``naive`` is the same gate under FastMoE's
  name.
- ``switch``: top-1 with the Switch balance loss (Fedus et al. §2.2); jitter through ``jitter_eps``.
- ``gshard``: top-2; the second expert is kept with probability 2 * p2 ("random routing", GShard §2.2) when
  ``second_expert_policy='random'``; GShard's balance loss on the first choices, and the weights renormalised over
  the kept choices after the capacity cut (fairseq's top2gating).
Capacity, when used, is applied by the base class with the configured drop policy.
"""
from __future__ import annotations

import torch

from .base import Gate
from .registry import register_gate


@register_gate("topk")
class TopKGate(Gate):
    """megatron-core's TopKRouter (the base class's steps)."""


@register_gate("naive")
class NaiveGate(TopKGate):
    """FastMoE's NaiveGate: the top-k gate."""


@register_gate("switch")
class SwitchGate(TopKGate):
    """Top-1; the jitter and the balance loss come from the base class (jitter_eps, aux_loss_coeff)."""

    fixed_top_k = 1


@register_gate("gshard")
class GShardGate(Gate):
    fixed_top_k = 2
    balance_on_choice = True

    def select(self, logits, probs):
        ids = self.topk(logits, probs, 2)
        kept = torch.ones_like(ids, dtype=torch.bool)
        if self.training and self.cfg.second_expert_policy == "random":
            kept[:, 1] = 2.0 * probs.gather(1, ids[:, 1:]).squeeze(1) > torch.rand_like(ids[:, 1], dtype=probs.dtype)
        return ids, kept

    def balance_loss(self, scores, ids, valid, coeff):
        """GShard: E * sum_e (fraction of tokens whose first choice is e) * (mean gate probability of e)."""
        return super().balance_loss(scores, ids[:, :1], valid, coeff)

    def final_weights(self, weights, ids, kept, scores):
        """The chosen experts' probabilities renormalised over the choices kept after the capacity cut."""
        w = scores.gather(1, ids) * kept
        if self.cfg.normalize_top_k:
            w = w / w.sum(-1, keepdim=True).clamp_min(1e-20)
        if self.cfg.topk_scaling_factor:
            w = w * self.cfg.topk_scaling_factor
        return w
