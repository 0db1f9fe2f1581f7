"""Rows measured on the emulated cluster for `megamoe reproduce tamoe | fastermoe`, from the results folder of
`megamoe bench gates` (``--cluster-results DIR``: DIR/results.json, made with root by ``megamoe bench gates --out
DIR``). Every row's source names the cluster's shaping ("measured, emulated cluster: 2 nodes x 2, inter-node 100
MB/s, intra-node 400 MB/s"). Without the folder, one row says how to produce it."""
from __future__ import annotations

import json
import os
from typing import Optional

from ..bench.gates import shaping_label

__all__ = ["load", "add_table1_rows", "add_gate_rows", "add_schedule_rows", "add_schedule_bound_rows", "shaping_label", "NODES", "HOW"]

NODES = {"2x2": "2 nodes x 2", "3asym": "3 nodes of 2+1+1"}
HOW = "not run here: needs `megamoe bench gates --out DIR` (root; ~25 min), then --cluster-results DIR"


def load(path: Optional[str]) -> Optional[dict]:
    if not path:
        return None
    with open(os.path.join(path, "results.json")) as f:
        return json.load(f)


def add_table1_rows(table, res: Optional[dict], columns: int) -> None:
    """TA-MoE Table 1 on the shaped links: All (us) and even / this, per pattern."""
    if res is None or "table1" not in res:
        table.add(*(["emulated cluster: not run"] + [None] * (columns - 2) + [HOW]))
        return
    secs = res["table1"]["seconds"]
    even = secs["even (1/4 each)"]
    for name, s in secs.items():
        row = [name, 128.0, None, None, None, None, s * 1e6, even / s, None, None, shaping_label(res)]
        table.add(*row)


def add_gate_rows(table, res: Optional[dict], gates=("gshard", "ta_moe"), with_target: bool = True) -> None:
    """Time to a common target and off-node share per gate configuration (the convergence / Table 3 rows)."""
    if res is None:
        table.add(*(["emulated cluster: not run"] + [None] * (len(table.columns) - 2) + [HOW]))
        return
    runs = [r for r in res["runs"] if r["config"].split(":")[0] in gates]
    for topology in dict.fromkeys(r["topology"] for r in runs):
        mine = [r for r in runs if r["topology"] == topology]
        base = next((r for r in mine if r["config"] == "gshard"), mine[0])
        for r in mine:
            speed = base["time_to_target"] / r["time_to_target"] if r.get("time_to_target") else None
            label = f"{r['config']} ({topology})"
            table.add(label, None, r.get("time_to_target"), min(e["loss"] for e in r["evals"]),
                      r["final_valid_loss"], r["off_node_share"], r["step_seconds"] * 1e3, speed,
                      shaping_label(res, NODES.get(topology, topology)))


def add_schedule_rows(table, res: Optional[dict]) -> None:
    """Smart schedule per layer on the cluster (plain / smart, measured), beside its predictions."""
    if res is None or not res.get("schedule"):
        table.add(*(["smart schedule on the emulated cluster: not run"] + [None] * (len(table.columns) - 2) + [HOW]))
        return
    for s in res["schedule"]:
        config, groups = s["case"].split(":")
        table.add(f"smart schedule, config {config}, {groups} groups, a2a {s['comm_share']:.0%} of the layer",
                  f"plain {s['plain_ms']:.0f} ms, smart {s['smart_ms']:.0f} ms", None, s["measured_ratio"], None, None,
                  shaping_label({"shaping": dict(res["shaping"], intra=None)}))


def add_schedule_bound_rows(table, res: Optional[dict]) -> None:
    """Fig. 12 on the cluster: per smart-schedule case, the all-to-all share, the bound and the measured speedup."""
    if res is None or not res.get("schedule"):
        table.add(*(["emulated cluster: not run"] + [None] * (len(table.columns) - 2) + [HOW]))
        return
    label = shaping_label({"shaping": dict(res["shaping"], intra=None)})
    for s in res["schedule"]:
        config, groups = s["case"].split(":")
        gain = (s["measured_ratio"] - 1) / (s["upper_bound"] - 1) if s["upper_bound"] > 1 else None
        table.add("emulated cluster, 4 ranks", f"config {config}, {groups} groups", "-", s["comm_share"],
                  s["upper_bound"], s["measured_ratio"], gain, label)
