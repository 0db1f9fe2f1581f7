"""``megamoe bench planners --paired``: each placement run trained at the same time as its own static run, on two
emulated clusters side by side, so that a drift of the machine's speed falls on both alike.

Run one after the other, two runs that do the same work (static and ``idle``) have differed by up to 20% on this
machine within one bench, more than the 3% a never-lose floor must resolve. Side by side, each rank of the two jobs
gets half its CPU share and each link half its bandwidth: the same ratio of compute to wire as one job at the full
share, at half the speed, and 8 ranks capped at half the share ask no more of the cores than 4 at the full one.
A run's "over static" is then over the static beside it, round by round (``static_beside``).
"""
from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import time
from typing import Callable, Dict, List, Optional

BESIDE_KEYS = ("step_seconds", "mean_step_seconds", "late_step_seconds", "time_to_target")
START_GAP_S = 5.0      # the second job starts after the first has registered its cluster (no clean-up race)


def _child(fn: Callable[[], dict], path: str) -> None:
    row = fn()
    with open(path, "w") as f:
        json.dump(row, f)


def run_side_by_side(first: Callable[[], dict], second: Callable[[], dict], folder: str) -> List[dict]:
    """Run ``first`` and ``second`` (each returns a JSON-able row) at the same time, each in its own forked process
    (each launcher owns its signal handlers and its cluster); their rows, in that order. A failed one raises."""
    ctx = multiprocessing.get_context("fork")
    os.makedirs(folder, exist_ok=True)
    paths = [os.path.join(folder, f"side{i}.json") for i in range(2)]
    procs = []
    for fn, path in zip((first, second), paths):
        if os.path.exists(path):
            os.remove(path)
        proc = ctx.Process(target=_child, args=(fn, path))
        proc.start()
        procs.append(proc)
        time.sleep(START_GAP_S)
    for proc in procs:
        proc.join()
    bad = [i for i, proc in enumerate(procs) if proc.exitcode != 0 or not os.path.exists(paths[i])]
    if bad:
        raise RuntimeError(f"megamoe bench planners --paired: side {bad} failed (exit codes "
                           f"{[p.exitcode for p in procs]}; logs under {folder})")
    rows = []
    for path in paths:
        with open(path) as f:
            rows.append(json.load(f))
    return rows


def pair_rows(static: dict, run: dict) -> dict:
    """``run``'s row with the static that ran beside it (``static_beside``: its step times and time to target)."""
    return dict(run, static_beside={k: static.get(k) for k in BESIDE_KEYS})


def median_static(statics: List[dict]) -> dict:
    """One round's static row from its copies (one beside each run): the copy with the median time to target."""
    ranked = sorted(statics, key=lambda r: (r.get("time_to_target") is None, r.get("time_to_target") or 0.0))
    return ranked[(len(ranked) - 1) // 2]


def paired_speedups(row: dict) -> Dict[str, Optional[float]]:
    """The median over the rounds of the static beside's step time over the run's (per step, whole run, second
    half); {} for a row that was not paired."""
    beside = row.get("static_beside_rounds")
    if not beside:
        return {}
    out = {}
    for key, name in (("step_seconds", "measured_speedup"), ("mean_step_seconds", "mean_speedup"),
                      ("late_step_seconds", "late_speedup")):
        out[name] = statistics.median(b[key] / v for b, v in zip(beside, row[f"{key}_rounds"]))
    return out
