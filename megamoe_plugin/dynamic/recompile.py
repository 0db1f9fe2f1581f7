"""RECOMPILE (DynaMoE paper 000 §3, Appendix B): decide shape changes off the critical path, apply them at a step
boundary exactly Δ_launch steps later.

The paper's mechanism on Legion: model metrics are queued as futures when their tasks are launched; the
user's *recompile trigger* runs on the CPU with the metrics of the execution frontier while Δ_launch iterations of
already launched work keep the accelerator busy; its decision takes effect at the launch frontier. In a PyTorch
step loop:

* ``record(step, metrics)`` at the end of training step ``step`` (1-based): the metrics (tensors may still be in
  flight on a GPU; they are read on the worker thread, never on the training thread) are handed to ONE background
  thread that calls ``trigger(step, metrics)``;
* ``boundary(step)`` before training step ``step``: applies, with ``apply(decision)``, the decision computed from
  the metrics of step ``step - 1 - delta_launch`` (None = no change). Steps ``s + 1 .. s + Δ`` run while the trigger
  for step s computes; so with Δ_launch = 0 the loop waits for every trigger (a synchronous recompile), and with a
  Δ_launch long enough for the trigger the loop never waits (one worker thread runs the triggers in step order,
  so on average a trigger must take less than a step; a single slow one may take up to Δ_launch steps). When a trigger is late the loop waits for it, as
  the paper's launch frontier stalls: the decision still lands exactly Δ_launch steps after its metrics, on every
  rank the same (``waits`` / ``waited_s`` count it).
* ``delta_launch`` can be changed at any time; a decision is due at the boundary fixed when its metrics were
  recorded.

Decisions must be the same on every rank: pass metrics that are already global (all-reduced), or give ``group``
so the decision of the group's first rank is broadcast at the boundary (one small collective per applied
decision). What a decision does is the caller's: new per-expert capacities for the capacity dispatch (the
"recompilation" of its static shapes: buffers, and a torch.compile graph or CUDA graph captured for them), caching
on or off. Weights are never touched.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict

import torch
import torch.distributed as dist

__all__ = ["Recompiler"]


def _to_host(metrics: Dict[str, Any]) -> Dict[str, Any]:
    """Tensors -> CPU copies (on the worker thread: the training thread never syncs for a metric)."""
    return {k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in metrics.items()}


class Recompiler:
    """Runs ``trigger(step, metrics) -> decision | None`` off the training thread and applies decisions with
    ``apply(decision)`` at the step boundary ``delta_launch`` steps after their metrics (module docstring)."""

    def __init__(self, trigger: Callable[[int, Dict[str, Any]], Any], apply: Callable[[Any], None],
                 delta_launch: int = 1, group=None):
        if delta_launch < 0:
            raise ValueError(f"delta_launch must be >= 0, got {delta_launch}")
        self.trigger, self.apply_fn, self.group = trigger, apply, group
        self._delta = int(delta_launch)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megamoe-recompile")
        self._due: Dict[int, Future] = {}             # boundary step -> future decision
        self._lock = threading.Lock()
        self.applied = 0                               # decisions that changed something (recompilations)
        self.waits = 0                                 # boundaries where the loop had to wait for a trigger
        self.waited_s = 0.0
        self.history = []                              # (metrics step, applied at step, decision)

    @property
    def delta_launch(self) -> int:
        return self._delta

    @delta_launch.setter
    def delta_launch(self, value: int) -> None:
        if int(value) < 0:
            raise ValueError(f"delta_launch must be >= 0, got {value}")
        self._delta = int(value)

    def record(self, step: int, metrics: Dict[str, Any]) -> None:
        """End of training step ``step``: queue its metrics for the trigger (returns at once)."""
        due = int(step) + 1 + self._delta
        fut = self._pool.submit(lambda: (int(step), self.trigger(int(step), _to_host(metrics))))
        with self._lock:
            if due in self._due:                       # delta_launch shrank: two decisions for one boundary,
                prev = self._due[due]                  # both apply there, in metrics order
                self._due[due] = _chain(prev, fut)
            else:
                self._due[due] = fut

    def boundary(self, step: int) -> bool:
        """Before training step ``step``: apply the decisions due now. Returns True if one changed something."""
        with self._lock:
            due = sorted(s for s in self._due if s <= step)
            futs = [self._due.pop(s) for s in due]
        changed = False
        for fut in futs:
            if not fut.done():
                self.waits += 1
                t0 = time.perf_counter()
                fut.result()
                self.waited_s += time.perf_counter() - t0
            for metrics_step, decision in _results(fut):
                decision = self._agreed(decision)
                self.history.append((metrics_step, step, decision))
                if decision is not None:
                    self.apply_fn(decision)
                    self.applied += 1
                    changed = True
        return changed

    def drain(self) -> Dict[int, list]:
        """Wait for every trigger still running and return the decisions not yet applied, without applying them:
        {boundary step: [(metrics step, decision or None), ...]}. After it, the trigger's own state (e.g. a
        policy's moving averages) includes every recorded step and is not being written: what a checkpoint saves."""
        with self._lock:
            due = dict(self._due)
        out = {}
        for step, fut in sorted(due.items()):
            out[int(step)] = [(int(s), d) for s, d in _results(fut)]
        return out

    def restore(self, pending: Dict[int, list]) -> None:
        """Re-queue decisions saved by ``drain`` (a resumed run applies them at the same boundaries)."""
        with self._lock:
            for step, results in pending.items():
                results = [(int(s), d) for s, d in results]
                fut: Future = Future()
                fut.set_result(results)
                self._due[int(step)] = _chain(fut, self._due[int(step)]) if int(step) in self._due else fut   # older first

    def _agreed(self, decision):
        if self.group is None or not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return decision
        box = [decision]
        dist.broadcast_object_list(box, src=dist.get_process_group_ranks(self.group)[0], group=self.group)
        return box[0]

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _chain(first: Future, second: Future) -> Future:
    out: Future = Future()
    lock = threading.Lock()

    def done(_):
        with lock:
            if out.done() or not (first.done() and second.done()):
                return
            try:
                out.set_result(_results(first) + _results(second))
            except Exception as e:      # the trigger raised: surface it at the boundary
                out.set_exception(e)

    first.add_done_callback(done)
    second.add_done_callback(done)
    return out


def _results(fut: Future):
    r = fut.result()
    return r if isinstance(r, list) else [r]
