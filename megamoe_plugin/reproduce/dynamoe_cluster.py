"""DynaMoE's capacity measured on the emulated cluster, for `megamoe reproduce dynamoe --cluster-results PATHS`
(paper 000 §5.1 Fig. 6 / Fig. 9: the drop-rate / step-time trade-off).

Reads the results of ``megamoe bench capacity`` (``results.json`` in its ``--out`` folder, or that file itself;
a comma list for several settings, e.g. 512 and 2,048 tokens per rank), made with root on fixed-speed ranks
over several seeds, and presents them as one table: per configuration the mean and standard deviation over the
seeds of the step time, the dropped fraction and the final validation loss, the bytes per step over the
inter-node links, and for every dynamic policy the static curve's step time at the policy's dropped fraction
divided by the policy's own step (piecewise linear through the static factors and dropless dispatch, which drops
nothing): above 1 the policy is faster than a static factor at equal drops (it dominates there), below 1 a
static factor is faster. Results with ``dynamic`` and ``dynamic+cache`` (the caching regime:
``--max-train-samples``) also give ``caching_table``: per seed, the epoch caching switched on and the step time
over the steps it was on against ``dynamic``'s over the same steps. Nothing is re-measured here.
"""
from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Optional

from ..cluster import cpu_caps
from .common import interp, PAPER, Table

__all__ = ["load", "cluster_table", "caching_table", "static_step_at", "source_label", "HOW"]

HOW = ("not run here: needs `megamoe bench capacity --seeds 0,1,2 --out DIR` (root, about an hour), then "
       "--cluster-results DIR")


def load(paths: Optional[str]) -> List[dict]:
    """The bench's results, one per comma-separated path (a results folder or its results.json)."""
    out = []
    for path in filter(None, (paths or "").split(",")):
        file = os.path.join(path, "results.json") if os.path.isdir(path) else path
        if not os.path.exists(file):
            raise SystemExit(f"--cluster-results: {path!r} has no results of `megamoe bench capacity` "
                             "(a folder with results.json, or the file)")
        with open(file) as f:
            res = json.load(f)
        if "summary" not in res or "setup" not in res:
            raise SystemExit(f"--cluster-results: {file} is not a `megamoe bench capacity` result (no summary)")
        out.append(res)
    return out


def _tokens_per_rank(setup: dict) -> Optional[str]:
    found = re.search(r"(\d+) tokens per rank", setup.get("label", ""))
    return found.group(1) if found else None


def source_label(setup: dict) -> str:
    """'measured, emulated cluster: 2 nodes x 2, fixed-speed ranks (0.45 core each), inter-node 100 MB/s, ...'."""
    tokens = _tokens_per_rank(setup)
    seeds = setup.get("seeds") or []
    parts = ["measured, emulated cluster: 2 nodes x 2", cpu_caps.source_label(setup.get("cpu_shares")),
             f"inter-node {setup['inter_node_bandwidth'] / 1e6:.0f} MB/s"]
    if tokens:
        parts.append(f"{tokens} tokens per rank")
    parts.append(f"{setup.get('steps')} steps, {len(seeds)} seed{'s' if len(seeds) != 1 else ''}")
    return ", ".join(parts)


def static_step_at(summary: Dict[str, dict], dropped: float) -> Optional[float]:
    """The static curve's step time (s) at a dropped fraction: linear between the neighbouring static points
    (CF=* and dropless at 0 drops), None outside their range."""
    return interp([(s["dropped"][0], s["step_seconds"][0]) for name, s in summary.items()
                   if name.startswith("CF=") or name == "dropless"], dropped)


def _pm(mean_sd, scale: float = 1.0, digits: int = 3) -> str:
    return f"{mean_sd[0] * scale:.{digits}f} ± {mean_sd[1] * scale:.{digits}f}"


def cluster_table(results: List[dict]) -> Table:
    t = Table("fig9_cluster", "Fig. 9 on the emulated cluster: static capacity factors, dynamic capacity and "
              "dropless dispatch (`megamoe bench capacity`; mean ± standard deviation over the seeds)",
              ["setting", "config", "step ms", "dropped fraction", "link MB/step", "final valid loss",
               "static step at equal drops / this", "source"])
    t.add("paper (Fig. 6)", "dynamic capacity vs the no-drop static factor, same accuracy",
          "1.4x faster (1.7x with caching)", None, None, "same", None, PAPER)
    if not results:
        t.add("emulated cluster: not run", None, None, None, None, None, None, HOW)
        return t
    for res in results:
        summary, setup = res["summary"], res["setup"]
        tokens = _tokens_per_rank(setup)
        setting = f"{tokens} tokens per rank" if tokens else "-"
        if setup.get("max_train_samples"):
            setting += f", the first {setup['max_train_samples']} training samples (caching regime)"
        label = source_label(setup)
        for name, s in summary.items():
            ratio = None
            if name.startswith("dynamic"):
                at = static_step_at(summary, s["dropped"][0])
                ratio = at / s["step_seconds"][0] if at else None
            t.add(setting, name, _pm(s["step_seconds"], 1e3, 0), _pm(s["dropped"]),
                  s["link_bytes_per_step"][0] / 1e6, _pm(s["final_valid_loss"]), ratio, label)
            if name.startswith("dynamic") and ratio is not None:
                verdict = "faster than" if ratio > 1 else "slower than"
                t.notes.append(f"{setting}, {name}: {verdict} the static curve at its dropped fraction "
                               f"({s['dropped'][0]:.3f}) by {abs(ratio - 1):.0%} in the means"
                               + (f"; dominated beyond one standard deviation by {', '.join(s['dominated_by'])}"
                                  if s.get("dominated_by") else "; no static factor is faster and drops less "
                                  "beyond one standard deviation of both"))
    t.notes.append("step ms: each run's median step; dropped fraction: of the assignments, over the whole run; "
                   "link MB/step: bytes over the inter-node links per step, measured on the links (every "
                   "collective). The static curve runs through the static factors and dropless dispatch.")
    return t


def caching_table(results: List[dict]) -> Optional[Table]:
    """§5.3 on the emulated cluster: assignment caching against the same dynamic policy without it, per seed;
    None when no result compared them."""
    with_cache = [r for r in results if r.get("caching")]
    if not with_cache:
        return None
    t = Table("fig10_cluster_caching", "Assignment caching on the emulated cluster (`megamoe bench capacity "
              "--configs dynamic,dynamic+cache --max-train-samples N`): dynamic+cache against dynamic, same seed",
              ["setting", "seed", "caching on from epoch", "layer calls from the cache", "steps on",
               "step ms with caching on / dynamic, same steps", "speedup on those steps",
               "control: the steps before caching was on (equal work)", "whole run", "source"])
    t.add("paper (§5.3, Fig. 10)", None, "about 10", None, None, None, "1.15x (none from caching alone in its "
          "expert-parallel mapping, §5.1)", None, None, PAPER)
    for res in with_cache:
        setup = res["setup"]
        setting = (f"first {setup.get('max_train_samples')} training samples, {setup.get('steps')} steps, caching "
                   f"on at {setup.get('cache_on', 0.96):g} (off below {setup.get('cache_off', 0.9):g})")
        for x in res["caching"]["per_seed"]:
            steps = (f"{x['on_step_seconds'] * 1e3:.0f} / {x['dynamic_step_seconds'] * 1e3:.0f}"
                     if "ratio" in x else None)
            t.add(setting, x["seed"], x["cache_on_epoch"] if x["cache_on_epoch"] is not None else "never",
                  x.get("cached_calls"), x["steps_on"], steps, x.get("ratio"), x.get("off_ratio"), x["whole_run_ratio"],
                  source_label(setup))
        if res["caching"]["ratio"] is not None:
            t.notes.append(f"{setting}: the steps with caching on ran {_pm(res['caching']['ratio'])}x as fast "
                           "as the same steps of the dynamic run (mean ± standard deviation over the seeds)"
                           + (f"; the steps before it, with equal work in both runs, "
                              f"{_pm(res['caching']['off_ratio'])}x: the run-to-run noise"
                              if res["caching"].get("off_ratio") else "") + ".")
    t.notes.append("A step with caching on still runs the gate (its probabilities weight the combine and it keeps "
                   "training); what caching saves is the wait for the gate before the dispatch, which only "
                   "concurrent execution (a side stream on a GPU) can hide.")
    return t
