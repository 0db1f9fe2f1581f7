"""``megamoe perf ...``: the performance model from the command line.

    megamoe perf profiles                      the named hardware profiles, their numbers and where they come from
    megamoe perf roofline [flags]              FasterMoE's DDL-Roofline points (paper 003 §3.3, Fig. 5) + a PNG
    megamoe perf simulate TRACE [flags]        replay a routing trace through the cost model, per-step breakdown
    megamoe perf calibrate [flags]             measure this machine and fit a profile (perfmodel.calibrate)

Every time and throughput printed by ``roofline`` and ``simulate`` is a model prediction for the named profile (or
profile JSON), not a measurement.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional, Sequence
from ..stats import load_trace
from .cost import LayerShape
from .profiles import PROFILES, get_profile
from .roofline import format_points, plot_roofline, roofline_points, synthetic_counts
from .simulate import format_steps, format_summary, simulate_trace, summarize

__all__ = ["main"]


def _profile(name: str):
    try:
        return get_profile(name)
    except (KeyError, FileNotFoundError, ValueError) as err:
        raise SystemExit(f"megamoe perf: {err}")


def _shape(args, num_experts: int, profile):
    bpe = args.bytes_per_element or getattr(profile, "bytes_per_element", 2)
    return LayerShape(hidden=args.hidden, ffn=args.ffn or 2 * args.hidden, num_experts=num_experts,
                      bytes_per_element=bpe)


def _add_shape_flags(p: argparse.ArgumentParser, experts_default: Optional[int]) -> None:
    p.add_argument("--profile", default="johnny", help="Named profile (megamoe perf profiles) or a profile JSON.")
    p.add_argument("--hidden", type=int, default=1024, help="H, the embedding width (default 1024).")
    p.add_argument("--ffn", type=int, default=None, help="Expert FFN width alpha*H (default 2*H).")
    p.add_argument("--experts", type=int, default=experts_default,
                   help="Number of experts E" + (f" (default {experts_default})." if experts_default else
                                                 " (default: the trace's)."))
    p.add_argument("--bytes-per-element", type=int, default=None, help="Default: the profile's.")
    p.add_argument("--world-size", type=int, default=None,
                   help="Target workers W (default: the trace's ranks, or all of the profile's GPUs); a trace's "
                        "source rows are reused as w %% P.")


def _roofline(argv: List[str]) -> int:
    import torch

    p = argparse.ArgumentParser(prog="megamoe perf roofline",
                                description="FasterMoE DDL-Roofline (paper 003 §3.3, Fig. 5): predicted (R_CC, P-bar) "
                                            "of data, model and expert parallelism and FasterMoE's optimizations.")
    _add_shape_flags(p, experts_default=None)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", default=None, help="Routing trace (the --moe-trace-path of a run): real counts.")
    src.add_argument("--tokens-per-rank", type=int, default=None,
                     help="Synthetic counts: assignments each worker sends per layer-iteration (default 1024).")
    p.add_argument("--skew", type=float, default=0.0,
                   help="Synthetic counts: expert e gets a share proportional to (e+1)^-skew (0 = uniform).")
    p.add_argument("--max-steps", type=int, default=None, help="Use only the trace's first N steps.")
    p.add_argument("--top-k", type=int, default=None, help="Experts per token (default: the trace's, else 1).")
    p.add_argument("--smart-groups", type=int, default=None,
                   help="Groups of the smart schedule (default: the profile's nodes, or one per worker).")
    p.add_argument("--out", default=None, help="Write the Fig. 5-style plot here (PNG).")
    args = p.parse_args(argv)
    profile = _profile(args.profile)
    if args.trace:
        trace = _read_trace(p, args.trace)
        counts = torch.as_tensor(trace["counts"])
        if args.max_steps:
            counts = counts[:args.max_steps]
        E = counts.shape[-1]
        if args.experts is not None and args.experts != E:
            p.error(f"--experts {args.experts} but the trace has {E} experts")
        top_k = args.top_k or int(trace.get("top_k") or 1)
        what = f"trace {args.trace}: {counts.shape[0]} step(s) x {counts.shape[1]} layer(s), P={counts.shape[2]}"
    else:
        E = args.experts or 16
        W = args.world_size or profile.nodes * profile.gpus_per_node
        n = args.tokens_per_rank or 1024
        counts = synthetic_counts(W, E, n, args.skew)
        top_k = args.top_k or 1
        what = f"synthetic counts: {n} assignments per worker, skew {args.skew:g}"
    shape = _shape(args, E, profile)
    try:
        points = roofline_points(profile, shape, counts, world_size=args.world_size, top_k=top_k,
                                 smart_groups=args.smart_groups)
    except ValueError as err:
        p.error(str(err))
    W = points[0].workers
    if args.trace and W != counts.shape[-2]:
        what += f", replayed on {W} workers (worker w uses the trace's rank w % {counts.shape[-2]})"
    print(f"DDL-Roofline, MODEL PREDICTIONS for profile {profile.name!r} (not measurements): {W} workers, "
          f"H={shape.hidden}, ffn={shape.ffn}, E={E}, top-k={top_k}, P_w={profile.gemm_tflops:g} TFLOPS")
    print(what)
    print(format_points(points))
    for pt in points:
        if "shadowed_mean" in pt.detail:
            print(f"{pt.label}: {pt.detail['shadowed_mean']:.2f} expert(s) shadowed per layer-iteration (Algorithm 1)")
    if args.out:
        plot_roofline(points, points[0].peak, args.out,
                      title=f"DDL-Roofline, {profile.name}: H={shape.hidden}, ffn={shape.ffn}, E={E}, N={W} "
                            f"(model predictions)")
        print(f"plot written to {args.out}")
    return 0


def _read_trace(parser: argparse.ArgumentParser, path: str) -> dict:
    """The trace at ``path`` (shards ``path.rank<r>``), or argparse's error naming the flag and what is wrong."""
    try:
        return load_trace(path)
    except (FileNotFoundError, ValueError) as err:       # TraceError is a ValueError
        parser.error(f"trace {path}: {err}")


def _simulate(argv: List[str]) -> int:
    p = argparse.ArgumentParser(prog="megamoe perf simulate",
                                description="Replay a routing trace through the cost model: predicted per-step "
                                            "compute / all-to-all / sync time on a profile.")
    p.add_argument("trace", help="Trace path (the --moe-trace-path of a run; shards <path>.rank<r>).")
    _add_shape_flags(p, experts_default=None)
    p.add_argument("--max-steps", type=int, default=None, help="Replay only the first N steps.")
    p.add_argument("--json", default=None, help="Also write the per-step results and the summary as JSON here.")
    args = p.parse_args(argv)
    profile = _profile(args.profile)
    trace = _read_trace(p, args.trace)
    if args.max_steps:
        trace = dict(trace, counts=trace["counts"][:args.max_steps], steps=trace["steps"][:args.max_steps])
    S, L, P, E = trace["counts"].shape
    if args.experts is not None and args.experts != E:
        p.error(f"--experts {args.experts} but the trace has {E} experts")
    shape = _shape(args, E, profile)
    try:
        results = simulate_trace(trace, profile, shape, world_size=args.world_size)
    except ValueError as err:
        p.error(str(err))
    summary = summarize(results)
    W = args.world_size or P
    remap = f"; worker w replays the trace's rank w % {P}" if W != P else ""
    print(f"trace {args.trace}: {S} step(s) x {L} MoE layer(s), recorded on {P} rank(s), {E} experts{remap}")
    print(f"MODEL PREDICTIONS for profile {profile.name!r} (not measurements): {W} workers, H={shape.hidden}, "
          f"ffn={shape.ffn}; times summed over the layers, forward + backward")
    print(format_steps(results))
    print(format_summary(summary))
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump({"profile": profile.name, "world_size": W, "steps": results, "summary": summary}, f, indent=1)
        print(f"results written to {args.json}")
    return 0


def _profiles(argv: List[str]) -> int:
    argparse.ArgumentParser(prog="megamoe perf profiles",
                            description="List the named hardware profiles with their numbers and sources.").parse_args(
        argv)
    import textwrap
    for name, prof in PROFILES.items():
        d = prof.to_dict()
        print(f"{name}: {d.get('description', '')}")
        print(f"    {'world size':<22} {prof.nodes * prof.gpus_per_node} GPUs")
        for k, v in d.items():
            if k in ("name", "description", "source"):
                continue
            print(f"    {k:<22} {v}")
        lines = textwrap.wrap(d.get("source", ""), 90) or [""]
        print(f"    {'source':<22} {lines[0]}")
        for line in lines[1:]:
            print(" " * 27 + line)
        print()
    return 0


def _calibrate(argv: List[str]) -> int:
    try:
        mod = importlib.import_module(f"{__package__}.calibrate")
    except ModuleNotFoundError as err:
        if err.name != f"{__package__}.calibrate":
            raise
        print("megamoe perf calibrate: not available in this installation (no megamoe_plugin.perfmodel.calibrate "
              "module)", file=sys.stderr)
        return 2
    return int(mod.main(argv) or 0)


_COMMANDS = {
    "profiles": (_profiles, "List the named hardware profiles with their numbers and sources."),
    "roofline": (_roofline, "FasterMoE DDL-Roofline points (model predictions) and a Fig. 5-style PNG."),
    "simulate": (_simulate, "Replay a routing trace through the cost model: predicted per-step breakdown."),
    "calibrate": (_calibrate, "Measure this machine and fit a hardware profile (megamoe_plugin.perfmodel.calibrate)."),
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="megamoe perf", allow_abbrev=False,
                                description="Performance model: hardware profiles, DDL-Roofline, trace simulation.",
                                epilog="'megamoe perf <command> -h' shows a command's own flags.")
    sub = p.add_subparsers(dest="command", metavar="<command>", required=True)
    for name, (_, help_text) in _COMMANDS.items():
        sub.add_parser(name, help=help_text, description=help_text, add_help=False, allow_abbrev=False)
    if not argv or argv[0] in ("-h", "--help"):
        p.print_help()
        return 0 if argv else 2
    ns, rest = p.parse_known_args(argv[:1])
    func, _ = _COMMANDS[ns.command]
    return func(rest + argv[1:])


if __name__ == "__main__":
    sys.exit(main())
