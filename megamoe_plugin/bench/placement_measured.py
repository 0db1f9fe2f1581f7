"""The MEASURED part of `megamoe bench placement`: static EP vs FasterMoE shadowing vs FlexMoE trained for real on
``--measure-procs`` gloo processes of this machine (CPU), timed step by step.

Model: a residual stack of ``--measure-layers`` MoE layers (``MoELayer``, expert parallelism over all processes,
E = ``--measure-experts-per-rank`` x procs experts, top-2, dropless, H x F FFN experts), an MSE loss against random
targets, Adam. The gate is ``bench_zipf_drift`` (registered here): its choices ignore the learned logits and follow a
deterministic Zipf(``--measure-skew``) popularity whose ranking drifts by ``--measure-drift`` positions per step
(the synthetic trace's formula, ``perfmodel.placement_replay.synthetic_trace``; experts 0, 1, ... start hottest, so the
first rank is the hot one), sampled per token without replacement by Gumbel-top-k from a generator seeded by
(seed, layer, rank, step): the same routing in every strategy at every step. Its combine weights are the learned
softmax probabilities of the chosen experts, so the gate trains.

Strategies, each its own model with the same initial weights (experts distinct per rank, the gate shared), run
interleaved step by step (round r runs step r of every strategy, in an order that rotates), so a slow phase of a
shared machine hits all alike:

* ``static EP``: ``MoEConfig(placement="none")``: contiguous expert blocks;
* ``shadow``: ``placement="shadow"`` (FasterMoE Alg. 1 on the last step's counts, through ``AfterStepHook``);
* ``flexmoe``: ``placement="flexmoe"``, one spare vExpert slot per rank (Expand / Shrink / Migrate of parameters
  and Adam state between steps).

The planners' cost model is a profile of THIS machine and world (``--measure-profile``): ``calibrate`` (default:
``perfmodel.calibrate.calibrate(quick=True)`` on the measuring processes, saved as JSON and passed as
``placement_profile``), ``gemm`` (the fallback, also taken when calibration fails: the measured expert-FFN GEMM
throughput with assumed shared-memory network numbers), or a named profile / JSON path.

Timed: one training step = forward + backward + the data-parallel all-reduce of the gate's gradients + Adam +
the after-step hook (moves, shadow selection), between a barrier and the end of the step, the slowest rank's
time; ``--measure-warmup`` steps excluded, ``--measure-steps`` timed. Outside the timed region: the per-step mean
loss over ranks (all three must agree to ``LOSS_RTOL``: placement must not change the math), and each layer's
[P, E] routing counts with the placement the step ran with (balance ratio, FlexMoE Eq. 6; the cost model's
prediction of the MoE layers).
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Dict, Optional

import torch
import torch.distributed as dist

from ..config import INIT_STD
from ..placement.policies import FLEXMOE_MAX_MOVES
from ..gates import Gate, register_gate

STRATEGIES = ("static EP", "shadow", "flexmoe")
POLICY = {"static EP": "none", "shadow": "shadow", "flexmoe": "flexmoe"}
LOSS_RTOL = 1e-4


# --- the skewed, drifting, deterministic gate ---------------------------------------------------------------------
def zipf_popularity(num_experts: int, step: int, layer: int, skew: float, drift: float) -> torch.Tensor:
    """[E] popularity (sums to 1): Zipf(skew) over positions, expert i at position (i - step * drift - 0.37 layer)
    mod E, interpolated between neighbouring positions (``synthetic_trace``'s formula without its permutation)."""
    E = int(num_experts)
    zipf = torch.arange(1, E + 1, dtype=torch.float64).pow(-float(skew))
    pos = (torch.arange(E, dtype=torch.float64) - step * float(drift) - 0.37 * layer) % E
    lo = pos.floor().long() % E
    hi = (lo + 1) % E
    w = pos - pos.floor()
    pop = (1 - w) * zipf[lo] + w * zipf[hi]
    return pop / pop.sum()


@register_gate("bench_zipf_drift")
class ZipfDriftGate(Gate):
    """Benchmark gate: top-k by Gumbel-top-k sampling of ``zipf_popularity`` (module docstring). Set ``stream``
    (the layer index), ``skew``, ``drift``, ``seed`` on the instance; ``calls`` counts training forwards (the
    step). Evaluation calls use the current step without advancing it."""
    stream, skew, drift, seed = 0, 2.0, 0.02, 0

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.calls = 0

    def select(self, logits, probs):
        T, E = logits.shape
        step = self.calls
        if self.training:
            self.calls += 1
        pop = zipf_popularity(E, step, self.stream, self.skew, self.drift)
        seed = (((int(self.seed) * 1_000_003 + int(self.stream)) * 10_007 + int(self.ep.rank)) * 100_003
                + step) % (2 ** 62)
        g = torch.Generator().manual_seed(seed)
        u = torch.rand(T, E, generator=g, dtype=torch.float64).clamp_(1e-12, 1 - 1e-12)
        score = pop.log()[None, :] - torch.log(-torch.log(u))
        ids = torch.topk(score, self.top_k, dim=-1).indices.to(logits.device)
        return ids, torch.ones_like(ids, dtype=torch.bool)


# --- the profile for the planners ---------------------------------------------------------------------------------
def _gemm_profile(P: int, name: str):
    """Fallback: a profile of this machine from the measured expert-FFN GEMM throughput (slowest rank); the network
    numbers are assumptions for processes on one host (shared memory through gloo), not measurements."""
    from ..perfmodel.calibrate import measure_gemm
    from ..perfmodel.profiles import HardwareProfile
    gemm = measure_gemm(tokens=(256, 1024, 2048), iters=3, device="cpu")
    flops = torch.tensor([gemm["flops"]], dtype=torch.float64)
    dist.all_reduce(flops, op=dist.ReduceOp.MIN)
    return HardwareProfile(
        name=name, description=f"this machine: {P} gloo process(es) on CPU; GEMM measured, network assumed",
        source="measured here: expert-FFN GEMM fit; assumed: 5 GB/s per rank link, 100 us latency (one host)",
        nodes=1, gpus_per_node=P, gemm_tflops=float(flops) / 1e12, intra="switch", intra_bandwidth_gbps=5.0,
        nic_bandwidth_gbps=5.0, intra_latency_us=100.0, nic_latency_us=100.0, bytes_per_element=4)


def _make_profile(spec: str, P: int, path: str) -> Dict[str, object]:
    """Collective. Returns {path, kind, note, seconds, gemm_gflops, a2a_gbps, alpha_us}; rank 0 writes the JSON."""
    from ..perfmodel.profiles import get_profile
    t0 = time.perf_counter()
    info: Dict[str, object] = {"path": path, "note": ""}
    profile = None
    if spec == "calibrate":
        from ..perfmodel.calibrate import calibrate
        try:
            cal = calibrate(name=f"measured-here-{P}procs", quick=True, device=torch.device("cpu"))
            profile, info["kind"] = cal.profile, "calibrated here (perfmodel.calibrate, quick)"
            info["layer_overhead_s"] = cal.layer_overhead_s
        except Exception as e:                      # noqa: BLE001 - any failure: the documented fallback
            info["note"] = f"calibration failed ({type(e).__name__}: {e}); fell back to the GEMM-derived profile"
            spec = "gemm"
    if spec == "gemm":
        profile = _gemm_profile(P, f"gemm-here-{P}procs")
        info["kind"] = "derived from the GEMM throughput measured here (network assumed)"
    if profile is None:
        profile = get_profile(spec)
        info["kind"] = f"given: {spec}"
    if dist.get_rank() == 0:
        profile.save(path)
    dist.barrier()
    info.update(seconds=time.perf_counter() - t0, name=profile.name, gemm_gflops=profile.gemm_tflops * 1e3,
                a2a_gbps=profile.intra_bandwidth_gbps, alpha_us=profile.intra_latency_us)
    return info


# --- the measured run ---------------------------------------------------------------------------------------------
def _build(args, P: int, rank: int, profile_path: str):
    """Per strategy: (cfg, layers, optimizer, hook), same initial weights in all (experts copied into the first
    E/P slots of a layer with spare slots)."""
    from ..config import MoEConfig
    from ..layer import MoELayer
    from ..placement import AfterStepHook
    E = args.measure_experts_per_rank * P
    H, F_ = args.measure_hidden, args.measure_ffn
    base = dict(num_experts=E, top_k=2, gate="bench_zipf_drift", expert_parallel_size=P, world_size=P,
                aux_loss_coeff=0.0, placement_profile=profile_path, placement_threshold=args.threshold,
                placement_interval=1,                                          # plans every step, as it times them
                placement_guard=-1.0)     # the planners' own per-step decisions: a few steps, no wall-clock guard
    built = {}
    ref_state = None
    for name in STRATEGIES:
        extra = {"placement": POLICY[name]}
        if name == "flexmoe":
            extra["placement_spare_slots"] = 1
        cfg = MoEConfig(**base, **extra)
        torch.manual_seed(args.seed)                           # the gate: the same on every rank
        layers = torch.nn.ModuleList(MoELayer(cfg, H, F_, ep_group=dist.group.WORLD, layer_id=j)
                                     for j in range(args.measure_layers))
        for j, layer in enumerate(layers):
            layer.gate.stream, layer.gate.skew, layer.gate.drift, layer.gate.seed = \
                j, args.measure_skew, args.measure_drift, args.seed
        if ref_state is None:                                  # experts: this rank's own
            g = torch.Generator().manual_seed(args.seed * 7919 + 1 + rank)
            with torch.no_grad():
                for layer in layers:
                    for p in layer.experts.parameters():
                        p.normal_(0.0, INIT_STD, generator=g)
            ref_state = [{n: p.detach().clone() for n, p in layer.named_parameters()} for layer in layers]
        else:
            with torch.no_grad():
                for layer, want in zip(layers, ref_state):
                    for n, p in layer.named_parameters():
                        p.zero_()
                        p[:want[n].shape[0]].copy_(want[n])
        opt = torch.optim.Adam(layers.parameters(), lr=args.measure_lr)
        built[name] = (cfg, layers, opt, AfterStepHook(cfg))
    return built


def _train_step(layers, opt, hook, x, target, iteration: int, world: int) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    h = x
    for layer in layers:
        h = h + layer(h)
    loss = (h - target).pow(2).mean()
    loss.backward()
    gate_grads = [layer.gate.weight.grad for layer in layers]
    flat = torch.cat([g.reshape(-1) for g in gate_grads])
    dist.all_reduce(flat)                                      # the gate is data parallel (what DDP does)
    off = 0
    for g in gate_grads:
        g.copy_(flat[off:off + g.numel()].view_as(g)).div_(world)
        off += g.numel()
    for layer in layers:                                       # DDP's 1/world on the experts' gradients
        for p in layer.experts.parameters():
            if p.grad is not None:
                p.grad.div_(world)
    opt.step()
    t0 = time.perf_counter()
    hook.run(layers, opt, iteration, moe_layers=list(layers))
    return loss.detach(), time.perf_counter() - t0


def measure(args, P: int, rank: int, profile_info: dict) -> Optional[dict]:
    """Collective over the default group; rank 0 returns the results."""
    from ..perfmodel.cost import LayerShape
    from ..perfmodel.profiles import get_profile
    built = _build(args, P, rank, profile_info["path"])
    E, H, F_, T = args.measure_experts_per_rank * P, args.measure_hidden, args.measure_ffn, args.measure_tokens
    total = args.measure_warmup + args.measure_steps
    g = torch.Generator().manual_seed(args.seed * 31 + 17 + rank)
    data = [(torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)) for _ in range(total)]
    cm = get_profile(profile_info["path"]).cost_model(LayerShape(H, F_, E, bytes_per_element=4), world_size=P)
    rec = {name: {"time": [], "hook": [], "loss": [], "balance": [], "predicted": [], "shadowed": [], "replicas": []}
           for name in STRATEGIES}
    for step in range(total):
        k = step % len(STRATEGIES)
        for name in STRATEGIES[k:] + STRATEGIES[:k]:
            cfg, layers, opt, hook = built[name]
            rts = [layer.plan.placement for layer in layers]
            before = [(rt.state.copy(), list(rt.shadowed)) for rt in rts]
            x, target = data[step]
            dist.barrier()
            t0 = time.perf_counter()
            loss, hook_dt = _train_step(layers, opt, hook, x, target, step + 1, P)
            dt = time.perf_counter() - t0
            tm = torch.tensor([dt, hook_dt], dtype=torch.float64)
            dist.all_reduce(tm, op=dist.ReduceOp.MAX)
            ls = loss.to(torch.float64).reshape(1)
            dist.all_reduce(ls)
            r = rec[name]
            r["time"].append(float(tm[0]))
            r["hook"].append(float(tm[1]))
            r["loss"].append(float(ls) / P)
            bal, pred, shad, repl = [], 0.0, 0, 0
            for layer, (state, shadowed) in zip(layers, before):
                c = layer.last_routing.counts.detach()
                parts = [torch.empty_like(c) for _ in range(P)]
                dist.all_gather(parts, c.contiguous())
                counts = torch.stack(parts).to(torch.float64)
                loads = state.rank_loads(counts, shadowed)
                bal.append(float(loads.max()) * P / float(loads.sum()))
                pred += (cm.shadow_layer_time(counts, shadowed, state.placement()) if shadowed
                         else cm.layer_time(counts, state.placement())).total
                shad += len(shadowed)
                repl += state.total_replicas - E + len(shadowed) * (P - 1)
            r["balance"].append(sum(bal) / len(bal))
            r["predicted"].append(pred)
            r["shadowed"].append(shad)
            r["replicas"].append(repl)
    if rank:
        return None
    w = args.measure_warmup
    rows = []
    for name in STRATEGIES:
        cfg, layers, opt, hook = built[name]
        r = rec[name]
        timed = r["time"][w:]
        pol = hook.policy
        rows.append({
            "strategy": name, "policy": POLICY[name], "mean_s": sum(timed) / len(timed),
            "median_s": statistics.median(timed), "min_s": min(timed), "hook_s": sum(r["hook"][w:]) / len(timed),
            "moves": int(pol.total_moves) if pol is not None else 0,
            "bytes_moved": int(pol.total_bytes) if pol is not None else 0,
            "replicas_last": r["replicas"][-1], "shadowed_last": r["shadowed"][-1],
            "shadowed_steps": sum(1 for s in r["shadowed"] if s), "shadowed_max": max(r["shadowed"]),
            "balance_mean": sum(r["balance"][w:]) / len(timed), "balance_last": r["balance"][-1],
            "balance_first": r["balance"][0],
            "predicted_s": sum(r["predicted"][w:]) / len(timed), "losses": r["loss"],
            "times": r["time"]})
    base = rows[0]
    for row in rows:
        row["speedup"] = base["median_s"] / row["median_s"]        # the headline: median steady-state step
        row["speedup_mean"] = base["mean_s"] / row["mean_s"]
        row["loss_max_rel_diff"] = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(row["losses"],
                                                                                          base["losses"]))
    return {"procs": P, "threads": torch.get_num_threads(), "torch": torch.__version__, "hidden": H, "ffn": F_,
            "experts": E, "layers": args.measure_layers, "tokens_per_rank": T, "top_k": 2,
            "skew": args.measure_skew, "drift": args.measure_drift, "warmup": w, "steps": args.measure_steps,
            "threshold": args.threshold, "max_moves": FLEXMOE_MAX_MOVES, "profile": profile_info, "rows": rows,
            "loss_max_rel_diff": max(row["loss_max_rel_diff"] for row in rows), "loss_rtol": LOSS_RTOL}


def _worker(rank: int, world: int, args, profile_path: str, result_file: str) -> None:
    import json
    info = _make_profile(args.measure_profile, world, profile_path)
    t0 = time.perf_counter()
    res = measure(args, world, rank, info)
    if rank == 0:
        res["train_wall_s"] = time.perf_counter() - t0
        with open(result_file, "w") as f:
            json.dump(res, f)


def run_measured(args) -> dict:
    """Spawn ``args.measure_procs`` gloo processes, calibrate, train and time; rank 0's results."""
    import json

    from ..launch import run_processes
    P = int(args.measure_procs)
    if P < 2:
        raise SystemExit("megamoe bench placement: --measure-procs needs 2 or more processes (0 skips)")
    if not getattr(args, "measure_threads", 0):
        args.measure_threads = max(1, (os.cpu_count() or 1) // P)
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        result = os.path.join(d, "result.json")
        profile_path = args.measure_profile_out or os.path.join(d, "profile.json")
        run_processes(_worker, P, args, profile_path, result, threads=args.measure_threads,
                      label="bench placement (measured)")
        with open(result) as f:
            res = json.load(f)
        with open(profile_path) as f:
            res["profile"]["json"] = json.load(f)
    if args.measure_profile_out:
        res["profile"]["path"] = args.measure_profile_out
    else:
        res["profile"]["path"] = "(temporary)"
    res["wall_s"] = time.perf_counter() - t0
    res["cpus"] = os.cpu_count() or 1
    res["load_avg"] = [load_before, os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")]
    return res


# --- report -------------------------------------------------------------------------------------------------------
def report(res: dict) -> str:
    P = res["procs"]
    where = f"measured here (CPU, gloo, {P} procs)"
    prof = res["profile"]
    lines = [f"# MEASURED here: {P} gloo processes on this machine's CPU ({res['threads']} thread(s) each, torch "
             f"{res['torch']}), real training steps",
             "",
             f"model: {res['layers']} MoE layer(s) in a residual stack, H={res['hidden']} F={res['ffn']} "
             f"E={res['experts']} ({res['experts'] // P} per rank), top-{res['top_k']} dropless, "
             f"{res['tokens_per_rank']} tokens per rank per step, MSE loss, Adam; gate bench_zipf_drift: Zipf skew "
             f"{res['skew']:g} drifting {res['drift']:g} positions/step (hottest experts start on rank 0), the same "
             f"routing in every strategy",
             f"timing: forward + backward + gate all-reduce + Adam + after-step hook, slowest rank, "
             f"{res['steps']} steps after {res['warmup']} warmup, strategies interleaved step by step; FlexMoE: 1 "
             f"spare slot per rank, threshold {res['threshold']:g}, at most {res['max_moves']} moves per layer per "
             f"step",
             f"machine: {res.get('cpus', '?')} CPU cores, 1-minute load average {res['load_avg'][0]:.1f} before / "
             f"{res['load_avg'][1]:.1f} after (these processes included){_load_note(res)}",
             f"planners' cost model: profile {prof['name']!r}, {prof['kind']} in {prof['seconds']:.1f} s: GEMM "
             f"{prof['gemm_gflops']:.1f} GFLOP/s per rank, link {prof['a2a_gbps']:.2f} GB/s, alpha "
             f"{prof['alpha_us']:.0f} us" + (f"; {prof['note']}" if prof.get("note") else ""),
             "",
             "| strategy | measured ms/step (median) | mean | speedup vs static (measured: median / mean) | moves | "
             "MB moved | replicas (last step) | shadowed (last step; steps with any) | balance ratio (first / "
             "timed mean / last) | after-step hook ms/step | cost model ms/step (MoE layers) | where |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        lines.append(
            f"| {r['strategy']} | {r['median_s'] * 1e3:.1f} | {r['mean_s'] * 1e3:.1f} | {r['speedup']:.2f}x / "
            f"{r['speedup_mean']:.2f}x | {r['moves']} | {r['bytes_moved'] / 1e6:.1f} | {r['replicas_last']} | "
            f"{r['shadowed_last']}; {r['shadowed_steps']} | {r['balance_first']:.2f} / {r['balance_mean']:.2f} / "
            f"{r['balance_last']:.2f} | {r['hook_s'] * 1e3:.1f} | {r['predicted_s'] * 1e3:.1f} | {where} |")
    ok = res["loss_max_rel_diff"] <= res["loss_rtol"]
    diffs = ", ".join(f"{r['strategy']} {r['loss_max_rel_diff']:.1e}" for r in res["rows"][1:])
    rows = {r["strategy"]: r for r in res["rows"]}
    lines += ["",
              f"same math: mean loss over ranks at each of the {len(res['rows'][0]['losses'])} steps, max relative "
              f"difference from static EP: {diffs} (tolerance {res['loss_rtol']:g}): {'OK' if ok else 'FAILED'}; "
              f"loss {res['rows'][0]['losses'][0]:.5f} -> {res['rows'][0]['losses'][-1]:.5f}",
              f"FlexMoE over shadowing, measured: {rows['shadow']['median_s'] / rows['flexmoe']['median_s']:.2f}x "
              f"(median step; mean {rows['shadow']['mean_s'] / rows['flexmoe']['mean_s']:.2f}x). Medians are the "
              f"headline: steady-state steps on a machine other processes may share; the moves happen in the first "
              f"hook runs (warmup), so the timed steps are the placement's steady state, not its transition.",
              f"moves = Expand/Shrink/Migrate executed over all steps (warmup included); MB moved = parameters + "
              f"Adam state sent point to point; replicas = vExperts beyond one per expert + shadow copies; cost model "
              f"= the planners' profile's prediction of the MoE layers' step (no gate, Adam, Python) for the routed "
              f"counts; wall time of the measured part {res.get('wall_s', float('nan')):.1f} s."]
    return "\n".join(lines)


def _load_note(res: dict) -> str:
    if "load_avg" not in res or not res["load_avg"][0] + res["procs"] > res.get("cpus", 1) + 0.5:
        return ""
    return (f": the cores were oversubscribed (load before + {res['procs']} ranks > {res.get('cpus')} cores), so the "
            "ranks competed for CPU time and the total work, not only the busiest rank's, set the pace; balancing "
            "gains shrink under such load")


def add_arguments(p) -> None:
    g = p.add_argument_group("measured part (gloo processes on this machine)")
    g.add_argument("--measure-procs", type=int, default=2, help="gloo processes (default 2; 0 skips the measured part)")
    g.add_argument("--measure-steps", type=int, default=12, help="timed steps per strategy (default 12)")
    g.add_argument("--measure-warmup", type=int, default=3, help="untimed first steps (default 3)")
    g.add_argument("--measure-layers", type=int, default=2)
    g.add_argument("--measure-hidden", type=int, default=256)
    g.add_argument("--measure-ffn", type=int, default=1024)
    g.add_argument("--measure-experts-per-rank", type=int, default=2)
    g.add_argument("--measure-tokens", type=int, default=1024,
                   help="tokens per rank per step (default 1024: enough expert compute that balancing it outweighs "
                        "the placement's collectives on CPU gloo)")
    g.add_argument("--measure-skew", type=float, default=2.0,
                   help="Zipf exponent of the gate's popularity (default 2: balance ratio ~1.55 on 2 ranks x 2 "
                        "experts, top-2)")
    g.add_argument("--measure-drift", type=float, default=0.02, help="popularity ranking drift per step")
    g.add_argument("--measure-lr", type=float, default=1e-3)
    g.add_argument("--measure-threads", type=int, default=0, help="threads per process (0: cores / procs)")
    g.add_argument("--measure-profile", default="calibrate",
                   help="the planners' cost model: calibrate (default) | gemm (measured GEMM, assumed network) | a "
                        "named profile or JSON path")
    g.add_argument("--measure-profile-out", default=None, help="keep the profile JSON used here at this path")
