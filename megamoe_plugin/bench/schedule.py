"""`megamoe bench schedule`: plain vs smart schedule (FasterMoE paper 003 §4.2), measured and predicted.

One MoE layer with expert parallelism over P processes (default: 2 gloo processes spawned on this machine; under
``torchrun --nproc_per_node P -m megamoe_plugin.bench.schedule ...`` it uses the launcher's processes instead,
NCCL when CUDA is there). Two layers with the SAME weights and inputs: ``--moe-schedule plain`` (all-to-all,
experts, all-to-all) and ``--moe-schedule smart:n`` (pipelined grouped pairwise exchange;
default n = P, one group per process: on one machine the topology has a single node, which would give one group
and nothing to overlap). Before timing, one forward checks that both give the same output (max |diff| printed).

Measured: forward+backward wall time of each (the slowest rank's, per round), median over ``--iters`` rounds
after ``--warmup``; every round runs every layer (a shared machine's slow phases hit all alike). The ratio is
plain / smart (> 1: smart faster). A third layer runs the smart code path with ONE group (``--moe-schedule smart:1``:
one exchange, compute, one return, nothing to overlap): plain / that ratio separates what the implementation
itself costs or saves (point-to-point instead of all_to_all_single, chunk bookkeeping) from the overlap.

Predicted, two ways, both with ``perfmodel.schedule.predict_schedule_times`` (Fig. 8a plain = sum of all S, C, R;
Fig. 8b smart = communication stream S_0..S_{n-1}, R_0..R_{n-1} and computation stream C_0..C_{n-1}):

- ``components``: this run's own parts, measured in isolation on the real routing: every step's exchange S_j and
  return R_j (the smart path's own point-to-point posts for that step alone) and its expert computation C_j
  (forward, and backward for the backward phase), each the slowest rank's median; and the plain path's row
  regrouping ([source][expert] <-> [expert][source], two gathers forward and two index_add_ backward over all
  received rows), which the smart path does only inside chunks that hold several sources (none when every group
  is one rank). Everything else of the layer (gate, sort, count exchange, combine) is taken as the measured plain
  time minus the modelled plain parts and added to both, so the predicted plain time equals the measured one.
- ``perfmodel``: ``perfmodel.calibrate.calibrate(quick=True)`` fits a HardwareProfile on these processes (GEMM
  FLOP/s, all-to-all bandwidth, fixed layer cost); ``predict_layer_schedule`` derives the per-step times from the
  gathered routing counts [P, E] with its ``CostModel`` (``Network.alltoallv_time`` of each step's pair traffic,
  Eq.1 per chunk). ``--no-calibrate`` skips it. ``--profile NAME[,NAME]`` also prints what the model predicts for
  the same routing on the papers' clusters (perfmodel.profiles).

On a CPU host the "communication stream" is gloo's background threads sharing the cores with the GEMMs, so the
overlap the model assumes is only partly there; the table shows how much.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from typing import List, Optional

import torch
import torch.distributed as dist

from ..parallel import comm_device

CONFIGS = {
    "comm": dict(H=1024, F=256, E=8, k=2, T=2048),      # little compute per byte moved
    "balanced": dict(H=512, F=512, E=8, k=2, T=2048),
    "compute": dict(H=512, F=2048, E=8, k=2, T=2048),
    "tiny": dict(H=32, F=64, E=4, k=2, T=64),
}


def _inputs(H, E, k, T, routing, rank, device):
    """Shared router weight; this rank's tokens = noise + decreasing multiples of their preferred experts' router
    directions (preferences uniform, or Zipf(1.2) popularity for skewed), so the router sends them there."""
    g = torch.Generator().manual_seed(0)
    wg = torch.randn(E, H, generator=g) / math.sqrt(H)
    unit = wg / wg.norm(dim=1, keepdim=True) * math.sqrt(H)
    g = torch.Generator().manual_seed(100 + rank)
    pop = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** (1.2 if routing == "skewed" else 0.0)
    pref = torch.multinomial((pop / pop.sum()).expand(T, E), k, replacement=False, generator=g)
    x = torch.randn(T, H, generator=g)
    for j in range(k):
        x = x + (4.0 - j) * unit[pref[:, j]]
    return x.to(device), wg.to(device)


def _timed(fn, iters, warmup, group, device) -> float:
    """Median over `iters` of the slowest rank's time of fn()."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        times.append(_round(fn, group, device))
    return statistics.median(times)


def _round(fn, group, device) -> float:
    dist.barrier(group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)
    return float(dt)


def _components(smart_layer, routing, H, group, device, iters):
    """Per-step S_j, R_j (exchange alone) and C_j forward/backward (experts alone), the slowest rank's medians."""
    from ..dispatch.smart import post_dispatch_step, post_return_step
    from ..experts import _bounds, _lanes_for, _use_onednn, expert_backward, expert_forward

    disp, bank = smart_layer.plan.smart, smart_layer.experts
    _, n_rows, call = disp.plan(routing, device)
    send = torch.randn(n_rows, H, device=device)
    recv = send.new_empty(call.recv_total, H)
    back = torch.empty_like(send)
    onednn = _use_onednn(send, bank.cpu_gemm)
    S, R, Cf, Cb = [], [], [], []
    with torch.no_grad():
        for j in range(call.n):
            c = call.chunks[call.source(j)]
            out = torch.randn(c.end - c.start, H, device=device)

            def s_step():
                got, sent = post_dispatch_step(call, send, recv, j)
                for w in got + sent:
                    w.wait()

            def r_step():
                got, sent = post_return_step(call, out, back, j)
                for w in got + sent:
                    w.wait()

            groups = _bounds(c.counts)
            x = torch.randn(c.end - c.start, H, device=device)
            lanes = _lanes_for(x, groups, bank.w1, bank.cpu_lanes)
            fwd = lambda: expert_forward(x, bank.w1, bank.w2, bank.b1, bank.b2, groups, bank.activation, lanes,
                                         onednn)
            _, h, a = fwd()
            g1, g2 = torch.empty_like(bank.w1), torch.empty_like(bank.w2)
            bwd = lambda: expert_backward(out, x, h, a, bank.w1, bank.w2, groups, bank.activation, lanes, onednn,
                                          g1, g2)
            S.append(_timed(s_step, iters, 1, group, device))
            R.append(_timed(r_step, iters, 1, group, device))
            Cf.append(_timed(fwd, iters, 1, group, device))
            Cb.append(_timed(bwd, iters, 1, group, device))
        # the plain path's [source][expert] <-> [expert][source] row regrouping of everything received: two
        # gathers forward, two index_add_ backward; the smart path does it only inside chunks of several sources
        perm = torch.randperm(call.recv_total, device=device)
        buf = torch.randn(call.recv_total, H, device=device)

        def regroup():
            y = buf.index_select(0, perm).index_select(0, perm)
            torch.zeros_like(buf).index_add_(0, perm, torch.zeros_like(buf).index_add_(0, perm, y))
        regroup_time = _timed(regroup, iters, 1, group, device)
    rows = sum(c.end - c.start for c in call.chunks if c.regroup is not None)
    return S, R, Cf, Cb, regroup_time, rows / max(call.recv_total, 1)


def run(args, group=None) -> Optional[dict]:
    """Collective over `group` (every rank calls it); rank 0 returns the results, the others None."""
    from ..config import MoEConfig
    from ..layer import MoELayer
    from ..perfmodel.schedule import predict_layer_schedule, predict_schedule_times, speedup_upper_bound

    group = group if group is not None else dist.group.WORLD
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    device = comm_device(group)
    c = CONFIGS[args.config]
    H, F_, E, k, T = c["H"], c["F"], c["E"], c["k"], c["T"]
    if E % P:
        E = P * max(1, E // P)
    n = args.groups or P
    cfg = MoEConfig(num_experts=E, top_k=k, gate="naive", expert_parallel_size=P, world_size=P, aux_loss_coeff=0.0)
    torch.manual_seed(1000 + rank)                       # each rank its own experts
    plain = MoELayer(cfg, H, F_, ep_group=group, device=device)
    smart = MoELayer(cfg.replace(schedule=f"smart:{n}"), H, F_, ep_group=group, device=device)
    single = MoELayer(cfg.replace(schedule="smart:1"), H, F_, ep_group=group, device=device)
    x, wg = _inputs(H, E, k, T, args.routing, rank, device)
    with torch.no_grad():
        plain.gate.weight.copy_(wg)
    smart.load_state_dict(plain.state_dict())
    single.load_state_dict(plain.state_dict())
    with torch.no_grad():
        diff = float((plain(x) - smart(x)).abs().max())
    routing = smart.last_routing
    counts = routing.counts.to(device)
    parts = [torch.empty_like(counts) for _ in range(P)]
    dist.all_gather(parts, counts, group=group)
    counts = torch.stack(parts).cpu()

    xin = x.clone().requires_grad_()
    grad = torch.ones_like(x)

    def step(layer):
        def fn():
            for p in layer.parameters():
                p.grad = None
            xin.grad = None
            layer(xin).backward(grad)
        return fn

    steps = {"plain": step(plain), "smart": step(smart), "single": step(single)}
    for _ in range(args.warmup):
        for fn in steps.values():
            fn()
    times = {name: [] for name in steps}
    for i in range(args.iters):
        for name in (list(steps) if i % 2 == 0 else list(steps)[::-1]):
            times[name].append(_round(steps[name], group, device))
    measured = {name: statistics.median(ts) for name, ts in times.items()}

    S, R, Cf, Cb, regroup, regroup_frac = _components(smart, routing, H, group, device, max(3, args.iters // 2))
    pf, sf = predict_schedule_times(S, Cf, R)
    pb, sb = predict_schedule_times(S, Cb, R)
    other = measured["plain"] - (pf + pb) - regroup
    note = ""
    if other < 0:
        note = "isolated components sum to more than the plain step; rest of the layer taken as 0"
        other = 0.0
    comp_pred = {"plain": other + pf + pb + regroup, "smart": other + sf + sb + regroup_frac * regroup}

    perf = None
    if not args.no_calibrate:
        from ..perfmodel.calibrate import calibrate
        from ..perfmodel.cost import LayerShape
        cal = calibrate(group, quick=True, device=device)
        shape = LayerShape(hidden=H, ffn=F_, num_experts=E, bytes_per_element=4)
        model = cal.profile.cost_model(shape, world_size=P)
        perf = predict_layer_schedule(counts, smart.plan.smart.groups, model, overhead=cal.layer_overhead_s)
        perf["profile"] = cal.profile.name
    profiles = []
    if args.profile:
        from ..perfmodel.cost import LayerShape
        from ..perfmodel.profiles import get_profile
        for name in args.profile.split(","):
            prof = get_profile(name)
            shape = LayerShape(hidden=H, ffn=F_, num_experts=E, bytes_per_element=prof.bytes_per_element)
            pred = predict_layer_schedule(counts, smart.plan.smart.groups, prof.cost_model(shape, world_size=P))
            pred["profile"] = name
            profiles.append(pred)
    if rank:
        return None
    return {"config": args.config, "H": H, "F": F_, "E": E, "k": k, "T": T, "routing": args.routing, "P": P,
            "groups": smart.plan.smart.groups, "threads": torch.get_num_threads(), "device": device.type,
            "backend": str(dist.get_backend(group)), "iters": args.iters, "max_abs_diff": diff,
            "counts": counts.tolist(), "measured": measured,
            "measured_ratio": measured["plain"] / measured["smart"],
            "components": {"S": S, "R": R, "C_fwd": Cf, "C_bwd": Cb, "regroup": regroup,
                           "regroup_fraction": regroup_frac, "rest": other, "note": note},
            "components_pred": comp_pred, "components_ratio": comp_pred["plain"] / comp_pred["smart"],
            "upper_bound": speedup_upper_bound(2 * (sum(S) + sum(R)), sum(Cf) + sum(Cb)),
            "perfmodel": perf, "profiles": profiles}


def report(res: dict) -> str:
    ms = lambda t: f"{t * 1e3:.2f}"
    c = res["components"]
    lines = [f"`megamoe bench schedule`: {res['P']} {res['backend']} processes on {res['device']}, "
             f"{res['threads']} thread(s) each, torch {torch.__version__}; config {res['config']}: H={res['H']} "
             f"F={res['F']} E={res['E']} k={res['k']} T={res['T']} tokens per rank, {res['routing']} routing; "
             f"smart groups {res['groups']}; forward+backward, median of {res['iters']} interleaved rounds "
             f"(slowest rank). Same output: max |plain - smart| = {res['max_abs_diff']:.1e}.",
             "",
             "| | plain ms | smart ms | plain / smart |",
             "|---|---:|---:|---:|",
             f"| measured | {ms(res['measured']['plain'])} | {ms(res['measured']['smart'])} | "
             f"{res['measured_ratio']:.3f} |",
             f"| measured, smart path with 1 group (same code, nothing to overlap) | {ms(res['measured']['plain'])} | "
             f"{ms(res['measured']['single'])} | {res['measured']['plain'] / res['measured']['single']:.3f} |",
             f"| predicted: components measured here + Fig. 8 timeline | {ms(res['components_pred']['plain'])} | "
             f"{ms(res['components_pred']['smart'])} | {res['components_ratio']:.3f} |"]
    if res["perfmodel"]:
        p = res["perfmodel"]
        lines.append(f"| predicted: perfmodel (calibrated profile {p['profile']!r}, CostModel per step) | "
                     f"{ms(p['plain'])} | {ms(p['smart'])} | {p['ratio']:.3f} |")
    for p in res["profiles"]:
        lines.append(f"| predicted for this routing on profile {p['profile']!r} (not measured) | {ms(p['plain'])} | "
                     f"{ms(p['smart'])} | {p['ratio']:.3f} |")
    lines += ["",
              "components per step j (ms, slowest rank): S_j " + ", ".join(ms(t) for t in c["S"]) +
              "; R_j " + ", ".join(ms(t) for t in c["R"]) + "; C_j forward " + ", ".join(ms(t) for t in c["C_fwd"]) +
              "; C_j backward " + ", ".join(ms(t) for t in c["C_bwd"]) +
              f"; plain's row regrouping {ms(c['regroup'])} (smart: {c['regroup_fraction']:.0%} of it)"
              f"; rest of the layer (gate, sort, counts, combine) {ms(c['rest'])}" + (f" ({c['note']})" if c["note"]
                                                                                   else ""),
              f"paper §5.5 upper bound of the exchange+expert speedup (comm + comp) / max(comm, comp): "
              f"{res['upper_bound']:.3f}",
              "routing counts [source rank x expert]: " + json.dumps(res["counts"])]
    return "\n".join(lines)


# --- processes ---------------------------------------------------------------------------------------------------
def _worker(rank: int, world: int, args: argparse.Namespace, result_file: str) -> None:
    res = run(args)
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump(res, f)


def main(argv: Optional[List[str]] = None) -> dict:
    from .report import emit_report
    p = argparse.ArgumentParser(prog="megamoe bench schedule", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="comm", choices=sorted(CONFIGS))
    p.add_argument("--routing", default="skewed", choices=("balanced", "skewed"))
    p.add_argument("--nproc", type=int, default=2, help="gloo processes to spawn (ignored under torchrun)")
    p.add_argument("--groups", type=int, default=0, help="smart groups n (default: one per process)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads per process (0 = cores / processes)")
    p.add_argument("--no-calibrate", action="store_true", help="skip the perfmodel calibration and its prediction")
    p.add_argument("--profile", default="", help="also predict the ratio on these perfmodel profiles (comma list)")
    p.add_argument("--output", help="also write the report here")
    p.add_argument("--json", default=None, help="also write the results here (JSON)")
    args = p.parse_args(argv)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    if args.threads <= 0:
        procs = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])) if launched else args.nproc
        args.threads = max(1, (os.cpu_count() or 1) // procs)
    if launched:                                          # torchrun: use its processes
        use_cuda = torch.cuda.is_available()
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.set_num_threads(args.threads)
        dist.init_process_group("nccl" if use_cuda else "gloo")
        try:
            res = run(args)
        finally:
            dist.destroy_process_group()
        if res is None:
            return {}
    else:
        from ..launch import run_processes
        if args.nproc < 2:
            p.error("--nproc: the schedules differ only with expert parallelism; use 2 or more processes")
        with tempfile.TemporaryDirectory() as d:
            result = os.path.join(d, "result.json")
            run_processes(_worker, args.nproc, args, result, threads=args.threads, label="bench schedule")
            with open(result) as f:
                res = json.load(f)
    emit_report([report(res)], args.output)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f)
    return res


if __name__ == "__main__":
    main()
