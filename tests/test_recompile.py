"""RECOMPILE (DynaMoE §3, Appendix B): triggers run off the training thread, decisions land exactly Δ_launch steps
after their metrics, a slow trigger does not stall a loop whose Δ_launch covers it, Δ_launch changes at run time,
trigger errors surface, and a group agrees on its first rank's decision (2 gloo processes)."""
import threading
import time

import pytest
import torch
import torch.distributed as dist

from conftest import run_distributed
from megamoe_plugin.dynamic import Recompiler

pytestmark = pytest.mark.serial         # step times against sleeps


def _loop(rc, steps, work_s, applied, metrics_of=lambda s: {"loss": torch.tensor(float(s))}):
    step_times = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        rc.boundary(step)
        applied.append((step, current[0]))
        time.sleep(work_s)                                   # the step's work
        rc.record(step, metrics_of(step))
        step_times.append(time.perf_counter() - t0)
    return step_times


current = [None]


def _trigger(delay):
    def trigger(step, metrics):
        assert threading.current_thread() is not threading.main_thread()
        time.sleep(delay(step) if callable(delay) else delay)
        return {"capacity": int(metrics["loss"])}           # a decision derived from step `step`'s metrics
    return trigger


def _apply(decision):
    current[0] = decision["capacity"]


# Δ=1: every trigger takes 60% of a step; Δ=3: every 4th takes 2.2 steps (one worker thread: the average must fit)
@pytest.mark.parametrize("delta,delay", [(1, 0.06), (3, lambda s: 0.22 if s % 4 == 1 else 0.005)])
def test_slow_trigger_does_not_stall_and_lands_exactly_delta_later(delta, delay):
    current[0] = None
    rc = Recompiler(_trigger(delay), _apply, delta_launch=delta)
    applied = []
    times = _loop(rc, 10, 0.1, applied)
    rc.close()
    assert rc.waits == 0, rc.waited_s                       # the loop never waited for the trigger
    assert max(times) < 0.1 + 0.05                           # and no step took the trigger's time
    for metrics_step, at, decision in rc.history:
        assert at == metrics_step + 1 + delta and decision == {"capacity": metrics_step}
    for step, cap in applied:                                # what each step ran with
        assert cap == (step - 1 - delta if step - 1 - delta >= 1 else None)
    assert rc.applied == 10 - 1 - delta


def test_delta_zero_is_synchronous_and_waits():
    current[0] = None
    rc = Recompiler(_trigger(0.05), _apply, delta_launch=0)
    applied = []
    _loop(rc, 5, 0.0, applied)
    rc.close()
    assert rc.waits >= 3 and rc.waited_s > 0.1
    assert applied[1:] == [(s, s - 1) for s in range(2, 6)]


def test_delta_changes_at_run_time_and_none_changes_nothing():
    current[0] = None
    rc = Recompiler(lambda s, m: None if s % 2 else {"capacity": s}, _apply, delta_launch=2)
    for step in range(1, 4):
        rc.boundary(step)
        rc.record(step, {"loss": torch.tensor(0.0)})
    rc.delta_launch = 0                                      # step 3's decision was due at 6; step 4's is due at 5
    for step in range(4, 8):
        rc.boundary(step)
        rc.record(step, {"loss": torch.tensor(0.0)})
    rc.boundary(8)
    rc.close()
    landed = {m: at for m, at, _ in rc.history}
    assert landed[1] == 4 and landed[2] == 5 and landed[3] == 6 and landed[4] == 5 and landed[5] == 6
    assert rc.applied == 3 and current[0] == 6              # decisions of steps 2, 4, 6; the Nones change nothing
    with pytest.raises(ValueError, match="delta_launch"):
        rc.delta_launch = -1


def test_trigger_error_surfaces_at_the_boundary():
    def bad(step, metrics):
        raise RuntimeError("trigger broke")
    rc = Recompiler(bad, _apply, delta_launch=1)
    rc.record(1, {})
    rc.boundary(2)                                           # not due yet
    with pytest.raises(RuntimeError, match="trigger broke"):
        rc.boundary(3)
    rc.close()


def _group_agrees(rank, world):
    got = []
    rc = Recompiler(lambda s, m: {"rank": rank, "step": s}, got.append, delta_launch=1, group=dist.group.WORLD)
    for step in range(1, 5):
        rc.boundary(step)
        rc.record(step, {})
    rc.close()
    assert got == [{"rank": 0, "step": s} for s in (1, 2)], got


def test_group_applies_its_first_ranks_decision():
    run_distributed(_group_agrees, 2)
