"""Model-state moves behind the next step (FlexMoE paper 001 §4: adjustments overlapped with training; the hiding
that SwiftMoE and Pro-Prophet build on).

A synchronous move (``PlacementRuntime.execute``) sends an expert's rows point to point and blocks until they
arrive, between two optimizer steps. Nothing needs them that soon: the parameter rows are first read by the moved
layer's expert computation in the next forward, after the layers below it and its own gate and dispatch; the
optimizer-state rows (fp32 master, Adam moments) only by the next optimizer step. ``MoveTransfer`` posts every
transfer asynchronously, parameter rows before state rows, on the expert-parallel group's own copy (so the layers'
all-to-alls do not queue behind them), and completes them where they are needed:

* ``wait_weights`` before the layer's experts compute (``ExpertBank.weights``) or a shadow broadcast reads them;
* ``finish`` (everything, the sends too) before the optimizer steps (a step pre-hook on every ``torch.optim``
  level of the trainer's optimizer), before a checkpoint reads the bank or the optimizer (state-dict pre-hooks),
  and before the next placement change.

The sender snapshots its rows when the move is posted, so it may free or refill the slot at once. A batch whose
moves read or overwrite a slot that an earlier move of the same batch receives into runs synchronously instead.
The seconds spent posting and waiting are the moves' exposed time (``PlacementRuntime.take_move_wait``): against the cost model's
transfer time of the same moves it gives the hidden fraction the placement policies learn (``move_exposure``)."""
from __future__ import annotations

import time
import weakref
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["MoveTransfer", "chained", "hook_optimizer", "finish_all", "track", "untrack"]

_PENDING: "weakref.WeakSet" = weakref.WeakSet()        # runtimes with transfers in flight, process-wide
_HOOKED: "weakref.WeakSet" = weakref.WeakSet()         # optimizers whose step / state_dict finish them first


def finish_all(*_args, **_kwargs) -> None:
    """Complete every runtime's transfers in flight (an optimizer-step or state-dict pre-hook)."""
    for runtime in list(_PENDING):
        runtime.finish_moves()


def hook_optimizer(levels) -> bool:
    """Register ``finish_all`` before ``step`` and ``state_dict`` of every ``torch.optim.Optimizer`` among
    ``levels`` (the trainer's optimizer and its wrapped ones); False when none is one (then the state cannot wait)."""
    found = False
    for level in levels:
        if isinstance(level, torch.optim.Optimizer):
            found = True
            if level not in _HOOKED:
                level.register_step_pre_hook(finish_all)
                level.register_state_dict_pre_hook(finish_all)
                _HOOKED.add(level)
    return found


def chained(moves: Sequence) -> bool:
    """True when a move reads, frees or overwrites a (rank, slot) an earlier move of the batch receives into: the
    batch must run in order, synchronously."""
    received = set()
    for mv in moves:
        touched = {(mv.src, mv.src_slot)} | ({(mv.dst, mv.dst_slot)} if mv.dst is not None else set())
        if touched & received:
            return True
        if mv.sends_rows:
            received.add((mv.dst, mv.dst_slot))
    return False


class MoveTransfer:
    """One batch of moves in flight on this rank: sends of snapshots and receives into buffers, each an entry
    (work, buffer, target row or None for a send), parameter rows apart from optimizer-state rows; both ends post
    them in the same order."""

    def __init__(self, group, peer_of):
        self.group, self._peer = group, peer_of
        self._weights: List[Tuple[object, torch.Tensor, Optional[torch.Tensor]]] = []   # (work, buffer, target)
        self._rest: List[Tuple[object, torch.Tensor, Optional[torch.Tensor]]] = []
        self.wait_s = 0.0
        self.sent = 0

    def post(self, rows: Sequence[torch.Tensor], peer: int, send: bool, weights: bool) -> None:
        """Post the transfer of ``rows`` to (``send``) or from ``peer`` (an expert-parallel rank)."""
        out = self._weights if weights else self._rest
        for t in rows:
            if send:
                buf = t.detach().clone(memory_format=torch.contiguous_format)
                out.append((dist.isend(buf, dst=self._peer(peer), group=self.group), buf, None))
                self.sent += buf.numel() * buf.element_size()
            else:
                buf = torch.empty_like(t, memory_format=torch.contiguous_format)
                out.append((dist.irecv(buf, src=self._peer(peer), group=self.group), buf, t))

    def _complete(self, entries) -> None:
        start = time.perf_counter()
        with torch.no_grad():
            for work, buf, target in entries:
                work.wait()
                if target is not None:
                    target.copy_(buf)
        entries.clear()
        self.wait_s += time.perf_counter() - start

    def wait_weights(self) -> None:
        """Every parameter-row transfer complete (sends too) and the received rows in place; the optimizer-state
        rows may still be in flight."""
        self._complete(self._weights)

    def finish(self) -> None:
        """Every transfer complete, parameter and state rows in place."""
        self._complete(self._weights)
        self._complete(self._rest)

    @property
    def weights_pending(self) -> bool:
        return bool(self._weights)


def track(runtime) -> None:
    """``runtime`` has transfers in flight (``finish_all`` completes them)."""
    _PENDING.add(runtime)


def untrack(runtime) -> None:
    _PENDING.discard(runtime)
