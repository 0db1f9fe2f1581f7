"""`megamoe bench layer --device cuda --dtype bf16`: the MoE layer on a GPU against megatron-core's experts.

Same inputs as the CPU benchmark (``bench.layer.make_inputs``), cast to the dtype and moved to the device.
Implementations, each forward + backward of the same layer function:
- ``ours dropless`` (``--moe-expert-kernel auto``: on CUDA whichever of the two timed faster) and ``ours
  dropless, loop kernel``;
- ``megatron-core SequentialMLP`` (the peer layer with our weights loaded, outputs checked against ours);
- ``megatron-core GroupedMLP`` and ``megatron-core TE grouped`` when their packages import (random init:
  timing only);
- ``grouped GEMM floor``: the three grouped products of the experts alone on pre-sorted rows.
Times are medians of interleaved rounds, each implementation timed between ``torch.cuda.synchronize`` calls.
TFLOP/s counts the expert GEMMs only (fc1 and fc2, forward and the two backward products each: 12 T k H F), as a
share of the card's dense bf16 peak when the card is known.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Optional

import torch

from ..experts import GroupedExpertMM, offsets_from_counts
from .ours import megatron_peer, ours
from .layer_inputs import CONFIGS, make_inputs, route
from .report import emit_report

DENSE_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0}   # vendor dense peaks


def card_peak(name: str) -> Optional[float]:
    for key, peak in DENSE_BF16_TFLOPS.items():
        if key in name:
            return peak
    return None


def _floor(x, wg, w1, w2, k, dtype, device):
    ids, _ = route(x, wg, k)
    counts = torch.bincount(ids.reshape(-1), minlength=w1.shape[0]).to(device)
    xs = x[torch.argsort(ids.reshape(-1), stable=True) // k].to(device=device, dtype=dtype).clone().requires_grad_()
    a, b = (t.detach().to(device=device, dtype=dtype).clone().requires_grad_() for t in (w1, w2))
    offs = offsets_from_counts(counts)
    grad = torch.ones_like(xs)

    def step():
        for p in (xs, a, b):
            p.grad = None
        GroupedExpertMM.apply(xs, a, b, None, None, offs, "gelu").backward(grad)
    return step


def time_synced(fns: Dict[str, Callable[[], None]], repeat: int) -> Dict[str, float]:
    for fn in fns.values():
        fn(); fn()
    torch.cuda.synchronize()
    times = {n: [] for n in fns}
    for _ in range(repeat):
        for n, fn in fns.items():
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times[n].append(time.perf_counter() - t)
    return {n: statistics.median(v) for n, v in times.items()}


def run_config(name: str, routing: str, repeat: int, dtype: torch.dtype, device) -> List[dict]:
    c = CONFIGS[name]
    H, F_, E, k, T = c["H"], c["F"], c["E"], c["k"], c["T"]
    x, wg, w1, w2 = make_inputs(H, F_, E, k, T, routing)
    impls, notes = {}, {}
    impls["ours dropless"], _, our_layer = ours(x, wg, w1, w2, k, kernel="auto", device=device, dtype=dtype)
    impls["ours dropless, loop kernel"], _, _ = ours(x, wg, w1, w2, k, kernel="loop", device=device, dtype=dtype)
    impls["grouped GEMM floor"] = _floor(x, wg, w1, w2, k, dtype, device)
    for label, kw in (("megatron-core SequentialMLP", {}), ("megatron-core GroupedMLP", {"grouped": True}),
                      ("megatron-core TE grouped", {"grouped": True, "te": True})):
        try:
            step, mlayer = megatron_peer(x, wg, w1, w2, k, device=device, dtype=dtype, **kw)
            if not kw:
                with torch.no_grad():
                    xd = x.to(device=device, dtype=dtype)
                    y_ours = our_layer(xd).float()
                    err = float((mlayer(xd.view(T, 1, H))[0].view(T, H).float() - y_ours).abs().max()
                                / y_ours.abs().max())
                notes[label] = f"output rel. diff vs ours {err:.1e}"
            impls[label] = step
        except Exception as e:              # a package that does not import, or a layout this version refuses
            notes[label] = f"skipped: {type(e).__name__}: {str(e)[:120]}"
    times = time_synced(impls, repeat)
    flops = 12.0 * T * k * H * F_
    peak = card_peak(torch.cuda.get_device_name(device))
    rows = []
    for n in list(impls) + [n for n in notes if n not in impls]:
        t = times.get(n, float("nan"))
        tf = flops / t / 1e12 if n in times else float("nan")
        rows.append(dict(config=name, routing=routing, impl=n, time=t, tflops=tf,
                         share=(tf / peak if peak else float("nan")), note=notes.get(n, "")))
    return rows


def format_table(rows: List[dict]) -> str:
    out = ["| config | routing | implementation | time (ms) | expert TFLOP/s | share of dense bf16 peak | "
           "SequentialMLP / this | note |", "|---|---|---|---:|---:|---:|---:|---|"]
    for cfg, routing in dict.fromkeys((r["config"], r["routing"]) for r in rows):
        group = [r for r in rows if r["config"] == cfg and r["routing"] == routing]
        seq = next((r["time"] for r in group if r["impl"] == "megatron-core SequentialMLP"), float("nan"))
        for r in group:
            out.append(f"| {cfg} | {routing} | {r['impl']} | {r['time'] * 1e3:.2f} | {r['tflops']:.1f} | "
                       f"{100 * r['share']:.0f}% | {seq / r['time']:.2f} | {r['note']} |")
    return "\n".join(out)


def targets(rows: List[dict]) -> List[str]:
    lines = []
    for cfg, routing in dict.fromkeys((r["config"], r["routing"]) for r in rows):
        g = {r["impl"]: r for r in rows if r["config"] == cfg and r["routing"] == routing}
        o = g["ours dropless"]["time"]
        parts = []
        seq = g.get("megatron-core SequentialMLP", {}).get("time", float("nan"))
        if seq == seq:
            parts.append(f"vs SequentialMLP {seq / o:.2f}x (>=1.2: {'met' if seq / o >= 1.2 else 'MISSED'})")
        for label in ("megatron-core GroupedMLP", "megatron-core TE grouped"):
            t = g.get(label, {}).get("time", float("nan"))
            if t == t:
                parts.append(f"vs {label} {t / o:.2f}x (>=0.9: {'met' if t / o >= 0.9 else 'MISSED'})")
        lines.append(f"config {cfg} {routing}: " + ("; ".join(parts) or "no megatron-core peer ran"))
    return lines


def main(configs: List[str], routings: List[str], repeat: int, dtype_name: str, output: Optional[str]) -> List[dict]:
    if not torch.cuda.is_available():
        raise SystemExit("megamoe bench layer --device cuda: no CUDA device is visible to this process")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    device = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for name in configs:
        for routing in routings:
            rows += run_config(name, routing, repeat, dtype, device)
    header = (f"{torch.cuda.get_device_name(device)}, {dtype_name}, median of {repeat} interleaved forward+backward "
              f"rounds, one process (torch {torch.__version__}, CUDA {torch.version.cuda}). Measured on a GPU.")
    emit_report([header, format_table(rows), "\n".join(targets(rows))], output)
    return rows
