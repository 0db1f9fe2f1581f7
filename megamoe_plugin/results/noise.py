"""BENCHMARKS.md's "noise and limits": the run-to-run spread of each testbed, from the shipped runs.

CPU: two `bench layer` runs of the same code on the same day (the current one and `layer-cpu-previous`).
Emulated cluster: the baseline's own spread across the interleaved rounds (planners) and the seeds (gates,
capacity) of the current runs. The one-process benchmarks that `megamoe reproduce` runs again for docs/results.md:
both runs, side by side. The GPU runs were single runs: no spread is known.
"""
from __future__ import annotations

from typing import List

from .claims import PaperTables
from .mdtable import percent, ratio, table
from .registry import Data
from .sections_local import layer_rows, number


def _spread(values: List[float]) -> float:
    return max(values) / min(values) - 1


def noise(data: Data) -> str:
    rows = []
    now, before = layer_rows(data.text("layer-cpu")), layer_rows(data.text("layer-cpu-previous"))
    for impl in ("ours dropless", "megatron-core MoELayer"):
        changes = [number(now[c][impl]["time (ms)"]) / number(before[c][impl]["time (ms)"]) - 1
                   for c in now if c in before]
        rows.append(["CPU", f"`bench layer`, {impl}: two runs on {data.runs['layer-cpu']['date']}, hours apart "
                     f"(commits {data.runs['layer-cpu-previous']['commit']} and {data.runs['layer-cpu']['commit']}: "
                     "no change to the layer's computation), the cells both ran, later over earlier", f"{percent(min(changes), 0, True)} to "
                     f"{percent(max(changes), 0, True)}"])
    for run in ("planners-2048", "planners-512"):
        res = data.json(run)
        static = next(r for r in res["cells"][0]["rows"] if r["run"] == "static")
        rows.append(["emulated cluster", f"`bench planners` ({res['setup']['tokens_per_rank']:,} tokens per rank): "
                     "static's median step, max / min over the rounds", percent(_spread(static["step_seconds_rounds"]), 0)])
    for run in ("gates-2x2", "gates-3asym"):
        base = [r["step_seconds"] for r in data.json(run)["runs"] if r["config"] == "alf"]
        rows.append(["emulated cluster", f"`bench gates` ({run[6:]}): the baseline's median step, max / min over "
                     "the seeds", percent(_spread(base), 0)])
    for run in ("capacity-512", "capacity-2048"):
        summary = data.json(run)["summary"]
        cv = [s["step_seconds"][1] / s["step_seconds"][0] for name, s in summary.items() if name.startswith("CF=")]
        rows.append(["emulated cluster", f"`bench capacity` ({run[9:]} tokens per rank): a static factor's step, "
                     "standard deviation / mean over the seeds", f"{percent(min(cv), 0)} to {percent(max(cv), 0)}"])
    # the same one-process benchmarks run again by `megamoe reproduce` (docs/results.md) on the same day
    papers = PaperTables(data.root)
    again = number(papers.cell("MoE deployment (paper 004): the paper's numbers", "value", figure="Fig. 9",
                               quantity="max throughput", source="measured"))
    here = data.json("inference")["ratios"]["best_throughput_ratio"]
    rows.append(["CPU", "`bench inference`, dynamic over static gating's best throughput: this page's run and "
                 "`megamoe reproduce deployment`'s (docs/results.md), same day", f"{ratio(here)} and {ratio(again)}"])
    again = number(papers.cell("DynaMoE (paper 000): the paper's numbers", "value", figure="Fig. 6",
                               quantity="^dynamic vs no-drop", source="measured").split("step")[1])
    here = data.json("dynamic")["ratios"]["dynamic"]["step"]
    rows.append(["CPU", "`bench dynamic`, dynamic over no-drop per step: this page's run and `megamoe reproduce "
                 "dynamoe`'s (docs/results.md), same day", f"{ratio(here)} and {ratio(again)}"])
    rows.append(["GPU", "each GPU number is one run (one lent machine); no spread is known", "-"])
    return table(["testbed", "what varied", "spread"], rows)
