"""The pay-off guard: a placement change is kept only when the measured steps after it are not slower than those
before it, so a policy never loses to the placement it started from by more than the guard's margin.

The planners decide from a cost model; where the model is wrong about a cost (a replica's gradient all-reduce, a
shadow broadcast, padding, the moves themselves), a change it predicted to pay can lose. The guard checks each change
against the measurement that follows it: after a run that changed something (moves or a new shadow set), the next run
compares the interval's measured step time, plus the change's own time (the hook that made the moves) spread over
the interval, with the interval before the change. Slower by more than ``margin``: the change is undone (the previous
slot table is restored with ``eplb.moves_to``, the previous shadow set put back) and the policy pauses for
``backoff ** strikes`` runs (doubling at each consecutive undo, at most ``max_pause``); not slower: kept, and the
strikes reset.

The step times are the maximum over all ranks (one all-reduce of one number), so every rank takes the same decision.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .state import Move, PlacementError, PlacementState

__all__ = ["PayoffGuard", "job_max"]


def job_max(value: Optional[float]) -> Optional[float]:
    """The maximum of ``value`` over every rank of the job (None when any rank has none). Collective."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    t = torch.tensor([-1.0 if value is None else float(value)], dtype=torch.float64)
    low = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return None if float(low) < 0 else float(t)


@dataclass
class _Change:
    before_s: float                                   # measured step time of the interval before the change
    cost_s: float                                     # the change's own time (the hook that made it)
    snapshots: List[Tuple[object, PlacementState, Tuple[int, ...]]] = field(default_factory=list)


class PayoffGuard:
    """Module docstring. ``margin`` < 0 turns the guard off (every change is kept)."""

    def __init__(self, margin: float = 0.03, backoff: int = 2, max_pause: int = 32):
        self.margin, self.backoff, self.max_pause = float(margin), int(backoff), int(max_pause)
        self.pending: Optional[_Change] = None
        self.strikes = self.pause = self.kept = self.undone = 0

    @property
    def enabled(self) -> bool:
        return self.margin >= 0

    def check(self, measured_s: Optional[float], interval: int) -> Optional[List[Tuple[object, List[Move],
                                                                                        Tuple[int, ...]]]]:
        """At the start of a run, with the job's measured step time since the last run: None, or for every layer
        ``(runtime, moves, shadow set)`` that undo the last change (it did not pay)."""
        change, self.pending = self.pending, None
        if change is None or measured_s is None or not self.enabled:
            return None
        after = measured_s + change.cost_s / max(interval, 1)
        if after <= change.before_s * (1.0 + self.margin):
            self.kept += 1
            self.strikes = 0
            return None
        self.undone += 1
        self.strikes += 1
        self.pause = min(self.backoff ** self.strikes, self.max_pause)
        undo = []
        for rt, state, shadow in change.snapshots:
            target = [sorted(e for e in state.slots_of(r) if e is not None) for r in range(state.num_ranks)]
            try:
                from .eplb import moves_to
                moves = moves_to(rt.state, target, nbytes=0)
            except PlacementError:
                moves = []                                # cannot be reached through a free slot: keep it
            undo.append((rt, moves, shadow))
        return undo

    def paused(self) -> bool:
        """Whether this run must not change the placement (after an undo); counts the run."""
        if self.pause > 0:
            self.pause -= 1
            return True
        return False

    def record(self, before_s: Optional[float], cost_s: float, runtimes: Sequence[object],
               states: Sequence[PlacementState], shadows: Sequence[Tuple[int, ...]]) -> None:
        """A run changed the placement: remember what it was, to judge the change at the next run."""
        if before_s is None or not self.enabled:
            return
        self.pending = _Change(before_s, cost_s, list(zip(runtimes, states, shadows)))
