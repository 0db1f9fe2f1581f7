"""``megamoe bench capacity``: DynaMoE's dynamic capacity against static capacity factors and dropless dispatch, trained
on the emulated cluster (paper 000 §4.1, §5.1 Fig. 6 / Fig. 9), where its mechanism can show: less padding in the
experts' compute and in the all-to-all over a slow inter-node link.

The real-text MoE LM of ``megamoe bench planners`` (the embedded corpus, 16 experts, EP=4 on 2 nodes x 2, every rank
a fixed-speed device by default: ``--cpu-share auto``), Switch top-1 with the 0.01 balance loss (DynaMoE's gate),
trained from the same data with each of:

- ``CF=1.0``, ``CF=1.25``, ``CF=1.5``, ``CF=2.0`` (and on request ``CF=3.0``, ``CF=4.0``): capacity dispatch with
  one static capacity factor (GShard's drop and pad);
- ``dynamic``: ``--moe-capacity-policy dynamic`` (per-expert moving average + max(20% headroom, 2 standard
  deviations), RECOMPILE off the critical path); ``dynamic q=0.9``: each expert's capacity the 0.9-quantile of its
  demand over the last 32 steps;
- ``dynamic+cache``: ``dynamic`` plus sample-assignment caching (§4.2; on at ``--cache-on`` of the tokens not
  reassigned over an epoch, the paper's 96%, off below ``--cache-off``, never before ``--cache-min-epoch``). It
  switches on only where the assignments converge: a small dataset over many epochs (the caching regime:
  ``--configs dynamic,dynamic+cache --max-train-samples 32 --steps 240 --cache-on 0.8 --cache-off 0.75``; at
  96% the kept fraction of that run plateaus near 92%). Its rows add the epoch caching switched on, the layer
  calls dispatched from the cache and the step time over the steps it was on, beside ``dynamic``'s over the same
  steps, with the same comparison over the steps before it (equal work: the noise floor);
- ``dropless``: no capacity, nothing dropped (the quality reference).

Every seed (``--seeds``) runs each configuration once, interleaved (seed by seed). Per run: the median step time,
the dropped fraction of the assignments, the bytes over the inter-node links per step (measured on the links,
every collective included), the final validation loss. Per configuration: mean and standard deviation over the
seeds, and ``drop_vs_step.png``: dropped fraction against step time with error bars. A dynamic policy dominates the
static curve where no static factor (nor dropless dispatch) is both faster and drops less (``dominated_by`` lists
those that are); the results say where.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import textwrap
from typing import Dict, List, Optional

from ..cluster import cpu_caps, netns
from .planners import run_one, step_seconds

CAPACITY = ["--moe-dispatch", "capacity"]
CONFIGS = {
    "CF=1.0": CAPACITY + ["--moe-capacity-factor", "1.0"],
    "CF=1.25": CAPACITY + ["--moe-capacity-factor", "1.25"],
    "CF=1.5": CAPACITY + ["--moe-capacity-factor", "1.5"],
    "CF=2.0": CAPACITY + ["--moe-capacity-factor", "2.0"],
    "CF=3.0": CAPACITY + ["--moe-capacity-factor", "3.0"],
    "CF=4.0": CAPACITY + ["--moe-capacity-factor", "4.0"],
    "dynamic": CAPACITY + ["--moe-capacity-policy", "dynamic"],
    "dynamic q=0.9": CAPACITY + ["--moe-capacity-policy", "quantile"],
    "dynamic+cache": CAPACITY + ["--moe-capacity-policy", "dynamic", "--moe-assignment-cache"],
    "dropless": [],
}
DEFAULT_CONFIGS = ["CF=1.0", "CF=1.25", "CF=1.5", "CF=2.0", "dynamic", "dynamic q=0.9", "dropless"]
ROUTING = ["--moe-gate", "switch", "--moe-top-k", "1", "--moe-aux-loss-coeff", "0.01"]


def _mean_sd(values: List[float]) -> tuple:
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarise(rows: Dict[str, List[dict]]) -> Dict[str, dict]:
    """Per configuration: mean and standard deviation over its seeds of step time, dropped fraction, link bytes
    and final validation loss; for the dynamic ones, the static factors (and dropless dispatch, the end of the
    static curve) that dominate them (faster and fewer drops, beyond one standard deviation of both)."""
    out = {}
    for name, runs in rows.items():
        step = _mean_sd([r["step_seconds"] for r in runs])
        drop = _mean_sd([1.0 - r["token_efficiency"] for r in runs])
        out[name] = {"seeds": [r["seed"] for r in runs], "step_seconds": step, "dropped": drop,
                     "link_bytes_per_step": _mean_sd([r["link_bytes_per_step"] for r in runs]),
                     "final_valid_loss": _mean_sd([r["final_valid_loss"] for r in runs])}
    for name, s in out.items():
        if name.startswith("dynamic"):
            s["dominated_by"] = [
                other for other, o in out.items() if (other.startswith("CF=") or other == "dropless")
                and o["step_seconds"][0] + o["step_seconds"][1] < s["step_seconds"][0] - s["step_seconds"][1]
                and o["dropped"][0] + o["dropped"][1] < s["dropped"][0] - s["dropped"][1]]
    return out


def logged_intervals(out: str, batch_size: int) -> dict:
    """A finished run's per-step time of every logged interval and its assignment-cache record, from its
    metrics.json: ``intervals`` [(first step, last step, seconds per step, caching on through it)], and for a run
    with the cache its per-epoch ``cache_history`` (epoch, fraction not reassigned, on after it), ``cache_on_epoch``
    (the first epoch it was on, or None) and ``cached_calls`` (layer calls dispatched from the cache)."""
    with open(os.path.join(out, "metrics.json")) as f:
        m = json.load(f)
    intervals, prev_step, prev_on = [], 0, False
    for h in m["history"]:
        on = bool((h.get("dynamic") or {}).get("cache_on", 0.0))
        intervals.append((prev_step + 1, h["step"], step_seconds(h, batch_size), prev_on and on))
        prev_step, prev_on = h["step"], on
    out_row = {"intervals": intervals}
    if "cache_on" in (m.get("dynamic") or {}):
        history = m.get("cache_history") or []
        out_row.update(cache_history=history, cache_on_epoch=next((e + 1 for e, _, on in history if on), None),
                       cached_calls=m["dynamic"].get("cached_calls", 0.0))
    return out_row


def cache_comparison(rows: Dict[str, List[dict]]) -> Optional[dict]:
    """Per seed: dynamic+cache's median step time over the logged intervals it had caching on throughout, against
    dynamic's over the same intervals (``ratio`` > 1: caching faster), the same over the intervals before caching
    switched on (``off_ratio``: equal work, the noise floor) and the whole runs' ratio; None without both
    configurations."""
    if "dynamic+cache" not in rows or "dynamic" not in rows:
        return None
    base = {r["seed"]: r for r in rows["dynamic"]}
    per_seed = []
    for r in rows["dynamic+cache"]:
        b = base.get(r["seed"])
        if b is None:
            continue
        theirs = {(a, z): t for a, z, t, _ in b["intervals"]}
        on = [(a, z, t) for a, z, t, flag in r["intervals"] if flag and (a, z) in theirs]
        row = {"seed": r["seed"], "cache_on_epoch": r.get("cache_on_epoch"), "cached_calls": r.get("cached_calls"),
               "steps_on": sum(z - a + 1 for a, z, _ in on), "whole_run_ratio": b["step_seconds"] / r["step_seconds"]}
        if on:
            row["on_step_seconds"] = statistics.median(t for _, _, t in on)
            row["dynamic_step_seconds"] = statistics.median(theirs[(a, z)] for a, z, _ in on)
            row["ratio"] = row["dynamic_step_seconds"] / row["on_step_seconds"]
            # the control: the same comparison over the steps before caching switched on, where both runs did
            # the same work, so its distance from 1 is the run-to-run noise of the measurement
            before = [(a, z, t) for a, z, t, _ in r["intervals"] if z < on[0][0] and (a, z) in theirs]
            if before:
                row["off_ratio"] = (statistics.median(theirs[(a, z)] for a, z, _ in before)
                                    / statistics.median(t for _, _, t in before))
        per_seed.append(row)
    ratios = [x["ratio"] for x in per_seed if "ratio" in x]
    controls = [x["off_ratio"] for x in per_seed if "off_ratio" in x]
    return {"per_seed": per_seed, "ratio": _mean_sd(ratios) if ratios else None,
            "off_ratio": _mean_sd(controls) if controls else None,
            "seeds_on": sum(1 for x in per_seed if x["cache_on_epoch"] is not None)}


def format_cache(comparison: dict) -> str:
    lines = ["assignment caching (dynamic+cache against dynamic, same seed, same steps):"]
    for x in comparison["per_seed"]:
        if x["cache_on_epoch"] is None:
            lines.append(f"  seed {x['seed']}: caching never switched on (whole run {x['whole_run_ratio']:.3f}x)")
            continue
        lines.append(f"  seed {x['seed']}: on from epoch {x['cache_on_epoch']}, {x['cached_calls']:.0f} layer calls "
                     f"from the cache, {x['steps_on']} steps on throughout"
                     + (f": {x['on_step_seconds'] * 1e3:.0f} ms vs {x['dynamic_step_seconds'] * 1e3:.0f} ms per "
                        f"step ({x['ratio']:.3f}x)" if "ratio" in x else "")
                     + (f", before it {x['off_ratio']:.3f}x (same work)" if "off_ratio" in x else "")
                     + f"; whole run {x['whole_run_ratio']:.3f}x")
    if comparison["ratio"] is not None:
        lines.append(f"  steps with caching on: {comparison['ratio'][0]:.3f}x ± {comparison['ratio'][1]:.3f} "
                     f"over {len([x for x in comparison['per_seed'] if 'ratio' in x])} seed(s)"
                     + (f"; before caching was on (same work, the noise floor): {comparison['off_ratio'][0]:.3f}x "
                        f"± {comparison['off_ratio'][1]:.3f}" if comparison["off_ratio"] is not None else ""))
    return "\n".join(lines)


def plot(summary: Dict[str, dict], path: str, label: str) -> Optional[str]:
    """Dropped fraction against step time, error bars one standard deviation over the seeds."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    static = sorted((n for n in summary if n.startswith("CF=")), key=lambda n: float(n[3:]))
    xs = [summary[n]["step_seconds"][0] * 1e3 for n in static]
    ax.plot(xs, [summary[n]["dropped"][0] for n in static], "-", color="grey", label="static CF curve")
    for n, s in summary.items():
        ax.errorbar(s["step_seconds"][0] * 1e3, s["dropped"][0], xerr=s["step_seconds"][1] * 1e3,
                    yerr=s["dropped"][1], fmt="o" if n.startswith("CF=") else "s", capsize=3, label=n)
    ax.set_xlabel("step time (ms, median per run; mean over seeds)")
    ax.set_ylabel("dropped fraction of assignments")
    ax.set_title(textwrap.fill(label, 90), fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def format_summary(summary: Dict[str, dict]) -> str:
    lines = [f"{'config':<20} {'step ms':>14} {'dropped':>15} {'link MB/step':>14} {'valid loss':>16}  dominated by"]
    for name, s in summary.items():
        lines.append(f"{name:<20} {s['step_seconds'][0] * 1e3:>7.0f} ± {s['step_seconds'][1] * 1e3:<4.0f} "
                     f"{s['dropped'][0]:>7.3f} ± {s['dropped'][1]:<5.3f} "
                     f"{s['link_bytes_per_step'][0] / 1e6:>14.2f} "
                     f"{s['final_valid_loss'][0]:>8.4f} ± {s['final_valid_loss'][1]:<5.4f}  "
                     + (", ".join(s["dominated_by"]) or "nothing" if "dominated_by" in s else ""))
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> dict:
    p = argparse.ArgumentParser(prog="megamoe bench capacity", description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="comma list of: " + ", ".join(CONFIGS)
                   + f" (default: {','.join(DEFAULT_CONFIGS)}; the larger factors extend the static curve to the "
                   "drop rates of the dynamic policies on skewed routing)")
    p.add_argument("--seeds", default="0,1,2", help="comma list of seeds; every seed runs every config once")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--batch-size", type=int, default=8, help="sequences of 64 tokens per rank per step")
    p.add_argument("--inter-node-bandwidth", default="100MB/s")
    p.add_argument("--cpu-share", default="auto", help="each rank's CPU share in cores (megamoe cluster run "
                   "--cpu-share): auto (fixed-speed ranks, the default), off, one value or one per rank")
    p.add_argument("--max-train-samples", type=int, default=0, help="train every config on the first N samples "
                   "of the training split only (megamoe train --max-train-samples; 0 = all): the caching regime")
    p.add_argument("--cache-min-epoch", type=int, default=10, help="dynamic+cache: never switch caching on before "
                   "this epoch (the paper's 10)")
    p.add_argument("--cache-on", type=float, default=0.96, help="dynamic+cache: switch caching on at this fraction "
                   "of tokens not reassigned over an epoch (the paper's 0.96)")
    p.add_argument("--cache-off", type=float, default=0.90, help="dynamic+cache: switch it off below this fraction "
                   "(the paper's 0.90)")
    p.add_argument("--out", default="results/bench_capacity")
    args = p.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"megamoe bench capacity: --configs {','.join(unknown)}: unknown; known: {', '.join(CONFIGS)}")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        inter = netns.parse_bandwidth(args.inter_node_bandwidth)
    except ValueError as e:
        raise SystemExit(f"megamoe bench capacity: --seeds / --inter-node-bandwidth: {e}") from None
    if not seeds or args.steps < 1 or args.batch_size < 1:
        raise SystemExit("megamoe bench capacity: --seeds needs one seed at least; --steps and --batch-size >= 1")
    if args.max_train_samples < 0 or args.cache_min_epoch < 0:
        raise SystemExit("megamoe bench capacity: --max-train-samples and --cache-min-epoch must be >= 0")
    if args.max_train_samples and args.max_train_samples < 4 * args.batch_size:
        raise SystemExit(f"megamoe bench capacity: --max-train-samples {args.max_train_samples} is less than one "
                         f"step of 4 ranks x --batch-size {args.batch_size}")
    data = ["--max-train-samples", str(args.max_train_samples)] if args.max_train_samples else []
    if not 0 <= args.cache_off <= args.cache_on <= 1:
        raise SystemExit(f"megamoe bench capacity: --cache-off {args.cache_off} and --cache-on {args.cache_on} need "
                         "0 <= off <= on <= 1")
    cache = ["--moe-assignment-cache-min-epoch", str(args.cache_min_epoch), "--moe-assignment-cache-on",
             str(args.cache_on), "--moe-assignment-cache-off", str(args.cache_off)]
    why = netns.unavailable()
    if why:
        raise SystemExit(f"megamoe bench capacity: {why}")
    shares = cpu_caps.bench_shares(args.cpu_share, 4, "megamoe bench capacity")
    label = (f"emulated cluster 2 x 2, inter-node {inter / 1e6:g} MB/s, {cpu_caps.describe(shares)}, "
             f"{args.batch_size * 64} tokens per rank, {len(seeds)} seed(s)"
             + (f", the first {args.max_train_samples} training samples only" if args.max_train_samples else ""))
    print(f"[bench capacity] {label}", flush=True)
    rows: Dict[str, List[dict]] = {c: [] for c in configs}
    for seed in seeds:
        for i, name in enumerate(configs):
            print(f"[bench capacity] seed {seed} {name} ...", flush=True)
            out = os.path.join(args.out, f"seed{seed}", name.replace("=", "").replace(" ", "_").replace("+", "_"))
            extra = CONFIGS[name] + data + (cache if "--moe-assignment-cache" in CONFIGS[name] else [])
            row = run_one(name, ROUTING, args.steps, extra, inter, None, out, 29700 + 2 * i, args.batch_size,
                          shares, seed)
            row.update(logged_intervals(out, args.batch_size))
            rows[name].append(row)
            print(f"[bench capacity] seed {seed} {name}: step {row['step_seconds'] * 1e3:.0f} ms, dropped "
                  f"{1 - row['token_efficiency']:.3f}, valid loss {row['final_valid_loss']:.4f}", flush=True)
    summary = summarise(rows)
    os.makedirs(args.out, exist_ok=True)
    figure = plot(summary, os.path.join(args.out, "drop_vs_step.png"), label)
    caching = cache_comparison(rows)
    results = {"setup": {"label": label, "cpu_shares": shares, "inter_node_bandwidth": inter, "steps": args.steps,
                         "batch_size": args.batch_size, "seeds": seeds, "max_train_samples": args.max_train_samples,
                         "cache_min_epoch": args.cache_min_epoch, "cache_on": args.cache_on,
                         "cache_off": args.cache_off},
               "runs": rows, "summary": summary, "caching": caching, "figure": figure}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(format_summary(summary), flush=True)
    if caching is not None:
        print(format_cache(caching), flush=True)
    return results


if __name__ == "__main__":
    main()
