"""CostModel: predicted time of one MoE layer's training step from a routing count matrix and an expert placement.

Owns the per-layer cost model shared by the planners and simulators:

* computation, paper 003 (FasterMoE) §3.1 Eq.1: ``Lat_comp = max_w 4 B_w alpha H^2 / P_w`` for one forward of the
  expert FFN (two GEMMs, 2 FLOPs per FMA; here alpha H = ``LayerShape.ffn``), or, when a profiled throughput is
  given, paper 001 (FlexMoE) §3.4 Eq.7 ``T_C = I_{e,g} / TPS`` summed over a GPU's experts (max over GPUs);
* all-to-all, paper 003 §3.2 Eq.2 over the ``Network`` (the topology-aware refinement of FlexMoE Eq.8's
  per-pair ``count / Bw``: shared links are charged once with all the traffic crossing them);
* synchronous step, paper 003 §3.3/§4.1 Eq.7: 3 x forward computation (forward + 2 backward GEMMs) and
  4 x all-to-all (2 forward, 2 backward);
* replicated experts, paper 001 §3.4 Eq.9: ``T_Sync = size(e.gradients) / BPS(group)`` per replicated expert,
  BPS profiled per device group or derived from the network's ring all-reduce; FlexMoE's flexible routing
  (Algorithm 3: an expert's tokens split evenly over its replicas, each source filling its own replica first),
  all of it charged to the step (an upper bound where the all-reduces overlap the layers below);
* shadowing, paper 003 §4.1 Eq.8: a shadowed expert's tokens stay on their source, its parameters are broadcast
  and its gradients reduced (``shadow_layer_time``), all of it charged to the step;
* expert moves, paper 001 §3.4 "Expert Adjustment Cost": size(model states) / Bw_{g,g'} (``move_time``), paid
  between two steps.

Units: seconds, bytes, FLOP/s; token counts are torch tensors of any dtype (fractions allowed).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, Iterable, Optional, Sequence, Union

import torch

from ..placement.state import flexible_route
from .network import Network

Placement = Optional[Sequence[Union[int, Sequence[int]]]]


@dataclass
class LayerShape:
    """One MoE FFN layer: hidden = H, ffn = alpha*H (an expert's inner width), num_experts E, element size."""
    hidden: int
    ffn: int
    num_experts: int
    bytes_per_element: int = 2

    @property
    def expert_param_bytes(self) -> int:
        """Two weight matrices H x ffn (biases neglected, as in the papers)."""
        return 2 * self.hidden * self.ffn * self.bytes_per_element

    @property
    def token_bytes(self) -> int:
        """One token's embedding, the unit of all-to-all traffic."""
        return self.hidden * self.bytes_per_element

    @property
    def flops_per_token(self) -> int:
        """Forward FLOPs of one token through one expert: 4 alpha H^2 (paper 003 Eq.1)."""
        return 4 * self.hidden * self.ffn

    @property
    def layer_param_bytes(self) -> int:
        """All experts' parameters: 2 N alpha H^2 elements, what data parallelism all-reduces (paper 003 §3.3)."""
        return self.num_experts * self.expert_param_bytes


@dataclass
class Breakdown:
    compute: float
    alltoall: float
    sync: float
    total: float

    def as_dict(self) -> Dict[str, float]:
        return asdict(self)


class CostModel:
    """Per-layer time model over a ``Network`` (see the module docstring for the equations).

    gemm_flops: FLOP/s per device (P_w of Eq.1), a float or one value per rank. tokens_per_second: forward
    tokens/s of one expert per device (FlexMoE's TPS, float or per rank); when given it replaces Eq.1.
    sync_bps: profiled all-reduce bytes/s per device group, keyed by the sorted tuple of its ranks.
    shared_gemm_flops: FLOP/s of a compute pool all ranks share (CPU ranks on one machine's cores: a rank runs
    faster while the others wait); 0 = every rank computes on its own device (GPUs).
    bcast: (bytes/s, latency s) of a broadcast or reduce over all ranks as measured on the job (the collective
    library's own algorithm); None = the network's pipelined chain (shadowing's Eq. 8)."""

    def __init__(self, network: Network, gemm_flops, shape: LayerShape, tokens_per_second=None,
                 sync_bps: Optional[dict] = None, shared_gemm_flops: float = 0.0, bcast: Optional[tuple] = None):
        self.network = network
        self.shape = shape
        self.num_ranks = network.num_ranks
        self.gemm_flops = self._per_rank(gemm_flops, "gemm_flops")
        self.tokens_per_second = None if tokens_per_second is None else \
            self._per_rank(tokens_per_second, "tokens_per_second")
        self.sync_bps = {tuple(sorted(int(r) for r in k)): float(v) for k, v in (sync_bps or {}).items()}
        self.shared_gemm_flops = float(shared_gemm_flops or 0.0)
        self.bcast = bcast          # (bytes/s, seconds) of one measured broadcast (or reduce) over all ranks

    def _per_rank(self, value, what) -> torch.Tensor:
        t = torch.as_tensor(value, dtype=torch.float64).reshape(-1)
        if t.numel() == 1:
            t = t.expand(self.num_ranks).clone()
        if t.numel() != self.num_ranks:
            raise ValueError(f"{what}: {t.numel()} values for {self.num_ranks} ranks")
        if not bool((t > 0).all()):
            raise ValueError(f"{what} must be > 0")
        return t

    # --- the three terms ---------------------------------------------------------------------------------------
    def compute_time(self, tokens_per_rank) -> float:
        """One forward of the expert FFNs, Eq.1: max_w 4 B_w H ffn / P_w (or max_w B_w / TPS_w); with a shared
        compute pool, at least the total work over the pool's rate."""
        b = torch.as_tensor(tokens_per_rank).to(torch.float64).reshape(-1)
        if b.numel() != self.num_ranks:
            raise ValueError(f"tokens_per_rank: {b.numel()} values for {self.num_ranks} ranks")
        if self.tokens_per_second is not None:
            return float((b / self.tokens_per_second).max())
        t = float((self.shape.flops_per_token * b / self.gemm_flops).max())
        if self.shared_gemm_flops > 0:
            t = max(t, float(self.shape.flops_per_token * b.sum() / self.shared_gemm_flops))
        return t

    def alltoall_time(self, rank_tokens) -> float:
        """One all-to-all-v of [P, P] tokens src -> dst (Eq.2 over the network)."""
        t = torch.as_tensor(rank_tokens).to(torch.float64)
        return self.network.alltoallv_time(t * self.shape.token_bytes)

    def sync_time(self, nbytes, ranks) -> float:
        """FlexMoE Eq.9: nbytes / BPS(group); BPS profiled in sync_bps, else the network's ring all-reduce over
        the sorted group. 0 for a group of one rank."""
        group = tuple(sorted({int(r) for r in ranks}))
        if len(group) < 2 or float(nbytes) <= 0:
            return 0.0
        if group in self.sync_bps:
            return float(nbytes) / self.sync_bps[group]
        return self.network.allreduce_time(nbytes, list(group))

    def move_time(self, nbytes, src, dst) -> float:
        """Moving an expert's model states (parameters + optimizer state: pass their bytes) src -> dst."""
        return self.network.p2p_time(nbytes, src, dst)

    def placement_matrix(self, placement: Placement = None, num_experts: Optional[int] = None) -> torch.Tensor:
        """[E, P] replica multiplicity of each expert on each rank (FlexMoE vExperts: a rank may hold several).

        None: contiguous blocks, expert e on rank e // (E / P) (needs E a multiple of P)."""
        p = self.num_ranks
        if placement is None:
            e = self.shape.num_experts if num_experts is None else int(num_experts)
            if e < p or e % p:
                raise ValueError(f"default placement needs num_experts ({e}) a multiple of the ranks ({p}); "
                                 "pass a placement")
            m = torch.zeros(e, p, dtype=torch.float64)
            m[torch.arange(e), torch.arange(e) // (e // p)] = 1.0
            return m
        if num_experts is not None and len(placement) != num_experts:
            raise ValueError(f"placement lists {len(placement)} experts, counts have {num_experts}")
        m = torch.zeros(len(placement), p, dtype=torch.float64)
        for e, ranks in enumerate(placement):
            ranks = [ranks] if isinstance(ranks, int) else list(ranks)
            if not ranks:
                raise ValueError(f"expert {e} has no replica")
            for r in ranks:
                if not 0 <= int(r) < p:
                    raise ValueError(f"expert {e}: rank {r} out of range 0..{p - 1}")
                m[e, int(r)] += 1.0
        return m

    def route(self, counts, placement: Placement = None) -> torch.Tensor:
        """[P, P] tokens src -> dst rank (diagonal: tokens computed where they are) for counts [P, E].

        A replicated expert's tokens are split evenly over its replicas (capacity I_e / n_e each); a source fills
        its own replica first (up to its capacity), the rest of every source's tokens go to the replicas with
        room left, in proportion to that room (FlexMoE Algorithm 3, locality first). Unreplicated experts get
        all their tokens. The per-expert split is ``placement.state.flexible_route``; this sums it over experts."""
        c = self._counts(counts)
        return self._route(c, self.placement_matrix(placement, c.shape[1]))

    @staticmethod
    def _route(c: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """[P, P] of ``placement.state.flexible_route`` (the one implementation of Algorithm 3)."""
        return flexible_route(c, m).sum(1)

    def layer_time(self, counts, placement: Placement = None) -> Breakdown:
        """Synchronous training step of one MoE layer: 3 x compute + 4 x all-to-all + sum of replicated experts'
        Eq.9 synchronisation (parameter bytes over the sorted group of distinct ranks holding it)."""
        c = self._counts(counts)
        return self.layer_time_matrix(c, self.placement_matrix(placement, c.shape[1]))

    def layer_time_matrix(self, counts, multiplicity: torch.Tensor, sync_cache: Optional[dict] = None) -> Breakdown:
        """``layer_time`` for an [E, P] vExpert multiplicity matrix (``placement_matrix`` / ``PlacementState.
        multiplicity``). ``sync_cache``: a dict the caller keeps to memoise Eq.9 per rank group (planners that
        score many placements on one cost model)."""
        c = self._counts(counts)
        m = torch.as_tensor(multiplicity).to(torch.float64)
        rank_tokens = self._route(c, m)
        comp = 3.0 * self.compute_time(rank_tokens.sum(0))
        a2a = 4.0 * self.alltoall_time(rank_tokens)
        sync = self.replica_sync_time(m, sync_cache)
        return Breakdown(comp, a2a, sync, comp + a2a + sync)

    def replica_sync_time(self, multiplicity: torch.Tensor, sync_cache: Optional[dict] = None) -> float:
        """Eq.9 summed over the experts replicated on more than one rank of an [E, P] multiplicity matrix."""
        m = torch.as_tensor(multiplicity)
        sync = 0.0
        size = self.shape.expert_param_bytes
        for e in ((m > 0).sum(1) > 1).nonzero().reshape(-1).tolist():
            group = tuple(m[e].nonzero().reshape(-1).tolist())
            if sync_cache is None:
                sync += self.sync_time(size, group)
            else:
                if group not in sync_cache:
                    sync_cache[group] = self.sync_time(size, group)
                sync += sync_cache[group]
        return sync

    def shadow_layer_time(self, counts, shadowed: Iterable[int], placement: Placement = None) -> Breakdown:
        """FasterMoE dynamic shadowing (paper 003 §4.1, Eq.8 on the network): the experts in `shadowed` are
        replicated on every rank, their tokens computed where they are; for each, its parameters are broadcast
        from its owner (first replica) and its gradients reduced back, both pipelined over the ring chain
        owner, owner+1, ..., owner-1 (reported as ``sync``). Other experts route as in ``layer_time``."""
        c = self._counts(counts)
        shadowed = sorted({int(e) for e in shadowed})
        m = self.placement_matrix(placement, c.shape[1])
        for e in shadowed:
            if not 0 <= e < c.shape[1]:
                raise ValueError(f"shadowed expert {e} out of range")
        keep = torch.ones(c.shape[1], dtype=torch.bool)
        keep[shadowed] = False
        local = c[:, ~keep].sum(1)
        rest = c[:, keep]
        rank_tokens = self._route(rest, m[keep]) + torch.diag(local)
        comp = 3.0 * self.compute_time(rank_tokens.sum(0))
        a2a = 4.0 * self.alltoall_time(rank_tokens)
        sync = self.shadow_sync_time(shadowed, m)
        # replicated (non-shadowed) experts still all-reduce their gradients
        rest_m = m.clone()
        rest_m[~keep] = 0.0
        sync += self.replica_sync_time(rest_m)
        return Breakdown(comp, a2a, sync, comp + a2a + sync)

    def shadow_sync_time(self, shadowed: Iterable[int], multiplicity: Optional[torch.Tensor] = None) -> float:
        """Eq. 8's communication for ``shadowed`` experts: per expert a
        broadcast of its parameters from its owner (its first rank in the [E, P] ``multiplicity``; None =
        contiguous blocks) and a reduce of its gradients back."""
        m = self.placement_matrix(None, self.shape.num_experts) if multiplicity is None else multiplicity
        p, s = self.num_ranks, self.shape.expert_param_bytes
        sync = 0.0
        for e in sorted({int(e) for e in shadowed}):
            if self.bcast is not None:          # measured: the library's broadcast and reduce as they run
                sync += 2.0 * (self.bcast[1] + s / self.bcast[0])
                continue
            owner = int(m[e].nonzero()[0])
            chain = [(owner + k) % p for k in range(p)]
            sync += self.network.broadcast_time(s, chain) + self.network.reduce_time(s, chain)
        return sync

    def _counts(self, counts) -> torch.Tensor:
        c = torch.as_tensor(counts).to(torch.float64)
        if c.dim() != 2 or c.shape[0] != self.num_ranks:
            raise ValueError(f"counts must be [{self.num_ranks}, E], got {list(c.shape)}")
        if bool((c < 0).any()):
            raise ValueError("counts must be non-negative")
        return c
