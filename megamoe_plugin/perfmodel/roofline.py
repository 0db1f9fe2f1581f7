"""DDL-Roofline of FasterMoE (paper 003 §3.3, Eqs. 3-6, Fig. 5) with the §4.1 shadowing and §4.2 smart schedule.

Owns: the roofline formulas (Eq. 3 ``r_cc``, Eq. 4 ``p_bar``, Eq. 5 ``p_ideal``, Eq. 6 ``p_semi_ideal``), the
(R_CC, P-bar) points of the parallel strategies of one MoE MLP layer (``roofline_points``), the smart-schedule
latency of a layer (``smart_schedule_time``, through ``schedule.predict_layer_schedule``) and the Fig. 5 style plot
(``plot_roofline``). Algorithm 1's expert shadowing lives in ``placement.shadow`` (``shadow_search``, imported here
under its old name ``select_shadow_experts``: (counts, latency function) -> (shadowed experts, latency)).

**Every number here is a model prediction**, not a measurement: latencies come from the cost model
(``CostModel`` / ``Network``: Eq. 1 computation, Eq. 2 topology-aware communication) fed with the numbers of a
``HardwareProfile`` (its ``source`` field says where they come from) and the routing counts given. The peak P_w of
Eqs. 5-6 is the profile's ``gemm_tflops``.

Per point, for one training iteration (forward + backward) of one MoE MLP layer:

    Lat_comp  computation of the iteration on the slowest worker (3 GEMM rounds: 1 forward + 2 backward)
    Lat_comm  communication of the iteration
    Lat_e2e   end-to-end latency (synchronous: Lat_comp + Lat_comm; overlapped: less, never below the max)
    R_CC = Lat_comp / Lat_comm                                                      (Eq. 3)
    P-bar = 12 alpha H^2 sum_w B_w / (N Lat_e2e)                                    (Eq. 4)

where sum_w B_w is the number of (token, expert) assignments in ``counts`` (so 12 alpha H^2 = 3 x 4 x H x ffn FLOPs
per assignment: every strategy does the same useful work) and N the number of workers. With these totals
P-bar <= P_w min(1, R_CC) (Eq. 5) always holds, and P-bar <= P_w R/(R+1) (Eq. 6) for every synchronous point.

The strategies (labels as in the returned points):

``data parallel`` / ``data parallel (overlap)``
    The whole layer (E experts, 2 E H ffn parameters; the paper's 2 N alpha H^2 with E = N) is replicated; each
    worker runs its own tokens locally (no all-to-all), the gradients are ring all-reduced over all N workers.
    Synchronous: Lat_e2e = Lat_comp + Lat_comm. Overlap variant (§3.3: "the all-reduce may be overlapped with
    backward computation"): Lat_e2e = Lat_fwd + max(Lat_bwd, Lat_comm).
``ZeRO-1`` / ``ZeRO-2`` / ``ZeRO-3`` (the data-parallel baselines of §5.4, Fig. 10)
    Data parallelism over the same replicated layer with DeepSpeed's ZeRO stages (ring collectives of the layer's
    parameter bytes S over all N workers; a ring reduce-scatter or all-gather is half a ring all-reduce).
    Stage 1 (optimizer states partitioned): the gradients are reduced and the updated parameters gathered, the
    traffic of one all-reduce, after the backward: Lat_e2e = Lat_comp + AR(S). Stage 2 (+ gradients partitioned):
    the reduce-scatter runs during the backward, the all-gather of the updated parameters after it:
    Lat_fwd + max(Lat_bwd, AR/2) + AR/2. Stage 3 (+ parameters partitioned): the parameters are all-gathered
    before the forward and again before the backward, the gradients reduce-scattered during the backward:
    AR/2 + Lat_fwd + AR/2 + max(Lat_bwd, AR/2) (no prefetch across layers: one layer is modelled).
``model parallel``
    Every expert is split over the N workers (tensor parallelism): each does 1/N of every assignment's FLOPs, so
    no load imbalance; 2 all-reduces (one forward, one backward) of the embeddings of the tokens, B x H elements
    with B = assignments / top_k (the combine is linear, so it is done before the all-reduce). Synchronous only.
``expert parallel``
    FastMoE-style: experts in contiguous blocks, ``CostModel.layer_time`` of the counts, i.e.
    Lat_e2e = 3 Lat_comp,fwd + 4 Lat_comm,fwd with the load imbalance of ``counts``.
``+ shadowing``
    Algorithm 1 (§4.1) on the counts: hot experts in descending order of load are replicated on every worker (their
    tokens are computed where they are), kept while the predicted latency keeps dropping. The latency is
    ``CostModel.shadow_layer_time``: Eq. 8 generalised to the topology, i.e. the new compute + the all-to-all of the
    remaining traffic + per shadowed expert a broadcast of its parameters and a reduce of its gradients over the
    ring of all workers (the shadowing traffic counts as communication in R_CC). Synchronous.
``+ smart schedule``
    §4.2 asynchronous fine-grained schedule: the ranks form n groups, the all-to-all becomes n steps of grouped
    pairwise exchange S_j / compute C_j / return R_j, run on a communication and a computation stream (Fig. 8b);
    ``schedule.predict_layer_schedule`` times that timeline op by op (forward with C, backward with 2C) from the
    per-step traffic on the network. R_CC keeps the coarse Lat_comp / Lat_comm of ``expert parallel``; only
    Lat_e2e changes. The first S and the last R cannot overlap, and the n pairwise steps can be slower than one
    concurrent all-to-all, so the gain shrinks when communication dominates (§4.2: "the optimization would have
    little effect"); the prediction is not clamped, it may even be slower than the synchronous point.
    Groups: the profile's nodes when the workers span several whole nodes (FasterMoE's "closely connected workers
    in the same group"), else one worker per group; ``smart_groups`` overrides.
``FasterMoE (shadowing + smart)``
    Both: Algorithm 1 run with the latency of the schedule in use (the smart-scheduled layer plus the shadowing
    broadcast/reduce, which is not overlapped), so it is never slower than ``+ smart schedule`` alone; the experts
    it shadows may differ from those of ``+ shadowing`` (chosen for the synchronous latency).

``counts`` is [P, E] (one forward of one layer: tokens from source rank p to expert e) or [..., P, E] (e.g. a
routing trace's [S, L, P, E]): then every [P, E] slice is one layer-iteration and the latencies and FLOPs are summed
over them before R_CC and P-bar are formed (the throughput of the whole trace).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from ..placement.shadow import shadow_search as select_shadow_experts
from .schedule import consecutive_groups, predict_layer_schedule
from .simulate import contiguous_placement, remap_counts

__all__ = ["r_cc", "mlp_flops", "p_bar", "p_ideal", "p_semi_ideal", "RooflinePoint", "roofline_points",
           "select_shadow_experts", "smart_schedule_time",
           "synthetic_counts", "plot_roofline", "format_points", "LABELS"]

LABELS = {
    "dp": "data parallel",
    "dp_overlap": "data parallel (overlap)",
    "zero1": "data parallel, ZeRO-1",
    "zero2": "data parallel, ZeRO-2",
    "zero3": "data parallel, ZeRO-3",
    "mp": "model parallel",
    "ep": "expert parallel",
    "shadow": "expert parallel + shadowing",
    "smart": "expert parallel + smart schedule",
    "fastermoe": "FasterMoE (shadowing + smart)",
}


# --- Eqs. 3-6 -------------------------------------------------------------------------------------------------------
def r_cc(lat_comp: float, lat_comm: float) -> float:
    """Eq. 3: R_CC = Lat_comp / Lat_comm (inf without communication)."""
    if lat_comm <= 0:
        return math.inf if lat_comp > 0 else 0.0
    return lat_comp / lat_comm


def mlp_flops(hidden: int, ffn: Optional[int] = None, tokens: float = 0.0, alpha: Optional[float] = None) -> float:
    """FLOPs of one training iteration (forward + backward) of an MoE MLP layer over ``tokens`` assignments:
    12 alpha H^2 sum_w B_w = 12 H ffn B (ffn = alpha H; 3 GEMM rounds of 4 B H ffn)."""
    if ffn is None:
        if alpha is None:
            raise ValueError("give ffn or alpha")
        ffn = alpha * hidden
    return 12.0 * hidden * ffn * float(tokens)


def p_bar(total_flops: Optional[float], num_workers: int, lat_e2e: float, *, hidden: Optional[int] = None,
          alpha: Optional[float] = None, tokens: Optional[float] = None) -> float:
    """Eq. 4: P-bar = 12 alpha H^2 sum_w B_w / (N Lat_e2e) in FLOP/s. Give the FLOPs, or (hidden, alpha, tokens =
    sum_w B_w) and total_flops=None."""
    if total_flops is None:
        if hidden is None or alpha is None or tokens is None:
            raise ValueError("give total_flops, or hidden, alpha and tokens")
        total_flops = mlp_flops(hidden, alpha=alpha, tokens=tokens)
    if lat_e2e <= 0:
        raise ValueError("lat_e2e must be positive")
    return total_flops / (num_workers * lat_e2e)


def p_ideal(peak: float, rcc: float) -> float:
    """Eq. 5: P_w min{1, R_CC} (communication and computation fully overlapped)."""
    return peak * min(1.0, rcc)


def p_semi_ideal(peak: float, rcc: float) -> float:
    """Eq. 6: P_w R_CC / (R_CC + 1) (full utilisation, computation and communication one after the other)."""
    if math.isinf(rcc):
        return peak
    return peak * rcc / (rcc + 1.0)


# --- points ---------------------------------------------------------------------------------------------------------
@dataclass
class RooflinePoint:
    """One strategy on the DDL-Roofline. Latencies in seconds, flops in FLOPs, peak in FLOP/s; all predicted."""
    label: str
    lat_comp: float
    lat_comm: float
    lat_e2e: float
    flops: float
    workers: int
    peak: float
    detail: Dict[str, float] = field(default_factory=dict)
    source: str = "model prediction"

    @property
    def r_cc(self) -> float:
        return r_cc(self.lat_comp, self.lat_comm)

    @property
    def p_bar(self) -> float:
        return p_bar(self.flops, self.workers, self.lat_e2e) if self.lat_e2e > 0 else 0.0

    @property
    def ideal(self) -> float:
        return p_ideal(self.peak, self.r_cc)

    @property
    def semi_ideal(self) -> float:
        return p_semi_ideal(self.peak, self.r_cc)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(r_cc=self.r_cc, p_bar=self.p_bar, p_ideal=self.ideal, p_semi_ideal=self.semi_ideal)
        return d


def _groups(world_size: int, gpus_per_node: int, smart_groups: Optional[int]) -> List[List[int]]:
    """The smart schedule's groups of consecutive ranks: ``smart_groups`` of them, by default one per node when the
    workers span several whole nodes, else one per worker."""
    if smart_groups is None:
        nodes = world_size // gpus_per_node if gpus_per_node and world_size % gpus_per_node == 0 else 1
        smart_groups = nodes if nodes > 1 else world_size
    return consecutive_groups(world_size, smart_groups)


def smart_schedule_time(cost, counts: torch.Tensor, groups: Sequence[Sequence[int]], placement=None,
                        shadowed: Sequence[int] = ()) -> float:
    """§4.2 smart schedule of one layer-iteration (forward + backward), without the shadowing broadcast/reduce:
    the two-stream timeline of ``schedule.predict_layer_schedule`` over ``groups``, fed with the [P, P] rank
    tokens of the layer: ``CostModel.route`` of the non-shadowed experts, plus the ``shadowed`` experts' tokens
    computed where they are (as ``CostModel.shadow_layer_time``)."""
    c = torch.as_tensor(counts).to(torch.float64)
    if shadowed:
        local = c[:, list(shadowed)].sum(1)
        c = c.clone()
        c[:, list(shadowed)] = 0.0
        tokens = cost.route(c, placement) + torch.diag(local)
    else:
        tokens = cost.route(c, placement)
    return predict_layer_schedule(tokens, groups, cost)["smart"]


def synthetic_counts(world_size: int, num_experts: int, tokens_per_rank: int, skew: float = 0.0) -> torch.Tensor:
    """[W, E] counts: every rank sends ``tokens_per_rank`` assignments, expert e's share proportional to
    (e+1)^-skew (Zipf; skew 0 = uniform), rounded so that each row sums to tokens_per_rank exactly."""
    w = torch.arange(1, num_experts + 1, dtype=torch.float64).pow(-float(skew))
    share = w / w.sum() * tokens_per_rank
    row = share.floor()
    rest = int(tokens_per_rank - row.sum())
    if rest > 0:
        row[torch.argsort(share - row, descending=True, stable=True)[:rest]] += 1
    return row.to(torch.long).repeat(world_size, 1)


def roofline_points(profile, shape, counts: torch.Tensor, *, world_size: Optional[int] = None, top_k: int = 1,
                    smart_groups: Optional[int] = None, cost_model=None, network=None,
                    include: Sequence[str] = tuple(LABELS)) -> List[RooflinePoint]:
    """(R_CC, P-bar) points of the strategies in ``include`` (keys of ``LABELS``) for ``counts`` [..., P, E] on
    ``profile`` (see the module docstring). ``world_size`` W != P remaps the source rows (rank w uses row w % P,
    as ``simulate_trace``). ``cost_model`` / ``network`` override the profile's. All values are predictions."""

    counts = torch.as_tensor(counts)
    if counts.dim() < 2:
        raise ValueError("counts must be [..., P, E]")
    P, E = counts.shape[-2:]
    if E != shape.num_experts:
        raise ValueError(f"counts have {E} experts, the layer shape {shape.num_experts}")
    W = world_size or P
    counts = remap_counts(counts, W)
    contiguous_placement(E, W)                      # validates E % W
    unknown = set(include) - set(LABELS)
    if unknown:
        raise ValueError(f"unknown strategies {sorted(unknown)}; known: {list(LABELS)}")
    cost = cost_model if cost_model is not None else profile.cost_model(shape, W)
    net = network if network is not None else cost.network
    peak = float(profile.gemm_tflops) * 1e12
    groups = _groups(W, getattr(profile, "gpus_per_node", W), smart_groups) if (
        "smart" in include or "fastermoe" in include) else None
    src = f"model prediction ({getattr(profile, 'name', 'profile')})"

    acc = {k: [0.0, 0.0, 0.0] for k in include}     # comp, comm, e2e summed over the [P, E] slices
    detail = {k: {} for k in include}
    flops = 0.0
    dp_bytes = E * shape.expert_param_bytes
    dp_keys = {"dp", "dp_overlap", "zero1", "zero2", "zero3"} & set(include)
    dp_comm = net.allreduce_time(dp_bytes, list(range(W))) if dp_keys else 0.0
    slices = counts.reshape(-1, W, E)
    for c in slices:
        c = c.double()
        assignments = float(c.sum())
        flops += mlp_flops(shape.hidden, shape.ffn, assignments)

        def add(key, comp, comm, e2e, **extra):
            a = acc[key]
            a[0] += comp; a[1] += comm; a[2] += e2e
            for name, v in extra.items():
                detail[key][name] = detail[key].get(name, 0.0) + v

        if dp_keys:
            comp = 3 * cost.compute_time(c.sum(1))
            fwd, bwd, half = comp / 3, 2 * comp / 3, dp_comm / 2
            if "dp" in include:
                add("dp", comp, dp_comm, comp + dp_comm)
            if "dp_overlap" in include:
                add("dp_overlap", comp, dp_comm, fwd + max(bwd, dp_comm))
            if "zero1" in include:
                add("zero1", comp, dp_comm, comp + dp_comm)
            if "zero2" in include:
                add("zero2", comp, dp_comm, fwd + max(bwd, half) + half)
            if "zero3" in include:
                add("zero3", comp, 3 * half, half + fwd + half + max(bwd, half))
        if "mp" in include:
            comp = 3 * cost.compute_time(torch.full((W,), assignments / W, dtype=torch.float64))
            nbytes = assignments / max(top_k, 1) * shape.token_bytes
            comm = 2 * net.allreduce_time(nbytes, list(range(W)))
            add("mp", comp, comm, comp + comm)
        need_ep = {"ep", "smart"} & set(include)
        bd = cost.layer_time(c) if need_ep else None
        if "ep" in include:
            add("ep", bd.compute, bd.alltoall + bd.sync, bd.total)
        if "smart" in include:
            e2e = smart_schedule_time(cost, c, groups)
            add("smart", bd.compute, bd.alltoall + bd.sync, e2e + bd.sync)
        if "shadow" in include or "fastermoe" in include:
            cache = {}

            def breakdown(shadowed, c=c, cache=cache):
                key = tuple(shadowed)
                if key not in cache:
                    cache[key] = cost.shadow_layer_time(c, shadowed) if shadowed else cost.layer_time(c)
                return cache[key]

            if "shadow" in include:
                chosen, _ = select_shadow_experts(c, lambda sh: breakdown(sh).total)
                b = breakdown(chosen)
                add("shadow", b.compute, b.alltoall + b.sync, b.total, shadowed=len(chosen))
            if "fastermoe" in include:
                def smart_total(sh, c=c):
                    b = breakdown(sh)
                    return smart_schedule_time(cost, c, groups, shadowed=sh) + b.sync

                chosen, e2e = select_shadow_experts(c, smart_total)
                b = breakdown(chosen)
                add("fastermoe", b.compute, b.alltoall + b.sync, e2e, shadowed=len(chosen))

    points = []
    n = len(slices)
    for key in include:
        comp, comm, e2e = acc[key]
        d = {"lat_comp_s": comp, "lat_comm_s": comm, "lat_e2e_s": e2e, "layer_iterations": n}
        for name, v in detail[key].items():
            d[name + "_mean"] = v / n
        points.append(RooflinePoint(LABELS[key], comp, comm, e2e, flops, W, peak, d, src))
    return points


# --- output ---------------------------------------------------------------------------------------------------------
def format_points(points: Sequence[RooflinePoint]) -> str:
    """Plain-text table: strategy, R_CC, P-bar (TFLOPS), ideal and semi-ideal at that R_CC, latencies (ms)."""
    head = ("strategy", "R_CC", "P-bar TFLOPS", "ideal", "semi-ideal", "comp ms", "comm ms", "e2e ms")
    rows = []
    for p in points:
        rows.append((p.label, f"{p.r_cc:.3g}", f"{p.p_bar / 1e12:.2f}", f"{p.ideal / 1e12:.2f}",
                     f"{p.semi_ideal / 1e12:.2f}", f"{p.lat_comp * 1e3:.3f}", f"{p.lat_comm * 1e3:.3f}",
                     f"{p.lat_e2e * 1e3:.3f}"))
    w = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    fmt = lambda r: "  ".join(f"{v:<{w[0]}}" if i == 0 else f"{v:>{w[i]}}" for i, v in enumerate(r))  # noqa: E731
    return "\n".join([fmt(head), "  ".join("-" * x for x in w)] + [fmt(r) for r in rows])


def plot_roofline(points: Sequence[RooflinePoint], peak: float, path: str, title: Optional[str] = None) -> str:
    """Fig. 5: ideal polyline (solid, Eq. 5), semi-ideal curve (dashed, Eq. 6), log-scale R_CC axis, the labelled
    points; written as a PNG with matplotlib's Agg canvas (no pyplot, no global backend change). Returns ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    finite = [p.r_cc for p in points if math.isfinite(p.r_cc) and p.r_cc > 0]
    lo = min(finite + [1.0]) / 4
    hi = max(finite + [1.0]) * 4
    xs = [lo * (hi / lo) ** (i / 399) for i in range(400)]
    tf = peak / 1e12
    fig = Figure(figsize=(8, 5.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(xs, [p_ideal(tf, x) for x in xs], "-", color="black", label="ideal  $P_w\\min\\{1, R_{CC}\\}$ (Eq. 5)")
    ax.plot(xs, [p_semi_ideal(tf, x) for x in xs], "--", color="gray",
            label="semi-ideal  $P_w R_{CC}/(R_{CC}+1)$ (Eq. 6)")
    markers = "osD^v<>ph*"
    for i, p in enumerate(points):
        x = p.r_cc if math.isfinite(p.r_cc) else hi
        ax.scatter([x], [p.p_bar / 1e12], marker=markers[i % len(markers)], s=55, zorder=3, label=p.label)
        ax.annotate(p.label, (x, p.p_bar / 1e12), textcoords="offset points", xytext=(6, 4 + 9 * (i % 2)),
                    fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(0, tf * 1.1)
    ax.set_xlabel("$R_{CC}$ = Lat$_{comp}$ / Lat$_{comm}$ (Eq. 3)")
    ax.set_ylabel("$\\bar{P}$ per worker, TFLOPS (Eq. 4)")
    ax.set_title(title or "DDL-Roofline (model predictions)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=120)
    return path
