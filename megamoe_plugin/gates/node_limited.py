"""Node-limited routing from the job's topology: each token uses experts on at most M nodes.

DeepSeek-V3 (§2.1.2 of its report) limits every token to M nodes: the experts form one group per node, a node's
score is the sum of its best k/M scores, the token keeps its M best nodes and chooses its k experts among them
(megatron-core's group-limited top-k, ``--moe-router-num-groups`` / ``--moe-router-group-topk``). There the
groups are typed by hand and must be equal. Here they are the nodes of the expert-parallel layout, taken from the
job's topology (``--moe-topology``, the launcher's ``LOCAL_WORLD_SIZE``, or ``megamoe topology`` measured): expert
e belongs to the node of the rank that holds it, and nodes may hold different numbers of experts (3 nodes of
2 + 1 + 1 ranks). M is ``group_topk`` (Megatron: ``--moe-router-group-topk``).

Two rules choose the M nodes:

- ``node_limited`` (DeepSeek's): the M nodes with the best node scores;
- ``node_limited_sender`` (sender-aware): the sending rank's own node is always admitted (its experts cost no
  inter-node link), plus the best M - 1 other nodes by node score. With M = 1 every token stays on its node.

The limit applies to the choice only; the combine weights are the router's (scores at the chosen experts), as in
megatron-core. A node with fewer than k/M experts scores with the ones it has. FasterMoE's Hir gate (gates/hir.py)
limits the same traffic by a per-rank budget of cross-node assignments instead; ``megamoe bench gates`` compares
them. On one node both rules are the plain top-k.
"""
from __future__ import annotations

from typing import List

import torch

from .base import Gate, expert_nodes
from .registry import register_gate
from ..config import ConfigError, flag


@register_gate("node_limited")
class NodeLimitedGate(Gate):
    """Top-k among the experts of the token's M best nodes (DeepSeek-V3's rule, nodes from the topology)."""

    needs_topology = True
    sender_admitted = False               # the sender-aware rule always admits the sender's own node
    derives_groups = True                 # the groups are the topology's nodes: --moe-num-groups is refused

    def __init__(self, cfg, hidden_size, ep=None, topology=None):
        super().__init__(cfg, hidden_size, ep=ep, topology=topology)
        topo = topology or cfg.build_topology()
        self.topology = topo
        node_of_expert, own = expert_nodes(topo, self.ep, cfg.num_experts)
        nodes = sorted(set(node_of_expert))
        index = {n: i for i, n in enumerate(nodes)}
        node_ids = torch.tensor([index[n] for n in node_of_expert])
        self.num_nodes = len(nodes)
        self.node_limit = min(node_limit(cfg), self.num_nodes)
        widest = max(int((node_ids == i).sum()) for i in range(self.num_nodes))
        # [N, widest] expert ids of each node, padded with E (a -inf column appended to the scores)
        table = torch.full((self.num_nodes, widest), cfg.num_experts, dtype=torch.long)
        for i in range(self.num_nodes):
            members = torch.nonzero(node_ids == i).flatten()
            table[i, :members.numel()] = members
        self.register_buffer("node_table", table, persistent=False)
        self.register_buffer("expert_node", node_ids, persistent=False)
        self.own_node = index.get(own, 0)
        self.per_node = max(1, min(cfg.top_k // self.node_limit, widest))

    @classmethod
    def validate_config(cls, cfg) -> None:
        super().validate_config(cfg)
        if cfg.num_groups:
            raise ConfigError(f"{flag('num_groups')}={cfg.num_groups}: --moe-gate {cfg.gate} takes its groups from "
                              f"the topology's nodes (--moe-topology or the launcher's LOCAL_WORLD_SIZE); leave it 0")
        if cfg.group_topk < 0:
            raise ConfigError(f"{flag('group_topk')}={cfg.group_topk}: --moe-gate {cfg.gate} takes M >= 1, the most "
                              "nodes one token may use (0, the default: one node)")

    @classmethod
    def check_options(cls, cfg, topology) -> List[str]:
        nodes = topology.node_ids()
        per_rank = cfg.num_experts / max(topology.num_ranks, 1)
        sizes = sorted(nodes.count(n) * per_rank for n in set(nodes))
        M = min(node_limit(cfg), len(sizes))
        room = sum(sizes[:M])
        if cls.sender_admitted:          # the sender's own node may be the smallest
            room = sizes[0] + sum(sizes[::-1][:M - 1])
        if cfg.top_k > room:
            raise ConfigError(f"{flag('group_topk')}={node_limit(cfg)}: on the topology {topology.spec()} the "
                              f"admitted nodes can hold {room:g} experts, fewer than {flag('top_k')}={cfg.top_k}; "
                              "admit more nodes")
        if len(set(nodes)) == 1:
            return [f"--moe-gate={cfg.gate} on the topology {topology.spec()} (one node): every token's experts are "
                    "on one node already, so it routes as the plain top-k"]
        return []

    def topk(self, logits, probs, k):
        basis = self.choice_basis(logits, probs).float()
        if self.num_nodes == 1:
            return torch.topk(basis, k=k, dim=-1).indices
        T = basis.shape[0]
        padded = torch.cat([basis, basis.new_full((T, 1), float("-inf"))], dim=1)        # [T, E + 1]
        grouped = padded[:, self.node_table]                                            # [T, N, widest]
        best = grouped.topk(self.per_node, dim=-1).values
        node_score = torch.where(torch.isfinite(best), best, torch.zeros_like(best)).sum(-1)      # [T, N]
        if self.sender_admitted:
            node_score[:, self.own_node] = float("inf")
        chosen = torch.topk(node_score, k=self.node_limit, dim=-1).indices               # [T, M]
        allowed = torch.zeros_like(node_score, dtype=torch.bool).scatter_(1, chosen, True)
        masked = basis.masked_fill(~allowed[:, self.expert_node], float("-inf"))
        return torch.topk(masked, k=k, dim=-1).indices


@register_gate("node_limited_sender")
class SenderNodeLimitedGate(NodeLimitedGate):
    """Node-limited routing that always admits the sender's own node, plus its M - 1 best other nodes."""

    sender_admitted = True


def node_limit(cfg) -> int:
    """M: --moe-group-topk, 1 when not given."""
    return cfg.group_topk or 1
