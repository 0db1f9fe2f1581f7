"""``megamoe bench planners``: FlexMoE placement and FasterMoE shadowing against static expert parallelism, trained
on the emulated cluster (papers 001 §5, 003 §4.1).

A real-text MoE LM whose routing skews on its own (the embedded corpus, 16 experts, top-1, no balance loss: FlexMoE
§2.4 / Fig. 2), EP=4 on 2 nodes x 2, trained from the same seed and data with:

- ``static``: static expert parallelism, dropless;
- ``capacity``: static with a capacity factor (DeepSpeed-style drop and pad, ``--capacity-factor``);
- ``shadow``: FasterMoE dynamic shadowing; ``flexmoe``: FlexMoE vExperts; ``eplb``: DeepSeek's EPLB (one spare
  slot per rank, like FlexMoE); all with the default cost model (the start-up calibration of this cluster,
  ``--moe-placement-profile auto``).

Every rank is a fixed-speed device by default (``--cpu-share auto``: its own CPU cgroup capped at 0.9 x cores /
ranks), so a loaded rank cannot borrow the cores its idle peers leave; ``--batch-size`` sets the tokens per rank per
step (x 64).

Per run: the measured step time (median of the log lines after the first), token efficiency (kept / routed),
expert efficiency (FlexMoE §5.4: useful expert rows over P x the busiest rank's rows, under the placement each step
ran with), the balance ratio over time (Eq. 6, first and last quarter), moves and bytes moved, the validation loss
at the end and the training time to a common target loss (the worst of the runs' best losses). With ``--balanced``
the same four on a balanced model (gshard top-2, balance loss 0.01): the planners must stay idle there.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Dict, List, Optional

from ..cluster import netns
from ..cluster.launcher import run_job
from .gates import time_to

RUNS = ("static", "capacity", "shadow", "flexmoe", "eplb")
SKEWED = ["--moe-gate", "switch", "--moe-top-k", "1", "--moe-aux-loss-coeff", "0"]
BALANCED = ["--moe-gate", "gshard", "--moe-top-k", "2", "--moe-second-expert-policy", "all",
            "--moe-aux-loss-coeff", "0.01"]
MODEL = ["--hidden", "256", "--layers", "4", "--heads", "4", "--ffn-hidden", "512", "--moe-every", "1",
         "--seq-len", "64", "--moe-num-experts", "16", "--lr", "3e-3", "--threads", "1",
         "--corpus-bytes", "1000000", "--eval-batches", "8", "--seed", "0", "--moe-expert-parallel-size", "4"]


def _flags(run: str, routing: List[str], steps: int, capacity_factor: float, out: str, batch_size: int = 8) -> List[str]:
    extra = {"static": [], "capacity": ["--moe-dispatch", "capacity", "--moe-capacity-factor", str(capacity_factor)],
             "shadow": ["--moe-placement", "shadow"], "flexmoe": ["--moe-placement", "flexmoe"],
             "eplb": ["--moe-placement", "eplb"]}[run]
    return ["megamoe", "train", *MODEL, "--batch-size", str(batch_size), *routing, *extra, "--steps", str(steps),
            "--eval-interval", str(max(steps // 8, 1)), "--log-interval", str(max(steps // 20, 1)),
            "--trace", os.path.join(out, "trace"), "--metrics-json", os.path.join(out, "metrics.json")]


def _efficiency(counts, per: int):
    """Per step: (balance ratio Eq. 6, expert efficiency) of [L, P, E] counts under contiguous blocks."""
    import torch
    loads = counts.to(torch.float64).sum(1).reshape(counts.shape[0], -1, per).sum(-1)      # [L, P]
    P = loads.shape[1]
    total = loads.sum(1).clamp_min(1)
    return (loads.max(1).values * P / total).mean().item(), (total / (P * loads.max(1).values.clamp_min(1))).mean().item()


def run_one(run: str, routing: List[str], steps: int, capacity_factor: float, inter: float, intra: Optional[float],
            out: str, port: int, batch_size: int = 8, cpu_shares=None) -> dict:
    from ..stats import load_trace
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    code = run_job(_flags(run, routing, steps, capacity_factor, out, batch_size), 2, 2, inter, intra,
                   master_port=port, log_dir=os.path.join(out, "logs"), timeout=3600, echo=lambda line: None,
                   say=lambda t: None, cpu_shares=cpu_shares)
    if code:
        raise RuntimeError(f"{run}: megamoe train exited with {code} (logs: {out}/logs)")
    with open(os.path.join(out, "metrics.json")) as f:
        m = json.load(f)
    counts = load_trace(os.path.join(out, "trace"))["counts"]            # [S, L, P, E]
    S = counts.shape[0]
    per = counts.shape[-1] // counts.shape[2]
    first = [_efficiency(counts[s], per) for s in range(S // 4)]
    last = [_efficiency(counts[s], per) for s in range(S - S // 4, S)]
    placed = [h.get("placement") or {} for h in m["history"]]
    routed = sum(h["moe"][lid]["tokens_per_expert"] and 1 for h in m["history"] for lid in h["moe"])
    drop = [s["dropped_fraction"] for h in m["history"] for s in h["moe"].values()]
    step_times = [4 * batch_size * 64 / h["tokens_per_s"] for h in m["history"][1:]]
    expert_eff = [p["expert_efficiency"] for p in placed if "expert_efficiency" in p] or [e for _, e in last]
    return {"run": run, "step_seconds": statistics.median(step_times), "final_valid_loss": m["evals"][-1]["loss"],
            "evals": m["evals"], "token_efficiency": 1.0 - (sum(drop) / len(drop) if drop else 0.0),
            "expert_efficiency": sum(expert_eff[-max(len(expert_eff) // 4, 1):]) / max(len(expert_eff[-max(len(expert_eff) // 4, 1):]), 1),
            "balance_first": sum(b for b, _ in first) / len(first), "balance_last": sum(b for b, _ in last) / len(last),
            "moves": max([p.get("moves_total", 0.0) for p in placed] + [0.0]),
            "shadowed_last": placed[-1].get("shadowed", 0.0) if placed else 0.0,
            "replicas_last": placed[-1].get("replicas", 0.0) if placed else 0.0,
            "bytes_moved_last": placed[-1].get("bytes_moved", 0.0) if placed else 0.0,
            "wall_seconds": time.time() - t0, "routed_lines": routed}


def main(argv: Optional[List[str]] = None) -> dict:
    p = argparse.ArgumentParser(prog="megamoe bench planners", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--inter-node-bandwidth", default="100MB/s")
    p.add_argument("--intra-node-bandwidth", default=None, help="default: unshaped loopback")
    p.add_argument("--balanced", action="store_true", help="also the balanced model (planners must stay idle)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences of 64 tokens per rank per step (8: 512 "
                   "tokens per rank; 32: 2,048, the papers' regime where the hot expert's activations exceed its "
                   "parameters)")
    p.add_argument("--cpu-share", default="auto", help="each rank's CPU share in cores (megamoe cluster run "
                   "--cpu-share): auto, off, one value or one per rank")
    p.add_argument("--out", default="results/bench_planners")
    args = p.parse_args(argv)
    why = netns.unavailable()
    if why:
        raise SystemExit(f"megamoe bench planners: {why}")
    inter = netns.parse_bandwidth(args.inter_node_bandwidth)
    intra = netns.parse_bandwidth(args.intra_node_bandwidth) if args.intra_node_bandwidth else None
    from ..cluster import cpu_caps
    shares = cpu_caps.parse_shares(args.cpu_share, 4)
    if shares and cpu_caps.unavailable():
        raise SystemExit(f"megamoe bench planners: --cpu-share {args.cpu_share}: {cpu_caps.unavailable()} "
                         "(--cpu-share off runs the ranks uncapped)")
    print(f"[bench planners] {4 * args.batch_size * 64} tokens per step ({args.batch_size * 64} per rank), ranks "
          + (f"capped at {shares[0]:g} core each (fixed-speed)" if shares else "uncapped (sharing the cores)"),
          flush=True)
    by_routing: Dict[str, list] = {}
    for label, routing in (("skewed", SKEWED),) + ((("balanced", BALANCED),) if args.balanced else ()):
        rows = []
        for i, run in enumerate(args.runs.split(",")):
            print(f"[bench planners] {label} {run} ...", flush=True)
            row = run_one(run, routing, args.steps, args.capacity_factor, inter, intra,
                          os.path.join(args.out, label, run), 29900 + 2 * i, args.batch_size, shares)
            rows.append(row)
            print(f"[bench planners] {label} {run}: step {row['step_seconds'] * 1e3:.0f} ms, moves {row['moves']:.0f}, "
                  f"balance {row['balance_first']:.2f}->{row['balance_last']:.2f}, valid loss "
                  f"{row['final_valid_loss']:.4f}", flush=True)
        target = max(min(e["loss"] for e in r["evals"]) for r in rows)
        for r in rows:
            r["target_loss"], r["time_to_target"] = target, time_to(r["evals"], target)
        by_routing[label] = rows
    # the shape `megamoe reproduce flexmoe --cluster-results DIR` reads
    results = {"setup": {"batch_size": args.batch_size, "tokens_per_rank": args.batch_size * 64,
                         "cpu_shares": shares, "inter_node_bandwidth": inter}, "cluster": by_routing}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(format_results(results), flush=True)
    return results


def format_results(results: dict) -> str:
    lines = [f"{'routing':<9} {'run':<9} {'step ms':>8} {'tok eff':>8} {'exp eff':>8} {'balance':>12} {'moves':>6} "
             f"{'valid loss':>10} {'time to target':>14}"]
    for label, rows in results["cluster"].items():
        for r in rows:
            ttt = f"{r['time_to_target']:.1f}s" if r.get("time_to_target") is not None else "not reached"
            lines.append(f"{label:<9} {r['run']:<9} {r['step_seconds'] * 1e3:>8.0f} {r['token_efficiency']:>8.3f} "
                         f"{r['expert_efficiency']:>8.3f} {r['balance_first']:>5.2f}->{r['balance_last']:<5.2f} "
                         f"{r['moves']:>6.0f} {r['final_valid_loss']:>10.4f} {ttt:>14}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
