"""`megamoe reproduce deployment`: MoE inference deployment (paper 004) -- dynamic vs static gating (§V, Figs. 9-10),
expert-buffering cache miss rates (§VI-C, Fig. 12) and expert load balancing (§VII, Fig. 14).

What is measured, and by which code (this module only drives it and presents the results):

* Figs. 9-10: ``megamoe bench inference`` (``bench/inference.py``; BENCHMARKS.md, section inference): one tiny
  MoE LM with the same weights through the paper's static gating (dense [T, E, C] masks and einsums at its LM
  capacity factor 12.8), this package's capacity dispatch at CF 1, 2 and 12.8, and dynamic (dropless) gating;
  throughput (tokens/s, median LM forward), peak activation memory and the largest batch within a memory budget.
  ``--fast``: the bench's ``quick`` setting; full mode: its ``default``. On the CPU the model is randomly
  initialised (as the bench's default); a CUDA device is used when there is one.
* Fig. 12: ``inference.cache_sim.miss_curve`` replays a routing trace of a trained model (default: the shipped
  ``deploy_small`` trace: ``megamoe train`` 16 experts, top-2, 4 MoE layers, traced over held-out text in 16-token
  batches, see examples/reproduce/make_traces.sh) through a per-device cache of expert slots, experts in contiguous
  blocks over ``CACHE_DEVICES`` devices, for LIFO (the paper's), FIFO, LRU, LFU and Belady's MIN; and again with a
  load-balancing (anti-correlation, the paper's for Fig. 12) placement fitted on the first half of the trace's
  batches. All curves replay the held-out second half, so the balanced placement is never judged on the data it was
  fitted on. The miss rate is the worst case over layers and devices (Fig. 12's metric).
* Fig. 14: ``inference.balance.evaluate_placements`` per layer of the same trace on ``BALANCE_DEVICES`` devices:
  Max Load and Avg Max Load on the held-out half for the original order (identity), greedy and anti-correlation
  placements fitted on the first half.

Each table has the paper's own numbers as ``paper`` rows (only those stated in its text; the figures' bars are not
read off), and ``anchors`` lines each paper number up with this run's. Cache and balance numbers are computed here
from the trace (deterministic: the same on any machine), labelled ``computed from trace (<trace>)``.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional

from .common import mark_fast, PAPER, Table, from_trace, header, print_tables, save_figure, shipped_trace

__all__ = ["PAPER_NUMBERS", "CACHE_DEVICES", "BALANCE_DEVICES", "TRACE", "run", "gating_tables", "cache_results",
           "cache_table", "balance_results", "balance_table", "anchors_table"]

CPU = "measured here (CPU)"
TRACE = "deploy_small"
CACHE_DEVICES = 2            # 16 experts -> 8 per device: cache sizes 1..8 (the paper: 1..16 of 16 per GPU)
BALANCE_DEVICES = 4          # 16 experts -> 4 per device; perfect balance = 0.25
CACHE_POLICIES = ("lifo", "fifo", "lru", "lfu", "belady")
BALANCED_POLICIES = ("lifo", "fifo", "belady")
PAPER_NUMBERS = {
    "throughput_vs_static": 6.21, "throughput_vs_tutel": 3.32,            # §V-B Fig. 9, LM on one node
    "throughput_vs_static_multinode": 11.55,                              # LM, multi-node
    "activation_gb_static": 6.29, "activation_gb_dynamic": 1.28, "memory_batch": 8,   # §V-B Fig. 10, LM
    "max_batch_static": 8, "max_batch_dynamic": 64,                       # LM, 32 GB V100s
    "static_memory_reduction": 1.47,                                      # §VI, expert buffering (MT decoder)
    "cache_sizes": "1-16 of 16 per GPU", "total_memory_saved": "0-32.2%",  # §VI-C Fig. 12
    "load_before": 0.6, "load_after": 0.4,                                # §VII-A Fig. 14, LM: > 0.6 -> < 0.4
}


def _label(device_name: Optional[str]) -> str:
    return CPU if not device_name or device_name == "CPU" else f"measured here (GPU {device_name})"


def _r(v, digits: int):
    """Round for the table (ints for 0 digits); None stays None."""
    if v is None:
        return None
    return int(round(v)) if digits == 0 else round(float(v), digits)


def _mib(b) -> float:
    return b / float(1 << 20)


# --- Figs. 9-10: static vs dynamic gating ----------------------------------------------------------------------
def gating_tables(res: dict) -> List[Table]:
    """fig9_throughput, fig10_memory and fig10_largest_batch from ``bench.inference.run``'s result."""
    s = res["setup"]
    src = _label(s["device_name"] if s["device"].startswith("cuda") else None)
    dyn, static = res["dynamic"], res["static_baseline"]
    P = PAPER_NUMBERS
    setup = (f"{'CUDA ' + s['device_name'] if s['device'].startswith('cuda') else 'CPU'}, {s['threads']} thread(s); "
             f"tiny MoE GPT ({s['layers']} blocks, {s['moe_layers']} MoE, hidden {s['hidden']}, E="
             f"{s['moe']['num_experts']} top-{s['moe']['top_k']} {s['moe']['gate']}, random init), sequences of "
             f"{s['seq_len']} tokens of the {s['split']} split; eval, no_grad; median of {s['repeat']} interleaved "
             f"rounds; load average {s['load_avg'][0]:.1f} -> {s['load_avg'][1]:.1f}; {s['wall_s']:.0f} s")
    rows = [r for r in res["rows"] if r["in_table"]]
    by = {(r["impl"], r["batch"]): r for r in res["rows"]}

    f9 = Table("fig9_throughput", "Fig. 9: inference throughput by batch size, static vs dynamic gating",
               ["batch", "implementation", "tokens/s", "forward ms", "dropped %", "memory budget",
                "dynamic speedup", "source"])
    for r in rows:
        d = by.get((dyn, r["batch"]))
        sp = (d["tokens_per_s"] / r["tokens_per_s"]) if d and d["tokens_per_s"] and r["tokens_per_s"] else None
        f9.add(r["batch"], r["impl"], _r(r["tokens_per_s"], 0), _r(r["fwd_ms"], 2),
               _r(100.0 * r["dropped_fraction"], 2), "over" if r["over_budget"] else "within", _r(sp, 3), src)
    best = res["ratios"]["best_within_budget"]
    for name in (static, dyn):
        if name in best:
            f9.add(f"best within budget ({best[name]['batch']})", name, _r(best[name]["tokens_per_s"], 0), None, None,
                   "within", _r(best[dyn]["tokens_per_s"] / best[name]["tokens_per_s"], 3) if dyn in best else None,
                   src)
    f9.add("best feasible", "static gating (LM, 1 node)", None, None, None, "within", P["throughput_vs_static"],
           PAPER)
    f9.add("best feasible", "Tutel gating (LM, 1 node)", None, None, None, "within", P["throughput_vs_tutel"], PAPER)
    f9.add("best feasible", "static gating (LM, multi-node)", None, None, None, "within",
           P["throughput_vs_static_multinode"], PAPER)
    f9.notes += [setup,
                 f"dynamic speedup = {dyn} tokens/s / the row's at the same batch (the 'best within budget' rows: "
                 f"at the batch each runs fastest within {s['budget_mb']:g} MiB). static einsum = the paper's static "
                 f"gating (dense [T, E, C] masks, CF 12.8 = its LM waste factor); static capacity = the same fixed "
                 "buffers by index; CF 1 and 2 drop tokens at inference.",
                 "'-' tokens/s: the static forward passed the abort limit (4 x the budget) and was stopped, not "
                 "timed (the paper's missing bars). Paper rows: maxima over the batch sizes each policy can run "
                 "(§V-B); its per-batch bars are not given in the text. Tutel's gating is not implemented here."]

    f10 = Table("fig10_memory", "Fig. 10: peak activation memory by batch size, static vs dynamic gating",
                ["batch", "implementation", "activation peak", "MoE peak MiB", "static / dynamic", "source"])
    for r in rows:
        d = by.get((dyn, r["batch"]))
        peak = f"> {_mib(r['peak_bytes']):.2f} MiB (stopped)" if r["aborted"] else f"{_mib(r['peak_bytes']):.3f} MiB"
        ratio = None if r["aborted"] or not d else r["peak_bytes"] / max(d["peak_bytes"], 1)
        f10.add(r["batch"], r["impl"], peak, None if r["aborted"] else _r(_mib(r["moe_peak_bytes"]), 3), _r(ratio, 2),
                src)
    gb_s, gb_d = P["activation_gb_static"], P["activation_gb_dynamic"]
    f10.add(P["memory_batch"], "static gating (LM, 1 node)", f"{gb_s:g} GB", None, round(gb_s / gb_d, 2), PAPER)
    f10.add(P["memory_batch"], "dynamic gating (LM, 1 node)", f"{gb_d:g} GB", None, 1.0, PAPER)
    f10.notes += [setup, f"memory: {s['memory_method']}; activations only (parameters and the input excluded), as "
                         "Fig. 10's light bars. static / dynamic = the row's peak over dynamic gating's at the batch."]

    fl = Table("fig10_largest_batch", "Fig. 10: largest batch within a memory budget",
               ["implementation", "memory budget", "largest batch", "source"])
    for name, v in res["largest_batch"].items():
        b = v["batch"]
        fl.add(name, f"{s['budget_mb']:g} MiB activations", "none" if b is None else
               (f">= {b} (the cap)" if v["capped"] else b), src)
    fl.add("static gating (LM)", "32 GB V100s (whole model)", P["max_batch_static"], PAPER)
    fl.add("dynamic gating (LM)", "32 GB V100s (whole model)", P["max_batch_dynamic"], PAPER)
    fl.notes.append(f"batch doubled from 1 up to {s['max_batch']} (the cap) while the activation peak stays within "
                    "the budget.")
    return [f9, f10, fl]


# --- Fig. 12: expert buffering cache miss rates -------------------------------------------------------------------
def _halves(trace: dict):
    S = int(trace["counts"].shape[0])
    if S < 2:
        raise ValueError(f"the trace has {S} batch(es); need at least 2 (fit on one half, replay the other)")
    return trace["counts"][: S // 2], trace["counts"][S // 2:]


def cache_results(trace: dict, devices: int = CACHE_DEVICES, weight: float = 0.5) -> dict:
    """Miss curves on the held-out half: contiguous placement (all policies) and an anti-correlation placement per
    layer fitted on the first half (LIFO, FIFO, Belady)."""
    from ..inference.balance import anticorrelation_placement, layer_loads
    from ..inference.cache_sim import miss_curve

    fit, test = _halves(trace)
    L = int(trace["counts"].shape[1])
    placement = [anticorrelation_placement(layer_loads(fit, l), devices, weight) for l in range(L)]
    return {"identity": miss_curve(test, devices, policies=CACHE_POLICIES),
            "balanced": miss_curve(test, devices, policies=BALANCED_POLICIES, placement=placement),
            "placement": placement, "fit_batches": int(fit.shape[0]), "test_batches": int(test.shape[0]),
            "devices": devices}


def cache_table(c: dict, trace_desc: str) -> Table:
    ident, bal = c["identity"], c["balanced"]
    cols = (["cache/device", "expert memory saved"] + [f"{p.upper() if p != 'belady' else 'Belady'}"
                                                       for p in CACHE_POLICIES]
            + [f"{p.upper() if p != 'belady' else 'Belady'} + LB" for p in BALANCED_POLICIES] + ["source"])
    t = Table("fig12_miss_rate", "Fig. 12: worst-case expert-cache miss rate vs cache size per device", cols,
              fmt="{:.3f}")
    for i, size in enumerate(ident["sizes"]):
        t.add(size, f"{100 * ident['memory_saved'][i]:.1f}%", *[ident["worst"][p][i] for p in CACHE_POLICIES],
              *[bal["worst"][p][i] for p in BALANCED_POLICIES], from_trace(trace_desc))
    P = PAPER_NUMBERS
    t.add(P["cache_sizes"], f"{P['total_memory_saved']} of total static memory", "falls faster above 5",
          "above LIFO", "-", "-", "lowest", "close to Belady", "-", "-", PAPER)
    t.notes += [f"{trace_desc}; {c['devices']} devices x {ident['experts_per_device']} experts, each with its own "
                f"cache; fitted on batches 1-{c['fit_batches']}, replayed on the held-out {c['test_batches']}.",
                "miss rate = misses / expert activations of a (layer, device), cold misses included; worst case over "
                f"{ident['layers']} layers x {c['devices']} devices (Fig. 12's metric). '+ LB': experts placed by "
                "anti-correlation balancing (weight 0.5) fitted on the first half, per layer; the other columns "
                "keep contiguous blocks. Expert memory saved = 1 - cache / experts per device (the paper reports "
                "the share of total static memory, MT decoder).",
                "paper row: Fig. 12 (MT decoder, 128 experts on 8 GPUs) -- LIFO below FIFO, the miss rate falling "
                "faster above 5 per GPU, and with load balancing LIFO close to Belady's MIN; its values are read off "
                "no figure here."]
    return t


# --- Fig. 13: memory vs latency of expert buffering ---------------------------------------------------------------
FIG13_EXPERT_BYTES = 1024 * 4096 * 2 * 2        # an expert of H 1024, FFN 4096 in fp16 (two matrices)
FIG13_HOST_BANDWIDTH = 12e9                     # paper 004 §VI: CPU-GPU copies saturated at 12 GB/s


def fig13_table(trace: dict, c: dict, trace_desc: str) -> Table:
    """Fig. 13: per cache size, the experts' static memory per device and the time one batch spends loading missed
    experts from host memory (LIFO, the pooled miss rate of the held-out half x the expert activations per device
    and batch x the expert's bytes / the host link)."""
    ident = c["identity"]
    _, test = _halves(trace)
    S, L, _, E = test.shape
    active = float((test.sum(2) > 0).sum()) / (S * c["devices"])      # expert activations per device and batch
    label = from_trace(f"{trace_desc.split(' (')[0].replace('trace ', '')}; 16 MiB experts, 12 GB/s host link")
    t = Table("fig13_memory_latency", "Fig. 13: expert memory vs expert-load latency per cache size (LIFO)",
              ["cache/device", "expert memory per device (MiB)", "LIFO miss rate (pooled)",
               "misses per device and batch", "expert loads per batch (ms)", "source"], fmt="{:.4g}")
    for i, size in enumerate(ident["sizes"]):
        rate = ident["pooled"]["lifo"][i]
        misses = rate * active
        t.add(size, size * FIG13_EXPERT_BYTES / 2**20, rate, misses,
              misses * FIG13_EXPERT_BYTES / FIG13_HOST_BANDWIDTH * 1e3, label)
    t.add("a series of sizes", "-", "-", "-", "Pareto frontier; latency grows as the cache shrinks, bounded by "
          "the 12 GB/s CPU-GPU copies (values only in the figure)", PAPER)
    t.notes += [f"{trace_desc}; held-out half ({S} batches), {c['devices']} devices x {E // c['devices']} "
                f"experts, {active:.2f} expert activations per device and batch over the {L} layers.",
                "memory = cache slots x one expert of H 1024 / FFN 4096 in fp16 (16 MiB; the paper's MT decoder "
                "sizes are not in its text); latency = the misses' copies at 12 GB/s (the bandwidth the paper saw "
                "saturate), serialised, nothing overlapped with compute: an upper bound on the added latency."]
    return t


# --- Fig. 14: load balancing ---------------------------------------------------------------------------------------
def balance_results(trace: dict, devices: int = BALANCE_DEVICES, weight: float = 0.5) -> Dict[int, dict]:
    """{layer id: evaluate_placements(...)} (fit on the first half, evaluate on the second)."""
    from ..inference.balance import evaluate_placements, layer_loads

    return {int(lid): evaluate_placements(layer_loads(trace, j), devices, weight)
            for j, lid in enumerate(trace["layers"])}


def balance_table(b: Dict[int, dict], devices: int, batches: int, trace_desc: str) -> Table:
    t = Table("fig14_load_balance", "Fig. 14: Max Load and Avg Max Load before and after load balancing",
              ["layer", "placement", "Max Load", "Avg Max Load", "source"], fmt="{:.3f}")
    for lid, res in b.items():
        for name in ("identity", "greedy", "anticorrelation"):
            t.add(lid, name, res[name]["max_load"], res[name]["avg_max_load"], from_trace(trace_desc))
    P = PAPER_NUMBERS
    t.add("LM (paper)", "identity (original order)", f"> {P['load_before']:g}", f"> {P['load_before']:g}", PAPER)
    t.add("LM (paper)", "greedy", f"< {P['load_after']:g}", f"< {P['load_after']:g}", PAPER)
    t.notes += [f"{trace_desc}; {devices} devices (perfect balance = {1 / devices:.3f}); placements fitted on the "
                f"first {batches // 2} batches, loads measured on the held-out {batches - batches // 2}. Max Load = "
                "the largest share of a batch's assignments one device ever gets; Avg Max Load = the per-batch "
                "largest share, averaged.",
                "paper rows: §VII-A, LM: 'reducing from more than 0.6 to less than 0.4' (both metrics); its "
                "per-layer bars are not given in the text."]
    return t


# --- anchors ----------------------------------------------------------------------------------------------------------
def anchors_table(gating: Optional[dict], cache: dict, bal: Dict[int, dict], bal_devices: int,
                  trace_desc: str = TRACE) -> Table:
    P = PAPER_NUMBERS
    a = Table("anchors", "MoE deployment (paper 004): the paper's numbers and this run's",
              ["figure", "quantity", "value", "source"])
    if gating is not None:
        s = gating["setup"]
        src = _label(s["device_name"] if s["device"].startswith("cuda") else None)
        dyn, static = gating["dynamic"], gating["static_baseline"]
        best = gating["ratios"]["best_within_budget"]
        a.add("Fig. 9", "max throughput, dynamic / static gating", f"{P['throughput_vs_static']:g}x (LM, 1 node); "
              f"{P['throughput_vs_tutel']:g}x vs Tutel", PAPER)
        if static in best and dyn in best:
            a.add("Fig. 9", "max throughput, dynamic / static gating",
                  f"{gating['ratios']['best_throughput_ratio']:.2f}x ({dyn} at batch {best[dyn]['batch']} vs {static} "
                  f"at batch {best[static]['batch']}, within {s['budget_mb']:g} MiB); Tutel not reproduced", src)
        rows = {(r["impl"], r["batch"]): r for r in gating["rows"]}
        b = P["memory_batch"]
        a.add("Fig. 10", f"activation memory at batch {b}, static -> dynamic",
              f"{P['activation_gb_static']:g} GB -> {P['activation_gb_dynamic']:g} GB "
              f"({P['activation_gb_static'] / P['activation_gb_dynamic']:.2f}x)", PAPER)
        st, d = rows.get((static, b)), rows.get((dyn, b))
        if st and d:
            a.add("Fig. 10", f"activation memory at batch {b}, static -> dynamic",
                  (f"> {_mib(st['peak_bytes']):.2f} MiB (stopped)" if st["aborted"] else
                   f"{_mib(st['peak_bytes']):.2f} MiB") + f" -> {_mib(d['peak_bytes']):.2f} MiB"
                  + ("" if st["aborted"] else f" ({st['peak_bytes'] / max(d['peak_bytes'], 1):.2f}x)"), src)
        a.add("Fig. 10", "largest batch, static / dynamic gating",
              f"{P['max_batch_static']} / {P['max_batch_dynamic']}", PAPER)
        lb = gating["largest_batch"]

        def lbs(n):
            v = lb.get(n, {})
            return "none" if v.get("batch") is None else (f">= {v['batch']}" if v["capped"] else str(v["batch"]))
        a.add("Fig. 10", "largest batch, static / dynamic gating",
              f"{lbs(static)} / {lbs(dyn)} (within {s['budget_mb']:g} MiB of activations)", src)

    trace_label = from_trace(trace_desc)
    ident, balc = cache["identity"], cache["balanced"]
    sizes = ident["sizes"]
    a.add("Fig. 12", "LIFO vs FIFO (worst-case miss rate)", "LIFO better than FIFO", PAPER)
    mid = [i for i, c in enumerate(sizes) if 1 < c < ident["experts_per_device"]]    # equal at 1 and full
    lf = [(ident["worst"]["lifo"][i], ident["worst"]["fifo"][i]) for i in mid]
    a.add("Fig. 12", "LIFO vs FIFO (worst-case miss rate)",
          f"LIFO below FIFO at {sum(l < f for l, f in lf)}, equal at {sum(l == f for l, f in lf)}, above at "
          f"{sum(l > f for l, f in lf)} of the {len(mid)} sizes between 1 and a full cache", trace_label)
    a.add("Fig. 12", "LIFO with load balancing vs Belady", "very close to Belady's MIN", PAPER)
    gap = lambda c: max(l - b for l, b in zip(c["worst"]["lifo"], c["worst"]["belady"]))     # noqa: E731
    a.add("Fig. 12", "LIFO with load balancing vs Belady",
          f"largest LIFO - Belady gap over sizes: {gap(ident):.3f} contiguous, {gap(balc):.3f} balanced", trace_label)
    a.add("§VI", "static memory reduction at a tolerable miss rate",
          f"up to {P['static_memory_reduction']:g}x (MT decoder)", PAPER)
    half = min(sizes, key=lambda c: abs(c - ident["experts_per_device"] / 2))
    i = sizes.index(half)
    a.add("§VI", "static memory reduction at a tolerable miss rate",
          f"cache {half} of {ident['experts_per_device']}: expert memory / "
          f"{ident['experts_per_device'] / half:.2f}, worst-case LIFO miss rate {ident['worst']['lifo'][i]:.3f}", trace_label)
    a.add("Fig. 14", "Max Load, original order -> greedy", f"> {P['load_before']:g} -> < {P['load_after']:g} (LM)",
          PAPER)
    mean = lambda key, name: sum(r[name][key] for r in bal.values()) / len(bal)       # noqa: E731
    a.add("Fig. 14", "Max Load, original order -> greedy",
          f"{mean('max_load', 'identity'):.3f} -> {mean('max_load', 'greedy'):.3f} (mean over {len(bal)} layers; Avg "
          f"Max Load {mean('avg_max_load', 'identity'):.3f} -> {mean('avg_max_load', 'greedy'):.3f}; {bal_devices} "
          f"devices, perfect = {1 / bal_devices:.3f})", trace_label)
    return a


# --- figures --------------------------------------------------------------------------------------------------------
def _plt():
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    return plt


def figure_gating(res: dict, what: str):
    plt = _plt()
    import matplotlib.ticker
    s = res["setup"]
    fig, ax = plt.subplots(figsize=(6.6, 4.2))
    for i, im in enumerate(res["impls"]):
        rows = sorted((r for r in res["rows"] if r["impl"] == im["name"]), key=lambda r: r["batch"])
        if what == "throughput":
            pts = [(r["batch"], r["tokens_per_s"], r["over_budget"]) for r in rows if r["tokens_per_s"]]
        else:
            pts = [(r["batch"], _mib(r["peak_bytes"]), r["aborted"]) for r in rows]
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", color=f"C{i}", markersize=3, label=im["name"])
        over = [p for p in pts if p[2]]
        if over:
            ax.plot([p[0] for p in over], [p[1] for p in over], "x", color=f"C{i}", markersize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    batches = sorted({r["batch"] for r in res["rows"]})
    ax.set_xticks(batches)
    ax.set_xticklabels([str(b) for b in batches])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("batch size (sequences of %d tokens)" % s["seq_len"])
    where = "GPU" if s["device"].startswith("cuda") else "CPU"
    if what == "throughput":
        ax.set_ylabel("tokens/s")
        ax.set_title(f"Fig. 9 shape: throughput, static vs dynamic gating ({where}; x: over budget)", fontsize=9)
    else:
        ax.axhline(s["budget_mb"], color="grey", linestyle="--", linewidth=1, label=f"budget {s['budget_mb']:g} MiB")
        ax.set_ylabel("peak activation memory (MiB)")
        ax.set_title(f"Fig. 10 shape: activation memory ({where}; x: stopped at 4 x budget)", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return fig


def figure12(c: dict):
    plt = _plt()
    ident, bal = c["identity"], c["balanced"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.0), sharey=True)
    x = ident["sizes"]
    colors = {"lifo": "C0", "fifo": "C1", "lru": "C4", "lfu": "C5", "belady": "C3"}
    for p in ("lifo", "fifo"):
        axes[0].plot(x, ident["worst"][p], "-o", color=colors[p], markersize=3, label=f"{p.upper()}")
        axes[0].plot(x, bal["worst"][p], "--s", color=colors[p], markersize=3, label=f"{p.upper()} + LB")
    axes[0].set_title("(a) with / without reassignment (load balancing)", fontsize=9)
    for p in CACHE_POLICIES:
        axes[1].plot(x, ident["worst"][p], "-o", color=colors[p], markersize=3,
                     label=p.upper() if p != "belady" else "Belady's MIN")
    axes[1].plot(x, bal["worst"]["lifo"], "--s", color=colors["lifo"], markersize=3, label="LIFO + LB")
    axes[1].plot(x, bal["worst"]["belady"], "--s", color=colors["belady"], markersize=3, label="Belady + LB")
    axes[1].set_title("(b) against the offline optimum", fontsize=9)
    for ax in axes:
        ax.set_xlabel(f"cache size per device (experts, of {ident['experts_per_device']})")
        ax.set_xticks(x)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("worst-case miss rate (layers x devices)")
    fig.suptitle(f"Fig. 12 shape: expert buffering on the held-out {c['test_batches']} batches, {c['devices']} devices",
                 fontsize=10)
    fig.tight_layout()
    return fig


def figure14(bal: Dict[int, dict], devices: int):
    plt = _plt()
    import numpy as np

    names = ("identity", "greedy", "anticorrelation")
    layers = list(bal)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    w = 0.27
    for ax, key, title in zip(axes, ("max_load", "avg_max_load"), ("Max Load", "Avg Max Load")):
        for i, n in enumerate(names):
            ax.bar(np.arange(len(layers)) + (i - 1) * w, [bal[l][n][key] for l in layers], w, color=f"C{i}",
                   label=n)
        ax.axhline(1 / devices, color="grey", linestyle="--", linewidth=1, label=f"perfect ({1 / devices:.2f})")
        ax.set_xticks(np.arange(len(layers)))
        ax.set_xticklabels([f"layer {l}" for l in layers])
        ax.set_title(title, fontsize=9)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylabel("share of a batch's assignments on one device")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Fig. 14 shape: load before / after balancing ({devices} devices, held-out half)", fontsize=10)
    fig.tight_layout()
    return fig


# --- the command ----------------------------------------------------------------------------------------------------
def run(out_dir: str, fast: bool, log=print, trace: Optional[str] = None, gating: bool = True, seed: int = 0) -> dict:
    """`trace`: a routing trace prefix (default: the shipped ``deploy_small``); `gating`: run the Figs. 9-10 bench."""
    from ..stats import load_trace

    trace_path = trace or shipped_trace(TRACE)
    log(header("deployment", fast, f"trace {trace_path}"))
    tr = load_trace(trace_path)
    S, L, _, E = tr["counts"].shape
    desc = (f"trace {os.path.basename(trace_path)} ({S} batches x {L} MoE layers x {E} experts, top-"
            f"{tr.get('top_k', '?')}, {int(tr['counts'][0, 0].sum())} assignments per layer in its first batch)")
    tables: List[Table] = []
    figures: List[str] = []
    gres = None
    if gating:
        from ..bench import inference as bench
        gres = bench.run(dict(bench.SETTINGS["quick" if fast else "default"]), seed=seed, log=log)
        tables += gating_tables(gres)
        figures += [save_figure(figure_gating(gres, "throughput"), out_dir, "fig9_throughput"),
                    save_figure(figure_gating(gres, "memory"), out_dir, "fig10_memory")]
    log(f"cache simulation and load balancing on {desc}")
    cache = cache_results(tr, CACHE_DEVICES)
    tables.append(cache_table(cache, desc))
    figures.append(save_figure(figure12(cache), out_dir, "fig12_miss_rate"))
    tables.append(fig13_table(tr, cache, desc))
    bal = balance_results(tr, BALANCE_DEVICES)
    tables.append(balance_table(bal, BALANCE_DEVICES, S, desc))
    figures.append(save_figure(figure14(bal, BALANCE_DEVICES), out_dir, "fig14_load_balance"))
    tables.append(anchors_table(gres, cache, bal, BALANCE_DEVICES, desc))
    paths = [t.write(out_dir) for t in mark_fast(tables, fast)]
    print_tables(tables, figures, log, fast=fast)
    return {"tables": paths, "figures": figures}
