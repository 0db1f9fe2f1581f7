"""`megamoe bench dynamic`: DynaMoE's runtime/quality trade-off (paper 000 §5.1 Fig. 6, §5.2 Fig. 9) and the
cached fraction over training (§5.3 Fig. 10), measured on this CPU in one process (no all-to-all: every run's
experts are local, so the trade-off shows in the compute alone; ``megamoe bench capacity`` measures it with expert
parallelism over 2 nodes on fixed-speed ranks).

What. One real-text language model (``models.TinyMoEGPT``, byte tokens of the embedded corpus as ``megamoe train``
uses; Switch top-1 gate, E = 8 experts) trained eight times with the same seed, initial weights, data and steps,
its MoE layers in capacity dispatch (GShard drop rule; padded per-expert buffers whose padding is computed):

- ``static CF=1``, ``CF=2``, ``CF=4``: one capacity factor for all experts and the whole run (paper Eq. 4);
- ``static no-drop``: CF = E/k, every expert's buffer holds all T tokens of the step, so nothing CAN be dropped
  (the paper's static factor "that ensures no samples are dropped", α = 7 there, §5.1);
- ``dynamic``: ``capacity_policy="dynamic"`` with its defaults (§4.1: per-expert moving average + max(20%
  headroom, 2 standard deviations), grow at once, shrink at most every 10 steps, RECOMPILE Δ_launch = 1); the first
  steps run at the config's CF = 1 until the first decision lands;
- ``dynamic spread=0``: the same policy covering only the 20% headroom, not the jitter (a second point of the dynamic
  curve; Fig. 9 plots policies of different average factors);
- ``dynamic q=0.9``: ``capacity_policy="quantile"``: each expert's capacity is the 0.9-quantile of
  its demand over the last 32 steps, grown as soon as that quantile exceeds it (the average rule grows an expert only
  once it drops on average);
- ``dynamic+cache``: ``dynamic`` plus sample-assignment caching (§4.2) with the paper's thresholds (on at >= 96% of
  tokens not reassigned over an epoch, off below 90%) but ``min_epoch`` 2 instead of 10 (``--cache-min-epoch``).

How. The training set is a fixed list of N sequences spread evenly over the corpus' train split; every epoch walks
it in the same order, so a sample's index (its position in the list) keys the assignment cache (``set_batch``).
The runs are interleaved: step s of every run in a fresh random order, then step s+1, so a shared machine's slow
phases hit all alike. (While caching is off, ``dynamic`` and ``dynamic+cache`` compute the same shapes; whichever
of them runs second in a step finds those new shapes' kernels and memory already prepared by the other, which the
random order shares out evenly; a run alone would pay it every time its capacities change.) Per run, wall clock:

- step time: ``perf_counter`` around the whole training step (``set_batch``, forward, loss, backward, clipping,
  AdamW, and ``DynamicRuntime.after_step`` where the run has a runtime);
- MoE layer time: each ``MoELayer``'s forward from a forward pre-hook to its forward hook, plus its backward from
  the gradient hook on its output (its backward can start) to the gradient hook on its input (all of it has run:
  that input feeds only the layer). CPU autograd runs on one thread in reverse creation order, so the window holds
  the layer's own backward; a few aux-loss nodes of the gate may run just before it;
- final validation loss: nats/token on M held-out sequences, evaluated dropless (``eval_capacity_factor`` 0) for
  every run, so it measures the trained model, not an inference capacity;
- average capacity factor (buffer rows / assignments over all training calls), dropped fraction (assignments cut
  by the capacity / assignments), RECOMPILE decisions applied (``DynamicRuntime.recompilations``);
- Fig. 8: per step, each expert's capacity in the first MoE layer of every dynamic run and the policy's moving
  average of its demand (assignments the gate sent it before the capacity cut; as last seen by the trigger);
- Fig. 10: per epoch, the fraction of tokens whose assignment did not change since the previous epoch and whether
  caching was on after it (``DynamicRuntime.cache_history``), and the epoch caching took effect, if it did.

Times are means over the steps after ``--skip`` warm-up steps; ratios are no-drop / run (> 1: faster), printed next
to the paper's anchors (dynamic 1.4x, dynamic + caching 1.7x over the no-drop static CF, §5.1 Fig. 6). On a CPU the
gate and the experts share the same cores one after the other, so caching (the experts may start before the gate
has finished) has nothing to overlap; the paper saw no speedup from caching alone where its hardware mapping had no
spare device for the gate either (§5.1).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from ..config import MoEConfig
from ..cpu_alloc import retain_freed_memory
from ..data import build_corpus
from ..dynamic.runtime import DynamicRuntime, dynamic_enabled
from ..dynamic.settings import DynamicSettings
from ..layer import collect_aux_loss, moe_layers
from ..models import TinyMoEGPT
from ..train import clip_grad_norm, lr_at

ANCHORS = {"dynamic": 1.4, "dynamic+cache": 1.7}       # paper 000 §5.1, Fig. 6: speedup over the no-drop static CF
SETTINGS = {   # default (< 6 min on 2 cores) and --quick (the test, < 60 s)
    "default": dict(hidden=128, heads=4, layers=4, ffn=256, moe_every=2, experts=8, seq_len=64, batch=8,
                    samples=256, epochs=10, valid=128, lr=3e-3, skip=2),
    "quick": dict(hidden=32, heads=2, layers=2, ffn=64, moe_every=1, experts=8, seq_len=32, batch=8,
                  samples=48, epochs=6, valid=16, lr=3e-3, skip=2),
}


def run_specs(E: int, k: int, min_epoch: int = 2, cache_on: float = 0.96,
              cache_off: float = 0.90) -> List[tuple]:
    """(name, MoEConfig overrides, DynamicSettings) of the eight runs."""
    dyn, default = dict(capacity_policy="dynamic"), DynamicSettings()
    return [("static CF=1", dict(capacity_factor=1.0), default), ("static CF=2", dict(capacity_factor=2.0), default),
            ("static CF=4", dict(capacity_factor=4.0), default),
            ("static no-drop", dict(capacity_factor=E / k), default),
            ("dynamic", dyn, default), ("dynamic spread=0", dyn, DynamicSettings(spread=0.0)),
            ("dynamic q=0.9", dict(capacity_policy="quantile"), default),
            ("dynamic+cache", dict(dyn, assignment_cache=True, assignment_cache_min_epoch=min_epoch,
                                   assignment_cache_on=cache_on, assignment_cache_off=cache_off), default)]


def sequences(corpus, split: str, n: int, seq_len: int) -> torch.Tensor:
    """[n, seq_len + 1] windows spread evenly over `split` (every domain of the corpus); row i is sample i."""
    sp = corpus.split(split)
    total = sp.num_samples(seq_len)
    if total < n:
        raise SystemExit(f"megamoe bench dynamic: the {split} split has {total} sequences of {seq_len}, need {n}")
    picks = torch.linspace(0, total - 1, n).round().long()
    return sp.tokens[picks[:, None] * seq_len + torch.arange(seq_len + 1)]


class LayerClock:
    """Wall clock of the MoE layers' forward and backward in training steps (hooks; module docstring), and their
    capacity statistics (buffer rows, assignments, capacity drops) from each call's routing."""

    def __init__(self, layers):
        self.fwd = self.bwd = 0.0
        self.rows = self.assignments = 0
        self.dropped = torch.zeros((), dtype=torch.float64)
        self._start: Dict[int, float] = {}
        for m in layers:
            m.register_forward_pre_hook(self._pre)
            m.register_forward_hook(self._post)

    def take(self):
        out = (self.fwd, self.bwd)
        self.fwd = self.bwd = 0.0
        return out

    def _pre(self, mod, args):
        if mod.training and args[0].requires_grad:
            args[0].register_hook(lambda g, m=id(mod): self._bwd_end(m))
        self._start[id(mod)] = time.perf_counter()

    def _post(self, mod, args, out):
        now = time.perf_counter()
        if not mod.training:
            return
        self.fwd += now - self._start[id(mod)]
        r = mod.last_routing
        T = r.expert_ids.shape[0]
        cap = mod.plan.capacity_for(T, True)
        self.rows += sum(cap)
        self.assignments += r.expert_ids.numel()
        self.dropped += (r.demand.sum() - r.counts.sum()).double()
        if out.requires_grad:
            out.register_hook(lambda g, m=id(mod): self._bwd_start(m))
        self._start[id(mod)] = time.perf_counter()       # hook bookkeeping is not the layer's time

    def _bwd_start(self, key):
        self._start[-key] = time.perf_counter()

    def _bwd_end(self, key):
        self.bwd += time.perf_counter() - self._start.pop(-key, time.perf_counter())


class Run:
    def __init__(self, name: str, cfg: MoEConfig, vocab: int, s: dict, seed: int, steps: int,
                 settings: DynamicSettings = DynamicSettings()):
        self.name, self.cfg, self.steps, self.s = name, cfg, steps, s
        torch.manual_seed(seed)                           # the same initial weights in every run
        self.model = TinyMoEGPT(cfg, vocab, hidden=s["hidden"], heads=s["heads"], layers=s["layers"],
                                ffn_hidden=s["ffn"], seq_len=s["seq_len"], moe_every=s["moe_every"])
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        rest = [p for p in self.model.parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                     lr=s["lr"], betas=(0.9, 0.95))
        layers = moe_layers(self.model)
        self.rt = DynamicRuntime(cfg, {m.layer_id: m for m in layers}, positions=s["seq_len"],
                                 settings=settings) if dynamic_enabled(cfg) else None
        self.clock = LayerClock(layers)
        self.step_s: List[float] = []
        self.moe_fwd_s: List[float] = []
        self.moe_bwd_s: List[float] = []
        self.val: List[tuple] = []                        # (epoch, validation loss)
        self.epoch_marks: List[tuple] = [(0.0, 0, 0)]     # (dropped, assignments, rows) at each epoch's end
        self.cache_on_epoch: Optional[int] = None
        self.first_moe = layers[0]
        self.capacity_trace: List[List[int]] = []          # Fig. 8: the first MoE layer's capacities per step
        self.demand_trace: List[List[float]] = []          # ... and the policy's smoothed demand of its experts
        self.model.train()

    def step(self, step: int, epoch: int, ids: torch.Tensor, data: torch.Tensor, warmup: int) -> None:
        t0 = time.perf_counter()
        for g in self.opt.param_groups:
            g["lr"] = lr_at(step - 1, self.steps, self.s["lr"], warmup)
        if self.rt is not None and self.rt.cache is not None:
            self.rt.cache.set_batch(ids, data.shape[1] - 1, layout="bs", epoch=epoch)
        logits = self.model(data[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1))
        loss = loss + collect_aux_loss(self.model)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        clip_grad_norm(self.model, 1.0)
        self.opt.step()
        if self.rt is not None:
            self.rt.after_step(step)
            if self.cfg.dynamic_capacity:
                self.capacity_trace.append(list(self.first_moe.plan.expert_capacity or []))
                avg = self.rt.capacity_policy.average.get(self.first_moe.layer_id)
                self.demand_trace.append([] if avg is None else avg.tolist())
            if self.cache_on_epoch is None and self.rt.cache is not None and self.rt.cache.active:
                self.cache_on_epoch = epoch
        self.step_s.append(time.perf_counter() - t0)
        fwd, bwd = self.clock.take()
        self.moe_fwd_s.append(fwd)
        self.moe_bwd_s.append(bwd)

    @torch.no_grad()
    def evaluate(self, valid: torch.Tensor, batch: int) -> float:
        self.model.eval()
        nll, n = 0.0, 0
        for i in range(0, valid.shape[0], batch):
            w = valid[i:i + batch]
            logits = self.model(w[:, :-1])
            nll += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum"))
            n += w[:, 1:].numel()
        self.model.train()
        return nll / n

    def result(self, skip: int) -> dict:
        moe = [f + b for f, b in zip(self.moe_fwd_s, self.moe_bwd_s)]
        mean = lambda xs: statistics.fmean(xs[skip:]) * 1e3       # noqa: E731
        m = self.rt.metrics() if self.rt is not None else {}
        a = max(self.clock.assignments, 1)
        out = {"name": self.name, "capacity_policy": self.cfg.capacity_policy,
               "capacity_factor": self.cfg.capacity_factor, "assignment_cache": self.cfg.assignment_cache,
               "avg_capacity_factor": self.clock.rows / a, "dropped_fraction": float(self.clock.dropped) / a,
               "recompilations": int(self.rt.recompilations) if self.rt is not None else 0,
               "step_ms": mean(self.step_s), "moe_ms": mean(moe), "moe_fwd_ms": mean(self.moe_fwd_s),
               "moe_bwd_ms": mean(self.moe_bwd_s), "train_s": sum(self.step_s), "step_s": self.step_s,
               "moe_s": moe, "val_loss": self.val[-1][1], "val_best": min(self.val, key=lambda v: v[1]),
               "val_curve": self.val, "runtime_metrics": m}
        marks = self.epoch_marks
        out["per_epoch"] = [{"epoch": i + 1, "dropped_fraction": (d1 - d0) / max(a1 - a0, 1),
                             "avg_capacity_factor": (r1 - r0) / max(a1 - a0, 1)}
                            for i, ((d0, a0, r0), (d1, a1, r1)) in enumerate(zip(marks, marks[1:]))]
        if self.capacity_trace:
            out["capacity_trace"], out["demand_trace"] = self.capacity_trace, self.demand_trace
        if self.rt is not None and self.rt.cache is not None:
            out["cache"] = {"on_epoch": self.cache_on_epoch, "cached_calls": int(self.rt.cache.cached_calls),
                            "history": [list(h) for h in self.rt.cache_history()]}
        return out


def ratios(runs: Dict[str, dict], skip: int) -> Dict[str, dict]:
    """no-drop / run for the step and MoE-layer means over the steps after `skip` (> 1: the run is faster)."""
    base = runs["static no-drop"]
    mean = lambda xs: statistics.fmean(xs[skip:])       # noqa: E731
    out = {}
    for name in ("dynamic", "dynamic spread=0", "dynamic+cache"):
        r = runs[name]
        out[name] = {"moe": mean(base["moe_s"]) / mean(r["moe_s"]), "step": mean(base["step_s"]) / mean(r["step_s"]),
                     "val_loss_delta": r["val_loss"] - base["val_loss"], "anchor": ANCHORS.get(name)}
    d, c = runs["dynamic"], runs["dynamic+cache"]
    out["cache vs dynamic"] = {"moe": mean(d["moe_s"]) / mean(c["moe_s"]),
                               "step": mean(d["step_s"]) / mean(c["step_s"]),
                               "val_loss_delta": c["val_loss"] - d["val_loss"], "anchor": None}
    return out


def run(s: dict, seed: int = 0, threads: int = 0, log=print, min_epoch: int = 2, cache_on: float = 0.96,
        cache_off: float = 0.90, only: Optional[List[str]] = None) -> dict:
    """Train the runs of ``run_specs`` (``only``: those names, e.g. the caching regime's) interleaved step by step;
    the result dict of the module docstring."""
    threads = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    retain_freed_memory()
    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    corpus = build_corpus(max_bytes=1_000_000, seed=seed)
    train = sequences(corpus, "train", s["samples"], s["seq_len"])
    valid = sequences(corpus, "valid", s["valid"], s["seq_len"])
    spe = s["samples"] // s["batch"]
    steps = spe * s["epochs"]
    warmup = max(steps // 10, 1)
    base = dict(num_experts=s["experts"], top_k=1, gate="switch", aux_loss_coeff=0.01, dispatch="capacity")
    runs = [Run(name, MoEConfig(**base, **over), corpus.vocab_size, s, seed, steps, settings)
            for name, over, settings in run_specs(s["experts"], 1, min_epoch, cache_on, cache_off)
            if only is None or name in only]
    log(f"bench dynamic: {len(runs)} runs x {steps} steps ({s['epochs']} epochs of {spe} steps, {s['samples']} "
        f"sequences of {s['seq_len']} bytes, batch {s['batch']}), {threads} thread(s); interleaved step by step")
    order = random.Random(seed)
    for step in range(1, steps + 1):
        epoch, i = divmod(step - 1, spe)
        ids = torch.arange(i * s["batch"], (i + 1) * s["batch"])
        for r in order.sample(runs, len(runs)):           # a new order every step (module docstring)
            r.step(step, epoch + 1, ids, train[ids], warmup)
        if step % spe == 0:
            for r in runs:
                r.val.append((epoch + 1, r.evaluate(valid, s["batch"])))
                r.epoch_marks.append((float(r.clock.dropped), r.clock.assignments, r.clock.rows))
            log(f"  epoch {epoch + 1:3d}/{s['epochs']}: valid loss " +
                " ".join(f"{r.name}={r.val[-1][1]:.3f}" for r in runs))
    for r in runs:
        if r.rt is not None:
            r.rt.close()
    res = {"setup": dict(s, steps=steps, steps_per_epoch=spe, threads=threads, cpus=len(os.sched_getaffinity(0)),
                         seed=seed, torch=torch.__version__, moe=base, cache_on=cache_on, cache_off=cache_off,
                         cache_min_epoch=min_epoch,
                         wall_s=time.perf_counter() - t_start, load_avg=[load_start, os.getloadavg()[0]]),
           "runs": [r.result(s["skip"]) for r in runs]}
    byname = {r["name"]: r for r in res["runs"]}
    if only is None:
        res["ratios"] = ratios(byname, s["skip"])
    if "dynamic+cache" in byname:
        res["fig10"] = byname["dynamic+cache"]["cache"]["history"]
    return res


def report(res: dict) -> str:
    s = res["setup"]
    E, k = s["moe"]["num_experts"], s["moe"]["top_k"]
    lines = [f"DynaMoE capacity trade-off (paper 000 Fig. 6/9/10), measured here on CPU ({s['cpus']} cores, "
             f"{s['threads']} torch threads, fp32, torch {s['torch']}), tiny GPT on the embedded corpus: "
             f"{s['layers']} blocks ({s['layers'] // s['moe_every']} MoE), hidden {s['hidden']}, ffn {s['ffn']}, "
             f"E={E} k={k} {s['moe']['gate']}, {s['samples']} train sequences x {s['seq_len']} bytes, batch "
             f"{s['batch']} ({s['batch'] * s['seq_len']} tokens/step), {s['epochs']} epochs = {s['steps']} steps, "
             f"seed {s['seed']}; times: mean per step over steps {s['skip'] + 1}..{s['steps']}, runs interleaved step "
             f"by step; machine load average {s['load_avg'][0]:.1f} at the start, {s['load_avg'][1]:.1f} at the "
             f"end; {s['wall_s']:.0f} s in all.",
             f"no-drop = static CF = E/k = {E / k:g}: every expert's buffer holds all tokens, nothing can be dropped. "
             f"Validation loss: nats/token on {s['valid']} held-out sequences, dropless evaluation for every run.",
             "One process, no exchange: the same trade-off with expert parallelism over a slow link, on fixed-speed "
             "ranks, is `megamoe bench capacity` (root; BENCHMARKS.md).", "",
             "| run | avg capacity factor | dropped | recompilations | MoE layers ms/step (fwd+bwd) | step ms | "
             "train s | final valid loss | best (epoch) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["runs"]:
        lines.append(f"| {r['name']} | {r['avg_capacity_factor']:.2f} | {100 * r['dropped_fraction']:.2f}% | "
                     f"{r['recompilations']} | {r['moe_ms']:.1f} ({r['moe_fwd_ms']:.1f}+{r['moe_bwd_ms']:.1f}) | "
                     f"{r['step_ms']:.1f} | {r['train_s']:.1f} | {r['val_loss']:.4f} | {r['val_best'][1]:.4f} "
                     f"({r['val_best'][0]}) |")
    lines.append("")
    for name, q in res["ratios"].items():
        vs = "dynamic" if name == "cache vs dynamic" else "no-drop"
        label = "dynamic+cache vs dynamic" if name == "cache vs dynamic" else f"{name} vs no-drop"
        anchor = f" (paper: {q['anchor']}x)" if q["anchor"] else ""
        if name == "cache vs dynamic":
            anchor = " (paper §5.1: caching alone gave no speedup in its expert-parallel mapping)"
        lines.append(f"{label}: MoE layers {q['moe']:.2f}x, step {q['step']:.2f}x faster{anchor}; valid loss "
                     f"{q['val_loss_delta']:+.4f} vs {vs}")
    c = next(r for r in res["runs"] if r["name"] == "dynamic+cache")["cache"]
    lines += ["", "Fig. 10 (dynamic+cache): epoch | fraction of tokens not reassigned since the previous epoch | "
                  "caching on after it"]
    for epoch, frac, on in res["fig10"]:
        lines.append(f"  {epoch:3d} | {'-' if frac is None else f'{frac:.4f}'} | {'on' if on else 'off'}")
    lines.append(f"caching took effect in epoch {c['on_epoch']} ({c['cached_calls']} MoE layer calls used cached "
                 f"assignments)" if c["on_epoch"] is not None else
                 f"caching never turned on (on at >= {100 * s['cache_on']:g}% of tokens not reassigned over an "
                 f"epoch, from epoch {s['cache_min_epoch']}; off below {100 * s['cache_off']:g}%)")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> dict:
    p = argparse.ArgumentParser(prog="megamoe bench dynamic", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a tiny model and dataset (< 60 s; the test)")
    for name in ("samples", "epochs", "batch", "seq_len", "experts", "hidden", "ffn", "skip"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=f"override the {name} setting")
    p.add_argument("--cache-on", type=float, default=0.96, help="caching on at this fraction of tokens not "
                                                                 "reassigned over an epoch (paper: 0.96)")
    p.add_argument("--cache-off", type=float, default=0.90, help="caching off below this fraction (paper: 0.90)")
    p.add_argument("--cache-min-epoch", type=int, default=2, help="caching never on before this epoch (paper: 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = all cores)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results (per-step times included) here")
    args = p.parse_args(argv)
    s = dict(SETTINGS["quick" if args.quick else "default"])
    for name in ("samples", "epochs", "batch", "seq_len", "experts", "hidden", "ffn", "skip"):
        if getattr(args, name) is not None:
            s[name] = getattr(args, name)
    if s["samples"] < s["batch"] or s["epochs"] < 2:
        p.error("need --samples >= --batch and --epochs >= 2")
    if not 0 <= args.cache_off <= args.cache_on <= 1:
        p.error("need 0 <= --cache-off <= --cache-on <= 1")
    res = run(s, args.seed, args.threads, min_epoch=args.cache_min_epoch, cache_on=args.cache_on,
              cache_off=args.cache_off)
    print(report(res), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
