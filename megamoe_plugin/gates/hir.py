"""FasterMoE's topology-aware "Hir" gate (paper 003 §4.3, contention-avoiding expert selection).

With N nodes of M workers, an unrestricted all-to-all pushes about M times more bytes through each node's network
interface than through a worker's local link. The Hir gate lets at most

    L = W_net / (M * W_local) * B            (B = tokens of this worker, W from the Topology)

of a worker's tokens go to experts on other nodes, so that the node's cross-node traffic, M * L tokens, takes
about as long as its local traffic. When more than L of the top choices are remote, the L with the highest gate
scores keep them; the others re-select the best expert on their own node (excluding experts the token already
chose). With top-k > 1 the budget counts (token, choice) assignments, which
for k = 1 is the paper's rule. On a single node the gate equals the naive top-k gate.
"""
from __future__ import annotations

import math

import torch

from .base import Gate, expert_nodes
from .registry import register_gate


@register_gate("hir")
class HirGate(Gate):
    needs_topology = True
    balance_on_choice = True              # the loss balances the choices the budget left

    def __init__(self, cfg, hidden_size, ep=None, topology=None):
        super().__init__(cfg, hidden_size, ep=ep, topology=topology)
        topo = topology or cfg.build_topology()
        node_of_expert, own = expert_nodes(topo, self.ep, cfg.num_experts)
        me = self.ep.global_rank_of(self.ep.rank)
        self.register_buffer("local_expert", torch.tensor(node_of_expert) == own, persistent=False)
        self.single_node = bool(self.local_expert.all())   # decided once here: no host sync per call
        self.workers_per_node = topo.ranks_per_node(me)
        self.budget_ratio = topo.net_bandwidth / (self.workers_per_node * topo.local_bandwidth)
        self.topology = topo

    @classmethod
    def check_options(cls, cfg, topology):
        if len(set(topology.node_ids())) == 1:
            return [f"--moe-gate=hir on the topology {topology.spec()} (one node): no token can cross a node, so "
                    "hir routes exactly like the naive top-k gate; give the job's nodes with --moe-topology "
                    "(e.g. '[[0,1],[2,3]]'), or launch with LOCAL_WORLD_SIZE set per node (torchrun, megamoe "
                    "cluster run)"]
        return []

    def budget(self, num_tokens: int) -> int:
        """L of paper 003 §4.3 for a worker holding `num_tokens` tokens."""
        return int(math.floor(self.budget_ratio * num_tokens))

    def select(self, logits, probs):
        ids = self.topk(logits, probs, self.top_k)
        kept = torch.ones_like(ids, dtype=torch.bool)
        if self.single_node or ids.numel() == 0:
            return ids, kept
        local = self.local_expert.to(ids.device)
        remote = ~local[ids]                                            # [T, k]
        score = torch.where(remote, probs.gather(1, ids), float("-inf")).reshape(-1)
        allowed = torch.zeros_like(score, dtype=torch.bool)
        n_keep = min(self.budget(ids.shape[0]), score.numel())
        if n_keep:
            allowed[torch.topk(score, n_keep).indices] = True
        overflow = remote & ~allowed.view_as(remote)
        local_probs = probs.masked_fill(~local, float("-inf"))
        for j in range(self.top_k):                                     # loop over k choices, not tokens
            others = torch.cat([ids[:, :j], ids[:, j + 1:]], dim=1)
            cand = local_probs.scatter(1, others, float("-inf")) if others.numel() else local_probs
            best_val, best = cand.max(dim=-1)
            can = torch.isfinite(best_val)
            ids[:, j] = torch.where(overflow[:, j] & can, best, ids[:, j])
            kept[:, j] &= ~(overflow[:, j] & ~can)
        return ids, kept
