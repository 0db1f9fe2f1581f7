"""``megamoe cache-sim`` and ``megamoe balance``: paper 004's expert-buffering cache simulation (§VI-C, Fig. 12) and
expert load balancing (§VII, Fig. 14) on a recorded routing trace (``--moe-trace-path`` of a run).

    megamoe cache-sim --trace PATH --devices N [--sizes 1-8] [--policies lifo,fifo,lru,belady] [--out DIR]
    megamoe balance   --trace PATH --devices N --out placement.json [--method best] [--weight 0.5]

``main(argv)`` takes the subcommand first (``main(["balance", ...])``); ``cache_sim_main`` and ``balance_main``
take only the subcommand's flags.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import List, Optional, Sequence
from ..stats import load_trace
from .balance import PlacementFileError, evaluate_placements, layer_loads, perm_to_placement, placement_to_perm, read_placement_file, write_placement_file
from .cache_sim import POLICIES, format_miss_table, miss_curve, plot_miss_curve

__all__ = ["main", "cache_sim_main", "balance_main", "parse_sizes"]


def parse_sizes(text: str) -> List[int]:
    """'1-8' / '1,2,4,8' / '1-4,8,16' -> sorted unique positive ints."""
    out = set()
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)\s*-\s*(\d+)", part)
        if m:
            lo, hi = int(m.group(1)), int(m.group(2))
            if lo > hi:
                raise ValueError(f"range {part!r} is empty")
            out.update(range(lo, hi + 1))
        elif part.isdigit():
            out.add(int(part))
        else:
            raise ValueError(f"{part!r} is neither a size nor a range a-b")
    if not out or min(out) < 1:
        raise ValueError("cache sizes must be >= 1")
    return sorted(out)


def _load(p: argparse.ArgumentParser, path: str, max_steps: Optional[int]) -> dict:
    m = re.fullmatch(r"(.*)\.rank\d+", path)
    if m and not os.path.exists(path + ".rank0"):
        path = m.group(1)                      # a shard's path was given: its trace is the prefix
    try:
        trace = load_trace(path)
    except (FileNotFoundError, ValueError) as err:
        p.error(f"--trace {path}: {err}")
    if max_steps:
        trace["counts"] = trace["counts"][:max_steps]
    return trace


def _layer_positions(p: argparse.ArgumentParser, trace: dict, text: str) -> List[int]:
    ids = list(trace["layers"])
    if not text:
        return list(range(len(ids)))
    try:
        want = [int(v) for v in text.split(",")]
    except ValueError:
        p.error(f"--layers {text!r}: expected comma-separated layer ids")
    missing = [l for l in want if l not in ids]
    if missing:
        p.error(f"--layers: trace has no layer(s) {missing} (it has {ids})")
    return [ids.index(l) for l in want]


def _check_devices(p: argparse.ArgumentParser, devices: int, E: int) -> None:
    if devices < 1 or E % devices:
        p.error(f"--devices {devices}: the trace's {E} experts cannot be split evenly over {devices} devices")


def cache_sim_main(argv: Optional[Sequence[str]] = None) -> int:

    p = argparse.ArgumentParser(
        prog="megamoe cache-sim", allow_abbrev=False,
        description="Expert buffering (paper 004 §VI-C, Fig. 12): replay a routing trace through a per-device cache "
                    "of expert slots and report the miss rate against the cache size, worst case over layers and "
                    "devices and the mean, per eviction policy, with Belady's MIN as the offline optimum. An expert is "
                    "active in a batch (trace step) when it received a token; each device caches its own experts and "
                    "runs them in ascending id.")
    p.add_argument("--trace", required=True, help="Routing trace (the --moe-trace-path of a run; shards <path>.rank<r>).")
    p.add_argument("--devices", type=int, required=True, help="Expert-parallel devices D (E / D experts each).")
    p.add_argument("--sizes", default="", help="Cache sizes per device: '1-8', '1,2,4,8' (default: 1..E/D).")
    p.add_argument("--policies", default="lifo,fifo,lru,lfu,belady",
                   help=f"Comma list of {', '.join(POLICIES)} (default: all).")
    p.add_argument("--placement-file", default="",
                   help="Place experts as this placement file says (written by `megamoe balance`) instead of "
                        "contiguous blocks: the paper's 'with reassignment' curves.")
    p.add_argument("--layers", default="", help="Comma list of the trace's layer ids to simulate (default: all).")
    p.add_argument("--max-steps", type=int, default=None, help="Use only the trace's first N steps.")
    p.add_argument("--expert-params", type=float, default=None,
                   help="Parameters of all experts (whole model, or one device's): with --total-params, the memory "
                        "saved is also shown as a share of all parameters.")
    p.add_argument("--total-params", type=float, default=None, help="All parameters (same scope as --expert-params).")
    p.add_argument("--out", default="", help="Folder for miss_curve.png and miss_curve.json (default: print only).")
    args = p.parse_args(argv)

    trace = _load(p, args.trace, args.max_steps)
    counts = trace["counts"]
    S, L, P, E = counts.shape
    _check_devices(p, args.devices, E)
    try:
        sizes = parse_sizes(args.sizes) if args.sizes else None
    except ValueError as err:
        p.error(f"--sizes {args.sizes!r}: {err}")
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    bad = [x for x in policies if x not in POLICIES]
    if bad or not policies:
        p.error(f"--policies: unknown {bad}; known: {', '.join(POLICIES)}")
    if (args.expert_params is None) != (args.total_params is None):
        p.error("--expert-params and --total-params go together")
    positions = _layer_positions(p, trace, args.layers)
    layer_ids = [trace["layers"][i] for i in positions]
    placement = None
    if args.placement_file:
        try:
            pf = read_placement_file(args.placement_file, E)
        except PlacementFileError as err:
            p.error(str(err))
        placement = {j: perm_to_placement(pf.layers[lid], args.devices)
                     for j, lid in enumerate(layer_ids) if lid in pf.layers}
    sub = counts[:, positions]
    try:
        curve = miss_curve(sub, args.devices, sizes, policies, placement, args.expert_params, args.total_params)
    except ValueError as err:
        p.error(str(err))
    curve["layer_ids"] = layer_ids
    curve["trace"] = args.trace
    curve["placement_file"] = args.placement_file or None
    print(f"trace {args.trace}: {S} batch(es) x {len(positions)} layer(s), {E} experts on {args.devices} device(s) "
          f"({E // args.devices} each){', placement ' + args.placement_file if args.placement_file else ''}")
    print("miss rate per cache size: worst case over layers and devices / mean over those with accesses\n")
    print(format_miss_table(curve))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        png = plot_miss_curve(curve, os.path.join(args.out, "miss_curve.png"))
        with open(os.path.join(args.out, "miss_curve.json"), "w") as f:
            json.dump(curve, f, indent=1)
        print(f"\nwrote {png} and {os.path.join(args.out, 'miss_curve.json')}")
    return 0


METHODS = ("best", "greedy", "anticorrelation", "eplb", "identity")


def balance_main(argv: Optional[Sequence[str]] = None) -> int:

    p = argparse.ArgumentParser(
        prog="megamoe balance", allow_abbrev=False,
        description="Expert load balancing (paper 004 §VII, Fig. 14): per layer, fit greedy, anti-correlation and "
                    "EPLB (DeepSeek's hierarchical balanced packing) placements on the first half of a routing "
                    "trace's batches, report Max Load (largest share of a batch's tokens one device ever gets) and "
                    "Avg Max Load (the per-batch largest share, averaged) on the held-out second half for the "
                    "identity, greedy, anti-correlation and EPLB placements, and write the chosen placement as a "
                    "--moe-placement-file.")
    p.add_argument("--trace", required=True, help="Routing trace (the --moe-trace-path of a run; shards <path>.rank<r>).")
    p.add_argument("--devices", type=int, required=True, help="Expert-parallel devices D to place the experts on.")
    p.add_argument("--out", required=True, help="Placement file to write (JSON, for --moe-placement-file).")
    p.add_argument("--method", choices=METHODS, default="best",
                   help="Placement written per layer: best = the lowest Avg Max Load (then Max Load) on the fitted "
                        "half of identity, greedy, anti-correlation and EPLB (default); or one of them for every "
                        "layer.")
    p.add_argument("--weight", type=float, default=0.5,
                   help="Anti-correlation weight of the Pearson term (paper: 0.5).")
    p.add_argument("--nodes", type=int, default=1,
                   help="EPLB: the devices form this many nodes of consecutive devices (experts are packed onto "
                        "nodes first, then onto each node's devices).")
    p.add_argument("--layers", default="", help="Comma list of the trace's layer ids to balance (default: all).")
    p.add_argument("--max-steps", type=int, default=None, help="Use only the trace's first N steps.")
    args = p.parse_args(argv)

    trace = _load(p, args.trace, args.max_steps)
    S, L, P, E = trace["counts"].shape
    _check_devices(p, args.devices, E)
    if S < 2:
        p.error(f"--trace: {S} step(s); need at least 2 (fit on the first half, evaluate on the second)")
    positions = _layer_positions(p, trace, args.layers)
    D = args.devices
    if args.nodes < 1 or D % args.nodes:
        p.error(f"--nodes {args.nodes}: --devices {D} must split into that many nodes of equal size")
    print(f"trace {args.trace}: {S} batch(es), fit on the first {S // 2}, evaluated on the last {S - S // 2}; "
          f"{E} experts on {D} device(s); perfect balance = {1 / D:.3f}\n")
    names = ("identity", "greedy", "anticorrelation", "eplb")
    print("| layer | " + " | ".join(f"{n} Max / Avg Max Load" for n in names) + " | written |")
    print("|---|" + "---|" * len(names) + "---|")
    perms, report, chosen = {}, {}, {}
    for j in positions:
        lid = int(trace["layers"][j])
        res = evaluate_placements(layer_loads(trace, j), D, args.weight, args.nodes)
        if args.method == "best":
            # chosen on the fitted half only: the held-out half stays an honest estimate of the choice
            pick = min(names, key=lambda n: (round(res[n]["fit_avg_max_load"], 12),
                                             round(res[n]["fit_max_load"], 12), names.index(n)))
        else:
            pick = args.method
        perms[lid] = placement_to_perm(res[pick]["placement"], D)
        chosen[lid] = pick
        report[str(lid)] = {n: {"max_load": res[n]["max_load"], "avg_max_load": res[n]["avg_max_load"]}
                            for n in names}
        cells = [f"{res[n]['max_load']:.3f} / {res[n]['avg_max_load']:.3f}" for n in names]
        print(f"| {lid} | " + " | ".join(cells) + f" | {pick} |")
    meta = {"num_devices": D, "method": args.method, "chosen": {str(k): v for k, v in chosen.items()},
            "weight": args.weight, "nodes": args.nodes, "trace": os.path.abspath(args.trace), "fit_batches": S // 2,
            "eval_batches": S - S // 2, "heldout": report,
            "note": "perm[new_slot] = old_expert; device d holds slots d*E/D..(d+1)*E/D-1"}
    write_placement_file(args.out, perms, meta)
    print(f"\nwrote {args.out} ({len(perms)} layer(s)); use it with --moe-placement-file={args.out}")
    return 0


_COMMANDS = {"cache-sim": cache_sim_main, "balance": balance_main}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``main(["cache-sim", ...])`` / ``main(["balance", ...])``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _COMMANDS:
        print("usage: megamoe {cache-sim,balance} [flags]   ('megamoe <command> -h' for its flags)\n"
              "  cache-sim  expert-buffering cache miss rates over a routing trace (paper 004 §VI-C)\n"
              "  balance    expert load-balancing placement from a routing trace (paper 004 §VII)",
              file=sys.stdout if argv[:1] in (["-h"], ["--help"]) else sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    return _COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
