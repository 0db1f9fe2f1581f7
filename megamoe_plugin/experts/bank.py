"""ExpertBank: the FFN experts that live on one rank, computed as one grouped operation.

Weights are stacked per slot: ``w1`` [E_local, H, F'] (F' = 2F for the gated activations), ``w2`` [E_local, F, H], optional biases
``b1`` [E_local, F'] and ``b2`` [E_local, H]. One expert is one index along dim 0 of every parameter (and of every
optimizer state tensor shaped like it), so copying, replicating or moving an expert with its optimizer state
(FlexMoE vExperts, paper 001 §3.2-3.3) is a slice copy: see ``expert_state`` / ``load_expert_state``.

Tokens arrive sorted by local expert in contiguous groups of sizes ``tokens_per_expert``: host ints (after an
expert-parallel exchange, whose split sizes are on the host anyway) or a device tensor (one rank: no host sync).
The kernel is ``--moe-expert-kernel`` (experts/choice.py): the grouped GEMM (experts/grouped.py) or one GEMM per
expert (experts/loop.py); both give the same outputs and gradients.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Union

import torch
import torch.nn as nn

from ..config import INIT_STD
from .activations import activation_spec, is_gated
from .choice import KERNELS, choose_kernel, cuda_fallback
from .grouped import GroupedExpertMM, offsets_from_counts
from .loop import GroupedExpertFFN


def check_input_dtype(x: torch.Tensor, bank: "ExpertBank", where: str) -> None:
    """A clear error at the MoE layer's entry instead of a oneDNN / matmul failure deep inside: the tokens and
    the experts' weights must have one dtype (the model is cast as a whole, e.g. --bf16 or model.to(dtype))."""
    if x.dtype != bank.w1.dtype:
        raise TypeError(f"{where}: input dtype {x.dtype} but the expert weights are {bank.w1.dtype}; cast the "
                        f"model to the input's dtype (model.to({x.dtype}), or the trainer's --bf16 / --fp16 flag) or "
                        f"the input to {bank.w1.dtype}")


class ExpertBank(nn.Module):
    """The experts of one rank. ``forward(x, tokens_per_expert)`` with x sorted into contiguous groups."""

    def __init__(self, num_local_experts: int, hidden_size: int, ffn_hidden_size: int, activation: str = "gelu",
                 bias: bool = False, init_std: float = 0.02, dtype: Optional[torch.dtype] = None, device=None,
                 cpu_lanes: int = 0, cpu_gemm: str = "auto", kernel: str = "auto"):
        super().__init__()
        fc1_out = 2 * ffn_hidden_size if is_gated(activation) else ffn_hidden_size
        kw = {"dtype": dtype, "device": device}
        self.num_local_experts, self.hidden_size, self.ffn_hidden_size = num_local_experts, hidden_size, ffn_hidden_size
        if kernel not in KERNELS:
            raise ValueError(f"expert kernel {kernel!r}: must be one of {', '.join(KERNELS)}")
        self.activation, self.cpu_lanes, self.cpu_gemm, self.kernel = activation, cpu_lanes, cpu_gemm, kernel
        self.w1 = nn.Parameter(torch.empty(num_local_experts, hidden_size, fc1_out, **kw))
        self.w2 = nn.Parameter(torch.empty(num_local_experts, ffn_hidden_size, hidden_size, **kw))
        self.b1 = nn.Parameter(torch.zeros(num_local_experts, fc1_out, **kw)) if bias else None
        self.b2 = nn.Parameter(torch.zeros(num_local_experts, hidden_size, **kw)) if bias else None
        nn.init.normal_(self.w1, std=init_std)
        nn.init.normal_(self.w2, std=init_std)
        for p in self.parameters():
            p.expert = True          # fairseq skips these in the data-parallel all-reduce
            p.allreduce = False      # Megatron reduces these over the expert-data-parallel group

    placement = None    # a placement.runtime.PlacementRuntime when experts can be replicated, moved or shadowed

    @classmethod
    def from_config(cls, cfg, hidden_size: int, ffn_hidden_size: int, init_std: Optional[float] = None,
                    dtype: Optional[torch.dtype] = None, device=None) -> "ExpertBank":
        """The bank of one rank for a MoEConfig: its vExpert slots, activation (with a gated activation's offset
        and clamp), biases and kernel; on CPU its lanes and GEMM library are chosen per call (``cpu_lanes`` 0 and
        ``cpu_gemm`` "auto", attributes a benchmark may set)."""
        act = activation_spec(cfg.activation, cfg.glu_linear_offset, cfg.activation_clamp)
        return cls(cfg.slots_per_rank, hidden_size, ffn_hidden_size, act, cfg.linear_bias,
                   INIT_STD if init_std is None else init_std, dtype=dtype, device=device,
                   kernel=cfg.expert_kernel)

    def weights(self) -> List[Optional[torch.Tensor]]:
        """[w1, w2, b1, b2] as this step computes with them: the parameters, or with a non-trivial placement the
        replica-synchronised slots plus this step's shadow copies (placement/runtime.py)."""
        if self.placement is None:
            return [self.w1, self.w2, self.b1, self.b2]
        if self.placement.trivial:
            return [self.w1, self.w2, self.b1, self.b2]
        return self.placement.expert_weights(self)

    def kernel_for(self, x: torch.Tensor, weights: Optional[List[Optional[torch.Tensor]]] = None) -> str:
        """'grouped_mm' or 'loop' for a call on x (experts/choice.py); ``weights`` as from ``weights()``."""
        w1, w2, b1, _ = weights if weights is not None else self.weights()
        return choose_kernel(self.kernel, x, w1, w2, self.activation, b1 is not None, self.cpu_lanes, self.cpu_gemm)

    def forward(self, x: torch.Tensor, tokens_per_expert: Union[torch.Tensor, Sequence[int]]) -> torch.Tensor:
        """x [N, H] sorted into contiguous groups of ``tokens_per_expert`` rows (host ints or a device tensor; rows
        after the last group come out as zeros). Zero tokens still go through the kernel: every parameter gets a
        (zero) gradient on every rank."""
        weights = self.weights()          # with a placement: replica-synchronised slots + shadows, built once
        kernel = self.kernel_for(x, weights)
        if kernel == "grouped_mm":
            counts = tokens_per_expert if torch.is_tensor(tokens_per_expert) else \
                torch.tensor(list(tokens_per_expert), dtype=torch.int64).to(x.device, non_blocking=True)
            try:
                return GroupedExpertMM.apply(x, *weights, offsets_from_counts(counts), self.activation)
            except RuntimeError as err:
                if self.kernel != "auto" or x.device.type != "cuda":
                    raise
                cuda_fallback(err, x)
                self.kernel = "loop"
        # the loop kernel slices groups on the host: device counts are read here (on CPU that is no device sync)
        counts = tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert) else list(tokens_per_expert)
        return GroupedExpertFFN.apply(x, *weights, counts, self.activation, self.cpu_lanes, self.cpu_gemm)

    # --- slot API: one expert = one index along dim 0 -------------------------------------------------------
    def expert_params(self) -> Dict[str, nn.Parameter]:
        return {n: p for n, p in self.named_parameters()}

    def expert_state(self, slot: int, optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[str, torch.Tensor]:
        """Copies of one expert's parameters and (if given) the optimizer state tensors shaped like them."""
        out = {n: p.detach()[slot].clone() for n, p in self.expert_params().items()}
        if optimizer is not None:
            for n, p in self.expert_params().items():
                for key, val in optimizer.state.get(p, {}).items():
                    if torch.is_tensor(val) and val.shape == p.shape:
                        out[f"{n}/{key}"] = val[slot].clone()
        return out

    @torch.no_grad()
    def load_expert_state(self, slot: int, state: Dict[str, torch.Tensor],
                          optimizer: Optional[torch.optim.Optimizer] = None) -> None:
        for n, p in self.expert_params().items():
            p[slot].copy_(state[n])
            if optimizer is not None:
                for key, val in optimizer.state.get(p, {}).items():
                    if torch.is_tensor(val) and val.shape == p.shape and f"{n}/{key}" in state:
                        val[slot].copy_(state[f"{n}/{key}"])
