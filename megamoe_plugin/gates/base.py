"""Routing (what every gate returns), TokenBatch (where the routed tokens sit) and the Gate base class.

A gate maps tokens x[T, H] to a Routing: expert ids [T, k], combine weights [T, k], which of the T*k assignments
survive (``kept``), per-expert kept counts, the dropped count, and its aux losses (already scaled by their
coefficients). The base class is megatron-core 0.19's router, step by step (``TopKRouter.routing``):

1. logits = x W^T (+ b) in the router dtype, after Switch's multiplicative input jitter in training;
2. the z-loss (ST-MoE) on the logits;
3. scores by the score function (softmax / sigmoid / sqrtsoftplus, gates/scores.py); the expert bias (aux-loss-free
   balancing, an fp32 buffer) is added for the choice only;
4. ``select``: the gate's own rule (subclasses); the default is the top-k, group-limited when asked, or one of the
   balancing rules that choose the experts themselves (sinkhorn, quantile balancing);
5. the combine weights (softmax over the chosen logits or the full softmax, normalised sigmoid scores, scaling);
6. the capacity cut (gates/capacity.py: drop policy choice / probs / position) when a capacity is given;
7. the balance losses (gates/balance.py: aux_loss, seq_aux_loss, global_aux_loss) on the scores over all experts;
8. the expert bias's token counts (training only, padding excluded), which ``balance.end_global_batch`` (or
   megatron-core's ``finalize_model_grads``, which finds the buffers by their megatron-core names) turns into
   the once-per-global-batch sign update.

Counts the losses need over several ranks are summed over ``seq_group`` (the ranks that split one batch of
sequences: Megatron's tensor x context parallel group) and, for the global loss, ``batch_group`` (every rank of
the global batch); both default to none (one rank), ``set_reduction_groups`` sets them.

Cached assignments (DynaMoE §4.2, ``dynamic/assignment_cache.py``): ``forward(x, capacity, assigned=ids)`` routes
by the given ids [T, k] instead of the gate's choice. Which assignments are kept, their buffer slots and the counts
come from those ids alone, so dispatch and the experts need nothing from the gate; the gate still computes its
logits (the combine weights are its weights at the assigned experts, so it keeps training), its balance losses
and its own choice (``Routing.gate_ids``, which refreshes the cache). On a GPU that gate work runs on a side stream,
concurrently with the dispatch and the experts; ``Routing.join()`` (called before the combine) waits for it.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..config import INIT_STD, MoEConfig
from ..parallel import ExpertParallel
from .balance import all_reduce_sum, expert_counts, group_size, sequence_prob_sums, switch_loss, z_loss
from .capacity import (apply_capacity, capacity_from_factor, capacity_mask_counts,  # noqa: F401  (re-exported)
                       masked_expert_ids)
from .scores import (aux_loss_scores, combine_weights, expert_scores, quantile_select, sinkhorn_select, topk_ids)
from ..config import ConfigError, flag

_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


@dataclass
class Routing:
    expert_ids: torch.Tensor            # [T, k] long, global expert ids
    weights: torch.Tensor               # [T, k] combine weights (0 where dropped)
    kept: torch.Tensor                  # [T, k] bool
    counts: torch.Tensor                # [E] long, kept assignments per expert (this rank's tokens)
    dropped: torch.Tensor               # [] long, assignments dropped (capacity, random routing, no room)
    aux_losses: Dict[str, torch.Tensor] = field(default_factory=dict)
    slots: Optional[torch.Tensor] = None  # [T, k] long, position in the expert's capacity buffer (capacity mode)
    demand: Optional[torch.Tensor] = None  # [E] long, assignments per expert before the capacity cut (capacity mode)
    gate_ids: Optional[torch.Tensor] = None  # [T, k] the gate's own choice when expert_ids came from a cache
    side_stream: Any = None               # CUDA stream still computing the weights / aux losses (cached routing)
    valid_tokens: Any = None              # this rank's tokens that count in the losses (padding excluded)

    def join(self) -> None:
        """Make the current stream wait for the gate's side stream (no-op on CPU or without caching)."""
        if self.side_stream is not None:
            torch.cuda.current_stream().wait_stream(self.side_stream)
            self.side_stream = None

    @property
    def chosen_ids(self) -> torch.Tensor:
        """The gate's own choice [T, k] (what an assignment cache stores and compares)."""
        return self.gate_ids if self.gate_ids is not None else self.expert_ids

    @cached_property
    def masked_ids(self) -> torch.Tensor:
        """[T*k] expert id of every assignment, token-major, with dropped ones set to E (they sort last).
        Computed once per call: the counts and the dropless dispatcher's argsort both read it."""
        return masked_expert_ids(self.expert_ids, self.kept, self.counts.numel())

    @property
    def top_k(self) -> int:
        return self.expert_ids.shape[1]

    def aux_loss(self) -> torch.Tensor:
        if not self.aux_losses:
            return self.weights.new_zeros(())
        return sum(self.aux_losses.values())


@dataclass
class TokenBatch:
    """Where the T routed tokens sit in the micro-batch: their sequence (the per-sequence loss) and padding."""
    num_sequences: int = 1
    sequence_of: Optional[torch.Tensor] = None    # [T] long, each token's sequence (None: one sequence)
    padding: Optional[torch.Tensor] = None        # [T] bool, True = a padding token (counts in no loss)

    @classmethod
    def from_shape(cls, shape: Sequence[int], layout: str = "sb", padding: Optional[torch.Tensor] = None,
                   select: Optional[torch.Tensor] = None, device=None) -> "TokenBatch":
        """Tokens of a [S, B] ("sb", Megatron's and fairseq's) or [B, S] ("bs") batch, flattened; ``select``: the
        flat indices of the tokens routed (the rest were removed); ``padding`` over the routed tokens."""
        if len(shape) < 2:
            return cls(1, None, padding)
        seq_axis = 1 if layout == "sb" else 0
        num = int(shape[seq_axis])
        idx = select if select is not None else torch.arange(int(torch.tensor(shape).prod()), device=device)
        sequence_of = idx % num if layout == "sb" else idx // int(shape[1])
        return cls(num, sequence_of, padding)


class Gate(nn.Module):
    """The router: linear layer + the steps of the module docstring. Subclasses set the choice in ``select``."""

    def __init__(self, cfg: MoEConfig, hidden_size: int, ep: Optional[ExpertParallel] = None, topology=None):
        super().__init__()
        self.cfg = cfg
        self.num_experts = cfg.num_experts
        self.top_k = cfg.top_k
        self.ep = ep or ExpertParallel(None)
        self.topology = topology
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden_size))
        nn.init.normal_(self.weight, std=INIT_STD)
        self.weight.megamoe_gate = True          # found by gate_sync.py (--moe-gate-sync local / average:K)
        self.bias = None
        if cfg.linear_bias:
            self.bias = nn.Parameter(torch.empty(cfg.num_experts))
            nn.init.normal_(self.bias, std=INIT_STD)
            self.bias.megamoe_gate = True
        self.losses = cfg.balance_losses
        self.routing_rule = cfg.balance_routing
        E = cfg.num_experts
        # megatron-core's names, so that its finalize_model_grads finds and updates these buffers
        if cfg.router_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32))
            self.register_buffer("local_tokens_per_expert", torch.zeros(E, dtype=torch.float32), persistent=False)
        if cfg.balance_coeff("global_aux_loss") > 0:
            self.register_buffer("global_tokens_per_expert", torch.zeros(E, dtype=torch.float32), persistent=False)
            self.register_buffer("ga_steps", torch.zeros((), dtype=torch.float32), persistent=False)
        if self.routing_rule == "quantile_balancing":
            self.register_buffer("qb_beta", torch.zeros(E, dtype=torch.float32))
            self.register_buffer("qb_beta_accum", torch.zeros(E, dtype=torch.float32), persistent=False)
            self.register_buffer("qb_beta_count", torch.zeros((), dtype=torch.long), persistent=False)
        self.seq_group = None
        self.batch_group = None

    # --- the gate's rules, asked before any model exists ------------------------------------------------------
    fixed_top_k: Optional[int] = None       # the only top-k this gate routes with (None: any)
    needs_topology = False                  # its routing reads the job's topology (nodes, link bandwidths)
    default_gate_sync = "all"               # what --moe-gate-sync auto means for this gate
    balance_on_choice = False               # the aux loss counts the gate's own choice (else the router's top-k)
    fp32_buffers = ("expert_bias", "local_tokens_per_expert", "qb_beta", "qb_beta_accum")   # never cast

    @classmethod
    def has_per_rank_state(cls, cfg: MoEConfig) -> bool:
        """Whether this gate, with these options, keeps buffers of its own per rank (``per_rank_buffers``)."""
        return False

    @classmethod
    def gate_sync_default(cls, cfg: Optional[MoEConfig]) -> str:
        """What --moe-gate-sync auto means for this gate with these options."""
        return cls.default_gate_sync

    @classmethod
    def validate_config(cls, cfg: MoEConfig) -> None:
        """Raise ``ConfigError`` (naming the flag) for options this gate cannot work with; no topology, no
        environment (``MoEConfig.validate`` calls it)."""
        if cls.fixed_top_k is not None and cfg.top_k != cls.fixed_top_k:
            raise ConfigError(f"{flag('top_k')}={cfg.top_k!r}: the {cfg.gate} gate routes each token to "
                              f"{cls.fixed_top_k} expert{'s' if cls.fixed_top_k > 1 else ''}; use {flag('top_k')}="
                              f"{cls.fixed_top_k} (or the topk gate for other k)")

    @classmethod
    def check_options(cls, cfg: MoEConfig, topology) -> List[str]:
        """Before any model exists: raise ``ConfigError`` (naming the flag) for settings this gate cannot work
        with, and return warnings for settings it accepts but that make it behave like another gate.
        ``topology`` is the job's Topology (``cfg.build_topology()``)."""
        return []

    def set_reduction_groups(self, seq_group=None, batch_group=None) -> None:
        """``seq_group``: ranks splitting one batch of sequences (tensor x context parallel); ``batch_group``: every
        rank of the global batch (data x tensor x context parallel). None = this rank alone."""
        self.seq_group, self.batch_group = seq_group, batch_group

    # --- the choice (subclasses) ----------------------------------------------------------------------------------
    def select(self, logits: torch.Tensor, probs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Return (expert_ids [T, k] long, kept [T, k] bool) from the router dtype's logits and the fp32 scores
        the choice compares (``probs``: the score function's, plus the expert bias when it is on)."""
        ids = self.topk(logits, probs, self.top_k)
        return ids, torch.ones_like(ids, dtype=torch.bool)

    def topk(self, logits: torch.Tensor, probs: torch.Tensor, k: int) -> torch.Tensor:
        """The k best experts [T, k], group-limited when configured. softmax scores with normalisation choose on
        the logits (megatron-core: group scores then sum logits), otherwise on ``probs``."""
        cfg = self.cfg
        return topk_ids(self.choice_basis(logits, probs), k, cfg.num_groups, cfg.group_topk)

    def choice_basis(self, logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """What the top-k compares: the logits for softmax with normalisation (megatron-core), else ``probs``."""
        cfg = self.cfg
        on_logits = cfg.score_function == "softmax" and cfg.normalize_top_k and logits is not None
        return logits if on_logits else probs

    def balance_loss(self, scores: torch.Tensor, ids: torch.Tensor, valid: Optional[torch.Tensor],
                     coeff: float) -> torch.Tensor:
        """The aux_loss term: Switch's loss on the assignments ``ids`` (the router's top-k, or the gate's own
        choice when ``balance_on_choice``), counts summed over ``seq_group``."""
        counts, total = self.group_counts(ids, valid)
        return switch_loss(scores.sum(0), counts, total, ids.shape[1], self.num_experts, coeff)

    def group_counts(self, ids: torch.Tensor, valid: Optional[torch.Tensor]):
        """(assignments per expert summed over ``seq_group``, the group's token count behind them)."""
        counts = all_reduce_sum(expert_counts(ids, self.num_experts, valid), self.seq_group)
        return counts, self._group_tokens(counts, ids.shape[1], valid, ids.shape[0] * group_size(self.seq_group))

    # --- shared ------------------------------------------------------------------------------------------------
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.cfg.jitter_eps > 0:
            x = jitter(x, self.cfg.jitter_eps)
        dtype = _ROUTER_DTYPES.get(self.cfg.router_dtype, x.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(x.to(dtype), self.weight.to(dtype), bias)

    def forward(self, x: torch.Tensor, capacity: Optional[Sequence[int]] = None,
                assigned: Optional[torch.Tensor] = None, batch: Optional[TokenBatch] = None) -> Routing:
        if assigned is not None:
            return self._forward_assigned(x, capacity, assigned, batch)
        self._keep_fp32_state()
        logits, scores, ids, kept, weights, aux = self._decide(x, batch)
        return self._routing(x, ids, kept, weights, capacity, scores, aux, batch)

    def _decide(self, x: torch.Tensor, batch: Optional[TokenBatch]):
        """logits, scores [T, E] (fp32), the gate's choice (ids, kept), its weights [T, k] and its aux losses."""
        cfg = self.cfg
        padding = batch.padding if batch is not None else None
        logits = self.logits(x)
        learning = self.training and torch.is_grad_enabled() and x.shape[0] > 0
        aux = {}
        if learning and cfg.z_loss_coeff > 0:
            aux["z"] = z_loss(logits, cfg.z_loss_coeff / group_size(self.seq_group), padding)
        scores = expert_scores(logits, cfg.score_function)
        if self.routing_rule == "sinkhorn":
            ids, weights = sinkhorn_select(logits, self.top_k, self.training)
            kept = torch.ones_like(ids, dtype=torch.bool)
        else:
            if self.routing_rule == "quantile_balancing":
                ids = self._quantile_choice(logits)
                kept = torch.ones_like(ids, dtype=torch.bool)
            else:
                ids, kept = self.select(logits, scores if getattr(self, "expert_bias", None) is None
                                        else scores + self.expert_bias)
            weights = combine_weights(logits, scores, ids, cfg.score_function, cfg.normalize_top_k,
                                      cfg.topk_scaling_factor)
        if learning and self.losses:
            aux.update(self._balance_losses(logits, scores, ids, kept, batch))
        return logits, scores, ids, kept, weights * kept, aux

    def _balance_losses(self, logits, scores, ids, kept, batch) -> Dict[str, torch.Tensor]:
        # the losses measure the router's unconstrained top-k: the choice itself when nothing constrained it
        plain = (type(self).select is Gate.select and type(self).topk is Gate.topk and self.routing_rule is None
                 and not self.cfg.group_topk
                 and getattr(self, "expert_bias", None) is None)
        aux_scores, aux_ids = aux_loss_scores(logits, scores, self.cfg.score_function, self.top_k,
                                              ids if plain else None)
        valid = None if batch is None or batch.padding is None else ~batch.padding
        if valid is not None:
            aux_scores = aux_scores * valid.unsqueeze(-1)
        out = {}
        for kind, coeff in self.losses:
            if kind == "aux_loss":
                choice = torch.where(kept, ids, self.num_experts) if self.balance_on_choice else aux_ids
                out["balance"] = self.balance_loss(aux_scores, choice, valid, coeff)
            elif kind == "seq_aux_loss":
                out["seq_balance"] = self._sequence_loss(aux_scores, aux_ids, valid, batch, coeff)
            else:
                out["global_balance"] = self._global_loss(aux_scores, aux_ids, valid, coeff)
        return out

    def _group_tokens(self, group_counts, k: int, valid, unpadded_total):
        """Tokens behind group-summed counts: all of them, or the valid ones (counts / k) with a padding mask."""
        return unpadded_total if valid is None else group_counts.sum() / k

    def _sequence_loss(self, scores, ids, valid, batch, coeff):
        """seq_aux_loss: Switch's loss per sequence (counts over ``seq_group``), averaged over the sequences; a
        sequence's token count is the group's tokens / sequences (megatron-core's, for equal lengths)."""
        seq_of = batch.sequence_of if batch is not None else None
        S = batch.num_sequences if seq_of is not None else 1
        counts = all_reduce_sum(expert_counts(ids, self.num_experts, valid, seq_of, S).view(S, -1),
                                  self.seq_group)
        total = self._group_tokens(counts, ids.shape[1], valid, ids.shape[0] * group_size(self.seq_group)) / S
        prob_sums = sequence_prob_sums(scores, seq_of, S)
        return switch_loss(prob_sums, counts, total, ids.shape[1], self.num_experts, coeff) / S

    def _global_loss(self, scores, ids, valid, coeff):
        """global_aux_loss: counts over ``batch_group``, averaged over this global batch's micro-batches so far."""
        counts = all_reduce_sum(expert_counts(ids, self.num_experts, valid), self.batch_group)
        self.global_tokens_per_expert += counts
        self.ga_steps += 1
        total = self._group_tokens(counts, ids.shape[1], valid, ids.shape[0] * group_size(self.batch_group))
        return switch_loss(scores.sum(0), self.global_tokens_per_expert / self.ga_steps, total, ids.shape[1],
                             self.num_experts, coeff)

    def _quantile_choice(self, logits: torch.Tensor) -> torch.Tensor:
        """Quantile balancing's choice on the logits of the whole ``seq_group`` (a sequence's tokens together);
        in training its quantiles accumulate for the once-per-global-batch bias update."""
        update = self.training and torch.is_grad_enabled()
        size = group_size(self.seq_group)
        with torch.no_grad():
            local = logits.detach().float().contiguous()
            full = local
            if size > 1:
                full = local.new_empty(local.shape[0] * size, local.shape[1])
                dist.all_gather_into_tensor(full, local, group=self.seq_group)
            ids, quantile = quantile_select(full, self.top_k, self.qb_beta, update)
            if update:
                self.qb_beta_accum.add_(quantile)
                self.qb_beta_count.add_(1)
            if size > 1:
                me = dist.get_rank(self.seq_group)
                ids = ids[me * local.shape[0]:(me + 1) * local.shape[0]].contiguous()
        return ids

    def _keep_fp32_state(self) -> None:
        """The balancing buffers stay fp32 when the model is cast (megatron-core's Float16Module casts buffers)."""
        for name in self.fp32_buffers:
            t = getattr(self, name, None)
            if t is not None and t.dtype != torch.float32:
                t.data = t.data.float()

    def _load_from_state_dict(self, *args, **kwargs):
        self._keep_fp32_state()          # load the checkpoint's fp32 bias into an fp32 buffer, not a cast copy
        return super()._load_from_state_dict(*args, **kwargs)

    def _save_to_state_dict(self, *args, **kwargs):
        self._keep_fp32_state()
        return super()._save_to_state_dict(*args, **kwargs)

    def reset_global_batch_state(self) -> None:
        """Start a new global batch: the expert bias's counts, the global loss's counts, the quantile sums."""
        for name in ("local_tokens_per_expert", "qb_beta_accum", "qb_beta_count"):
            t = getattr(self, name, None)
            if t is not None:
                t.zero_()
        self.reset_global_aux_loss_tracker()

    def reset_global_aux_loss_tracker(self) -> None:
        """megatron-core's name: its finalize_model_grads calls it once per global batch."""
        if getattr(self, "global_tokens_per_expert", None) is not None:
            self.global_tokens_per_expert.zero_()
            self.ga_steps.zero_()

    def final_weights(self, weights: torch.Tensor, ids: torch.Tensor, kept: torch.Tensor, scores) -> torch.Tensor:
        """The combine weights after the capacity cut: the choice's weights where kept (megatron-core)."""
        return weights * kept

    def _cut(self, ids: torch.Tensor, kept: torch.Tensor, capacity: Optional[Sequence[int]], weights,
             policy: Optional[str] = None):
        """The capacity cut: (kept, slots, pre-cut demand per expert); no cut without capacity."""
        if capacity is None:
            return kept, None, None
        demand = torch.bincount(masked_expert_ids(ids, kept, self.num_experts),
                                minlength=self.num_experts + 1)[: self.num_experts]
        kept, slots = apply_capacity(ids, kept, capacity, policy or self.cfg.drop_policy, weights)
        return kept, slots, demand

    def _routing(self, x, ids, kept, weights, capacity, scores, aux, batch) -> Routing:
        precut = kept
        kept, slots, demand = self._cut(ids, kept, capacity, weights)
        flat = masked_expert_ids(ids, kept, self.num_experts)
        counts = torch.bincount(flat, minlength=self.num_experts + 1)[: self.num_experts]
        if getattr(self, "expert_bias", None) is not None and self.training and torch.is_grad_enabled():
            self._count_for_bias(ids, precut, kept, counts, weights, capacity, batch)
        dropped = kept.numel() - kept.sum()
        padding = batch.padding if batch is not None else None
        valid = x.shape[0] if padding is None else (~padding).sum()
        routing = Routing(ids, self.final_weights(weights, ids, kept, scores).to(x.dtype), kept, counts, dropped,
                          aux, slots, demand, valid_tokens=valid)
        routing.__dict__["masked_ids"] = flat          # fill the cached property: no second pass
        return routing

    @torch.no_grad()
    def _count_for_bias(self, ids, precut, kept, counts, weights, capacity, batch) -> None:
        """The tokens each expert takes this call (the expert bias's load; padding tokens excluded). With
        ``pad_to_capacity`` megatron-core's routing map is the whole capacity mask: every expert takes
        min(capacity, T) rows."""
        padding = batch.padding if batch is not None else None
        if capacity is not None and self.cfg.pad_to_capacity:
            counts = capacity_mask_counts(ids, precut, capacity, self.cfg.drop_policy, weights, padding, counts)
        elif padding is not None:
            counts = torch.bincount(masked_expert_ids(ids, kept & (~padding).unsqueeze(1), self.num_experts),
                                    minlength=self.num_experts + 1)[: self.num_experts]
        self.local_tokens_per_expert += counts.to(torch.float32)

    def _forward_assigned(self, x: torch.Tensor, capacity, assigned: torch.Tensor, batch) -> Routing:
        """Route by cached ids: kept/slots/counts from the ids alone (the dispatch can start at once); the gate's
        logits, weights, aux losses and own choice on a side stream when on a GPU (module docstring)."""
        self._keep_fp32_state()
        ids = assigned.to(torch.long)
        # the weights are not known yet: a cached call keeps assignments in choice or token order
        policy = "choice" if self.cfg.drop_policy == "choice" else "position"
        kept, slots, demand = self._cut(ids, torch.ones_like(ids, dtype=torch.bool), capacity, None, policy)
        flat = masked_expert_ids(ids, kept, self.num_experts)
        counts = torch.bincount(flat, minlength=self.num_experts + 1)[: self.num_experts]
        side = None
        if x.is_cuda:
            side = _side_stream(x.device)
            side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            logits, scores, gate_ids, _, _, aux = self._decide(x, batch)
            weights = combine_weights(logits, scores, ids, self.cfg.score_function, self.cfg.normalize_top_k,
                                      self.cfg.topk_scaling_factor)
            weights = self.final_weights(weights, ids, kept, scores).to(x.dtype)
        if side is not None:            # tensors made on the side stream, used on the current one
            for t in [weights, gate_ids, *aux.values()]:
                t.record_stream(torch.cuda.current_stream(x.device))
        routing = Routing(ids, weights, kept, counts, kept.numel() - kept.sum(), aux, slots, demand, gate_ids, side,
                          valid_tokens=x.shape[0])
        routing.__dict__["masked_ids"] = flat
        return routing


def jitter(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Switch's multiplicative input jitter, x * U(1 - eps, 1 + eps), drawn as megatron-core draws it."""
    low = torch.tensor(1.0 - eps, dtype=x.dtype, device=x.device)
    high = torch.tensor(1.0 + eps, dtype=x.dtype, device=x.device)
    return x * (low + torch.rand(x.shape, dtype=x.dtype, device=x.device) * (high - low))


_SIDE_STREAMS: Dict[Any, Any] = {}


def _side_stream(device):
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def assignment_fractions(expert_ids: torch.Tensor, kept: torch.Tensor, num_experts: int) -> torch.Tensor:
    """f_e: fraction of the token's (kept) choices going to each expert, [E] float (no gradient)."""
    flat = masked_expert_ids(expert_ids, kept, num_experts)
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts].float()
    return counts / max(expert_ids.numel(), 1)


def expert_nodes(topology, ep: ExpertParallel, num_experts: int):
    """([E] the topology node of each expert's home rank in the EP group, this rank's node); experts sit in
    contiguous blocks over the EP ranks."""
    if topology.num_ranks <= max(ep.global_ranks):
        raise ValueError(f"--moe-topology={topology.spec()} has {topology.num_ranks} ranks but the expert-parallel "
                         f"group holds global rank {max(ep.global_ranks)}")
    per_rank = num_experts // ep.size
    nodes = topology.node_ids()
    return ([nodes[ep.global_rank_of(e // per_rank)] for e in range(num_experts)],
            nodes[ep.global_rank_of(ep.rank)])
