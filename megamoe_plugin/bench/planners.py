"""``megamoe bench planners``: FlexMoE placement and FasterMoE shadowing against static expert parallelism, trained
on the emulated cluster (papers 001 §5, 003 §4.1).

A real-text MoE LM whose routing skews on its own (the embedded corpus, 16 experts, top-1, no balance loss: FlexMoE
§2.4 / Fig. 2), EP=4 on 2 nodes x 2, trained from the same seed and data with:

- ``static``: static expert parallelism, dropless;
- ``capacity``: static with a capacity factor (DeepSpeed-style drop and pad, ``--capacity-factor``);
- ``shadow``: FasterMoE dynamic shadowing; ``shadow_overlap``: the same with the copies' gradient reduces behind the
  backward of the layers below (``--moe-placement-overlap-sync``); ``flexmoe``: FlexMoE vExperts;
  ``flexmoe_overlap``: the same with the replicas' gradient all-reduces behind the backward
  (``--moe-placement-overlap-sync``);
  ``eplb``: DeepSeek's EPLB (one spare slot per rank, like FlexMoE); all with
  the default cost model (the start-up calibration of this cluster, ``--moe-placement-profile auto``);
- ``shadow_unguarded``, ``flexmoe_unguarded``, ``eplb_unguarded``: the policy with the pay-off guard off
  (``--moe-placement-guard -1``): what the guard's verdicts and its least resolvable gain cost or save;
- ``idle``: FlexMoE's data path (placement runtime, one spare slot per rank, per-step counts) with the policy never
  run (interval beyond the run): what having placement on costs before it decides anything.

The runs with replicas (``flexmoe``, ``flexmoe_overlap``, ``eplb``, ``idle``) also run as
``<run>_spare<N>``: with N spare slots per rank instead of their default one (``--moe-placement-spare-slots``), to
compare planners at equal spare slots or to see what more replicas buy. The runs with a policy also run as
``<run>_every<K>`` (after any ``_spare<N>``): the policy run every K steps (``--moe-placement-interval``), to compare
how fast a planner follows the routing against how noisy its verdicts' windows get.

Every rank is a fixed-speed device by default (``--cpu-share auto``: its own CPU cgroup capped at 0.9 x cores /
ranks), so a loaded rank cannot borrow the cores its idle peers leave; ``--batch-size`` sets the tokens per rank per
step (x 64). Rounds alternate the order of the runs (``--runs`` as given, then reversed: ``round_order``).

Per run: the measured step time (median of the log lines after the first; also the mean over the whole run, policy
costs included: training seconds / steps; and the median of the second half: the steady state after the policies
settled), token efficiency (kept / routed),
expert efficiency (FlexMoE §5.4: useful expert rows over P x the busiest rank's rows, under the placement each step
ran with), the balance ratio over time (Eq. 6, first and last quarter), moves and bytes moved, the validation loss
at the end and the training time to a common target loss (the worst of the runs' best losses). Per cell, the
balance bound: static's step less the expert compute that perfect balance would save on this routing (every rank at
the mean expert load, nothing paid for it), priced with the profile the planners calibrated. Compute only: the
all-to-all that a balanced placement also evens out (the busiest rank receives fewer tokens) is not in it, so a
planner can beat it. With ``--balanced``
the same four on a balanced model (gshard top-2, balance loss 0.01): the planners must stay idle there.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from typing import Dict, List, Optional

from ..cluster import netns
from ..cluster.launcher import run_job
from .gates import time_to

RUNS = ("static", "capacity", "shadow", "shadow_overlap", "shadow_unguarded", "flexmoe",
        "flexmoe_overlap", "flexmoe_unguarded", "eplb", "eplb_unguarded", "idle")
# run only when asked: they explain the others' numbers
DIAGNOSTIC_RUNS = ("shadow_unguarded", "flexmoe_unguarded", "eplb_unguarded", "idle")
# these also run as <run>_spare<N>: N spare slots per rank
REPLICA_RUNS = ("flexmoe", "flexmoe_overlap", "flexmoe_unguarded", "eplb", "eplb_unguarded", "idle")
# these also run as <run>[_spare<N>][_every<K>]: the policy run every K steps (--moe-placement-interval)
POLICY_RUNS = ("shadow", "shadow_overlap", "shadow_unguarded", "flexmoe", "flexmoe_overlap",
               "flexmoe_unguarded", "eplb", "eplb_unguarded")
SKEWED = ["--moe-gate", "switch", "--moe-top-k", "1", "--moe-aux-loss-coeff", "0"]
BALANCED = ["--moe-gate", "gshard", "--moe-top-k", "2", "--moe-second-expert-policy", "all",
            "--moe-aux-loss-coeff", "0.01"]
MODEL = ["--hidden", "256", "--layers", "4", "--heads", "4", "--ffn-hidden", "512", "--moe-every", "1",
         "--seq-len", "64", "--moe-num-experts", "16", "--lr", "3e-3", "--threads", "1",
         "--corpus-bytes", "1000000", "--eval-batches", "8", "--seed", "0", "--moe-expert-parallel-size", "4"]


def split_run(run: str):
    """(one of RUNS, spare slots per rank or None, policy interval or None, guard margin or None) of a run name:
    ``flexmoe_overlap_spare2_every5_guard0`` is flexmoe_overlap with two spare slots per rank (the placements with
    replicas only), its policy run every 5 steps and the pay-off guard's margin 0% (the placements with a policy
    and the guard on only); None for a name that is not a run."""
    found = re.fullmatch(r"(.+?)(?:_spare(\d+))?(?:_every(\d+))?(?:_guard(\d+))?", run)
    base, spare, every, guard = found[1], found[2], found[3], found[4]
    if base not in RUNS or (spare is not None and (base not in REPLICA_RUNS or int(spare) < 1)) \
            or ((every is not None or guard is not None) and base not in POLICY_RUNS) \
            or (guard is not None and base.endswith("_unguarded")) \
            or (every is not None and int(every) < 1):
        return None
    return base, (int(spare) if spare else None), (int(every) if every else None), \
        (int(guard) / 100 if guard else None)


def round_order(runs: List[str], k: int) -> List[str]:
    """The order round ``k`` (from 0) runs ``runs`` in: as given in even rounds, reversed in odd ones (A B B A), so a
    drift of the machine's speed within a pair of rounds falls on every run alike, not on the first (static)."""
    return list(runs) if k % 2 == 0 else list(reversed(runs))


def run_order(run: str):
    base, spare, every, guard = split_run(run)
    return RUNS.index(base), spare or 0, every or 0, -1 if guard is None else guard


def run_flags(run: str, capacity_factor: float) -> List[str]:
    """The ``megamoe train`` flags of one of RUNS (or ``<run>_spare<N>_every<K>_guard<M>``, ``split_run``)."""
    base, spare, every, guard = split_run(run)
    return (_base_flags(base, capacity_factor) + (["--moe-placement-spare-slots", str(spare)] if spare else [])
            + (["--moe-placement-interval", str(every)] if every else [])
            + (["--moe-placement-guard", str(guard)] if guard is not None else []))


def _base_flags(run: str, capacity_factor: float) -> List[str]:
    if run.endswith("_unguarded"):                     # the policy's run with the pay-off guard off
        return _base_flags(run[:-len("_unguarded")], capacity_factor) + ["--moe-placement-guard", "-1"]
    return {"static": [], "capacity": ["--moe-dispatch", "capacity", "--moe-capacity-factor", str(capacity_factor)],
            "shadow": ["--moe-placement", "shadow"],
            "shadow_overlap": ["--moe-placement", "shadow", "--moe-placement-overlap-sync"],
            "flexmoe": ["--moe-placement", "flexmoe"],
            "flexmoe_overlap": ["--moe-placement", "flexmoe", "--moe-placement-overlap-sync"],
            "eplb": ["--moe-placement", "eplb"],
            "idle": ["--moe-placement", "flexmoe", "--moe-placement-interval", "1000000000"]}[run]


def _flags(extra: List[str], routing: List[str], steps: int, out: str, batch_size: int = 8, seed: int = 0) -> List[str]:
    model = list(MODEL)
    model[model.index("--seed") + 1] = str(seed)
    return ["megamoe", "train", *model, "--batch-size", str(batch_size), *routing, *extra, "--steps", str(steps),
            "--eval-interval", str(max(steps // 8, 1)), "--log-interval", str(max(steps // 20, 1)),
            "--trace", os.path.join(out, "trace"), "--metrics-json", os.path.join(out, "metrics.json")]


def _efficiency(counts, per: int):
    """Per step: (balance ratio Eq. 6, expert efficiency) of [L, P, E] counts under contiguous blocks."""
    import torch
    loads = counts.to(torch.float64).sum(1).reshape(counts.shape[0], -1, per).sum(-1)      # [L, P]
    P = loads.shape[1]
    total = loads.sum(1).clamp_min(1)
    return (loads.max(1).values * P / total).mean().item(), (total / (P * loads.max(1).values.clamp_min(1))).mean().item()


def _second_half_mean(values: List[float]) -> Optional[float]:
    half = values[len(values) // 2:]
    return sum(half) / len(half) if half else None


def _predicted_saving(placed: List[dict]) -> Optional[float]:
    """The cost model's predicted MoE saving per step over static placement, mean of the second half of the
    policy's runs (None for a run without a policy)."""
    pairs = [(p["predicted_static_step_s"], p["predicted_step_s"]) for p in placed
             if "predicted_static_step_s" in p and "predicted_step_s" in p]
    if not pairs:
        return None
    half = pairs[len(pairs) // 2:]
    return sum(a - b for a, b in half) / len(half)


def _profile_of(out: str) -> Optional[str]:
    """The calibrated profile a run's policy used (the path its rank-0 log names), None without one."""
    try:
        with open(os.path.join(out, "logs", "rank0.log")) as f:
            text = f.read()
    except OSError:
        return None
    found = re.findall(r"placement cost model: .*?(?:cached in |calibration of this cluster \()(\S+?\.json)", text)
    return found[-1] if found and os.path.exists(found[-1]) else None


def balance_bound_saving(counts, profile_path: Optional[str]) -> Optional[float]:
    """The expert compute per step that perfect balance would save on this routing, by the cost model of
    ``profile_path``: that of the static blocks ([S, L, P, E] counts, second half of the steps) less that of every
    rank holding the mean load, with nothing paid for it (no replica synchronisation, no moves). The all-to-all is
    left out (a balance also evens out what the busiest rank receives), so a planner can save more than this."""
    if profile_path is None:
        return None
    import torch

    from ..perfmodel.cost import LayerShape
    from ..perfmodel.profiles import HardwareProfile
    hidden, ffn = int(MODEL[MODEL.index("--hidden") + 1]), int(MODEL[MODEL.index("--ffn-hidden") + 1])
    S, L, P, E = counts.shape
    cm = HardwareProfile.load(profile_path).cost_model(LayerShape(hidden, ffn, E), world_size=P)
    saved = []
    for s in range(S // 2, S):
        loads = counts[s].to(torch.float64).sum(1).reshape(L, P, E // P).sum(-1)          # [L, P] rows per rank
        saved.append(sum(3.0 * (cm.compute_time(row) - cm.compute_time(torch.full_like(row, float(row.mean()))))
                         for row in loads))
    return sum(saved) / len(saved) if saved else None


def run_one(run: str, routing: List[str], steps: int, extra: List[str], inter: float, intra: Optional[float],
            out: str, port: int, batch_size: int = 8, cpu_shares=None, seed: int = 0) -> dict:
    """Train ``run`` (``megamoe train`` with ``extra`` flags) on the 2 x 2 emulated cluster; its measured row."""
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    code = run_job(_flags(extra, routing, steps, out, batch_size, seed), 2, 2, inter, intra,
                   master_port=port, log_dir=os.path.join(out, "logs"), timeout=3600, echo=lambda line: None,
                   say=lambda t: None, cpu_shares=cpu_shares)
    if code:
        raise RuntimeError(f"{run}: megamoe train exited with {code} (logs: {out}/logs)")
    return dict(read_run(run, out, batch_size, seed), wall_seconds=time.time() - t0)


def step_seconds(record: dict, batch_size: int) -> float:
    """Seconds per step of one logged interval of a run on the 2 x 2 cluster (4 ranks x batch x 64 tokens)."""
    return 4 * batch_size * 64 / record["tokens_per_s"]


def read_run(run: str, out: str, batch_size: int, seed: int = 0) -> dict:
    """The measured row of a finished run from its folder (metrics.json, trace, logs/network.json)."""
    from ..stats import load_trace
    with open(os.path.join(out, "metrics.json")) as f:
        m = json.load(f)
    with open(os.path.join(out, "logs", "network.json")) as f:
        link_bytes = sum(v["sent"] for v in json.load(f)["nodes"].values())
    counts = load_trace(os.path.join(out, "trace"))["counts"]            # [S, L, P, E]
    S = counts.shape[0]
    per = counts.shape[-1] // counts.shape[2]
    first = [_efficiency(counts[s], per) for s in range(S // 4)]
    last = [_efficiency(counts[s], per) for s in range(S - S // 4, S)]
    placed = [h.get("placement") or {} for h in m["history"]]
    routed = sum(h["moe"][lid]["tokens_per_expert"] and 1 for h in m["history"] for lid in h["moe"])
    drop = [s["dropped_fraction"] for h in m["history"] for s in h["moe"].values()]
    step_times = [step_seconds(h, batch_size) for h in m["history"][1:]]
    expert_eff = [p["expert_efficiency"] for p in placed if "expert_efficiency" in p] or [e for _, e in last]
    return {"run": run, "step_seconds": statistics.median(step_times),
            "mean_step_seconds": m["train_seconds"] / max(m["step"], 1),
            "late_step_seconds": statistics.median(step_times[len(step_times) // 2:]),
            "final_valid_loss": m["evals"][-1]["loss"],
            "evals": m["evals"], "token_efficiency": 1.0 - (sum(drop) / len(drop) if drop else 0.0),
            "expert_efficiency": sum(expert_eff[-max(len(expert_eff) // 4, 1):]) / max(len(expert_eff[-max(len(expert_eff) // 4, 1):]), 1),
            "balance_first": sum(b for b, _ in first) / len(first), "balance_last": sum(b for b, _ in last) / len(last),
            "moves": max([p.get("moves_total", 0.0) for p in placed] + [0.0]),
            "shadowed_last": placed[-1].get("shadowed", 0.0) if placed else 0.0,
            "shadow_wait_s": _second_half_mean([p["shadow_wait_s"] for p in placed if "shadow_wait_s" in p]),
            "sync_wait_s": _second_half_mean([p["sync_wait_s"] for p in placed if "sync_wait_s" in p]),
            "move_wait_total_s": max([p.get("move_wait_total_s", 0.0) for p in placed] + [0.0]),
            "replicas_last": placed[-1].get("replicas", 0.0) if placed else 0.0,
            "bytes_moved_last": placed[-1].get("bytes_moved", 0.0) if placed else 0.0,
            "bytes_moved_total": max([p.get("bytes_moved_total", 0.0) for p in placed] + [0.0]),
            "predicted_saving_s": _predicted_saving(placed),
            "bound_saving_s": balance_bound_saving(counts, _profile_of(out)),
            "link_bytes_per_step": link_bytes / m["step"], "seed": seed, "routed_lines": routed}


def _skewed(aux_loss: float) -> List[str]:
    """Switch top-1 routing with the given balance-loss coefficient (0: no balance loss, the most skewed)."""
    return SKEWED[:-1] + [f"{aux_loss:g}"]


def _summarise(rounds: List[dict]) -> dict:
    """One run's rounds as one row: the medians of the step time and the time to target (spread kept), the
    rest from the round with the median step."""
    by_step = sorted(rounds, key=lambda r: r["step_seconds"])
    row = dict(by_step[len(by_step) // 2])
    for key in ("step_seconds", "mean_step_seconds", "late_step_seconds"):
        row[f"{key}_rounds"] = [r[key] for r in rounds]
        row[key] = statistics.median(row[f"{key}_rounds"])
    ttt = [r["time_to_target"] for r in rounds if r.get("time_to_target") is not None]
    row["time_to_target_rounds"] = [r.get("time_to_target") for r in rounds]
    row["time_to_target"] = statistics.median(ttt) if len(ttt) == len(rounds) else None
    return row


def _predicted_vs_measured(rows: List[dict]) -> None:
    """Each run's speed-up over static per step: measured (median steps), and predicted by the cost model: the
    static run's measured step less the model's predicted MoE saving per step of the run's placement (its
    ``predicted_static_step_s - predicted_step_s``, second half of the run)."""
    static = next((r for r in rows if r["run"] == "static"), None)
    for r in rows:
        r["measured_speedup"] = static["step_seconds"] / r["step_seconds"] if static else None
        r["mean_speedup"] = static["mean_step_seconds"] / r["mean_step_seconds"] if static else None
        r["late_speedup"] = static["late_step_seconds"] / r["late_step_seconds"] if static else None
        saving = r.get("predicted_saving_s")
        r["predicted_speedup"] = (static["step_seconds"] / max(static["step_seconds"] - saving, 1e-9)
                                  if static and saving is not None else None)
    bound = [r["bound_saving_s"] for r in rows if r.get("bound_saving_s") is not None and r["run"] != "static"]
    if static and bound:          # the planners' runs: static's seed and data, so its routing up to rounding
        saving = statistics.median(bound)
        static["bound_speedup"] = static["step_seconds"] / max(static["step_seconds"] - saving, 1e-9)


def main(argv: Optional[List[str]] = None) -> dict:
    p = argparse.ArgumentParser(prog="megamoe bench planners", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default=",".join(r for r in RUNS if r not in DIAGNOSTIC_RUNS),
                   help=f"comma list of {', '.join(RUNS)} (default: all but {', '.join(DIAGNOSTIC_RUNS)}); "
                        f"{', '.join(REPLICA_RUNS)} also as <run>_spare<N>: with N spare slots per rank; "
                        f"{', '.join(POLICY_RUNS)} also with _every<K> (after any _spare<N>): the policy run every "
                        "K steps")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--inter-node-bandwidth", default="100MB/s", help="one value or a comma list (a sweep)")
    p.add_argument("--intra-node-bandwidth", default=None, help="default: unshaped loopback")
    p.add_argument("--balanced", action="store_true", help="also the balanced model (planners must stay idle)")
    p.add_argument("--batch-size", default="8", help="sequences of 64 tokens per rank per step, or a comma list "
                   "(8: 512 tokens per rank; 32: 2,048, the papers' regime where the hot expert's activations "
                   "exceed its parameters)")
    p.add_argument("--aux-loss", default="0", help="the skewed model's balance-loss coefficient, or a comma list "
                   "(0: no balance loss, the most skewed; 0.01: milder skew)")
    p.add_argument("--rounds", type=int, default=1, help="rounds, each running every run once, interleaved "
                   "(in the order of --runs, reversed in every second round; medians and spread reported)")
    p.add_argument("--cpu-share", default="auto", help="each rank's CPU share in cores (megamoe cluster run "
                   "--cpu-share): auto, off, one value or one per rank")
    p.add_argument("--out", default="results/bench_planners")
    p.add_argument("--report-only", action="store_true", help="run nothing: summarise the runs already in --out "
                   "(its <cell>/round<k>/<run> folders) with this version's columns")
    args = p.parse_args(argv)
    if args.report_only:
        return report_only(args.out)
    try:
        inters = [netns.parse_bandwidth(b) for b in args.inter_node_bandwidth.split(",")]
        batches = [int(b) for b in args.batch_size.split(",")]
        aux = [float(a) for a in args.aux_loss.split(",")]
    except ValueError as e:
        raise SystemExit(f"megamoe bench planners: --inter-node-bandwidth / --batch-size / --aux-loss: {e}")
    if args.rounds < 1 or min(batches) < 1:
        raise SystemExit("megamoe bench planners: --rounds and --batch-size must be >= 1")
    runs = args.runs.split(",")
    unknown = [r for r in runs if split_run(r) is None]
    if unknown:
        raise SystemExit(f"megamoe bench planners: --runs {','.join(unknown)}: unknown; known: {','.join(RUNS)}, "
                         f"and {'|'.join(REPLICA_RUNS)} with _spare<N> (N >= 1 spare slots per rank), "
                         f"{'|'.join(POLICY_RUNS)} with _every<K> (K >= 1 steps) and _guard<M> (the guard's "
                         f"margin M%)")
    why = netns.unavailable()
    if why:
        raise SystemExit(f"megamoe bench planners: {why}")
    intra = netns.parse_bandwidth(args.intra_node_bandwidth) if args.intra_node_bandwidth else None
    from ..cluster import cpu_caps
    shares = cpu_caps.bench_shares(args.cpu_share, 4, "megamoe bench planners")
    print(f"[bench planners] {cpu_caps.describe(shares)}; {args.rounds} interleaved round(s) of {','.join(runs)} "
          "per cell", flush=True)
    cells = []
    for batch in batches:
        for inter in inters:
            routings = [(f"skewed aux {a:g}" if len(aux) > 1 else "skewed", _skewed(a), a) for a in aux]
            routings += [("balanced", BALANCED, None)] if args.balanced else []
            for label, routing, a in routings:
                cell = {"tokens_per_rank": batch * 64, "batch_size": batch, "inter_node_bandwidth": inter,
                        "routing": label, "aux_loss": a}
                tag = f"t{batch * 64}_bw{inter / 1e6:g}_{label.replace(' ', '_')}"
                per_run: Dict[str, list] = {r: [] for r in runs}
                for k in range(args.rounds):
                    done = []
                    for run in round_order(runs, k):
                        print(f"[bench planners] {tag} round {k + 1} {run} ...", flush=True)
                        row = run_one(run, routing, args.steps, run_flags(run, args.capacity_factor), inter, intra,
                                      os.path.join(args.out, tag, f"round{k}", run), 29900 + 2 * runs.index(run),
                                      batch, shares)
                        done.append(row)
                        print(f"[bench planners] {tag} round {k + 1} {run}: step {row['step_seconds'] * 1e3:.0f} ms, "
                              f"moves {row['moves']:.0f}, valid loss {row['final_valid_loss']:.4f}", flush=True)
                    target = max(min(e["loss"] for e in r["evals"]) for r in done)
                    for r in done:
                        r["target_loss"], r["time_to_target"] = target, time_to(r["evals"], target)
                        per_run[r["run"]].append(r)
                cell["rows"] = _finish_cell(per_run, runs)
                cells.append(cell)
    # "cluster": the first cell's rows by routing, the shape `megamoe reproduce flexmoe --cluster-results` reads
    first = cells[0]
    results = {"setup": {"cpu_shares": shares, "rounds": args.rounds, "steps": args.steps,
                         "capacity_factor": args.capacity_factor, "batch_size": first["batch_size"],
                         "tokens_per_rank": first["tokens_per_rank"],
                         "inter_node_bandwidth": first["inter_node_bandwidth"]},
               "cells": cells,
               "cluster": {c["routing"]: c["rows"] for c in cells
                           if (c["batch_size"], c["inter_node_bandwidth"]) == (first["batch_size"],
                                                                            first["inter_node_bandwidth"])}}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(format_results(results), flush=True)
    return results


def _finish_cell(per_run: Dict[str, list], runs: List[str]) -> List[dict]:
    rows = [_summarise(per_run[r]) for r in runs if per_run.get(r)]
    _predicted_vs_measured(rows)
    return rows


def report_only(out: str) -> dict:
    """Summarise the run folders under ``out`` (``t<tokens>_bw<MB/s>_<routing>/round<k>/<run>``) without running
    anything; results.json is rewritten with this version's columns."""
    old = {}
    if os.path.exists(os.path.join(out, "results.json")):
        with open(os.path.join(out, "results.json")) as f:
            old = json.load(f).get("setup", {})
    cells = []
    for tag in sorted(os.listdir(out), key=lambda t: (-int(t[1:].split("_")[0]) if t[1:].split("_")[0].isdigit()
                                                      else 0, t)):
        found = re.fullmatch(r"t(\d+)_bw([0-9.]+)_(.+)", tag)
        if not found or not os.path.isdir(os.path.join(out, tag)):
            continue
        tokens, bw, label = int(found[1]), float(found[2]) * 1e6, found[3].replace("_", " ")
        per_run: Dict[str, list] = {}
        rounds = sorted(d for d in os.listdir(os.path.join(out, tag)) if d.startswith("round"))
        for rnd in rounds:
            done = []
            names = sorted((r for r in os.listdir(os.path.join(out, tag, rnd)) if split_run(r)), key=run_order)
            for run in names:
                d = os.path.join(out, tag, rnd, run)
                if os.path.exists(os.path.join(d, "metrics.json")):
                    done.append(read_run(run, d, tokens // 64))
            if not done:
                continue
            target = max(min(e["loss"] for e in r["evals"]) for r in done)
            for r in done:
                r["target_loss"], r["time_to_target"] = target, time_to(r["evals"], target)
                per_run.setdefault(r["run"], []).append(r)
        cells.append({"tokens_per_rank": tokens, "batch_size": tokens // 64, "inter_node_bandwidth": bw,
                      "routing": label, "rows": _finish_cell(per_run, sorted(per_run, key=run_order))})
    first = cells[0]
    results = {"setup": dict(old, report_only=True), "cells": cells,
               "cluster": {c["routing"]: c["rows"] for c in cells
                           if (c["batch_size"], c["inter_node_bandwidth"]) == (first["batch_size"],
                                                                            first["inter_node_bandwidth"])}}
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(format_results(results), flush=True)
    return results


def format_results(results: dict) -> str:
    lines = [f"{'tokens':>6} {'inter':>7} {'routing':<15} {'run':<11} {'step ms':>8} {'measured':>8} {'mean':>6} "
             f"{'late':>6} {'predicted':>9} {'tok eff':>7} {'exp eff':>7} {'moves':>6} {'MB moved':>8} {'valid loss':>10} "
             f"{'to target':>9}"]
    cells = results.get("cells") or [{"tokens_per_rank": results.get("setup", {}).get("tokens_per_rank", 0),
                                       "inter_node_bandwidth": results.get("setup", {}).get("inter_node_bandwidth", 0),
                                       "routing": label, "rows": rows}
                                      for label, rows in results["cluster"].items()]
    for c in cells:
        for r in c["rows"]:
            ttt = f"{r['time_to_target']:.1f}s" if r.get("time_to_target") is not None else "-"
            ms = r.get("measured_speedup")
            ps = r.get("predicted_speedup")
            mean, late = r.get("mean_speedup"), r.get("late_speedup")
            lines.append(f"{c['tokens_per_rank']:>6} {(c['inter_node_bandwidth'] or 0) / 1e6:>4.0f}MB/s "
                         f"{c['routing']:<15} {r['run']:<11} {r['step_seconds'] * 1e3:>8.0f} "
                         f"{(f'{ms:.2f}x' if ms else '-'):>8} {(f'{mean:.2f}x' if mean else '-'):>6} "
                         f"{(f'{late:.2f}x' if late else '-'):>6} {(f'{ps:.2f}x' if ps else '-'):>9} "
                         f"{r['token_efficiency']:>7.3f} {r['expert_efficiency']:>7.3f} {r['moves']:>6.0f} "
                         f"{r.get('bytes_moved_total', 0.0) / 1e6:>8.1f} {r['final_valid_loss']:>10.4f} {ttt:>9}")
        for r in c["rows"]:
            for key, what in (("sync_wait_s", "replicas' all-reduces"), ("shadow_wait_s", "shadows' reduces")):
                if r.get(key):
                    lines.append(f"{'':>6} {'':>11} {c['routing']:<15} {r['run']}: {r[key] * 1e3:.1f} ms per step "
                                 f"waited at the backward's end for the overlapped {what} (second half)")
            if r.get("moves") and r.get("move_wait_total_s"):
                lines.append(f"{'':>6} {'':>11} {c['routing']:<15} {r['run']}: {r['move_wait_total_s']:.2f} s "
                             "spent on the moves' transfers, slowest rank (blocking)")
        bound = next((r["bound_speedup"] for r in c["rows"] if r.get("bound_speedup")), None)
        if bound:
            lines.append(f"{'':>6} {'':>11} {c['routing']:<15} balance bound: {bound:.2f}x of static's step "
                         "(expert compute at the mean load on every rank, for free; the all-to-all left out; "
                         "predicted with the runs' calibrated profile)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
