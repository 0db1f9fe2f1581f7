"""The after-step hook: what runs on every rank between two optimizer steps, and the placement-policy registry.

FlexMoE (paper 001 §3, Fig. 5) re-places experts *between* optimizer steps, when no gradient is in flight and
the optimizer state is consistent with the weights; DynaMoE (paper 000 §4) changes capacities at the same point.
Adapters call ``AfterStepHook.run(model, optimizer, iteration)`` right after ``optimizer.step()`` (Megatron:
around ``train_step``; fairseq: after ``trainer.train_step``); the hook calls the configured policy every
``--moe-placement-interval`` steps.

A policy is a callable ``policy(ctx: StepContext) -> None``. Name one with ``--moe-placement``:
- ``none`` (default): nothing runs;
- ``flexmoe`` / ``shadow`` / ``eplb`` (policies.py), executed by the layers' ``PlacementRuntime`` (runtime.py);
- a name added with ``@register_placement_policy("name")`` (a class or factory taking the MoEConfig);
- ``package.module:attr``: imported, so a policy can live in the user's code without registering it first.
"""
from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch.nn as nn

from ..config import ConfigError, MoEConfig, flag
from ..layer import find_moe_layers
from .free_rows import FreeRows

_POLICIES: Dict[str, Callable[[MoEConfig], Callable]] = {}


def register_placement_policy(name: str):
    """Decorator: ``@register_placement_policy("flexmoe")`` on a class/factory ``(cfg: MoEConfig) -> policy``."""
    def deco(factory):
        if name in _POLICIES or name == "none":
            raise ValueError(f"placement policy {name!r} is already registered")
        _POLICIES[name] = factory
        return factory
    return deco


def registered_placement_policies() -> List[str]:
    return ["none"] + sorted(_POLICIES)


def build_placement_policy(cfg: MoEConfig) -> Optional[Callable]:
    """The policy object named by ``cfg.placement`` (None for "none"). Errors name the flag."""
    name = cfg.placement
    if name in ("", "none"):
        return None
    if name in _POLICIES:
        return _POLICIES[name](cfg)
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"{flag('placement')}={name!r}: cannot import it ({e})") from None
        return factory(cfg)
    raise ConfigError(f"{flag('placement')}={name!r}: unknown policy; known: "
                      f"{', '.join(registered_placement_policies())}, or package.module:attr")


@dataclass
class StepContext:
    """What a policy sees after an optimizer step."""
    model: Any                      # the trainer's model (a module or a list of modules, e.g. Megatron chunks)
    optimizer: Any                  # the trainer's optimizer (torch, Megatron or fairseq wrapper)
    iteration: int                  # optimizer steps done so far (1 after the first step)
    moe_layers: List[nn.Module]     # the model's MoE layers (core MoELayer or adapter layers), in order
    extra: Dict[str, Any] = field(default_factory=dict)   # adapter-specific (e.g. Megatron's process groups)
    steps: int = 1                  # optimizer steps since the policy last ran: the steps the layers' counts cover
    last_step: Optional[int] = None     # the run's last optimizer step (train-iters, max-update), None if unknown


class AfterStepHook:
    """Runs the configured policy (and any extra callbacks) after optimizer steps."""

    def __init__(self, cfg: MoEConfig, policy: Optional[Callable] = None):
        self.cfg = cfg
        self.policy = policy if policy is not None else build_placement_policy(cfg)
        self.callbacks: List[Callable[[StepContext], None]] = []
        self.calls = 0
        self._started: Optional[float] = None     # when the previous call started
        self._steps = 0                 # optimizer steps since the policy last ran
        self._layers = None             # (model, its MoE layers): found once
        self._eval_forwards = 0         # the layers' forwards without gradient, at the previous call
        self._observed: Optional[float] = None    # the last step duration given to the policy
        self.free_rows: Optional[FreeRows] = None     # the optimizer skips the banks' free slots (free_rows.py)
        self._free_rows_for = None                    # the optimizer those hooks are on

    def add(self, fn: Callable[[StepContext], None]) -> None:
        self.callbacks.append(fn)

    @property
    def active(self) -> bool:
        return self.policy is not None or bool(self.callbacks)

    def run(self, model, optimizer, iteration: int, moe_layers: Optional[List[nn.Module]] = None,
            last_step: Optional[int] = None, **extra) -> bool:
        """Call after ``optimizer.step()`` on every rank; ``last_step``: the run's last optimizer step, when the
        trainer knows it (no change is made after it, none is amortised past it). Returns True when something ran.
        Every call gives the policy the step's duration (``observe_step``, the pay-off guard's measurements): the
        time since the previous call started, so the policy's own time after a step counts in the step it slows
        down. A step beside which the MoE layers ran forwards without gradient (an evaluation) is observed as the
        step before it: every rank must observe as many steps (the guard's verdicts are collective)."""
        start = time.perf_counter()
        observe = getattr(self.policy, "observe_step", None)
        if moe_layers is None:
            if self._layers is None or self._layers[0] is not model:
                self._layers = (model, find_moe_layers(model))
            moe_layers = self._layers[1]
        if observe is not None:
            evals = sum(getattr(getattr(getattr(m, "plan", None), "placement", None), "eval_forwards", 0)
                        for m in moe_layers)
            if self._started is not None:
                seconds = start - self._started
                if evals != self._eval_forwards and self._observed is not None:
                    seconds = self._observed
                observe(seconds)
                self._observed = seconds
            self._eval_forwards = evals
        self._started = start
        self._steps += 1
        if self.policy is not None and optimizer is not self._free_rows_for:
            if self.free_rows is not None:
                self.free_rows.detach()
            self.free_rows, self._free_rows_for = FreeRows.attach(optimizer, moe_layers), optimizer
        if self.policy is not None:                   # the planners' window of the last steps' routing
            keep = self.cfg.placement_plan_window
            for m in moe_layers:
                rt = getattr(getattr(m, "plan", None), "placement", None)
                if rt is not None:
                    rt.close_step(keep)
        early = getattr(self.policy, "early_due", None)      # the pay-off guard's early look at a change
        if not self.active or (iteration % self.cfg.placement_every and not (early is not None and early())):
            return False
        ctx = StepContext(model, optimizer, iteration, moe_layers, dict(extra), steps=self._steps, last_step=last_step)
        self._steps = 0
        if self.policy is not None:
            self.policy(ctx)
        for fn in self.callbacks:
            fn(ctx)
        self.calls += 1
        return True


