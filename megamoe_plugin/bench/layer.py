"""`megamoe bench layer`: one process, identical inputs, forward+backward time of MoE layer implementations.

Implementations (all compute the same function of the same x, router weight and expert weights):
- ``ours dropless``: MoELayer, dynamic gating (argsort + contiguous groups, no capacity); its expert GEMMs use
  oneDNN's kernel where available (the bank's ``cpu_gemm`` "auto"); ``ours dropless, BLAS GEMMs`` is the same layer with
  torch.mm (the BLAS every other row uses), to show what the kernel choice alone is worth.
- ``ours capacity CF=c``: MoELayer in capacity mode (GShard drop rule, padded per-expert buffers).
- ``megatron-core``: megatron-core's own MoELayer (dropless, alltoall dispatcher, SequentialMLP), built on CPU
  with the plugin's shims (skipped with a note if megatron-core is not installed).
- ``ours dropless, deepseek-v3 router`` / ``megatron-core MoELayer, deepseek-v3 router`` (``--routers``): both
  layers with DeepSeek-V3's router (sigmoid scores, expert bias, 4 groups, scaling 2.5, the sequence-level
  balance loss) instead of softmax top-k; the plugin's from the same megatron-core flags ``--moe-plugin`` reads.
- ``gshard einsum CF=c``: GShard-style static dispatch with a dense [T, E, C] mask and einsums (what fairseq's moe
  branch and DeepSpeed-MoE do), written here for the comparison.
- ``expert floor``: only the experts' own work (fc1 -> gelu -> fc2 forward and backward, written out as GEMMs into
  preallocated buffers, no autograd) on pre-sorted contiguous token groups of exactly the sizes the router
  produced: no gate, no permutation, no combine; on BLAS, and (``expert floor, oneDNN GEMMs``) with the forward
  and input-gradient GEMMs on oneDNN as the layer's CPU kernel runs them; many small experts side by side on CPU
  lanes where the layer's kernel does that. The ratios divide by the faster of the two: nothing that computes the
  layer with these kernels can be faster.
- ``argsort + loop``: the plain reference (softmax top-k, argsort, gather, one autograd fc1 -> gelu -> fc2 per
  expert, weighted index_add), forward and backward.
- ``dense MLP``: the dense MLP with the same FLOPs (T tokens, hidden k*F).
- ``part: gate`` / ``part: permutation`` / ``part: combine``: the layer's work outside the experts, each alone on
  the same inputs (``parts``): where the time above the floor goes.

Routing: ``balanced`` draws each token's k preferred experts uniformly, ``skewed`` from a Zipf(1.2) popularity;
inputs are noise plus the preferred experts' router directions, so the router (a real softmax top-k over
x @ Wg^T) sends the tokens where the draw says. Times are medians over ``--repeat`` rounds after a warm-up, each
round running every implementation once (a shared machine's slow phases then hit all alike);
"page faults / step" is the median of each implementation's minor page faults per call (getrusage): a step that
gets fresh pages from the kernel for its buffers pays for each 4 KiB page, which the preallocated floor never does;
dispatch-buffer bytes are analytic (the token buffers and masks each implementation allocates to move tokens to
experts, not counting the expert activations every implementation shares).
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Callable, Dict, List, Optional

try:
    import resource
except ImportError:          # not on Windows
    resource = None

import torch
import torch.nn.functional as F

from ..cpu_alloc import retain_freed_memory
from ..experts.loop import _lanes_for as lanes_for, _mm_into as mm_into, _run_groups as run_groups, onednn_available
from .layer_inputs import CONFIGS, ROUTERS, make_inputs, route, router_fields
from .ours import megatron_peer, ours
from .report import emit_report
from ..progress import Progress

__all__ = ["CONFIGS", "make_inputs", "route", "emit_report", "ours", "main"]

# --- implementations: each returns a callable running one forward+backward, and its dispatch-buffer bytes --------
def megatron(x, wg, w1, w2, k, router=None):
    E, H, F_ = w1.shape
    step, layer = megatron_peer(x, wg, w1, w2, k, router=router)
    T = x.shape[0]
    # routing map [T, E] bool + probs [T, E] fp32, permuted tokens [T*k, H] out and back
    nbytes = T * E * (1 + 4) + 2 * T * k * H * 4
    return step, nbytes, layer


def _autograd_step(x, weights, make_forward):
    """Leaf copies of ``x`` and ``weights``, the forward ``make_forward(*weight copies)`` returns, and a callable
    running one forward+backward of it (gradients reset each time): (step, forward)."""
    leaves = [t.clone().requires_grad_() for t in weights]
    xin = x.clone().requires_grad_()
    grad = torch.ones_like(x)
    forward = make_forward(*leaves)

    def step():
        for p in (*leaves, xin):
            p.grad = None
        forward(xin).backward(grad)

    return step, forward


def gshard_einsum(x, wg, w1, w2, k, cf):
    E, H, F_ = w1.shape
    T = x.shape[0]
    C = max(int(math.ceil(cf * T * k / E)), 1)
    step, forward = _autograd_step(x, (wg, w1, w2), lambda wg_, w1_, w2_: _gshard_forward(wg_, w1_, w2_, k, T, E, C))
    nbytes = 2 * T * E * C * 4 + 2 * E * C * H * 4     # combine + dispatch masks, expert in/out buffers
    return step, nbytes, forward


def _gshard_forward(wg_, w1_, w2_, k, T, E, C):
    def forward(xv):
        # fairseq moe-branch / GShard top-k gating: masks [T, E], locations by cumsum, one-hot slots, [T, E, C]
        probs = torch.softmax(xv @ wg_.t(), -1)
        top = torch.topk(probs, k, -1)
        gates = top.values / top.values.sum(-1, keepdim=True) if k > 1 else top.values
        combine = xv.new_zeros(T, E, C)
        taken = torch.zeros(E, dtype=torch.long)
        for j in range(k):                               # first choices claim slots before second choices
            mask = F.one_hot(top.indices[:, j], E)       # [T, E]
            loc = torch.cumsum(mask, 0) - 1 + taken
            taken = taken + mask.sum(0)
            mask = mask * (loc < C)
            loc_s = (loc * mask).sum(1)                  # [T]
            slot = F.one_hot(loc_s, C).to(xv.dtype)      # [T, C]
            combine = combine + (gates[:, j, None] * mask)[:, :, None] * slot[:, None, :]
        dispatch = (combine > 0).to(xv.dtype)
        expert_in = torch.einsum("tec,th->ech", dispatch, xv)
        h = F.gelu(torch.einsum("ech,ehf->ecf", expert_in, w1_))
        out = torch.einsum("ecf,efh->ech", h, w2_)
        return torch.einsum("tec,ech->th", combine, out)

    return forward


class ExpertFloor:
    """The experts' forward and backward written out as GEMMs into preallocated buffers (``expert_floor``):
    ``floor()`` fills ``y``, ``dx``, ``dw1``, ``dw2`` for the rows ``xs`` (sorted by expert, ``counts`` per expert)
    with the output gradient ``dy`` (ones). ``onednn``: the forward and input-gradient GEMMs on oneDNN's linear
    kernel (the mix the layer's CPU kernel uses; the weight gradients stay on BLAS), else every GEMM on BLAS. Small
    experts run side by side on CPU lanes when the layer's kernel would (``experts/loop.py``)."""

    def __init__(self, xs, counts, w1, w2, onednn: bool = False):
        n, (E, H, F_) = xs.shape[0], w1.shape
        self.xs, self.w1, self.w2, self.onednn = xs, w1, w2, onednn
        self.h, self.a, self.da = (torch.empty(n, F_) for _ in range(3))
        self.y, self.dx, self.dy = torch.empty(n, H), torch.empty(n, H), torch.ones(n, H)
        self.dw1, self.dw2 = torch.zeros_like(w1), torch.zeros_like(w2)
        ends = torch.tensor(counts).cumsum(0).tolist()
        self.spans = [(e, ends[e] - counts[e], ends[e]) for e in range(E) if counts[e]]
        self.lanes = lanes_for(xs, self.spans, w1, 0)

    def _mm(self, a, b, out):
        """out = a @ b through the layer kernel's own GEMM call (oneDNN gets the weight as the view b.t(); the
        weights change every step, so neither may keep a transposed copy)."""
        mm_into(a, b, out, self.onednn)

    def __call__(self) -> None:
        w1, w2, dy = self.w1, self.w2, self.dy

        def expert(e, i, j):
            xe, he, ae, dae = self.xs[i:j], self.h[i:j], self.a[i:j], self.da[i:j]
            self._mm(xe, w1[e], he)
            ae.copy_(F.gelu(he))
            self._mm(ae, w2[e], self.y[i:j])
            torch.mm(ae.t(), dy[i:j], out=self.dw2[e])
            self._mm(dy[i:j], w2[e].t(), dae)
            dh = torch.ops.aten.gelu_backward(dae, he)
            torch.mm(xe.t(), dh, out=self.dw1[e])
            self._mm(dh, w1[e].t(), self.dx[i:j])

        # many small experts run side by side on CPU lanes, one thread each, by the layer's own rule
        run_groups(expert, self.spans, self.lanes)


def onednn_floor_available() -> bool:
    return onednn_available()


def expert_floor(x, wg, w1, w2, k, onednn: bool = False):
    """The floor no layer can beat: the experts' own work on pre-sorted contiguous token groups of exactly the
    router's sizes, with no autograd and no allocation (``ExpertFloor``): no gate, no permutation, no combine.
    The benchmark times it on BLAS and on the oneDNN mix and takes the faster as the floor."""
    E = w1.shape[0]
    ids, _ = route(x, wg, k)
    counts = torch.bincount(ids.reshape(-1), minlength=E).tolist()
    xs = x[torch.argsort(ids.reshape(-1), stable=True) // k].contiguous()
    return ExpertFloor(xs, counts, w1, w2, onednn), 0, counts


def argsort_loop(x, wg, w1, w2, k):
    """The plain reference a user writes: softmax top-k router, argsort of the expert ids, gather, one
    fc1 -> gelu -> fc2 per expert under autograd, weighted scatter-add back; forward and backward of all of it."""
    E, H, F_ = w1.shape
    T = x.shape[0]
    step, forward = _autograd_step(x, (wg, w1, w2), lambda wg_, w1_, w2_: _loop_forward(wg_, w1_, w2_, k, T, E, H))
    return step, T * k * H * 4 * 2, forward


def _loop_forward(wg_, w1_, w2_, k, T, E, H):
    def forward(xv):
        probs = torch.softmax(xv @ wg_.t(), -1)
        top = torch.topk(probs, k, -1)
        w = top.values / top.values.sum(-1, keepdim=True) if k > 1 else top.values
        flat = top.indices.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=E).tolist()
        xs = xv[order // k]
        outs = [F.gelu(part @ w1_[e]) @ w2_[e] for e, part in enumerate(xs.split(counts)) if part.shape[0]]
        ys = torch.cat(outs) * w.reshape(-1)[order, None]
        return torch.zeros(T, H, dtype=ys.dtype).index_add(0, order // k, ys)

    return forward


def parts(x, wg, w1, w2, k) -> Dict[str, Callable[[], None]]:
    """The layer's work outside the experts, each piece alone on the same inputs (forward and backward): where the
    time above the expert floor goes. ``gate``: router logits, softmax, top-k and weights; ``permutation``: argsort
    of the expert ids and the gather of the rows in expert order (its backward scatters the gradient back);
    ``combine``: the weighted sum of each token's k expert outputs back into token order. (One process: no
    exchange.)"""
    E, H, F_ = w1.shape
    T = x.shape[0]
    ids, weights = route(x, wg, k)
    order = torch.argsort(ids.reshape(-1), stable=True)
    wg_, xin = wg.clone().requires_grad_(), x.clone().requires_grad_()
    ys = torch.randn(T * k, H).requires_grad_()
    wsorted = weights.reshape(-1)[order, None].contiguous()
    gk, gx = torch.ones(T, k), torch.ones(T * k, H)
    gout = torch.ones(T, H)

    def gate():
        wg_.grad = xin.grad = None
        probs = torch.softmax(xin @ wg_.t(), -1)
        top = torch.topk(probs, k, -1)
        w = top.values / top.values.sum(-1, keepdim=True) if k > 1 else top.values
        w.backward(gk)

    def permutation():
        xin.grad = None
        o = torch.argsort(ids.reshape(-1), stable=True)
        xin[o // k].backward(gx)

    def combine():
        ys.grad = None
        torch.zeros(T, H).index_add(0, order // k, ys * wsorted).backward(gout)

    return {"part: gate": gate, "part: permutation": permutation, "part: combine": combine}


def gate_step(layer, x) -> Callable[[], None]:
    """Our layer's gate alone, forward and backward (combine weights and aux losses): the router's own cost."""
    gate = layer.gate
    xin = x.clone().requires_grad_()

    def step():
        gate.weight.grad = xin.grad = None
        r = gate(xin)
        (r.weights.sum() + r.aux_loss()).backward()
    return step


def dense_mlp(x, k, F_):
    T, H = x.shape
    g = torch.Generator().manual_seed(1)
    a = (torch.randn(H, k * F_, generator=g) * 0.02).requires_grad_()
    b = (torch.randn(k * F_, H, generator=g) * 0.02).requires_grad_()
    xin = x.clone().requires_grad_()
    grad = torch.ones_like(x)

    def step():
        for p in (a, b, xin):
            p.grad = None
        (F.gelu(xin @ a) @ b).backward(grad)

    return step, 0


def _minor_faults() -> int:
    """Minor page faults of this process so far (0 where getrusage is missing): a step that takes fresh pages
    from the kernel for its buffers pays one fault per 4 KiB page, about 0.1-0.2 s per GiB on these machines."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource is not None else 0


def time_interleaved(fns: Dict[str, Callable[[], None]], repeat: int, progress=None, what: str = "",
                     faults: Optional[Dict[str, float]] = None) -> Dict[str, float]:
    """Median time of each callable; rounds run every implementation once, so a slow phase of a shared
    machine hits all of them alike instead of one. ``progress`` (a progress.Progress) steps once per round,
    the warm-up included. ``faults``: filled with the median minor page faults of each callable's call."""
    for fn in fns.values():
        fn()
    if progress is not None:
        progress.step(f"{what} warm-up")
    times = {name: [] for name in fns}
    paged = {name: [] for name in fns}
    for r in range(repeat):
        for name, fn in fns.items():
            f0 = _minor_faults()
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
            paged[name].append(_minor_faults() - f0)
        if progress is not None:
            progress.step(f"{what} round {r + 1}/{repeat}")
    if faults is not None:
        faults.update({name: statistics.median(v) for name, v in paged.items()})
    return {name: statistics.median(ts) for name, ts in times.items()}


def _megatron_rows(impls, notes, x, wg, w1, w2, k, y_ours, label, router=None, check=True):
    """megatron-core's layer (with ``router``'s fields) as the row ``label``, checked to compute ``y_ours``."""
    T, H = x.shape
    try:
        step, nbytes, mlayer = megatron(x, wg, w1, w2, k, router)
        if check:   # the peer must compute the same function on the same inputs
            with torch.no_grad():
                y_meg = mlayer(x.view(T, 1, H))[0].view(T, H)
            err = float((y_meg - y_ours).abs().max() / y_ours.abs().max())
            if err > 1e-3:
                raise AssertionError(f"{label}: megatron-core and ours disagree (rel. err {err:.2e})")
        impls[label] = (step, nbytes)
    except ImportError as e:
        notes[label] = f"skipped: {e}"


def run_config(name: str, routing: str, repeat: int, skip_gshard: bool = False, skip_megatron: bool = False,
               check: bool = True, progress=None, routers=("softmax",)) -> List[dict]:
    c = CONFIGS[name]
    H, F_, E, k, T = c["H"], c["F"], c["E"], c["k"], c["T"]
    x, wg, w1, w2 = make_inputs(H, F_, E, k, T, routing)
    impls, notes = {}, {}

    floor_step, _, counts = expert_floor(x, wg, w1, w2, k)
    impls["expert floor"] = (floor_step, 0)
    if onednn_floor_available():
        impls["expert floor, oneDNN GEMMs"] = (expert_floor(x, wg, w1, w2, k, onednn=True)[0], 0)
    step, nbytes, _ = argsort_loop(x, wg, w1, w2, k)
    impls["argsort + loop"] = (step, nbytes)
    step, nbytes, layer = ours(x, wg, w1, w2, k)
    impls["ours dropless"] = (step, nbytes)
    with torch.no_grad():
        y_ours = layer(x)
    step, nbytes, _ = ours(x, wg, w1, w2, k, cpu_gemm="blas")
    impls["ours dropless, BLAS GEMMs"] = (step, nbytes)
    for cf in (1.0, 2.0):
        step, nbytes, _ = ours(x, wg, w1, w2, k, "capacity", cf)
        impls[f"ours capacity CF={cf:g}"] = (step, nbytes)
    if not skip_megatron:
        _megatron_rows(impls, notes, x, wg, w1, w2, k, y_ours, "megatron-core MoELayer", check=check)
    if len(routers) > 1:
        impls["part: our gate, softmax router"] = (gate_step(layer, x), 0)
    for router in routers:
        if router == "softmax":
            continue
        fields = router_fields(router, E, k)
        step, nbytes, layer = ours(x, wg, w1, w2, k, router=fields)
        impls[f"ours dropless, {router} router"] = (step, nbytes)
        impls[f"part: our gate, {router} router"] = (gate_step(layer, x), 0)
        if not skip_megatron:
            with torch.no_grad():
                y_router = layer(x)
            _megatron_rows(impls, notes, x, wg, w1, w2, k, y_router, f"megatron-core MoELayer, {router} router",
                           fields, check)
    if not skip_gshard:
        for cf in (1.0, 2.0):
            step, nbytes, fwd = gshard_einsum(x, wg, w1, w2, k, cf)
            impls[f"gshard einsum CF={cf:g}"] = (step, nbytes)
    step, _ = dense_mlp(x, k, F_)
    impls["dense MLP (same FLOPs)"] = (step, 0)
    for part, fn in parts(x, wg, w1, w2, k).items():
        impls[part] = (fn, 0)
    faults: Dict[str, float] = {}
    times = time_interleaved({n: f for n, (f, _) in impls.items()}, repeat, progress, f"config {name} {routing}",
                             faults)
    skew = max(counts) / (sum(counts) / len(counts))
    rows = [dict(config=name, routing=routing, impl=n, time=times[n], bytes=b, note="", max_over_mean=skew,
                 faults=faults[n]) for n, (_, b) in impls.items()]
    rows += [dict(config=name, routing=routing, impl=n, time=float("nan"), bytes=0, note=v, max_over_mean=skew,
                  faults=float("nan")) for n, v in notes.items()]
    return rows


def format_table(rows: List[dict]) -> str:
    out = ["| config | routing | implementation | time (ms) | / expert floor | / argsort + loop | megatron / this | "
           "dispatch buffers | page faults / step |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for (cfg, routing) in dict.fromkeys((r["config"], r["routing"]) for r in rows):
        group = [r for r in rows if r["config"] == cfg and r["routing"] == routing]
        floor = min(r["time"] for r in group if r["impl"].startswith("expert floor"))
        loop = next(r["time"] for r in group if r["impl"] == "argsort + loop")
        meg = next((r["time"] for r in group if r["impl"].startswith("megatron")), float("nan"))
        c = CONFIGS[cfg]
        label = f"{cfg}: H={c['H']} F={c['F']} E={c['E']} k={c['k']} T={c['T']}"
        for r in group:
            b = r["bytes"]
            size = "-" if not b else (f"{b / 2**20:.1f} MiB" if b < 2**30 else f"{b / 2**30:.2f} GiB")
            out.append(f"| {label} | {routing} (max/mean {r['max_over_mean']:.2f}) | {r['impl']} | "
                       f"{r['time'] * 1e3:.1f} | {r['time'] / floor:.3f} | {r['time'] / loop:.3f} | "
                       f"{meg / r['time']:.3f} | {size} | {_count(r.get('faults'))} |"
                       + (f" {r['note']}" if r["note"] else ""))
    return "\n".join(out)


def _count(n: Optional[float]) -> str:
    return "-" if n is None or math.isnan(n) else f"{n:,.0f}"


def targets(rows: List[dict]) -> List[str]:
    """The issue's targets, each checked on this run's numbers."""
    lines = []
    for (cfg, routing) in dict.fromkeys((r["config"], r["routing"]) for r in rows):
        g = {r["impl"]: r for r in rows if r["config"] == cfg and r["routing"] == routing}
        o = g["ours dropless"]
        fl = min((r for n, r in g.items() if n.startswith("expert floor")), key=lambda r: r["time"])
        res = [f"floor ratio {o['time'] / fl['time']:.3f} (<=1.05: {'met' if o['time'] <= 1.05 * fl['time'] else 'MISSED'})"]
        if "megatron-core MoELayer" in g and not math.isnan(g["megatron-core MoELayer"]["time"]):
            s = g["megatron-core MoELayer"]["time"] / o["time"]
            res.append(f"vs megatron {s:.2f}x (>=1.10: {'met' if s >= 1.10 else 'MISSED'})")
        if "gshard einsum CF=1" in g:
            s = g["gshard einsum CF=1"]["time"] / o["time"]
            m = g["gshard einsum CF=1"]["bytes"] / o["bytes"]
            res.append(f"vs static CF=1 {s:.1f}x (>=3: {'met' if s >= 3 else 'MISSED'}), buffers {m:.1f}x smaller "
                       f"(>=8: {'met' if m >= 8 else 'MISSED'})")
        d = g["dense MLP (same FLOPs)"]["time"] / o["time"]
        res.append(f"FLOP rate vs dense {100 * d:.0f}%")
        if "argsort + loop" in g:
            res.append(f"vs argsort + loop {g['argsort + loop']['time'] / o['time']:.2f}x")
        for n, r in g.items():
            if n.startswith("ours dropless, ") and n.endswith(" router"):
                router = n[len("ours dropless, "):-len(" router")]
                cost = r["time"] / o["time"]
                res.append(f"{router} router / softmax top-k {cost:.3f} (<=1.02: {'met' if cost <= 1.02 else 'MISSED'})")
                gates = g.get(f"part: our gate, {router} router"), g.get("part: our gate, softmax router")
                if all(gates):
                    extra = (gates[0]["time"] - gates[1]["time"]) / o["time"]
                    res.append(f"its gate alone {gates[0]['time'] * 1e3:.1f} ms vs softmax's {gates[1]['time'] * 1e3:.1f}"
                               f" ms: {100 * extra:+.1f}% of the layer")
                peer = g.get(f"megatron-core MoELayer, {router} router")
                if peer is not None and not math.isnan(peer["time"]):
                    s = peer["time"] / r["time"]
                    res.append(f"vs megatron with the {router} router {s:.2f}x (>=1.10: {'met' if s >= 1.10 else 'MISSED'})")
        above = o["time"] - fl["time"]
        pieces = ", ".join(f"{n[len('part: '):]} {g[n]['time'] * 1e3:.1f}" for n in g if n.startswith("part: "))
        res.append(f"ours - floor {above * 1e3:.1f} ms (alone: {pieces} ms)")
        lines.append(f"config {cfg} {routing}: " + "; ".join(res))
    return lines


def main(argv: Optional[List[str]] = None) -> List[dict]:
    p = argparse.ArgumentParser(prog="megamoe bench layer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="1,2,3", help="comma list of: " + ", ".join(CONFIGS))
    p.add_argument("--routing", default="balanced,skewed")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-gshard", action="store_true", help="skip the dense-mask einsum (slow, GiB of masks)")
    p.add_argument("--skip-megatron", action="store_true")
    p.add_argument("--routers", default="softmax,deepseek-v3",
                   help="routers to time, comma list of: " + ", ".join(ROUTERS) + " (softmax is always the "
                        "baseline; deepseek-v3: sigmoid, expert bias, 4 groups, scaling 2.5, seq aux loss)")
    p.add_argument("--output", help="also write the markdown table here")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: the GPU comparison against megatron-core's SequentialMLP / GroupedMLP / TE "
                        "(bench/layer_device.py)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"), help="with --device cuda")
    p.add_argument("--keep-denormals", action="store_true",
                   help="leave denormal floats as they are (default: flushed to zero for every implementation; on "
                        "CPUs whose denormal arithmetic is slow, a softmax router's gradients of near-zero "
                        "probabilities make its GEMMs many times slower, whatever the layer)")
    p.add_argument("--no-retain-freed-memory", action="store_true",
                   help="leave glibc's malloc thresholds alone (every implementation then page-faults its large "
                        "buffers in every step)")
    args = p.parse_args(argv)
    for name in args.configs.split(","):
        if name not in CONFIGS:
            p.error(f"--configs: unknown config {name!r}; known: {', '.join(CONFIGS)}")
    routers = [r for r in args.routers.split(",") if r]
    for router in routers:
        if router not in ROUTERS:
            p.error(f"--routers: unknown router {router!r}; known: {', '.join(ROUTERS)}")
    if args.device == "cuda":
        from .layer_device import main as device_main
        return device_main(args.configs.split(","), args.routing.split(","), args.repeat, args.dtype, args.output)
    if args.dtype != "fp32":
        p.error("--dtype: the CPU benchmark is fp32 (bf16 comparisons are the --device cuda run)")
    torch.set_num_threads(args.threads)
    flushed = not args.keep_denormals and torch.set_flush_denormal(True)
    retained = False if args.no_retain_freed_memory else retain_freed_memory()
    rows = []
    configs, routings = args.configs.split(","), args.routing.split(",")
    for routing in routings:
        if routing not in ("balanced", "skewed"):
            p.error(f"--routing: {routing!r} is not balanced or skewed")
    progress = Progress("bench layer", len(configs) * len(routings) * (args.repeat + 1))
    try:
        for name in configs:
            for routing in routings:
                rows += run_config(name, routing, args.repeat, args.skip_gshard, args.skip_megatron,
                                   progress=progress, routers=routers)
    finally:
        if flushed:
            torch.set_flush_denormal(False)          # torch's default, for whatever runs next in this process
    table = format_table(rows)
    summary = "\n".join(targets(rows))
    header = (f"CPU fp32, {args.threads} thread(s), median of {args.repeat} interleaved forward+backward rounds, one "
              f"process, glibc malloc {'retaining freed memory' if retained else 'default'}, denormals "
              f"{'flushed to zero' if flushed else 'kept'} (same for every implementation). Measured on this machine "
              f"(torch {torch.__version__}).")
    emit_report([header, table, summary], args.output, separators=["\n", "\n\n"])
    return rows
