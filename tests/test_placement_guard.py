"""The pay-off guard (placement/guard.py): a change is judged by the measured step time after it against the one
before it (the change's own time spread over the interval); one that lost is undone exactly (the previous slot table
and shadow set come back) and the policy pauses 2, 4, ... runs; one that paid is kept and resets the pauses."""
from types import SimpleNamespace

from megamoe_plugin.placement.guard import PayoffGuard
from megamoe_plugin.placement.state import PlacementState


def _changed_runtime():
    before = PlacementState(8, 4, 3)
    rt = SimpleNamespace(state=before.copy())
    rt.state.expand(0, 1)                                 # the change: a replica of expert 0 on rank 1 ...
    rt.state.migrate(3, 1, 2)                             # ... and expert 3 moved to rank 2
    return rt, before


def test_a_change_that_lost_is_undone_and_the_policy_pauses():
    guard = PayoffGuard(margin=0.03)
    rt, before = _changed_runtime()
    guard.record(1.00, cost_s=0.5, runtimes=[rt], states=[before], shadows=[(2,)])
    # 1.00 s/step before; after: 0.99 s + 0.5 s / 10 steps = 1.04 > 1.03: lost
    undo = guard.check(0.99, interval=10)
    assert undo is not None and guard.undone == 1 and guard.kept == 0
    (got_rt, moves, shadow), = undo
    assert got_rt is rt and shadow == (2,)
    restored = rt.state.copy().apply(moves)
    assert [sorted(e for e in restored.slots_of(r) if e is not None) for r in range(4)] == \
        [sorted(e for e in before.slots_of(r) if e is not None) for r in range(4)]
    assert [guard.paused() for _ in range(3)] == [True, True, False]         # 2 runs after the first undo
    guard.record(1.00, 0.0, [rt], [before], [()])
    assert guard.check(1.10, interval=1) is not None                         # a second undo in a row: 4 runs
    assert [guard.paused() for _ in range(5)] == [True] * 4 + [False]


def test_a_change_that_paid_is_kept_and_resets_the_strikes():
    guard = PayoffGuard(margin=0.03)
    rt, before = _changed_runtime()
    guard.record(1.00, 0.0, [rt], [before], [()])
    assert guard.check(1.20, interval=1) is not None and guard.strikes == 1
    while guard.paused():
        pass
    guard.record(1.00, cost_s=0.2, runtimes=[rt], states=[before], shadows=[()])
    assert guard.check(0.95, interval=10) is None                            # 0.95 + 0.02 <= 1.03: paid
    assert guard.kept == 1 and guard.strikes == 0 and not guard.paused()
    assert guard.check(5.0, interval=1) is None                              # nothing pending: nothing to judge


def test_no_measurement_or_guard_off_keeps_everything():
    rt, before = _changed_runtime()
    off = PayoffGuard(margin=-1)
    off.record(1.0, 0.0, [rt], [before], [()])
    assert off.check(9.0, interval=1) is None and off.pending is None
    on = PayoffGuard()
    on.record(None, 0.0, [rt], [before], [()])                              # the first run has no "before"
    assert on.check(9.0, interval=1) is None
