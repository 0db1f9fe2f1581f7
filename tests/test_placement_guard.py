"""The pay-off guard (placement/guard.py): a change is judged on the median step of a window of steps after it
(plus the change's own time spread over the window) against the median of the window before it; no new change is
made until the window is complete; one that lost is undone exactly (the previous slot table and shadow set come
back) and the policy pauses 2, 4, ... runs; one that paid is kept and resets the pauses. A single slow step (an
evaluation in the window) does not decide. Every rank takes the same verdict, however long its own part of the
change took."""
import json
from dataclasses import replace
from types import SimpleNamespace

import pytest

from megamoe_plugin.placement.guard import WAIT, PayoffGuard
from megamoe_plugin.placement.state import PlacementState


def _ranks_judge(rank, world, out):
    """Same steps on both ranks; the run that made the change took rank 1 much longer (a slow rank's moves)."""
    guard = PayoffGuard(warmup_steps=0, margin=0.03, min_reference=1)
    rt, before = _changed_runtime()
    _steps(guard, 1.0, 1.0, 1.0)
    guard.record(1.0, cost_s=0.0 if rank == 0 else 3.0, interval=3, runtimes=[rt], states=[before], shadows=[()])
    _steps(guard, 0.9, 0.9, 0.9)
    verdict = guard.check(3)
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"undone": guard.undone, "kept": guard.kept, "undo": isinstance(verdict, list)}, f)


def _ranks_max_many(rank, world, out):
    from megamoe_plugin.placement.guard import job_max_many
    got = job_max_many([1.0 + rank, 5.0 - rank, None if rank == 1 else 2.0, 0.0])
    with open(f"{out}.{rank}", "w") as f:
        json.dump(got, f)


def test_several_maxima_in_one_all_reduce(tmp_path):
    # per value the maximum over the ranks; None wherever any rank has none
    from conftest import run_distributed
    out = str(tmp_path / "max")
    run_distributed(_ranks_max_many, 2, out)
    got = [json.loads(open(f"{out}.{r}").read()) for r in range(2)]
    assert got[0] == got[1] == [2.0, 5.0, None, 0.0], got


def test_every_rank_takes_the_same_verdict(tmp_path):
    # alone, rank 0 would keep it (0.9 + 0 <= 1.03) and rank 1 undo it (0.9 + 3 s / 3 > 1.03): the ranks would
    # then plan different placements; the slowest rank's cost decides on both
    from conftest import run_distributed
    out = str(tmp_path / "verdict")
    run_distributed(_ranks_judge, 2, out)
    got = [json.loads(open(f"{out}.{r}").read()) for r in range(2)]
    assert got[0] == got[1] == {"undone": 1, "kept": 0, "undo": True}, got


def _changed_runtime():
    before = PlacementState(8, 4, 3)
    rt = SimpleNamespace(state=before.copy())
    rt.state.expand(0, 1)                                 # the change: a replica of expert 0 on rank 1 ...
    rt.state.migrate(3, 1, 2)                             # ... and expert 3 moved to rank 2
    return rt, before


def _steps(guard, *seconds):
    for s in seconds:
        guard.observe(s)


def _kept_shadow_change(step):
    """6 steps of 1.0 s at the start, then a new shadow set (moved nothing) kept at ``step`` s: no trust earned."""
    guard = PayoffGuard(warmup_steps=0, margin=0.03)
    rt, start = _changed_runtime()
    _steps(guard, *[1.0] * 6)
    guard.record(1.0, 0.0, 1, [rt], [start], [(2,)], free_undo=True)
    _steps(guard, step, step, step)
    assert guard.check(1) is None and guard.kept == 1 and not guard.trusted
    return guard, rt, start


def _shadow_policy_run(**overrides):
    """A one-process MoE layer with the shadowing policy (fixed profile), its optimizer and after-step hook."""
    import torch

    from megamoe_plugin import MoEConfig
    from megamoe_plugin.layer import MoELayer
    from megamoe_plugin.placement import AfterStepHook
    cfg = MoEConfig(num_experts=4, top_k=1, gate="switch", placement="shadow", placement_profile="flexmoe-a100",
                    **{"placement_interval": 4, **overrides})
    torch.manual_seed(0)
    layer = MoELayer(cfg, 8, 16)
    return layer, torch.optim.Adam(layer.parameters(), lr=1e-3), AfterStepHook(cfg)


def _train(layer, opt, hook, steps, before_hook=None):
    """``steps`` training steps, each closed by the hook; ``before_hook(it)`` runs just before it."""
    import torch
    for it in range(1, steps + 1):
        opt.zero_grad()
        layer(torch.randn(32, 8)).sum().backward()
        opt.step()
        if before_hook is not None:
            before_hook(it)
        hook.run(layer, opt, it)


def test_a_change_that_lost_is_undone_and_the_policy_pauses():
    guard = PayoffGuard(warmup_steps=0, margin=0.03, min_reference=3)
    rt, before = _changed_runtime()
    _steps(guard, 1.0, 1.0, 5.0, 1.0)                    # one slow step (an evaluation) among them
    assert guard.baseline(interval=1) == 1.0              # median of the last 3
    guard.record(guard.baseline(1), cost_s=0.3, interval=1, runtimes=[rt], states=[before], shadows=[(2,)])
    _steps(guard, 0.99, 0.99)
    assert guard.check(1) == WAIT                         # 2 of 3 steps measured: no verdict, no new change
    _steps(guard, 0.99)
    # median 0.99 + 0.3 s / 3 steps = 1.09 > 1.03: lost
    undo = guard.check(1)
    assert isinstance(undo, list) and guard.undone == 1 and guard.kept == 0
    (got_rt, moves, shadow), = undo
    assert got_rt is rt and shadow == (2,)
    restored = rt.state.copy().apply(moves)
    assert [sorted(e for e in restored.slots_of(r) if e is not None) for r in range(4)] == \
        [sorted(e for e in before.slots_of(r) if e is not None) for r in range(4)]
    assert [guard.paused() for _ in range(3)] == [True, True, False]         # 2 runs after the first undo
    assert guard.returned == 1 and not guard.stopped       # no change has paid yet: the trial counts as a return
    guard.record(1.0, 0.0, 1, [rt], [before], [()])
    _steps(guard, 1.2, 1.2, 1.2)
    assert isinstance(guard.check(1), list)                                  # a second lost trial: stop
    assert guard.returned == 2 and guard.stopped and all(guard.paused() for _ in range(40))


def test_after_a_change_paid_a_lost_trial_pauses_without_stopping():
    guard = PayoffGuard(warmup_steps=0, margin=0.03, min_reference=3)
    rt, before = _changed_runtime()
    _steps(guard, 1.0, 1.0, 1.0)
    guard.record(1.0, 0.0, 1, [rt], [before], [()])
    _steps(guard, 0.9, 0.9, 0.9)
    assert guard.check(1) is None and guard.kept == 1                        # it paid
    for _ in range(3):                                                       # back at the start by the watch
        guard._return_to_origin(counted=False)
        guard.record(1.0, 0.0, 1, [rt], [before], [()])
        _steps(guard, 1.2, 1.2, 1.2)
        assert isinstance(guard.check(1), list)
    assert guard.undone == 3 and guard.returned == 0 and not guard.stopped
    assert [guard.paused() for _ in range(9)] == [True] * 8 + [False]       # 2 ** 3 runs after the third undo


def test_a_change_that_moved_nothing_is_kept_only_when_not_slower():
    """A new shadow set costs nothing to undo: 2% slower is within the 3% margin for a change that moved rows (kept),
    but undoes one that moved nothing; and the watch of a placement reached by shadow changes alone sends it back
    to the start on a 2% loss that it lets pass where rows were moved."""
    rt, before = _changed_runtime()
    verdicts = {}
    for free in (False, True):
        guard = PayoffGuard(warmup_steps=0, margin=0.03)
        guard.record(1.0, 0.0, 1, [rt], [before], [(2,)], free_undo=free)
        _steps(guard, 1.02, 1.02, 1.02)
        verdicts[free] = guard.check(1)
    assert verdicts[False] is None and isinstance(verdicts[True], list)
    watched = {}
    for free in (False, True):
        guard = PayoffGuard(warmup_steps=0, margin=0.03, min_reference=3)
        _steps(guard, *[1.0] * 6)
        guard.record(1.0, 0.0, 1, [rt], [before], [(2,)], free_undo=free)
        _steps(guard, 0.99, 0.99, 0.99)
        assert guard.check(1) is None and guard.kept == 1               # it paid (both)
        _steps(guard, *[1.05] * 3)                                      # then the routing moved: 2% behind overall
        watched[free] = guard.check(1)
    assert watched[False] is None and isinstance(watched[True], list)


def test_a_verdict_judges_against_the_old_placement_on_the_routing_after_the_change():
    """Steps slowed from 1.0 to 1.06 s after a change, but the model prices the old placement 0.04 s slower on the
    counts of the window after it than on those before (the routing concentrated): against 1.0 + 0.04 = 1.04 s
    the change is within the 3% margin and kept. Without the drift it is undone. A drift the model prices at 0.3 s
    is credited 5% of the step at most (``max_drift``): 1.2 s steps lose against 1.05 s."""
    snapshots_seen = []
    cases = ((lambda snaps: snapshots_seen.append(snaps) or 0.54, 1.06, True, 0.04), (None, 1.06, False, 0.0),
             (lambda snaps: 0.8, 1.2, False, 0.05))
    for i, (drift, step, kept, credited) in enumerate(cases):
        guard = PayoffGuard(warmup_steps=0, margin=0.03)
        rt, before = _changed_runtime()
        if i == 0:
            first = (rt, before)
        guard.record(1.0, cost_s=0.0, interval=3, runtimes=[rt], states=[before], shadows=[()],
                     before_model_s=0.5)
        _steps(guard, step, step, step)
        verdict = guard.check(3, drift=drift)
        assert (verdict is None) == kept and guard.kept == int(kept)
        assert guard.last_drift_s == pytest.approx(credited)
    (rt_seen, state_seen, shadow_seen), = snapshots_seen[0]           # the old placement, as recorded
    assert rt_seen is first[0] and state_seen == first[1] and shadow_seen == ()


def test_a_change_that_paid_is_kept_and_one_slow_step_does_not_decide():
    guard = PayoffGuard(warmup_steps=0, margin=0.03)
    rt, before = _changed_runtime()
    guard.record(1.00, cost_s=1.0, interval=10, runtimes=[rt], states=[before], shadows=[()])
    _steps(guard, *([0.9] * 8 + [6.0, 6.0]))              # two evaluations in the window of 10
    assert guard.check(10) is None                        # median 0.9 + 1.0 s / 10 = 1.0 <= 1.03: paid
    assert guard.kept == 1 and guard.strikes == 0 and not guard.paused()
    assert guard.last_measured_s == pytest.approx(1.0) and guard.last_reference_s == 1.0   # reported as metrics
    assert guard.check(10) is None                        # nothing pending: nothing to judge


def test_no_measurement_or_guard_off_keeps_everything():
    rt, before = _changed_runtime()
    off = PayoffGuard(warmup_steps=0, margin=-1)
    _steps(off, 1.0, 1.0, 1.0)
    assert off.steps == [] and off.baseline(1) is None        # off: nothing measured
    off.record(1.0, 0.0, 1, [rt], [before], [()])
    assert off.check(1) is None and off.pending is None
    on = PayoffGuard(warmup_steps=0)
    assert on.baseline(1) is None                         # no step seen yet: no "before", nothing recorded
    _steps(on, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
    assert on.baseline(10) == 1.0                         # a first run at step 10 has 9 steps: judged on them
    on.record(None, 0.0, 1, [rt], [before], [()])
    assert on.check(1) is None


def test_the_hook_says_how_many_steps_the_counts_cover():
    """The layers' counts accumulate over every step since the policy last ran; the hook passes that number, so a
    policy prices one step (not ``--moe-placement-interval`` steps as one) whatever the interval or the iteration a
    run resumed at."""
    import torch.nn as nn

    from megamoe_plugin import MoEConfig
    from megamoe_plugin.placement import AfterStepHook

    seen = []
    hook = AfterStepHook(MoEConfig(num_experts=4, placement_interval=3),
                         policy=lambda ctx: seen.append((ctx.iteration, ctx.steps)))
    for it in range(11, 19):                       # a run resumed after iteration 10
        hook.run(nn.Linear(2, 2), None, it, moe_layers=[])
    assert seen == [(12, 2), (15, 3), (18, 3)], seen


def test_changes_that_add_up_to_a_loss_return_to_the_original_placement():
    """Each change is within the margin of the steps just before it, but together they run 3.5% slower than the
    original placement: the watch goes back to the original slot table, not to the first change's."""
    guard = PayoffGuard(warmup_steps=0, margin=0.03)
    rt, start = _changed_runtime()                        # rt now holds change 1 (made from `start`)
    guard.record(1.00, 0.0, 1, [rt], [start], [()])
    _steps(guard, 1.02, 1.02, 1.02)                       # +2%: kept
    assert guard.check(1) is None and guard.reference == 1.00
    second = rt.state.copy()
    rt.state.expand(1, 3)                                 # change 2, made from change 1
    guard.record(1.02, 0.0, 1, [rt], [second], [()])
    _steps(guard, 1.05, 1.05, 1.05)                       # +3% on the last; since the start +3.5%: back to it
    undo = guard.check(1)
    assert isinstance(undo, list) and guard.returned == 1
    assert guard.last_measured_s == pytest.approx(1.035) and guard.last_reference_s == 1.0    # the watch, since the start
    (_, moves, shadow), = undo
    restored = rt.state.copy().apply(moves)
    assert restored == start and shadow == ()


def test_after_a_change_that_moved_rows_paid_later_changes_are_judged_by_the_watch_alone():
    """A change that moved rows paid (0.8 s against 1.0): the model priced this job right, so a second change is not
    judged on its own window (a slow one, 1.1 s, does not undo it) and the planners need only their own least gain;
    the watch over every step since the start still sends the placement back when those steps (median 1.15 s)
    are slower than the start, and from there a change is judged on its own again. A kept change that moved
    nothing (a new shadow set) does not earn that trust."""
    guard = PayoffGuard(warmup_steps=0, margin=0.03)
    rt, start = _changed_runtime()
    _steps(guard, *[1.0] * 6)
    assert guard.resolvable_gain(1, 0.1) > 0.1
    guard.record(1.0, 0.0, 1, [rt], [start], [()])
    _steps(guard, 0.8, 0.8, 0.8)
    assert guard.check(1) is None and guard.kept == 1 and guard.trusted
    assert guard.resolvable_gain(1, 0.1) == 0.0
    first = rt.state.copy()
    rt.state.expand(1, 3)
    guard.record(0.8, 0.0, 1, [rt], [first], [()])
    assert guard.pending is None
    _steps(guard, 1.1, 1.1, 1.1)
    assert guard.check(1) is None and guard.undone == 0       # 6 steps away: median 0.95 against the start's 1.0
    _steps(guard, *[1.2] * 6)
    undo = guard.check(1)                                       # 12 steps away: median 1.15
    assert isinstance(undo, list) and guard.returned == 1 and guard.at_origin and not guard.trusted
    (_, moves, _), = undo
    assert rt.state.copy().apply(moves) == start
    assert guard.resolvable_gain(1, 0.1) > 0.1

    free, rt, start = _kept_shadow_change(0.9)
    free.record(0.9, 0.0, 1, [rt], [start], [(3,)], free_undo=True)
    assert free.pending is not None


def test_a_loss_within_the_verdicts_noise_waits_for_more_steps_instead_of_undoing():
    """Steps that vary by 10% from one to the next: one 10-step window 5% slower than the 10 before is within the
    margin (3%) plus one standard error of the two medians (1.25 x 0.1 x sqrt(1/10 + 1/10) = 5.6%), so the
    change is neither kept nor undone; the policy waits, and the steps of the next window (faster) keep it. A
    window 15% slower is beyond the noise and is undone at once; a change still 5% slower after three windows is
    undone on the margin alone."""
    def noisy_guard():
        guard = PayoffGuard(warmup_steps=0, margin=0.03)
        guard.job_noise = 0.1
        _steps(guard, *[1.0] * 10)
        return guard

    guard = noisy_guard()
    rt, start = _changed_runtime()
    guard.record(1.0, 0.0, 10, [rt], [start], [()])
    _steps(guard, *[1.05] * 10)
    assert guard.check(10) == WAIT and guard.undone == 0 and guard.kept == 0 and guard.inconclusive == 1
    _steps(guard, *[0.95] * 11)                           # median of the 21 steps since: 0.95
    assert guard.check(10) is None and guard.kept == 1 and guard.pending is None

    lost = noisy_guard()
    lost.record(1.0, 0.0, 10, [rt], [start], [()])
    _steps(lost, *[1.15] * 10)
    assert isinstance(lost.check(10), list) and lost.undone == 1 and lost.inconclusive == 0

    slow = noisy_guard()
    slow.record(1.0, 0.0, 10, [rt], [start], [()])
    verdicts = []
    for _ in range(3):
        _steps(slow, *[1.05] * 10)
        verdicts.append(slow.check(10))
    assert verdicts[:2] == [WAIT, WAIT] and isinstance(verdicts[2], list) and slow.undone == 1

    quiet = PayoffGuard(warmup_steps=0, margin=0.03)                      # no noise measured: the margin alone, at once
    _steps(quiet, *[1.0] * 10)
    quiet.record(1.0, 0.0, 10, [rt], [start], [()])
    _steps(quiet, *[1.05] * 10)
    assert isinstance(quiet.check(10), list)


def test_the_watch_judges_against_the_start_on_the_routing_of_now():
    """Kept changes run 1.07 s a step against a reference of 1.0 s measured early, but the model prices the original
    placement 0.15 s slower on the routing of now than on that of the reference's steps (the routing concentrated),
    credited 5% of the step at most: against 1.05 s (+3%) the changes pay and the watch keeps them. Without the
    drift it sends the policy back; at 1.1 s a step the capped credit does not cover them either."""
    for drift, step, returned in ((lambda snaps: 0.65, 1.07, 0), (None, 1.07, 1), (lambda snaps: 0.65, 1.1, 1)):
        guard = PayoffGuard(warmup_steps=0, margin=0.03)
        rt, start = _changed_runtime()
        _steps(guard, *[1.0] * 6)
        guard.record(1.0, 0.0, 1, [rt], [start], [()], before_model_s=0.5)
        _steps(guard, 0.98, 0.98, 0.98)
        assert guard.check(1, drift=lambda snaps: 0.5) is None and guard.kept == 1
        _steps(guard, *[step] * 9)                        # 12 steps away: the watch at 6 and 12
        guard.check(1, drift=drift)
        assert guard.returned == returned


def test_a_watch_within_the_noise_looks_again_one_window_later():
    """10% step noise, 6 reference steps: 10 steps since leaving at 1.06 s are above the margin but within one
    standard error (1.25 x 0.1 x sqrt(1/10 + 1/6) = 6.5%); the watch looks again one window later rather than at
    twice the steps, and from four windows away judges on the margin alone."""
    guard = PayoffGuard(warmup_steps=0, margin=0.03)
    guard.job_noise = 0.1
    rt, start = _changed_runtime()
    _steps(guard, *[1.0] * 6)
    guard.record(1.0, 0.0, 5, [rt], [start], [()])
    _steps(guard, *[1.0] * 5)
    assert guard.check(5) is None and guard.kept == 1      # the change's own window is within the margin
    _steps(guard, *[1.12] * 5)                             # median of the 10 since leaving: 1.06
    assert guard.check(5) is None and guard.inconclusive == 1 and guard._next_watch == 15
    _steps(guard, *[1.06] * 5)                             # median 1.06, standard error 1.25 x 0.1 x sqrt(1/15 + 1/6)
    assert guard.check(5) is None and guard.inconclusive == 2 and guard._next_watch == 20
    _steps(guard, *[1.06] * 5)                             # 20 steps away = 4 windows: the margin decides
    assert isinstance(guard.check(5), list) and guard.returned == 1


def test_the_first_steps_of_a_run_are_not_observed():
    """The run's first 10 steps (slower while caches warm up) make no baseline and no reference: the policy is held
    until 6 steps after them are measured, and the baseline is theirs."""
    guard = PayoffGuard(margin=0.03)
    _steps(guard, *[2.0] * 10)
    assert guard.baseline(1) is None and guard.paused() and guard.step_noise() is None
    _steps(guard, *[1.0] * 6)
    assert guard.baseline(3) == 1.0 and not guard.paused() and guard.step_noise() == 0.0


def test_no_change_before_the_reference_is_measured():
    guard = PayoffGuard(warmup_steps=0, margin=0.03)                      # min_reference 6 steps under the original placement
    _steps(guard, 1.0, 1.0, 1.0, 1.0, 1.0)
    assert guard.paused()
    _steps(guard, 1.0)
    assert not guard.paused()
    assert PayoffGuard(warmup_steps=0, margin=-1).paused() is False       # off: never holds a policy back


def test_a_kept_change_that_loses_later_returns_to_the_start_and_two_returns_stop_the_policy():
    """A change judged on a lucky window is kept; the watch over every step since the placement left the start
    (at 2, 4, ... windows) finds it slower than the start and goes back; the second return stops the policy."""
    guard = PayoffGuard(warmup_steps=0, margin=0.03)
    rt, start = _changed_runtime()
    _steps(guard, *[1.0] * 6)
    guard.record(1.0, 0.0, 1, [rt], [start], [()])
    assert guard.reference == 1.0 and not guard.at_origin
    _steps(guard, 1.0, 1.0, 1.0)
    assert guard.check(1) is None and guard.kept == 1     # the window paid
    _steps(guard, 1.2, 1.2)
    assert guard.check(1) is None                         # 5 steps since leaving: the first watch falls at 6
    _steps(guard, 1.2)
    undo = guard.check(1)                                 # median of 1.0 x 3, 1.2 x 3 = 1.1 > 1.03
    assert isinstance(undo, list) and guard.returned == 1 and guard.at_origin and not guard.stopped
    assert guard.last_measured_s == pytest.approx(1.1) and guard.last_reference_s == 1.0    # the watch's numbers
    (_, moves, _), = undo
    assert rt.state.copy().apply(moves) == start
    assert [guard.paused() for _ in range(33)] == [True] * 32 + [False]      # the longest pause
    rt.state = start.copy()
    rt.state.expand(0, 1)
    guard.record(1.0, 0.0, 1, [rt], [start], [()])        # a second try: a lucky window, then slower than the start
    _steps(guard, 1.0, 1.0, 1.0)
    assert guard.check(1) is None
    _steps(guard, 1.2, 1.2, 1.2)
    assert isinstance(guard.check(1), list) and guard.returned == 2 and guard.stopped
    _steps(guard, *[1.0] * 10)
    assert all(guard.paused() for _ in range(100))        # stopped for the rest of the run


def test_a_change_that_keeps_paying_is_watched_less_and_less_often():
    guard = PayoffGuard(warmup_steps=0, margin=0.03)
    rt, start = _changed_runtime()
    _steps(guard, *[1.0] * 6)
    guard.record(1.0, 0.0, 1, [rt], [start], [()])
    verdicts = []
    for _ in range(40):
        _steps(guard, 0.8)
        verdicts.append(guard.check(1))
    assert all(v is None or v == WAIT for v in verdicts) and not guard.at_origin and guard.returned == 0
    assert guard._next_watch == 48                        # watched at 6, 12, 24 steps away; next at 48


def _without_warmup(hook):
    """The policy's guard observes from the first step (these tests count steps from there)."""
    hook.policy.guard.settings = replace(hook.policy.guard.settings, warmup_steps=0)


def test_a_held_policy_runs_no_collective_and_prices_the_held_steps_later(monkeypatch):
    """While the guard holds a policy (its reference still short, a pause, or stopped) and nothing is shadowed,
    a run costs no collective; the layers' counts keep adding up and the next full run prices them as one step's
    (divided by every step they cover). Once stopped, the counts are dropped each run instead."""
    import torch

    from megamoe_plugin import MoEConfig
    from megamoe_plugin.layer import MoELayer
    from megamoe_plugin.placement import AfterStepHook, policies

    cfg = MoEConfig(num_experts=4, top_k=1, gate="switch", placement="shadow", placement_profile="flexmoe-a100")
    torch.manual_seed(0)
    layer = MoELayer(cfg, 8, 16)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-3)
    hook = AfterStepHook(cfg)
    _without_warmup(hook)
    gathered, real = [], policies.gather_counts
    monkeypatch.setattr(policies, "gather_counts", lambda rts, **kw: gathered.append(
        float(rts[0].step_counts.sum())) or real(rts, **kw))

    def step(it):
        opt.zero_grad()
        layer(torch.randn(32, 8)).sum().backward()
        opt.step()
        hook.run(layer, opt, it)

    for it in range(1, 7):                                # 5 step durations seen at run 6: under the 6 needed
        step(it)
    assert gathered == [] and hook.policy._held_steps == 6
    step(7)
    assert gathered == [7 * 32.0] and hook.policy._held_steps == 0     # seven steps' counts, in one run
    hook.policy.guard.stopped = True
    step(8)
    assert len(gathered) == 1 and layer.plan.placement.step_counts is None


def test_a_step_beside_an_evaluation_is_not_timed():
    """The hook times each step as the time between its calls; an evaluation between two steps (forwards without
    gradient through the MoE layers) would count as a slow training step and could undo a change that paid. It is
    observed as the step before it, so every rank still observes as many steps (the guard's verdicts are
    collective)."""
    import time

    import torch

    from megamoe_plugin import MoEConfig, MoELayer
    from megamoe_plugin.placement import AfterStepHook

    cfg = MoEConfig(num_experts=4, top_k=1, gate="switch", placement="shadow", placement_interval=1000)
    layer = MoELayer(cfg, 16, 32)
    assert layer.plan.placement is not None

    class Policy:
        seen = []

        def __call__(self, ctx):
            pass

        def observe_step(self, seconds):
            self.seen.append(seconds)
    policy = Policy()
    hook = AfterStepHook(cfg, policy=policy)
    x = torch.randn(8, 16)
    for it in range(1, 6):
        layer(x).sum().backward()
        if it == 3:                                      # an evaluation after step 2, before step 3's hook call
            with torch.no_grad():
                layer(x)
            time.sleep(0.2)                              # a slow one
        hook.run(layer, None, it)
    # calls 2..5 close a step each; the one closed at call 3 ran beside the evaluation and counts as the one before
    assert len(policy.seen) == 4 and policy.seen[1] == policy.seen[0] and max(policy.seen) < 0.2, policy.seen


def test_the_step_noise_is_the_spread_from_one_step_to_the_next():
    guard = PayoffGuard(warmup_steps=0, margin=0.03, min_reference=6)
    _steps(guard, *[1.0, 1.2] * 3)                  # median 1.1, every step 0.2 away from the one before
    noise = guard.step_noise()
    assert abs(noise - 1.4826 * 0.2 / 2 ** 0.5 / 1.1) < 1e-12
    warming = PayoffGuard(warmup_steps=0, margin=0.03, min_reference=6)
    _steps(warming, *[1.3, 1.32] * 3, *[1.0, 1.02] * 3)    # six slow warm-up steps, then faster; 0.02 step to step
    # consecutive differences: 0.02 x 10 and one 0.32; median step (1.02 + 1.3) / 2 = 1.16. A spread about the
    # median (MAD 0.15) would have called the warm-up 19% noise
    assert abs(warming.step_noise() - 1.4826 * 0.02 / 2 ** 0.5 / 1.16) < 1e-9
    quiet = PayoffGuard(warmup_steps=0, margin=0.03, min_reference=6)
    _steps(quiet, *[1.0] * 6)
    assert quiet.step_noise() == 0.0
    short = PayoffGuard(warmup_steps=0, margin=0.03, min_reference=6)
    _steps(short, 1.0, 1.2)
    assert short.step_noise() is None


def test_a_policy_that_keeps_changing_nothing_plans_less_and_less_often(monkeypatch):
    """At the original placement, each run that changes nothing skips the next 1, 2, 4, then 7 runs (at most
    IDLE_GAP_STEPS = 8 steps between two runs at an interval of 1): a skipped run plans nothing and calls no
    collective. (Guard off, one process: the shadowing planner has nothing to shadow.)"""
    from megamoe_plugin.placement import policies

    planned, step = [], [0]
    real = policies.ShadowPolicy.decide

    def spy(self, key, cm, rt, counts):
        planned.append(step[0])
        return real(self, key, cm, rt, counts)
    monkeypatch.setattr(policies.ShadowPolicy, "decide", spy)
    layer, opt, hook = _shadow_policy_run(placement_interval=1, placement_guard=-1)
    _train(layer, opt, hook, 40, before_hook=lambda it: step.__setitem__(0, it))
    assert planned == [1, 3, 6, 11, 19, 27, 35], planned
    assert not layer.experts.placement.shadowed


def test_flexmoe_plans_from_the_last_steps_routing(monkeypatch):
    """FlexMoE's planner decides from the routing of the last 3 steps (``MoEConfig.placement_plan_window``), not
    from the whole 10-step interval's: where the hot experts drift, the last steps predict the next ones better.
    Step k routes [k, 0, 0, 10 - k] tokens: at step 10 the last three steps' mean is [9, 0, 0, 1], the interval's
    [5.5, 0, 0, 4.5]."""
    import torch

    from megamoe_plugin import MoEConfig
    from megamoe_plugin.layer import MoELayer
    from megamoe_plugin.placement import AfterStepHook

    cfg = MoEConfig(num_experts=4, top_k=1, gate="switch", placement="flexmoe", placement_profile="flexmoe-a100")
    layer = MoELayer(cfg, 8, 16)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-3)
    hook = AfterStepHook(cfg)
    _without_warmup(hook)
    seen = []
    monkeypatch.setattr(type(hook.policy), "decide", lambda self, key, cm, rt, counts: seen.append(counts) or ([], None))
    rt = layer.plan.placement
    for it in range(1, 11):
        with torch.enable_grad():
            rt._accumulate(torch.tensor([it, 0, 0, 10 - it]), torch.tensor(0))
        hook.run(layer, opt, it)
    assert len(seen) == 1 and seen[0].tolist() == [[9.0, 0.0, 0.0, 1.0]]


def test_no_change_after_the_last_step_and_moves_amortised_over_the_steps_left(monkeypatch):
    """With the run's last step known (``last_step``: train-iters, max-update, --steps), a move's transfer is
    amortised over min(interval, steps left) and no run plans after the last step: nothing would pay it back.
    Interval 4, last step 10, 12 steps: plans at 4 (over 4 steps) and 8 (over the 2 left), none at 12."""
    import torch

    from megamoe_plugin import MoEConfig
    from megamoe_plugin.layer import MoELayer
    from megamoe_plugin.placement import AfterStepHook, policies

    cfg = MoEConfig(num_experts=4, top_k=1, gate="switch", placement="flexmoe", placement_profile="flexmoe-a100",
                    placement_interval=4, placement_guard=-1)
    layer = MoELayer(cfg, 8, 16)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-3)
    hook = AfterStepHook(cfg)
    monkeypatch.setattr(policies._Policy, "_back_off", lambda self, acted, layers, every: None)
    real, planned = policies.FlexMoEPolicy.decide, []

    def spy(self, key, cm, rt, counts):
        out = real(self, key, cm, rt, counts)
        planned.append((it, self._planners[key].horizon))
        return out
    monkeypatch.setattr(policies.FlexMoEPolicy, "decide", spy)
    for it in range(1, 13):
        opt.zero_grad()
        layer(torch.randn(32, 8)).sum().backward()
        opt.step()
        hook.run(layer, opt, it, last_step=10)
    assert planned == [(4, 4.0), (8, 2.0)], planned
    assert layer.plan.placement.step_counts is not None          # the steps after the last run were not planned


def test_with_the_guard_on_a_change_needs_two_windows_before_the_last_step(monkeypatch):
    """With the guard on, a change is made only while its verdict's window and one more fit before the run's last
    step: one made later could not be undone before the end, nor pay back its moves. Interval 4 (window 4): with
    the last step at 20 the policy plans at 8 and 12 (8 steps left) but not at 16 (4 left); at 4 the guard's
    reference (6 steps) is still short. With the last step at 24 it plans at 16 too."""
    import torch

    from megamoe_plugin import MoEConfig
    from megamoe_plugin.layer import MoELayer
    from megamoe_plugin.placement import AfterStepHook, policies

    monkeypatch.setattr(policies._Policy, "_back_off", lambda self, acted, layers, every: None)

    def planned_steps(last_step):
        cfg = MoEConfig(num_experts=4, top_k=1, gate="switch", placement="flexmoe", placement_profile="flexmoe-a100",
                        placement_interval=4)
        layer = MoELayer(cfg, 8, 16)
        opt = torch.optim.Adam(layer.parameters(), lr=1e-3)
        hook = AfterStepHook(cfg)
        _without_warmup(hook)
        planned = []
        monkeypatch.setattr(type(hook.policy), "decide",
                            lambda self, key, cm, rt, counts: planned.append(it) or ([], None))
        for it in range(1, last_step + 1):
            opt.zero_grad()
            layer(torch.randn(32, 8)).sum().backward()
            opt.step()
            hook.run(layer, opt, it, last_step=last_step)
        return planned

    assert planned_steps(20) == [8, 12]
    assert planned_steps(24) == [8, 12, 16]


def test_a_sure_loss_is_undone_after_three_steps_of_a_longer_window():
    """A change judged on a 10-step window is looked at once after its first 3 steps: with steps that vary by 10%,
    3 steps 30% slower are a loss beyond the margin (3%) plus one standard error of the two medians
    (1.25 x 0.1 x sqrt(1/10 + 1/3) = 8.2%) and it is undone then; 3 steps 8% slower are within it, and 3 steps
    10% faster are not a verdict either: the whole window decides both."""
    def guard_with_change():
        guard = PayoffGuard(warmup_steps=0, margin=0.03)
        guard.job_noise = 0.1
        _steps(guard, *[1.0] * 10)
        rt, start = _changed_runtime()
        guard.record(1.0, 0.0, 10, [rt], [start], [()])
        return guard

    lost = guard_with_change()
    _steps(lost, 1.3, 1.3)
    assert not lost.early_due() and lost.check(10) == WAIT                 # 2 steps: no look yet
    _steps(lost, 1.3)
    assert lost.early_due()
    assert isinstance(lost.check(10), list) and lost.undone == 1 and lost.pending is None
    assert not lost.early_due()

    unsure = guard_with_change()
    _steps(unsure, 1.08, 1.08, 1.08)
    assert unsure.early_due() and unsure.check(10) == WAIT and unsure.pending is not None
    _steps(unsure, 1.08)
    assert not unsure.early_due()                                          # one look per change
    _steps(unsure, *[0.95] * 6)                                            # the window: median 0.95
    assert unsure.check(10) is None and unsure.kept == 1 and unsure.undone == 0

    faster = guard_with_change()
    _steps(faster, 0.9, 0.9, 0.9)
    assert faster.check(10) == WAIT and faster.kept == 0 and faster.pending is not None

    short = PayoffGuard(warmup_steps=0, margin=0.03)                      # a 3-step window has no early look
    _steps(short, 1.0, 1.0, 1.0)
    rt, start = _changed_runtime()
    short.record(1.0, 0.0, 3, [rt], [start], [()])
    _steps(short, 1.3, 1.3, 1.3)
    assert not short.early_due()


def test_the_hook_runs_the_policy_for_the_guards_early_look_between_intervals():
    import torch

    from megamoe_plugin import MoEConfig
    from megamoe_plugin.placement import AfterStepHook

    class Policy:
        def __init__(self):
            self.ran, self.due = [], set()

        def early_due(self):
            return self.it in self.due

        def __call__(self, ctx):
            self.ran.append(ctx.iteration)

    cfg = MoEConfig(num_experts=4, top_k=1, placement="flexmoe", placement_interval=10)
    policy = Policy()
    policy.due = {13}
    hook = AfterStepHook(cfg, policy=policy)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    for it in range(1, 21):
        policy.it = it
        hook.run(torch.nn.Linear(1, 1), opt, it, moe_layers=[])
    assert policy.ran == [10, 13, 20]


def test_a_verdict_reports_its_own_numbers_after_the_watch_it_consults():
    """A kept shadow change (moved nothing: no trust), then a change that moved rows runs 1.2 s against 0.99 s before
    it. Its verdict also asks the watch (6 steps since the start, median 1.095 s against 1.0 s); the metrics show
    the verdict's numbers, 1.2 against 0.99."""
    guard, rt, _ = _kept_shadow_change(0.99)
    guard.record(0.99, 0.0, 1, [rt], [rt.state.copy()], [()])
    _steps(guard, 1.2, 1.2, 1.2)
    assert isinstance(guard.check(1), list) and guard.returned == 1
    assert (guard.last_measured_s, guard.last_reference_s) == (1.2, 0.99)
