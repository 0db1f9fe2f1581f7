"""TA-MoE's topology-aware auxiliary loss (paper 002 §4, and the facts of the authors' release) on a top-k gate.

Derivation of the target dispatch pattern c_hat from a Topology (neither the paper copy nor the released code
gives it in full; this is ours, following the paper's alpha-beta model):

1. Cost model (Eq. 2). Source rank i sends x_ij bytes to rank j in one exchange; the delivery takes
   alpha_ij + beta_ij * x_ij (alpha, beta = 1/bandwidth of the pair's topology level). The exchange ends with its
   slowest delivery, so rank i minimises max_j (alpha_ij + beta_ij * x_ij) subject to sum_j x_ij = D (Eq. 3).
2. The optimum equalises the finish times of all used links ("water filling"): x_ij = max(0, (tau_i -
   alpha_ij) / beta_ij) with tau_i chosen so that the x_ij sum to D. We solve it exactly by bisection on tau.
   Without latency this is x_ij proportional to the link's bandwidth.
3. The rank's own expert(s) need no link, so the model puts no price on them; Eq. 4 (every expert receives a
   balanced total) fixes their share at the balanced 1/P, and the remaining (P-1)/P is water-filled over the
   other ranks. D = ``EXCHANGE_BYTES`` (64 MB a rank sends per all-to-all) * (P-1)/P; without latency the pattern
   does not depend on it.
4. Eq. 4 for asymmetric trees: Sinkhorn iterations make the matrix doubly stochastic (rows: what each source
   sends, columns: what each destination receives) while keeping its shape. Symmetric trees are unchanged.
5. Expert isolation (§4.2): c_hat = (1 - s) * c + s * uniform with s = ``SMOOTHING`` (0.1), so no expert is
   starved even behind a very slow link.

On [[0,1],[2,3]] with a 4:1 bandwidth ratio and no latency this gives row (1/4, 1/2, 1/8, 1/8): exactly the
paper's "uneven" pattern of Table 1.

The loss (the authors' release, reweighted GShard loss): for source rank i with fractions f_e of its token
choices and mean probabilities m_e, ``loss = E * sum_e w_e * f_e * m_e`` with w_e = (1/E) / c_hat_ie, where
c_hat_ie = c_hat_i,rank(e) / (experts per rank). Its balance point is f_e proportional to c_hat_ie (a GShard
loss is balanced when w_e * f_e is equal across experts); with a uniform c_hat it is exactly the GShard loss.

The loss steers every choice alike: each token's first expert drifts toward the source's node as much as its
second, which can cost quality per step (docs/topology-gates.md measures it); steering by bias (below) keeps the
quality per step of the aux-loss-free family.

**Steering by bias (with ``router_expert_bias``, the aux-loss-free family; no loss term).** Every sending rank i
keeps its own bias b_i[r], one value per destination rank r of its expert-parallel group (``sender_bias``, an fp32
buffer), added to the scores for the choice only, beside the shared per-expert bias of aux-loss-free balancing:
expert e is chosen by s_e + expert_bias_e + b_i[rank(e)]; the combine weights stay the scores. Once per global
batch (where the expert bias moves: ``balance.end_global_batch``, or the Megatron adapter's wrapped
``finalize_model_grads``) b_i moves by the sign of its dispatch error, DeepSeek-V3's rule applied per sender:
b_i[r] += u * sign(c_hat_ir * n_i - n_ir), n_ir = the assignments rank i sent to rank r since the last update
(kept ones, padding excluded), u = ``router_bias_update_rate``; then b_i is centred (mean 0), so only its shape
steers. Because c_hat is doubly stochastic (step 4), senders that meet their rows load every rank equally, and the
shared expert bias keeps the experts of one rank balanced. The bias needs no gradient and no gradient sync; under
tensor / context parallelism the counts are summed over ``seq_group`` and the row is the mean of the group's rows,
so every rank of the group keeps the same bias. Each rank's bias is its own: the trainers keep it with the
per-rank gate state of their checkpoints (gate_sync.rank_state), and a run resumed at another expert-parallel
size starts it from 0 (its rows no longer apply).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .balance import all_reduce_sum, group_size, switch_loss
from .base import Gate
from .registry import register_gate
from ..config import ConfigError, flag


EXCHANGE_BYTES = 64e6      # D: the bytes a rank sends per all-to-all in the alpha-beta model
SMOOTHING = 0.1            # s: the weight of the uniform pattern mixed into the target (expert isolation, §4.2)


def target_dispatch_pattern(topology, exchange_bytes: float = 64e6, smoothing: float = 0.0,
                            sinkhorn_iters: int = 50) -> torch.Tensor:
    """c_hat [P, P] float64: fraction of source i's dispatched tokens that should go to rank j (rows sum to 1)."""
    P = topology.num_ranks
    if P == 1:
        return torch.ones(1, 1, dtype=torch.float64)
    alpha = topology.latency_matrix()
    beta = 1.0 / topology.bandwidth_matrix()                      # 0 on the diagonal (no link)
    remote_bytes = exchange_bytes * (P - 1) / P
    c = torch.zeros(P, P, dtype=torch.float64)
    for i in range(P):                                            # P is the rank count, not tokens
        others = [j for j in range(P) if j != i]
        x = _water_fill(alpha[i, others], beta[i, others], remote_bytes)
        c[i, others] = x / exchange_bytes
        c[i, i] = 1.0 / P
    for _ in range(sinkhorn_iters):
        c = c / c.sum(1, keepdim=True)
        c = c / c.sum(0, keepdim=True)
    c = c / c.sum(1, keepdim=True)
    return (1.0 - smoothing) * c + smoothing / P


def _water_fill(alpha: torch.Tensor, beta: torch.Tensor, total: float) -> torch.Tensor:
    """x >= 0 with sum(x) = total minimising max(alpha + beta * x) over the links that carry data."""
    def sent(tau):
        return torch.clamp((tau - alpha) / beta, min=0.0)

    lo, hi = float(alpha.min()), float((alpha + beta * total).max())
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if float(sent(mid).sum()) < total:
            lo = mid
        else:
            hi = mid
    x = sent(hi)
    return x * (total / x.sum())


@register_gate("ta_moe")
class TopologyAwareGate(Gate):
    """Top-k gate whose balance loss steers the dispatch pattern toward c_hat (the topology's optimum)."""

    needs_topology = True
    balance_on_choice = True
    # each rank's loss has its own target; averaged gradients cancel them (measured on the emulated cluster,
    # docs/topology-gates.md), so by default every rank's gate learns from its own gradient
    default_gate_sync = "local"

    def __init__(self, cfg, hidden_size, ep=None, topology=None):
        super().__init__(cfg, hidden_size, ep=ep, topology=topology)
        topo = topology or cfg.build_topology()
        self.topology = topo
        pattern = target_dispatch_pattern(topo, EXCHANGE_BYTES, SMOOTHING)
        per_rank = cfg.num_experts // self.ep.size
        me = self.ep.global_rank_of(self.ep.rank)
        dest = [self.ep.global_rank_of(e // per_rank) for e in range(cfg.num_experts)]
        row = pattern[me, dest]                                   # restricted to the EP group's ranks
        target = (row / row.sum()).float()                        # c_hat_ie: fraction per expert, sums to 1
        self.register_buffer("target", target, persistent=False)
        self.register_buffer("loss_weight", (1.0 / cfg.num_experts) / target, persistent=False)
        self.steer_by_bias = bool(cfg.router_expert_bias)
        if self.steer_by_bias:
            self._pattern = pattern
            self._dest_global = [self.ep.global_rank_of(r) for r in range(self.ep.size)]
            self.register_buffer("rank_target", self._sender_row([me]), persistent=False)       # [R] c_hat_i,r
            self.register_buffer("dest_rank", torch.arange(cfg.num_experts) // per_rank, persistent=False)   # [E]
            # per-rank state: saved through gate_sync.rank_state, not the replicated state dict
            self.register_buffer("sender_bias", torch.zeros(self.ep.size, dtype=torch.float32), persistent=False)
            self.register_buffer("sender_tokens", torch.zeros(self.ep.size, dtype=torch.float32), persistent=False)

    per_rank_buffers = ("sender_bias",)
    fp32_buffers = Gate.fp32_buffers + ("sender_bias", "sender_tokens", "rank_target")

    def _sender_row(self, senders) -> torch.Tensor:
        """The target share c_hat_i,r of each destination rank r of the EP group, averaged over ``senders``."""
        rows = self._pattern[senders][:, self._dest_global].mean(0)
        return (rows / rows.sum()).float()

    def set_reduction_groups(self, seq_group=None, batch_group=None) -> None:
        super().set_reduction_groups(seq_group, batch_group)
        if self.steer_by_bias and group_size(seq_group) > 1:
            self.rank_target.copy_(self._sender_row(dist.get_process_group_ranks(seq_group)))

    @torch.no_grad()
    def _count_for_bias(self, ids, precut, kept, counts, weights, capacity, batch) -> None:
        super()._count_for_bias(ids, precut, kept, counts, weights, capacity, batch)
        if self.steer_by_bias:
            padding = batch.padding if batch is not None else None
            sent = kept if padding is None else kept & (~padding).unsqueeze(1)
            # weights, not a mask index: no data-dependent shape, no device sync
            self.sender_tokens += torch.bincount(self.dest_rank[ids].flatten(), weights=sent.flatten().float(),
                                                 minlength=self.ep.size)

    @torch.no_grad()
    def end_sender_batch(self) -> None:
        """The per-sender sign update of the module docstring (once per global batch; collective over
        ``seq_group`` when it has several ranks)."""
        if not self.steer_by_bias:
            return
        n = all_reduce_sum(self.sender_tokens, self.seq_group)
        # nothing sent: the sign is 0 everywhere and the bias stays (no host read)
        self.sender_bias.add_(torch.sign(self.rank_target * n.sum() - n) * self.cfg.router_bias_update_rate)
        self.sender_bias.sub_(self.sender_bias.mean())
        self.sender_tokens.zero_()

    @classmethod
    def has_per_rank_state(cls, cfg) -> bool:
        return bool(cfg.router_expert_bias)            # each sender's bias

    @classmethod
    def gate_sync_default(cls, cfg) -> str:
        """local for the loss (its per-rank targets cancel in averaged gradients); all when the bias steers."""
        return "all" if cfg is not None and cfg.router_expert_bias else cls.default_gate_sync

    @classmethod
    def check_options(cls, cfg, topology):
        if cfg.balance_coeff("aux_loss") <= 0 and not cfg.router_expert_bias:
            raise ConfigError(f"{flag('gate')}=ta_moe steers the dispatch only through its topology-aware loss (the "
                              f"aux_loss of {flag('load_balancing_type')}), and {flag('aux_loss_coeff')}="
                              f"{cfg.aux_loss_coeff} with {flag('load_balancing_type')}={cfg.load_balancing_type} "
                              f"switches it off; give aux_loss a coefficient > 0 (e.g. 0.01), or steer by bias "
                              f"with {flag('router_expert_bias')} (and a sigmoid score function)")
        pattern = target_dispatch_pattern(topology, EXCHANGE_BYTES, SMOOTHING)
        if float((pattern - 1.0 / topology.num_ranks).abs().max()) < 1e-6:
            return [f"--moe-gate=ta_moe on the topology {topology.spec()} (bandwidths "
                    f"{topology.bandwidth_gbps} GB/s per level): the derived target dispatch pattern is uniform, "
                    "so the loss is exactly the GShard balance loss; ta_moe needs ranks on links of different "
                    "cost (--moe-topology with several nodes and --moe-topology-bandwidth-gbps)"]
        return []

    def select(self, logits, probs):
        if self.steer_by_bias:
            ids = self.topk(logits, probs + self.sender_bias[self.dest_rank], self.top_k)
        else:
            ids = self.topk(logits, probs, self.top_k)
        return ids, torch.ones_like(ids, dtype=torch.bool)

    def balance_loss(self, scores, ids, valid, coeff):
        """E * coeff * sum_e w_e * f_e * m_e over the gate's own choices (module docstring), counts over
        ``seq_group``."""
        counts, total = self.group_counts(ids, valid)
        weight = None if self.steer_by_bias else self.loss_weight     # the bias steers; a loss then only balances
        return switch_loss(scores.sum(0), counts, total, ids.shape[1], self.num_experts, coeff, weight)
