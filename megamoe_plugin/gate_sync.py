"""Gate synchronisation across data-parallel ranks: ``--moe-gate-sync all | local | average:K``.

TA-MoE (paper 002) steers each rank's routing toward its own row of the topology's target pattern. A gate whose
gradient is averaged over ranks (``all``: FastMoE, FasterMoE, DeepSpeed-MoE and this project's default) has one
routing for every rank, and with i.i.d. data the per-rank targets (permutations of each other on a symmetric tree)
cancel. The authors' release keeps gate gradients out of the per-step all-reduce (``--gate_reduce_freq``), gates
broadcast once at the start, and meant to average the gate *parameters* every K steps. Here:

- ``all``: the gate is an ordinary replicated parameter (its gradient averaged every step);
- ``local``: every rank's gate learns from its own gradient only. The trainers leave the gate parameters out of
  their data/expert-parallel gradient reduction, and make gradient clipping global and identical on every rank:
  the gates' share of the squared norm is the mean over ranks of each rank's own (``local_grad_sq_norm``), so every
  rank clips by the same coefficient and the replicated parameters stay identical. Checkpoints keep every rank's
  gate (``gather_rank_states`` / ``rank_state_for``); resumed at another world size, every rank starts from the
  mean of the saved gates (what ``average`` would give) and re-specialises from there;
  the same per-rank state carries the gates' per-rank buffers (``per_rank_buffers``: TA-MoE's sender bias), which
  start from their initial value at another world size;
- ``average:K``: ``local`` plus an average of the gate parameters over ranks every K optimizer steps
  (``GateSync.after_step``); right after step K the gates are equal on every rank.

Gate parameters are found by the ``megamoe_gate`` attribute the Gate base class sets on them.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from .placement.optim_state import param_state_tensors



def gate_params(model) -> List[torch.nn.Parameter]:
    """The gate parameters of a model or a list of model chunks, in module order."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    seen, out = set(), []
    for chunk in chunks:
        for p in chunk.parameters():
            if getattr(p, "megamoe_gate", False) and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def local_grad_sq_norm(grads: List[torch.Tensor], group=None) -> torch.Tensor:
    """The gates' share of a global squared gradient norm, identical on every rank: the mean over the group's
    ranks of each rank's own sum of squares (float64 scalar, on the gradients' device). Collective."""
    if not grads:
        sq = torch.zeros((), dtype=torch.float64)
    else:
        sq = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]).pow(2).sum()
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size(group)
        if world > 1:
            dist.all_reduce(sq, group=group)
            sq = sq / world
    return sq


@torch.no_grad()
def average_params(params: List[torch.Tensor], group=None) -> None:
    """Replace every tensor by its mean over the group's ranks (one flat all-reduce). Collective."""
    if not params or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([p.detach().reshape(-1).to(torch.float32) for p in params])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for p in params:
        n = p.numel()
        p.copy_(flat[offset:offset + n].view_as(p).to(p.dtype))
        offset += n


class GateSync:
    """What a trainer calls for ``--moe-gate-sync``: ``local`` (leave gates out of the gradient reduction),
    ``after_step`` (``average:K``)."""

    def __init__(self, cfg, group=None):
        self.mode, self.every = cfg.gate_sync_mode
        self.per_rank_state = cfg.per_rank_gate_state      # checkpoints keep every rank's gate state
        self.group = group
        self.averaged = 0

    @property
    def local(self) -> bool:
        return self.mode != "all"

    def after_step(self, model, step: int) -> bool:
        """After optimizer step ``step`` (1-based): with ``average:K`` and K | step, average the gates (collective);
        returns whether it did."""
        if self.mode != "average" or step % self.every:
            return False
        average_params(gate_params(model), self.group)
        self.averaged += 1
        return True


# --- checkpoints: every rank's gate ------------------------------------------------------------------------------
def rank_state(model, optimizer=None, names: Optional[Dict[int, str]] = None) -> Dict[str, torch.Tensor]:
    """This rank's gate parameters and the optimizer state tensors shaped like them (``name``, ``name/<i>``)."""

    names = names or _names(model)
    out = {}
    for p in gate_params(model):
        name = names[id(p)]
        out[name] = p.detach().cpu().clone()
        for i, t in enumerate(param_state_tensors(optimizer, p)):
            out[f"{name}/{i}"] = t.detach().cpu().clone()
    for name, t in rank_buffers(model).items():
        out[_BUFFER + name] = t.detach().cpu().clone()
    return out


_BUFFER = "rank_buffer/"          # key prefix of a gate's per-rank buffers in a rank_state


def rank_buffers(model) -> Dict[str, torch.Tensor]:
    """The per-rank buffers of the model's gates (a gate's ``per_rank_buffers``: e.g. TA-MoE's sender bias), by
    qualified name."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    out = {}
    for i, c in enumerate(chunks):
        prefix = f"{i}." if len(chunks) > 1 else ""
        for mname, m in c.named_modules():
            for b in getattr(m, "per_rank_buffers", ()):
                t = getattr(m, b, None)
                if isinstance(t, torch.Tensor):
                    out[f"{prefix}{mname}.{b}"] = t
    return out


def gather_rank_states(model, optimizer=None, group=None) -> List[Dict[str, torch.Tensor]]:
    """Every rank's ``rank_state`` (collective; one list, in rank order, on every rank)."""
    mine = rank_state(model, optimizer)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [mine]
    states = [None] * dist.get_world_size(group)
    dist.all_gather_object(states, mine, group=group)
    return states


def rank_state_for(states: List[Dict[str, torch.Tensor]], rank: int, world: int) -> Dict[str, torch.Tensor]:
    """The saved gate state this rank resumes from: its own when the world size is the saved one, else the mean of
    every saved rank's (the gates re-specialise from their average; module docstring)."""
    if len(states) == world:
        return states[rank]
    # per-rank buffers describe the saved layout (a sender's row of the topology): they start afresh
    keys = [k for k in states[0] if not k.startswith(_BUFFER)]
    return {k: torch.stack([s[k].to(torch.float64) for s in states]).mean(0).to(states[0][k].dtype) for k in keys}


@torch.no_grad()
def load_rank_state(model, state: Dict[str, torch.Tensor], optimizer=None) -> None:
    """Write a ``rank_state`` back into this rank's gates (and their optimizer state)."""

    names = _names(model)
    for p in gate_params(model):
        name = names[id(p)]
        if name not in state:
            continue
        p.copy_(state[name].to(p.dtype))
        for i, t in enumerate(param_state_tensors(optimizer, p)):
            if f"{name}/{i}" in state:
                t.copy_(state[f"{name}/{i}"].to(t.dtype))
    for name, t in rank_buffers(model).items():
        if _BUFFER + name in state:
            t.copy_(state[_BUFFER + name].to(t.dtype))


def _names(model) -> Dict[int, str]:
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return {id(p): (f"{i}." if len(chunks) > 1 else "") + n for i, c in enumerate(chunks)
            for n, p in c.named_parameters()}
