"""``megamoe bench cluster``: one MoE layer with EP=4 on an emulated 2 nodes x 2 cluster, at two inter-node
bandwidths: the measured step split into compute / all-to-all (and the exchange's intra- and inter-node parts),
beside the prediction of a performance model calibrated on that same cluster.

The driver (root) creates one emulated cluster per bandwidth (``cluster.run_job``) and runs the worker on its 4
ranks, each a fixed-speed device by default (``--cpu-share auto``: its own CPU cgroup capped at 0.9 x cores / ranks,
so a rank cannot borrow the cores its waiting peers leave). Each worker:

1. calibrates the cluster (``perfmodel.calibrate``: GEMM rate with the CPU share each rank really gets while all
   ranks compute, all-to-all alpha, point-to-point alpha-beta per level of the launcher's topology);
2. for each layer shape x routing (balanced, skewed), times forward+backward of a real ``MoELayer`` (median of
   rounds) and, inside it, every ``all_to_all_single`` call (gloo's collectives block, so their wall time is the
   exchange time): compute = step - exchange;
3. replays the step's exchanges alone with the same split sizes, then with only the intra-node splits and only
   the inter-node splits: the exchange's intra and inter parts measured in isolation;
4. predicts the step from its routing counts with the calibrated model (compute, all-to-all total, and the
   all-to-all of the intra-node and inter-node traffic alone).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

SHAPES = ((256, 1024, 8, 1024), (512, 1024, 8, 1024), (256, 2048, 16, 2048))   # hidden, ffn, experts, tokens/rank
SKEW = 3.0


class _ExchangeTimer:
    """Wraps torch.distributed.all_to_all_single: wall time and split sizes of every call while recording."""

    def __init__(self):
        self.real = dist.all_to_all_single
        self.recording, self.seconds, self.calls = False, 0.0, []

    def __call__(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        if not self.recording:
            return self.real(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        t0 = time.perf_counter()
        out = self.real(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        self.seconds += time.perf_counter() - t0
        row = input.numel() // max(input.shape[0], 1) * input.element_size() if input.dim() else input.element_size()
        self.calls.append((list(input_split_sizes or []), list(output_split_sizes or []), row, input.dtype,
                           tuple(input.shape[1:])))
        return out


def _replay(calls, keep, group, iters: int) -> float:
    """Median wall time of replaying the recorded exchanges with only the splits to/from peers in ``keep``."""
    me = dist.get_rank(group)
    bufs = []
    for ins, outs, _, dtype, tail in calls:
        if not ins:                     # an even split (the count exchange): tiny, keep as is
            continue
        ins = [n if keep(me, r) else 0 for r, n in enumerate(ins)]
        outs = [n if keep(r, me) else 0 for r, n in enumerate(outs)]
        bufs.append((torch.zeros((sum(ins),) + tail, dtype=dtype), torch.empty((sum(outs),) + tail, dtype=dtype),
                     ins, outs))
    times = []
    for _ in range(iters + 1):
        dist.barrier(group)
        t0 = time.perf_counter()
        for x, y, ins, outs in bufs:
            dist.all_to_all_single(y, x, outs, ins, group=group)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)
        times.append(float(dt))
    return statistics.median(times[1:])


def _model_a2a(cal, case, counts, mask: Optional[torch.Tensor]) -> float:
    """The calibrated model's 4 all-to-alls of a step whose token matrix is restricted to ``mask`` [P, P]."""
    from ..perfmodel.cost import LayerShape
    shape = LayerShape(hidden=case.hidden, ffn=case.ffn, num_experts=case.experts,
                       bytes_per_element=cal.profile.bytes_per_element)
    model = cal.profile.cost_model(shape, world_size=counts.shape[0])
    m = model.placement_matrix(None, counts.shape[1])
    rank_tokens = model._route(model._counts(counts), m)
    if mask is not None:
        rank_tokens = rank_tokens * mask
    return 4.0 * model.alltoall_time(rank_tokens)


def _time_step(layer, x, timer: _ExchangeTimer, rounds: int, warmup: int = 2):
    """Per round: the step (slowest rank), the compute (the slowest rank's time outside all_to_all_single calls)
    and the exchange (step - compute: what communication, and waiting for it, added to the critical path).
    Medians over ``rounds``; also the exchanges of the last step (for replay)."""
    steps, computes = [], []
    for i in range(warmup + rounds):
        timer.recording, timer.seconds, timer.calls = True, 0.0, []
        dist.barrier()
        t0 = time.perf_counter()
        layer(x).sum().backward()
        dt = time.perf_counter() - t0
        timer.recording = False
        both = torch.tensor([dt, dt - timer.seconds], dtype=torch.float64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        if i >= warmup:
            steps.append(float(both[0]))
            computes.append(float(both[1]))
    step, compute = statistics.median(steps), statistics.median(computes)
    return step, compute, list(timer.calls)


def _worker(out: str, rounds: int, quick: bool) -> None:
    from ..perfmodel.calibrate import LayerCase, build_layer_case, calibrate, predict_layer
    from ..topology import Topology

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        cal = calibrate(name="emulated-cluster", quick=quick)
        topo = Topology.from_env(world_size=dist.get_world_size())
        node = torch.tensor(topo.node_ids())
        same = (node[:, None] == node[None, :]).to(torch.float64)
        timer = _ExchangeTimer()
        dist.all_to_all_single = timer
        rows = []
        try:
            for i, (hidden, ffn, experts, tokens) in enumerate(SHAPES[:2] if quick else SHAPES):
                for skew in (0.0, SKEW):
                    case = LayerCase(hidden, ffn, experts, tokens, skew=skew)
                    layer, x = build_layer_case(case, seed=i + 1)
                    step, compute, calls = _time_step(layer, x, timer, rounds)
                    counts = layer.last_routing.counts.detach()
                    parts = [torch.empty_like(counts) for _ in range(dist.get_world_size())]
                    dist.all_gather(parts, counts)
                    counts = torch.stack(parts)
                    alone = _replay(calls, lambda a, b: True, None, rounds)
                    intra = _replay(calls, lambda a, b: a != b and topo.node_of(a) == topo.node_of(b), None, rounds)
                    inter = _replay(calls, lambda a, b: topo.node_of(a) != topo.node_of(b), None, rounds)
                    predicted, b = predict_layer(cal, case, counts)
                    rows.append({"shape": f"H{hidden} F{ffn} E{experts} T{tokens}",
                                 "routing": "skewed" if skew else "balanced",
                                 "measured": {"step": step, "exchange": step - compute, "compute": compute,
                                              "exchange_alone": alone, "intra_alone": intra, "inter_alone": inter},
                                 "predicted": {"step": predicted, "compute": b.compute, "exchange": b.alltoall,
                                               "intra": _model_a2a(cal, case, counts, same - torch.eye(len(node))),
                                               "inter": _model_a2a(cal, case, counts, 1.0 - same),
                                               "overhead": cal.layer_overhead_s},
                                 "busiest_over_mean": float(counts.sum(0).max() / counts.sum(0).float().mean())})
        finally:
            dist.all_to_all_single = timer.real
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                json.dump({"calibration": cal.report(), "profile": cal.profile.to_dict(), "rows": rows,
                           "topology": repr(topo)}, f)
    finally:
        dist.destroy_process_group()


def split_probe(out: str, rounds: int = 3) -> None:
    """On every rank of a job: a reference MoE layer (H256 F1024, 2 experts per rank, 1024 tokens per rank, top-2,
    balanced) forward+backward; rank 0 writes the measured step / compute / exchange split to ``out``."""
    from ..perfmodel.calibrate import LayerCase, build_layer_case

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        world = dist.get_world_size()
        case = LayerCase(256, 1024, 2 * world, 1024)
        layer, x = build_layer_case(case, seed=1)
        timer = _ExchangeTimer()
        dist.all_to_all_single = timer
        try:
            step, compute, _ = _time_step(layer, x, timer, rounds)
        finally:
            dist.all_to_all_single = timer.real
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                json.dump({"shape": case.label(), "world": world, "step": step, "compute": compute,
                           "exchange": step - compute}, f)
    finally:
        dist.destroy_process_group()


def _table(bandwidth: str, res: dict) -> str:
    lines = [f"inter-node {bandwidth} per node (tbf), 2 nodes x 2 ranks, EP=4; {res['topology']}",
             f"{'shape':<22} {'routing':<9} {'step ms':>8} {'compute':>8} {'a2a':>7} {'a2a %':>6} "
             f"{'intra':>7} {'inter':>7} | {'pred step':>9} {'compute':>8} {'a2a':>7} {'intra':>7} {'inter':>7} "
             f"{'err':>6}"]
    for r in res["rows"]:
        m, p = r["measured"], r["predicted"]
        lines.append(f"{r['shape']:<22} {r['routing']:<9} {m['step'] * 1e3:>8.1f} {m['compute'] * 1e3:>8.1f} "
                     f"{m['exchange'] * 1e3:>7.1f} {m['exchange'] / m['step']:>6.0%} {m['intra_alone'] * 1e3:>7.1f} "
                     f"{m['inter_alone'] * 1e3:>7.1f} | {p['step'] * 1e3:>9.1f} {p['compute'] * 1e3:>8.1f} "
                     f"{p['exchange'] * 1e3:>7.1f} {p['intra'] * 1e3:>7.1f} {p['inter'] * 1e3:>7.1f} "
                     f"{(p['step'] - m['step']) / m['step']:>+6.0%}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> Dict[str, dict]:
    p = argparse.ArgumentParser(prog="megamoe bench cluster", description=__doc__.split("\n\n")[0])
    p.add_argument("--bandwidths", default="50MB/s,12MB/s", help="inter-node bandwidths to compare (comma list)")
    p.add_argument("--rounds", type=int, default=5, help="timed steps per case (median)")
    p.add_argument("--quick", action="store_true", help="fewer shapes and a quicker calibration")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--cpu-share", default="auto", help="each rank's CPU share in cores (megamoe cluster run "
                   "--cpu-share): auto (fixed-speed ranks, the default), off, one value or one per rank")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--split-probe", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.split_probe:
        split_probe(args.split_probe)
        return {}
    if args.worker:
        _worker(args.worker, args.rounds, args.quick)
        return {}
    from ..cluster import cpu_caps, netns, run_job
    why = netns.unavailable()
    if why:
        raise SystemExit(f"megamoe bench cluster: {why}")
    shares = cpu_caps.bench_shares(args.cpu_share, 4, "megamoe bench cluster")
    print(f"[bench cluster] 2 nodes x 2, {cpu_caps.describe(shares)}", flush=True)
    results = {}
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        for bw in args.bandwidths.split(","):
            out = os.path.join(d, "result.json")
            cmd = [sys.executable, "-m", "megamoe_plugin.bench.cluster", "--worker", out, "--rounds", str(args.rounds)]
            cmd += ["--quick"] if args.quick else []
            print(f"[bench cluster] inter-node {bw}: calibrating and timing {len(SHAPES[:2] if args.quick else SHAPES) * 2} "
                  f"cases ...", flush=True)
            t0 = time.time()
            code = run_job(cmd, 2, 2, netns.parse_bandwidth(bw), log_dir=os.path.join(d, "logs"), timeout=1800,
                           echo=lambda line: None, cpu_shares=shares)
            if code:
                raise SystemExit(f"megamoe bench cluster: the run at {bw} failed with status {code}")
            with open(out) as f:
                results[bw] = json.load(f)
            results[bw]["cpu_shares"] = shares
            print(f"[bench cluster] inter-node {bw}: done in {time.time() - t0:.0f}s", flush=True)
            print(results[bw]["calibration"])
            print(_table(bw, results[bw]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
