"""Which kernel computes the experts: ``--moe-expert-kernel {auto, grouped_mm, loop}``.

- ``grouped_mm`` (experts/grouped.py): torch's grouped GEMM, one kernel per product for every expert, the group
  offsets a device tensor. The GPU kernel of the field (torchtitan, Megatron's GroupedMLP / TE grouped linear).
- ``loop`` (experts/loop.py): one GEMM per expert, side by side on CPU lanes, oneDNN on CPU.
- ``auto``: grouped_mm on CUDA (falling back to the loop, with a warning, if this torch's kernel refuses the dtype
  or the card); on CPU whichever measured faster for the layer's shape: both kernels run forward + backward on
  synthetic rows once per process and per expert shape (hidden and FFN sizes, activation, bias, dtype, thread
  budget), with the first call's expert count and row count (at most ``MAX_TIMING_ROWS``), and the grouped GEMM
  must beat the loop by ``GROUPED_MARGIN`` to be chosen, on the wall clock and on the process's CPU time alike,
  each the best of ``TIMING_ROUNDS`` interleaved runs. The expert count and the row count are not part of the
  decision's key: placement and shadowing change both from step to step, and measuring again after each change
  cost a capped rank seconds per layer (12 forward + backward passes on up to 4x the rank's rows), which the
  pay-off guard then charged to the change. The choice must not flip from one process to the next (a resumed run
  computes with the kernel of the run it resumes, and two runs of one seed must agree); under a CPU quota
  (fixed-speed ranks) the wall clock alone flips it, and runs of one seed diverge. Measured on this project's
  2-core machines the loop is 1.06-1.5x faster than the grouped GEMM on CPU at every expert count (4-64) and row
  count (256-8,192) tried, far from the margin, so CPU runs keep it.
"""
from __future__ import annotations

import contextlib
import time
from typing import Dict, List, Optional, Tuple

import torch

from ..notices import warn_once
from . import grouped
from .loop import GroupedExpertFFN, lane_budget

KERNELS = ("auto", "grouped_mm", "loop")
GROUPED_MARGIN = 0.75         # grouped_mm is chosen on CPU only when it takes <= 0.75x the loop's time
TIMING_ROUNDS = 5             # best of this many interleaved runs each: a rank under a CPU quota (a CFS period of
                              # 10 ms, `megamoe cluster run --cpu-share`) is paused for part of some runs

MAX_TIMING_ROWS = 2048        # rows of the synthetic timing run: enough to load every expert, cheap under a quota

_DECISIONS: Dict[Tuple, str] = {}


def _bucket(rows: int) -> int:
    return 1 << max(6, (max(rows, 1) - 1).bit_length())


def _time_both(E: int, H: int, F1: int, F: int, dtype: torch.dtype, activation: str, bias: bool, rows: int,
               lanes: int, cpu_gemm: str) -> List[Tuple[float, float]]:
    """Forward + backward seconds of (loop, grouped_mm) on synthetic rows split evenly over the experts, by the
    wall clock and by the process's CPU time: [(loop, grouped) wall, (loop, grouped) CPU]. A rank paused by its
    CPU quota loses wall time but no CPU time, so the two clocks disagree exactly when a pause skewed a run."""
    g = torch.Generator().manual_seed(0)
    try:        # a dispatch mode of the caller (a memory meter, a profiler) does not see the synthetic run
        from torch.utils._python_dispatch import _disable_current_modes as hidden
    except ImportError:
        hidden = contextlib.nullcontext
    with hidden(), torch.inference_mode(False), torch.enable_grad():
        x = (torch.randn(rows, H, generator=g) * 0.1).to(dtype).requires_grad_()
        w1 = (torch.randn(E, H, F1, generator=g) * 0.02).to(dtype).requires_grad_()
        w2 = (torch.randn(E, F, H, generator=g) * 0.02).to(dtype).requires_grad_()
        b1 = torch.zeros(E, F1, dtype=dtype, requires_grad=True) if bias else None
        b2 = torch.zeros(E, H, dtype=dtype, requires_grad=True) if bias else None
        counts = [rows // E + (1 if e < rows % E else 0) for e in range(E)]
        offs = grouped.offsets_from_counts(torch.tensor(counts))
        dy = torch.ones(rows, H, dtype=dtype)
        runs = {
            "loop": lambda: GroupedExpertFFN.apply(x, w1, w2, b1, b2, counts, activation, lanes, cpu_gemm),
            "grouped_mm": lambda: grouped.GroupedExpertMM.apply(x, w1, w2, b1, b2, offs, activation),
        }
        for fn in runs.values():
            fn().backward(dy)                                  # warm-up: allocator, kernel selection
        wall = {name: float("inf") for name in runs}
        cpu = dict(wall)
        for _ in range(TIMING_ROUNDS):                         # interleaved: a pause hits one round, not one kernel
            for name, fn in runs.items():
                t, c = time.perf_counter(), time.process_time()
                fn().backward(dy)
                wall[name] = min(wall[name], time.perf_counter() - t)
                cpu[name] = min(cpu[name], time.process_time() - c)
    return [(wall["loop"], wall["grouped_mm"]), (cpu["loop"], cpu["grouped_mm"])]


def choose_kernel(requested: str, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, activation: str,
                  bias: bool, cpu_lanes: int = 0, cpu_gemm: str = "auto") -> str:
    """'grouped_mm' or 'loop' for a call of the experts on x (see the module docstring)."""
    if requested == "loop":
        return "loop"
    if not grouped.available():
        if requested == "grouped_mm":
            raise RuntimeError(f"--moe-expert-kernel=grouped_mm: torch {torch.__version__} has no grouped GEMM "
                               f"(torch.nn.functional.grouped_mm); use --moe-expert-kernel=loop or auto")
        return "loop"
    if requested == "grouped_mm":
        return "grouped_mm"
    if x.device.type == "cuda":
        return "grouped_mm"
    if x.device.type != "cpu":
        return "loop"
    E, H, F1 = w1.shape
    key = (H, F1, w2.shape[1], x.dtype, activation, bias, torch.get_num_threads(), lane_budget(), cpu_lanes,
           cpu_gemm)
    if key not in _DECISIONS:
        try:
            rows = min(_bucket(x.shape[0]), MAX_TIMING_ROWS)
            clocks = _time_both(E, H, F1, w2.shape[1], x.dtype, activation, bias, rows, cpu_lanes, cpu_gemm)
            wins = all(grouped_s <= GROUPED_MARGIN * loop_s for loop_s, grouped_s in clocks)
            _DECISIONS[key] = "grouped_mm" if wins else "loop"
        except RuntimeError:          # this torch's CPU grouped GEMM refuses the dtype or shape
            _DECISIONS[key] = "loop"
    return _DECISIONS[key]


def cuda_fallback(err: Exception, x: torch.Tensor) -> None:
    """A CUDA grouped GEMM that refused the call under ``auto``: say so once; the caller uses the loop."""
    warn_once(f"--moe-expert-kernel=auto: torch's grouped GEMM refused {x.dtype} on "
              f"{torch.cuda.get_device_name(x.device) if torch.cuda.is_available() else x.device} ({err}); the "
              f"experts run one GEMM per expert (--moe-expert-kernel=loop) instead")


def decisions() -> Dict[Tuple, str]:
    """The CPU choices measured so far in this process (shape key -> kernel), for reports and tests."""
    return dict(_DECISIONS)


def forget_decisions(key: Optional[Tuple] = None) -> None:
    if key is None:
        _DECISIONS.clear()
    else:
        _DECISIONS.pop(key, None)
