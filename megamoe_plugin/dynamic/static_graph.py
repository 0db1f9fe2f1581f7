"""Static-shape expert graphs for the capacity dispatch, re-compiled or re-captured by RECOMPILE (paper 000 §3).

With capacity dispatch the experts' input is a padded buffer whose shape depends only on the capacities, so the
expert computation can run as a compiled graph (``--moe-expert-graph compile``: ``torch.compile`` with static
shapes) or a captured CUDA graph (``--moe-expert-graph cuda-graph``: ``torch.cuda.make_graphed_callables``,
forward and backward). In PyTorch this is what a DynaMoE "recompilation" is: when dynamic capacity changes the
capacities, ``recompile()`` (called by ``DynamicRuntime`` at the step boundary) drops the graph of the old shapes
and the next call compiles / captures one for the new shapes. The graphs read the ExpertBank's parameters in
place: weights are never reallocated or copied.

The graphed function is the ExpertBank's math written with plain tensor ops per expert group (fixed slices), the
same values as ``ExpertBank.forward``. Shapes seen before are kept (an LRU of ``max_graphs``), so oscillating
capacities do not recompile each time. Only a trivial placement is supported (no replicated or shadowed slots).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, List, Sequence, Tuple

import torch
import torch.nn as nn

from ..experts.activations import activation as _act

__all__ = ["StaticExpertGraph", "grouped_expert_math"]


def grouped_expert_math(x, w1, w2, b1, b2, counts: Sequence[int], activation: str) -> torch.Tensor:
    """Expert e computes rows [start_e, start_e + counts[e]) of x: act(x W1_e + b1_e) W2_e + b2_e."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        xe = x[start:start + n]
        h = xe @ w1[e] + (b1[e] if b1 is not None else 0)
        outs.append(_act(h, activation) @ w2[e] + (b2[e] if b2 is not None else 0))
        start += n
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[-1])


class _FixedGroups(nn.Module):
    """The bank's computation for one fixed group layout (what a CUDA graph captures)."""

    def __init__(self, bank, counts: Tuple[int, ...]):
        super().__init__()
        self.bank, self.counts = bank, counts

    def forward(self, x):
        b = self.bank
        return grouped_expert_math(x, b.w1, b.w2, b.b1, b.b2, self.counts, b.activation)


class StaticExpertGraph:
    """Runs ``bank(x, tokens_per_expert)`` through a graph built for the current shapes (module docstring)."""

    def __init__(self, mode: str, max_graphs: int = 8):
        if mode not in ("compile", "cuda-graph"):
            raise ValueError(f"--moe-expert-graph: unknown mode {mode!r} (compile | cuda-graph)")
        self.mode, self.max_graphs = mode, max_graphs
        self._graphs: "OrderedDict[tuple, Callable]" = OrderedDict()
        self.builds = 0             # graphs compiled / captured
        self.recompiles = 0         # recompile() calls that dropped a graph

    def recompile(self) -> None:
        """The capacities changed (a RECOMPILE decision): the next call builds the graph of the new shapes."""
        if self._graphs:
            self._graphs.popitem(last=True)     # the graph in use; older shapes stay cached (LRU)
            self.recompiles += 1

    def __call__(self, bank, x: torch.Tensor, tokens_per_expert: List[int]) -> torch.Tensor:
        if bank.placement is not None and not bank.placement.trivial:
            return bank(x, tokens_per_expert)
        counts = tuple(int(c) for c in tokens_per_expert)
        key = (id(bank), counts, x.dtype, x.device, x.requires_grad)
        fn = self._graphs.get(key)
        if fn is None:
            fn = self._build(bank, counts, x)
            self._graphs[key] = fn
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(key)
        return fn(x)

    def _build(self, bank, counts: Tuple[int, ...], x: torch.Tensor) -> Callable:
        self.builds += 1
        bank.kernel_for(x)          # a kernel choice that times both kernels runs here, never traced or captured
        module = _FixedGroups(bank, counts)
        if self.mode == "compile":
            return torch.compile(module, dynamic=False)
        if not x.is_cuda:
            raise RuntimeError("--moe-expert-graph cuda-graph needs the experts on a CUDA device")
        sample = torch.zeros_like(x).requires_grad_(x.requires_grad)
        return torch.cuda.make_graphed_callables(module, (sample,))
