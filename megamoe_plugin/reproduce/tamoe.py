"""`megamoe reproduce tamoe`: TA-MoE (paper 002) Table 1 and the topology-aware loss's time to a target loss.

Two tables (``tamoe_table1.md``, ``tamoe_convergence.md``) and two figures, every row labelled (``common.py``):

**Table 1** (paper §3.3): device 0 of the topology [[0,1],[0̂,1̂]] (2 nodes x 2 devices) dispatches 128 MB with the
even pattern (1/4, 1/4, 1/4, 1/4 to 0, 1, 0̂, 1̂) and the uneven one (1/4, 1/2, 1/8, 1/8: more to the same-node
neighbour); time per destination and of the whole exchange ("All").

* ``paper``: the paper's numbers, copied.
* ``predicted (TA-MoE Table 1 fit cost model)``: the performance model (``perfmodel.Network.from_topology``, Eq. 2
  of paper 003: max over links of traffic / bandwidth) on the tree [[0,1],[2,3]] whose two link bandwidths are
  fitted to the paper's EVEN row only (32 MiB to the neighbour in 758 us; 32 MiB to a remote device in the mean
  of 5609 and 5618 us; no latency). The uneven row is then a genuine prediction. Per destination: the
  point-to-point time of that chunk alone; All: device 0 sends its three chunks at once (its uplink and its node's
  network link are shared); "all 4 ranks": every device sends the same pattern relative to itself at once (the
  MoE all-to-all). A third pattern is the one the package's TA-MoE gate derives for this topology
  (``gates.ta_moe.target_dispatch_pattern``, default smoothing 0.1).
* ``measured here``: the same three patterns on 4 gloo processes of this machine: per destination, rank 0 sends
  the chunk alone (``dist.send``; time from rank 0's send to the receiver's completion, both read from the one
  monotonic clock this host shares); All, rank 0 ``isend``s its three chunks at once; all 4 ranks: a real
  ``all_to_all_single`` with the pattern's uneven split sizes (all-to-all-v), the slowest rank's time. Medians.
  gloo on one machine without shaping moves every pair over loopback TCP on the same cores, so these rows cannot
  show the topology effect; they show what the uneven pattern costs when every link is equal (its largest chunk
  doubles). The topology effect is measured on the emulated cluster (``megamoe bench gates``: shaped links), whose
  rows ``--cluster-results`` adds.

**Convergence** (paper §5: TA-MoE's loss keeps the model quality and speeds up time to convergence): two
``megamoe train`` runs on 4 gloo processes with expert parallelism 4 over the topology [[0,1],[2,3]] (link
bandwidths: the Table 1 fit), identical but for ``--moe-gate gshard`` vs ``--moe-gate ta_moe``. For each:
validation loss every ``eval_interval`` steps; the target is the worse run's best validation loss, and steps and
training wall time (evaluation excluded: the trainer's own step timing, runs interleaved) to first reach it are ``measured here``; the
fraction of dispatched assignments that crossed nodes is counted from the run's routing trace. Predicted rows
replay each run's recorded routing through the Table 1 fit network, each source's dispatch scaled to Table 1's
128 MiB: all-to-all time per step (4 exchanges per MoE layer: 2 forward, 2 backward) and that time summed over the
steps to the target. On this machine the links are equal, so the measured wall time cannot show TA-MoE's gain.

``--fast`` (CI): 8 MiB exchanges, 40 training steps of a tiny model; full: 128 MiB, 300 steps of a small one.

The runs are interleaved one evaluation interval at a time (``training.train_interleaved_in_workers``); before
them a few silent steps warm the processes up (the first run would otherwise pay one-time costs). ``offnode_share``
and ``machine_note`` are shared with ``reproduce/fastermoe.py``.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from .common import mark_fast, PAPER, Table, fork_processes, header, measured, predicted, print_tables, save_figure
from .training import _flag, common_target, time_to_target, train_interleaved_in_workers, warm_up_in_workers

__all__ = ["run", "PAPER_TABLE1", "PATTERNS", "fitted_topology", "time_to_target", "common_target", "offnode_share",
           "machine_note"]

MIB = 2 ** 20
TOPOLOGY = "[[0,1],[2,3]]"
PAPER_MIB = 128                       # "We dispatch 128MB data" (read as MiB; the fit and predictions are unit-free)
# paper 002 Table 1: ratios to 0, 1, 0̂, 1̂ and times (us) per destination, then All
PAPER_TABLE1 = {
    "even": {"ratio": (1 / 4, 1 / 4, 1 / 4, 1 / 4), "us": (144.0, 758.0, 5609.0, 5618.0), "all_us": 14019.0},
    "uneven": {"ratio": (1 / 4, 1 / 2, 1 / 8, 1 / 8), "us": (144.0, 1492.0, 2835.0, 2861.0), "all_us": 10765.0},
}
PATTERNS = {name: v["ratio"] for name, v in PAPER_TABLE1.items()}
PAPER_SPEEDUPS = [("TA-MoE over DeepSpeed-MoE", "1.01-1.61x"), ("TA-MoE over FastMoE", "1.01-4.77x"),
                  ("TA-MoE over FasterMoE's Hir gate (time to convergence)", "1.25-1.54x")]
FIT_PROFILE = "TA-MoE Table 1 fit"
DERIVED = "TA-MoE target (derived)"

FAST_MODEL = ["--hidden", "32", "--layers", "2", "--heads", "2", "--ffn-hidden", "64", "--seq-len", "32",
              "--batch-size", "4", "--corpus-bytes", "200000", "--steps", "40", "--eval-interval", "10",
              "--eval-batches", "4"]
FULL_MODEL = ["--hidden", "64", "--layers", "2", "--heads", "2", "--ffn-hidden", "128", "--seq-len", "64",
              "--batch-size", "8", "--corpus-bytes", "1000000", "--steps", "300", "--eval-interval", "25",
              "--eval-batches", "8"]


# --------------------------------------------------------------------------------------------- shared helpers
def machine_note() -> str:
    """How busy this machine was: measured rows on a shared machine are only as good as its load."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"this machine: {os.cpu_count()} CPU core(s), 1-minute load average {load:.1f} when the measured rows "
            "were finished (other jobs share the cores; measured times are noisy at this scale)")


def offnode_share(counts: torch.Tensor, node_of_rank: Sequence[int]) -> float:
    """Fraction of the assignments in counts [..., P, E] (experts in contiguous blocks over the P ranks) whose
    expert lives on another node than their source rank."""
    c = torch.as_tensor(counts).to(torch.float64)
    P, E = c.shape[-2:]
    nodes = torch.tensor(list(node_of_rank))
    expert_node = nodes[torch.arange(E) // (E // P)]
    cross = (nodes.view(P, 1) != expert_node.view(1, E)).to(torch.float64)
    total = float(c.sum())
    return float((c * cross).sum()) / total if total else 0.0


# ------------------------------------------------------------------------------------------------- Table 1 model
def fitted_topology():
    """[[0,1],[2,3]] with the two link bandwidths that reproduce the paper's EVEN row (no latency)."""
    from ..topology import Topology
    even = PAPER_TABLE1["even"]["us"]
    chunk = PAPER_MIB * MIB / 4
    intra = chunk / (even[1] * 1e-6) / 1e9
    inter = chunk / (0.5 * (even[2] + even[3]) * 1e-6) / 1e9
    return Topology([[0, 1], [2, 3]], bandwidth_gbps=[intra, inter], latency_us=[0.0, 0.0])


def derived_pattern(topo, total_bytes: float) -> tuple:
    """Row 0 of the package's TA-MoE target dispatch pattern (the gate's smoothing)."""
    from ..gates.ta_moe import SMOOTHING, target_dispatch_pattern
    row = target_dispatch_pattern(topo, total_bytes, SMOOTHING)[0]
    return tuple(float(x) for x in row)


def _dest_order(rank: int) -> List[int]:
    """Destinations of `rank` in Table 1's order: itself, its same-node neighbour, the other node's two."""
    node = rank // 2
    return [rank, rank ^ 1] + [r for r in range(4) if r // 2 != node]


def pattern_matrix(ratios: Sequence[float], total: float, senders: Sequence[int] = (0,)) -> torch.Tensor:
    """[4, 4] bytes src -> dst: each sender dispatches `total` in Table 1's proportions relative to itself."""
    m = torch.zeros(4, 4, dtype=torch.float64)
    for s in senders:
        for r, d in zip(ratios, _dest_order(s)):
            m[s, d] = r * total
    return m


def predict_table1(patterns: Dict[str, tuple], total: float) -> Dict[str, dict]:
    from ..perfmodel.network import Network
    net = Network.from_topology(fitted_topology())
    out = {}
    for name, ratios in patterns.items():
        m0 = pattern_matrix(ratios, total)
        per = [net.p2p_time(float(m0[0, j]), 0, j) * 1e6 for j in range(4)]
        out[name] = {"us": per, "all_us": net.alltoallv_time(m0) * 1e6,
                     "a2a_us": net.alltoallv_time(pattern_matrix(ratios, total, range(4))) * 1e6}
    return out


# --------------------------------------------------------------------------------------------- Table 1 measured
def _elems(ratios, total_bytes) -> List[int]:
    return [max(1, int(round(r * total_bytes / 4))) for r in ratios]


def measure_table1(rank: int, patterns: Dict[str, tuple], total_bytes: int, iters: int) -> Optional[dict]:
    """Collective over the 4 ranks of the default group (see the module docstring); rank 0 returns the medians."""
    from time import perf_counter as now
    out = {}
    for name, ratios in patterns.items():
        sizes = _elems(ratios, total_bytes)                    # in Table 1's order, relative to the sender
        send = torch.randn(sum(sizes))
        chunks = list(torch.split(send, sizes))
        recv = torch.empty(max(sizes))
        per = [[] for _ in range(4)]
        for _ in range(iters + 1):                             # the first round warms the connections up
            # 0 -> 0: a local copy of its own chunk
            dist.barrier()
            if rank == 0:
                t = now()
                chunks[0].clone()
                per[0].append(now() - t)
            # 0 -> j alone
            for j in (1, 2, 3):
                n = sizes[_dest_order(0).index(j)]
                dist.barrier()
                stamp = torch.zeros(2, dtype=torch.float64)
                if rank == 0:
                    stamp[0] = now()
                    dist.send(chunks[_dest_order(0).index(j)].contiguous(), j)
                elif rank == j:
                    dist.recv(recv[:n], 0)
                    stamp[1] = now()
                dist.all_reduce(stamp)
                if rank == 0:
                    per[j].append(float(stamp[1] - stamp[0]))
        # All: rank 0 sends its three chunks at once
        alls = []
        for _ in range(iters + 1):
            dist.barrier()
            stamp = torch.zeros(5, dtype=torch.float64)
            if rank == 0:
                stamp[0] = now()
                reqs = [dist.isend(chunks[_dest_order(0).index(j)].contiguous(), j) for j in (1, 2, 3)]
                chunks[0].clone()
                for r in reqs:
                    r.wait()
                stamp[1] = now()
            else:
                n = sizes[_dest_order(0).index(rank)]
                dist.irecv(recv[:n], 0).wait()
                stamp[1 + rank] = now()
            dist.all_reduce(stamp)
            alls.append(float(stamp[1:].max() - stamp[0]))
        # all 4 ranks: all-to-all-v, every rank the pattern relative to itself
        in_splits = [0] * 4
        for r, d in zip(sizes, _dest_order(rank)):
            in_splits[d] = r
        out_splits = [_elems(ratios, total_bytes)[_dest_order(s).index(rank)] for s in range(4)]
        inp = torch.randn(sum(in_splits))
        outp = torch.empty(sum(out_splits))
        a2a = []
        for _ in range(iters + 1):
            dist.barrier()
            t = now()
            dist.all_to_all_single(outp, inp, out_splits, in_splits)
            dt = torch.tensor([now() - t], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            a2a.append(float(dt))
        if rank == 0:
            out[name] = {"us": [statistics.median(p[1:]) * 1e6 for p in per],
                         "all_us": statistics.median(alls[1:]) * 1e6, "a2a_us": statistics.median(a2a[1:]) * 1e6}
    return out if rank == 0 else None


# ----------------------------------------------------------------------------------------------------- workers
def _worker(rank: int, world: int, plan: dict, result_file: str) -> None:
    res = {"table1": measure_table1(rank, plan["patterns"], plan["bytes"], plan["iters"]), "runs": {}}
    warm_up_in_workers(rank, next(iter(plan["runs"].values())))
    logs = {gate: os.path.join(plan["out"], f"tamoe_train_{gate}.log") for gate in plan["runs"]}
    res["runs"] = train_interleaved_in_workers(rank, plan["runs"], logs, plan["tmp"])
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump(res, f)


def _train_flags(fast: bool, topo, gate: str) -> List[str]:
    bw = ",".join(f"{b:.6g}" for b in topo.bandwidth_gbps)
    every = _flag(FAST_MODEL if fast else FULL_MODEL, "--eval-interval")
    return (FAST_MODEL if fast else FULL_MODEL) + [
        "--threads", "1", "--log-interval", every, "--moe-every", "1", "--moe-num-experts", "8", "--seed", "0",
        "--lr", "3e-3", "--moe-expert-parallel-size", "4", "--moe-topology", TOPOLOGY,
        "--moe-topology-bandwidth-gbps", bw, "--moe-topology-latency-us", "0,0",   # no latency: the target does
        "--moe-gate", gate, "--moe-gate-sync", "all"]                               # not depend on the bytes sent


def _predicted_exchange(counts, net, total_bytes: float) -> List[float]:
    """Per step: 4 x sum over layers of the all-to-all time of the recorded routing, each source's dispatch
    scaled to `total_bytes` (seconds)."""
    c = torch.as_tensor(counts).to(torch.float64)
    S, L, P, E = c.shape
    out = []
    for s in range(S):
        t = 0.0
        for l in range(L):
            rt = c[s, l].view(P, P, E // P).sum(-1)
            rows = rt.sum(1, keepdim=True).clamp(min=1e-12)
            t += net.alltoallv_time(rt / rows * total_bytes)
        out.append(4.0 * t)
    return out


# --------------------------------------------------------------------------------------------------------- run
def run(out_dir: str, fast: bool, log=print, cluster_results: Optional[str] = None) -> dict:
    from . import cluster_rows
    cluster = cluster_rows.load(cluster_results)
    from ..perfmodel.network import Network
    os.makedirs(out_dir, exist_ok=True)
    t_start = time.perf_counter()
    topo = fitted_topology()
    paper_total = PAPER_MIB * MIB
    patterns = dict(PATTERNS)
    patterns[DERIVED] = derived_pattern(topo, paper_total)
    meas_mib = 8 if fast else PAPER_MIB
    gates = ("gshard", "ta_moe")
    with tempfile.TemporaryDirectory() as tmp:
        plan = {"patterns": patterns, "bytes": meas_mib * MIB, "iters": 5 if fast else 7, "out": out_dir,
                "tmp": tmp, "runs": {g: _train_flags(fast, topo, g) for g in gates}}
        result_file = os.path.join(tmp, "result.json")
        fork_processes(_worker, 4, plan, result_file)
        with open(result_file) as f:
            res = json.load(f)
    busy = machine_note()

    # ---- Table 1
    pred = predict_table1(patterns, paper_total)
    meas = res["table1"]
    t1 = Table("tamoe_table1", "TA-MoE Table 1: even vs uneven dispatch from device 0 on [[0,1],[0̂,1̂]] (times in us)",
               ["pattern (to 0, 1, 0̂, 1̂)", "MiB per device", "0->0", "0->1", "0->0̂", "0->1̂", "All",
                "All: even / this", "all 4 ranks all-to-all-v", "all 4: even / this", "source"], fmt="{:.5g}")

    def ratios_text(name):
        return f"{name} (" + ", ".join(f"{r:.3g}" for r in patterns[name]) + ")"

    for name in ("even", "uneven"):
        p = PAPER_TABLE1[name]
        t1.add(ratios_text(name), float(PAPER_MIB), *p["us"], p["all_us"],
               PAPER_TABLE1["even"]["all_us"] / p["all_us"], None, None, PAPER)
    for label, rows, mib in ((predicted(FIT_PROFILE), pred, PAPER_MIB), (measured(), meas, meas_mib)):
        for name in patterns:
            r = rows[name]
            t1.add(ratios_text(name), float(mib), *[float(x) for x in r["us"]], float(r["all_us"]),
                   rows["even"]["all_us"] / r["all_us"], float(r["a2a_us"]), rows["even"]["a2a_us"] / r["a2a_us"],
                   label)
    cluster_rows.add_table1_rows(t1, cluster, len(t1.columns))
    t1.notes += [
        f"predicted: link bandwidths fitted to the paper's EVEN row only: intra-node {topo.bandwidth_gbps[0]:.2f} "
        f"GB/s (32 MiB in 758 us), inter-node {topo.bandwidth_gbps[1]:.2f} GB/s per node (32 MiB in 5613.5 us), "
        "no latency; the uneven and derived rows are predictions. 0->0 has no link in the model (0); the paper's "
        "144 us is a local copy. All = device 0 sending its 3 chunks at once (Eq. 2: max over links); the paper's "
        "All is close to the SUM of its per-destination times (its transfers were not concurrent), which the model "
        "does not assume, so the model's All speedup is larger than the paper's.",
        f"'{DERIVED}': the pattern the package's ta_moe gate targets on this topology "
        "(gates.ta_moe.target_dispatch_pattern: water-filling of the alpha-beta model, smoothing 0.1).",
        f"measured here: 4 gloo processes on one host, {meas_mib} MiB per device, median of "
        f"{plan['iters']} rounds; 0->0 is a local copy. On one host every pair goes over loopback TCP on the same "
        "cores: no inter-node link, so these rows cannot show the topology effect (on equal links the uneven "
        "pattern's doubled neighbour chunk makes it no faster).",
        "measured, emulated cluster: `megamoe bench gates` on `megamoe cluster` (network namespaces, tbf-shaped "
        "links; 4 gloo processes as 2 nodes x 2), 128 MB from device 0, median of interleaved rounds; All = device "
        "0's exchange.", busy,
    ]

    # ---- convergence
    runs = res["runs"]
    target = common_target([runs[g] for g in gates])
    net = Network.from_topology(topo)
    nodes = topo.node_ids()
    conv = Table("tamoe_convergence", "TA-MoE loss vs GShard loss: steps and time to a target validation loss "
                 f"(target {target:.4f} = the worse run's best)",
                 ["gate", "steps to target", "time to target (s)", "best valid loss", "final valid loss",
                  "off-node share of assignments", "all-to-all per step (ms)", "speedup vs gshard", "source"])
    info = {}
    for g in gates:
        r = runs[g]
        steps, secs = time_to_target(r, target)
        per_step = _predicted_exchange(r["counts"], net, paper_total)
        upto = per_step[:steps] if steps else per_step
        comm = sum(upto) if steps else None
        info[g] = dict(steps=steps, secs=secs, comm=comm, per_step=statistics.mean(upto),
                       best=min(l for _, l in r["evals"]), final=r["evals"][-1][1],
                       offnode=offnode_share(torch.tensor(r["counts"]), nodes))
    for g in gates:
        i = info[g]
        conv.add(g, i["steps"], i["secs"], i["best"], i["final"], i["offnode"], None,
                 info["gshard"]["secs"] / i["secs"] if i["secs"] else None, measured())
    for g in gates:
        i = info[g]
        conv.add(f"{g}: all-to-all time of its routing on the Table 1 fit topology, 128 MiB/device",
                 i["steps"], i["comm"], None, None, None, i["per_step"] * 1e3,
                 info["gshard"]["comm"] / i["comm"] if i["comm"] else None, predicted(FIT_PROFILE))
    cluster_rows.add_gate_rows(conv, cluster, gates=("gshard", "ta_moe"))
    for what, speed in PAPER_SPEEDUPS:
        conv.add(what, None, None, None, None, None, None, speed, PAPER)
    conv.add("TA-MoE model quality", None, None, None, None, None, None,
             "'without sacrificing the model accuracy'", PAPER)
    model = FAST_MODEL if fast else FULL_MODEL
    conv.notes += [
        f"runs: `megamoe train` on 4 gloo processes, expert parallelism 4, 8 experts top-2, dropless, topology "
        f"{TOPOLOGY} with the Table 1 fit bandwidths; model/training flags {' '.join(model)}; logs "
        f"tamoe_train_<gate>.log. Identical seeds, data order and initial weights; only the gate's balance loss "
        "differs (gshard: GShard loss on first choices; ta_moe: the topology-weighted loss).",
        "the worse run reaches the target at its best evaluation by construction (its step count is a lower "
        "bound). measured time = training wall time to the target step on this machine (evaluation excluded; the links "
        "are equal here, so TA-MoE cannot save communication time); speedup = gshard's time / this run's.",
        "off-node share: assignments whose expert is on the other node, counted from the run's routing trace "
        "(an even dispatch sends 1/2 off-node). Why the ta_moe run's share stays at ~1/2: the gate is one "
        "replicated parameter whose gradient is averaged over the ranks (train.sync_gradients), each rank's "
        "topology weights favour ITS node's experts, and the ranks' data shards are i.i.d.; on a symmetric tree "
        "every expert gets the same summed weight over the ranks, so in expectation the preferences cancel and "
        "the loss acts as a plain balance loss. Steering toward the target pattern needs rank-local gates: "
        "--moe-gate-sync local (the default for ta_moe, auto), as the emulated-cluster rows use; these one-host "
        "rows run with --moe-gate-sync all to show the cancellation.",
        "emulated cluster rows (`megamoe bench gates`): `megamoe train` (4 MoE layers, hidden 256, 8 experts top-2, "
        "EP=4, 200 steps) per gate config from one seed; time to target = training seconds to the worse run's best "
        "validation loss; the 'all-to-all per step' column holds the measured step time (ms) there.",
        "predicted: each run's recorded routing per step and layer, each source's dispatch scaled to 128 MiB, "
        "through the Table 1 fit network; 4 all-to-alls per MoE layer per step; per step = the mean over the steps "
        "up to the target, time to target = their sum. Communication only (the part TA-MoE changes).",
        "paper rows: the paper's end-to-end speedups on its clusters (not comparable in scale; listed beside ours).",
        busy,
    ]

    tables = [t1, conv]
    md = [t.write(out_dir) for t in mark_fast(tables, fast)]
    figs = [_plot_table1(out_dir, t1_rows(pred, meas, patterns)), _plot_convergence(out_dir, runs, target)]
    log(header("tamoe", fast, f"{time.perf_counter() - t_start:.0f} s"))
    print_tables(tables, figs, log, fast=fast)
    return {"tables": md, "figures": figs}


def t1_rows(pred, meas, patterns):
    rows = [("paper", {n: PAPER_TABLE1["even"]["all_us"] / PAPER_TABLE1[n]["all_us"] for n in PAPER_TABLE1})]
    rows.append(("predicted (Table 1 fit)", {n: pred["even"]["all_us"] / pred[n]["all_us"] for n in patterns}))
    rows.append(("measured here", {n: meas["even"]["all_us"] / meas[n]["all_us"] for n in patterns}))
    return rows


def _plot_table1(out_dir, rows) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = ["even", "uneven", DERIVED]
    w = 0.25
    for k, (label, vals) in enumerate(rows):
        xs = [i + (k - 1) * w for i in range(len(names))]
        ax.bar(xs, [vals.get(n, 0.0) for n in names], w, label=label)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("All: even time / this pattern's time")
    ax.set_title("TA-MoE Table 1: exchange from device 0 on [[0,1],[0̂,1̂]]")
    ax.legend(fontsize=8)
    return save_figure(fig, out_dir, "tamoe_table1")


def _plot_convergence(out_dir, runs, target) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for g, r in runs.items():
        ax.plot([s for s, _ in r["evals"]], [l for _, l in r["evals"]], marker="o", label=f"--moe-gate {g}")
    ax.axhline(target, color="k", ls="--", lw=0.8, label="target")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (measured here)")
    ax.set_title("TA-MoE loss vs GShard loss (4 gloo ranks, [[0,1],[2,3]])")
    ax.legend(fontsize=8)
    return save_figure(fig, out_dir, "tamoe_convergence")
