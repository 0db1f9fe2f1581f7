"""Sections of the benchmarks measured on the emulated cluster: `bench cluster`, `gates`, `planners`, `capacity`.

Each builder reads the run's results.json as its benchmark wrote it (docs/data/runs.json names the file) and
renders the current table; the targets are the ones set for the benchmark when it was built (paper 002 §5 for
the gates, paper 001 §5.2 for the planners, paper 000 §5 for the capacity, the performance model's 15%).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ..bench.gates import LABELS, TOPOLOGY_LABELS, summary_markdown
from ..reproduce.common import interp
from .mdtable import percent, ratio, span, table
from .registry import Data, Headline, Section, section

PREDICTION_TOLERANCE = 0.15


@section("cluster")
def cluster(data: Data) -> Section:
    res = data.json("cluster")
    rows, errors = [], []
    for bandwidth, cell in res.items():
        for r in cell["rows"]:
            m, p = r["measured"], r["predicted"]
            err = p["step"] / m["step"] - 1
            errors.append(err)
            rows.append([bandwidth, r["shape"], r["routing"], f"{m['step'] * 1e3:.1f}", f"{m['compute'] * 1e3:.1f}",
                         f"{m['exchange'] * 1e3:.1f}", percent(m["exchange"] / m["step"], 0),
                         f"{p['step'] * 1e3:.1f}", percent(err, 0, signed=True)])
    worst = max(abs(e) for e in errors)
    body = "\n\n".join([
        data.provenance("cluster") + ".",
        table(["inter-node", "shape", "routing", "step ms", "compute ms", "all-to-all ms", "all-to-all share",
               "predicted step ms", "error"], rows, "lllrrrrrr"),
        data.command("cluster")])
    head = Headline("cluster: one layer, measured vs the calibrated model", f"largest step-time error "
                    f"{percent(worst)} over {len(errors)} cells", f"within {percent(PREDICTION_TOLERANCE, 0)}",
                    worst <= PREDICTION_TOLERANCE, "cluster")
    return Section("cluster", "`megamoe bench cluster`: one MoE layer on the emulated cluster", body, [head],
                   ["cluster"])


GATES_TARGET = 1.25


@section("gates")
def gates(data: Data) -> Section:
    summaries = [data.json(run) for run in ("gates-2x2", "gates-3asym")]
    table_md = summary_markdown({"summary": [r for s in summaries for r in s["summary"]]})
    bias = {r["topology"]: r for s in summaries for r in s["summary"] if r["config"] == "ta_moe_bias"}
    speedups = [bias[t]["speedup_vs_alf"] for t in ("2x2", "3asym")]
    result = " / ".join(f"{ratio(v)} ({TOPOLOGY_LABELS[t]})" for v, t in zip(speedups, ("2x2", "3asym")))
    body = "\n\n".join([
        data.provenance("gates-2x2") + f"; [3 nodes](docs/data/{data.runs['gates-3asym']['path']}).",
        table_md,
        "Baseline: " + LABELS["alf"] + ". Time to target: training seconds until the validation loss reaches the "
        "worst of that seed's best losses, over the baseline's of the same seed (median over the seeds).",
        data.command("gates-2x2"),
        "![time to target over the baseline, per routing and seed](docs/figures/benchmarks/gates_time_to_target.png)"])
    head = Headline("gates: TA-MoE's target by bias, time to target over the aux-loss-free baseline", result,
                    f">= {ratio(GATES_TARGET)}", min(speedups) >= GATES_TARGET, "gates")
    return Section("gates", "`megamoe bench gates`: topology-aware routing on the emulated cluster", body, [head],
                   ["gates-2x2", "gates-3asym"])


PLANNER_TARGET = 1.3
NEVER_LOSE = 0.97


def over_static(rows: List[dict]) -> Dict[str, List[Optional[float]]]:
    """Per run, per round: static's time to target over the run's (> 1: the run is faster)."""
    static = next(r for r in rows if r["run"] == "static")["time_to_target_rounds"]
    return {r["run"]: [s / t if s and t else None for s, t in zip(static, r["time_to_target_rounds"])]
            for r in rows}


def pairs_over_static(pairs: Dict[str, dict], measure: str = "train") -> Dict[str, List[Optional[float]]]:
    """Per run, per pair: the static run that trained beside it over the run, in training time for the same steps
    (``measure`` "train": the floor's wall time) or in time to the pair's target loss ("time_to_target")."""
    static, run_key = f"static_{measure}_s", f"run_{measure}_s"
    return {run: [p[static] / p[run_key] if p[run_key] else None for p in v["pairs"]] for run, v in pairs.items()}


def never_lose(over: Dict[str, List[Optional[float]]], unit: str = "rounds") -> Tuple[str, bool]:
    """The 512-token headline from ``over_static`` (or ``pairs_over_static``, ``unit`` "pairs"): every run's
    rounds >= NEVER_LOSE, read against the run that changes nothing (``idle``): when it is more than
    1 - NEVER_LOSE away from 1.00x in a round, the run's spread is larger than the floor, and the floor is not
    resolved (not met) whatever the others measured."""
    floor = [v for run, vals in over.items() if run != "static" for v in vals if v]
    control = [v for v in over.get("idle", []) if v]
    resolved = all(abs(v - 1) <= 1 - NEVER_LOSE for v in control)
    result = span(floor) + f" (runs x {unit})"
    if not resolved:
        result += f"; not resolved: `idle`, which changes nothing, measured {span(control)}"
    return result, bool(floor) and min(floor) >= NEVER_LOSE and resolved


def _planner_table(cell: dict) -> str:
    over = over_static(cell["rows"])
    lines = []
    for r in cell["rows"]:
        lines.append([r["run"], " / ".join(f"{s * 1e3:.0f}" for s in r["step_seconds_rounds"]),
                      " / ".join(f"{t:.1f}" for t in r["time_to_target_rounds"]),
                      "-" if r["run"] == "static" else " / ".join(ratio(v) for v in over[r["run"]]),
                      ratio(r.get("late_speedup")) if r["run"] != "static" else "-",
                      ratio(r.get("predicted_speedup")), f"{r['moves']:.0f}", f"{r['final_valid_loss']:.4f}"])
    return table(["run", "median step ms (rounds)", "time to target s (rounds)", "over static (rounds)",
                  "late steps over static", "predicted", "moves", "valid loss"], lines, "lrrrrrrr")


def _pairs_table(pairs: Dict[str, dict]) -> str:
    """One row per run; a ``static`` entry is two static runs side by side (the pairs' own resolution)."""
    wall, target = pairs_over_static(pairs), pairs_over_static(pairs, "time_to_target")
    label = {"static": "static beside static"}
    lines = [[label.get(run, run), " / ".join(ratio(v, 3) for v in wall[run]),
              " / ".join(ratio(v, 3) for v in target[run]),
              ", ".join(f"{p['static_step_ms']:.0f} / {p['run_step_ms']:.0f}" for p in v["pairs"]),
              " / ".join(ratio(p.get("late_over_static"), 3) for p in v["pairs"]),
              " / ".join(f"{p['moves']:.0f}" for p in v["pairs"])] for run, v in pairs.items()]
    return table(["run", "training time, static over run (pairs)", "time to target, static over run (pairs)",
                  "median step ms, static / run (pairs)", "second half over static (pairs)", "moves (pairs)"],
                 lines, "lrrrrr")


def _pairs_body(data: Data, run_id: str, res: dict) -> List[str]:
    """Each placement run beside a static run of its own (two emulated clusters at once; ``res``: the run's data):
    per cell, a table."""
    out = []
    for cell in res["cells"]:
        out += [f"**{cell['tokens_per_rank']:,} tokens per rank, each run beside its own static**, "
                f"{res['setup']['steps']} steps a run (a pair per value).", _pairs_table(cell["pairs"])]
    return out + [data.provenance(run_id).rstrip(".") + ".", data.command(run_id)]


def _cell_label(setup: dict) -> str:
    return (f"{setup['tokens_per_rank']:,} tokens per rank, {setup['inter_node_bandwidth'] / 1e6:.0f} MB/s between "
            f"nodes, {setup['rounds']} interleaved rounds of {setup['steps']} steps")


@section("planners")
def planners(data: Data) -> Section:
    big, small = data.json("planners-2048"), data.json("planners-512")
    over_big, over_small = over_static(big["cells"][0]["rows"]), over_static(small["cells"][0]["rows"])
    flex = [v for v in over_big["flexmoe"] if v]
    floor_result, floor_met = never_lose(over_small)
    runs = ["planners-2048", "planners-512"]
    pairs_body = []
    if "planners-pairs" in data.runs:
        # the floor as resolved beside a static run of its own; in the text these replace the 512-token runs one
        # after another (the figure keeps them)
        pairs = data.json("planners-pairs")
        pairs_body = _pairs_body(data, "planners-pairs", pairs)
        small_pairs = next(c for c in pairs["cells"] if c["tokens_per_rank"] == 512)
        floor_result, floor_met = never_lose(pairs_over_static(small_pairs["pairs"]),
                                             "pairs, training time beside its own static")
        runs.append("planners-pairs")
    small_body = pairs_body or [
        f"**{_cell_label(small['setup'])}**, where the model predicts little to gain. "
        + data.provenance("planners-512").rstrip(".") + ".",
        _planner_table(small["cells"][0]), data.command("planners-512")]
    body = "\n\n".join([
        f"**{_cell_label(big['setup'])}**, skewed routing, no balance loss. " + data.provenance("planners-2048"),
        _planner_table(big["cells"][0]), data.command("planners-2048"), *small_body,
        "![time to target over static per round](docs/figures/benchmarks/planners_over_static.png)"])
    heads = [Headline("planners: FlexMoE over static dropless, time to target (2,048 tokens per rank)",
                      span(flex) + " (rounds)", f">= {ratio(PLANNER_TARGET)}", min(flex) >= PLANNER_TARGET, "planners"),
             Headline("planners: never lose where nothing pays (512 tokens per rank)", floor_result,
                      f">= {ratio(NEVER_LOSE)} of static", floor_met, "planners")]
    return Section("planners", "`megamoe bench planners`: placement on the emulated cluster", body, heads, runs)


def _capacity_rows(summary: Dict[str, dict]) -> List[list]:
    return [[name, f"{s['step_seconds'][0] * 1e3:.0f} ± {s['step_seconds'][1] * 1e3:.0f}",
             percent(s["dropped"][0]), f"{s['link_bytes_per_step'][0] / 1e6:.1f}",
             f"{s['final_valid_loss'][0]:.3f} ± {s['final_valid_loss'][1]:.3f}"] for name, s in summary.items()]


def dynamic_vs_static(summary: Dict[str, dict], dynamic: str = "dynamic q=0.9"):
    """Static's step over the dynamic policy's at the dynamic policy's drop rate (paper 000 Fig. 9 reads the two
    curves at equal drops): static's step interpolated linearly in the drop rate between the two static factors
    around it (the nearest one outside their range). Returns (which statics, the ratio)."""
    dyn = summary[dynamic]
    drop = dyn["dropped"][0]
    statics = sorted((s["dropped"][0], s["step_seconds"][0], name) for name, s in summary.items()
                     if name.startswith("CF="))
    below = [s for s in statics if s[0] <= drop]
    above = [s for s in statics if s[0] > drop]
    if below and above:
        step = interp([below[-1][:2], above[0][:2]], drop)
        name = f"{below[-1][2]} and {above[0][2]}"
    else:
        _d, step, name = (below or above)[-1 if below else 0]
    return name, step / dyn["step_seconds"][0]


@section("capacity")
def capacity(data: Data) -> Section:
    small, big, cache = data.json("capacity-512"), data.json("capacity-2048"), data.json("capacity-caching")
    heads, parts = [], []
    for run, res in (("capacity-512", small), ("capacity-2048", big)):
        name, step_ratio = dynamic_vs_static(res["summary"])
        heads.append(Headline(f"capacity: DynaMoE's dynamic capacity over static factors "
                              f"({res['setup']['batch_size'] * 64:,} tokens per rank)",
                              f"{ratio(step_ratio)} per step vs static at equal drops ({name})",
                              ">= 1.00x per step at equal drops", step_ratio >= 1.0, "capacity"))
        parts += [f"**{res['setup']['label']}**, {res['setup']['steps']} steps. " + data.provenance(run),
                  table(["config", "step ms (mean ± sd)", "dropped", "link MB/step", "valid loss (mean ± sd)"],
                        _capacity_rows(res["summary"]), "lrrrr"), data.command(run)]
    parts = [p if not p.endswith(")") else p + "." for p in parts]
    figures = [f"![{name}](docs/data/{data.runs[run]['figure']})" for run, name in
               (("capacity-512", "step time against drops, 512 tokens per rank"),
                ("capacity-2048", "drops against step, 2,048 tokens per rank")) if data.runs[run].get("figure")]
    per_seed = cache["caching"]["per_seed"]
    parts += [f"**Assignment caching**: {cache['setup']['label']}, {cache['setup']['steps']} steps. "
              + data.provenance("capacity-caching") + ".",
              table(["seed", "caching on from epoch", "steps with caching on", "speed over dynamic's, those steps"],
                    [[s["seed"], s["cache_on_epoch"], s["steps_on"], ratio(s["ratio"])]
                     for s in per_seed], "rrrr"),
              data.command("capacity-caching")] + figures
    return Section("capacity", "`megamoe bench capacity`: DynaMoE's capacity on the emulated cluster",
                   "\n\n".join(parts), heads, ["capacity-512", "capacity-2048", "capacity-caching"])


def gates_medians(data: Data) -> Dict[str, float]:
    """TA-MoE by bias's median time-to-target speed-up per topology (for the README and results.md)."""
    return {r["topology"]: r["speedup_vs_alf"] for run in ("gates-2x2", "gates-3asym")
            for r in data.json(run)["summary"] if r["config"] == "ta_moe_bias"}

