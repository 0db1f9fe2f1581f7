"""The standard gates: naive top-k, Switch (top-1) and GShard (top-2 with random routing of the second expert).

- ``naive``: softmax, top-k, optional renormalisation (FastMoE's NaiveGate; Megatron's TopKRouter).
- ``switch``: top-1 with multiplicative jitter in training and the Switch balance loss (Fedus et al. §2.2).
- ``gshard``: top-2; the second expert is kept with probability 2 * p2 ("random routing", GShard §2.2) when
  ``second_expert_policy='random'``; GShard balance loss on the first choices (as fairseq's top2gating).
Capacity, when used, is applied by the base class with GShard's priority rule.
"""
from __future__ import annotations

import torch

from .base import Gate, assignment_fractions
from .registry import register_gate


@register_gate("naive")
class NaiveGate(Gate):
    def select(self, logits, probs):
        ids = torch.topk(probs, self.top_k, dim=-1).indices
        return ids, torch.ones_like(ids, dtype=torch.bool)


@register_gate("switch")
class SwitchGate(NaiveGate):
    """Top-1; the jitter and the balance loss come from the base class (jitter_eps, aux_loss_coeff)."""

    fixed_top_k = 1


@register_gate("gshard")
class GShardGate(Gate):
    fixed_top_k = 2

    def select(self, logits, probs):
        top2 = torch.topk(probs, 2, dim=-1)
        ids = top2.indices
        kept = torch.ones_like(ids, dtype=torch.bool)
        if self.training and self.cfg.second_expert_policy == "random":
            kept[:, 1] = 2.0 * top2.values[:, 1] > torch.rand_like(top2.values[:, 1])
        return ids, kept

    def balance_loss(self, probs, expert_ids, kept):
        """GShard: E * sum_e (fraction of tokens whose first choice is e) * (mean gate probability of e)."""
        first = expert_ids[:, :1]
        f = assignment_fractions(first, torch.ones_like(first, dtype=torch.bool), self.num_experts)
        return self.num_experts * (f * probs.mean(0)).sum()
