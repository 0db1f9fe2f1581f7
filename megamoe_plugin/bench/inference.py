"""`megamoe bench inference`: static vs dynamic gating at inference (paper 004 §III-B and §V, Figs. 9-10) at
small scale, measured on this machine (CPU here; a CUDA device when there is one).

What. One real-text MoE language model (``models.TinyMoEGPT``, byte tokens of the embedded corpus as ``megamoe
train`` uses; GShard top-2 gate, an MoE FFN every 2nd block as the paper's LM, MF = 2), in eval mode under
``torch.no_grad``, run with the *same weights* and the same input batches through these MoE implementations:

- ``static einsum CF=12.8`` (the paper's baseline, "static gating"): GShard-style dispatch as fairseq's moe branch
  and DeepSpeed-MoE compute it: one-hot [T, E] masks, slot locations by cumsum, one-hot slots, a dense [T, E, C]
  combine tensor and its boolean dispatch mask, ``einsum`` into per-expert buffers [E, C, H] of fixed capacity C,
  the experts on every row (padding included), ``einsum`` back. The capacity factor 12.8 is the paper's LM
  setting: E = 512 experts, capacity 0.05 of the tokens per expert, top-2, i.e. a buffer of E * 0.05 / 2 = 12.8
  times the tokens' assignments (its "waste factor", §III-B); in this package's terms C = ceil(CF * T * k / E).
- ``static capacity CF=c``: this package's capacity dispatch (``--moe-dispatch capacity``, eval capacity factor
  c): the same fixed per-expert buffers, padding computed, but scattered and gathered by index, no [T, E, C] mask.
  At the paper's CF it separates what the masks cost from what the padding costs; at CF 1 and 2 it is the usual
  training setting, which DROPS tokens at inference (the dropped column says how many).
- ``dynamic (dropless)``: dynamic gating (§V-A): argsort by expert, exact per-expert groups, no capacity, nothing
  dropped, no padding, no mask (``--moe-dispatch dropless``; also what capacity mode runs at eval with
  ``--moe-eval-capacity-factor 0``).

Every implementation computes the same function when nothing is dropped (the report prints the largest logit
difference against dynamic gating at the smallest batch as a check).

How.
- Throughput: tokens/s = batch x sequence length / the median wall time of one forward of the whole LM (embeddings,
  attention, MoE and dense blocks, output head) over ``--repeat`` rounds after one warm-up call each; every round
  runs every implementation once, in a fresh random order, so a shared machine's slow phases hit all alike. The MoE
  column is the time inside the MoE FFN modules (forward pre-hook to forward hook) in the same calls.
- Peak activation memory, CPU: a ``TorchDispatchMode`` (``LiveTensorBytes``) sees every ATen op of the forward;
  every tensor an op returns whose storage is new (not one of the op's inputs': views and in-place results are not
  allocations) adds its storage's bytes to a live total, and a ``weakref.finalize`` on the storage takes them off
  when the storage is freed. The peak of that total is the activation memory: bytes of tensors allocated during
  the forward and alive at the same time; parameters and the input batch existed before and are not counted
  (the paper's "dynamic memory", Fig. 10's bright bars). Not seen: scratch memory a kernel allocates inside
  itself, and ops run on other threads: the memory pass runs the experts on one lane (``ExpertBank.cpu_lanes`` 1) so
  that all of it is on the measuring thread. (torch.profiler's CPU memory events were tried and missed
  allocations here.) The MoE column is the largest rise of the live total inside one MoE FFN call above its value
  at the call's start: what dispatch, experts and combine allocate (masks and padded buffers included).
- Peak activation memory, CUDA: ``torch.cuda.max_memory_allocated`` minus the memory allocated before the forward
  (peak statistics reset at each MoE call's boundaries for the MoE column).
- Memory budget: for every implementation the batch is doubled from 1 until the measured peak exceeds
  ``--memory-budget-mb`` (or ``--max-batch`` is reached); the largest batch within the budget is what it can run
  (Fig. 10: static 8 vs dynamic 64 in the paper). A measurement stops the forward as soon as the live total passes
  ``--abort-mb`` (default 4 x the budget), so a huge static batch never allocates much more than that; such a point
  is reported as "> abort" and not timed. Points above the budget but below the abort limit are timed and marked
  "over budget": the best throughput within the budget only counts the others (the paper's missing bars).

The paper's numbers (8 V100s, a 52B-parameter LM) are printed next to the ratios measured here as anchors only: a
2-core CPU computes the padding and the masks at the same rate as useful work, and its model is thousands of
times smaller. Tutel's gating (the paper's second baseline) and the multi-node all-to-all (where the paper sees its
largest gains) are not reproduced here: one process, no expert parallelism.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
import weakref
from typing import Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..config import MoEConfig
from ..cpu_alloc import retain_freed_memory
from ..gates.base import capacity_from_factor
from ..experts.activations import activation
from ..layer import MoELayer
from ..models import TinyMoEGPT

__all__ = ["LiveTensorBytes", "CudaPeak", "BudgetExceeded", "GShardEinsumMoE", "PAPER", "SETTINGS", "PAPER_CF",
           "run", "report", "main"]

PAPER_CF = 12.8          # paper 004 LM: E=512, capacity 0.05 of the tokens per expert, top-2 -> 512 * 0.05 / 2
PAPER = {"throughput_vs_static": 6.21, "throughput_vs_tutel": 3.32, "memory_batch": 8,
         "activation_gb_static": 6.29, "activation_gb_dynamic": 1.28, "max_batch_static": 8, "max_batch_dynamic": 64}
SETTINGS = {   # default (a few minutes on 2 busy cores) and --quick (the test, < 60 s)
    "default": dict(hidden=128, heads=4, layers=4, ffn=256, moe_every=2, experts=32, top_k=2, seq_len=64,
                    batches=[1, 2, 4, 8, 16, 32, 64], repeat=5, budget_mb=256.0, max_batch=512),
    "quick": dict(hidden=64, heads=2, layers=2, ffn=128, moe_every=1, experts=16, top_k=2, seq_len=32,
                  batches=[1, 2, 4, 8], repeat=3, budget_mb=8.0, max_batch=64),
}
MIB = float(1 << 20)


# --- memory: live tensor bytes (CPU) and the CUDA allocator's peak -------------------------------------------------
class BudgetExceeded(RuntimeError):
    """Raised inside a measured forward as soon as the live bytes pass the meter's abort limit."""


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of tensors allocated while the mode is active and alive at the same time (module docstring).

    ``cur``: bytes of the live storages the mode has seen allocated; ``peak``: the largest ``cur``;
    ``begin_segment`` / ``end_segment``: the largest rise of ``cur`` above its value at ``begin_segment``
    (one MoE layer call). ``limit``: raise ``BudgetExceeded`` once ``cur`` exceeds it (None: never)."""

    def __init__(self, limit: Optional[int] = None):
        super().__init__()
        self.limit = limit
        self.cur = self.peak = 0
        self.allocations = 0
        self._live: Dict[int, int] = {}
        self._seg_base: Optional[int] = None
        self._seg_peak = 0

    def _free(self, key: int) -> None:
        self.cur -= self._live.pop(key, 0)

    def begin_segment(self) -> None:
        self._seg_base = self._seg_peak = self.cur

    def end_segment(self) -> int:
        rise = self._seg_peak - (self._seg_base or 0)
        self._seg_base = None
        return rise

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = set()
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                try:
                    inputs.add(t.untyped_storage()._cdata)
                except (RuntimeError, NotImplementedError):
                    pass
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            key = st._cdata
            if key in inputs:                    # a view of an input or an in-place/out= result: no new storage
                n = self._live.get(key)
                if n is not None and st.nbytes() > n:       # out= resized a storage we track
                    self.cur += st.nbytes() - n
                    self._live[key] = st.nbytes()
                else:
                    continue
            elif key in self._live:
                continue
            else:
                n = st.nbytes()
                self._live[key] = n
                self.cur += n
                self.allocations += 1
                weakref.finalize(st, self._free, key)
            self.peak = max(self.peak, self.cur)
            if self._seg_base is not None:
                self._seg_peak = max(self._seg_peak, self.cur)
        if self.limit is not None and self.cur > self.limit:
            raise BudgetExceeded(f"live tensor bytes {self.cur} passed the limit {self.limit}")
        return out


class CudaPeak:
    """The same interface on a CUDA device: the caching allocator's allocated-bytes peak above the start."""

    def __init__(self, device, limit: Optional[int] = None):
        self.device, self.limit = device, limit
        self.peak = 0
        self._base = 0
        self._seg_base = 0

    def __enter__(self):
        torch.cuda.synchronize(self.device)
        self._base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def _take(self) -> None:
        torch.cuda.synchronize(self.device)
        self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device) - self._base)

    def begin_segment(self) -> None:
        self._take()
        self._seg_base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def end_segment(self) -> int:
        torch.cuda.synchronize(self.device)
        rise = torch.cuda.max_memory_allocated(self.device) - self._seg_base
        self._take()
        torch.cuda.reset_peak_memory_stats(self.device)
        return rise

    def __exit__(self, *exc):
        self._take()
        return False


# --- the static-gating baseline: GShard einsum with dense [T, E, C] masks --------------------------------------------
class GShardEinsumMoE(nn.Module):
    """Static gating at inference as fairseq's moe branch (top2gating + MOELayer) and DeepSpeed-MoE compute it,
    on an existing ``MoELayer``'s gate and expert weights (shared, not copied).

    The gate's logits, softmax and top-k choice are the layer's own; then, per choice j (first choices claim slots
    before second choices, GShard's priority, as this package's capacity rule): one-hot mask [T, E], locations by
    cumsum, assignments at or past capacity C = ceil(CF * T * k / E) dropped, one-hot slot [T, C]; the combine
    tensor [T, E, C] (weights renormalised over the kept choices, as the core gate does), the dispatch mask
    ``combine > 0``, ``einsum`` into [E, C, H] buffers, the experts on all E x C rows, ``einsum`` back to [T, H]."""

    def __init__(self, layer: MoELayer, capacity_factor: float):
        super().__init__()
        self.layer = layer
        self.capacity_factor = float(capacity_factor)
        self.last_dropped = 0
        self.last_assignments = 0

    def capacity(self, num_tokens: int) -> int:
        cfg = self.layer.cfg
        return max(capacity_from_factor(self.capacity_factor, num_tokens, cfg.top_k, cfg.num_experts,
                                        cfg.min_capacity)[0], 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, H = x.shape, x.shape[-1]
        xt = x.reshape(-1, H)
        T = xt.shape[0]
        gate, bank, cfg = self.layer.gate, self.layer.experts, self.layer.cfg
        E = cfg.num_experts
        logits = gate.logits(xt)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        ids, kept = gate.select(logits, probs)
        k = ids.shape[1]
        C = self.capacity(T)
        taken = torch.zeros(E, dtype=torch.long, device=x.device)
        masks, locs = [], []
        for j in range(k):
            mask = F.one_hot(ids[:, j], E) * kept[:, j, None]            # [T, E]
            loc = torch.cumsum(mask, 0) - 1 + taken
            taken = taken + mask.sum(0)
            mask = mask * (loc < C)
            masks.append(mask)
            locs.append((loc * mask).sum(1))                              # [T] slot (0 where dropped)
        w = torch.stack([(probs * m).sum(1) for m in masks], 1)           # gate prob of each kept choice
        if cfg.normalize_top_k and k > 1:
            w = w / w.sum(-1, keepdim=True).clamp_min(1e-20)
        combine = None
        for j in range(k):
            term = (w[:, j, None] * masks[j])[:, :, None] * F.one_hot(locs[j], C)[:, None, :]   # [T, E, C]
            combine = term if combine is None else combine + term
        combine = combine.to(x.dtype)
        dispatch = (combine > 0).to(x.dtype)
        expert_in = torch.einsum("tec,th->ech", dispatch, xt)             # [E, C, H], padding rows are zero
        del dispatch
        h = torch.einsum("ech,ehf->ecf", expert_in, bank.w1)
        if bank.b1 is not None:
            h = h + bank.b1[:, None, :]
        out = torch.einsum("ecf,efh->ech", activation(h, bank.activation), bank.w2)
        if bank.b2 is not None:
            out = out + bank.b2[:, None, :]
        y = torch.einsum("tec,ech->th", combine, out)
        self.last_assignments = int(kept.sum())
        self.last_dropped = self.last_assignments - int(sum(int(m.sum()) for m in masks))
        return y.view(shape)


# --- the implementations, their models and hooks -------------------------------------------------------------------
class Impl:
    """One implementation: its model (same weights as the others) and the hooks that time and meter its MoE FFNs."""

    def __init__(self, name: str, kind: str, cf: Optional[float], model: nn.Module):
        self.name, self.kind, self.cf, self.model = name, kind, cf, model
        self.moe = [b.ffn for b in model.blocks if isinstance(b.ffn, (MoELayer, GShardEinsumMoE))]
        self.meter = None
        self.counting = False            # count dropped assignments (memory pass and the check, not while timing)
        self.moe_peak = 0
        self.moe_time = 0.0
        self.dropped = self.assignments = 0
        self._t0 = 0.0
        for m in self.moe:
            m.register_forward_pre_hook(self._pre)
            m.register_forward_hook(self._post)

    @property
    def static(self) -> bool:
        return self.kind != "dropless"

    def _pre(self, mod, args):
        if self.meter is not None:
            self.meter.begin_segment()
        self._t0 = time.perf_counter()

    def _post(self, mod, args, out):
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        self.moe_time += time.perf_counter() - self._t0
        if self.meter is not None:
            self.moe_peak = max(self.moe_peak, self.meter.end_segment())
        if self.meter is None and not self.counting:
            return
        if isinstance(mod, GShardEinsumMoE):
            self.dropped += mod.last_dropped
            self.assignments += mod.last_assignments
        else:
            r = mod.last_routing
            self.dropped += int(r.dropped)
            self.assignments += int(r.expert_ids.numel())

    def banks(self) -> list:
        return [m.layer.experts if isinstance(m, GShardEinsumMoE) else m.experts for m in self.moe]


def impl_specs(einsum_cfs: List[float], capacity_cfs: List[float]) -> List[tuple]:
    specs = [(f"static einsum CF={cf:g}", "einsum", cf) for cf in einsum_cfs]
    specs += [(f"static capacity CF={cf:g}", "capacity", cf) for cf in capacity_cfs]
    return specs + [("dynamic (dropless)", "dropless", None)]


def build_impls(s: dict, specs: List[tuple], device, seed: int = 0, base_cfg: Optional[MoEConfig] = None,
                state_dict: Optional[dict] = None, vocab: int = 0) -> List[Impl]:
    """One model per implementation, all with the weights of the first (or of `state_dict`)."""
    if base_cfg is None:
        base_cfg = MoEConfig(num_experts=s["experts"], top_k=s["top_k"], gate="gshard" if s["top_k"] == 2 else "naive",
                             second_expert_policy="all", dispatch="dropless", min_capacity=0, aux_loss_coeff=0.0)
    impls, ref = [], state_dict
    for name, kind, cf in specs:
        over = dict(dispatch="dropless") if kind in ("dropless", "einsum") else dict(
            dispatch="capacity", capacity_factor=cf, eval_capacity_factor=cf)
        cfg = base_cfg.replace(**over)
        torch.manual_seed(seed)
        model = TinyMoEGPT(cfg, vocab, hidden=s["hidden"], heads=s["heads"], layers=s["layers"],
                           ffn_hidden=s["ffn"], seq_len=s.get("seq_len_model", s["seq_len"]),
                           moe_every=s["moe_every"])
        if ref is None:
            ref = {k: v.clone() for k, v in model.state_dict().items()}
        else:
            model.load_state_dict(ref)
        if kind == "einsum":
            for b in model.blocks:
                if isinstance(b.ffn, MoELayer):
                    b.ffn = GShardEinsumMoE(b.ffn, cf)
        model.to(device).eval()
        impls.append(Impl(name, kind, cf, model))
    return impls


def batch_tokens(corpus, split: str, batch: int, seq_len: int) -> torch.Tensor:
    """[batch, seq_len] consecutive windows of the held-out split (wrapping around when it is short)."""
    toks = corpus.split(split).tokens
    n = max((toks.numel() - 1) // seq_len, 1)
    idx = torch.arange(batch) % n
    return toks[idx[:, None] * seq_len + torch.arange(seq_len)]


# --- measuring -----------------------------------------------------------------------------------------------------
@torch.no_grad()
def measure_memory(impl: Impl, tokens: torch.Tensor, abort_bytes: Optional[int]) -> dict:
    """One forward under the meter: activation peak and the largest MoE-call rise (bytes); `aborted` when the
    live bytes passed `abort_bytes` (the peak is then only a lower bound)."""
    cuda = tokens.is_cuda
    meter = CudaPeak(tokens.device, abort_bytes) if cuda else LiveTensorBytes(abort_bytes)
    impl.moe_peak, impl.dropped, impl.assignments = 0, 0, 0
    banks = impl.banks()
    old = [b.cpu_lanes for b in banks]
    if not cuda:
        for b in banks:               # every allocation on the measuring thread (module docstring)
            b.cpu_lanes = 1
    impl.meter = meter
    aborted = False
    try:
        with meter:
            impl.model(tokens)
    except BudgetExceeded:
        aborted = True
    finally:
        impl.meter = None
        for b, n in zip(banks, old):
            b.cpu_lanes = n
    if cuda and abort_bytes is not None and meter.peak > abort_bytes:
        aborted = True
    return {"peak": int(meter.peak), "moe_peak": int(impl.moe_peak), "aborted": aborted,
            "dropped": impl.dropped, "assignments": impl.assignments}


@torch.no_grad()
def time_rounds(impls: List[Impl], tokens: torch.Tensor, repeat: int, rng: random.Random) -> Dict[str, dict]:
    """Median forward and MoE time of each implementation over `repeat` rounds, every round running each once in a
    random order, after one warm-up call each."""
    cuda = tokens.is_cuda
    sync = (lambda: torch.cuda.synchronize(tokens.device)) if cuda else (lambda: None)   # noqa: E731
    for im in impls:
        im.model(tokens)
    sync()
    fwd = {im.name: [] for im in impls}
    moe = {im.name: [] for im in impls}
    for _ in range(repeat):
        for im in rng.sample(impls, len(impls)):
            im.moe_time = 0.0
            sync()
            t0 = time.perf_counter()
            im.model(tokens)
            sync()
            fwd[im.name].append(time.perf_counter() - t0)
            moe[im.name].append(im.moe_time)
    return {n: {"fwd_s": statistics.median(fwd[n]), "moe_s": statistics.median(moe[n]), "fwd_all": fwd[n]}
            for n in fwd}


def run(s: dict, corpus=None, seed: int = 0, threads: int = 0, device: str = "auto", einsum_cfs=None,
        capacity_cfs=None, abort_mb: Optional[float] = None, split: str = "valid", base_cfg=None, state_dict=None,
        log=print) -> dict:
    from ..data import build_corpus

    threads = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    retain_freed_memory()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    corpus = corpus or build_corpus(max_bytes=1_000_000, seed=seed)
    einsum_cfs = [PAPER_CF] if einsum_cfs is None else einsum_cfs
    capacity_cfs = [1.0, 2.0, PAPER_CF] if capacity_cfs is None else capacity_cfs
    specs = impl_specs(einsum_cfs, capacity_cfs)
    impls = build_impls(s, specs, dev, seed, base_cfg, state_dict, vocab=corpus.vocab_size)
    cfg = impls[-1].model.moe_cfg
    budget = int(s["budget_mb"] * MIB)
    abort = int((abort_mb if abort_mb is not None else 4 * s["budget_mb"]) * MIB)
    rng = random.Random(seed)
    n_moe = len(impls[-1].moe)
    log(f"bench inference: {len(impls)} implementations x batches {s['batches']} (seq {s['seq_len']}), "
        f"{threads} thread(s), {dev.type}; memory budget {s['budget_mb']:g} MiB, abort at {abort / MIB:g} MiB")

    # correctness: every implementation against dynamic gating on the smallest batch
    tokens = batch_tokens(corpus, split, min(s["batches"]), s["seq_len"]).to(dev)
    with torch.no_grad():
        ref = impls[-1].model(tokens)
        check = {}
        for im in impls:
            im.dropped = im.assignments = 0
            im.counting = True
            out = im.model(tokens)
            im.counting = False
            check[im.name] = {"max_abs_diff": float((out - ref).abs().max()), "dropped": im.dropped,
                              "assignments": im.assignments}

    # memory: every point of the table, then doubling to the largest batch within the budget
    mem: Dict[str, Dict[int, dict]] = {im.name: {} for im in impls}
    largest: Dict[str, dict] = {}
    for im in impls:
        b, last_ok = 1, None
        while True:
            if b not in mem[im.name]:
                mem[im.name][b] = measure_memory(im, batch_tokens(corpus, split, b, s["seq_len"]).to(dev), abort)
            m = mem[im.name][b]
            if m["aborted"] or m["peak"] > budget:
                break
            last_ok = b
            if b >= s["max_batch"]:
                break
            b *= 2
        largest[im.name] = {"batch": last_ok, "capped": last_ok is not None and last_ok >= s["max_batch"],
                            "first_over": None if last_ok is not None and last_ok >= s["max_batch"] else b}
        for bt in s["batches"]:
            if bt not in mem[im.name]:
                mem[im.name][bt] = measure_memory(im, batch_tokens(corpus, split, bt, s["seq_len"]).to(dev), abort)
        log(f"  memory {im.name}: largest batch within {s['budget_mb']:g} MiB = {last_ok}"
            + (" (the --max-batch cap)" if largest[im.name]["capped"] else ""))

    # throughput at the table's batches (and at every implementation's largest batch within the budget)
    timed_batches = sorted(set(s["batches"]) | {v["batch"] for v in largest.values() if v["batch"]})
    rows = []
    for b in timed_batches:
        tokens = batch_tokens(corpus, split, b, s["seq_len"]).to(dev)
        runnable = [im for im in impls if b in mem[im.name] and not mem[im.name][b]["aborted"]]
        times = time_rounds(runnable, tokens, s["repeat"], rng) if runnable else {}
        for im in impls:
            m = mem[im.name].get(b)
            if m is None:
                continue
            t = times.get(im.name)
            rows.append({"batch": b, "tokens": b * s["seq_len"], "impl": im.name, "kind": im.kind, "cf": im.cf,
                         "in_table": b in s["batches"], "tokens_per_s": b * s["seq_len"] / t["fwd_s"] if t else None,
                         "fwd_ms": t["fwd_s"] * 1e3 if t else None, "moe_ms": t["moe_s"] * 1e3 if t else None,
                         "peak_bytes": m["peak"], "moe_peak_bytes": m["moe_peak"], "aborted": m["aborted"],
                         "over_budget": m["aborted"] or m["peak"] > budget,
                         "dropped_fraction": m["dropped"] / m["assignments"] if m["assignments"] else 0.0})
        log(f"  batch {b:4d}: " + ", ".join(f"{im.name} {b * s['seq_len'] / times[im.name]['fwd_s']:,.0f} tok/s"
                                           for im in impls if im.name in times))

    static_name = impls[0].name if impls[0].kind == "einsum" else next(im.name for im in impls if im.static)
    res = {"setup": dict(s, threads=threads, cpus=len(os.sched_getaffinity(0)), device=str(dev),
                         device_name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU",
                         torch=torch.__version__, seed=seed, split=split, moe_layers=n_moe,
                         moe=dict(num_experts=cfg.num_experts, top_k=cfg.top_k, gate=cfg.gate,
                                  min_capacity=cfg.min_capacity), abort_mb=abort / MIB,
                         memory_method=("torch.cuda.max_memory_allocated" if dev.type == "cuda" else
                                        "LiveTensorBytes (TorchDispatchMode, live storage bytes)"),
                         wall_s=time.perf_counter() - t_start, load_avg=[load_start, os.getloadavg()[0]]),
           "impls": [{"name": im.name, "kind": im.kind, "cf": im.cf} for im in impls],
           "static_baseline": static_name, "dynamic": impls[-1].name,
           "check": check, "rows": rows, "largest_batch": largest}
    res["ratios"] = ratios(res)
    return res


def _row(res, impl, batch):
    return next((r for r in res["rows"] if r["impl"] == impl and r["batch"] == batch), None)


def ratios(res: dict) -> dict:
    """Per table batch: dynamic / static throughput, static / dynamic activation and MoE peak memory (vs the
    einsum baseline and vs every other static implementation); and the best throughput within the budget."""
    dyn = res["dynamic"]
    per_batch = []
    for b in res["setup"]["batches"]:
        d = _row(res, dyn, b)
        entry = {"batch": b, "vs": {}}
        for im in res["impls"]:
            if im["name"] == dyn:
                continue
            r = _row(res, im["name"], b)
            if r is None or d is None:
                continue
            entry["vs"][im["name"]] = {
                "throughput": (d["tokens_per_s"] / r["tokens_per_s"]) if r["tokens_per_s"] and d["tokens_per_s"]
                else None,
                "memory": None if r["aborted"] else r["peak_bytes"] / max(d["peak_bytes"], 1),
                "moe_memory": None if r["aborted"] else r["moe_peak_bytes"] / max(d["moe_peak_bytes"], 1),
                "static_over_budget": r["over_budget"]}
        per_batch.append(entry)
    best = {}
    for im in res["impls"]:
        ok = [r for r in res["rows"] if r["impl"] == im["name"] and not r["over_budget"] and r["tokens_per_s"]]
        if ok:
            top = max(ok, key=lambda r: r["tokens_per_s"])
            best[im["name"]] = {"batch": top["batch"], "tokens_per_s": top["tokens_per_s"]}
    out = {"per_batch": per_batch, "best_within_budget": best}
    s, d = res["static_baseline"], dyn
    if s in best and d in best:
        out["best_throughput_ratio"] = best[d]["tokens_per_s"] / best[s]["tokens_per_s"]
    return out


# --- report --------------------------------------------------------------------------------------------------------
def _mib(b: int) -> str:
    return f"{b / MIB:.2f}"


def report(res: dict) -> str:
    s = res["setup"]
    where = (f"CUDA ({s['device_name']})" if s["device"].startswith("cuda") else
             f"CPU ({s['cpus']} cores, {s['threads']} torch threads)")
    moe = s["moe"]
    E, k = moe["num_experts"], moe["top_k"]
    static, dyn = res["static_baseline"], res["dynamic"]
    lines = [f"Static vs dynamic gating at inference (paper 004 Figs. 9-10) -- measured here on {where}, fp32, "
             f"torch {s['torch']}; tiny MoE GPT on the embedded corpus ({s['split']} split): {s['layers']} blocks "
             f"({s['moe_layers']} MoE), hidden {s['hidden']}, ffn {s['ffn']}, E={E} top-{k} {moe['gate']}, sequence "
             f"{s['seq_len']} tokens; eval, no_grad; times: median of {s['repeat']} interleaved rounds of one LM "
             f"forward; memory: {s['memory_method']}; machine load average {s['load_avg'][0]:.1f} at the start, "
             f"{s['load_avg'][1]:.1f} at the end; {s['wall_s']:.0f} s in all.",
             f"Static einsum = the paper's baseline (dense [T, E, C] masks, fairseq moe branch / DeepSpeed style); "
             f"CF {PAPER_CF:g} = the paper's LM setting (E=512, 0.05 of the tokens per expert, top-2: a waste factor "
             f"of {PAPER_CF:g}); per-expert capacity C = ceil(CF * T * {k} / {E}). Static capacity = the same fixed "
             f"buffers by index, no masks. Memory budget {s['budget_mb']:g} MiB.", "",
             "| batch | tokens | implementation | tokens/s | forward ms | MoE ms | activation peak MiB | "
             "MoE peak MiB | dropped | budget |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        if not r["in_table"]:
            continue
        peak = (f"> {_mib(r['peak_bytes'])} (aborted)" if r["aborted"] else _mib(r["peak_bytes"]))
        lines.append(f"| {r['batch']} | {r['tokens']} | {r['impl']} | "
                     + (f"{r['tokens_per_s']:,.0f} | {r['fwd_ms']:.2f} | {r['moe_ms']:.2f} | " if r["tokens_per_s"]
                        else "- | - | - | ")
                     + f"{peak} | {'-' if r['aborted'] else _mib(r['moe_peak_bytes'])} | "
                       f"{100 * r['dropped_fraction']:.1f}% | {'over' if r['over_budget'] else 'ok'} |")
    lines += ["", "Ratios (dynamic vs each static implementation, same batch): throughput dynamic/static, "
                  "memory static/dynamic (activation peak; MoE peak)", "",
              "| batch | vs | throughput x | activation memory x | MoE memory x |", "|---:|---|---:|---:|---:|"]
    fmt = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"     # noqa: E731
    for e in res["ratios"]["per_batch"]:
        for name, q in e["vs"].items():
            lines.append(f"| {e['batch']} | {name}{' (over budget)' if q['static_over_budget'] else ''} | "
                         f"{fmt(q['throughput'])} | {fmt(q['memory'])} | {fmt(q['moe_memory'])} |")
    lines += ["", f"Largest batch within {s['budget_mb']:g} MiB (doubling from 1, up to {s['max_batch']}):"]
    for name, v in res["largest_batch"].items():
        b = v["batch"]
        m = _row(res, name, b) if b else None
        lines.append(f"  {name}: {'none' if b is None else b}" + (" (= --max-batch)" if v["capped"] else "")
                     + (f", activation peak {_mib(m['peak_bytes'])} MiB" if m else "")
                     + (f", {m['tokens_per_s']:,.0f} tokens/s" if m and m["tokens_per_s"] else ""))
    best = res["ratios"]["best_within_budget"]
    if static in best and dyn in best:
        def at(n):
            cap = res["largest_batch"][n]["capped"] and best[n]["batch"] == res["largest_batch"][n]["batch"]
            return f"{best[n]['tokens_per_s']:,.0f} tokens/s at batch {best[n]['batch']}" + \
                (" (= --max-batch)" if cap else "")
        lines.append(f"Best throughput within the budget: {dyn} {at(dyn)} vs {static} {at(static)}: "
                     f"{res['ratios']['best_throughput_ratio']:.2f}x "
                     f"(paper, LM on 1 node: up to {PAPER['throughput_vs_static']}x vs static, "
                     f"{PAPER['throughput_vs_tutel']}x vs Tutel)")
    d, st = _row(res, dyn, PAPER["memory_batch"]), _row(res, static, PAPER["memory_batch"])
    if d and st:
        paper = (f"(paper, LM at batch 8: {PAPER['activation_gb_static']} GB -> {PAPER['activation_gb_dynamic']} GB, "
                 f"{PAPER['activation_gb_static'] / PAPER['activation_gb_dynamic']:.2f}x, 79.6% less)")
        if st["aborted"]:
            lines.append(f"Activation memory at batch {d['batch']}: static > {_mib(st['peak_bytes'])} MiB (stopped at "
                         f"the abort limit) -> {_mib(d['peak_bytes'])} MiB dynamic {paper}")
        else:
            lines.append(f"Activation memory at batch {d['batch']}: {_mib(st['peak_bytes'])} MiB static -> "
                         f"{_mib(d['peak_bytes'])} MiB dynamic ({st['peak_bytes'] / max(d['peak_bytes'], 1):.2f}x, "
                         f"{100 * (1 - d['peak_bytes'] / st['peak_bytes']):.1f}% less) {paper}")
    lines.append(f"Paper's largest batches: static {PAPER['max_batch_static']}, dynamic {PAPER['max_batch_dynamic']} "
                 f"(8x; 32 GB V100s).")
    lines.append("Check, smallest batch, max |logits - dynamic's|: " + "; ".join(
        f"{n} {c['max_abs_diff']:.1e} ({c['dropped']} of {c['assignments']} dropped)"
        for n, c in res["check"].items() if n != dyn))
    return "\n".join(lines)


def _floats(text: str) -> List[float]:
    return [float(v) for v in text.split(",") if v.strip()] if text else []


def main(argv: Optional[List[str]] = None) -> dict:
    p = argparse.ArgumentParser(prog="megamoe bench inference", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a tiny model and few batches (< 60 s; the test)")
    for name in ("hidden", "heads", "layers", "ffn", "moe_every", "experts", "top_k", "seq_len", "repeat",
                 "max_batch"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=f"override the {name} setting")
    p.add_argument("--batch-sizes", default=None, help="comma list of batch sizes for the table")
    p.add_argument("--memory-budget-mb", type=float, default=None, help="memory budget for the largest batch")
    p.add_argument("--abort-mb", type=float, default=None, help="stop a measured forward once its live bytes pass "
                                                                "this (default 4 x the budget)")
    p.add_argument("--einsum-cf", default=str(PAPER_CF), help="capacity factors of the static einsum baseline "
                                                              "(the first is the baseline of the ratios)")
    p.add_argument("--capacity-cf", default=f"1,2,{PAPER_CF:g}", help="capacity factors of our capacity dispatch")
    p.add_argument("--checkpoint", default=None, help="a `megamoe train` checkpoint: its weights, sizes and gate "
                                                      "instead of a random-init model")
    p.add_argument("--split", default="valid", choices=("valid", "test", "train"))
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = all cores)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    p.add_argument("--output", default=None, metavar="PATH", help="also write the report here")
    args = p.parse_args(argv)
    s = dict(SETTINGS["quick" if args.quick else "default"])
    for name in ("hidden", "heads", "layers", "ffn", "moe_every", "experts", "top_k", "seq_len", "repeat",
                 "max_batch"):
        if getattr(args, name) is not None:
            s[name] = getattr(args, name)
    if args.batch_sizes:
        s["batches"] = sorted({int(v) for v in args.batch_sizes.split(",") if v.strip()})
    if args.memory_budget_mb is not None:
        s["budget_mb"] = args.memory_budget_mb
    if not s["batches"] or min(s["batches"]) < 1 or s["repeat"] < 1 or s["max_batch"] < 1:
        p.error("need batch sizes >= 1, --repeat >= 1 and --max-batch >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    base_cfg = state = None
    if args.checkpoint:
        from ..trace_cli import load_core_checkpoint
        model, base_cfg, margs = load_core_checkpoint(args.checkpoint)
        state = model.state_dict()
        s.update(hidden=margs["hidden"], heads=margs["heads"], layers=margs["layers"], ffn=margs["ffn_hidden"],
                 moe_every=margs["moe_every"], experts=base_cfg.num_experts, top_k=base_cfg.top_k,
                 seq_len=min(s["seq_len"], margs["seq_len"]))
        s["seq_len_model"] = margs["seq_len"]
        base_cfg = base_cfg.replace(dispatch="dropless", min_capacity=0)
    try:
        einsum_cfs, capacity_cfs = _floats(args.einsum_cf), _floats(args.capacity_cf)
    except ValueError:
        p.error("--einsum-cf / --capacity-cf: comma lists of numbers")
    if any(cf <= 0 for cf in einsum_cfs + capacity_cfs) or not einsum_cfs + capacity_cfs:
        p.error("capacity factors must be > 0, and at least one static implementation is needed")
    res = run(s, seed=args.seed, threads=args.threads, device=args.device, einsum_cfs=einsum_cfs,
              capacity_cfs=capacity_cfs, abort_mb=args.abort_mb, split=args.split, base_cfg=base_cfg,
              state_dict=state)
    text = report(res)
    print(text, flush=True)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
