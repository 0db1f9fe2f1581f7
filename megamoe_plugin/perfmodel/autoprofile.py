"""The planners' default cost model: a short calibration of the running job's own process groups (``--moe-placement-
profile auto``), so FlexMoE and shadowing decide with the cluster they run on rather than a paper's.

``auto_profile(shape, ...)`` (collective over the default group; the after-step hook calls it at the planners'
first run, every rank at the same point):

1. looks up a cached profile for this cluster's signature (world size, the launcher's topology and its bandwidths,
   each rank's CPU share, device, cores, torch version, the experts' hidden/FFN sizes and dtype) in ``~/.cache/megamoe/profiles`` (or
   ``$MEGAMOE_PROFILE_CACHE``); rank 0 decides and broadcasts, so every rank uses the same numbers;
2. otherwise measures, in well under a second on CPU: the expert FFN's forward+backward at the job's own
   hidden/FFN sizes with every rank at once (and rank 0 alone: ranks sharing one machine's cores become a shared
   compute pool; not where every rank is capped to a CPU share, ``fixed_speed_ranks``), the point-to-point
   alpha-beta of every level of the topology (``Topology.measure``), the latency of a small all-to-all, a
   broadcast + reduce of one expert (what shadowing costs, with the library's own algorithm) and the fixed cost
   of a tiny MoE layer step; fits a ``HardwareProfile`` and caches it.

The calibration is taken once per job; a cluster whose speed changed is measured again by removing its cached file
(or with ``megamoe perf calibrate``).
"""
from __future__ import annotations

import hashlib
import os
import platform
import time

import torch
import torch.distributed as dist

from .profiles import HardwareProfile
from ..topology import Topology
from .calibrate import LayerCase, _fit_line, _timed, measure_alltoall, measure_gemm, measure_layer

CACHE_ENV = "MEGAMOE_PROFILE_CACHE"
METHOD = 2                    # the calibration's method: a profile cached by an older one is measured again


def cache_dir() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "megamoe", "profiles")


def signature(hidden: int, ffn: int, dtype: torch.dtype, world: int, device: str) -> str:
    """What the measured numbers depend on: how they were measured (``METHOD``), the cluster (launcher topology
    and bandwidths, world, host), the machine (device, cores, torch) and the experts' shape."""
    shaping = os.environ.get("MEGAMOE_CLUSTER_SHAPING")       # the emulated cluster's settings, not its probe
    parts = [f"method={METHOD}", f"world={world}", f"topology={os.environ.get('MEGAMOE_TOPOLOGY', '')}",
             f"bw={shaping or os.environ.get('MEGAMOE_TOPOLOGY_BANDWIDTH_GBPS', '')}",
             f"local={os.environ.get('LOCAL_WORLD_SIZE', '')}", f"host={platform.node()}", f"device={device}",
             f"cpu_share={os.environ.get('MEGAMOE_CPU_SHARE', '')}",
             f"cores={os.cpu_count()}", f"threads={torch.get_num_threads()}", f"torch={torch.__version__}",
             f"shape={hidden}x{ffn}", f"dtype={dtype}"]
    return hashlib.sha1(";".join(parts).encode()).hexdigest()[:16]


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _broadcast_json(obj) -> object:
    if _world() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def auto_profile(hidden: int, ffn: int, dtype: torch.dtype = torch.float32, log=None) -> HardwareProfile:
    """The cached or freshly measured profile of this job (collective; see the module docstring)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sig = signature(hidden, ffn, dtype, _world(), device)
    path = os.path.join(cache_dir(), f"{sig}.json")
    cached = None
    if _rank() == 0 and os.path.isfile(path):
        try:
            cached = HardwareProfile.load(path).to_dict()
        except (ValueError, OSError, KeyError):
            cached = None
    cached = _broadcast_json(cached)
    if cached is not None:
        if log:
            log(f"placement cost model: the cached calibration of this cluster ({path})")
        return HardwareProfile.from_dict(cached)
    t0 = time.perf_counter()
    profile = measure_profile(hidden, ffn, dtype, torch.device(device))
    profile.name = f"auto-{sig}"
    if _rank() == 0:
        os.makedirs(cache_dir(), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        profile.save(tmp)
        os.replace(tmp, path)
    if log:
        log(f"placement cost model: calibrated this cluster in {time.perf_counter() - t0:.1f}s: "
            f"{profile.gemm_tflops * 1e3:.1f} GFLOP/s per rank"
            + (f" (pool {profile.shared_gemm_tflops * 1e3:.1f})" if profile.shared_gemm_tflops else "")
            + f", links {profile.intra_bandwidth_gbps:.3g} / {profile.nic_bandwidth_gbps:.3g} GB/s "
            f"(intra / inter-node), cached in {path}")
    return profile


def fixed_speed_ranks() -> bool:
    """Whether every rank of the job is capped to a CPU share (``MEGAMOE_CPU_SHARE``, set by ``megamoe cluster
    run --cpu-share``) and the shares add up to no more than this machine's cores: each rank is then a device of
    fixed speed by construction, and no compute pool is shared. Measuring it instead (rank 0 alone against every
    rank at once) is unreliable there: capped ranks that are idle between the two measurements ran rank 0 alone
    1.2-1.9x faster from one calibration to the next on the same 2-core machine, and a pool detected that way
    makes every rebalancing look worthless to the planners. Collective (one all-reduce)."""
    own = os.environ.get("MEGAMOE_CPU_SHARE", "")
    try:
        share = float(own) if own else -1.0
    except ValueError:
        share = -1.0
    t = torch.tensor([max(share, 0.0), 1.0 if share > 0 else 0.0], dtype=torch.float64)
    if _world() > 1:
        dist.all_reduce(t)
    return int(t[1]) == _world() and float(t[0]) <= (os.cpu_count() or 1) * 1.0001


def measure_profile(hidden: int, ffn: int, dtype: torch.dtype, device: torch.device) -> HardwareProfile:
    """Collective: the micro-benchmarks of the module docstring, a HardwareProfile of this job."""

    world = _world()
    group = dist.group.WORLD if world > 1 else None
    # a rank capped by a CPU quota (megamoe cluster run --cpu-share) runs in bursts of the quota's period: each
    # point must span many periods to give the rate the rank sustains, not one burst's
    capped = bool(os.environ.get("MEGAMOE_CPU_SHARE")) and device.type == "cpu"
    tokens, iters = ((512, 2048), 3) if capped else ((128, 512), 2)
    gemm = measure_gemm(hidden, ffn, tokens=tokens, iters=iters, device=device, dtype=dtype, group=group)
    flops, shared = gemm["flops"], 0.0
    if world > 1 and device.type == "cpu" and not fixed_speed_ranks():
        solo = torch.tensor([flops], dtype=torch.float64)
        if _rank() == 0:
            solo[0] = measure_gemm(hidden, ffn, tokens=tokens, iters=iters, device=device, dtype=dtype)["flops"]
        dist.broadcast(solo, 0)
        if float(solo) > 1.25 * flops:                 # ranks sharing one machine's cores
            flops, shared = float(solo), flops * world
    if world == 1:
        return HardwareProfile(name="auto", description="one process", source="measured at start-up",
                               gemm_tflops=flops / 1e12, intra_bandwidth_gbps=1e3, nic_bandwidth_gbps=1e3,
                               bytes_per_element=torch.tensor([], dtype=dtype).element_size())
    topo = Topology.from_env(world_size=world).measure(group, large_bytes=1 << 21, iters=2)
    a2a = measure_alltoall(group, sizes=(1 << 12, 1 << 16), iters=2, device=device)
    bcast_bw, bcast_lat = measure_broadcast(group, hidden * ffn * 2 * torch.tensor([], dtype=dtype).element_size(),
                                            device)
    overhead, _ = measure_layer(LayerCase(64, 64, world, 16, top_k=1), group, iters=2, device=device)
    local = topo.ranks_per_node()
    multi = topo.depth >= 2 and world > local
    return HardwareProfile(
        name="auto", description=f"this job: {world} ranks ({max(world // local, 1)} node(s) x {local}) on "
                                 f"{device.type}, measured at start-up",
        source="measured at start-up by the placement policy: expert FFN fwd+bwd at the job's shape (all ranks at "
               "once, and rank 0 alone), ping-pong per topology level, small all-to-all latency",
        nodes=max(world // local, 1), gpus_per_node=local, gemm_tflops=flops / 1e12, intra="switch",
        intra_bandwidth_gbps=topo.bandwidth_gbps[0] if multi else a2a["bandwidth"] / 1e9,
        nic_bandwidth_gbps=topo.bandwidth_gbps[-1],
        intra_latency_us=topo.latency_us[0] if multi else a2a["alpha_s"] * 1e6, nic_latency_us=topo.latency_us[-1],
        bytes_per_element=torch.tensor([], dtype=dtype).element_size(), shared_gemm_tflops=shared / 1e12,
        bcast_gbps=bcast_bw / 1e9, bcast_latency_us=bcast_lat * 1e6, layer_overhead_us=overhead * 1e6)


def measure_broadcast(group, expert_bytes: int, device) -> tuple:
    """(bytes/s, latency s) of a broadcast and a reduce from rank 0 over the group, fitted on a small message and
    one expert's parameters: what a shadowed expert costs, with the collective library's real algorithm."""
    xs, ys = [], []
    for nbytes in (1 << 10, max(int(expert_bytes), 1 << 12)):
        buf = torch.zeros(max(nbytes // 4, 1), device=device)

        def both():
            dist.broadcast(buf, 0, group=group)
            dist.reduce(buf, 0, group=group)
        xs.append(float(nbytes))
        ys.append(_timed(both, 2, 1, device, group) / 2)
    alpha, inv_bw = _fit_line(xs, ys)
    return (1.0 / inv_bw if inv_bw > 0 else xs[-1] / ys[-1]), max(alpha, 0.0)
