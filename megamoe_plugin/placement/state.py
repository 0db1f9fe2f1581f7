"""PlacementState: logical experts mapped to vExpert slots on ranks (FlexMoE paper 001 §3.2-§3.3), the Expand /
Shrink / Migrate primitives as ``Move`` records, and the one implementation of FlexMoE's token routing among
replicas (Algorithm 3) that ``perfmodel.cost.CostModel.route`` also uses.

Pure and deterministic: no process group, no tensor parameters; every rank holding the same state and the same
global counts computes the same routing and the same plans. The runtime executes the ``Move`` records (copying
parameters AND optimizer state for Expand / Migrate; Shrink needs no communication) and applies them to its own
copy with ``PlacementState.apply``.

Model
-----
* ``num_ranks`` ranks, each with ``slots_per_rank`` vExpert slots (a slot = room for one expert's parameters and
  optimizer state, and the unit of computation of FlexMoE's vExpert). A slot holds one logical expert id or is
  free (``None``).
* Initial state: contiguous blocks, rank r holds experts ``r*E/P .. (r+1)*E/P - 1`` in its first E/P slots, the
  other ``slots_per_rank - E/P`` slots are free (``E`` must be a multiple of ``P``; ``slots_per_rank >= E/P``;
  default one spare slot per rank).
* An expert may have several replicas (vExperts); every expert always keeps at least one.
* ``max_replicas_per_rank``: vExperts of ONE expert a rank may hold; 1 (the default) is what the runtime executes.
  Above 1 (the offline replay), FlexMoE's packed vExperts share one parameter copy and only change the routing
  shares (a rank with n_{e,g} of them takes n_{e,g} / n_e of the expert's tokens); an Expand onto a rank that holds
  the expert is then a metadata change (``Move.nbytes == 0``, ``src == dst``).

Routing (FlexMoE Algorithm 3, "flexible token routing"), for counts I[p, e] (tokens source rank p sends to
expert e) and the vExpert multiplicity n[e, q]:

    n_e = sum_q n[e, q];  cap_e = I_e / n_e             (tokens of an expert split evenly among its vExperts)
    local[p, e] = min(cap_e * n[e, p], I[p, e])         (locality first: the source's own replicas take what they
                                                         can of their share)
    room[e, q] = cap_e * n[e, q] - local[q, e]          (capacity left on q after its own tokens)
    out[p, e, q] = (I[p, e] - local[p, e]) * room[e, q] / sum_q room[e, q]   for q != p, + local on q == p

(the paper's line 9 writes ``min(cap n, I) - I``; the free capacity it means is ``cap n - min(cap n, I)``). Every
replica ends with exactly its share cap_e n[e, q] (the remainders fill the free capacity exactly). With
``integer=True`` the [P, E, P] split is rounded per (source, expert) row by the largest remainder (ties to the
lower destination rank), so rows sum to the integer counts exactly and every rank computes the same integers.

Balance ratio (paper 001 Eq. 6): max over ranks of the tokens a rank computes (after routing) over the mean over
ranks; 1.0 = perfectly balanced (and for no tokens at all).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional, Tuple

import torch

__all__ = ["Move", "PlacementState", "PlacementError", "flexible_route", "model_state_bytes", "resolve_cost_model", "SCHEMA"]

SCHEMA = "megamoe-placement/1"
MOVE_KINDS = ("expand", "shrink", "migrate")


class PlacementError(ValueError):
    """An invalid placement primitive (no free slot, no such replica, last replica, ...)."""


def model_state_bytes(shape, optimizer_states: int = 2, master_weights: Optional[bool] = None) -> int:
    """Bytes of one expert's model states, what Expand / Migrate send (paper 001 §3.4 "Expert Adjustment Cost":
    size(e.model_states)): its parameters (``shape.bytes_per_element`` each) + ``optimizer_states`` fp32 tensors
    per parameter (Adam: 2 moments) + an fp32 master copy when ``master_weights`` (default: when the parameters
    are narrower than 4 bytes, as mixed-precision trainers keep one). Gradients are not moved (between steps)."""
    params = shape.expert_param_bytes // shape.bytes_per_element
    master = shape.bytes_per_element < 4 if master_weights is None else bool(master_weights)
    return int(params * (shape.bytes_per_element + 4 * int(optimizer_states) + (4 if master else 0)))


@dataclass(frozen=True)
class Move:
    """One primitive for the runtime, in execution order.

    kind: "expand" (copy expert's states src -> dst into slot dst_slot; src == dst and nbytes == 0 when dst
    already holds the expert: a shared-weight vExpert), "shrink" (drop the vExpert of rank src in slot src_slot;
    dst is None, nbytes 0, no communication), "migrate" (send the vExpert of src/src_slot to dst/dst_slot and free
    the source slot). nbytes: model-state bytes transferred (0 when no LayerShape was given)."""
    kind: str
    expert: int
    src: int
    dst: Optional[int]
    src_slot: Optional[int] = None
    dst_slot: Optional[int] = None
    nbytes: int = 0

    @property
    def sends_rows(self) -> bool:
        """Whether executing it sends the expert's rows from one rank to another (whatever ``nbytes`` says)."""
        return self.kind != "shrink" and self.dst is not None and self.dst != self.src

    @property
    def communicates(self) -> bool:
        """Whether it sends rows the cost model prices (``nbytes`` > 0)."""
        return self.sends_rows and self.nbytes > 0


def flexible_route(counts: torch.Tensor, multiplicity: torch.Tensor) -> torch.Tensor:
    """FlexMoE Algorithm 3 (module docstring): [P, E] counts, [E, P] vExpert multiplicity -> [P, E, P] float64
    tokens source p -> expert e -> rank q. Every expert needs at least one vExpert."""
    c = torch.as_tensor(counts).to(torch.float64)
    m = torch.as_tensor(multiplicity).to(torch.float64)
    if c.dim() != 2 or m.dim() != 2 or m.shape != (c.shape[1], c.shape[0]):
        raise ValueError(f"counts [P, E] and multiplicity [E, P] do not match: {list(c.shape)} / {list(m.shape)}")
    n = m.sum(1)                                             # vExperts per expert
    if bool((n <= 0).any()):
        raise ValueError(f"expert(s) {(n <= 0).nonzero().reshape(-1).tolist()} have no replica")
    cap = c.sum(0) / n                                       # [E] tokens per vExpert
    capm = cap[:, None] * m                                  # [E, P] share of each rank
    local = torch.minimum(capm, c.t()) * (m > 0)             # [E, P] locality first
    room = capm - local                                      # [E, P] free capacity after own tokens
    rest = c - local.t()                                     # [P, E] tokens that travel
    room_sum = room.sum(1, keepdim=True)
    share = torch.where(room_sum > 0, room / room_sum.clamp_min(1e-300), torch.zeros_like(room))
    out = rest[:, :, None] * share[None, :, :]               # [P, E, P]
    idx = torch.arange(c.shape[0])
    out[idx, :, idx] += local.t()
    return out


def _round_rows(x: torch.Tensor, totals: torch.Tensor) -> torch.Tensor:
    """Largest-remainder rounding of the last dim of x (>= 0) to integers summing to ``totals`` (ties: lower
    index first). Deterministic."""
    x = x.clamp_min(0.0)
    base = x.floor()
    frac = x - base
    short = (totals.to(torch.float64) - base.sum(-1)).round().clamp_min(0).to(torch.long)
    order = torch.argsort(frac, dim=-1, descending=True, stable=True)
    pos = torch.empty_like(order)
    pos.scatter_(-1, order, torch.arange(x.shape[-1]).expand_as(order).contiguous())
    return base.to(torch.long) + (pos < short[..., None]).to(torch.long)


class PlacementState:
    """Logical experts on vExpert slots (see the module docstring)."""

    def __init__(self, num_experts: int, num_ranks: int, slots_per_rank: Optional[int] = None,
                 max_replicas_per_rank: int = 1):
        E, P = int(num_experts), int(num_ranks)
        if E < 1 or P < 1:
            raise PlacementError(f"need num_experts >= 1 and num_ranks >= 1, got {E}, {P}")
        if E % P:
            raise PlacementError(f"the initial contiguous placement needs num_experts ({E}) to be a multiple of "
                                 f"num_ranks ({P})")
        per = E // P
        S = per + 1 if slots_per_rank is None else int(slots_per_rank)
        if S < per:
            raise PlacementError(f"slots_per_rank ({S}) < experts per rank ({per}): the experts do not fit")
        if int(max_replicas_per_rank) < 1:
            raise PlacementError(f"max_replicas_per_rank must be >= 1, got {max_replicas_per_rank}")
        self.num_experts, self.num_ranks, self.slots_per_rank = E, P, S
        self.max_replicas_per_rank = int(max_replicas_per_rank)
        self._slots: List[List[Optional[int]]] = [
            [r * per + i if i < per else None for i in range(S)] for r in range(P)]

    # --- queries -----------------------------------------------------------------------------------------------
    def slots_of(self, rank: int) -> List[Optional[int]]:
        """The experts in rank's slots, in slot order (None = free)."""
        return list(self._slots[self._rank(rank)])

    def replicas(self, expert: int) -> List[int]:
        """Ranks holding a vExpert of ``expert``, ascending, one entry per vExpert (repeats when packed)."""
        e = self._expert(expert)
        return [r for r in range(self.num_ranks) for s in self._slots[r] if s == e]

    def ranks_of(self, expert: int) -> List[int]:
        """Distinct ranks holding ``expert``, ascending: its gradient all-reduce group."""
        return sorted(set(self.replicas(expert)))

    def owner(self, expert: int) -> Tuple[int, int]:
        """(rank, slot) of the replica that speaks for ``expert`` in checkpoints: its first one."""
        r = self.replicas(expert)[0]
        return r, self._slots[r].index(self._expert(expert))

    def logical_rows(self) -> List[int]:
        """For every logical expert, its owner's row in the [P * slots_per_rank] concatenation of all ranks'
        banks (what an all-gather of the bank, or the ranks' saved banks in rank order, give)."""
        return [r * self.slots_per_rank + s for r, s in (self.owner(e) for e in range(self.num_experts))]

    def num_replicas(self, expert: int) -> int:
        return len(self.replicas(expert))

    def count(self, expert: int, rank: int) -> int:
        """vExperts of ``expert`` on ``rank``."""
        e, r = self._expert(expert), self._rank(rank)
        return sum(1 for s in self._slots[r] if s == e)

    def free_slots(self, rank: int) -> List[int]:
        return [i for i, s in enumerate(self._slots[self._rank(rank)]) if s is None]

    def placement(self) -> List[List[int]]:
        """Per expert, the ranks of its vExperts (with repeats): the form ``CostModel.layer_time`` takes."""
        out: List[List[int]] = [[] for _ in range(self.num_experts)]
        for r in range(self.num_ranks):
            for s in self._slots[r]:
                if s is not None:
                    out[s].append(r)
        return out

    def multiplicity(self) -> torch.Tensor:
        """[E, P] float64 vExperts of each expert on each rank."""
        flat = [(s, r) for r in range(self.num_ranks) for s in self._slots[r] if s is not None]
        m = torch.zeros(self.num_experts * self.num_ranks, dtype=torch.float64)
        idx = torch.tensor([s * self.num_ranks + r for s, r in flat], dtype=torch.long)
        m.index_add_(0, idx, torch.ones(len(flat), dtype=torch.float64))
        return m.reshape(self.num_experts, self.num_ranks)

    def replica_groups(self) -> List[Tuple[int, Tuple[int, ...]]]:
        """(expert, sorted distinct ranks) of every expert on more than one rank, in ascending logical expert id:
        the order in which every rank must all-reduce replica gradients (paper 001 §4, no deadlock)."""
        return [(e, tuple(ranks)) for e in range(self.num_experts) if len(ranks := self.ranks_of(e)) > 1]

    @property
    def total_replicas(self) -> int:
        """vExperts in use (E when nothing is replicated)."""
        return sum(1 for slots in self._slots for s in slots if s is not None)

    # --- routing and balance -----------------------------------------------------------------------------------
    def route(self, counts, integer: bool = False) -> torch.Tensor:
        """[P, E] counts -> [P, E, P] tokens source p -> expert e -> rank q (FlexMoE Alg. 3, module docstring).
        Float64 fractions, or with ``integer=True`` int64 rows that sum to the (integer) counts exactly."""
        c = self._counts(counts)
        out = flexible_route(c, self.multiplicity())
        if integer:
            return _round_rows(out, c.round())
        return out

    def rank_loads(self, counts, shadowed: Iterable[int] = ()) -> torch.Tensor:
        """[P] tokens each rank computes after routing; the tokens of ``shadowed`` experts (FasterMoE shadowing)
        are computed on their source rank."""
        c = self._counts(counts).clone()
        local = torch.zeros(self.num_ranks, dtype=torch.float64)
        for e in shadowed:
            local += c[:, self._expert(e)]
            c[:, e] = 0
        return self.route(c).sum((0, 1)) + local

    def balance_ratio(self, counts) -> float:
        """Paper 001 Eq. 6 over ranks after routing: max_g load_g / mean_g load_g (1.0 when there is no token)."""
        load = self.rank_loads(counts)
        total = float(load.sum())
        return float(load.max()) * self.num_ranks / total if total > 0 else 1.0

    # --- primitives --------------------------------------------------------------------------------------------
    def expand(self, expert: int, rank: int, src: Optional[int] = None, shape=None,
               state_bytes: Optional[int] = None) -> Move:
        """Add a vExpert of ``expert`` on ``rank`` (lowest free slot), its states copied from replica ``src``
        (default: the lowest rank holding it; the rank itself when it already holds the expert: shared weights,
        nothing sent). Needs a free slot on ``rank`` and fewer than ``max_replicas_per_rank`` vExperts of it
        there."""
        e, r = self._expert(expert), self._rank(rank)
        free = self.free_slots(r)
        if not free:
            raise PlacementError(f"expand expert {e} on rank {r}: no free slot (rank {r} holds {self._slots[r]})")
        here = self.count(e, r)
        if here >= self.max_replicas_per_rank:
            raise PlacementError(f"expand expert {e} on rank {r}: rank {r} already holds {here} vExpert(s) of it "
                                 f"(max_replicas_per_rank={self.max_replicas_per_rank})")
        holders = self.ranks_of(e)
        if here:
            if src is not None and int(src) != r:
                raise PlacementError(f"expand expert {e} on rank {r}: rank {r} already holds it, its weights are "
                                     f"shared (src must be {r} or None)")
            src_r, src_slot, nbytes = r, self._slots[r].index(e), 0
        else:
            src_r = holders[0] if src is None else self._rank(src)
            if src_r not in holders:
                raise PlacementError(f"expand expert {e} from rank {src_r}: rank {src_r} holds no replica of it "
                                     f"(replicas on {holders})")
            src_slot, nbytes = self._slots[src_r].index(e), self._bytes(shape, state_bytes)
        self._slots[r][free[0]] = e
        return Move("expand", e, src_r, r, src_slot, free[0], nbytes)

    def shrink(self, expert: int, rank: int) -> Move:
        """Drop one vExpert of ``expert`` on ``rank`` (its highest slot there); never the expert's last one."""
        e, r = self._expert(expert), self._rank(rank)
        here = [i for i, s in enumerate(self._slots[r]) if s == e]
        if not here:
            raise PlacementError(f"shrink expert {e} on rank {r}: no replica there (replicas on "
                                 f"{self.ranks_of(e)})")
        if self.num_replicas(e) == 1:
            raise PlacementError(f"shrink expert {e} on rank {r}: it is the expert's last replica")
        self._slots[r][here[-1]] = None
        return Move("shrink", e, r, None, here[-1], None, 0)

    def migrate(self, expert: int, src: int, dst: int, shape=None, state_bytes: Optional[int] = None) -> Move:
        """Move the vExpert of ``expert`` on ``src`` (its highest slot there) to ``dst`` (lowest free slot)."""
        e, s, d = self._expert(expert), self._rank(src), self._rank(dst)
        if s == d:
            raise PlacementError(f"migrate expert {e}: source and destination are both rank {s}")
        here = [i for i, x in enumerate(self._slots[s]) if x == e]
        if not here:
            raise PlacementError(f"migrate expert {e} from rank {s}: no replica there (replicas on "
                                 f"{self.ranks_of(e)})")
        free = self.free_slots(d)
        if not free:
            raise PlacementError(f"migrate expert {e} to rank {d}: no free slot (rank {d} holds {self._slots[d]})")
        if self.count(e, d) >= self.max_replicas_per_rank:
            raise PlacementError(f"migrate expert {e} to rank {d}: rank {d} already holds "
                                 f"{self.count(e, d)} vExpert(s) of it (max_replicas_per_rank="
                                 f"{self.max_replicas_per_rank})")
        nbytes = 0 if self.count(e, d) else self._bytes(shape, state_bytes)
        self._slots[s][here[-1]] = None
        self._slots[d][free[0]] = e
        return Move("migrate", e, s, d, here[-1], free[0], nbytes)

    def apply(self, moves: Iterable[Move]) -> "PlacementState":
        """Apply recorded moves in order (e.g. a plan received by the runtime); checks each lands in the slots
        it names. Returns self."""
        for mv in moves:
            if mv.kind == "expand":
                got = self.expand(mv.expert, mv.dst, mv.src if mv.src != mv.dst else None, state_bytes=mv.nbytes)
            elif mv.kind == "shrink":
                got = self.shrink(mv.expert, mv.src)
            elif mv.kind == "migrate":
                got = self.migrate(mv.expert, mv.src, mv.dst, state_bytes=mv.nbytes)
            else:
                raise PlacementError(f"unknown move kind {mv.kind!r}; known: {', '.join(MOVE_KINDS)}")
            for name in ("src_slot", "dst_slot"):
                want = getattr(mv, name)
                if want is not None and getattr(got, name) != want:
                    raise PlacementError(f"{mv}: applied to {name}={getattr(got, name)}, the move names {want} "
                                         "(the states differ)")
        return self

    # --- copies, equality, persistence -------------------------------------------------------------------------
    def copy(self) -> "PlacementState":
        new = PlacementState.__new__(PlacementState)
        new.num_experts, new.num_ranks, new.slots_per_rank = self.num_experts, self.num_ranks, self.slots_per_rank
        new.max_replicas_per_rank = self.max_replicas_per_rank
        new._slots = [list(s) for s in self._slots]
        return new

    def key(self) -> tuple:
        return (self.num_experts, self.num_ranks, self.slots_per_rank, self.max_replicas_per_rank,
                tuple(tuple(s) for s in self._slots))

    def __eq__(self, other) -> bool:
        return isinstance(other, PlacementState) and self.key() == other.key()

    def __hash__(self):
        return hash(self.key())

    def __repr__(self):
        return (f"PlacementState(E={self.num_experts}, P={self.num_ranks}, slots_per_rank={self.slots_per_rank}, "
                f"replicas={self.total_replicas}, slots={self._slots})")

    def to_dict(self) -> dict:
        """Checkpoint metadata (JSON-able): schema, sizes and every rank's slots (-1 = free)."""
        return {"schema": SCHEMA, "num_experts": self.num_experts, "num_ranks": self.num_ranks,
                "slots_per_rank": self.slots_per_rank, "max_replicas_per_rank": self.max_replicas_per_rank,
                "slots": [[-1 if s is None else int(s) for s in slots] for slots in self._slots]}

    @classmethod
    def from_dict(cls, d: dict) -> "PlacementState":
        """Inverse of ``to_dict``; validates the slots (ids in range, every expert placed, multiplicity)."""
        if d.get("schema") != SCHEMA:
            raise PlacementError(f"unknown placement schema {d.get('schema')!r} (expected {SCHEMA!r})")
        E, P, S = int(d["num_experts"]), int(d["num_ranks"]), int(d["slots_per_rank"])
        mx = int(d.get("max_replicas_per_rank", 1))
        slots = d["slots"]
        if len(slots) != P or any(len(s) != S for s in slots):
            raise PlacementError(f"slots must be {P} ranks x {S} slots")
        new = cls.__new__(cls)
        new.num_experts, new.num_ranks, new.slots_per_rank, new.max_replicas_per_rank = E, P, S, mx
        new._slots = [[None if int(x) < 0 else int(x) for x in s] for s in slots]
        for r, s in enumerate(new._slots):
            for x in s:
                if x is not None and not 0 <= x < E:
                    raise PlacementError(f"rank {r}: expert id {x} out of range 0..{E - 1}")
                if x is not None and s.count(x) > mx:
                    raise PlacementError(f"rank {r} holds {s.count(x)} vExperts of expert {x} "
                                         f"(max_replicas_per_rank={mx})")
        missing = [e for e in range(E) if not any(e in s for s in new._slots)]
        if missing:
            raise PlacementError(f"expert(s) {missing} have no replica")
        return new

    # --- internals ---------------------------------------------------------------------------------------------
    def _expert(self, e) -> int:
        e = int(e)
        if not 0 <= e < self.num_experts:
            raise PlacementError(f"expert {e} out of range 0..{self.num_experts - 1}")
        return e

    def _rank(self, r) -> int:
        r = int(r)
        if not 0 <= r < self.num_ranks:
            raise PlacementError(f"rank {r} out of range 0..{self.num_ranks - 1}")
        return r

    @staticmethod
    def _bytes(shape, state_bytes) -> int:
        if state_bytes is not None:
            return int(state_bytes)
        return model_state_bytes(shape) if shape is not None else 0

    def _counts(self, counts) -> torch.Tensor:
        c = torch.as_tensor(counts).to(torch.float64)
        if c.shape != (self.num_ranks, self.num_experts):
            raise ValueError(f"counts must be [{self.num_ranks}, {self.num_experts}], got {list(c.shape)}")
        if bool((c < 0).any()):
            raise ValueError("counts must be non-negative")
        return c


def resolve_cost_model(spec, cache: dict, num_ranks: int):
    """The planners' cost model: a CostModel as given, or the one a factory ``f(num_ranks)`` builds (cached per world size)."""
    if hasattr(spec, "layer_time"):
        if spec.num_ranks != num_ranks:
            raise ValueError(f"the cost model has {spec.num_ranks} ranks, the placement {num_ranks}")
        return spec
    if num_ranks not in cache:
        cache[num_ranks] = spec(num_ranks)
    return cache[num_ranks]
