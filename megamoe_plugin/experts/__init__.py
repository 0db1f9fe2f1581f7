"""The experts of one rank: ``ExpertBank`` (bank.py) and the kernels that compute them.

- bank.py: the stacked expert weights, the slot API placement uses, the kernel dispatch.
- choice.py: ``--moe-expert-kernel`` auto / grouped_mm / loop.
- grouped.py: the grouped-GEMM kernel (GPU path; device-side group offsets, bf16 alignment on CPU).
- loop.py: one GEMM per expert (CPU path: lanes, oneDNN), also used chunk by chunk by the smart schedule.
"""
from .bank import ExpertBank, check_input_dtype
from .choice import KERNELS, choose_kernel
from .grouped import GroupedExpertMM, grouped_experts, offsets_from_counts
from .loop import (GroupedExpertFFN, _act_into, _bounds, _lanes_for, _mm_into, _run_groups, _use_onednn,
                   expert_backward, expert_forward, lane_budget, onednn_available)

__all__ = ["ExpertBank", "check_input_dtype", "KERNELS", "choose_kernel", "GroupedExpertMM", "grouped_experts",
           "offsets_from_counts", "GroupedExpertFFN", "expert_forward", "expert_backward", "lane_budget",
           "onednn_available", "_act_into", "_bounds", "_lanes_for", "_mm_into", "_run_groups", "_use_onednn"]
