"""`megamoe reproduce dynamoe`: DynaMoE (paper 000) -- static vs dynamic capacity factors (§5.1 Fig. 6, §5.2 Fig. 9)
and the fraction of tokens not reassigned per epoch that drives sample-assignment caching (§5.3 Fig. 10).

Everything measured comes from one call of ``megamoe bench dynamic`` (``bench/dynamic.py``; its docstring and
BENCHMARKS.md's dynamic section say how): one real-text LM trained seven times from the same weights
on the same data, static CF 1 / 2 / 4 / no-drop (CF = E/k), dynamic capacity (two policies) and dynamic + assignment
cache, interleaved step by step. ``--fast`` uses the bench's ``quick`` setting (seconds; the CI test), the full mode
its ``default`` (a few minutes on 2 cores). This module only presents the results as the paper's figures:

* ``fig9_runtime_vs_loss`` (table + PNG): per run, mean step time against final validation loss (the paper's
  runtime-accuracy plane), with average capacity factor, dropped fraction, recompilations and the speedup over the
  no-drop static factor; the paper's Fig. 6 speedups (1.4x dynamic, 1.7x with caching) as ``paper`` rows;
* ``fig10_cached_fraction`` (table + PNG): per epoch of the dynamic + cache run, the fraction of tokens whose
  assignment did not change since the previous epoch and whether caching was on, against the paper's thresholds;
* ``fig9_tradeoff``: each dynamic policy against the static curve at the same average factor, at the same dropped
  fraction and at the same step time (why the average rule drops more, and the quantile policy beside it);
* ``fig9_per_epoch``: dropped fraction and average factor per epoch of each capacity run (where the drops happen);
* ``fig8_capacity`` (table + PNG): the first MoE layer's per-expert capacity factors and demand ratios over training;
* ``fig10_caching_regime`` (table + PNG): a second bench call in the regime where the paper's caching pays (a small
  fixed dataset over many epochs, top-1; only no-drop, dynamic and dynamic + cache): the cached-fraction curve and
  the step time with caching on;
* ``anchors``: each of the paper's headline numbers in a ``paper`` row, followed by what this run measured.

The bench trains on the CPU (it never moves the model to a GPU), so its rows say ``measured here (CPU)`` on any
machine.
"""
from __future__ import annotations

from typing import Dict, List, Optional

from .common import interp, mark_fast, PAPER, Table, header, print_tables, save_figure

__all__ = ["PAPER_NUMBERS", "run", "tables_from_results", "interp_static_drop", "interp", "tradeoff_table",
           "capacity_table", "caching_table"]

CPU = "measured here (CPU)"        # bench/dynamic.py trains on the CPU whatever the machine has
PAPER_NUMBERS = {
    "speedup_dynamic": 1.4,           # §5.1 Fig. 6: dynamic CF vs the no-drop static CF, same accuracy
    "speedup_dynamic_cache": 1.7,     # §5.1 Fig. 6: dynamic CF + assignment caching
    "no_drop_alpha": 7.0,             # §5.1: the static factor that drops nothing in the paper's setup
    "cache_on": 0.96, "cache_off": 0.90, "cache_min_epoch": 10,     # §5.3 Fig. 10's policy
    "cache_off_epoch": 48,            # §5.3: caching briefly switched off during epoch 48
    "cache_speedup": 1.15,            # §5.3: the speedup caching gave in Fig. 10's training
}
STATIC = ("static CF=1", "static CF=2", "static CF=4", "static no-drop")
DYNAMIC = ("dynamic", "dynamic spread=0", "dynamic q=0.9")
CACHE_RUNS = ["static no-drop", "dynamic", "dynamic+cache"]
# the caching regime (§5.3: a fixed dataset trained to convergence over many epochs): few samples, many epochs,
# top-1, caching allowed from the paper's epoch 10
CACHING = {"quick": dict(samples=16, epochs=20), "default": dict(samples=48, epochs=60)}
CACHING_MIN_EPOCH = {"quick": 4, "default": 10}


def tradeoff_table(results: List[dict]) -> Table:
    """Fig. 9 read three ways, on the means over the seeds: each dynamic run against the static factors at its
    average capacity factor, at its dropped fraction and at its step time (static points interpolated)."""
    by_seed = [{r["name"]: r for r in res["runs"]} for res in results]

    def mean(name, key):
        return sum(runs[name][key] for runs in by_seed) / len(by_seed)

    st = {n: {k: mean(n, k) for k in ("avg_capacity_factor", "dropped_fraction", "step_ms", "val_loss")}
          for n in STATIC}
    cf_drop = [(v["avg_capacity_factor"], v["dropped_fraction"]) for v in st.values()]
    drop_cf = [(v["dropped_fraction"], v["avg_capacity_factor"]) for v in st.values()]
    cf_step = [(v["avg_capacity_factor"], v["step_ms"]) for v in st.values()]
    cf_loss = [(v["avg_capacity_factor"], v["val_loss"]) for v in st.values()]
    t = Table("fig9_tradeoff", f"Fig. 9 read at equal factor, equal drop rate and equal step time (means over "
              f"{len(results)} seed(s); static points interpolated)",
              ["dynamic run", "its CF / dropped % / step ms / valid loss", "static at equal CF: dropped %",
               "static at equal drop rate: CF / step ms / valid loss", "dynamic faster than static at equal drops",
               "source"])
    for name in DYNAMIC + ("dynamic+cache",):
        if not all(name in runs for runs in by_seed):
            continue
        cf, dr, ms, vl = (mean(name, k) for k in ("avg_capacity_factor", "dropped_fraction", "step_ms", "val_loss"))
        at_cf = interp(cf_drop, cf)
        eq_cf = interp(drop_cf, dr)
        eq_ms = None if eq_cf is None else interp(cf_step, eq_cf)
        eq_loss = None if eq_cf is None else interp(cf_loss, eq_cf)
        t.add(name, f"{cf:.2f} / {100 * dr:.1f}% / {ms:.1f} / {vl:.4f}",
              "-" if at_cf is None else f"{100 * at_cf:.1f}%",
              "-" if eq_cf is None else f"{eq_cf:.2f} / {eq_ms:.1f} / {eq_loss:.4f}",
              "-" if eq_ms is None else f"{eq_ms / ms:.3f}x", CPU)
    t.add("dynamic (paper)", "-", "-", "-", "1.4x at the accuracy of the no-drop factor", PAPER)
    t.notes += [
        "static curve: the four static runs' (CF, dropped fraction), (CF, step ms), (CF, valid loss), each mean over "
        "the seeds, joined by straight lines; 'at equal drop rate' finds the static CF with the dynamic run's "
        "dropped fraction on that line and reads its step time and loss there. A static step time within the "
        "seeds' spread of the dynamic one is a tie, not a result.",
        "why the average rule ('dynamic') can drop more than a static factor at the same average factor: it grows "
        "an expert only once the expert's smoothed demand exceeds its capacity, i.e. once it drops on AVERAGE, so "
        "an expert whose mean sits just under its capacity overflows on every above-average batch, and its "
        "smoothed demand lags the fast-changing routing of the first epochs (fig9_per_epoch: where the drops "
        "are). 'dynamic q=0.9' (--moe-capacity-policy quantile) grows an expert as soon as the 0.9-quantile of its "
        "demand over the last 32 steps exceeds its capacity."]
    return t


def per_epoch_table(res: dict) -> Table:
    """Dropped fraction and average capacity factor per epoch of every capacity run (where the drops happen)."""
    names = [n for n in STATIC[:3] + DYNAMIC if any(r["name"] == n for r in res["runs"])]
    runs = {r["name"]: r for r in res["runs"]}
    epochs = len(runs[names[0]]["per_epoch"])
    t = Table("fig9_per_epoch", "Fig. 9's runs per epoch: dropped % (average capacity factor)",
              ["run"] + [f"epoch {e + 1}" for e in range(epochs)] + ["source"])
    for n in names:
        t.add(n, *[f"{100 * e['dropped_fraction']:.1f}% ({e['avg_capacity_factor']:.2f})"
                   for e in runs[n]["per_epoch"]], CPU)
    t.add("paper (§5.2, Fig. 8)", "the imbalance varies over training; no per-epoch drops given",
          *["-"] * (epochs - 1), PAPER)
    t.notes.append(f"seed {res['setup']['seed']}; per epoch: assignments cut by the capacity / assignments, and "
                   "buffer rows / assignments, over that epoch's training steps. The balance loss evens the routing "
                   "out over the first epochs, so a static factor's drops are front-loaded; a dynamic policy that "
                   "lags the demand drops early too and keeps dropping on batch-to-batch jitter once it has shrunk.")
    return t


def _fig8_data(res: dict, name: str):
    """(capacities per step, smoothed demand per step, tokens per expert at perfect balance) of run ``name``'s
    first MoE layer, or None when the run recorded none."""
    run = next((r for r in res["runs"] if r["name"] == name and r.get("capacity_trace")), None)
    if run is None:
        return None
    s = res["setup"]
    return run["capacity_trace"], run["demand_trace"], s["batch"] * s["seq_len"] / s["moe"]["num_experts"]


def capacity_table(res: dict, name: str = "dynamic") -> Optional[Table]:
    """Fig. 8: the first MoE layer's per-expert capacity factor (capacity / mean demand per expert) over training,
    at a few points, and the spread of the demand between experts."""
    data = _fig8_data(res, name)
    if data is None:
        return None
    caps, dem, per_expert = data
    t = Table("fig8_capacity", f"Fig. 8: per-expert capacity factors over training ({name}, first MoE layer)",
              ["step", "capacity factor per expert (capacity / (tokens / E))", "demand / mean demand per expert",
               "source"])
    n = len(caps)
    for i in sorted({0, n // 8, n // 4, n // 2, 3 * n // 4, n - 1}):
        c, d = caps[i], dem[i]
        if not c:
            continue
        m = sum(d) / len(d) if d else 0.0
        t.add(i + 1, " ".join(f"{x / per_expert:.2f}" for x in c),
              " ".join(f"{x / m:.2f}" for x in d) if m > 0 else "-", CPU)
    t.add("over training", "different per expert and over time", "imbalanced, varies over training", PAPER)
    t.notes.append(f"capacity factor of an expert = its capacity / (tokens per step / E) = capacity / "
                   f"{per_expert:g}; demand = the policy's moving average of the assignments the gate sent the "
                   "expert (before the capacity cut) / its mean over the experts (the paper's 'ratio to the average "
                   "number of samples').")
    return t


def figure8(res: dict, name: str = "dynamic"):
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    caps, dem, per_expert = _fig8_data(res, name)
    fig, ax = plt.subplots(figsize=(7, 4))
    E = len(caps[-1])
    for e in range(E):
        ax.plot([c[e] / per_expert if c else None for c in caps], color=f"C{e % 10}", lw=1.4)
        ax.plot([d[e] / (sum(d) / len(d)) if d and sum(d) > 0 else None for d in dem], color=f"C{e % 10}",
                lw=0.8, alpha=0.35)
    ax.set_xlabel("training step")
    ax.set_ylabel("capacity factor (solid) / demand ratio (dim)")
    ax.set_title(f"DynaMoE Fig. 8: per-expert capacity factors ({name}, first MoE layer; measured here, CPU)",
                 fontsize=9)
    ax.grid(alpha=0.3)
    return fig


def caching_table(res: dict) -> Table:
    """Fig. 10 in the caching regime: per epoch, the fraction not reassigned and caching on/off, and the step
    times of dynamic + cache vs dynamic there."""
    s = res["setup"]
    runs = {r["name"]: r for r in res["runs"]}
    c = runs["dynamic+cache"]
    t = Table("fig10_caching_regime", f"Fig. 10 in the caching regime: {s['samples']} sequences, {s['epochs']} "
              "epochs (a fixed small dataset trained to convergence)", ["epoch", "fraction not reassigned",
                                                                       "caching on after it", "source"])
    for epoch, frac, on in res["fig10"]:
        if frac is not None:
            t.add(int(epoch), float(frac), "on" if on else "off", CPU)
    cache = c.get("cache", {})
    d = runs["dynamic"]
    on = cache.get("on_epoch")
    first = (on - 1) * s["steps_per_epoch"] if on is not None else None      # first step with caching on

    def ratio(key):
        xs, ys = d[key][first:], c[key][first:]
        return sum(xs) / sum(ys)

    if first is not None and first < len(c["step_s"]):
        t.add("dynamic+cache vs dynamic, steps with caching on", f"step {ratio('step_s'):.3f}x, MoE layers "
              f"{ratio('moe_s'):.3f}x", f"on from epoch {on} ({len(c['step_s']) - first} steps)", CPU)
    else:
        t.add("dynamic+cache vs dynamic", "-", "caching never on", CPU)
    t.add("10 onward", ">= 0.96", "on (1.15x from caching)", PAPER)
    t.notes += [f"tiny GPT as in Fig. 9 (E={s['moe']['num_experts']} top-1 switch), {s['samples']} training "
                f"sequences walked in the same order every epoch, {s['epochs']} epochs = {s['steps']} steps, "
                f"caching allowed from epoch {s['cache_min_epoch']} at >= {s['cache_on']:g} (off below "
                f"{s['cache_off']:g}); runs {', '.join(CACHE_RUNS)} interleaved step by step. The cosine learning "
                "rate decays over the run, which helps the assignments settle.",
                "speedup: summed step (MoE layer) times of dynamic / dynamic + cache over the steps where caching was "
                "on; on a CPU the gate and the experts run one after the other on the same cores, so skipping the "
                "wait for the gate saves nothing (paper §5.1: no speedup from caching where nothing could overlap).",
                f"caching took effect in epoch {cache['on_epoch']} ({cache['cached_calls']} MoE layer calls used "
                "cached assignments)" if cache.get("on_epoch") is not None else "caching never turned on"]
    return t


def interp_static_drop(runs: Dict[str, dict], cf: float) -> Optional[float]:
    """The static runs' dropped fraction linearly interpolated at average capacity factor `cf` (None outside)."""
    return interp([(runs[n]["avg_capacity_factor"], runs[n]["dropped_fraction"]) for n in STATIC if n in runs], cf)


def tables_from_results(res: dict) -> List[Table]:
    """The three tables from ``bench.dynamic.run``'s result dict."""
    s = res["setup"]
    runs = {r["name"]: r for r in res["runs"]}
    base = runs["static no-drop"]
    E, k = s["moe"]["num_experts"], s["moe"]["top_k"]
    setup = (f"tiny GPT on the embedded corpus ({s['layers']} blocks, {s['layers'] // s['moe_every']} MoE, hidden "
             f"{s['hidden']}, E={E} top-{k} {s['moe']['gate']}), {s['samples']} sequences x {s['seq_len']} bytes, "
             f"batch {s['batch']}, {s['epochs']} epochs = {s['steps']} steps, seed {s['seed']}, {s['threads']} "
             f"thread(s); load average {s['load_avg'][0]:.1f} -> {s['load_avg'][1]:.1f}; {s['wall_s']:.0f} s")

    f9 = Table("fig9_runtime_vs_loss", "Fig. 9 (and Fig. 6's speedups): runtime vs validation loss, static vs dynamic "
               "capacity factors",
               ["run", "avg capacity factor", "dropped %", "recompilations", "MoE ms/step", "step ms",
                "step speedup vs no-drop", "final valid loss", "source"])
    for r in res["runs"]:
        f9.add(r["name"], r["avg_capacity_factor"], 100.0 * r["dropped_fraction"], r["recompilations"], r["moe_ms"],
               r["step_ms"], base["step_ms"] / r["step_ms"], r["val_loss"], CPU)
    P = PAPER_NUMBERS
    f9.add(f"static no-drop (alpha={P['no_drop_alpha']:g})", P["no_drop_alpha"], 0.0, 0, None, None, 1.0,
           "reference accuracy", PAPER)
    f9.add("dynamic", None, None, None, None, None, P["speedup_dynamic"], "same as no-drop", PAPER)
    f9.add("dynamic+cache", None, None, None, None, None, P["speedup_dynamic_cache"], "same as no-drop", PAPER)
    f9.add("static CF=1", 1.0, None, 0, None, None, f"= dynamic+cache ({P['speedup_dynamic_cache']:g})",
           "worse (drops)", PAPER)
    f9.notes += [setup,
                 f"no-drop = static CF = E/k = {E / k:g}: every expert's buffer holds all of a step's tokens. Times: "
                 f"mean over steps {s['skip'] + 1}..{s['steps']}, runs interleaved step by step; speedup = no-drop "
                 "step time / the run's. Validation loss: nats/token, dropless evaluation for every run.",
                 "paper rows: §5.1 / Fig. 6 (GPU, expert parallel): dynamic CF 1.4x, + caching 1.7x over the no-drop "
                 "static factor at the same accuracy; 'the same throughput as a static capacity factor of 1.0' "
                 "(static CF=1 row); Fig. 9 plots no numbers in the text, only that dynamic policies trade runtime "
                 "for accuracy better than static factors."]

    hist = res["fig10"]
    cache = runs["dynamic+cache"].get("cache", {})
    f10 = Table("fig10_cached_fraction", "Fig. 10: fraction of tokens not reassigned since the previous epoch "
                "(dynamic + assignment cache)", ["epoch", "fraction not reassigned", "caching on after it", "source"])
    for epoch, frac, on in hist:
        f10.add(int(epoch), None if frac is None else float(frac), "on" if on else "off", CPU)
    f10.add(f"{P['cache_min_epoch']} onward", f">= {P['cache_on']:g}", "on", PAPER)
    f10.add(str(P["cache_off_epoch"]), f"< {P['cache_off']:g} (briefly)", "off, then on again", PAPER)
    f10.notes += [setup,
                  f"caching policy here: on at >= {s['cache_on']:g} of tokens not reassigned over an epoch, off below "
                  f"{s['cache_off']:g}, never before epoch {s['cache_min_epoch']} (the paper: epoch "
                  f"{P['cache_min_epoch']}; this run has only {s['epochs']} epochs). Epoch 1 has no previous epoch.",
                  (f"caching took effect in epoch {cache['on_epoch']} ({cache['cached_calls']} MoE layer calls used "
                   "cached assignments)") if cache.get("on_epoch") is not None else
                  "caching never turned on in this run"]

    q = res["ratios"]
    fr = [f for _, f, _ in hist if f is not None]
    fr_epochs = [int(e) for e, f, _ in hist if f is not None]
    a = Table("anchors", "DynaMoE (paper 000): the paper's numbers and this run's", ["figure", "quantity", "value",
                                                                                       "source"])
    a.add("Fig. 6", "dynamic vs no-drop static: speedup", f"{P['speedup_dynamic']:g}x at the same accuracy", PAPER)
    a.add("Fig. 6", "dynamic vs no-drop static: speedup",
          f"step {q['dynamic']['step']:.2f}x, MoE layers {q['dynamic']['moe']:.2f}x; valid loss "
          f"{q['dynamic']['val_loss_delta']:+.4f}", CPU)
    a.add("Fig. 6", "dynamic + caching vs no-drop static: speedup",
          f"{P['speedup_dynamic_cache']:g}x at the same accuracy", PAPER)
    a.add("Fig. 6", "dynamic + caching vs no-drop static: speedup",
          f"step {q['dynamic+cache']['step']:.2f}x, MoE layers {q['dynamic+cache']['moe']:.2f}x; valid loss "
          f"{q['dynamic+cache']['val_loss_delta']:+.4f}"
          + ("" if cache.get("on_epoch") is not None else " (caching never on: the dynamic run again)"), CPU)
    a.add("Fig. 9", "dynamic vs static at the same average factor", "dynamic: better runtime-accuracy trade-off",
          PAPER)
    for name in DYNAMIC:
        r = runs[name]
        st = interp_static_drop(runs, r["avg_capacity_factor"])
        a.add("Fig. 9", "dynamic vs static at the same average factor",
              f"{name}: {100 * r['dropped_fraction']:.1f}% dropped at CF {r['avg_capacity_factor']:.2f}, "
              f"{r['recompilations']} recompilations; static interpolated at that CF: "
              + ("-" if st is None else f"{100 * st:.1f}%"), CPU)
    a.add("Fig. 10", "tokens not reassigned between epochs", f">= {P['cache_on']:g} from epoch "
          f"{P['cache_min_epoch']} (caching on; {P['cache_speedup']:g}x from caching)", PAPER)
    a.add("Fig. 10", "tokens not reassigned between epochs",
          (f"{min(fr):.3f}-{max(fr):.3f} over epochs {fr_epochs[0]}-{fr_epochs[-1]} (last: {fr[-1]:.3f}); "
           if fr else "no epoch pair; ")
          + (f"caching on in epoch {cache['on_epoch']}" if cache.get("on_epoch") is not None else "caching never on"),
          CPU)
    a.add("Fig. 4", "DynaMoE without RECOMPILE vs FastMoE (1 GPU)", "up to 1.8x faster; 2.3x larger models before "
          "OOM", PAPER)
    a.add("Fig. 4", "DynaMoE without RECOMPILE vs FastMoE (1 GPU)", "no row: needs FastMoE on a GPU (FastMoE is "
          "not here; our layer against megatron-core's, on CPU and on an H100, is in BENCHMARKS.md: a different "
          "baseline)", "not run here: needs FastMoE")
    a.add("Fig. 5", "scaling with GPUs (throughput, model size)", "linear", PAPER)
    a.add("Fig. 5", "scaling with GPUs (throughput, model size)", "no row: needs several GPUs",
          "not run here: needs several GPUs")
    a.add("Fig. 7", "specification vs cooperation loss", "specification significantly better", PAPER)
    a.add("Fig. 7", "specification vs cooperation loss", "`python examples/dynamic/spec_vs_coop.py` (about 2 "
          "minutes; examples/reproduce/all.sh adds its table to docs/results.md)",
          "not run here: run by examples/reproduce/all.sh")
    a.notes.append(setup)
    return [f9, f10, a]


def figure9(res: dict):
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    runs = {r["name"]: r for r in res["runs"]}
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    st = [runs[n] for n in STATIC]
    ax.plot([r["step_ms"] for r in st], [r["val_loss"] for r in st], "-o", color="C0", label="static CF (global)")
    dy = [runs[n] for n in DYNAMIC]
    ax.plot([r["step_ms"] for r in dy], [r["val_loss"] for r in dy], "-s", color="C1", label="dynamic CF (local)")
    c = runs["dynamic+cache"]
    ax.plot([c["step_ms"]], [c["val_loss"]], "^", color="C2", markersize=8, label="dynamic + assignment cache")
    for r in st + dy:
        ax.annotate(f"{r['name'].replace('static ', '').replace('dynamic ', '')} ({r['avg_capacity_factor']:.2f})",
                    (r["step_ms"], r["val_loss"]), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("mean training step time (ms)   [label: run (average capacity factor)]")
    ax.set_ylabel("final validation loss (nats/token)")
    ax.set_title("DynaMoE Fig. 9: runtime vs accuracy (measured here, CPU)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def figure10(res: dict):
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    s = res["setup"]
    hist = [(e, f, on) for e, f, on in res["fig10"]]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    pts = [(e, f) for e, f, _ in hist if f is not None]
    if pts:
        ax.plot([e for e, _ in pts], [f for _, f in pts], "-o", color="C0", label="measured (dynamic + cache)")
    on = [e for e, _, o in hist if o]
    if on:
        ax.plot(on, [1.0] * len(on), "s", color="C2", label="caching on after the epoch")
    ax.axhline(s["cache_on"], color="C3", linestyle="--", linewidth=1, label=f"on threshold {s['cache_on']:g}")
    ax.axhline(s["cache_off"], color="C4", linestyle=":", linewidth=1, label=f"off threshold {s['cache_off']:g}")
    ax.axvline(s["cache_min_epoch"], color="grey", linewidth=1, alpha=0.6,
               label=f"earliest caching epoch here ({s['cache_min_epoch']})")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("epoch")
    ax.set_ylabel("fraction of tokens not reassigned")
    ax.set_title("DynaMoE Fig. 10: assignment convergence (paper: >= 0.96 from epoch 10)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.legend(fontsize=7, loc="center right")
    return fig


def _spread(values: List[float]) -> str:
    m = sum(values) / len(values)
    return f"{m:.4g} ({min(values):.4g}-{max(values):.4g})"


def seeds_table(results: List[dict]) -> Table:
    """Fig. 9 over seeds: per run, the mean and the min-max over the seeds of the step-time speedup over the
    no-drop static factor, the final validation loss, the dropped fraction and the average capacity factor."""
    seeds = [r["setup"]["seed"] for r in results]
    t = Table("fig9_seeds", f"Fig. 9 over {len(seeds)} seeds ({', '.join(map(str, seeds))}): mean (min-max)",
              ["run", "speedup vs no-drop (step)", "final valid loss", "valid loss - no-drop's", "dropped fraction",
               "average capacity factor", "source"])
    by_seed = [{r["name"]: r for r in res["runs"]} for res in results]
    for name in STATIC + DYNAMIC + ("dynamic+cache",):
        if not all(name in runs for runs in by_seed):
            continue
        sp = [runs["static no-drop"]["step_ms"] / runs[name]["step_ms"] for runs in by_seed]
        vl = [runs[name]["val_loss"] for runs in by_seed]
        dl = [runs[name]["val_loss"] - runs["static no-drop"]["val_loss"] for runs in by_seed]
        dr = [runs[name]["dropped_fraction"] for runs in by_seed]
        cf = [runs[name]["avg_capacity_factor"] for runs in by_seed]
        t.add(name, _spread(sp), _spread(vl), _spread(dl), _spread(dr), _spread(cf), CPU)
    t.add("dynamic vs static at the same accuracy", "1.4x (dynamic), 1.7x (+ caching)", None, "same accuracy",
          None, None, PAPER)
    t.notes.append("each seed trains all runs from its own initial weights and data order, interleaved step by "
                   "step; the spread is over seeds, so a difference smaller than it is not a result.")
    return t


def figure9_seeds(results: List[dict]):
    """Fig. 9 with error bars: mean step time against mean final validation loss, min-max over the seeds."""
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    by_seed = [{r["name"]: r for r in res["runs"]} for res in results]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for names, style, color, label in ((STATIC, "-o", "C0", "static CF (global)"),
                                       (DYNAMIC, "-s", "C1", "dynamic CF (local)"),
                                       (("dynamic+cache",), "^", "C2", "dynamic + assignment cache")):
        xs, ys, xerr, yerr = [], [], [[], []], [[], []]
        for n in names:
            st = [runs[n]["step_ms"] for runs in by_seed]
            vl = [runs[n]["val_loss"] for runs in by_seed]
            mx, my = sum(st) / len(st), sum(vl) / len(vl)
            xs.append(mx); ys.append(my)
            xerr[0].append(mx - min(st)); xerr[1].append(max(st) - mx)
            yerr[0].append(my - min(vl)); yerr[1].append(max(vl) - my)
        ax.errorbar(xs, ys, xerr=xerr, yerr=yerr, fmt=style, color=color, label=label, capsize=3)
    ax.set_xlabel("mean training step time (ms); bars: min-max over seeds")
    ax.set_ylabel("final validation loss (nats/token)")
    ax.set_title(f"DynaMoE Fig. 9 over {len(results)} seeds (measured here, CPU)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def run(out_dir: str, fast: bool, log=print, seed: int = 0, seeds: Optional[int] = None,
        cluster_results: Optional[str] = None) -> dict:
    """``seeds``: how many seeds Fig. 9 runs (from ``seed`` on); default 1 in fast mode, 3 in full mode.
    ``cluster_results``: comma list of `megamoe bench capacity` results (folders or files) for the cluster table."""
    from . import dynamoe_cluster
    cluster = dynamoe_cluster.load(cluster_results)          # a bad path fails before anything is measured
    from ..bench import dynamic as bench

    setting = dict(bench.SETTINGS["quick" if fast else "default"])
    log(header("dynamoe", fast, f"megamoe bench dynamic, {'quick' if fast else 'default'} setting"))
    n = seeds or (1 if fast else 3)
    results = [bench.run(setting, seed=seed + i, log=log) for i in range(n)]
    res = results[0]
    tables = tables_from_results(res)
    if n > 1:
        tables.insert(1, seeds_table(results))
    tables.insert(1, tradeoff_table(results))
    tables.insert(2, per_epoch_table(res))
    figures = [save_figure(figure9(res), out_dir, "fig9_runtime_vs_loss"),
               save_figure(figure10(res), out_dir, "fig10_cached_fraction")]
    cap = capacity_table(res)
    if cap is not None:
        tables.append(cap)
        figures.append(save_figure(figure8(res), out_dir, "fig8_capacity"))
    key = "quick" if fast else "default"
    log(f"caching regime: {CACHING[key]['samples']} sequences x {CACHING[key]['epochs']} epochs ...")
    regime = bench.run(dict(setting, **CACHING[key]), seed=seed, log=log, only=CACHE_RUNS,
                       min_epoch=CACHING_MIN_EPOCH[key])
    tables.append(caching_table(regime))
    if cluster:                     # measured with root by `megamoe bench capacity`; read, never re-measured
        tables.append(dynamoe_cluster.cluster_table(cluster))
        caching = dynamoe_cluster.caching_table(cluster)
        if caching is not None:
            tables.append(caching)
    else:
        log(f"DynaMoE on the emulated cluster: {dynamoe_cluster.HOW}")
    figures.append(save_figure(figure10(regime), out_dir, "fig10_caching_regime"))
    if n > 1:
        figures.append(save_figure(figure9_seeds(results), out_dir, "fig9_seeds"))
    paths = [t.write(out_dir) for t in mark_fast(tables, fast)]
    print_tables(tables, figures, log, fast=fast)
    return {"tables": paths, "figures": figures}
