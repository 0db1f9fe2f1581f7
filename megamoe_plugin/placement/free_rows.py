"""Free vExpert slots cost no optimizer work (FlexMoE's spare slots, paper 001 §3.2): while ``optimizer.step()``
runs, each bank parameter (or the fp32 master copy the optimizer updates), its gradient and its optimizer state are
narrowed to the rows up to the last occupied slot: dim-0 prefixes, views of the same memory updated in place. A free
slot carries no tokens and the next move into it overwrites it, weights and state. Only for tensors a
``torch.optim.Optimizer`` steps whole, once it has made their state (the first step); Megatron's distributed
optimizer keeps flat shards, which still step the free rows.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .optim_state import is_sharding, master_of, optimizer_levels

__all__ = ["FreeRows"]


class FreeRows:
    """Step hooks on the torch optimizers that update the banks of ``layers`` (module docstring)."""

    def __init__(self) -> None:
        # per torch optimizer: (the tensor it steps for a bank parameter, that layer's placement runtime)
        self.entries: Dict[int, List[Tuple[torch.Tensor, object]]] = {}
        self._saved: List[tuple] = []
        self._handles = []
        self.narrowed_steps = 0          # optimizer steps in which at least one tensor was narrowed

    @classmethod
    def attach(cls, optimizer, layers: Sequence) -> Optional["FreeRows"]:
        """Hooks for every bank of ``layers`` that has spare slots; None when there is nothing to narrow."""
        self = cls()
        levels = list(optimizer_levels(optimizer)) if optimizer is not None else []
        if any(is_sharding(level) for level in levels):
            return None
        torch_levels = [level for level in levels if isinstance(level, torch.optim.Optimizer)]
        for layer in layers:
            rt = getattr(getattr(layer, "plan", None), "placement", None)
            if rt is None or rt.slots_per_rank <= rt.num_experts // rt.ep.size:
                continue
            bank = layer.experts_bank
            for p in (bank.w1, bank.w2, bank.b1, bank.b2):
                if p is None:
                    continue
                key = next((m for m in (master_of(level, p) for level in levels) if m is not None), p)
                if key.shape != p.shape:
                    continue
                for level in torch_levels:
                    if any(q is key for group in level.param_groups for q in group["params"]):
                        self.entries.setdefault(id(level), []).append((key, rt))
                        break
        for level in torch_levels:
            if id(level) in self.entries:
                self._handles.append(level.register_step_pre_hook(self._narrow))
                self._handles.append(level.register_step_post_hook(self._restore))
        return self if self.entries else None

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _narrow(self, optimizer, args, kwargs) -> None:
        narrowed = False
        entries = self.entries.get(id(optimizer), ())
        rows_of = {id(rt): rt.occupied_rows() for _, rt in entries}     # once per layer, not per parameter
        for key, rt in entries:
            n = rows_of[id(rt)]
            state = optimizer.state.get(key)
            if n >= key.shape[0] or key.grad is None or not state:
                continue
            full, grad = key.data, key.grad
            rows = {k: v for k, v in state.items() if torch.is_tensor(v) and v.shape == full.shape}
            key.data, key.grad = full[:n], grad[:n]
            for k, v in rows.items():
                state[k] = v[:n]
            self._saved.append((key, full, grad, state, rows))
            narrowed = True
        self.narrowed_steps += int(narrowed)

    def _restore(self, optimizer, args, kwargs) -> None:
        while self._saved:
            key, full, grad, state, rows = self._saved.pop()
            key.data, key.grad = full, grad
            state.update(rows)
