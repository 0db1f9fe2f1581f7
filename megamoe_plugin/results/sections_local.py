"""Sections of the one-machine benchmarks: `bench layer` (CPU and GPU), `megatron`, `schedule`, `placement`,
`dynamic`, `inference`.

`bench layer` and `bench megatron` ship their markdown output; the others their ``--json`` results. The targets
are the ones each benchmark was built against (megatron-core's layer, the expert floor, paper 003 §4.2's overlap,
paper 001 / 003's placement, paper 000 §5 and paper 004's Fig. 9).
"""
from __future__ import annotations

import re
from typing import Dict, List, Tuple

from .mdtable import number, ratio, read_tables, span, table
from .registry import Data, Headline, Section, section

LAYER_VS_MEGATRON = 1.10
LAYER_VS_MEGATRON_GPU = 1.20
FLOOR_SHAPE_1 = 1.05


def layer_rows(text: str) -> Dict[Tuple[str, str], Dict[str, dict]]:
    """{(config, routing): {implementation: row}} from a `bench layer --output` file."""
    cells: Dict[Tuple[str, str], Dict[str, dict]] = {}
    for rows in read_tables(text):
        for r in rows:
            if "implementation" in r:
                cells.setdefault((r["config"], r["routing"].split(" (")[0]), {})[r["implementation"]] = r
    return cells


def _floor(impls: Dict[str, dict]) -> dict:
    return next(r for name, r in impls.items() if name.startswith("expert floor") and number(r["/ expert floor"]) == 1.0)


def layer_cpu_cells(data: Data) -> List[dict]:
    """Per shape and routing: ours, megatron-core and the floor (ms), from the CPU run; used by the figure too."""
    out = []
    for (config, routing), impls in layer_rows(data.text("layer-cpu")).items():
        ours, mc = impls["ours dropless"], impls["megatron-core MoELayer"]
        ds_ours, ds_mc = impls.get("ours dropless, deepseek-v3 router"), impls.get("megatron-core MoELayer, deepseek-v3 router")
        out.append({"config": config, "routing": routing, "ours": number(ours["time (ms)"]),
                    "megatron": number(mc["time (ms)"]), "floor": number(_floor(impls)["time (ms)"]),
                    "ours_ds": number(ds_ours["time (ms)"]) if ds_ours else None,
                    "megatron_ds": number(ds_mc["time (ms)"]) if ds_mc else None})
    return out


def layer_gpu_cells(data: Data) -> List[dict]:
    out = []
    for (config, routing), impls in layer_rows(data.text("layer-gpu")).items():
        out.append({"config": config, "routing": routing, "ours": number(impls["ours dropless"]["time (ms)"]),
                    "megatron": number(impls["megatron-core SequentialMLP"]["time (ms)"]),
                    "grouped": number(impls["megatron-core GroupedMLP"]["time (ms)"]),
                    "te": number(impls["megatron-core TE grouped"]["time (ms)"]),
                    "floor": number(impls["grouped GEMM floor"]["time (ms)"])})
    return out


@section("layer")
def layer(data: Data) -> Section:
    cpu, gpu = layer_cpu_cells(data), layer_gpu_cells(data)
    cpu_rows = [[c["config"], c["routing"], f"{c['ours']:.1f}", f"{c['megatron']:.1f}", f"{c['floor']:.1f}",
                 f"{c['ours'] / c['floor']:.3f}", ratio(c["megatron"] / c["ours"]),
                 ratio(c["megatron_ds"] / c["ours_ds"]) if c["ours_ds"] else "-",
                 f"{c['ours_ds'] / c['ours']:.3f}" if c["ours_ds"] else "-"] for c in cpu]
    def ms(v):                       # a grouped peer that did not run there (no grouped_gemm package): "-"
        return "-" if v is None else f"{v:.2f}"

    def best_grouped(c):
        done = [v for v in (c["grouped"], c["te"]) if v is not None]
        return ratio(min(done) / c["ours"]) if done else "-"

    gpu_rows = [[c["config"], c["routing"], ms(c["ours"]), ms(c["megatron"]), ms(c["grouped"]), ms(c["te"]),
                 ms(c["floor"]), ratio(c["megatron"] / c["ours"]), best_grouped(c)] for c in gpu]
    vs_mc = [c["megatron"] / c["ours"] for c in cpu]
    shape1 = [c["ours"] / c["floor"] for c in cpu if c["config"].startswith("1")]
    vs_gpu = [c["megatron"] / c["ours"] for c in gpu]
    body = "\n\n".join([
        "**CPU.** " + data.provenance("layer-cpu") + ".",
        table(["shape", "routing", "ours ms", "megatron-core ms", "floor ms", "ours / floor", "megatron-core / ours",
               "megatron-core / ours, DeepSeek-V3 router", "DeepSeek-V3 router / softmax, ours"], cpu_rows,
              "llrrrrrrr"),
        data.command("layer-cpu"),
        "**GPU.** " + data.provenance("layer-gpu") + ".",
        table(["config", "routing", "ours ms", "SequentialMLP ms", "GroupedMLP ms", "TE grouped ms",
               "grouped GEMM floor ms", "SequentialMLP / ours", "best grouped / ours"], gpu_rows, "llrrrrrrr"),
        data.command("layer-gpu"),
        "![ours, megatron-core and the floor per shape, CPU and GPU](docs/figures/benchmarks/layer.png)"])
    heads = [Headline("layer (CPU): megatron-core's MoELayer / ours, forward + backward", span(vs_mc) + " over "
                      f"{len(vs_mc)} cells", f">= {ratio(LAYER_VS_MEGATRON)} in every cell",
                      min(vs_mc) >= LAYER_VS_MEGATRON, "layer"),
             Headline("layer (CPU): ours / expert floor, first shape", span(shape1, 3, ""), f"<= {FLOOR_SHAPE_1:.2f}",
                      max(shape1) <= FLOOR_SHAPE_1, "layer"),
             Headline(f"layer (GPU, {data.gpu_name()} bf16): megatron-core's SequentialMLP / ours", span(vs_gpu) + " over "
                      f"{len(vs_gpu)} cells", f">= {ratio(LAYER_VS_MEGATRON_GPU)} in every cell",
                      min(vs_gpu) >= LAYER_VS_MEGATRON_GPU, "layer")]
    return Section("layer", "`megamoe bench layer`: one MoE layer, forward + backward", body, heads,
                   ["layer-cpu", "layer-gpu"])


PAPER_004_LOW = 6.21


@section("inference")
def inference(data: Data) -> Section:
    res = data.json("inference")
    best = res["ratios"]["best_within_budget"]
    base = res["static_baseline"]
    rows = [[name, v["batch"], f"{v['tokens_per_s']:,.0f}", res["largest_batch"][name]["batch"]]
            for name, v in best.items()]
    at8 = next(b for b in res["ratios"]["per_batch"] if b["batch"] == 8)["vs"][base]
    setup = res["setup"]
    body = "\n\n".join([
        data.provenance("inference") + f". Tiny MoE GPT ({setup['layers']} blocks, E={setup['experts']} top-"
        f"{setup['top_k']}), activations within {setup['budget_mb']:.0f} MiB.",
        table(["implementation", "batch of its best throughput", "tokens/s", "largest batch within the budget"], rows,
              "lrrr"),
        f"Dynamic gating over {base}: best throughput within the budget "
        f"{ratio(res['ratios']['best_throughput_ratio'])}; activation memory at batch 8 {ratio(at8['memory'])} less.",
        data.command("inference")])
    head = Headline("inference: dynamic over static gating, best throughput within the memory budget (paper 004 "
                    "Fig. 9)", ratio(res["ratios"]["best_throughput_ratio"]),
                    f">= {ratio(PAPER_004_LOW)} (the paper's low end)",
                    res["ratios"]["best_throughput_ratio"] >= PAPER_004_LOW, "inference")
    return Section("inference", "`megamoe bench inference`: dynamic vs static gating (paper 004)", body, [head],
                   ["inference"])




@section("schedule")
def schedule(data: Data) -> Section:
    res = data.json("schedule")
    m = res["measured"]
    rows = [["measured", f"{m['plain'] * 1e3:.1f}", f"{m['smart'] * 1e3:.1f}", ratio(res["measured_ratio"], 3)],
            ["measured, one group (nothing to overlap)", f"{m['plain'] * 1e3:.1f}", f"{m['single'] * 1e3:.1f}",
             ratio(m["plain"] / m["single"], 3)],
            ["predicted: components measured here + Fig. 8 timeline", f"{res['components_pred']['plain'] * 1e3:.1f}",
             f"{res['components_pred']['smart'] * 1e3:.1f}", ratio(res["components_ratio"], 3)],
            [f"predicted: perfmodel (profile '{res['perfmodel']['profile']}')", f"{res['perfmodel']['plain'] * 1e3:.1f}",
             f"{res['perfmodel']['smart'] * 1e3:.1f}", ratio(res["perfmodel"]["ratio"], 3)]]
    body = "\n\n".join([
        data.provenance("schedule") + f". {res['P']} gloo processes, H={res['H']} F={res['F']} E={res['E']} "
        f"top-{res['k']}, {res['T']:,} tokens per rank, {res['routing']} routing; outputs equal "
        f"(max difference {res['max_abs_diff']:.1e}).",
        table(["", "plain ms", "smart ms", "plain / smart"], rows, "lrrr"),
        f"Paper 003 §5.5's bound for this split of exchange and expert time: {ratio(res['upper_bound'], 3)}.",
        data.command("schedule")])
    head = Headline("schedule: FasterMoE's smart schedule over plain, one layer, 2 processes",
                    ratio(res["measured_ratio"], 3) + f" (bound {ratio(res['upper_bound'], 3)})", "> 1.00x",
                    res["measured_ratio"] > 1.0, "schedule")
    return Section("schedule", "`megamoe bench schedule`: FasterMoE's smart schedule (paper 003 §4.2)", body, [head],
                   ["schedule"])


DYNAMOE_ANCHOR = 1.4


@section("dynamic")
def dynamic(data: Data) -> Section:
    res = data.json("dynamic")
    rows = [[r["name"], f"{r['avg_capacity_factor']:.2f}", f"{r['dropped_fraction'] * 100:.1f}%", r["recompilations"],
             f"{r['moe_ms']:.1f}", f"{r['step_ms']:.1f}", f"{r['val_loss']:.4f}"] for r in res["runs"]]
    ratios = [[name, ratio(v["moe"]), ratio(v["step"]), f"{v['val_loss_delta']:+.4f}",
               ratio(v["anchor"], 1) if v.get("anchor") else "-"] for name, v in res["ratios"].items()]
    s = res["setup"]
    body = "\n\n".join([
        data.provenance("dynamic") + f". Tiny GPT ({s['layers']} blocks, E={s['experts']} {s['moe']['gate']} "
        f"top-{s['moe']['top_k']}), {s['steps']} steps, runs interleaved step by step.",
        table(["run", "average capacity factor", "dropped", "recompilations", "MoE ms / step", "step ms",
               "final valid loss"], rows, "lrrrrrr"),
        table(["over no-drop static", "MoE layers", "step", "valid loss", "paper"], ratios, "lrrrr"),
        data.command("dynamic")])
    step = res["ratios"]["dynamic"]["step"]
    head = Headline("dynamic: DynaMoE's dynamic capacity over no-drop static, one process (paper 000 Fig. 6)",
                    f"{ratio(step)} per step, valid loss {res['ratios']['dynamic']['val_loss_delta']:+.3f}",
                    f">= {ratio(DYNAMOE_ANCHOR, 1)} (the paper's)", step >= DYNAMOE_ANCHOR, "dynamic")
    return Section("dynamic", "`megamoe bench dynamic`: DynaMoE's dynamic capacity and caching (paper 000)", body,
                   [head], ["dynamic"])


MODELED_SHOWN = ("static EP", "static EP, capacity 1.0 (drops tokens)", "shadowing (last step)",
                 "FlexMoE (threshold 1.2, horizon 10)")


@section("placement")
def placement(data: Data) -> Section:
    res = data.json("placement")
    measured = res["measured"]
    static = next(r for r in measured["rows"] if r["strategy"] == "static EP")
    rows = [[r["strategy"], f"{r['median_s'] * 1e3:.1f}", ratio(static["median_s"] / r["median_s"]), r["moves"],
             f"{r['balance_first']:.2f} / {r['balance_mean']:.2f}"] for r in measured["rows"]]
    modeled = []
    for m in res["modeled"]:
        for r in m["rows"]:
            if r["label"] not in MODELED_SHOWN:
                continue
            modeled.append([f"{m['profile']}, {m['world_size']} GPUs", r["label"], f"{r['mean_total'] * 1e3:.2f}",
                            ratio(r["speedup"]), f"{r['mean_token_efficiency'] * 100:.0f}%"])
    by = {r["strategy"]: static["median_s"] / r["median_s"] for r in measured["rows"]}
    body = "\n\n".join([
        data.provenance("placement") + f". Measured: {measured['procs']} gloo processes, {measured['layers']} MoE "
        f"layers H={measured['hidden']} F={measured['ffn']} E={measured['experts']}, {measured['tokens_per_rank']:,} "
        f"tokens per rank, Zipf {measured['skew']:g} routing drifting {measured['drift']:g} per step; losses equal "
        f"(max relative difference {measured['loss_max_rel_diff']:.1e}).",
        table(["strategy", "median ms / step", "over static", "moves", "balance ratio first / mean"], rows, "lrrrr"),
        "Predicted by the placement simulator (MODELED, not measured) on the papers' clusters:",
        table(["profile", "strategy", "predicted ms / step", "over static", "token efficiency"], modeled, "llrrr"),
        data.command("placement")])
    heads = [Headline("placement: shadowing and FlexMoE over static EP, 2 processes, measured",
                      f"shadowing {ratio(by['shadow'])}, FlexMoE {ratio(by['flexmoe'])}", "> 1.00x",
                      min(by["shadow"], by["flexmoe"]) > 1.0, "placement")]
    return Section("placement", "`megamoe bench placement`: shadowing and FlexMoE, measured and modeled", body, heads,
                   ["placement"])


def _megatron_cells(text: str) -> List[dict]:
    """Per config and routing: ours and megatron's median ms, and the bench's own target for that cell."""
    cells, config = [], ""
    targets = {}
    for line in text.splitlines():
        if line.startswith("config ") and ", routing " in line:
            config = re.sub(r" seq=\d+ x batch=\d+ \((T=\d+)\) heads=\d+", r" \1", line.split(", routing ")[0])
        found = re.match(r"config (\d+) (\w+): .*\(target >= ([\d.]+)", line)
        if found:
            targets[(found[1], found[2])] = float(found[3])
        if line.startswith("| ") and ("| ours |" in line or "| megatron |" in line):
            cells.append((config, line))
    out: Dict[Tuple[str, str], dict] = {}
    for config, line in cells:
        routing, layer, ms = [c.strip() for c in line.strip("|").split("|")][:3]
        out.setdefault((config, routing), {})[layer] = float(ms)
    return [{"config": c, "routing": r, "ours": v["ours"], "megatron": v["megatron"],
             "target": targets[(c.split(":")[0].split()[1], r)]} for (c, r), v in out.items()]


@section("megatron")
def megatron(data: Data) -> Section:
    cells = _megatron_cells(data.text("megatron"))
    rows = [[c["config"], c["routing"], f"{c['ours']:.1f}", f"{c['megatron']:.1f}", ratio(c["megatron"] / c["ours"]),
             ratio(c["target"]), "met" if c["megatron"] / c["ours"] >= c["target"] else "missed"] for c in cells]
    body = "\n\n".join([
        data.provenance("megatron") + ". Megatron's own TransformerLayer (attention + MoE), built twice from one "
        "TransformerConfig; ours is the same spec with the plugin's MoE; outputs and gradients checked equal first.",
        table(["config", "routing", "ours ms", "megatron-core ms", "megatron-core / ours", "target", ""], rows,
              "llrrrrl"),
        data.command("megatron")])
    missed = [c for c in cells if c["megatron"] / c["ours"] < c["target"]]
    head = Headline("megatron: megatron-core's TransformerLayer with its MoE / with ours", span(
        c["megatron"] / c["ours"] for c in cells) + f" over {len(cells)} cells",
        ", ".join(f">= {ratio(t)} {r}" for r, t in {c["routing"]: c["target"] for c in cells}.items()), not missed,
        "megatron")
    return Section("megatron", "`megamoe bench megatron`: one megatron-core transformer layer", body, [head],
                   ["megatron"])
