"""The results pages' figures, drawn from the same shipped data as their tables (``megamoe results --figures``).

- layer.png: ours, megatron-core and the floor per shape and routing, CPU and GPU (`bench layer`);
- planners_over_static.png: each placement run's time to target over static's, per round (`bench planners`);
- gates_time_to_target.png: each routing's time to target over the aux-loss-free baseline, seeds and median
  (`bench gates`).
"""
from __future__ import annotations

import os
from typing import List

from ..bench.gates import LABELS, TOPOLOGY_LABELS
from ..reproduce.common import save_figure
from .registry import Data
from .sections_cluster import over_static
from .sections_local import layer_cpu_cells, layer_gpu_cells

FOLDER = os.path.join("docs", "figures", "benchmarks")


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _bars(ax, labels: List[str], series: dict, ylabel: str, title: str) -> None:
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=name)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(labels))])
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)


def _save(fig, title: str, out: str, name: str) -> str:
    fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, out, name)


def layer(data: Data, out: str) -> str:
    plt = _plt()
    cpu, gpu = layer_cpu_cells(data), layer_gpu_cells(data)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    _bars(axes[0], [f"{c['config'].split(':')[0]}\n{c['routing']}" for c in cpu],
          {"ours": [c["ours"] for c in cpu], "megatron-core MoELayer": [c["megatron"] for c in cpu],
           "expert floor": [c["floor"] for c in cpu]}, "ms, forward + backward",
          f"CPU, fp32 ({data.runs['layer-cpu']['date']}): lower is faster")
    _bars(axes[1], [f"{c['config']}\n{c['routing']}" for c in gpu],
          {"ours": [c["ours"] for c in gpu], "megatron-core SequentialMLP": [c["megatron"] for c in gpu],
           "grouped GEMM floor": [c["floor"] for c in gpu]}, "ms, forward + backward",
          f"GPU, {data.gpu_name()} bf16 ({data.runs['layer-gpu']['date']})")
    title = "`megamoe bench layer`: one MoE layer per shape (config) and routing, forward + backward"
    return _save(fig, title, out, "layer")


def planners(data: Data, out: str) -> str:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, run in zip(axes, ("planners-2048", "planners-512")):
        res = data.json(run)
        over = {k: v for k, v in over_static(res["cells"][0]["rows"]).items() if k != "static"}
        rounds = len(next(iter(over.values())))
        _bars(ax, list(over), {f"round {i + 1}": [v[i] or 0 for v in over.values()] for i in range(rounds)},
              "static's time to target / the run's",
              f"{res['setup']['tokens_per_rank']:,} tokens per rank, "
              f"{res['setup']['inter_node_bandwidth'] / 1e6:.0f} MB/s between nodes")
        ax.axhline(1.0, color="black", linewidth=0.8)
    title = "`megamoe bench planners` on the emulated cluster: above 1 is faster than static placement"
    return _save(fig, title, out, "planners_over_static")


def gates(data: Data, out: str) -> str:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, run in zip(axes, ("gates-2x2", "gates-3asym")):
        summary = [r for r in data.json(run)["summary"] if r["config"] != "alf"]
        for i, r in enumerate(summary):
            ax.scatter([i] * len(r["speedup_vs_alf_seeds"]), r["speedup_vs_alf_seeds"], color="grey", s=14)
            ax.bar(i, r["speedup_vs_alf"], 0.6, alpha=0.6)
        ax.set_xticks(range(len(summary)))
        ax.set_xticklabels([LABELS[r["config"]].strip("*") for r in summary], rotation=30, ha="right", fontsize=8)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(TOPOLOGY_LABELS[summary[0]["topology"]], fontsize=10)
    axes[0].set_ylabel("baseline's time to target / the routing's")
    title = "`megamoe bench gates`: time to target over the aux-loss-free baseline (bars: median; dots: seeds)"
    return _save(fig, title, out, "gates_time_to_target")


def draw(data: Data) -> List[str]:
    out = os.path.join(data.root, FOLDER)
    os.makedirs(out, exist_ok=True)
    return [layer(data, out), planners(data, out), gates(data, out)]
