"""Calibration: measure this machine's GEMM throughput and communication, fit the cost model, check its accuracy.

FasterMoE (paper 003 §3.1-3.2, §5.3 Fig. 9) and FlexMoE (paper 001 §3.4, Fig. 6c) drive their policies with a cost
model whose parameters are profiled on the hardware. ``calibrate(group)`` runs on every rank of a real process
group (gloo on CPU, NCCL on GPU) and:

1. **GEMM throughput** ``P``: forward+backward of one expert FFN (``ExpertBank``) on several token counts; a least
   squares fit of ``t = t0 + 12*B*H*F / P`` (3 GEMM rounds of 4*B*H*F FLOPs: Eq. 1 with backward = 2x forward).
2. **Point-to-point** per topology level: ``Topology.measure`` (ping-pong, alpha and bandwidth per level).
3. **All-to-all**: uniform ``all_to_all_single`` of several sizes, fit ``t = alpha + (P-1)*S / W`` -- the
   per-rank link bandwidth W the all-to-all actually reaches (on one host: shared memory through gloo).
4. **Fixed cost** of one MoE layer call (gate, sort, count exchange, Python): the measured time of a tiny layer.

The fitted numbers become a ``HardwareProfile`` ("measured here", savable as JSON and usable everywhere a named
profile is). ``validate`` then runs real ``MoELayer`` forward+backward steps for a set of layer configurations
(hidden size, FFN width, experts, tokens, routing skew), predicts each from its actual routing counts with
``CostModel.layer_time`` + the fixed cost, and reports R^2, mean relative error and whether the predictions order
the configurations as the measurements do (pairwise concordance).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..config import MoEConfig
from ..experts import ExpertBank
from ..layer import MoELayer
from ..topology import Topology
from .cost import LayerShape
from .network import Network
from .profiles import HardwareProfile
from ..launch import run_processes


# --- timing helpers -------------------------------------------------------------------------------------------------
def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, iters: int, warmup: int, device, group=None) -> float:
    """Median over `iters` of the slowest rank's time of fn() (collective when a group is given)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if group is not None:
            dist.barrier(group=group)
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        if group is not None:
            dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)
        times.append(float(dt))
    return statistics.median(times)


def _fit_line(xs: Sequence[float], ys: Sequence[float]):
    """Least squares y = a + b*x; returns (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    return my - b * mx, b


# --- micro-benchmarks -------------------------------------------------------------------------------------------------
def measure_gemm(hidden: int = 256, ffn: int = 1024, tokens: Sequence[int] = (256, 1024, 2048, 4096),
                 iters: int = 5, device=None, dtype=torch.float32, group=None) -> Dict[str, float]:
    """Expert FFN forward+backward: fitted FLOP/s (P) and per-call overhead t0. With ``group`` (collective) every
    rank computes at the same time and the slowest rank's time counts: the rate each rank really gets when the
    ranks share the machine's cores, as they do in a training step."""
    device = torch.device(device or "cpu")
    bank = ExpertBank(1, hidden, ffn, "gelu", device=device, dtype=dtype)
    xs, ys = [], []
    for B in tokens:
        x = torch.randn(B, hidden, device=device, dtype=dtype, requires_grad=True)

        def step():
            bank(x, [B]).sum().backward()
        t = _timed(step, iters, 2, device, group)
        xs.append(12.0 * B * hidden * ffn)
        ys.append(t)
    t0, inv_p = _fit_line(xs, ys)
    flops = 1.0 / inv_p if inv_p > 0 else max(x / y for x, y in zip(xs, ys))
    return {"flops": flops, "overhead_s": max(t0, 0.0), "points": list(zip(tokens, ys))}


def measure_alltoall(group=None, sizes: Sequence[int] = (1 << 14, 1 << 17, 1 << 19, 1 << 21), iters: int = 5,
                     device=None) -> Dict[str, float]:
    """Uniform all-to-all of `size` bytes per pair: fitted latency alpha and per-rank link bandwidth W."""
    device = torch.device(device or "cpu")
    P = dist.get_world_size(group)
    xs, ys = [], []
    for size in sizes:
        n = max(size // 4, 1)
        inp = torch.randn(P * n, device=device)
        out = torch.empty_like(inp)
        t = _timed(lambda: dist.all_to_all_single(out, inp, group=group), iters, 2, device, group)
        xs.append(float((P - 1) * n * 4))
        ys.append(t)
    alpha, inv_w = _fit_line(xs, ys)
    bandwidth = 1.0 / inv_w if inv_w > 0 else max(x / y for x, y in zip(xs, ys))
    return {"alpha_s": max(alpha, 0.0), "bandwidth": bandwidth, "points": list(zip(sizes, ys))}


# --- layer measurements -------------------------------------------------------------------------------------------
@dataclass
class LayerCase:
    hidden: int
    ffn: int
    experts: int
    tokens: int            # per rank
    skew: float = 0.0      # 0 = random routing; larger = more tokens to expert 0
    top_k: int = 2

    def label(self) -> str:
        return f"H{self.hidden} F{self.ffn} E{self.experts} T{self.tokens} k{self.top_k} skew{self.skew:g}"


DEFAULT_CASES = (
    LayerCase(128, 512, 4, 256), LayerCase(128, 512, 4, 1024), LayerCase(256, 1024, 4, 512),
    LayerCase(256, 1024, 8, 1024), LayerCase(256, 1024, 4, 1024, skew=3.0), LayerCase(512, 1024, 8, 2048),
)


def build_layer_case(case: LayerCase, group=None, device=None, seed: int = 0):
    """(a real MoELayer with EP = the group, this rank's input [tokens, hidden] with requires_grad) for ``case``;
    with ``skew`` a shared input direction that expert 0's gate row likes sends more tokens to expert 0."""
    device = torch.device(device or "cpu")
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    cfg = MoEConfig(num_experts=case.experts, top_k=case.top_k, gate="naive", expert_parallel_size=P,
                    world_size=P, aux_loss_coeff=0.0)
    torch.manual_seed(seed)
    layer = MoELayer(cfg, case.hidden, case.ffn, ep_group=group if group is not None else dist.group.WORLD,
                     device=device)
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(case.tokens, case.hidden, generator=gen).to(device)
    if case.skew:
        with torch.no_grad():             # a shared direction that expert 0's gate row likes
            direction = torch.ones(case.hidden, device=device) / math.sqrt(case.hidden)
            x += case.skew * direction
            layer.gate.weight[0] += direction * case.skew
    return layer, x.requires_grad_(True)


def measure_layer(case: LayerCase, group=None, iters: int = 5, device=None, seed: int = 0):
    """Median forward+backward time of a real MoELayer (EP = the group) and its routing counts [P, E]."""
    device = torch.device(device or "cpu")
    P = dist.get_world_size(group)
    layer, x = build_layer_case(case, group, device, seed)

    def step():
        layer(x).sum().backward()
    t = _timed(step, iters, 2, device, group)
    counts = layer.last_routing.counts.detach().to(device)
    parts = [torch.empty_like(counts) for _ in range(P)]
    dist.all_gather(parts, counts, group=group)
    return t, torch.stack(parts).cpu()


# --- fitting --------------------------------------------------------------------------------------------------------
@dataclass
class Calibration:
    profile: HardwareProfile
    gemm: dict
    alltoall: dict
    topology: Topology
    layer_overhead_s: float
    cases: List[dict] = field(default_factory=list)       # label, measured, predicted, breakdown
    r2: float = float("nan")
    mean_rel_error: float = float("nan")
    concordance: float = float("nan")                      # fraction of config pairs ordered alike

    def network(self) -> Network:
        return self.profile.network()

    def report(self) -> str:
        p = self.profile
        lines = [f"calibrated profile {p.name!r} ({p.nodes} node(s) x {p.gpus_per_node} rank(s)), measured here:",
                 f"  GEMM (expert FFN fwd+bwd): {p.gemm_tflops * 1e3:.1f} GFLOP/s per rank, call overhead "
                 f"{self.gemm['overhead_s'] * 1e6:.0f} us"
                 + (f"; the ranks share {p.shared_gemm_tflops * 1e3:.1f} GFLOP/s in all (one machine's cores)"
                    if p.shared_gemm_tflops else ""),
                 f"  all-to-all: {self.alltoall['bandwidth'] / 1e9:.2f} GB/s per rank link, alpha "
                 f"{self.alltoall['alpha_s'] * 1e6:.0f} us",
                 f"  point-to-point per level (GB/s): {[round(b, 3) for b in self.topology.bandwidth_gbps]}, "
                 f"latency (us): {[round(a, 1) for a in self.topology.latency_us]}",
                 f"  fixed cost of one MoE layer step: {self.layer_overhead_s * 1e3:.2f} ms"]
        if self.cases:
            lines.append(f"  {'layer config':<40} {'measured ms':>12} {'predicted ms':>13} {'rel err':>8}")
            for c in self.cases:
                lines.append(f"  {c['label']:<40} {c['measured'] * 1e3:>12.2f} {c['predicted'] * 1e3:>13.2f} "
                             f"{(c['predicted'] - c['measured']) / c['measured']:>+8.1%}")
            lines.append(f"  R^2 = {self.r2:.3f}, mean relative error = {self.mean_rel_error:.1%}, pairwise order "
                         f"agreement = {self.concordance:.0%} ({len(self.cases)} configurations)")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"profile": self.profile.to_dict(), "layer_overhead_s": self.layer_overhead_s, "cases": self.cases,
                "r2": self.r2, "mean_rel_error": self.mean_rel_error, "concordance": self.concordance,
                "gemm": {k: v for k, v in self.gemm.items() if k != "points"},
                "alltoall": {k: v for k, v in self.alltoall.items() if k != "points"}}


def calibrate(group=None, name: str = "measured-local", quick: bool = False, device=None) -> Calibration:
    """Collective: run the micro-benchmarks on every rank of `group` and fit a HardwareProfile."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    P = dist.get_world_size(group)
    iters = 3 if quick else 5
    sizes = (256, 1024, 2048) if quick else (256, 1024, 2048, 4096)
    gemm = measure_gemm(tokens=sizes, iters=iters, device=device, group=group)      # every rank at once
    solo = torch.tensor([gemm["flops"]], dtype=torch.float64)
    if dist.get_rank(group) == 0 and P > 1 and device.type == "cpu":            # rank 0 alone, the others idle
        solo[0] = measure_gemm(tokens=sizes, iters=iters, device=device)["flops"]
    dist.broadcast(solo, dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    gemm["solo_flops"] = float(solo)
    shared = 0.0
    if gemm["solo_flops"] > 1.25 * gemm["flops"]:
        # the ranks slow each other down (CPU ranks sharing one machine's cores): a rank alone is faster, and
        # together they share a pool; the model takes the larger of the busiest rank alone and the pool's total
        shared, gemm["flops"] = gemm["flops"] * P, gemm["solo_flops"]
    a2a = measure_alltoall(group, iters=iters, device=device)
    topo = Topology.from_env(world_size=P).measure(group, iters=iters)
    local = topo.ranks_per_node()
    tiny = LayerCase(64, 64, P, 16, top_k=1)
    overhead, _ = measure_layer(tiny, group, iters=iters, device=device)
    if topo.depth >= 2 and P > local:
        # several nodes (a torchrun job over hosts, or megamoe cluster run): each level from its own ping-pong;
        # the uniform all-to-all mixes both levels, so it gives only the latency of one exchange
        intra_gbps, intra_us = topo.bandwidth_gbps[0], topo.latency_us[0]
        source = ("measured here: expert-FFN GEMM fit (all ranks computing at once), ping-pong per topology level "
                  "(intra-node link, per-node network link), all-to-all latency")
    else:
        intra_gbps, intra_us = a2a["bandwidth"] / 1e9, a2a["alpha_s"] * 1e6
        source = ("measured here: expert-FFN GEMM fit (all ranks computing at once), all-to-all fit (per-rank link "
                  "bandwidth and alpha), ping-pong per topology level")
    profile = HardwareProfile(
        name=name, description=f"this machine: {P} rank(s) on {device.type}, fitted by megamoe perf calibrate",
        source=source, nodes=max(P // local, 1), gpus_per_node=local, gemm_tflops=gemm["flops"] / 1e12,
        intra="switch", intra_bandwidth_gbps=intra_gbps, ring_bandwidths_gbps=None,
        nic_bandwidth_gbps=topo.bandwidth_gbps[-1], intra_latency_us=intra_us, nic_latency_us=topo.latency_us[-1],
        bytes_per_element=4, shared_gemm_tflops=shared / 1e12)
    return Calibration(profile, gemm, a2a, topo, overhead)


def predict_layer(cal: Calibration, case: LayerCase, counts: torch.Tensor):
    """Predicted forward+backward time of one layer step with routing `counts` [P, E] and its breakdown."""
    shape = LayerShape(hidden=case.hidden, ffn=case.ffn, num_experts=case.experts,
                       bytes_per_element=cal.profile.bytes_per_element)
    model = cal.profile.cost_model(shape, world_size=counts.shape[0])
    b = model.layer_time(counts)
    return cal.layer_overhead_s + b.total, b


def validate(cal: Calibration, group=None, cases: Sequence[LayerCase] = DEFAULT_CASES, iters: int = 5,
             device=None) -> Calibration:
    """Collective: measure `cases` on the real layer and compare with the calibrated model's predictions."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cal.cases = []
    for i, case in enumerate(cases):
        measured, counts = measure_layer(case, group, iters=iters, device=device, seed=i + 1)
        predicted, b = predict_layer(cal, case, counts)
        cal.cases.append({"label": case.label(), "measured": measured, "predicted": predicted,
                          "breakdown": b.as_dict()})
    cal.r2, cal.mean_rel_error, cal.concordance = accuracy([c["measured"] for c in cal.cases],
                                                           [c["predicted"] for c in cal.cases])
    return cal


def accuracy(measured: Sequence[float], predicted: Sequence[float]):
    """(R^2 of predicted vs measured, mean relative error, fraction of pairs ordered alike)."""
    m, p = list(measured), list(predicted)
    mean = sum(m) / len(m)
    ss_tot = sum((x - mean) ** 2 for x in m)
    ss_res = sum((x - y) ** 2 for x, y in zip(m, p))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan")
    mre = sum(abs(y - x) / x for x, y in zip(m, p)) / len(m)
    pairs = [(i, j) for i in range(len(m)) for j in range(i + 1, len(m)) if m[i] != m[j]]
    agree = sum(1 for i, j in pairs if (m[i] < m[j]) == (p[i] < p[j]))
    return r2, mre, (agree / len(pairs) if pairs else float("nan"))


# --- entry point: `megamoe perf calibrate` ----------------------------------------------------------------------------
def _worker(rank: int, world: int, out: Optional[str], quick: bool, result_file: str) -> None:
    import json
    cal = validate(calibrate(quick=quick), iters=3 if quick else 5,
                   cases=DEFAULT_CASES[:4] if quick else DEFAULT_CASES)
    if rank == 0:
        if out:
            cal.profile.save(out)
        with open(result_file, "w") as f:
            json.dump({"report": cal.report(), **cal.to_dict()}, f)


def run_calibration(nproc: int = 2, out: Optional[str] = None, quick: bool = False) -> dict:
    """Spawn `nproc` gloo processes on this machine, calibrate and validate; returns rank 0's results
    (``report`` text, fitted ``profile`` dict, per-case predictions, ``r2``, ``mean_rel_error``, ``concordance``).
    Under torchrun (GPU/NCCL or several hosts) call ``calibrate`` and ``validate`` on every rank instead."""
    import json
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        result = os.path.join(d, "result.json")
        run_processes(_worker, nproc, out, quick, result, threads=max(1, (os.cpu_count() or 1) // nproc),
                      label="perf calibrate")
        with open(result) as f:
            return json.load(f)


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="megamoe perf calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="gloo processes to spawn on this machine (default 2); "
                   "under torchrun the job's own ranks are used instead (NCCL when CUDA is available)")
    p.add_argument("--out", default=None, help="write the fitted HardwareProfile here (JSON; usable as --profile)")
    p.add_argument("--quick", action="store_true", help="fewer sizes, iterations and layer configurations")
    args = p.parse_args(argv)
    import os
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:      # under torchrun: this job's ranks, NCCL on GPUs
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
        try:
            cal = validate(calibrate(quick=args.quick), iters=3 if args.quick else 5,
                           cases=DEFAULT_CASES[:4] if args.quick else DEFAULT_CASES)
            if dist.get_rank() == 0:
                if args.out:
                    cal.profile.save(args.out)
                print(cal.report())
        finally:
            dist.destroy_process_group()
        return 0
    res = run_calibration(args.nproc, args.out, args.quick)
    print(res["report"])
    if args.out:
        print(f"profile written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
