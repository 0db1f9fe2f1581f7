"""The pay-off guard: a placement change is kept only when the steps measured after it are not slower than those
before it (the papers' planners trust their cost models; this keeps a model that is wrong here from costing steps).

- Each change is judged once its window of steps is complete (``check``; no new change meanwhile): the median step
  after it, plus the change's own time spread over the window, against the median step before it moved by the
  routing's drift (``_drift_credit``). Slower by more than ``margin`` plus ``undo_sigmas`` standard errors: undone
  (the previous slot table and shadow set restored), the policy paused ``backoff ** strikes`` runs; within the
  margin: kept; in between: judged again a window later, up to ``verdict_windows`` windows, then by the margin
  alone. After the first ``min_steps`` steps of a longer window, a sure loss is undone early (``early_due``).
- A change that moved no rows (only shadow sets changed) costs nothing to undo: it is judged with margin 0, and so
  is the watch of a placement reached by such changes alone (keeping one that is not faster buys nothing).
- Away from the original placement, a watch compares the steps since it left with the ``reference`` (the median
  of the last ``reference_steps`` steps run there) at 2, 4, 8, ... windows: slower by more than the margin (and,
  before ``sure_windows`` windows, the noise) returns to the original placement; after ``max_returns`` returns the
  policy stops for the run. Before any change was kept, an undone trial from the original placement counts as a
  return too: the model is wrong on this job. Once a change that moved rows was kept, it is right (``trusted``):
  until the next return, later changes are judged by the watch alone and need only the planners' least gain.
- ``step_noise``: a step's relative spread from one step to the next at the original placement (the verdicts'
  standard errors); ``resolvable_gain``: the least saving a verdict tells from it (the planners must predict it).

Every median and time is the maximum over the job's ranks (one all-reduce), so every rank decides the same.
Constants: ``GuardSettings``; the measurements behind them: docs/history/ (the guard's design notes).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..parallel import comm_device
from .eplb import moves_to
from .state import PlacementError, PlacementState

__all__ = ["GuardSettings", "PayoffGuard", "WAIT", "job_max", "job_max_many"]

WAIT = "wait"


@dataclass(frozen=True)
class GuardSettings:
    """The pay-off guard's constants (``PayoffGuard(**overrides)`` changes any of them)."""
    margin: float = 0.03
    """A change may cost this fraction of a step and still be kept (``--moe-placement-guard``; < 0: guard off).
    A change that moved nothing (a new shadow set) costs nothing to undo: it is kept, and a placement reached by
    such changes alone stays, only when not slower at all."""
    min_steps: int = 3
    """The shortest window of steps a verdict is a median of (else the policy's interval)."""
    backoff: int = 2
    """After an undo the policy pauses ``backoff ** strikes`` runs (strikes: consecutive undos)."""
    max_pause: int = 32
    """The longest pause, in runs, after an undo or a return to the original placement."""
    warmup_steps: int = 10
    """The run's first steps, slower while caches and allocators warm up, are not observed: judged against them a
    change looks cheaper than it is."""
    min_reference: int = 6
    """Steps under the original placement (after the warm-up) before a policy may make its first change."""
    max_returns: int = 2
    """Returns to the original placement after which the policy stops for the run."""
    reference_steps: int = 64
    """The reference is the median of the last this many steps under the original placement."""
    resolve_sigmas: float = 2.0
    """A change's predicted saving must exceed this many standard deviations of its first verdict against the start."""
    max_drift: float = 0.05
    """The routing's drift, as the cost model prices it, excuses at most this fraction of a step in a verdict."""
    undo_sigmas: float = 1.0
    """An early verdict or watch undoes a loss only beyond the margin by this many standard errors."""
    verdict_windows: int = 3
    """An inconclusive verdict waits for up to this many windows after the change, then the margin decides."""
    sure_windows: int = 4
    """From this many windows away from the original placement the watch judges by the margin alone."""


def job_max(value: Optional[float]) -> Optional[float]:
    """The maximum of ``value`` (>= 0) over every rank of the job (None when any rank has none). Collective."""
    return job_max_many([value])[0]


def job_max_many(values: Sequence[Optional[float]]) -> List[Optional[float]]:
    """``job_max`` of several values (each >= 0 or None) in one all-reduce: a policy run's scalars cost one
    collective, not one each."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(values)
    own = [-1.0 if v is None else float(v) for v in values]
    t = torch.tensor(own + [-v for v in own], dtype=torch.float64, device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)          # the maxima, then minus the minima
    n = len(own)
    return [None if -float(t[n + i]) < 0 else float(t[i]) for i in range(n)]


@dataclass
class _Change:
    before_s: float                                   # median step before the change (slowest rank)
    cost_s: float                                     # the change's own time (the hook run that made it)
    start: int                                        # index of the first step after the change
    window: int
    snapshots: List[Tuple[object, PlacementState, Tuple[int, ...]]] = field(default_factory=list)
    from_origin: bool = False                         # made from the original placement: undoing it returns there
    before_model_s: Optional[float] = None            # the model's step of the old placement on the counts before
    old_after_s: List[float] = field(default_factory=list)   # the model's step of the old placement, per window after
    margin: float = 0.0                               # the loss it may cost and still be kept (fraction of a step)
    moved: bool = True                                # it moved rows (else only shadow sets changed)


class PayoffGuard:
    """Module docstring. ``margin`` < 0 turns the guard off (every change is kept); any other keyword overrides the
    ``GuardSettings`` field of that name."""

    def __init__(self, margin: Optional[float] = None, settings: GuardSettings = GuardSettings(), **overrides):
        if margin is not None:
            overrides["margin"] = float(margin)
        self.settings = replace(settings, **overrides)
        self.steps: List[float] = []                  # every observed training step's duration (s), in order
        self.pending: Optional[_Change] = None
        self.strikes = self.pause = self.kept = self.undone = 0
        self.reference: Optional[float] = None         # the job's median step under the original placement
        self.reference_n = 0                          # how many steps that median is of
        self.reference_model_s: Optional[float] = None   # the model's step of the original placement back then
        self.origin: Optional[List[Tuple[object, PlacementState, Tuple[int, ...]]]] = None
        self.returned = 0                             # returns to the original placement
        self.stopped = False                          # max_returns reached: no more changes in this run
        self.at_origin = True                         # the placement is the one the run started with
        self.origin_steps: List[float] = []           # the last reference_steps steps run there
        self.away: List[float] = []                   # the last 4 x reference_steps steps since it left
        self.away_steps = 0                           # every step since the placement left it
        self._next_watch = 0                          # away_steps at which the next watch verdict falls
        self.observed = 0                             # every step observed (``steps`` keeps the recent ones)
        self.job_noise: Optional[float] = None        # the job's step_noise, as the policy last all-reduced it
        self.last_drift_s = 0.0                       # how far the last verdict moved the steps before (s)
        self.last_measured_s = 0.0                    # the last verdict's or watch's measured step (s)
        self.last_reference_s = 0.0                   # what that step was compared with (s, drift included)
        self.inconclusive = 0                         # verdicts and watches that found a loss within the noise
        self.away_free = False                        # every change since leaving the start moved no rows
        self.trusted = False                          # a change that moved rows paid since leaving the start

    @property
    def enabled(self) -> bool:
        return self.settings.margin >= 0

    def window(self, interval: int) -> int:
        return max(self.settings.min_steps, int(interval))

    def observe(self, seconds: float) -> None:
        """One training step's duration (called by the after-step hook after every step)."""
        if self.enabled:
            self.observed += 1
            if self.observed <= self.settings.warmup_steps:
                return
            self.steps.append(float(seconds))
            if self.pending is None and len(self.steps) > 256:
                del self.steps[:-128]
            if self.at_origin:
                self.origin_steps.append(float(seconds))
                del self.origin_steps[:-self.settings.reference_steps]
            else:
                self.away.append(float(seconds))
                del self.away[:-4 * self.settings.reference_steps]
                self.away_steps += 1

    def baseline(self, interval: int) -> Optional[float]:
        """This rank's median step over the last window, or over every step seen when fewer (None under
        ``min_steps``: a policy's first run at step ``interval`` has seen ``interval - 1`` step durations)."""
        return statistics.median(self.steps[-self.window(interval):]) if len(self.steps) >= self.settings.min_steps else None

    def check(self, interval: int, drift: Optional[Callable[[list], Optional[float]]] = None):
        """At a policy run (collective while a change is pending or the placement is away from the original): None
        (nothing to judge, or it paid), ``WAIT`` (not judged yet, or a loss within the noise: make no new change),
        or per layer ``(runtime, moves, shadow set)`` that undo the last change or return to the original (it lost).
        ``drift(snapshots)`` (collective): the model's step of the OLD placement on the counts since the change, or
        None; the steps before the change are moved by its difference from ``before_model_s`` (the routing moves
        while a change is judged: early in training every placement's steps slow down). The watch passes the
        original placement's snapshots."""
        if not self.enabled:
            return None
        change = self.pending
        if change is None:
            return self._watch(interval, drift)
        after = self.steps[change.start:]
        early = len(after) < change.window          # an early look (``early_due``): it may only undo a sure loss
        if early and len(after) < self.settings.min_steps:
            return WAIT
        after = after[:self.settings.verdict_windows * change.window]
        measured = job_max(statistics.median(after)) + change.cost_s / max(len(after), change.window)
        before_s = change.before_s
        if drift is not None and change.before_model_s is not None:
            old_after = drift(change.snapshots)
            if old_after is not None:
                change.old_after_s.append(old_after)
            if change.old_after_s:                    # the old placement on the routing of every window judged
                before_s = max(before_s + self._drift_credit(statistics.fmean(change.old_after_s)
                                                             - change.before_model_s, before_s), 0.0)
        final = len(after) >= self.settings.verdict_windows * change.window
        behind = self._behind(interval, drift)        # (the watch's numbers, when judged, give way to the verdict's)
        self.last_measured_s, self.last_reference_s = measured, before_s
        lost = measured > before_s * (1.0 + change.margin)
        within_noise = measured <= before_s * (1.0 + change.margin) + \
            self.settings.undo_sigmas * self._median_difference_error(change.before_s, change.window, len(after))
        if early and not (lost and not within_noise):
            return WAIT                               # not a sure loss yet: the whole window decides
        if not behind and lost and not final and within_noise:
            self.inconclusive += 1                    # within the noise: judge again on one more window
            return WAIT
        self.pending = None
        self.last_drift_s = before_s - change.before_s
        if not behind and not lost:
            self.kept += 1
            self.trusted = self.trusted or change.moved
            self.strikes = 0
            return None
        self.undone += 1
        self.strikes += 1
        self.pause = min(self.settings.backoff ** self.strikes, self.settings.max_pause)
        if behind or change.from_origin:
            # a trial from the start that lost before any change paid counts as a return: a cost model that has
            # not been right once on this job stops after ``max_returns`` such trials
            return self._return_to_origin(counted=behind or self.kept == 0)
        return self._undo(change.snapshots)

    def early_due(self) -> bool:
        """Whether a pending change has just run ``min_steps`` steps of a longer window (``check`` then undoes a sure
        loss only). The same on every rank: every rank observes every step."""
        change = self.pending
        return (change is not None and self.settings.min_steps < change.window
                and len(self.steps) - change.start == self.settings.min_steps)

    def _drift_credit(self, modelled: float, step_s: float) -> float:
        """The routing's drift as a verdict counts it: the cost model's difference of the old placement between two
        windows' counts, at most ``max_drift`` of the step (where the model misprices a skew, it cannot excuse more)."""
        return min(modelled, self.settings.max_drift * step_s)

    def _behind(self, interval: int, drift=None) -> bool:
        """Whether the steps since the placement left the original one are slower than the reference beyond the
        noise (``_against_reference``), judged on at least two windows of them. Collective when judged."""
        if self.at_origin or self.reference is None or len(self.away) < 2 * self.window(interval):
            return False
        return self._against_reference(interval, drift) is True

    def _against_reference(self, interval: int, drift=None) -> Optional[bool]:
        """The job's median step since leaving the original placement against the reference: True (slower by more
        than the margin and, before ``sure_windows`` windows away, by more than ``undo_sigmas`` standard errors of
        the two medians beyond it), False (within the margin) or None (in between: not yet known). The reference
        moves with the routing's drift (``check``). Collective."""
        reference = self.reference
        if drift is not None and self.reference_model_s is not None and self.origin is not None:
            now = drift(self.origin)
            if now is not None:
                reference = max(reference + self._drift_credit(now - self.reference_model_s, reference), 0.0)
        away = job_max(statistics.median(self.away))
        self.last_measured_s, self.last_reference_s = away, reference
        margin = 0.0 if self.away_free else self.settings.margin
        if away <= reference * (1.0 + margin):
            return False
        if self.away_steps >= self.settings.sure_windows * self.window(interval):
            return True
        error = self._median_difference_error(reference, len(self.away), self.reference_n)
        return True if away > reference * (1.0 + margin) + self.settings.undo_sigmas * error else None

    def _watch(self, interval: int, drift=None):
        """Away from the original placement with no change pending: at 2, 4, 8, ... windows since leaving it,
        the median of the steps since then (up to the last 4 x reference_steps) against the reference; one window
        later again when that was within the noise."""
        if self.at_origin or self.reference is None or self.origin is None:
            return None
        if self.away_steps < max(self._next_watch, 2 * self.window(interval)):
            return None
        verdict = self._against_reference(interval, drift)
        if verdict is None:
            self.inconclusive += 1
            self._next_watch = self.away_steps + self.window(interval)
            return None
        self._next_watch = 2 * self.away_steps
        if not verdict:
            return None
        self.undone += 1
        self.pause = self.settings.max_pause
        return self._return_to_origin(counted=True)

    def _return_to_origin(self, counted: bool):
        if counted:
            self.returned += 1
            if self.returned >= self.settings.max_returns:
                self.stopped = True
        self._restart_watch(at_origin=True)
        return self._undo(self.origin)

    def _restart_watch(self, at_origin: bool) -> None:
        """A new placement from here on: its steps alone feed the watch, at 2, 4, ... windows from now."""
        self.at_origin, self.away, self.away_steps, self._next_watch = at_origin, [], 0, 0
        self.trusted = self.trusted and not at_origin

    def _undo(self, snapshots):
        undo = []
        for rt, state, shadow in snapshots:
            target = [sorted(e for e in state.slots_of(r) if e is not None) for r in range(state.num_ranks)]
            try:
                moves = moves_to(rt.state, target, nbytes=0)
            except PlacementError:
                moves = []                                # cannot be reached through a free slot: keep it
            undo.append((rt, moves, shadow))
        return undo

    def step_noise(self) -> Optional[float]:
        """This rank's relative spread of one step under the original placement, from one step to the next:
        1.4826 x the median of the absolute differences of consecutive steps, over sqrt(2) and the median step (a
        standard deviation that the odd evaluation or checkpoint step does not move, nor a slow drift such as the
        slower first steps of a run); None before ``min_reference`` such steps."""
        steps = self.origin_steps
        if len(steps) < self.settings.min_reference:
            return None
        med = statistics.median(steps)
        jumps = statistics.median(abs(b - a) for a, b in zip(steps, steps[1:]))
        return 1.4826 * jumps / (2.0 ** 0.5) / med if med > 0 else None

    def resolvable_gain(self, interval: int, noise: Optional[float]) -> float:
        """The smallest fraction of a step a change must save for the guard to tell it from the steps' noise: the
        first verdict against the start compares the median of two windows with the reference, which differ by
        noise alone with a standard deviation of about sqrt(2) x 1.25 x noise / sqrt(2 x window) (1.25: a median's
        standard error over a mean's); ``resolve_sigmas`` of those. 0 with the guard off, no estimate yet, or
        ``trusted`` (the watch judges)."""
        if not self.enabled or noise is None or self.trusted:
            return 0.0
        return self.settings.resolve_sigmas * 1.25 * (2.0 ** 0.5) * noise / (2 * self.window(interval)) ** 0.5

    def _median_difference_error(self, step_s: float, n1: int, n2: int) -> float:
        """The standard error (s) of the difference of the medians of ``n1`` and ``n2`` steps of about ``step_s``
        that vary by the job's ``step_noise`` (a median's standard error is about 1.25 x the mean's)."""
        return 1.25 * (self.job_noise or 0.0) * step_s * (1.0 / n1 + 1.0 / n2) ** 0.5

    def paused(self, interval: int = 0, steps_left: Optional[int] = None) -> bool:
        """Whether this run must not change the placement: after an undo (counts the run), before the reference
        has ``min_reference`` steps, for good once ``stopped``, or with fewer than two windows of ``interval`` left
        before the run's last step (``steps_left``): a verdict comes a window after its change, so a later change
        could neither be undone before the end nor pay its moves back."""
        if not self.enabled:
            return False
        if self.stopped or (self.at_origin and len(self.origin_steps) < self.settings.min_reference):
            return True
        if self.pause > 0:
            self.pause -= 1
            return True
        return steps_left is not None and steps_left < 2 * self.window(interval)

    def record(self, before_s: Optional[float], cost_s: float, interval: int, runtimes: Sequence[object],
               states: Sequence[PlacementState], shadows: Sequence[Tuple[int, ...]],
               before_model_s: Optional[float] = None, free_undo: bool = False) -> None:
        """A run changed the placement: remember what it was, to judge the change once its window is measured.
        ``before_s``: the job's median step before the change (``job_max(baseline(interval))``); ``cost_s``: this
        rank's time for the run that made it (the verdict adds the slowest rank's); ``before_model_s``: the model's
        step of the old placement on the counts before the change (``check``'s ``drift`` reference; job-wide);
        ``free_undo``: the change moved no rows, so it is judged with margin 0. While ``trusted`` nothing is kept:
        the watch judges the change with every step since the start (its own time not charged). Collective."""
        if before_s is None or not self.enabled:
            return
        cost_s = job_max(cost_s)
        snapshots = [(rt, state.copy(), tuple(shadow)) for rt, state, shadow in zip(runtimes, states, shadows)]
        from_origin = self.at_origin
        if from_origin:                               # the steps before this change ran the original placement
            if self.origin is None:
                self.origin = snapshots
            self.reference = job_max(statistics.median(self.origin_steps)) if self.origin_steps else before_s
            self.reference_n = len(self.origin_steps) or 1
            self.reference_model_s = before_model_s
            self._restart_watch(at_origin=False)
        self.away_free = free_undo and (from_origin or self.away_free)
        if self.trusted:                              # (never at the original placement)
            return
        self.pending = _Change(before_s, cost_s, len(self.steps), self.window(interval), snapshots, from_origin,
                               before_model_s, margin=0.0 if free_undo else self.settings.margin, moved=not free_undo)
