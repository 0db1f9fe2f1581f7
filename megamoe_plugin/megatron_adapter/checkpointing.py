"""Checkpoints of the megatron-core trainer (``megatron_adapter.trainer``): nothing lost, nothing half-loaded,
nothing executed.

Layout of ``--save DIR`` (Megatron-LM's, plus small files of plain tensors and numbers)::

    DIR/latest_checkpointed_iteration.txt     the newest complete iteration (written last, by rank 0)
    DIR/iter_0000020/                         megatron-core dist_checkpointing: model + optimizer, experts by
                                              logical id (so any expert-parallel size loads them)
    DIR/iter_0000020/run_state.pt             what every rank needs, whatever the world size: the iteration and
                                              the learning-rate scheduler (one schedule for the whole job)
    DIR/iter_0000020/extra_rank<r>.pt         what is rank r's own: its RNG states and DynaMoE runtime state

Both small files are read with ``torch.load(weights_only=True)``: they hold tensors, numbers, strings and
containers only (numpy's RNG state is stored as a tensor), so a downloaded checkpoint cannot run code. A file
that is not such a checkpoint stops the load with a ``CheckpointError`` naming it.

Resuming at another world size: ranks without an ``extra_rank<r>.pt`` keep the RNG seeded from ``--seed`` (said
in the log) and take the DynaMoE state of the saved ranks (assignment caches merged); the scheduler and the
iteration come from ``run_state.pt`` on every rank.
"""
from __future__ import annotations

import glob
import os
import random
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

FORMAT = "megamoe-megatron/2"
TRACKER = "latest_checkpointed_iteration.txt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the file or folder and what is wrong."""


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> Optional[int]:
    """The newest complete iteration saved under ``root``, or None when there is none."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path}: expected an iteration number, found {text[:40]!r}")
    return int(text)


def safe_load(path: str, what: str):
    """``torch.load(weights_only=True)`` with a clear error for a missing, truncated, foreign or code-carrying
    file (the restricted unpickler refuses any class that is not a tensor or a plain container)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing ({what})") from None
    except Exception as err:       # UnpicklingError (code or foreign classes), truncated zip, garbage bytes
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{path}: not a readable {what} (refused by torch.load(weights_only=True): "
                              f"{first})") from None


# --- RNG states as plain tensors ----------------------------------------------------------------------------------
def rng_state(tracker_states: dict) -> dict:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                      "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)},
            "tracker": tracker_states}


def set_rng_state(state: dict, set_tracker: Callable[[dict], None]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    set_tracker(state["tracker"])


# --- save ---------------------------------------------------------------------------------------------------------
def save(root: str, iteration: int, model, optimizer, scheduler, tracker_states: dict, dynamic=None,
         world_size: Optional[int] = None, local_gates: bool = False) -> str:
    """Collective: every rank calls it. Writes the model/optimizer shards, ``run_state.pt`` (rank 0) and this rank's
    ``extra_rank<r>.pt``; the tracker file last, so an interrupted save leaves the previous checkpoint current."""
    from megatron.core import dist_checkpointing

    rank = dist.get_rank()
    path = iteration_dir(root, iteration)
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    extra = {"format": FORMAT, "rng": rng_state(tracker_states)}      # before anything could draw from the RNG
    if dynamic is not None:
        extra["dynamic"] = dynamic.state_dict()
    if local_gates:                     # --moe-plugin-gate-sync local / average:K: this rank's gate is its own
        from ..gate_sync import rank_state
        extra["gates"] = rank_state([model.module], optimizer)
    model_sd = model.module.sharded_state_dict()
    dist_checkpointing.save({"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd)}, path)
    _atomic_save(extra, os.path.join(path, f"extra_rank{rank}.pt"))
    if rank == 0:
        _atomic_save({"format": FORMAT, "iteration": iteration, "scheduler": scheduler.state_dict(),
                      "world_size": world_size or dist.get_world_size()}, os.path.join(path, "run_state.pt"))
    dist.barrier()
    if rank == 0:
        tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tmp, os.path.join(root, TRACKER))
    dist.barrier()
    return path


def _atomic_save(obj, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


# --- load ---------------------------------------------------------------------------------------------------------
def load(root: str, model, optimizer, scheduler, set_tracker: Callable[[dict], None], dynamic=None,
         log: Callable[[str], None] = print, local_gates: bool = False) -> int:
    """Collective. Restore the newest complete checkpoint under ``root``; returns its iteration. Raises
    ``CheckpointError`` when there is none (the caller decides whether that is fatal)."""
    from megatron.core import dist_checkpointing

    iteration = read_tracker(root)
    if iteration is None:
        raise CheckpointError(f"{root}: no checkpoint ({TRACKER} not found)")
    path = iteration_dir(root, iteration)
    run_state = _load_run_state(path, iteration)
    rank = dist.get_rank()
    own = os.path.join(path, f"extra_rank{rank}.pt")
    extra = safe_load(own, "per-rank checkpoint state") if os.path.exists(own) else None
    model_sd = model.module.sharded_state_dict()
    try:
        state = dist_checkpointing.load(
            {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True)}, path)
    except Exception as err:
        raise CheckpointError(f"{path}: the model/optimizer shards do not load into this model "
                              f"({type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''})") from err
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(run_state["scheduler"])          # every rank: one schedule for the job
    missing = [r for r in range(dist.get_world_size())
               if not os.path.exists(os.path.join(path, f"extra_rank{r}.pt"))]
    if missing:
        log(f" extra_rank{{{','.join(map(str, missing))}}}.pt not in the checkpoint (saved at world size "
            f"{run_state.get('world_size')}, now {dist.get_world_size()}): rank(s) {missing} keep the RNG seeded "
            "from --seed and take the saved ranks' DynaMoE state; the LR schedule is the checkpoint's on every rank")
    if extra is not None:
        set_rng_state(extra["rng"], set_tracker)
        if dynamic is not None and "dynamic" in extra:
            dynamic.load_state_dict(extra["dynamic"])
    elif dynamic is not None:
        merged = _merged_dynamic_state(path)
        if merged is not None:
            dynamic.load_state_dict(merged)
    if local_gates:                     # this rank's own gate, or (a new rank) the mean of the saved ones
        from ..gate_sync import load_rank_state, rank_state_for
        gates = [s.get("gates") for s in _extra_states(path)]
        if gates and all(g for g in gates):
            load_rank_state([model.module], rank_state_for(gates, rank, dist.get_world_size()), optimizer)
    return iteration


def _load_run_state(path: str, iteration: int) -> dict:
    file = os.path.join(path, "run_state.pt")
    if os.path.exists(file):
        state = safe_load(file, "checkpoint run state")
        if not isinstance(state, dict) or state.get("format") != FORMAT or "scheduler" not in state:
            raise CheckpointError(f"{file}: not a {FORMAT} checkpoint")
        if state.get("iteration") != iteration:
            raise CheckpointError(f"{file}: holds iteration {state.get('iteration')}, the tracker says "
                                  f"{iteration}: the checkpoint is torn; remove {path} or fix {TRACKER}")
        return state
    raise CheckpointError(f"{path}: no run_state.pt: written by an older version of this trainer, which stored the "
                          "learning-rate schedule per rank; re-save it with this version or start afresh")


def _extra_states(path: str) -> list:
    """Every saved rank's extra_rank<r>.pt, in rank order."""
    files = sorted(glob.glob(os.path.join(path, "extra_rank*.pt")),
                   key=lambda p: int(os.path.basename(p)[len("extra_rank"):-len(".pt")]))
    return [safe_load(f, "per-rank checkpoint state") for f in files]


def _merged_dynamic_state(path: str) -> Optional[dict]:
    """The DynaMoE state of the saved ranks for a rank that has none: rank 0's policies, every rank's cache."""
    from ..dynamic.assignment_cache import AssignmentCache

    states = [s.get("dynamic") for s in _extra_states(path)]
    states = [s for s in states if s is not None]
    if not states:
        return None
    mine = dict(states[0])
    caches = [s["cache"] for s in states if "cache" in s]
    if caches:
        mine["cache"] = AssignmentCache.merge_states(caches)
    return mine
