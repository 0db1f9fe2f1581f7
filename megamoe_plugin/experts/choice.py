"""Which kernel computes the experts: ``--moe-expert-kernel {auto, grouped_mm, loop}``.

- ``grouped_mm`` (experts/grouped.py): torch's grouped GEMM, one kernel per product for every expert, the group
  offsets a device tensor. The GPU kernel of the field (torchtitan, Megatron's GroupedMLP / TE grouped linear).
- ``loop`` (experts/loop.py): one GEMM per expert, side by side on CPU lanes, oneDNN on CPU.
- ``auto``: whichever measured faster for the layer's shape. On CUDA both kernels run forward + backward once per
  process, card and expert shape on synthetic rows (the first call's row bucket, at most ``MAX_TIMING_ROWS_CUDA``),
  timed with CUDA events, and the loop must take at most ``LOOP_MARGIN_CUDA`` of the grouped GEMM's time to be
  chosen: the grouped GEMM is one launch per product and needs no host read of the group sizes, so it stays the
  choice wherever the two are close (measured on an H100 in bf16: the loop is 1.2-2.4x slower at 8-32 experts of
  H256-512 and 4-8k tokens, launch-bound, and 5-9% faster at 8 experts of H2048 F8192 and 16k tokens, where each
  expert's GEMM fills the card). A grouped GEMM that refuses the dtype or the card falls back to the loop with a
  warning. On CPU: both kernels run forward + backward on
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
from .grouped import GroupedExpertMM, available as grouped_mm_available, offsets_from_counts
from .loop import GroupedExpertFFN, lane_budget

KERNELS = ("auto", "grouped_mm", "loop")
GROUPED_MARGIN = 0.75         # grouped_mm is chosen on CPU only when it takes <= 0.75x the loop's time
TIMING_ROUNDS = 5             # best of this many interleaved runs each: a rank under a CPU quota (a CFS period of
                              # 10 ms, `megamoe cluster run --cpu-share`) is paused for part of some runs

MAX_TIMING_ROWS = 2048        # rows of the synthetic timing run: enough to load every expert, cheap under a quota
MAX_TIMING_ROWS_CUDA = 32768  # on a GPU: enough rows for large experts to fill the card, a few ms per pass
LOOP_MARGIN_CUDA = 0.95       # on CUDA the loop is chosen only when it takes <= 0.95x the grouped GEMM's time

_DECISIONS: Dict[Tuple, str] = {}


def _bucket(rows: int) -> int:
    return 1 << max(6, (max(rows, 1) - 1).bit_length())


def _time_both(E: int, H: int, F1: int, F: int, dtype: torch.dtype, activation: str, bias: bool, rows: int,
               lanes: int, cpu_gemm: str, device="cpu") -> List[Tuple[float, float]]:
    """Forward + backward seconds of (loop, grouped_mm) on synthetic rows split evenly over the experts. On CPU by
    the wall clock and by the process's CPU time: [(loop, grouped) wall, (loop, grouped) CPU] (a rank paused by its
    CPU quota loses wall time but no CPU time, so the two clocks disagree exactly when a pause skewed a run); on
    CUDA by CUDA events: [(loop, grouped)]."""
    device = torch.device(device)
    on_gpu = device.type == "cuda"
    g = torch.Generator(device=device).manual_seed(0)
    try:        # a dispatch mode of the caller (a memory meter, a profiler) does not see the synthetic run
        from torch.utils._python_dispatch import _disable_current_modes as hidden
    except ImportError:
        hidden = contextlib.nullcontext
    with hidden(), torch.inference_mode(False), torch.enable_grad():
        def rand(*shape, std):
            return (torch.randn(*shape, generator=g, device=device) * std).to(dtype).requires_grad_()
        x, w1, w2 = rand(rows, H, std=0.1), rand(E, H, F1, std=0.02), rand(E, F, H, std=0.02)
        b1 = torch.zeros(E, F1, dtype=dtype, device=device, requires_grad=True) if bias else None
        b2 = torch.zeros(E, H, dtype=dtype, device=device, requires_grad=True) if bias else None
        counts = [rows // E + (1 if e < rows % E else 0) for e in range(E)]
        offs = offsets_from_counts(torch.tensor(counts, device=device))
        dy = torch.ones(rows, H, dtype=dtype, device=device)
        runs = {
            "loop": lambda: GroupedExpertFFN.apply(x, w1, w2, b1, b2, counts, activation, lanes, cpu_gemm),
            "grouped_mm": lambda: GroupedExpertMM.apply(x, w1, w2, b1, b2, offs, activation),
        }
        for fn in runs.values():
            fn().backward(dy)                                  # warm-up: allocator, kernel selection
        wall = {name: float("inf") for name in runs}
        cpu = dict(wall)
        for _ in range(TIMING_ROUNDS):                         # interleaved: a pause hits one round, not one kernel
            for name, fn in runs.items():
                if on_gpu:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    fn().backward(dy)
                    end.record()
                    end.synchronize()
                    wall[name] = min(wall[name], start.elapsed_time(end) / 1e3)
                    continue
                t, c = time.perf_counter(), time.process_time()
                fn().backward(dy)
                wall[name] = min(wall[name], time.perf_counter() - t)
                cpu[name] = min(cpu[name], time.process_time() - c)
    if on_gpu:
        return [(wall["loop"], wall["grouped_mm"])]
    return [(wall["loop"], wall["grouped_mm"]), (cpu["loop"], cpu["grouped_mm"])]


def choose_kernel(requested: str, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, activation: str,
                  bias: bool, cpu_lanes: int = 0, cpu_gemm: str = "auto") -> str:
    """'grouped_mm' or 'loop' for a call of the experts on x (see the module docstring)."""
    if requested == "loop":
        return "loop"
    if not grouped_mm_available():
        if requested == "grouped_mm":
            raise RuntimeError(f"--moe-expert-kernel=grouped_mm: torch {torch.__version__} has no grouped GEMM "
                               f"(torch.nn.functional.grouped_mm); use --moe-expert-kernel=loop or auto")
        return "loop"
    if requested == "grouped_mm":
        return "grouped_mm"
    if x.device.type == "cuda":
        return _choose_on_cuda(x, w1, w2, activation, bias)
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


def _choose_on_cuda(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, activation: str, bias: bool) -> str:
    E, H, F1 = w1.shape
    key = ("cuda", torch.cuda.get_device_name(x.device), H, F1, w2.shape[1], x.dtype, activation, bias)
    if key not in _DECISIONS:
        try:
            rows = min(_bucket(x.shape[0]), MAX_TIMING_ROWS_CUDA)
            (loop_s, grouped_s), = _time_both(E, H, F1, w2.shape[1], x.dtype, activation, bias, rows, 0, "auto",
                                              x.device)
            _DECISIONS[key] = "loop" if loop_s <= LOOP_MARGIN_CUDA * grouped_s else "grouped_mm"
        except RuntimeError as err:   # the grouped GEMM refuses this dtype or card: the loop, said once
            cuda_fallback(err, x)
            _DECISIONS[key] = "loop"
    return _DECISIONS[key]


def cuda_fallback(err: Exception, x: torch.Tensor) -> None:
    """A CUDA grouped GEMM that refused the call under ``auto``: say so once; the caller uses the loop."""
    warn_once(f"--moe-expert-kernel=auto: torch's grouped GEMM refused {x.dtype} on "
              f"{torch.cuda.get_device_name(x.device) if torch.cuda.is_available() else x.device} ({err}); the "
              f"experts run one GEMM per expert (--moe-expert-kernel=loop) instead")


def decisions() -> Dict[Tuple, str]:
    """The choices measured so far in this process (shape key -> kernel), for reports and tests."""
    return dict(_DECISIONS)


def forget_decisions(key: Optional[Tuple] = None) -> None:
    if key is None:
        _DECISIONS.clear()
    else:
        _DECISIONS.pop(key, None)
