"""`megamoe reproduce flexmoe`: FlexMoE (paper 001) Figs. 5, 6, 7 and Table 2 from this repository.

    megamoe reproduce flexmoe [--fast] [--out DIR] [--cluster-results DIR]

Fig. 5 (time to quality: measured on the emulated cluster, predicted at 8-64 GPUs) and Fig. 6(a)/(b) (trigger and
scheduling policies in the simulator) are ``flexmoe_time``'s. The other four results, each a markdown table (every row says how it was obtained: ``common.py``) and a PNG:

* ``fig6c_cost_model`` (Fig. 6(c), "estimation cost vs real cost on different input sizes for computation /
  all-to-all / all-reduce"): two gloo processes on this machine fit the cost model with ``perfmodel.calibrate``
  (``calibrate()``: expert-FFN GEMM throughput over 256-2048 tokens, all-to-all latency and bandwidth over 16 KiB-2
  MiB per pair, ping-pong); then the same processes time expert computation (forward + backward of one expert
  FFN), uniform all-to-all and all-reduce at the calibration's sizes and at others ("held-out"), in interleaved
  rounds, and the ``CostModel`` predicts every point: ``3 x compute_time`` (Eq. 7 / FasterMoE Eq. 1, no
  intercept), ``alltoall_time`` (Eq. 8 on the network) and ``sync_time`` (Eq. 9; all-reduce is never fitted, so
  every all-reduce point is out of sample), once with ``calibrate()``'s profile and once with the same line fits
  redone on this run's timings at the calibration's sizes (``refit-here``: the model's form without the noise of
  the calibration's own back-to-back timings). One row per point and source (measured / each prediction), and
  ``fig6c_error_summary`` with the mean absolute relative error per operation beside the paper's "less than 3%".
* ``table2_quality`` (Table 2, model quality with vs without token drops): ``megamoe train`` runs of one tiny MoE
  GPT on the embedded real-text corpus, same seed / data / steps, top-2 GShard gate, balance loss 0.001 (paper
  001 §5.1), differing only in dispatch: GShard/DeepSpeed capacity with factor 1.0 (drops what overflows) vs
  dropless (FlexMoE's guarantee). Validation loss / perplexity on the valid split, evaluated dropless (our default,
  ``--moe-eval-capacity-factor 0``) and, for the capacity model, also with capacity 1.0 at evaluation (DeepSpeed's
  default ``eval_capacity_factor``). Full mode adds capacity factor 2.0 and a second seed. Beside the paper's
  BERT/GPT perplexities (DeepSpeed vs FlexMoE).
* ``fig7a_efficiency`` (Fig. 7(a)): token efficiency and expert efficiency over training of DeepSpeed-style static
  expert parallelism with capacity 1.0, dropless static expert parallelism, FasterMoE shadowing and FlexMoE, on the
  routing of a real training run (the shipped ``megatron_gpt`` trace; the table says which) replayed through the
  placement simulator (``perfmodel.placement_replay``) with the ``flexmoe-a100`` cost model driving the planners'
  decisions. Definitions (paper 001 §5.4, as ``perfmodel.placement_replay`` computes them): token efficiency = "the fraction
  of input tokens that are processed by the expert network" = processed / routed assignments (1 for every dropless
  strategy); expert efficiency = "the meaningful computation of GPUs" = processed assignments / (GPUs x the largest
  number of token slots one GPU computes in the synchronous step, padding included) (= 1 / balance ratio when
  dropless).
* ``fig7b_scaling`` (Fig. 7(b)): predicted throughput of one MoE layer with 64 experts (paper §5.5) on 8, 16, 32
  and 64 GPUs of the ``flexmoe-a100`` profile for the same four strategies, normalised to DeepSpeed-style static EP
  on 8 GPUs as the paper does, on a synthetic skewed, drifting routing (no 64-expert trace is shipped): Zipf 1.25
  popularity (the paper's "top-10 of 64 experts receive ~75% of the tokens", §2.4), 4096 tokens x top-2 per GPU
  (weak scaling). Both input tokens/s and processed tokens/s (input x token efficiency) are given: the capacity
  run's step is short because it drops tokens.

Every time in fig7a/fig7b is a model prediction for the paper's cluster (``perfmodel.profiles``: its numbers and
assumptions are documented there); only the routing comes from a real run (fig7a) or a stated synthetic model
(fig7b). ``--fast`` (the CI test): tiny training runs, quick calibration, every k-th recorded step of the trace
(the planner then decides from the previously sampled step), 3 simulated steps per scale point.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
import tempfile
import time
from typing import List, Optional, Sequence, Tuple

import torch

from ..cluster import cpu_caps
from .common import (mark_fast, PAPER, Table, fork_processes, header, measured, predicted, print_tables, save_figure,
                     shipped_trace)

__all__ = ["run", "cost_model_accuracy", "quality_with_drops", "efficiency_over_training", "scaling"]

PROFILE = "flexmoe-a100"
GEMM_SHAPE = (256, 1024)                # H, F of the expert FFN timed in fig6c (calibrate's measure_gemm default)
CALIBRATED = "calibrated-here"          # the profile calibrate() fits on this machine (fig6c)
REFIT = "refit-here"                    # the same fits on fig6c's interleaved timings

# Paper 001 Table 2 (validation perplexity, lower is better): DeepSpeed (capacity 1.0, drops) vs FlexMoE (dropless)
PAPER_TABLE2 = [("BERT-MoE-S", 3.53, 3.14), ("BERT-MoE-L", 3.31, 3.07), ("GPT-MoE-S", 12.2, 11.72),
                ("GPT-MoE-L", 10.71, 10.47)]
PAPER_SWIN = ("Swin-MoE-S acc@1 77.316 (DeepSpeed) vs 77.754 (FlexMoE), acc@5 93.838 vs 94.042; Swin-MoE-L acc@1 "
              "77.022 vs 77.109, acc@5 93.642 vs 93.663")

# strategy labels shared by fig7a and fig7b
DEEPSPEED = "static EP, capacity 1.0 (DeepSpeed-style, drops)"
STATIC = "static EP, dropless"
SHADOW = "FasterMoE shadowing"
FLEXMOE = "FlexMoE"
STRATEGIES = (DEEPSPEED, STATIC, SHADOW, FLEXMOE)
DROPLESS = (STATIC, SHADOW, FLEXMOE)
COLORS = {DEEPSPEED: "tab:gray", STATIC: "tab:blue", SHADOW: "tab:orange", FLEXMOE: "tab:green"}

# FlexMoE planner settings: `megamoe bench placement`'s defaults (not tuned for these results)
FLEX_OPTIONS = dict(threshold=1.2, horizon=10.0, max_moves=16)


def _pct(x: float) -> str:
    return f"{x:+.1%}"


# ================================================================================================ Fig. 6(c)
def _cost_worker(rank: int, world: int, result_file: str, fast: bool) -> None:
    """Calibrate (``perfmodel.calibrate.calibrate``), then time every size of the three operations in interleaved
    rounds (each round visits every size once, so a burst of load from other jobs hits all sizes alike) and keep
    the median over rounds of the slowest rank's time."""
    import torch.distributed as dist

    from ..experts import ExpertBank
    from ..perfmodel.calibrate import _timed, calibrate

    cal = calibrate(name=CALIBRATED, quick=False, device="cpu")
    cpu, group = torch.device("cpu"), dist.group.WORLD
    fit_tokens = [int(b) for b, _ in cal.gemm["points"]]
    fit_a2a = [int(b) for b, _ in cal.alltoall["points"]]
    held_tokens = (128, 512, 1536) if fast else (128, 512, 1536, 3072, 6144)
    held_a2a = (1 << 15, 1 << 18, 1 << 20) if fast else (1 << 13, 1 << 15, 1 << 18, 1 << 20, 1 << 22)
    ar_sizes = (1 << 16, 1 << 20, 1 << 22) if fast else (1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 23)
    H, F = GEMM_SHAPE
    bank = ExpertBank(1, H, F, "gelu", device=cpu)          # measure_gemm's expert FFN
    cases = []                                               # (op, size, subset, fn)
    for tokens in sorted(set(fit_tokens) | set(held_tokens)):
        x = torch.randn(tokens, H, requires_grad=True)
        cases.append(("computation", tokens, "fit" if tokens in fit_tokens else "held-out",
                      lambda x=x, b=tokens: bank(x, [b]).sum().backward()))
    for size in sorted(set(fit_a2a) | set(held_a2a)):
        inp = torch.randn(world * max(size // 4, 1))
        out = torch.empty_like(inp)
        cases.append(("all-to-all", size, "fit" if size in fit_a2a else "held-out",
                      lambda i=inp, o=out: dist.all_to_all_single(o, i)))
    for size in ar_sizes:
        buf = torch.randn(max(size // 4, 1))
        cases.append(("all-reduce", size, "held-out", lambda b=buf: dist.all_reduce(b)))
    times = [[] for _ in cases]
    for r in range(5 if fast else 9):
        for i, (_, _, _, fn) in enumerate(cases):
            times[i].append(_timed(fn, 1, 1 if r == 0 else 0, cpu, group))
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump({"profile": cal.profile.to_dict(), "rounds": len(times[0]),
                       "points": [[op, size, subset, statistics.median(t), min(t), max(t)]
                                  for (op, size, subset, _), t in zip(cases, times)]}, f)


def _run_cost_worker(fast: bool, nproc: int = 2) -> dict:
    with tempfile.TemporaryDirectory() as d:
        result = os.path.join(d, "result.json")
        fork_processes(_cost_worker, nproc, result, fast)
        with open(result) as f:
            return json.load(f)


def _refit_profile(raw_points, profile, nproc: int, H: int, F: int):
    """``profile`` with its GEMM throughput and all-to-all link refitted by ``calibrate``'s own line fits
    (``_fit_line``: t = t0 + 12 B H F / P, t = alpha + (P - 1) S / W) on this run's interleaved medians at the
    calibration's sizes."""
    import copy

    from ..perfmodel.calibrate import _fit_line
    out = copy.deepcopy(profile)
    out.name, out.source = REFIT, "fig6c: calibrate()'s fits on the interleaved medians of its own sizes"
    g = [(12.0 * size * H * F, t) for op, size, subset, t, _, _ in raw_points if op == "computation" and subset == "fit"]
    a = [((nproc - 1) * size, t) for op, size, subset, t, _, _ in raw_points if op == "all-to-all" and subset == "fit"]
    if len(g) >= 2:
        _, inv = _fit_line(*zip(*g))
        out.gemm_tflops = (1.0 / inv if inv > 0 else max(x / y for x, y in g)) / 1e12
    if len(a) >= 2:
        alpha, inv = _fit_line(*zip(*a))
        out.intra_bandwidth_gbps = (1.0 / inv if inv > 0 else max(x / y for x, y in a)) / 1e9
        out.intra_latency_us = max(alpha, 0.0) * 1e6
    return out


def cost_model_accuracy(out_dir: str, fast: bool, log=print, nproc: int = 2) -> Tuple[List[Table], List[str]]:
    """Fig. 6(c): measured vs predicted time of computation / all-to-all / all-reduce on this machine, predicted by
    the cost model with ``calibrate()``'s profile and with the same fits redone on this run's interleaved timings."""
    from ..perfmodel.cost import LayerShape
    from ..perfmodel.profiles import HardwareProfile

    t0 = time.perf_counter()
    res = _run_cost_worker(fast, nproc)
    profile = HardwareProfile.from_dict(res["profile"])
    H, F = GEMM_SHAPE
    refit = _refit_profile(res["points"], profile, nproc, H, F)
    shape = LayerShape(H, F, nproc, bytes_per_element=profile.bytes_per_element)
    models = [(predicted(CALIBRATED), profile.cost_model(shape, nproc)),
              (predicted(REFIT), refit.cost_model(shape, nproc))]
    points = []        # (operation, size label, size, subset, measured s, {model: predicted s}, min s, max s)
    for op, size, subset, t, lo, hi in res["points"]:
        preds = {}
        for name, cm in models:
            if op == "computation":
                preds[name] = 3.0 * cm.compute_time([size] * nproc)
            elif op == "all-to-all":
                preds[name] = cm.alltoall_time(torch.full((nproc, nproc), size / shape.token_bytes,
                                                          dtype=torch.float64))
            else:
                preds[name] = cm.sync_time(size, range(nproc))
        label = f"{int(size)} tokens" if op == "computation" else \
            f"{_kib(size)} per pair" if op == "all-to-all" else _kib(size)
        points.append((op, label, size, subset, t, preds, lo, hi))
    ops = ("computation", "all-to-all", "all-reduce")
    points.sort(key=lambda p: (ops.index(p[0]), p[2]))

    where = measured()
    table = Table("fig6c_cost_model", f"Fig. 6(c): cost model vs measured time on this machine ({nproc} gloo "
                  "processes)", ["operation", "input size", "points", "time (ms)", "min-max over rounds (ms)",
                                 "prediction error", "source"], fmt="{:.4g}")
    for op, label, _, subset, t, preds, lo, hi in points:
        table.add(op, label, subset, t * 1e3, f"{lo * 1e3:.4g}-{hi * 1e3:.4g}", "-", where)
        for name, _ in models:
            table.add(op, label, subset, preds[name] * 1e3, "-", _pct((preds[name] - t) / t), name)
    table.add("computation / all-to-all / all-reduce", "several (Fig. 6(c))", "-", "-", "-", "< 3% on average",
              PAPER)

    def link(p):
        return (f"{p.gemm_tflops * 1e3:.1f} GFLOP/s, all-to-all link {p.intra_bandwidth_gbps:.2f} GB/s, alpha "
                f"{p.intra_latency_us:.0f} us")

    table.notes += [
        f"{where}: the slowest of {nproc} gloo processes on this machine, median over {res['rounds']} interleaved "
        "rounds (each round times every size once, so load from other jobs on the shared CPU cores hits all sizes "
        "alike; the min-max column shows how much it did).",
        f"{models[0][0]}: the cost model of `perfmodel.cost` with the profile `perfmodel.calibrate.calibrate()` "
        f"fitted in the same processes just before from its own back-to-back timings ({link(profile)}). "
        f"{models[1][0]}: the same cost model and the same line fits (`calibrate._fit_line`) redone on this table's "
        f"medians at the calibration's sizes ({link(refit)}): how good the model's form is when its fit is not "
        "disturbed. 'fit' = the calibration's sizes (in-sample for the refit), 'held-out' = other sizes (out of "
        "sample for both). All-reduce is fitted by neither: its prediction is the network model's ring all-reduce "
        "over the fitted link (Eq. 9 without a profiled BPS).",
        f"computation: forward + backward of one expert FFN H={H} F={F} (fp32, GELU) = 3 x Eq. 1 / Eq. 7, no "
        "per-call intercept (as the paper's T_C = I / TPS); all-to-all: uniform `all_to_all_single`, Eq. 8; "
        "all-reduce: `dist.all_reduce` of fp32 tensors. prediction error = (predicted - measured) / measured.",
        f"took {time.perf_counter() - t0:.0f} s"]

    summary = Table("fig6c_error_summary", "Fig. 6(c): mean absolute prediction error of the cost model",
                    ["operation", "held-out sizes", "mean abs. error (held-out)", "fit sizes",
                     "mean abs. error (fit)", "max abs. error (all)", "compared with", "source"])
    for name, _ in models:
        for op in ops:
            held = [abs(p[5][name] - p[4]) / p[4] for p in points if p[0] == op and p[3] == "held-out"]
            fit = [abs(p[5][name] - p[4]) / p[4] for p in points if p[0] == op and p[3] == "fit"]
            summary.add(op, len(held), f"{statistics.mean(held):.1%}" if held else "-", len(fit),
                        f"{statistics.mean(fit):.1%}" if fit else "-", f"{max(held + fit):.1%}", where, name)
    summary.add("computation / all-to-all / all-reduce", "-", "< 3% (average)", "-", "-", "-",
                "their real execution cost", PAPER)
    summary.notes += ["Errors of the predicted rows of fig6c_cost_model against the measured rows of the same size. "
                      "The paper's cost model is profiled on 8-GPU A100 servers with NCCL (kernels on dedicated "
                      "GPUs); ours on CPU processes sharing two busy cores, so timing noise alone can exceed 3%, "
                      "and calibrate()'s back-to-back timings can be hit by a burst of load (compare its row with "
                      "the refit's)."]

    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    styles = {models[0][0]: ("-", "tab:red"), models[1][0]: ("--", "tab:purple")}
    for ax, op in zip(axes, ops):
        pts = [p for p in points if p[0] == op]
        xs = [p[2] for p in pts]
        for name, _ in models:
            ls, color = styles[name]
            ax.plot(xs, [p[5][name] * 1e3 for p in pts], ls, color=color, label=name)
        for subset, marker in (("fit", "o"), ("held-out", "s")):
            sel = [p for p in pts if p[3] == subset]
            if sel:
                ax.errorbar([p[2] for p in sel], [p[4] * 1e3 for p in sel],
                            yerr=[[(p[4] - p[6]) * 1e3 for p in sel], [(p[7] - p[4]) * 1e3 for p in sel]],
                            fmt=marker, color="tab:blue", capsize=2, label=f"{where} ({subset} sizes)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("tokens" if op == "computation" else "bytes" + (" per pair" if op == "all-to-all" else ""))
        ax.set_ylabel("time (ms)")
        ax.set_title(op)
        ax.legend(fontsize=6)
    fig.suptitle("FlexMoE Fig. 6(c) on this machine: cost model estimate vs measured time (median, min-max bars)")
    return [table, summary], [save_figure(fig, out_dir, "fig6c_cost_model")]


def _kib(nbytes) -> str:
    n = float(nbytes)
    return f"{n / (1 << 20):g} MiB" if n >= (1 << 20) else f"{n / 1024:g} KiB"


# ================================================================================================ Table 2
def _train_args(fast: bool) -> List[str]:
    if fast:
        return ["--hidden", "64", "--layers", "2", "--heads", "2", "--ffn-hidden", "128", "--seq-len", "64",
                "--batch-size", "8", "--corpus-bytes", "300000", "--moe-every", "1", "--steps", "60",
                "--eval-interval", "0", "--eval-batches", "16", "--threads", "1"]
    return ["--hidden", "128", "--layers", "4", "--heads", "4", "--ffn-hidden", "256", "--seq-len", "128",
            "--batch-size", "8", "--corpus-bytes", "2000000", "--moe-every", "2", "--steps", "300",
            "--eval-interval", "0", "--eval-batches", "32", "--threads", "1"]


# the paper's MoE settings (§5.1): top-2 gate, balance loss 0.001; 16 experts (the shipped traces' count)
PAPER_MOE = ["--moe-num-experts", "16", "--moe-top-k", "2", "--moe-gate", "gshard", "--moe-aux-loss-coeff", "0.001"]


@contextlib.contextmanager
def _eval_capacity(model, factor: float):
    """Evaluate ``model``'s MoE layers with capacity ``factor`` at inference (0 = dropless); restored after."""
    from ..layer import moe_layers
    layers = moe_layers(model)
    saved = [m.plan.cfg for m in layers]
    try:
        for m in layers:
            m.plan.cfg = m.plan.cfg.replace(eval_capacity_factor=float(factor))
        yield
    finally:
        for m, cfg in zip(layers, saved):
            m.plan.cfg = cfg


def _train_dropped(res) -> float:
    """Fraction of routed assignments not computed over the whole run (the run logs once, at its end)."""
    fr = [s["dropped_fraction"] for h in res.history for s in (h.get("moe") or {}).values()]
    return sum(fr) / len(fr) if fr else float("nan")


def quality_with_drops(out_dir: str, fast: bool, log=print, trace_path: Optional[str] = None
                       ) -> Tuple[List[Table], List[str], Optional[str]]:
    """Table 2: the same tiny GPT trained with capacity 1.0 (drops) and dropless. Returns (tables, figures, the
    path of the dropless run's routing trace when ``trace_path`` is given)."""
    from .. import train
    from ..data import build_corpus

    base = _train_args(fast)
    steps = int(base[base.index("--steps") + 1])
    seeds = [0] if fast else [0, 1]
    runs = [("capacity", 1.0)] + ([] if fast else [("capacity", 2.0)]) + [("dropless", None)]
    t0 = time.perf_counter()
    results = []          # (label, cf, seed, res, eval dropless, eval with capacity or None)
    for seed in seeds:
        for dispatch, cf in runs:
            args = base + PAPER_MOE + ["--seed", str(seed), "--moe-dispatch", dispatch, "--log-interval",
                                       str(steps)]
            if cf is not None:
                args += ["--moe-capacity-factor", str(cf)]
            if dispatch == "dropless" and seed == seeds[0] and trace_path:
                args += ["--trace", trace_path]
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                res = train.main(args)
            ev = res.evals[-1]
            ev_cap = None
            if cf is not None:
                corpus = build_corpus(max_bytes=int(base[base.index("--corpus-bytes") + 1]), seed=seed)
                with _eval_capacity(res.model, cf):
                    ev_cap = train.evaluate(res.model, corpus, "valid", int(base[base.index("--batch-size") + 1]),
                                            int(base[base.index("--seq-len") + 1]),
                                            max_batches=int(base[base.index("--eval-batches") + 1]))
            results.append((dispatch, cf, seed, res, ev, ev_cap))
            log(f"  table 2: {dispatch}{'' if cf is None else f' CF {cf:g}'} seed {seed}: valid loss "
                f"{ev['loss']:.4f} (ppl {ev['ppl']:.3f}), {_train_dropped(res):.1%} of assignments dropped in "
                f"training ({time.perf_counter() - t0:.0f} s)")

    where = measured()
    table = Table("table2_quality", "Table 2: model quality with vs without token drops (validation perplexity)",
                  ["model", "training dispatch", "evaluation dispatch", "seed", "steps", "train assignments dropped",
                   "valid loss", "valid ppl", "ppl / dropless ppl", "source"], fmt="{:.4f}")
    drop_ppl = {seed: ev["ppl"] for dispatch, cf, seed, _, ev, _ in results if dispatch == "dropless"}
    model_name = "tiny MoE GPT (megamoe train)"
    for dispatch, cf, seed, res, ev, ev_cap in results:
        train_label = "dropless" if cf is None else f"capacity {cf:.1f}"
        table.add(model_name, train_label, "dropless", seed, res.step, _train_dropped(res), ev["loss"], ev["ppl"],
                  ev["ppl"] / drop_ppl[seed], where)
        if ev_cap is not None:
            table.add(model_name, train_label, f"capacity {cf:.1f}", seed, res.step, _train_dropped(res),
                      ev_cap["loss"], ev_cap["ppl"], ev_cap["ppl"] / drop_ppl[seed], where)
    for name, ds, fx in PAPER_TABLE2:
        table.add(name, "capacity 1.0 (DeepSpeed)", "-", "-", "-", "-", "-", ds, "-", PAPER)
        table.add(name, "dropless (FlexMoE)", "-", "-", "-", "-", "-", fx, "-", PAPER)
    m = train.build_parser().parse_args(base + PAPER_MOE)
    table.notes += [
        f"{where}: `megamoe train` {' '.join(base)} {' '.join(PAPER_MOE)} --seed S --moe-dispatch capacity "
        "--moe-capacity-factor CF | dropless; every run the same seed, data order, steps and initial weights "
        f"(model: {m.layers} layers, hidden {m.hidden}, MoE every {m.moe_every} block(s)); validation on the "
        f"first {m.eval_batches} batches of the embedded corpus's valid split. "
        "'train assignments dropped' = the fraction of routed (token, expert) assignments not computed during "
        "training (StatsSink); evaluation 'capacity CF' re-evaluates the same trained model with the same "
        "capacity at inference (DeepSpeed's default eval_capacity_factor is 1.0; our default is dropless).",
        f"paper: Table 2 (validation perplexity of BERT/GPT-MoE trained on Wikipedia on 32-64 A100s); also "
        f"{PAPER_SWIN}.",
        "ppl / dropless ppl: > 1 means the run with drops is worse than the dropless run of the same seed (the "
        "seed also selects the corpus documents, so only runs of one seed share a validation set). The paper's "
        "ratios, from its two perplexities: " + ", ".join(f"{n} {d / f:.3f}" for n, d, f in PAPER_TABLE2) + ".",
        f"took {time.perf_counter() - t0:.0f} s"]
    return [table], [], (trace_path if trace_path and os.path.exists(trace_path + ".rank0") else None)


# ================================================================================================ Fig. 7(a)
def _load_routing(fallback: Optional[str]) -> Tuple[dict, str]:
    from ..stats import load_trace
    try:
        path = shipped_trace("megatron_gpt")
        what = ("shipped trace megatron_gpt (training routing of the small MoE GPT that "
                "examples/reproduce/make_traces.sh trains with the Megatron adapter)")
    except FileNotFoundError:
        if not fallback:
            raise
        path = fallback
        what = ("the dropless Table 2 run's own routing trace (no shipped megatron_gpt trace yet: "
                "examples/reproduce/make_traces.sh makes it)")
    return load_trace(path), what


def _scale_trace(trace: dict, tokens_per_gpu: int, index: Optional[Sequence[int]] = None) -> Tuple[dict, float]:
    """The steps ``index`` (default all) with counts scaled so a source rank sends ``tokens_per_gpu x top_k``
    assignments per step on average (the routing shares are the trace's; the scale is the paper's batch, not our
    tiny model's)."""
    c = torch.as_tensor(trace["counts"]).to(torch.float64)
    idx = torch.arange(c.shape[0]) if index is None else torch.as_tensor(list(index), dtype=torch.long)
    steps = torch.as_tensor(trace.get("steps", torch.arange(c.shape[0])))[idx]
    c = c[idx]
    k = int(trace.get("top_k") or 2)
    per_source = float(c.sum(-1).mean())
    factor = tokens_per_gpu * k / per_source if per_source > 0 else 1.0
    return dict(trace, counts=c * factor, steps=steps), factor


def _windows(S: int, windows: int, length: int) -> List[int]:
    """``windows`` runs of ``length`` consecutive steps spread evenly over 0..S-1 (all steps when they cover it)."""
    if windows * length >= S:
        return list(range(S))
    starts = [round(i * (S - length) / (windows - 1)) for i in range(windows)] if windows > 1 else [0]
    return [s + j for s in starts for j in range(length)]


def _strategies(cm, E: int, W: int):
    from ..placement.flexmoe import FlexMoEPlanner, StaticPlanner
    from ..placement.shadow import ShadowPlanner
    return [(DEEPSPEED, dict(capacity_factor=1.0)),
            (STATIC, dict(planner=StaticPlanner())),
            (SHADOW, dict(planner=ShadowPlanner(cm), decide_on="current")),
            (FLEXMOE, dict(planner=FlexMoEPlanner(cm, **FLEX_OPTIONS), slots_per_rank=E // W + 1))]


def efficiency_over_training(out_dir: str, fast: bool, log=print, fallback_trace: Optional[str] = None,
                             world: int = 16, tokens_per_gpu: int = 4096, phases: int = 4
                             ) -> Tuple[List[Table], List[str]]:
    """Fig. 7(a): token and expert efficiency per step of the four strategies on a real routing trace."""
    from ..perfmodel.cost import LayerShape
    from ..perfmodel.profiles import get_profile
    from ..perfmodel.simulate import simulate_trace

    t0 = time.perf_counter()
    raw, what = _load_routing(fallback_trace)
    S, L, P, E = raw["counts"].shape
    index = _windows(S, phases, 5) if fast else list(range(S))
    trace, factor = _scale_trace(raw, tokens_per_gpu, index)
    prof = get_profile(PROFILE)
    W = world if E % world == 0 else E
    shape = LayerShape(768, 3072, E, bytes_per_element=prof.bytes_per_element)   # GPT-MoE-S widths (Table 1)
    cm = prof.cost_model(shape, W)
    per_step = {}
    for label, kw in _strategies(cm, E, W):
        per_step[label] = simulate_trace(trace, prof, shape, world_size=W, cost_model=cm, **kw)
    n = len(trace["steps"])
    bounds = [round(i * n / phases) for i in range(phases + 1)]
    src = predicted(PROFILE)
    table = Table("fig7a_efficiency", "Fig. 7(a): token efficiency and expert efficiency over training",
                  ["strategy", "training phase", "recorded steps", "token efficiency", "expert efficiency",
                   "balance ratio", "source"], fmt="{:.4f}")
    phase_points = {}
    for label in STRATEGIES:
        rows = per_step[label]
        pts = []
        for i in range(phases):
            sel = rows[bounds[i]:bounds[i + 1]]
            if not sel:
                continue
            tok = sum(r["token_efficiency"] for r in sel) / len(sel)
            eff = sum(r["expert_efficiency"] for r in sel) / len(sel)
            bal = sum(r["balance_ratio"] for r in sel) / len(sel)
            table.add(label, f"{i + 1}/{phases}", f"{sel[0]['step']}-{sel[-1]['step']}", tok, eff, bal, src)
            pts.append((tok, eff))
        phase_points[label] = pts
        tok = sum(r["token_efficiency"] for r in rows) / len(rows)
        eff = sum(r["expert_efficiency"] for r in rows) / len(rows)
        bal = sum(r["balance_ratio"] for r in rows) / len(rows)
        table.add(label, "all", f"{rows[0]['step']}-{rows[-1]['step']}", tok, eff, bal, src)
    table.add("DeepSpeed (expert parallelism)", "all", "-", "low (drops)", "low", "-", PAPER)
    table.add("FasterMoE", "all", "-", "100% (no drops)", "low", "-", PAPER)
    table.add("FlexMoE", "all", "-", "100% (guaranteed)", "closest to 100%", "-", PAPER)
    table.notes += [
        f"routing: {what}; {S} recorded steps x {L} MoE layers x {P} source ranks x {E} experts"
        + (f"; fast mode: {phases} windows of 5 consecutive recorded steps spread over the run ({n} steps; a "
           "window's first step is planned from the previous window's last)" if n < S else "") + f"; rows remapped to {W} GPUs (GPU w replays source rank w % {P}), counts "
        f"scaled x{factor:.3g} so each GPU routes {tokens_per_gpu} tokens x top-{raw.get('top_k') or 2} per step "
        "(the trace's routing shares at a paper-scale batch).",
        f"{src}: placement simulator (`perfmodel.placement_replay`) on {W} GPUs of the {PROFILE} profile, {E} experts (one "
        f"per GPU as in the paper's runs), expert widths H 768 / FFN 3072 (GPT-MoE-S, Table 1). The efficiencies "
        "are counted on the trace's routing under each strategy's placement; the cost model only drives the "
        "planners' decisions (shadowing: FasterMoE Alg. 1 on the step's own counts; FlexMoE: Alg. 1-3 with "
        f"threshold {FLEX_OPTIONS['threshold']:g}, horizon {FLEX_OPTIONS['horizon']:g} steps, "
        f"{FLEX_OPTIONS['max_moves']} moves per layer per step, {E // W + 1} vExpert slots per GPU, deciding "
        "before each step from the previous step's counts).",
        "token efficiency (§5.4) = processed / routed assignments; expert efficiency = processed assignments / "
        "(GPUs x the largest number of token slots one GPU computes, padding included), = 1 / balance ratio when "
        "dropless; balance ratio = Eq. 6 after routing. Means over the steps of each phase (and over layers).",
        "paper: Fig. 7(a) gives no numbers in the text; its qualitative statements are quoted (§5.4).",
        f"took {time.perf_counter() - t0:.0f} s"]

    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    for label in STRATEGIES:
        pts = phase_points[label]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", color=COLORS[label], label=label, markersize=4)
        if pts:
            ax.annotate("end", pts[-1], fontsize=6, color=COLORS[label])
    ax.plot([1.0], [1.0], marker="*", color="red", markersize=14, linestyle="none", label="ideal")
    ax.set_xlabel("token efficiency")
    ax.set_ylabel("expert efficiency")
    ax.set_xlim(0, 1.05)
    ax.set_ylim(0, 1.05)
    ax.set_title(f"per training phase ({phases} phases)")
    ax.legend(fontsize=7)
    for ax, key, name in ((axes[1], "token_efficiency", "token efficiency"),
                          (axes[2], "expert_efficiency", "expert efficiency")):
        for label in STRATEGIES:
            rows = per_step[label]
            ax.plot([r["step"] for r in rows], _smooth([r[key] for r in rows], 1 if fast else 5), color=COLORS[label],
                    label=label, linewidth=1.2)
        ax.set_xlabel("training step (recorded)")
        ax.set_ylabel(name)
        ax.set_ylim(0, 1.05)
        ax.set_title(name + ("" if fast else " (5-step moving average)"))
    fig.suptitle(f"FlexMoE Fig. 7(a): predicted on {PROFILE} ({W} GPUs) with the routing of a real run")
    return [table], [save_figure(fig, out_dir, "fig7a_efficiency")]


def _smooth(xs: Sequence[float], k: int) -> List[float]:
    if k <= 1:
        return list(xs)
    out = []
    for i in range(len(xs)):
        w = xs[max(0, i - k + 1):i + 1]
        out.append(sum(w) / len(w))
    return out


# ================================================================================================ Fig. 7(b)
def scaling(out_dir: str, fast: bool, log=print, worlds: Sequence[int] = (8, 16, 32, 64), experts: int = 64,
            tokens_per_gpu: int = 4096, results: Optional[dict] = None) -> Tuple[List[Table], List[str]]:
    """Fig. 7(b): predicted throughput of one 64-expert MoE layer from 8 to 64 GPUs, normalised to DeepSpeed-8.
    ``results``: a dict that receives {(strategy label, GPUs): summary} (Fig. 5's predicted step times)."""
    from ..perfmodel.cost import LayerShape
    from ..perfmodel.profiles import get_profile
    from ..perfmodel.simulate import simulate_trace, summarize
    from ..perfmodel.placement_replay import synthetic_trace

    t0 = time.perf_counter()
    prof = get_profile(PROFILE)
    shape = LayerShape(1024, 4096, experts, bytes_per_element=prof.bytes_per_element)   # BERT-MoE-L widths
    steps = 3 if fast else 16
    syn = dict(top_k=2, skew=1.25, drift=0.05, noise=0.1, seed=0)
    res = {}       # (label, W) -> summary
    for W in worlds:
        trace = synthetic_trace(W, experts, steps, layers=1, tokens_per_rank=tokens_per_gpu, **syn)
        cm = prof.cost_model(shape, W)
        for label, kw in _strategies(cm, experts, W):
            rows = simulate_trace(trace, prof, shape, world_size=W, cost_model=cm, **kw)
            s = summarize(rows[1:])            # step 0: no planner has acted yet
            s["tokens_per_s"] = W * tokens_per_gpu / s["mean_total"]
            res[(label, W)] = s
            if results is not None:
                results[(label, W)] = s
        log(f"  fig 7(b): {W} GPUs done ({time.perf_counter() - t0:.0f} s)")
    base = res[(DEEPSPEED, worlds[0])]
    base_in = base["tokens_per_s"]
    base_proc = base["tokens_per_s"] * base["mean_token_efficiency"]
    src = predicted(PROFILE)
    table = Table("fig7b_scaling", f"Fig. 7(b): scalability of one MoE layer with {experts} experts",
                  ["strategy", "GPUs", "predicted ms/step", "input tokens/s", "input throughput (norm.)",
                   "processed throughput (norm.)", "token efficiency", "expert efficiency", "source"], fmt="{:.4g}")
    for label in STRATEGIES:
        for W in worlds:
            s = res[(label, W)]
            table.add(label, W, s["mean_total"] * 1e3, s["tokens_per_s"], s["tokens_per_s"] / base_in,
                      s["tokens_per_s"] * s["mean_token_efficiency"] / base_proc, s["mean_token_efficiency"],
                      s["mean_expert_efficiency"], src)
    table.add("DeepSpeed / FasterMoE / FlexMoE", "8-64", "-", "-", "FlexMoE significantly outperforms DeepSpeed "
              "and FasterMoE (values only in the figure)", "-", "-", "-", PAPER)
    table.notes += [
        f"{src}: placement simulator, one MoE layer of {experts} experts (paper §5.5), H 1024 / FFN 4096 (BERT-MoE-L "
        f"widths, Table 1), {tokens_per_gpu} tokens x top-2 per GPU per step (weak scaling), mean over steps 1-"
        f"{steps - 1} of {steps} (step 0, before any planner acted, left out). Strategies as in fig7a.",
        f"routing: synthetic (`perfmodel.placement_replay.synthetic_trace`, Zipf skew {syn['skew']}, drift "
        f"{syn['drift']}/step, per-GPU noise {syn['noise']}, seed {syn['seed']}): no shipped trace has 64 experts.",
        "normalised to the DeepSpeed-style row at 8 GPUs, as the paper's Fig. 7(b) is to DeepSpeed-8GPUs. input "
        "throughput counts every routed token; processed throughput counts the tokens the experts computed "
        "(x token efficiency): the capacity row's step is short because it drops tokens.",
        f"took {time.perf_counter() - t0:.0f} s"]

    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(worlds))
    width = 0.2
    for ax, key, name in ((axes[0], "in", "input throughput"), (axes[1], "proc", "processed throughput")):
        for i, label in enumerate(STRATEGIES):
            vals = []
            for W in worlds:
                s = res[(label, W)]
                vals.append(s["tokens_per_s"] / base_in if key == "in"
                            else s["tokens_per_s"] * s["mean_token_efficiency"] / base_proc)
            ax.bar([j + (i - 1.5) * width for j in x], vals, width, color=COLORS[label], label=label)
        ax.set_xticks(list(x))
        ax.set_xticklabels([f"{W} GPUs" for W in worlds])
        ax.set_ylabel("normalised to DeepSpeed-style, 8 GPUs")
        ax.set_title(name)
        ax.legend(fontsize=7)
    fig.suptitle(f"FlexMoE Fig. 7(b): predicted on {PROFILE}, one MoE layer with {experts} experts", y=1.02)
    return [table], [save_figure(fig, out_dir, "fig7b_scaling")]


# ================================================================================================ entry point
def run(out_dir: str, fast: bool, log=print, cluster_results: Optional[str] = None) -> dict:
    """Write FlexMoE's Figs. 5, 6 and 7 and Table 2 into ``out_dir`` (module docstring; Figs. 5 and 6(a)/(b):
    ``flexmoe_time``). ``cluster_results``: the folder of `megamoe bench planners --out DIR` (Fig. 5's measured
    rows)."""
    os.makedirs(out_dir, exist_ok=True)
    threads = torch.get_num_threads()          # megamoe train sets its --threads; restored at the end
    try:
        return _run(out_dir, fast, log, cluster_results)
    finally:
        torch.set_num_threads(threads)


def _planners_results(path: Optional[str]):
    """(results of `megamoe bench planners`, the cluster's shaping label) or (None, None)."""
    if not path:
        return None, None
    with open(os.path.join(path, "results.json")) as f:
        res = json.load(f)
    return res, shaping_label(res.get("setup") or {})


def shaping_label(setup: dict) -> str:
    """How the cluster runs of `megamoe bench planners` were measured, from their recorded set-up: the ranks'
    CPU shares (fixed-speed ranks) or shared cores (results that predate the shares or ran with --cpu-share off),
    the inter-node bandwidth and the tokens per rank."""
    bw = setup.get("inter_node_bandwidth") or 100e6
    ranks = cpu_caps.source_label([s for s in (setup.get("cpu_shares") or []) if s])
    tokens = f", {setup['tokens_per_rank']:,} tokens per rank" if setup.get("tokens_per_rank") else ""
    return f"measured, emulated cluster: 2 nodes x 2, {ranks}, inter-node {bw / 1e6:g} MB/s{tokens}"


def _run(out_dir: str, fast: bool, log, cluster_results: Optional[str] = None) -> dict:
    from . import flexmoe_time
    t0 = time.perf_counter()
    log(header("flexmoe", fast))
    tables: List[Table] = []
    figures: List[str] = []
    with tempfile.TemporaryDirectory() as work:
        log("Table 2: training with and without token drops ...")
        t, f, trace = quality_with_drops(out_dir, fast, log, trace_path=os.path.join(work, "dropless_trace"))
        tables += t
        figures += f
        log("Fig. 6(c): calibrating and validating the cost model on 2 gloo processes ...")
        t, f = cost_model_accuracy(out_dir, fast, log)
        tables += t
        figures += f
        log("Fig. 7(a): token and expert efficiency on the routing trace ...")
        t, f = efficiency_over_training(out_dir, fast, log, fallback_trace=trace)
        tables += t
        figures += f
    log("Fig. 7(b): scaling from 8 to 64 GPUs (predicted) ...")
    scale: dict = {}
    t, f = scaling(out_dir, fast, log, results=scale)
    tables += t
    figures += f
    log("Fig. 5: time to quality (emulated cluster; predicted at 8-64 GPUs) ...")
    planners, shaping = _planners_results(cluster_results)
    tables.append(flexmoe_time.time_to_quality(planners, scale, shaping,
                                               "not run here: needs `megamoe bench planners --out DIR` (root; "
                                               "~30 min), then --cluster-results DIR"))
    log("Fig. 6(a)/(b): trigger and scheduling policies (simulator) ...")
    t, fig = flexmoe_time.trigger_policies(fast, FLEX_OPTIONS)
    tables.append(t)
    figures.append(save_figure(fig, out_dir, "fig6ab_policies"))
    order = ["fig5_time_to_quality", "fig6ab_policies", "fig6c_cost_model", "fig6c_error_summary", "table2_quality", "fig7a_efficiency", "fig7b_scaling"]
    tables.sort(key=lambda t: order.index(t.name) if t.name in order else len(order))
    paths = [t.write(out_dir) for t in mark_fast(tables, fast)]
    print_tables(tables, figures, log, fast=fast)
    log(f"megamoe reproduce flexmoe: {len(paths)} tables, {len(figures)} figures in {out_dir} "
        f"({time.perf_counter() - t0:.0f} s)")
    return {"tables": paths, "figures": figures}
