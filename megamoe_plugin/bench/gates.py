"""``megamoe bench gates``: the topology-aware gates measured on the emulated cluster (TA-MoE paper 002, FasterMoE's
Hir gate, paper 003 §4.3).

For each topology (2 nodes x 2, and an asymmetric 3 nodes of 2+1+1 ranks; inter-node links 4x slower than the
intra-node ones by default) and each routing configuration (the default list: gshard with its aux loss; ``alf``, the
aux-loss-free baseline: sigmoid scores + expert bias, no loss; TA-MoE's loss with local gates; Hir; node-limited
routing with DeepSeek's rule and with the sender's rule, M = 1; TA-MoE's target by per-sender bias: ``PRESETS``),
``megamoe train`` trains the same MoE GPT from the same seed and data under ``megamoe cluster run``, every rank
a fixed-speed device by default (``--cpu-share auto``: its own CPU cgroup). ``--seeds 0,1,2`` runs every config once
per seed (the configs of a seed interleaved) and summarises, per config, the medians over seeds of its ratios to the
baseline of the same seed (``seed_summary``; ``--report`` prints that as markdown, ``--figure`` plots the losses);
without it, ``--train-rounds`` rounds interleaved (the row is the round with the median step). A configuration may
carry gate options after ``+`` (``ta_moe:local+router-bias-update-rate=0.01`` adds
``--moe-router-bias-update-rate 0.01``;
``=true`` / ``=false`` for a switch), and ``--train-args`` changes the model or data for every run
(``"--batch-size 16 --moe-every 2"``). Per run:

- the off-node share of the dispatched assignments (routing trace, last quarter of training; for ta_moe its target
  from the derived pattern), and the MoE inter-node bytes per step that implies (computed from the trace:
  assignments x hidden x 4 bytes x 4 exchanges per step);
- the job's inter-node traffic per step, measured on the links (veth counters; every collective included);
- the expert-load balance (the busiest expert's assignments over the mean, from the trace's last quarter);
- the measured step time (median of the log lines after the first), the validation loss at every evaluation and
  at the end, and the training time to a target validation loss (the worst of the runs' best losses of that
  topology and seed, so every run reaches it);
- beside the step, the alpha-beta model's prediction (``predicted_step``): gshard's measured step less the time
  the run's fewer MoE inter-node bytes take on the shaped uplinks.

``table1`` measures TA-MoE's Table 1 for real: device 0 sends 128 MB split evenly (1/4 each) or by the derived
uneven pattern over the shaped links, in interleaved rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch

from ..cluster import cpu_caps, netns
from ..cluster.launcher import run_job

TOPOLOGIES = {"2x2": (2, 2), "3asym": (3, [2, 1, 1])}
# the aux-loss-free family (Megatron's flags for DeepSeek-V3's balancing): sigmoid scores, the expert bias, no loss
_ALF = "+score-function=sigmoid+router-expert-bias=true+load-balancing-type=none"
PRESETS = {
    "alf": "topk" + _ALF,                                           # the aux-loss-free baseline
    "ta_moe_loss": "ta_moe:local",                                  # TA-MoE's loss (released: local gates)
    "ta_moe_bias": "ta_moe" + _ALF,                                 # TA-MoE's target by per-sender bias
    "node_limited": "node_limited+group-topk=1" + _ALF,             # DeepSeek's rule, M = 1 node
    "node_limited_sender": "node_limited_sender+group-topk=1" + _ALF,   # sender's node always, M = 1
}
CONFIGS = ("gshard", "alf", "ta_moe_loss", "hir", "node_limited", "node_limited_sender", "ta_moe_bias")
def shaping_label(results: dict, nodes: str = "2 nodes x 2") -> str:
    """How a row measured by this bench was obtained (the reproduce tables' source column)."""
    sh = results["shaping"]
    intra = f", intra-node {sh['intra'] / 1e6:.0f} MB/s" if sh.get("intra") else ""
    speed = cpu_caps.source_label(sh.get("cpu_shares_2x2"))
    return f"measured, emulated cluster: {nodes}, {speed}, inter-node {sh['inter'] / 1e6:.0f} MB/s{intra}"


MODEL = ["--hidden", "256", "--layers", "4", "--heads", "4", "--ffn-hidden", "512", "--moe-every", "1",
         "--seq-len", "64", "--batch-size", "8", "--moe-num-experts", "8", "--moe-top-k", "2",
         "--moe-second-expert-policy", "all", "--moe-aux-loss-coeff", "0.01", "--lr", "3e-3", "--threads", "1",
         "--corpus-bytes", "1000000", "--eval-batches", "8", "--seed", "0"]


def config_flags(config: str) -> List[str]:
    """``gate[:sync][+option=value...]`` (or a name of ``PRESETS``, options may follow it) as megamoe train flags:
    the options are --moe-<option> VALUE, and --moe-<option> / --no-moe-<option> for true / false; sync auto when
    not given (the gate's own default)."""
    head, plus, rest = config.partition("+")
    if head in PRESETS:
        config = PRESETS[head] + plus + rest
    base, *options = config.split("+")
    gate, _, sync = base.partition(":")
    flags = ["--moe-gate", gate, "--moe-gate-sync", sync or "auto"]
    for opt in options:
        name, eq, value = opt.partition("=")
        if not eq or not name:
            raise SystemExit(f"megamoe bench gates: --configs {config!r}: {opt!r} is not option=value")
        if value.lower() in ("true", "false"):
            flags.append(f"--moe-{name}" if value.lower() == "true" else f"--no-moe-{name}")
        else:
            flags += [f"--moe-{name}", value]
    return flags


def _flags(config: str, world: int, steps: int, out: str, train_args: Sequence[str] = ()) -> List[str]:
    return (["megamoe", "train", *MODEL, *train_args, "--steps", str(steps), "--eval-interval",
             str(max(steps // 8, 1)), "--log-interval", str(max(steps // 20, 1)), *config_flags(config),
             "--moe-expert-parallel-size", str(world), "--trace", os.path.join(out, "trace"),
             "--metrics-json", os.path.join(out, "metrics.json")])


def _flag_value(flags: Sequence[str], name: str) -> str:
    """The last value given to ``name`` (argparse keeps the last)."""
    return flags[len(flags) - 1 - flags[::-1].index(name) + 1]


def off_node_share(counts: torch.Tensor, groups: List[List[int]], last_fraction: float = 0.25) -> float:
    """Fraction of the dispatched assignments whose expert lives on another node: counts [S, L, P, E] of a trace
    (experts in contiguous blocks over the P ranks), over its last ``last_fraction`` of steps."""
    S, L, P, E = counts.shape
    node = {r: k for k, g in enumerate(groups) for r in g}
    per = E // P
    remote = torch.tensor([[node[p] != node[e // per] for e in range(E)] for p in range(P)], dtype=torch.float64)
    c = counts[int(S * (1 - last_fraction)):].to(torch.float64)
    return float((c * remote).sum() / c.sum().clamp_min(1))


def load_imbalance(counts: torch.Tensor, last_fraction: float = 0.25) -> float:
    """Expert-load balance: the busiest expert's assignments over the mean, per step and layer (all senders
    together), averaged over the trace's last ``last_fraction`` of steps (1.0 = perfectly balanced)."""
    S = counts.shape[0]
    per_expert = counts[int(S * (1 - last_fraction)):].to(torch.float64).sum(dim=2)          # [S', L, E]
    ratio = per_expert.amax(-1) / per_expert.mean(-1).clamp_min(1e-9)
    return float(ratio.mean())


def target_share(groups: List[List[int]], bandwidth_gbps: List[float], smoothing: float = 0.1) -> float:
    """TA-MoE's derived target: the mean over source ranks of the share its row sends off-node."""
    from ..gates import target_dispatch_pattern
    from ..topology import Topology
    topo = Topology(groups, bandwidth_gbps=bandwidth_gbps)
    c = target_dispatch_pattern(topo, 64e6, smoothing)
    node = topo.node_ids()
    P = topo.num_ranks
    return sum(float(c[i, j]) for i in range(P) for j in range(P) if node[i] != node[j]) / P


def time_to(evals: List[dict], target: float) -> Optional[float]:
    """Training seconds at which the validation loss first reaches ``target`` (linear between evaluations)."""
    prev = None
    for e in evals:
        if e["loss"] <= target:
            if prev is None:
                return e["train_seconds"]
            f = (prev["loss"] - target) / max(prev["loss"] - e["loss"], 1e-12)
            return prev["train_seconds"] + f * (e["train_seconds"] - prev["train_seconds"])
        prev = e
    return None


def run_config(topology: str, config: str, steps: int, inter: float, intra: float, out: str, port: int,
               cpu_share: str = "off", train_args: Sequence[str] = ()) -> dict:
    from ..stats import load_trace
    nodes, procs = TOPOLOGIES[topology]
    groups = [[0, 1], [2, 3]] if topology == "2x2" else [[0, 1], [2], [3]]
    world = sum(len(g) for g in groups)
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    flags = _flags(config, world, steps, out, train_args)
    code = run_job(flags, nodes, procs, inter, intra, master_port=port,
                   log_dir=os.path.join(out, "logs"), timeout=3600, echo=lambda line: None, say=lambda t: None,
                   cpu_shares=cpu_caps.bench_shares(cpu_share, world, "megamoe bench gates"))
    if code:
        raise RuntimeError(f"{topology} {config}: megamoe train exited with {code} (logs: {out}/logs)")
    with open(os.path.join(out, "metrics.json")) as f:
        m = json.load(f)
    with open(os.path.join(out, "logs", "network.json")) as f:
        net = json.load(f)
    trace = load_trace(os.path.join(out, "trace"))
    counts = trace["counts"]
    share = off_node_share(counts, groups)
    S, L = counts.shape[:2]
    assignments_per_step = float(counts.sum()) / S
    hidden = int(_flag_value(flags, "--hidden"))
    tokens = world * int(_flag_value(flags, "--batch-size")) * int(_flag_value(flags, "--seq-len"))
    step_times = [tokens / h["tokens_per_s"] for h in m["history"][1:]]
    sent = sum(v["sent"] for v in net["nodes"].values())
    return {"topology": topology, "config": config, "off_node_share": share, "load_imbalance": load_imbalance(counts),
            "moe_inter_bytes_per_step": share * assignments_per_step * hidden * 4 * 4,
            "link_bytes_per_step": sent / m["step"], "step_seconds": statistics.median(step_times),
            "final_valid_loss": m["evals"][-1]["loss"], "evals": m["evals"], "wall_seconds": time.time() - t0,
            "train_seconds": m["train_seconds"]}


def table1(inter: float, intra: float, out: str, rounds: int, port: int) -> dict:
    """TA-MoE Table 1 on the shaped links: 128 MB from device 0, even vs derived uneven split (interleaved)."""
    os.makedirs(out, exist_ok=True)
    result = os.path.join(out, "table1.json")
    cmd = [sys.executable, "-m", "megamoe_plugin.bench.gates", "--table1-worker", result, "--rounds", str(rounds)]
    code = run_job(cmd, 2, 2, inter, intra, master_port=port, log_dir=os.path.join(out, "logs"), timeout=1800,
                   echo=lambda line: None, say=lambda t: None)
    if code:
        raise RuntimeError(f"table 1 exited with {code} (logs: {out}/logs)")
    with open(result) as f:
        return json.load(f)


def _table1_worker(out: str, rounds: int, total: int = 128 << 20) -> None:
    """Every rank: rank 0 sends ``total`` bytes split by each pattern (its own share stays), the others receive;
    patterns interleaved round by round; rank 0 writes the medians."""
    import torch.distributed as dist
    from ..gates import target_dispatch_pattern
    from ..topology import Topology

    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        topo = Topology.from_env(world_size=world)
        derived = target_dispatch_pattern(topo, float(total), 0.0)[0].tolist()
        patterns = {"even (1/4 each)": [0.25] * 4, "uneven (paper: 1/4, 1/2, 1/8, 1/8)": [0.25, 0.5, 0.125, 0.125],
                    "derived from the measured topology": derived}
        times = {k: [] for k in patterns}
        for _ in range(rounds + 1):
            for name, frac in patterns.items():
                n = [int(total * f) // 4 for f in frac]
                ins = [0] * world if rank else [0] + n[1:]
                outs = [n[rank] if rank else 0] + [0] * (world - 1)
                x, y = torch.zeros(sum(ins)), torch.empty(sum(outs))
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_to_all_single(y, x, outs, ins)
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                times[name].append(float(dt))
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"topology": repr(topo), "patterns": patterns,
                           "seconds": {k: statistics.median(v[1:]) for k, v in times.items()}}, f)
    finally:
        dist.destroy_process_group()


def main(argv: Optional[List[str]] = None) -> dict:
    p = argparse.ArgumentParser(prog="megamoe bench gates", description=__doc__.split("\n\n")[0])
    p.add_argument("--topologies", default="2x2,3asym", help="comma list of: 2x2, 3asym")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma list of gate[:sync] (sync: all, local, "
                   "average:K)")
    p.add_argument("--steps", type=int, default=200, help="training steps of every run")
    p.add_argument("--inter-node-bandwidth", default="100MB/s")
    p.add_argument("--intra-node-bandwidth", default="400MB/s", help="4x the inter-node links by default")
    p.add_argument("--table1-rounds", type=int, default=3, help="interleaved rounds of TA-MoE's Table 1 (0 = skip)")
    p.add_argument("--schedule", default="compute:2,compute:4", help="smart-schedule cases measured on 2 nodes x 2 "
                   "(bench schedule CONFIG:GROUPS, comma list; empty = skip)")
    p.add_argument("--train-rounds", type=int, default=1, help="rounds of the training runs, each running every "
                   "config once, interleaved (medians and spread reported)")
    p.add_argument("--cpu-share", default="auto", help="each rank's CPU share in cores (megamoe cluster run "
                   "--cpu-share): auto (fixed-speed ranks, the default), off, one value or one per rank")
    p.add_argument("--train-args", default="", help="megamoe train flags added to every run's model and data "
                   "(e.g. \"--batch-size 16 --moe-every 2 --seed 1\")")
    p.add_argument("--seeds", default="", help="comma list of seeds: every config runs once per seed (--seed S), "
                   "the configs of one seed interleaved, seeds one after another; the summary gives medians over "
                   "seeds (empty: the model's seed, --train-rounds rounds)")
    p.add_argument("--out", default="results/bench_gates", help="runs, traces, logs and results.json")
    p.add_argument("--report", default=None, metavar="RESULTS_JSON", help="print the seeds summaries of finished "
                   "runs' results.json (comma list) as one markdown table (what docs/topology-gates.md ships) and "
                   "exit")
    p.add_argument("--figure", default=None, metavar="PNG", help="with --report: also plot validation loss against "
                   "steps and against training seconds (seed 0) into this PNG")
    p.add_argument("--table1-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.table1_worker:
        _table1_worker(args.table1_worker, args.rounds)
        return {}
    if args.report:
        results = {"summary": report_summary(args.report.split(","))}
        print(summary_markdown(results))
        if args.figure:
            print(f"figure: {figure(args.report.split(','), args.figure)}")
        return results
    why = netns.unavailable()
    if why:
        raise SystemExit(f"megamoe bench gates: {why}")
    inter, intra = netns.parse_bandwidth(args.inter_node_bandwidth), netns.parse_bandwidth(args.intra_node_bandwidth)
    shares = cpu_caps.bench_shares(args.cpu_share, 4, "megamoe bench gates")       # checked before anything runs
    if args.train_rounds < 1:
        raise SystemExit("megamoe bench gates: --train-rounds must be >= 1")
    print(f"[bench gates] {cpu_caps.describe(shares)}", flush=True)
    results: Dict[str, object] = {"shaping": {"inter": inter, "intra": intra, "cpu_share": args.cpu_share,
                                              "cpu_shares_2x2": shares}, "runs": []}
    if args.table1_rounds:
        print(f"[bench gates] TA-MoE Table 1 on 2 nodes x 2 ({args.table1_rounds} interleaved rounds)", flush=True)
        results["table1"] = table1(inter, intra, os.path.join(args.out, "table1"), args.table1_rounds, 29800)
        print(json.dumps(results["table1"]["seconds"], indent=1), flush=True)
    results["schedule"] = []
    for case in filter(None, args.schedule.split(",")):
        config, groups = case.split(":")
        out = os.path.join(args.out, "schedule", f"{config}_g{groups}.json")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        print(f"[bench gates] smart schedule {config}, {groups} groups, on 2 nodes x 2 ...", flush=True)
        code = run_job(["megamoe", "bench", "schedule", "--config", config, "--routing", "balanced", "--groups",
                        groups, "--iters", "8", "--json", out], 2, 2, inter, None, master_port=29790,
                       log_dir=os.path.join(args.out, "schedule", "logs"), timeout=1800, echo=lambda line: None,
                       say=lambda t: None, cpu_shares=shares)
        if code:
            raise RuntimeError(f"smart schedule {case}: exited with {code}")
        with open(out) as f:
            res = json.load(f)
        results["schedule"].append({"case": case, "measured_ratio": res["measured_ratio"],
                                    "single_group_ratio": res["measured"]["plain"] / res["measured"]["single"],
                                    "components_ratio": res["components_ratio"],
                                    "perfmodel_ratio": (res["perfmodel"] or {}).get("ratio"),
                                    "plain_ms": res["measured"]["plain"] * 1e3, "smart_ms": res["measured"]["smart"] * 1e3,
                                    "comm_share": 2 * (sum(res["components"]["S"]) + sum(res["components"]["R"]))
                                    / res["measured"]["plain"], "upper_bound": res["upper_bound"]})
        print(f"[bench gates] smart schedule {case}: plain / smart {res['measured_ratio']:.3f}", flush=True)
    configs = [c for c in args.configs.split(",") if c]
    train_args = shlex.split(args.train_args)
    for c in configs:
        config_flags(c)                                              # a malformed option fails before any run
    results["train_args"] = train_args
    seeds = [int(v) for v in args.seeds.split(",") if v.strip()]
    for topology in filter(None, args.topologies.split(",")):
        for seed in seeds:
            for i, config in enumerate(configs):
                t0 = time.time()
                print(f"[bench gates] {topology} seed {seed} {config} ({i + 1}/{len(configs)}) ...", flush=True)
                run = run_config(topology, config, args.steps, inter, intra,
                                 os.path.join(args.out, topology, f"seed{seed}", config.replace(":", "_")),
                                 29810 + 2 * i, args.cpu_share, [*train_args, "--seed", str(seed)])
                run["seed"] = seed
                results["runs"].append(run)
                print(f"[bench gates] {topology} seed {seed} {config}: off-node share {run['off_node_share']:.3f}, "
                      f"step {run['step_seconds'] * 1e3:.0f} ms, balance {run['load_imbalance']:.2f}, valid loss "
                      f"{run['final_valid_loss']:.4f} ({time.time() - t0:.0f}s)", flush=True)
        if seeds:
            continue
        rounds: Dict[str, List[dict]] = {c: [] for c in configs}
        for k in range(args.train_rounds):
            for i, config in enumerate(configs):
                t0 = time.time()
                print(f"[bench gates] {topology} round {k + 1} {config} ({i + 1}/{len(configs)}) ...", flush=True)
                run = run_config(topology, config, args.steps, inter, intra,
                                 os.path.join(args.out, topology, f"round{k}", config.replace(":", "_")),
                                 29810 + 2 * i, args.cpu_share, train_args)
                rounds[config].append(run)
                print(f"[bench gates] {topology} {config}: off-node share {run['off_node_share']:.3f}, step "
                      f"{run['step_seconds'] * 1e3:.0f} ms, link {run['link_bytes_per_step'] / 1e6:.1f} MB/step, "
                      f"valid loss {run['final_valid_loss']:.4f} ({time.time() - t0:.0f}s)", flush=True)
        for config in configs:
            results["runs"].append(_median_round(rounds[config]))
    _finish(results, args)
    return results


def _median_round(rounds: List[dict]) -> dict:
    """One config's rounds as one row: the round with the median step time, with every round's step time and
    final validation loss kept (the spread)."""
    row = dict(sorted(rounds, key=lambda r: r["step_seconds"])[len(rounds) // 2])
    row["step_seconds_rounds"] = [r["step_seconds"] for r in rounds]
    row["final_valid_loss_rounds"] = [r["final_valid_loss"] for r in rounds]
    return row


def predicted_step(base: dict, run: dict, nodes: int, inter_bandwidth: float) -> float:
    """The alpha-beta model's step for ``run``: gshard's measured step less the time its extra MoE inter-node
    bytes take on the shaped links. Each node's uplink carries about 1/nodes of the bytes that cross nodes (both
    directions are shaped alike), and the exchanges are not overlapped with compute."""
    saved = base["moe_inter_bytes_per_step"] - run["moe_inter_bytes_per_step"]
    return base["step_seconds"] - saved / nodes / inter_bandwidth


def _finish(results: dict, args) -> None:
    by_topo: Dict[tuple, List[dict]] = {}
    for r in results["runs"]:
        by_topo.setdefault((r["topology"], r.get("seed")), []).append(r)
    for (topology, _), runs in by_topo.items():
        target = max(min(e["loss"] for e in r["evals"]) for r in runs)
        groups = [[0, 1], [2, 3]] if topology == "2x2" else [[0, 1], [2], [3]]
        bw = [results["shaping"]["intra"] / 1e9, results["shaping"]["inter"] / 1e9]
        base = next((r for r in runs if r["config"] == "gshard"), None)
        for r in runs:
            r["target_loss"] = target
            r["time_to_target"] = time_to(r["evals"], target)
        alf = next((r for r in runs if r["config"] == "alf"), None)
        for r in runs:
            if alf is not None and alf.get("time_to_target") and r.get("time_to_target"):
                r["speedup_vs_alf"] = alf["time_to_target"] / r["time_to_target"]
                r["step_ratio_vs_alf"] = alf["step_seconds"] / r["step_seconds"]
                r["loss_vs_alf"] = r["final_valid_loss"] / alf["final_valid_loss"] - 1.0
            if r["config"].startswith("ta_moe"):
                r["target_off_node_share"] = target_share(groups, bw)
            if base is not None:
                r["predicted_step_seconds"] = predicted_step(base, r, len(groups), results["shaping"]["inter"])
    if any("seed" in r for r in results["runs"]):
        results["summary"] = seed_summary(results["runs"])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(format_results(results), flush=True)
    if results.get("summary"):
        print(format_summary(results["summary"]), flush=True)


def seed_summary(runs: List[dict]) -> List[dict]:
    """Per topology and config, over the seeds: the median time-to-target speed-up over the aux-loss-free
    baseline of the same seed, the median step-time ratio (throughput) and the median final-loss difference at
    equal steps (quality per step), with every seed's values."""
    rows: Dict[tuple, List[dict]] = {}
    for r in runs:
        rows.setdefault((r["topology"], r["config"]), []).append(r)
    out = []
    for (topology, config), rs in rows.items():
        def med(key):
            vals = [r[key] for r in rs if r.get(key) is not None]
            return statistics.median(vals) if vals else None
        out.append({"topology": topology, "config": config, "seeds": [r["seed"] for r in rs],
                    "speedup_vs_alf": med("speedup_vs_alf"), "speedup_vs_alf_seeds": [r.get("speedup_vs_alf") for r in rs],
                    "step_ratio_vs_alf": med("step_ratio_vs_alf"), "loss_vs_alf": med("loss_vs_alf"),
                    "loss_vs_alf_seeds": [r.get("loss_vs_alf") for r in rs],
                    "off_node_share": med("off_node_share"), "load_imbalance": med("load_imbalance"),
                    "step_ms": 1e3 * med("step_seconds")})
    return out


LABELS = {"gshard": "gshard + aux loss 0.01", "alf": "aux-loss-free baseline (sigmoid + expert bias)",
          "ta_moe_loss": "TA-MoE's loss (local gates)", "hir": "Hir (FasterMoE)",
          "node_limited": "node-limited M=1, DeepSeek's rule", "node_limited_sender": "node-limited M=1, sender's node",
          "ta_moe_bias": "**TA-MoE by bias**"}
TOPOLOGY_LABELS = {"2x2": "2 x 2", "3asym": "3 nodes 2+1+1"}
COLORS = {"gshard": "tab:gray", "alf": "tab:blue", "ta_moe_loss": "tab:green", "hir": "tab:purple",
          "node_limited": "tab:brown", "node_limited_sender": "tab:olive", "ta_moe_bias": "tab:red"}


def report_summary(paths: Sequence[str]) -> List[dict]:
    """The seeds summaries of several results.json (e.g. one per topology), in order."""
    rows = []
    for path in paths:
        with open(path) as f:
            results = json.load(f)
        if "summary" not in results:
            raise SystemExit(f"megamoe bench gates --report {path}: no seeds summary (a --seeds run writes one)")
        rows += results["summary"]
    return rows


def figure(paths: Sequence[str], out: str, seed: int = 0) -> str:
    """Validation loss against steps (quality per step) and against training seconds (what the user waits for),
    one row per results.json (topology), the runs of ``seed``; written as a PNG at ``out``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(paths), 2, figsize=(11, 4.2 * len(paths)), squeeze=False)
    for row, path in zip(axes, paths):
        with open(path) as f:
            runs = [r for r in json.load(f)["runs"] if r.get("seed", seed) == seed]
        for r in runs:
            steps = [e["step"] for e in r["evals"]]
            loss = [e["loss"] for e in r["evals"]]
            secs = [e["train_seconds"] for e in r["evals"]]
            style = dict(lw=2.4 if r["config"] in ("ta_moe_bias", "alf") else 1.2, color=COLORS.get(r["config"]))
            label = LABELS.get(r["config"], r["config"]).strip("*")
            row[0].plot(steps, loss, label=label, **style)
            row[1].plot(secs, loss, label=label, **style)
        topo = TOPOLOGY_LABELS.get(runs[0]["topology"], runs[0]["topology"]) if runs else path
        target = runs[0].get("target_loss") if runs else None
        for ax, xlabel in zip(row, ("step (equal steps: quality per step)", "training seconds (time to target)")):
            if target:
                ax.axhline(target, color="grey", ls=":", lw=1)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("validation loss")
            ax.set_title(f"{topo}, seed {seed}")
            lo = min(e["loss"] for r in runs for e in r["evals"])
            ax.set_ylim(lo - 0.05, lo + 0.6)
        row[1].legend(fontsize=7)
    fig.tight_layout()
    fig.suptitle("megamoe bench gates: measured on the emulated cluster (fixed-speed ranks, 100 / 400 MB/s links)",
                 y=1.02)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return out


def _fmt(v, fmt: str) -> str:
    return format(v, fmt) if v is not None else "-"


def _summary_cells(r: dict) -> List[str]:
    """One summary row's values as text: off-node share, balance, step ms, throughput, loss, time to target."""
    seeds = " / ".join(_fmt(v, ".2f") for v in r["speedup_vs_alf_seeds"])
    return [_fmt(r["off_node_share"], ".3f"), _fmt(r["load_imbalance"], ".2f"), _fmt(r["step_ms"], ".0f"),
            _fmt(r["step_ratio_vs_alf"], ".3f"), _fmt(r["loss_vs_alf"], "+.2%"),
            f"{_fmt(r['speedup_vs_alf'], '.2f')} ({seeds})"]


def summary_markdown(results: dict) -> str:
    """The seeds summary as the markdown table docs/topology-gates.md ships (``--report``; a test compares them)."""
    rows = ["| topology | routing | off-node share | busiest expert / mean | step ms | throughput vs baseline | "
            "final loss vs baseline (equal steps) | time to target vs baseline: median (seeds) |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results["summary"]:
        cells = [TOPOLOGY_LABELS.get(r["topology"], r["topology"]), LABELS.get(r["config"], r["config"]),
                 *_summary_cells(r)]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def format_summary(summary: List[dict]) -> str:
    widths = (8, 7, 8, 17, 11, 0)
    lines = [f"{'topology':<7} {'config':<20} {'off-node':>8} {'balance':>7} {'step ms':>8} {'throughput vs alf':>17} "
             f"{'loss vs alf':>11} time to target vs alf (median; seeds)"]
    for r in summary:
        cells = " ".join(c.rjust(w) for c, w in zip(_summary_cells(r), widths))
        lines.append(f"{r['topology']:<7} {r['config']:<20} {cells}")
    return "\n".join(lines)


def format_results(results: dict) -> str:
    lines = [f"{'topology':<7} {'config':<20} {'off-node':>8} {'target':>7} {'balance':>7} {'MoE inter MB/step':>17} "
             f"{'link MB/step':>12} {'step ms':>8} {'predicted':>9} {'valid loss':>10} {'time to target':>14} "
             f"{'vs alf':>6}"]
    for r in results["runs"]:
        tgt = f"{r['target_off_node_share']:.3f}" if "target_off_node_share" in r else "-"
        ttt = f"{r['time_to_target']:.1f}s" if r.get("time_to_target") is not None else "not reached"
        pred = f"{r['predicted_step_seconds'] * 1e3:.0f}" if r.get("predicted_step_seconds") else "-"
        vs = f"{r['speedup_vs_alf']:.2f}" if r.get("speedup_vs_alf") else "-"
        bal = f"{r['load_imbalance']:.2f}" if r.get("load_imbalance") else "-"
        lines.append(f"{r['topology']:<7} {r['config']:<20} {r['off_node_share']:>8.3f} {tgt:>7} {bal:>7} "
                     f"{r['moe_inter_bytes_per_step'] / 1e6:>17.2f} {r['link_bytes_per_step'] / 1e6:>12.2f} "
                     f"{r['step_seconds'] * 1e3:>8.0f} {pred:>9} {r['final_valid_loss']:>10.4f} {ttt:>14} {vs:>6}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
