"""`megamoe bench placement`: static expert parallelism vs FasterMoE shadowing vs FlexMoE, in two parts.

MODELED: a skewed routing trace through the performance-model simulator (``perfmodel.simulate.simulate_trace`` in
planner mode) on the papers' clusters. **Every time of this part is a model prediction** for the named hardware
profile (``perfmodel.profiles``: the papers' clusters, numbers and assumptions documented there); only the routing
comes from the trace. ``--targets none`` skips it.

MEASURED (``placement_measured.py``): the placement runtime trains a small stack of MoE layers for real on
``--measure-procs`` gloo processes of this machine (default 2; 0 skips it) under static EP, shadowing and FlexMoE
(``MoEConfig.placement`` + ``AfterStepHook``), with a deterministic skewed, drifting gate and a cost model
calibrated on those processes; it prints measured ms/step, speedups, moves, replicas, balance ratios, and checks
that the three strategies give the same losses (placement must not change the math; the command fails otherwise).
See that module's docstring for the model, the gate and what is timed.

A last table puts our numbers beside the papers' anchors and says which are modeled and which measured.

Trace: ``--trace PATH`` (a ``--moe-trace-path`` recording, ``stats.load_trace``), or a deterministic synthetic one
per target (``perfmodel.placement_replay.synthetic_trace``): Zipf-skewed expert popularity (default skew 1.25: the top 10
of 64 experts get ~75% of the tokens, FlexMoE paper 001 §2.4 / Fig. 3a) whose ranking drifts slowly and smoothly
(``--drift`` positions per step, §2.4's "changes continuously and smoothly"), per-rank noise, top-2.

Targets (``--targets``, ``profile:world_size``), one expert per GPU as in both papers' runs:

* ``flexmoe-a100:64``: FlexMoE's cluster (8 x 8 A100, paper 001 §5.1) with its BERT-MoE-L layer (H 1024,
  FFN 4096, 64 experts; Table 1);
* ``johnny:16``: FasterMoE's johnny (2 x 8 V100-PCIe, 50 Gb/s; paper 003 §5.1) with its MoE-GPT-S layer (H 1024,
  alpha 2, 16 experts; Table 2).

Strategies (every one but the capacity row dropless; one placement state per MoE layer; decisions before step s
from step s-1's counts unless said otherwise):

* ``static EP``: contiguous blocks, the baseline of the speedups;
* ``static EP, capacity 1.0``: DeepSpeed/GShard-style padded buffers of ceil(1.0 x assignments / E) per
  (rank, expert), overflow dropped: a shorter step that loses tokens (token efficiency < 1), the baseline of
  FlexMoE's 1.70x, which is measured as time to the same model quality;
* ``shadowing (last step)``: FasterMoE Alg. 1 on the last step's counts (what the after-step hook can do);
* ``shadowing (same step)``: Alg. 1 on the step's own counts (FasterMoE selects within the iteration);
* ``FlexMoE``: ``FlexMoEPlanner`` (threshold, horizon, slots per rank as given); its transfers are in the time;
  a second row with horizon 1 (every move must pay for itself within one step) when ``--horizon`` is not 1.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import List, Optional


TARGETS = {
    "flexmoe-a100": dict(hidden=1024, ffn=4096, experts=64, model="BERT-MoE-L (paper 001 Table 1)"),
    "johnny": dict(hidden=1024, ffn=2048, experts=16, model="MoE-GPT-S (paper 003 Table 2)"),
}
DEFAULT_TARGETS = "flexmoe-a100:64,johnny:16"

ANCHORS = [
    "FlexMoE (paper 001 §5.2): 1.70x average (up to 2.10x) over DeepSpeed and 1.30x average (up to 1.45x) over "
    "FasterMoE, measured as training time to the same model quality on 32-64 A100s (end to end, including "
    "DeepSpeed's extra iterations from dropped tokens)",
    "FasterMoE (paper 003 §5.5, Fig. 11): shadowing up to 1.97x per iteration (1 expert shadowed; 19% of the "
    "experts shadowed on average); Fig. 13: shadowing alone up to 1.95x on johnny (4.74x on trevor), over "
    "FastMoE's expert parallelism",
]


def _targets(spec: str):
    out = []
    if spec.strip().lower() in ("", "none"):
        return out
    for item in [x for x in spec.split(",") if x]:
        name, _, w = item.partition(":")
        if name not in TARGETS and not os.path.isfile(name):
            raise SystemExit(f"megamoe bench placement: unknown target profile {name!r}; known: {sorted(TARGETS)}")
        out.append((name, int(w) if w else None))
    return out


def run(args) -> List[dict]:
    from ..perfmodel.cost import LayerShape
    from ..perfmodel.profiles import get_profile
    from ..perfmodel.simulate import simulate_trace, summarize
    from ..placement.flexmoe import FlexMoEPlanner, StaticPlanner
    from ..placement.shadow import ShadowPlanner
    from ..perfmodel.placement_replay import synthetic_trace, write_trace

    recorded = None
    if args.trace:
        from ..stats import load_trace
        recorded = load_trace(args.trace)
        if args.steps:
            recorded = dict(recorded, counts=recorded["counts"][:args.steps], steps=recorded["steps"][:args.steps])
    results = []
    for name, world in _targets(args.targets):
        profile = get_profile(name)
        spec = TARGETS.get(name, dict(hidden=args.hidden or 1024, ffn=args.ffn or 4096, experts=None, model="?"))
        W = world or profile.world_size
        if recorded is not None:
            trace = recorded
            E = int(trace["counts"].shape[-1])
            source = f"trace {args.trace} ({trace['counts'].shape[0]} steps x {trace['counts'].shape[1]} layers, " \
                     f"P={trace['counts'].shape[2]} rows reused as w % P)"
        else:
            E = spec["experts"] or W
            trace = synthetic_trace(W, E, args.steps or 40, layers=args.layers, tokens_per_rank=args.tokens_per_rank,
                                    top_k=args.top_k, skew=args.skew, drift=args.drift, noise=args.noise,
                                    seed=args.seed)
            source = (f"synthetic: {trace['counts'].shape[0]} steps x {args.layers} layer(s), {args.tokens_per_rank} "
                      f"tokens x top-{args.top_k} per rank, Zipf skew {args.skew}, drift {args.drift}/step, seed "
                      f"{args.seed}")
            if args.save_trace:
                os.makedirs(args.save_trace, exist_ok=True)
                write_trace(trace, os.path.join(args.save_trace, f"{name}-{W}"))
        model = spec["model"] if spec["experts"] in (None, E) else f"{spec['model']} widths, {E} experts from the trace"
        if E % W:
            raise SystemExit(f"megamoe bench placement: {E} experts cannot start in contiguous blocks on {W} ranks")
        shape = LayerShape(args.hidden or spec["hidden"], args.ffn or spec["ffn"], E,
                           bytes_per_element=profile.bytes_per_element)
        cm = profile.cost_model(shape, W)
        slots = args.slots_per_rank or E // W + 1
        strategies = [
            ("static EP", dict(planner=StaticPlanner())),
            ("static EP, capacity 1.0 (drops tokens)", dict(capacity_factor=1.0)),
            ("shadowing (last step)", dict(planner=ShadowPlanner(cm), smoothing=args.smoothing)),
            ("shadowing (same step)", dict(planner=ShadowPlanner(cm), decide_on="current")),
            (f"FlexMoE (threshold {args.threshold:g}, horizon {args.horizon:g})",
             dict(planner=FlexMoEPlanner(cm, threshold=args.threshold, horizon=args.horizon,
                                         max_moves=args.max_moves), slots_per_rank=slots, smoothing=args.smoothing)),
        ]
        if args.horizon != 1:
            strategies.append((f"FlexMoE (threshold {args.threshold:g}, horizon 1)",
                               dict(planner=FlexMoEPlanner(cm, threshold=args.threshold, horizon=1.0,
                                                           max_moves=args.max_moves), slots_per_rank=slots,
                                    smoothing=args.smoothing)))
        rows = []
        for label, kw in strategies:
            t = time.perf_counter()
            steps = simulate_trace(trace, profile, shape, world_size=W, cost_model=cm, **kw)
            s = summarize(steps)
            s.update(label=label, wall_s=time.perf_counter() - t)
            rows.append(s)
        base = rows[0]["mean_total"]
        for r in rows:
            r["speedup"] = base / r["mean_total"]
        results.append(dict(profile=name, world_size=W, experts=E, hidden=shape.hidden, ffn=shape.ffn,
                            model=model, source=source, slots_per_rank=slots, rows=rows,
                            flexmoe_over_shadow=rows[2]["mean_total"] / rows[4]["mean_total"]))
    return results


class PlacementBenchResults(list):
    """What ``main`` returns: the modeled results (a list, one dict per target, as before) with the measured part's
    results (a dict, or None when skipped) as ``.measured``."""
    measured: Optional[dict] = None


def report(results: List[dict]) -> str:
    lines = ["# MODELED: megamoe bench placement MODEL PREDICTIONS (perfmodel simulator), not measurements", ""]
    for res in results:
        lines += [f"## {res['profile']}, {res['world_size']} GPUs (modeled): {res['model']}, H={res['hidden']} "
                  f"FFN={res['ffn']} E={res['experts']}, {res['slots_per_rank']} slots per rank for FlexMoE",
                  f"routing: {res['source']}", "",
                  "| strategy | predicted ms/step | speedup vs static | balance ratio | token eff. | expert eff. | "
                  "replicas | moves (all steps) | MB moved (all steps) | transfer ms/step |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in res["rows"]:
            lines.append(
                f"| {r['label']} | {r['mean_total'] * 1e3:.3f} | {r['speedup']:.2f}x | "
                f"{r['mean_balance_ratio']:.2f} | {r['mean_token_efficiency']:.1%} | "
                f"{r['mean_expert_efficiency']:.1%} | {r['mean_replicas']:.1f} | {r['moves']} | "
                f"{r['bytes_moved'] / 1e6:.0f} | {r['mean_transfer'] * 1e3:.3f} |")
        lines += ["", f"FlexMoE over shadowing (last step): {res['flexmoe_over_shadow']:.2f}x (predicted). The "
                  "capacity row's step is short because it drops tokens (token eff. < 100%): its speedup is not "
                  "comparable.", ""]
    lines += ["Paper anchors (measured on the papers' clusters, end to end; ours above are per-step model "
              "predictions of the MoE layers alone):"] + [f"- {a}" for a in ANCHORS]
    lines += ["",
              "Metrics (means over steps): balance ratio = FlexMoE Eq. 6 after routing; token eff. = processed / "
              "routed assignments; expert eff. = processed / (ranks x the largest per-rank computed token slots) "
              "(FlexMoE §5.4); replicas = vExperts beyond one per expert (shadowing: shadowed x (P-1)); MB moved = "
              "model states of Expand/Migrate (shadowing: parameters broadcast + gradients reduced)."]
    return "\n".join(lines)


def beside_anchors(results: List[dict], measured: Optional[dict]) -> str:
    """Our speedups (modeled per target, measured here) beside the papers' anchors, each labelled."""
    def modeled(pick):
        out = []
        for res in results:
            rows = {r["label"]: r for r in res["rows"]}
            flex = next(r for r in res["rows"] if r["label"].startswith("FlexMoE"))
            out.append(f"{pick(rows, flex)} modeled ({res['profile']}:{res['world_size']})")
        return out

    meas = {r["strategy"]: r for r in measured["rows"]} if measured else {}
    where = f"measured here (CPU, gloo, {measured['procs']} procs)" if measured else ""

    def m(a, b):
        return [f"{meas[b]['median_s'] / meas[a]['median_s']:.2f}x (mean step "
                f"{meas[b]['mean_s'] / meas[a]['mean_s']:.2f}x) {where}"] if measured else []

    table = [
        ("FlexMoE over static expert parallelism",
         "1.70x avg (up to 2.10x) over DeepSpeed, time to the same quality, 32-64 A100s (FlexMoE §5.2; DeepSpeed "
         "drops tokens, so its baseline is not our dropless static EP)",
         modeled(lambda rows, f: f"{f['speedup']:.2f}x") + m("flexmoe", "static EP")),
        ("FlexMoE over FasterMoE shadowing",
         "1.30x avg (up to 1.45x), time to the same quality (FlexMoE §5.2)",
         modeled(lambda rows, f: f"{rows['shadowing (last step)']['mean_total'] / f['mean_total']:.2f}x")
         + m("flexmoe", "shadow")),
        ("shadowing over static expert parallelism",
         "up to 1.97x per iteration (FasterMoE §5.5 Fig. 11); up to 1.95x on johnny (Fig. 13)",
         modeled(lambda rows, f: f"{rows['shadowing (last step)']['speedup']:.2f}x (same step: "
                                 f"{rows['shadowing (same step)']['speedup']:.2f}x)") + m("shadow", "static EP")),
    ]
    lines = ["# Ours beside the paper anchors (the anchors: measured by the papers on their clusters, end to end; "
             "\"modeled\" = perfmodel prediction of the MoE layers' step; \"measured here\" = wall time of whole "
             "training steps on this machine)", "",
             "| comparison | paper anchor (measured, theirs) | ours |", "|---|---|---|"]
    for what, anchor, ours in table:
        lines.append(f"| {what} | {anchor} | {'; '.join(ours) if ours else '(not run)'} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> PlacementBenchResults:
    from .report import emit_report
    from .placement_measured import add_arguments, report as measured_report, run_measured
    p = argparse.ArgumentParser(prog="megamoe bench placement", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=None, help="recorded routing trace (--moe-trace-path); default: synthetic")
    p.add_argument("--targets", default=DEFAULT_TARGETS,
                   help=f"profile:world_size list (default {DEFAULT_TARGETS}); none skips the modeled part")
    p.add_argument("--steps", type=int, default=None, help="steps (synthetic default 40; a trace: its first N)")
    p.add_argument("--layers", type=int, default=1, help="synthetic: MoE layers")
    p.add_argument("--tokens-per-rank", type=int, default=4096, help="synthetic: tokens per rank per step")
    p.add_argument("--top-k", type=int, default=2, help="synthetic: experts per token")
    p.add_argument("--skew", type=float, default=1.25, help="synthetic: Zipf exponent of expert popularity")
    p.add_argument("--drift", type=float, default=0.05, help="synthetic: popularity ranking drift per step")
    p.add_argument("--noise", type=float, default=0.1, help="synthetic: per-rank log-normal spread of the shares")
    p.add_argument("--seed", type=int, default=0, help="synthetic trace, and the measured part's weights and data")
    p.add_argument("--hidden", type=int, default=None, help="override the target's H")
    p.add_argument("--ffn", type=int, default=None, help="override the target's expert FFN width")
    p.add_argument("--threshold", type=float, default=1.2,
                   help="FlexMoE balance-ratio trigger (Eq. 6), modeled and measured")
    p.add_argument("--horizon", type=float, default=10.0,
                   help="FlexMoE: steps over which a move's transfer must pay back (default 10; modeled only: the "
                        "runtime's horizon is its placement interval, 1)")
    p.add_argument("--max-moves", type=int, default=16, help="FlexMoE: moves per layer per step at most")
    p.add_argument("--smoothing", type=float, default=0.0,
                   help="planners deciding from past steps see an EMA of the counts with this weight (default 0: "
                        "the last step's counts; modeled only)")
    p.add_argument("--slots-per-rank", type=int, default=None,
                   help="FlexMoE vExpert slots (default E/P + 1; modeled only: measured uses 1 spare slot)")
    p.add_argument("--save-trace", default=None, help="write the synthetic traces here (load_trace format)")
    p.add_argument("--json", default=None, help="write the results as JSON here ({modeled: [...], measured: {...}})")
    p.add_argument("--output", default=None, help="also write the report here")
    add_arguments(p)
    args = p.parse_args(argv)
    if args.measure_procs == 1 or args.measure_procs < 0:
        p.error("--measure-procs: 0 (skip) or 2 or more")
    results = PlacementBenchResults(run(args))
    results.measured = run_measured(args) if args.measure_procs else None
    parts = []
    if results:
        parts.append(report(results))
    if results.measured:
        parts.append(measured_report(results.measured))
    parts.append(beside_anchors(results, results.measured))
    emit_report(parts, args.output)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"modeled": list(results), "measured": results.measured}, f, indent=1)
    m = results.measured
    if m and m["loss_max_rel_diff"] > m["loss_rtol"]:
        raise SystemExit(f"megamoe bench placement: the strategies' losses differ by {m['loss_max_rel_diff']:.1e} "
                         f"(relative) > {m['loss_rtol']:g}: placement changed the math")
    return results


if __name__ == "__main__":
    main()
