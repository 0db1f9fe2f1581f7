"""PlacementRuntime: one MoE layer's live expert placement, executed (FlexMoE paper 001 §3.2-§4, FasterMoE paper
003 §4.1). ``PlacementState`` (state.py) says where experts live; this module makes the layer compute that way.

Per layer and expert-parallel group (every group of a data-parallel job holds the same placement, so the
expert-data-parallel gradient reduction still pairs equal slots):

* **vExpert slots.** The layer's ``ExpertBank`` has ``slots_per_rank`` slots (its E/P experts + spare ones); rank q's
  slot i is global slot ``q * W + i`` (W = slots + shadow copies this step). A free slot holds zeros.
* **Routing to slots** (``route_tokens``): logical expert ids become global slot ids before the (unchanged)
  dropless exchange. An expert with one replica is a table lookup. When some expert has several, every rank
  all-gathers the [P, E] counts of the call and computes FlexMoE Algorithm 3 (``PlacementState.route(integer=
  True)``, identical integers on every rank): this rank's tokens of expert e, in their sorted order, are cut into
  runs, one per replica, sized by its row. Shadowed experts' tokens stay on their source (FasterMoE). No loop
  over tokens; one extra host sync per layer only while replicas exist. The same integers say what every source
  sends to each of this rank's slots (``SlotRouting.recv_counts``), so the all-gather replaces the dispatcher's
  count exchange instead of adding to it.
* **Replica gradients** (``_ReplicaGradSync``): an identity on the bank's weights whose backward all-reduces the
  rows of every replicated expert over the ranks holding it, in ascending logical expert id on every rank (no
  deadlock: the lowest pending expert's ranks are all ready for it, paper 001 §4). The groups come from
  ``GroupCache`` (an LRU of process groups, created together by every rank between steps).
* **Shadowing** (``_ShadowCopies``): the chosen experts' rows are broadcast from their owner (first replica) to
  every rank of the group at the start of the layer's forward and appended as extra slots; their gradients are
  reduced back to the owner's row in backward (paper 003 §4.1). The optimizer never sees the copies.
* **Moves** (``execute``): Expand / Migrate send the expert's parameter rows AND the optimizer-state rows that go
  with them (Adam moments, fp32 master weights: ``optim_state.param_state_tensors``) point-to-point src -> dst,
  between optimizer steps; Shrink (and the source of a Migrate) zeroes the freed slot, with no communication.

Checkpoints: the state's ``logical_rows`` / ``slots_of`` let the adapters save experts by logical id whatever the
placement and load them into any placement and expert-parallel size (checkpoint.py).
"""
from __future__ import annotations

import contextlib
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Deque, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..parallel import ExpertParallel, comm_device
from .optim_state import slot_state_views
from .state import Move, PlacementError, PlacementState

__all__ = ["PlacementRuntime", "GroupCache", "SlotRouting", "apply_placement", "group_cache"]


@dataclass
class SlotRouting:
    """A Routing whose expert ids are global slot ids: what the dropless and smart dispatchers consume."""
    expert_ids: torch.Tensor       # [T, k] (only its shape is read)
    weights: torch.Tensor          # [T, k] combine weights, unchanged
    masked_ids: torch.Tensor       # [T*k] global slot of every assignment, num_slots for dropped ones
    counts: torch.Tensor           # [num_slots] assignments this rank sends to each slot
    # [P * W] assignments this rank receives from each source for each of its slots (source-major), when the
    # routing was computed from every rank's counts (replicas): the dispatcher then skips its count exchange
    recv_counts: Optional[torch.Tensor] = None


# --- process groups of replica sets: an LRU cache, created collectively ---------------------------------------------
class GroupCache:
    """LRU cache of process groups keyed by their sorted global ranks (FlexMoE §4: communicators per replica set
    are cached, the least recently used evicted). ``ensure`` is collective over the default group: every rank says
    which groups it misses, and all ranks create the union in one order (``new_group`` needs every rank)."""

    def __init__(self, capacity: int = 32):
        self.capacity = int(capacity)
        self._groups: "OrderedDict[Tuple[int, ...], object]" = OrderedDict()
        self.created = 0

    def get(self, ranks: Sequence[int]):
        key = tuple(sorted(int(r) for r in ranks))
        if key not in self._groups:
            raise PlacementError(f"no process group for ranks {key}: GroupCache.ensure must run first (every rank, "
                                 "between steps)")
        self._groups.move_to_end(key)
        return self._groups[key]

    def ensure(self, needed: Iterable[Sequence[int]]) -> int:
        """Collective. Make the groups of ``needed`` (this rank's) available on their members; returns how many
        groups were created."""
        mine = sorted({tuple(sorted(int(r) for r in g)) for g in needed if len(g) > 1})
        for key in mine:
            if key in self._groups:
                self._groups.move_to_end(key)
        missing = [k for k in mine if k not in self._groups]
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:
            flag_ = torch.tensor([len(missing)], dtype=torch.long, device=comm_device())
            dist.all_reduce(flag_, op=dist.ReduceOp.MAX)          # the usual case: nobody misses a group
            if int(flag_) == 0:
                return 0
            everyone: List[Optional[list]] = [None] * world
            dist.all_gather_object(everyone, missing)
            union = sorted({tuple(k) for part in everyone for k in part})
        else:
            union = missing
        for key in union:
            self._groups[key] = dist.new_group(list(key)) if world > 1 else None
            self.created += 1
        keep = set(mine)
        while len(self._groups) > self.capacity:
            victim = next((k for k in self._groups if k not in keep), None)
            if victim is None:
                break
            g = self._groups.pop(victim)
            if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
                with contextlib.suppress(Exception):   # a backend without per-group teardown: dropping it is enough
                    dist.destroy_process_group(g)
        return len(union)

    def __len__(self):
        return len(self._groups)


_CACHE: Optional[GroupCache] = None


def group_cache(capacity: int = 32) -> GroupCache:
    """The process-wide replica group cache (one per process: groups are shared by all layers)."""
    global _CACHE
    if _CACHE is None:
        _CACHE = GroupCache(capacity)
    _CACHE.capacity = max(_CACHE.capacity, int(capacity))
    return _CACHE


# --- autograd pieces -------------------------------------------------------------------------------------------------
def _row(tensors, i: int) -> torch.Tensor:
    """Row i of every tensor, flattened into one buffer (one message per expert)."""
    return torch.cat([t[i].reshape(-1) for t in tensors])


def _owner_row(weights, slot: int, me: int, owner: int) -> torch.Tensor:
    """What a rank puts into a shadow broadcast: its row ``slot`` if it owns the expert, else an empty buffer."""
    return _row(weights, slot) if me == owner else weights[0].new_empty(sum(w[0].numel() for w in weights))


def _write_row(flat: torch.Tensor, tensors, i: int, add: bool = False) -> None:
    """Inverse of ``_row``: row i of every tensor from ``flat`` (copied, or added with ``add``)."""
    off = 0
    for t in tensors:
        n = t[i].numel()
        part = flat[off:off + n].view_as(t[i])
        t[i].add_(part) if add else t[i].copy_(part)
        off += n


class _ReplicaGradSync(torch.autograd.Function):
    """Identity on the bank's weights; backward sums each replicated expert's rows over its ranks.

    Synchronously (the default), each all-reduce completes inside this layer's backward. With ``overlap``, they are
    launched asynchronously and the layers below run their backward meanwhile (as data parallelism overlaps its
    gradient buckets, and as FlexMoE §4 assumes); at the end of the backward pass (an autograd-engine callback)
    each is waited on and the other replicas' part of the sum is added to the parameter's gradient (``.grad``, or
    Megatron's ``main_grad`` once its accumulation hook has moved ``.grad`` there)."""

    @staticmethod
    def forward(ctx, plan, runtime, *weights):
        ctx.plan, ctx.meta = plan, [(w.shape, w.dtype, w.device) for w in weights]
        ctx.params = weights if runtime.overlap_sync else None
        ctx.runtime = runtime
        return tuple(w.view_as(w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        grads = [torch.zeros(s, dtype=d, device=dev) if g is None else g.contiguous()
                 for g, (s, d, dev) in zip(grads, ctx.meta)]
        if ctx.params is None:
            for slot, group in ctx.plan:                     # ascending logical expert id
                flat = _row(grads, slot)
                dist.all_reduce(flat, group=group)
                _write_row(flat, grads, slot)
            return (None, None, *grads)
        pending = []
        for slot, group in ctx.plan:                         # ascending logical expert id, on every rank alike
            local = _row(grads, slot)
            total = local.clone()
            pending.append((slot, local, total, dist.all_reduce(total, group=group, async_op=True)))
        params, runtime = ctx.params, ctx.runtime
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: _add_other_replicas(params, pending, runtime))
        return (None, None, *grads)


def _grad_targets(params, what: str) -> List[torch.Tensor]:
    """Each parameter's gradient at the end of the backward pass: ``.grad``, or Megatron's ``main_grad`` once its
    accumulation hook has moved ``.grad`` there."""
    targets = []
    for p in params:
        g = p.grad if p.grad is not None else getattr(p, "main_grad", None)
        if g is None:
            raise RuntimeError(f"overlapped {what}: an expert parameter has no gradient at the end of the backward "
                               "pass (neither .grad nor main_grad)")
        targets.append(g)
    return targets


def _wait_all(pending) -> float:
    """Wait for every pending collective (the last item of each entry); returns the seconds waited."""
    start = time.perf_counter()
    for entry in pending:
        entry[-1].wait()
    return time.perf_counter() - start


def _add_other_replicas(params, pending, runtime) -> None:
    """End of the backward pass: the overlapped all-reduces' sums, less this rank's own rows (already accumulated),
    added into each parameter's gradient. The seconds spent waiting for them (the part of the all-reduces the layers
    below did not hide) add up in ``runtime.sync_wait_s``."""
    targets = _grad_targets(params, "replica gradient sync")
    runtime.sync_wait_s += _wait_all(pending)
    for slot, local, total, _ in pending:
        _write_row(total - local, targets, slot, add=True)


def _add_shadow_gradients(params, pending, runtime) -> None:
    """End of the backward pass: the overlapped reduces of the shadow copies' gradients, added by each owner into
    its expert's row. The seconds waited add up in ``runtime.shadow_reduce_wait_s``."""
    targets = _grad_targets(params, "shadow gradient reduce")
    runtime.shadow_reduce_wait_s += _wait_all(pending)
    for mine, slot, flat, _ in pending:
        if mine:
            _write_row(flat, targets, slot, add=True)


class _ShadowCopies(torch.autograd.Function):
    """[K, ...] copies of the shadowed experts' rows, broadcast from their owners; backward reduces the copies'
    gradients to the owners' rows: inside this layer's backward, or, with ``overlap`` = (runtime, group, params),
    launched asynchronously on the shadow group so the layers below run their backward meanwhile, and added to the
    owners' gradients at the end of the backward pass (as ``_ReplicaGradSync`` does for replicas)."""

    @staticmethod
    def forward(ctx, spec, *weights):
        entries, group, me, overlap = spec           # entries: (owner ep rank, owner global rank, owner slot)
        ctx.spec, ctx.meta = spec, [(w.shape, w.dtype, w.device) for w in weights]
        outs = [w.new_empty((len(entries),) + tuple(w.shape[1:])) for w in weights]
        for j, (owner, owner_global, slot) in enumerate(entries):
            flat = _owner_row(weights, slot, me, owner)
            dist.broadcast(flat, src=owner_global, group=group)
            _write_row(flat, outs, j)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        entries, group, me, overlap = ctx.spec
        grads = [torch.zeros((len(entries),) + tuple(s[1:]), dtype=d, device=dev) if g is None else g.contiguous()
                 for g, (s, d, dev) in zip(grads, ctx.meta)]
        if overlap is not None:
            runtime, reduce_group, params = overlap
            pending = []
            for j, (owner, owner_global, slot) in enumerate(entries):      # the same order on every rank
                flat = _row(grads, j)
                pending.append((me == owner, slot, flat,
                                dist.reduce(flat, dst=owner_global, group=reduce_group, async_op=True)))
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: _add_shadow_gradients(params, pending, runtime))
            return (None, *[None] * len(grads))
        out = [torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.meta]
        for j, (owner, owner_global, slot) in enumerate(entries):
            flat = _row(grads, j)
            dist.reduce(flat, dst=owner_global, group=group)
            if me == owner:
                _write_row(flat, out, slot, add=True)
        return (None, *out)


# --- the runtime -----------------------------------------------------------------------------------------------------
class PlacementRuntime:
    """The placement of one MoE layer on its expert-parallel group (module docstring)."""

    def __init__(self, num_experts: int, ep: ExpertParallel, slots_per_rank: int, edp_group=None,
                 cache: Optional[GroupCache] = None, overlap_sync: bool = False):
        self.ep, self.edp_group = ep, edp_group
        self.overlap_sync = bool(overlap_sync)               # replicas' gradient all-reduces behind the backward
        # seconds spent on moves, that the backward's end waited for the overlapped replica all-reduces, and for the
        # shadow copies' overlapped reduces, since ``take_waits``
        self.move_wait_s = self.sync_wait_s = self.shadow_reduce_wait_s = 0.0
        self.num_experts, self.slots_per_rank = int(num_experts), int(slots_per_rank)
        self.state = PlacementState(num_experts, ep.size, slots_per_rank, max_replicas_per_rank=1)
        self.shadowed: List[int] = []
        self.cache = cache if cache is not None else group_cache()
        self.step_counts: Optional[torch.Tensor] = None     # this rank's [E] counts since the last policy run
        self._step_in_progress: Optional[torch.Tensor] = None   # this rank's [E] counts of the current step
        self.recent: Deque[torch.Tensor] = deque()          # this rank's [E] counts of each of the last steps
        self.step_dropped: Optional[torch.Tensor] = None    # and its dropped assignments (capacity dispatch)
        self.moves_done = self.bytes_moved = 0
        self.eval_forwards = 0                               # forwards without gradient (evaluation) so far
        self._rebuild()

    # --- derived tables ----------------------------------------------------------------------------------------
    def _rebuild(self) -> None:
        P, S, E, me = self.ep.size, self.slots_per_rank, self.num_experts, self.ep.rank
        shadow = self.shadowed
        W = self.width = S + len(shadow)                   # slots per rank in this step's dispatch
        self.num_slots = P * W
        slot_eq = torch.full((E, P), -1, dtype=torch.long)
        for q in range(P):
            for i, e in enumerate(self.state.slots_of(q)):
                if e is not None:
                    slot_eq[e, q] = q * W + i
        for j, e in enumerate(shadow):
            slot_eq[e, :] = -1
            slot_eq[e, me] = me * W + S + j
        self._slot_eq = slot_eq
        self._shadow_set = set(shadow)
        self._replicated = any(self.state.num_replicas(e) > 1 for e in range(E) if e not in self._shadow_set)
        lookup = torch.full((E + 1,), self.num_slots, dtype=torch.long)
        if not self._replicated:
            lookup[:E] = slot_eq.max(1).values
        self._lookup = lookup
        self._device_tables: Dict[str, tuple] = {}
        canonical = PlacementState(E, P, S, max_replicas_per_rank=1)
        self.trivial = (not shadow and self.state == canonical and S == E // P)
        # replica all-reduce plan: (my slot, group) per replicated expert I hold, ascending logical id
        self._sync_plan_keys = []
        for e, ranks in self.state.replica_groups():       # shadowed ones too: their replicas must stay equal
            if me in ranks:
                self._sync_plan_keys.append((self.state.slots_of(me).index(e),
                                             tuple(self.ep.global_ranks[r] for r in ranks), len(ranks) == P))
        # a shadowed expert that also has replicas: its copies' gradient must reach its owner's row before the
        # replicas' all-reduce starts, so those reduces run inside the layer's backward even with overlap_sync
        self._shadow_in_layer = any(self.state.num_replicas(e) > 1 for e in shadow)
        self._shadow_entries = []
        for e in shadow:
            owner = self.state.replicas(e)[0]
            self._shadow_entries.append((owner, self.ep.global_ranks[owner], self.state.slots_of(owner).index(e)))

    @property
    def shadow_reduce_overlapped(self) -> bool:
        """Whether the shadow copies' gradient reduces run behind the layers below (``overlap_sync``)."""
        return self.overlap_sync and bool(self._shadow_entries) and not self._shadow_in_layer

    def _tables(self, device) -> tuple:
        key = str(device)
        if key not in self._device_tables:
            self._device_tables[key] = (self._lookup.to(device), self._slot_eq.reshape(-1).to(device))
        return self._device_tables[key]

    def needed_groups(self) -> List[Tuple[int, ...]]:
        """Global-rank tuples of the replica all-reduce groups this rank takes part in (not the whole EP group),
        and the expert-parallel group's own copy when experts are shadowed (their overlapped gradient reduces)."""
        groups = [ranks for _, ranks, whole in self._sync_plan_keys if not whole]
        if self._shadow_entries and self.ep.size > 1:
            groups.append(tuple(self.ep.global_ranks))
        return groups

    # --- forward: logical experts -> slots ----------------------------------------------------------------------
    def route_tokens(self, routing) -> SlotRouting:
        """Routing (logical ids) -> SlotRouting (global slot ids) for this call; see the module docstring. With
        the initial placement and nothing shadowed, the routing itself (expert id = slot id)."""
        counts = routing.counts
        self._accumulate(counts, routing.dropped)
        if self.trivial:
            return routing
        ids = routing.masked_ids
        lookup, slot_eq = self._tables(ids.device)
        if not self._replicated:
            new_ids = lookup[ids]
            new_counts = torch.zeros(self.num_slots, dtype=counts.dtype, device=counts.device)
            new_counts.index_add_(0, lookup[:-1], counts)
            return SlotRouting(routing.expert_ids, routing.weights, new_ids, new_counts)
        P, me = self.ep.size, self.ep.rank
        parts = [torch.empty_like(counts) for _ in range(P)]
        dist.all_gather(parts, counts.contiguous(), group=self.ep.group)
        allc = torch.stack(parts).cpu()                                   # the extra host sync (replicas only)
        routed = allc.clone()
        shadow = sorted(self._shadow_set)
        if shadow:
            routed[:, shadow] = 0
        splits = self.state.route(routed, integer=True)                  # [P, E, P] source's tokens of e to q
        src = torch.arange(P)
        for e in shadow:                                                  # shadowed: every source keeps its own
            splits[src, e, src] = allc[:, e]
        split = splits[me]                                                # [E, P] my tokens of e to rank q
        # what each source sends to each of my slots: the count exchange's answer, known here already
        mine = self._slot_eq[:, me]                                       # [E] my global slot of e, or -1
        held = (mine >= 0).nonzero().flatten()
        recv = torch.zeros(P, self.width, dtype=torch.long)
        recv[:, mine[held] - me * self.width] = splits[:, held, me].to(torch.long)
        n = int(allc[me].sum())
        order = torch.argsort(ids, stable=True)[:n]
        runs = split.reshape(-1).to(ids.device)
        dest = torch.repeat_interleave(slot_eq.clamp_min(0), runs, output_size=n)
        new_ids = torch.full_like(ids, self.num_slots)
        new_ids[order] = dest
        new_counts = torch.zeros(self.num_slots, dtype=counts.dtype, device=counts.device)
        new_counts.index_add_(0, slot_eq.clamp_min(0), runs.to(counts.dtype))
        return SlotRouting(routing.expert_ids, routing.weights, new_ids, new_counts,
                           recv.reshape(-1).to(device=counts.device, dtype=counts.dtype))

    def _accumulate(self, counts: torch.Tensor, dropped: torch.Tensor) -> None:
        if not torch.is_grad_enabled():
            self.eval_forwards += 1                  # inference / validation calls do not steer placement, and a
            return                                   # step they ran beside is not timed for the pay-off guard
        c, d = counts.detach(), dropped.detach()
        self.step_counts = c.clone() if self.step_counts is None else self.step_counts + c
        self._step_in_progress = c.clone() if self._step_in_progress is None else self._step_in_progress + c
        self.step_dropped = d.clone() if self.step_dropped is None else self.step_dropped + d

    # --- forward: the bank's weights as this step computes with them ---------------------------------------------
    def expert_weights(self, bank) -> List[Optional[torch.Tensor]]:
        """[w1, w2, b1, b2] of the slots this step computes: replica-synchronised, plus shadow copies."""
        raw = [bank.w1, bank.w2, bank.b1, bank.b2]
        present = [w for w in raw if w is not None]
        params = list(present)
        if self._sync_plan_keys and torch.is_grad_enabled():
            plan = [(slot, self.ep.group if whole else self.cache.get(ranks))
                    for slot, ranks, whole in self._sync_plan_keys]
            present = list(_ReplicaGradSync.apply(plan, self, *present))
        if self._shadow_entries:
            overlap = None
            group = self._shadow_group() if self.shadow_reduce_overlapped and torch.is_grad_enabled() else None
            if group is not None:
                overlap = (self, group, params)
            copies = _ShadowCopies.apply((self._shadow_entries, self.ep.group, self.ep.rank, overlap), *present)
            present = [torch.cat([w, c], 0) for w, c in zip(present, copies)]
        it = iter(present)
        return [None if w is None else next(it) for w in raw]

    def _shadow_group(self):
        """The expert-parallel group's own copy for the shadows' asynchronous collectives (so the layers'
        all-to-alls do not queue behind them), or None where it has not been made (``GroupCache.ensure`` runs
        between steps) or there is one rank."""
        if self.ep.size < 2:
            return None
        try:
            return self.cache.get(tuple(self.ep.global_ranks))
        except PlacementError:
            return None

    # --- between steps -----------------------------------------------------------------------------------------
    def set_shadowed(self, experts: Sequence[int]) -> None:
        """Experts to shadow from the next forward on (FasterMoE Alg. 1's choice); [] for none."""
        experts = [int(e) for e in experts]
        bad = [e for e in experts if not 0 <= e < self.num_experts]
        if bad or len(set(experts)) != len(experts):
            raise PlacementError(f"shadowed experts must be distinct ids in 0..{self.num_experts - 1}: {experts}")
        self.shadowed = experts
        self._rebuild()

    def close_step(self, keep: int) -> None:
        """An optimizer step ended (the after-step hook, every step, on every rank): its counts join ``recent``,
        which keeps the last ``keep`` steps'. A step without a training forward adds zeros."""
        c = self._step_in_progress
        self._step_in_progress = None
        self.recent.append(torch.zeros(self.num_experts, dtype=torch.float64) if c is None else c)
        while len(self.recent) > keep:
            self.recent.popleft()

    def permute_counts(self, index: torch.Tensor) -> None:
        """Renumber the experts of every per-expert count this runtime holds (the interval's, the step in
        progress and ``recent``): new expert ``i`` takes old expert ``index[i]``'s counts."""
        def take(c):
            return c.index_select(0, index.to(c.device)) if torch.is_tensor(c) and c.dim() == 1 else c
        self.step_counts, self._step_in_progress = take(self.step_counts), take(self._step_in_progress)
        self.recent = deque(take(c) for c in self.recent)

    def recent_counts(self) -> torch.Tensor:
        """This rank's [E] counts summed over ``recent``, float64 (zeros before the first step closes)."""
        if not self.recent:
            return torch.zeros(self.num_experts, dtype=torch.float64)
        dev = self.recent[-1].device
        return torch.stack([c.to(dev, torch.float64) for c in self.recent]).sum(0)

    def take_step_counts(self) -> torch.Tensor:
        """This rank's [E] counts since the last call (zeros when there was no training forward)."""
        c, self.step_counts = self.step_counts, None
        return torch.zeros(self.num_experts, dtype=torch.long) if c is None else c

    def take_dropped(self) -> float:
        """This rank's dropped assignments since the last call."""
        d, self.step_dropped = self.step_dropped, None
        return 0.0 if d is None else float(d)

    def take_waits(self) -> Tuple[float, float, float]:
        """Seconds since the last call that the ends of this rank's backward passes waited for the overlapped
        replica all-reduces (0 without ``overlap_sync``) and for the shadows' gradient reduces, and that it blocked
        on moves."""
        waits = (self.sync_wait_s, self.shadow_reduce_wait_s, self.move_wait_s)
        self.sync_wait_s = self.shadow_reduce_wait_s = self.move_wait_s = 0.0
        return waits

    @torch.no_grad()
    def execute(self, moves: Sequence[Move], bank, optimizer=None) -> int:
        """Carry out ``moves`` on this rank's ``bank`` (and the optimizer state of its parameters) and apply them
        to ``state``. Every rank of the expert-parallel group calls it with the same moves, between optimizer
        steps; the transfers are complete on return. Returns the bytes this rank sent."""
        start = time.perf_counter()
        params = [p for p in (bank.w1, bank.w2, bank.b1, bank.b2) if p is not None]
        for mv in moves:
            if mv.kind not in ("expand", "shrink", "migrate"):
                raise PlacementError(f"unknown move kind {mv.kind!r}")
        sent = self._send_now(moves, params, optimizer)
        self.state.apply(moves)
        self.moves_done += len(moves)
        self.bytes_moved += sent
        self._rebuild()
        if any(mv.sends_rows for mv in moves):
            self.move_wait_s += time.perf_counter() - start
        return sent

    def _send_now(self, moves, params, optimizer) -> int:
        me, sent = self.ep.rank, 0
        for mv in moves:
            if mv.sends_rows:
                if me == mv.src:
                    for t in self._slot_tensors(params, optimizer, mv.src_slot):
                        dist.send(t.contiguous(), dst=self.ep.global_ranks[mv.dst], group=self.ep.group)
                        sent += t.numel() * t.element_size()
                elif me == mv.dst:
                    for t in self._slot_tensors(params, optimizer, mv.dst_slot):
                        buf = torch.empty_like(t)
                        dist.recv(buf, src=self.ep.global_ranks[mv.src], group=self.ep.group)
                        t.copy_(buf)
            if mv.kind in ("shrink", "migrate") and me == mv.src:
                for t in self._slot_tensors(params, optimizer, mv.src_slot):
                    t.zero_()
        return sent

    @staticmethod
    def _slot_tensors(params, optimizer, slot: int) -> List[torch.Tensor]:
        out = []
        for p in params:
            out.append(p.data[slot])
            out += slot_state_views(optimizer, p, slot)
        return out

    # --- checkpoints by logical id -----------------------------------------------------------------------------
    def occupied_rows(self) -> int:
        """1 + this rank's highest slot that holds an expert: the bank rows past it are free (free_rows.py)."""
        slots = self.state.slots_of(self.ep.rank)
        return max((i + 1 for i, e in enumerate(slots) if e is not None), default=0)

    def slot_weights(self) -> torch.Tensor:
        """[slots] 1 / (replicas of the slot's expert), 0 for a free slot: weights that count every logical expert
        once in sums over all ranks' slots (e.g. the squared gradient norm for clipping)."""
        return torch.tensor([0.0 if e is None else 1.0 / self.state.num_replicas(e) for e in
                             self.state.slots_of(self.ep.rank)], dtype=torch.float64)

    def grad_sq_norm(self, grad: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
        """Squared L2 norm of one [slots, ...] bank gradient with every logical expert counted once over the
        expert-parallel group (rows weighted by ``slot_weights``); on the gradient's device, no host sync."""
        n = self.occupied_rows()                 # the free slots past it weigh 0: their rows are not read
        rows = torch.linalg.vector_norm(grad[:n].reshape(n, -1), dim=1, dtype=dtype).pow(2)
        return (rows * self.slot_weights()[:n].to(device=rows.device, dtype=dtype)).sum()

    def expert_grad_sq_norm(self, bank) -> torch.Tensor:
        """This rank's share of the squared L2 norm of the bank's gradients (``grad_sq_norm`` summed over its
        parameters). float64 scalar on the CPU."""
        total = torch.zeros((), dtype=torch.float64)
        for p in (bank.w1, bank.w2, bank.b1, bank.b2):
            if p is not None and p.grad is not None:
                total = total + self.grad_sq_norm(p.grad).cpu()
        return total

    def to_checkpoint(self) -> dict:
        """The placement (for a resume at the same expert-parallel size, whose bank rows are laid out by it)."""
        return {"state": self.state.to_dict(), "shadowed": list(self.shadowed)}

    def from_checkpoint(self, d: dict) -> None:
        state = PlacementState.from_dict(d["state"])
        if (state.num_experts, state.num_ranks, state.slots_per_rank) != (self.num_experts, self.ep.size,
                                                                           self.slots_per_rank):
            raise PlacementError(f"checkpoint placement is E={state.num_experts}, P={state.num_ranks}, "
                                 f"slots={state.slots_per_rank}; this layer E={self.num_experts}, P={self.ep.size}, "
                                 f"slots={self.slots_per_rank}")
        self.state = state
        self.shadowed = [int(e) for e in d.get("shadowed", [])]
        self._rebuild()

    def reset(self) -> None:
        """Back to contiguous blocks, nothing shadowed (for a model whose slots were just filled that way)."""
        self.state = PlacementState(self.num_experts, self.ep.size, self.slots_per_rank, max_replicas_per_rank=1)
        self.shadowed = []
        self._rebuild()


def apply_placement(changes: Sequence[Tuple[PlacementRuntime, Sequence[Move], object]], optimizer=None) -> int:
    """Collective over the default group, between optimizer steps: execute each (runtime, moves, bank) and make
    the replica groups the new placements need. Every rank calls it (with its own layers; possibly none).
    Returns the bytes this rank sent."""
    caches = {id(rt.cache): rt.cache for rt, _, _ in changes} or {id(group_cache()): group_cache()}
    sent = sum(rt.execute(moves, bank, optimizer) for rt, moves, bank in changes)
    needed = [g for rt, _, _ in changes for g in rt.needed_groups()]
    for cache in caches.values():
        cache.ensure(needed)
    return sent
