"""The pay-off guard: a placement change is kept only when the measured steps after it are not slower than those
before it, so a policy never loses to the placement it started from by more than the guard's margin.

The planners decide from a cost model; where the model is wrong about a cost (a replica's gradient all-reduce, a
shadow broadcast, padding, the moves themselves), a change it predicted to pay can lose. The guard checks each change
against the measurement that follows it. It sees every training step's duration (``observe``, from the after-step
hook; a step beside which the trainer evaluated counts as the step before it) and compares the median step of the
``window`` steps after a change (at least 3, or the policy's interval), plus the change's own time (the hook run
that made it) spread over the window, with the median of the ``window`` steps before it. Medians, so a step that also ran an evaluation or a checkpoint does not decide. Until the window
after a change is complete the policy makes no new change (``waiting``), so each verdict judges one change.

The routing moves while a change is judged (early in training it concentrates on fewer experts, and the steps
of every placement slow down; measured at 2,048 tokens per rank: static's steps 10-20 slower than its steps 1-10,
and FlexMoE's first change judged a loss on that alone). So the policy gives the verdict the cost model's time of
the OLD placement on the counts of the window before the change and on those of the window after it, and the
steps before are moved by the difference: the change is judged against what the old placement would have run.

A verdict is a difference of two medians of noisy steps, so "slower" has three answers. Slower by more than
``margin`` plus ``UNDO_SIGMAS`` standard errors of that difference (``verdict_error``, from the job's
``step_noise``): lost. Within the margin: paid. In between: not yet known, and the change is judged again one window
later on every step since it (the policy still makes no new change), up to ``VERDICT_WINDOWS`` windows, after which
the margin alone decides. Measured at 2,048 tokens per rank: steps varying 7-12% from one to the next make two
10-step medians of one placement differ by 4-7%, and against the bare 3% margin one FlexMoE run in each of two rounds
was sent back to the start by its first verdict or the first watch, ending at 1.02-1.05x of static where the runs
that kept their changes reached 1.15x. Keeping such a change at once (and leaving it to the watch) was measured too:
no faster there, and it lets a change that loses a little run until the watch is sure.

Lost: the change is undone (the previous slot table is restored with ``eplb.moves_to``,
the previous shadow set put back) and the policy pauses for ``backoff ** strikes`` runs (doubling at each
consecutive undo, at most ``max_pause``); not slower: kept, and the strikes reset. The medians and the change's
own time are the maximum over all ranks (all-reduces), so every rank takes the same decision.

Judged one by one, a chain of changes each within the margin can add up to a loss against the placement the policy
started from (measured: FlexMoE at 512 tokens per rank, 0.89x of static with 1 of 3 changes undone), and a change
kept on a lucky window keeps losing afterwards. So the guard also keeps the ``reference``: the median of the steps
run under the original placement (the last ``REFERENCE_STEPS`` of them; a policy makes no change before
``min_reference`` such steps exist). Away from the original placement it watches the median of the steps since
the placement left it (up to the last ``4 x REFERENCE_STEPS``), at 2, 4, 8, ... windows after leaving (a growing
sample, so the verdicts get surer and rarer), and at each pending change's verdict too, once those steps span two
windows (one window of a few steps is too noisy to send a policy back to its start): slower than the reference by
more than ``margin`` (and, before ``SURE_WINDOWS`` windows away, by more than ``UNDO_SIGMAS`` standard errors of
the two medians beyond it; within them the watch looks again one window later) returns to the original placement
(slot table and shadow set), whatever the last change did, and pauses the policy ``max_pause`` runs. The reference
is moved for the routing's drift as a verdict's steps before are: by the model's difference between the original
placement on the counts of the latest window and on those before the placement left it. An undo that restores an earlier change (not the original placement)
restarts that watch on the restored placement's own steps, at 2, 4, ... windows again: its earlier steps ran on
older routing (measured at 512 tokens per rank and 25 MB/s: after an undo at step 30 the restored placement ran
5-8% slower than static to the end of the run, and the watch, next due at twice the steps since leaving and
judging a median full of that placement's earlier steps, never fired). After ``max_returns`` returns the policy
stops for the rest of the run (``stopped``): on this run its cost model predicts gains it does not deliver, and
each further try costs steps.

A verdict can only see a gain larger than the steps' own spread: ``resolvable_gain`` is the smallest saving (a
fraction of the step) that two window medians tell apart from noise, from the spread of the steps under the original
placement (``step_noise``, from one step to the next). The policies ask their planners for at least that much, so a change the guard could not
verify is not made: where steps vary by 10% (the emulated cluster's ranks, sharing a host) two 10-step windows
resolve about 8% of a step and two 3-step windows (shadowing's) about 14%; on a quiet GPU cluster (1-2%) 1-3%.

The verdicts also say how much of its predicted savings the model delivers on this run: each change carries the
saving its planner predicted (seconds per step), each verdict measures the one it got (the median step before it
less the median after it and the change's own time), and ``realisation`` is their ratio summed over the verdicts,
with a prior of one verdict that delivered exactly its prediction, clipped to [MIN_REALISATION, 1]. A verdict
counts against the model only by what it measured below the prediction beyond its own standard error (two window
medians of steps that vary by the job's ``step_noise``): where one window of steps varies by more than the
predicted saving, a single unlucky verdict says nothing about the model (measured at 2,048 tokens per rank: steps
varying 20% from one to the next, one shadow set undone, and the realisation fell to 0.13 for the rest of the run).
A verdict says at worst that the model delivered none of its prediction: a loss beyond that is the undo's to repair,
not a share of the saving (measured at 2,048 tokens per rank over 120 steps: one change undone at step 25-30, while
the hot experts still changed from one window to the next, counted as about -1.1 of its prediction, the
realisation fell to 0.29 and the policy, asked for a 75% gain, changed nothing for the 90 steps left). And a
verdict's weight halves every ``REALISATION_HALF_LIFE`` windows: the routing it was measured on moves on, and a
model refuted early must not stay refuted on the routing of a hundred steps later; a model refuted at every window
stays low (about 0.17), since each new verdict weighs in full. The policies divide their planners' threshold by it:
a model whose savings were refuted must predict more before the next change (measured: shadowing at 512 tokens per
rank predicted 20-30% of the layers' time per set and the guard undid 10 of 11 sets), while a model whose savings the steps confirm keeps the threshold set by the noise alone.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..parallel import comm_device
from .eplb import moves_to
from .state import PlacementError, PlacementState

__all__ = ["PayoffGuard", "WAIT", "job_max", "job_max_many"]

WAIT = "wait"
REFERENCE_STEPS = 64          # steps under the original placement the reference is the median of
RESOLVE_SIGMAS = 2.0          # a change's predicted saving must exceed this many standard deviations of its verdict
UNDO_SIGMAS = 1.0             # an early verdict undoes a loss only beyond the margin by this many standard errors
VERDICT_WINDOWS = 3           # an inconclusive verdict on a change waits for up to this many windows after it
SURE_WINDOWS = 4              # from this many windows away from the start the watch judges by the margin alone
MIN_REALISATION = 0.05        # the lowest share of its predicted savings a model is trusted to deliver
REALISATION_HALF_LIFE = 3     # a verdict's weight in the realisation halves every this many windows of steps


def job_max(value: Optional[float]) -> Optional[float]:
    """The maximum of ``value`` (>= 0) over every rank of the job (None when any rank has none). Collective."""
    return job_max_many([value])[0]


def job_max_many(values: Sequence[Optional[float]]) -> List[Optional[float]]:
    """``job_max`` of several values (each >= 0 or None) in one all-reduce: a policy run's scalars cost one
    collective, not one each (on the emulated cluster a small all-reduce costs a few ms of a rank's step)."""
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
    predicted_s: Optional[float] = None               # the saving per step its planner predicted
    before_model_s: Optional[float] = None            # the model's step of the old placement on the counts before
    old_after_s: List[float] = field(default_factory=list)   # the model's step of the old placement, per window after


class PayoffGuard:
    """Module docstring. ``margin`` < 0 turns the guard off (every change is kept)."""

    def __init__(self, margin: float = 0.03, min_steps: int = 3, backoff: int = 2, max_pause: int = 32,
                 min_reference: int = 6, max_returns: int = 2):
        self.margin, self.min_steps = float(margin), int(min_steps)
        self.backoff, self.max_pause = int(backoff), int(max_pause)
        self.min_reference, self.max_returns = int(min_reference), int(max_returns)
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
        self.origin_steps: List[float] = []           # the last REFERENCE_STEPS steps run there
        self.away: List[float] = []                   # the last 4 x REFERENCE_STEPS steps since it left
        self.away_steps = 0                           # every step since the placement left it
        self._next_watch = 0                          # away_steps at which the next watch verdict falls
        self.observed = 0                             # every step observed (``steps`` keeps the recent ones)
        # per verdict with a prediction: (step observed, window, predicted saving (s), the saving it counts (s))
        self.verdicts: List[Tuple[int, int, float, float]] = []
        self.judged = 0                               # verdicts with a prediction
        self.job_noise: Optional[float] = None        # the job's step_noise, as the policy last all-reduced it
        self.last_drift_s = 0.0                       # how far the last verdict moved the steps before (s)
        self.inconclusive = 0                         # verdicts and watches that found a loss within the noise

    @property
    def enabled(self) -> bool:
        return self.margin >= 0

    def window(self, interval: int) -> int:
        return max(self.min_steps, int(interval))

    def observe(self, seconds: float) -> None:
        """One training step's duration (called by the after-step hook after every step)."""
        if self.enabled:
            self.steps.append(float(seconds))
            self.observed += 1
            if self.pending is None and len(self.steps) > 256:
                del self.steps[:-128]
            if self.at_origin:
                self.origin_steps.append(float(seconds))
                del self.origin_steps[:-REFERENCE_STEPS]
            else:
                self.away.append(float(seconds))
                del self.away[:-4 * REFERENCE_STEPS]
                self.away_steps += 1

    def baseline(self, interval: int) -> Optional[float]:
        """This rank's median step over the last window, or over every step seen when fewer (None under
        ``min_steps``: a policy's first run at step ``interval`` has seen ``interval - 1`` step durations)."""
        return statistics.median(self.steps[-self.window(interval):]) if len(self.steps) >= self.min_steps else None

    def check(self, interval: int, drift: Optional[Callable[[list], Optional[float]]] = None):
        """At a policy run (collective while a change is pending or the placement is away from the original):
        None (nothing to judge, or it paid), ``WAIT`` (a change's window is not complete, or its loss is within the
        noise and it is judged again on the next window: make no new change), or
        for every layer ``(runtime, moves, shadow set)`` that undo the last change or return to the original
        placement (it lost).

        ``drift``: called with the change's snapshots when its verdict is due (collective: every rank judges at the
        same step), the model's step time of the OLD placement on the counts of the window after the change, or
        None. The routing moves while a change is judged (early in training it concentrates on fewer experts, and
        every placement's steps slow down); the verdict then weighs the steps after the change against the steps
        before it moved by the model's difference between the old placement on the two windows' counts
        (``before_model_s`` at ``record``; the mean over the windows a verdict spans), not against the steps before
        as they were. The watch calls it with the original placement's snapshots."""
        if not self.enabled:
            return None
        change = self.pending
        if change is None:
            return self._watch(interval, drift)
        after = self.steps[change.start:]
        if len(after) < change.window:
            return WAIT
        after = after[:VERDICT_WINDOWS * change.window]
        measured = job_max(statistics.median(after)) + change.cost_s / len(after)
        before_s = change.before_s
        if drift is not None and change.before_model_s is not None:
            old_after = drift(change.snapshots)
            if old_after is not None:
                change.old_after_s.append(old_after)
            if change.old_after_s:                    # the old placement on the routing of every window judged
                before_s = max(before_s + statistics.fmean(change.old_after_s) - change.before_model_s, 0.0)
        final = len(after) >= VERDICT_WINDOWS * change.window
        behind = self._behind(interval, drift)
        lost = measured > before_s * (1.0 + self.margin)
        if not behind and lost and not final and \
                measured <= before_s * (1.0 + self.margin) + UNDO_SIGMAS * self.verdict_error(change, len(after)):
            self.inconclusive += 1                    # within the noise: judge again on one more window
            return WAIT
        self.pending = None
        self.last_drift_s = before_s - change.before_s
        if change.predicted_s is not None and change.predicted_s > 0:
            realised = before_s - measured + self.verdict_error(change, len(after))
            self.verdicts.append((self.observed, change.window, change.predicted_s,
                                  min(change.predicted_s, max(realised, 0.0))))
            self.verdicts = [v for v in self.verdicts                   # weighs under 2 ** -20 by now
                             if self.observed - v[0] < 20 * REALISATION_HALF_LIFE * v[1]]
            self.judged += 1
        if not behind and not lost:
            self.kept += 1
            self.strikes = 0
            return None
        self.undone += 1
        self.strikes += 1
        self.pause = min(self.backoff ** self.strikes, self.max_pause)
        if behind or change.from_origin:
            return self._return_to_origin(counted=behind)
        # back to the placement before this change: the routing has moved since that placement was judged, so the
        # watch judges it afresh on its own steps, not on the steps of its earlier, better-suited, days
        self._restart_watch(at_origin=False)
        return self._undo(change.snapshots)

    def _behind(self, interval: int, drift=None) -> bool:
        """Whether the steps since the placement left the original one are slower than the reference (beyond the
        noise, ``_against_reference``). Judged on at least two windows of them: one window of a few steps is too
        noisy to send a policy back to its start (on the emulated cluster the median of 3 steps moves by 10-15%
        between windows of the same placement). Collective when judged (every rank has observed as many steps)."""
        if self.at_origin or self.reference is None or len(self.away) < 2 * self.window(interval):
            return False
        return self._against_reference(interval, drift) is True

    def _against_reference(self, interval: int, drift=None) -> Optional[bool]:
        """The job's median step since leaving the original placement against the reference: True (slower by more
        than the margin and, before ``SURE_WINDOWS`` windows away, by more than ``UNDO_SIGMAS`` standard errors of
        the two medians beyond it), False (within the margin) or None (in between: not yet known). The reference
        moves by the model's difference between the original placement on the routing of now and of then (the
        routing concentrates early in training and every placement's steps slow down; without it the watch
        judged a change's steps against steps of an easier routing). Collective."""
        reference = self.reference
        if drift is not None and self.reference_model_s is not None and self.origin is not None:
            now = drift(self.origin)
            if now is not None:
                reference = max(reference + now - self.reference_model_s, 0.0)
        away = job_max(statistics.median(self.away))
        if away <= reference * (1.0 + self.margin):
            return False
        if self.away_steps >= SURE_WINDOWS * self.window(interval):
            return True
        error = self._median_difference_error(reference, len(self.away), self.reference_n)
        return True if away > reference * (1.0 + self.margin) + UNDO_SIGMAS * error else None

    def _watch(self, interval: int, drift=None):
        """Away from the original placement with no change pending: at 2, 4, 8, ... windows since leaving it,
        the median of the steps since then (up to the last 4 x REFERENCE_STEPS) against the reference; one window
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
        self.pause = self.max_pause
        return self._return_to_origin(counted=True)

    def _return_to_origin(self, counted: bool):
        if counted:
            self.returned += 1
            if self.returned >= self.max_returns:
                self.stopped = True
        self._restart_watch(at_origin=True)
        return self._undo(self.origin)

    def _restart_watch(self, at_origin: bool) -> None:
        """A new placement from here on: its steps alone feed the watch, at 2, 4, ... windows from now."""
        self.at_origin, self.away, self.away_steps, self._next_watch = at_origin, [], 0, 0

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
        standard deviation that the odd evaluation or checkpoint step does not move, nor a slow drift: the first
        steps of a run are slower for a while, and a spread about the median would count that warm-up as noise;
        measured at 2,048 tokens per rank, 27-45% of a step that way against 7-12% step to step); None before
        ``min_reference`` such steps."""
        steps = self.origin_steps
        if len(steps) < self.min_reference:
            return None
        med = statistics.median(steps)
        jumps = statistics.median(abs(b - a) for a, b in zip(steps, steps[1:]))
        return 1.4826 * jumps / (2.0 ** 0.5) / med if med > 0 else None

    def resolvable_gain(self, interval: int, noise: Optional[float]) -> float:
        """The smallest fraction of a step that a change must save for the guard to tell it from noise. The first
        verdict that weighs a change against the original placement sees the steps of two windows since it left;
        that median and the reference differ by noise alone with a standard deviation of about
        sqrt(2) x 1.25 x noise / sqrt(2 x window) (1.25: a median's standard error over a mean's); two of those.
        0 with the guard off or no estimate yet."""
        if not self.enabled or noise is None:
            return 0.0
        return RESOLVE_SIGMAS * 1.25 * (2.0 ** 0.5) * noise / (2 * self.window(interval)) ** 0.5

    def verdict_error(self, change: _Change, after: Optional[int] = None) -> float:
        """The standard error (s) of one verdict's measured saving: the difference of the median of the window
        before the change and that of the ``after`` steps after it (one window by default), of steps that vary by
        the job's ``step_noise`` (a median's standard error is about 1.25 x the mean's)."""
        return self._median_difference_error(change.before_s, change.window, after or change.window)

    def _median_difference_error(self, step_s: float, n1: int, n2: int) -> float:
        """The standard error (s) of the difference of the medians of ``n1`` and ``n2`` steps of about ``step_s``
        that vary by the job's ``step_noise`` (a median's standard error is about 1.25 x the mean's)."""
        return 1.25 * (self.job_noise or 0.0) * step_s * (1.0 / n1 + 1.0 / n2) ** 0.5

    def realisation(self) -> float:
        """The share of its predicted savings the model has delivered on this run (module docstring): 1 before any
        verdict; each verdict weighted by 2 ** -(its age in windows / REALISATION_HALF_LIFE); the same on every
        rank (the verdicts' inputs are job-wide, and every rank observes as many steps)."""
        if not self.enabled or not self.verdicts:
            return 1.0
        prior = statistics.fmean(v[2] for v in self.verdicts)
        weights = [0.5 ** ((self.observed - at) / (REALISATION_HALF_LIFE * window))
                   for at, window, _, _ in self.verdicts]
        predicted = sum(w * v[2] for w, v in zip(weights, self.verdicts))
        realised = sum(w * v[3] for w, v in zip(weights, self.verdicts))
        return min(1.0, max(MIN_REALISATION, (realised + prior) / (predicted + prior)))

    def paused(self) -> bool:
        """Whether this run must not change the placement: after an undo (counts the run), before the reference
        has ``min_reference`` steps, or for good once ``stopped``."""
        if not self.enabled:
            return False
        if self.stopped or (self.at_origin and len(self.origin_steps) < self.min_reference):
            return True
        if self.pause > 0:
            self.pause -= 1
            return True
        return False

    def record(self, before_s: Optional[float], cost_s: float, interval: int, runtimes: Sequence[object],
               states: Sequence[PlacementState], shadows: Sequence[Tuple[int, ...]],
               predicted_s: Optional[float] = None, before_model_s: Optional[float] = None) -> None:
        """A run changed the placement: remember what it was, to judge the change once its window is measured.
        ``before_s``: the job's median step before the change (``job_max(baseline(interval))``); ``cost_s``: this
        rank's time for the run that made it; ``predicted_s``: the saving per step its planner predicted (for
        ``realisation``); ``before_model_s``: the model's step time of the old placement on the counts of the
        steps before the change (the reference ``check``'s ``drift`` is taken against; job-wide). Collective (every
        rank records the same change): the verdict adds the slowest rank's cost, so every rank judges the change
        alike."""
        if before_s is None or not self.enabled:
            return
        cost_s, predicted_s = job_max_many([cost_s, predicted_s])
        snapshots = [(rt, state.copy(), tuple(shadow)) for rt, state, shadow in zip(runtimes, states, shadows)]
        from_origin = self.at_origin
        if from_origin:                               # the steps before this change ran the original placement
            if self.origin is None:
                self.origin = snapshots
            self.reference = job_max(statistics.median(self.origin_steps)) if self.origin_steps else before_s
            self.reference_n = len(self.origin_steps) or 1
            self.reference_model_s = before_model_s
            self._restart_watch(at_origin=False)
        self.pending = _Change(before_s, cost_s, len(self.steps), self.window(interval), snapshots, from_origin,
                               predicted_s, before_model_s)
