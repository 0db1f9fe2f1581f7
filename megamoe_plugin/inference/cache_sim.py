"""Expert-buffering cache simulator over recorded routing traces (paper 004 §VI-C, Fig. 12).

Expert buffering (paper 004 §VI) keeps every expert's weights in CPU memory and a cache of ``cache_size`` expert
slots per device; an expert is *active* on its device in a batch when it receives at least one token (from any
source rank), and an active expert that is not in the device's cache is a miss (its weights are copied in). The
paper replays traces of expert activations through such a per-device cache, varies the cache size from 1 to the
experts per device, and reports the *worst-case* miss rate over layers (and devices) per policy, against Belady's
MIN (the offline optimum that sees the future). This module does the same for the traces ``stats.TraceRecorder``
writes.

Access model (shared by every policy, so their miss counts are comparable):
* batch = one trace row (one recorded step); per layer, expert e is active in batch b when its count summed over
  the source ranks is > 0 (``activity``);
* expert e lives on device ``e // (E // D)`` (contiguous blocks, the identity placement) or on
  ``placement[e]`` (a load-balancing placement, ``balance.py``); each device has its own cache of
  ``cache_size`` slots and sees only its own experts (``E_local = E // D`` of them);
* within a batch the device runs its active experts one after another in ascending expert id (the order MoE
  Transformers execute them in, paper 004 §VI-B, and the order a permuted expert bank keeps, ``balance.py``): the
  access sequence of a (layer, device) is batch by batch, ascending expert id within a batch. Each access is a
  hit or a miss; a miss with a full cache evicts one resident expert. Cold misses count.
* the online policies (``lifo`` - the paper's -, ``fifo``, ``lru``, ``lfu``) are ``eviction.ExpertSlotCache``:
  experts inactive in the current batch are evicted first, then by the policy. The simulator replays the cache's
  slot plan and checks it is consistent (a hit is on the slot holding the expert, a load evicts that slot's
  occupant).
* ``belady``: Belady's MIN over the same access sequence: on a miss with a full cache, evict the resident expert
  whose next access is farthest in the future (never again = infinitely far; ties: one inactive in the current
  batch, then the lowest id). An expert still needed later in the current batch always has a nearer next access
  than any expert needed only in later batches, so MIN never evicts it while such an expert is resident: the
  online policies' "inactive in this batch first" rule holds for it too. MIN is optimal for this demand-paging
  model, so no policy has fewer misses on the same trace.

Miss rate of a (layer, device) = misses / accesses (0 when the device had no access). ``miss_curve`` sweeps the
cache size 1..E_local and reports per policy the worst case (max over layers and devices: Fig. 12's metric), the
mean over the (layer, device) cells that had accesses, and the pooled rate (all misses / all accesses), with the
static memory saved: a cache of c slots keeps c of the E_local experts of every MoE layer on the device, so
``1 - c / E_local`` of the device's expert parameters (and ``(1 - c / E_local) * expert_params / total_params`` of
all parameters when the counts are given: pass whole-model counts for the model's share, a device's counts for the
device's share; the paper reports 0-32.2% of total static memory for its MT decoder).
"""
from __future__ import annotations

import heapq
import math
import os
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
from .eviction import ExpertSlotCache

__all__ = ["POLICIES", "activity", "layer_placements", "access_sequences", "simulate", "simulate_counts",
           "belady_misses", "online_misses", "miss_curve", "format_miss_table", "plot_miss_curve"]

ONLINE_POLICIES = ("lifo", "fifo", "lru", "lfu")
POLICIES = ONLINE_POLICIES + ("belady",)

Placement = Union[None, Sequence[int], Mapping[int, Sequence[int]], Sequence[Sequence[int]]]


# --- inputs ------------------------------------------------------------------------------------------------------
def activity(trace) -> np.ndarray:
    """Per-batch expert activity, bool [S, L, E], from ``load_trace``'s dict, its counts [S, L, P, E] (summed over
    the source ranks P), counts or activity [S, L, E], or [S, E] (one layer)."""
    if isinstance(trace, Mapping):
        trace = trace["counts"]
    a = trace.detach().cpu().numpy() if hasattr(trace, "detach") else np.asarray(trace)
    if a.ndim == 4:
        a = a.sum(axis=2)
    elif a.ndim == 2:
        a = a[:, None, :]
    elif a.ndim != 3:
        raise ValueError(f"trace counts must be [S, L, P, E], [S, L, E] or [S, E]; got shape {a.shape}")
    if a.dtype != bool and (a < 0).any():
        raise ValueError("trace counts must be non-negative")
    return a > 0


def _check_device_of_expert(dev: Sequence[int], num_experts: int, num_devices: int, what: str) -> List[int]:
    dev = [int(d) for d in dev]
    if len(dev) != num_experts:
        raise ValueError(f"{what}: {len(dev)} entries for {num_experts} experts")
    if any(d < 0 or d >= num_devices for d in dev):
        raise ValueError(f"{what}: device ids must be in [0, {num_devices}), got {sorted(set(dev))}")
    per = np.bincount(dev, minlength=num_devices)
    if (per != num_experts // num_devices).any():
        raise ValueError(f"{what}: every device must hold {num_experts // num_devices} experts, got "
                         f"{per.tolist()}")
    return dev


def layer_placements(placement: Placement, num_layers: int, num_experts: int, num_devices: int) -> List[List[int]]:
    """device_of_expert [E] per layer from None (contiguous blocks), one list for every layer, a list of L lists,
    or a dict {layer index (position in the trace): list} (missing layers: contiguous blocks)."""
    if num_devices < 1 or num_experts % num_devices:
        raise ValueError(f"{num_experts} experts cannot be split evenly over {num_devices} devices")
    per = num_experts // num_devices
    identity = [e // per for e in range(num_experts)]
    if placement is None:
        return [identity] * num_layers
    if isinstance(placement, Mapping):
        bad = [k for k in placement if not 0 <= int(k) < num_layers]
        if bad:
            raise ValueError(f"placement for layer index(es) {bad}, the trace has {num_layers} layer(s)")
        return [_check_device_of_expert(placement[l], num_experts, num_devices, f"placement of layer index {l}")
                if l in placement else identity for l in range(num_layers)]
    placement = list(placement)
    if placement and not np.isscalar(placement[0]):
        if len(placement) != num_layers:
            raise ValueError(f"{len(placement)} per-layer placements for {num_layers} layer(s)")
        return [_check_device_of_expert(p, num_experts, num_devices, f"placement of layer index {l}")
                for l, p in enumerate(placement)]
    return [_check_device_of_expert(placement, num_experts, num_devices, "placement")] * num_layers


def access_sequences(active: np.ndarray, num_devices: int, placement: Placement = None
                     ) -> List[List[List[List[int]]]]:
    """[layer][device][batch] -> the device's active experts of that batch as local ids (ascending), where local
    id i is the i-th smallest expert id on the device."""
    S, L, E = active.shape
    out = []
    for l, dev in enumerate(layer_placements(placement, L, E, num_devices)):
        dev = np.asarray(dev)
        per_device = []
        for d in range(num_devices):
            experts = np.flatnonzero(dev == d)            # ascending global ids = local ids 0..E_local-1
            sub = active[:, l, experts]
            per_device.append([np.flatnonzero(row).tolist() for row in sub])
        out.append(per_device)
    return out


# --- policies ----------------------------------------------------------------------------------------------------
def belady_misses(batches: Sequence[Sequence[int]], cache_size: int) -> int:
    """Misses of Belady's MIN on one device's access sequence (batches of ascending local ids; module docstring)."""
    if cache_size < 1:
        raise ValueError(f"cache size must be >= 1, got {cache_size}")
    seq: List[Tuple[int, int]] = [(b, e) for b, batch in enumerate(batches) for e in batch]
    n = len(seq)
    nxt = [math.inf] * n
    last: Dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        e = seq[i][1]
        nxt[i] = last.get(e, math.inf)
        last[e] = i
    resident: Dict[int, float] = {}          # expert -> position of its next access
    heap: List[Tuple[float, int, int]] = []  # (-next access, -expert, expert); stale entries skipped
    misses = 0
    for i, (b, e) in enumerate(seq):
        if e not in resident:
            misses += 1
            if len(resident) >= cache_size:
                victim = _pop_farthest(heap, resident, batches[b])
                del resident[victim]
        resident[e] = nxt[i]
        heapq.heappush(heap, (-nxt[i], e, e))
    return misses


def _pop_farthest(heap, resident, batch) -> int:
    """The resident expert whose next access is farthest; among those never used again, one not active in the
    current batch, then the lowest id (ties do not change the miss count)."""
    top = None
    while heap:
        neg, _, e = heap[0]
        if resident.get(e) != -neg:
            heapq.heappop(heap)                      # stale: re-pushed with a newer next access, or evicted
            continue
        top = -neg
        break
    if top is None:
        raise RuntimeError("Belady: full cache with no resident expert")
    if top != math.inf:
        return heapq.heappop(heap)[2]
    never = sorted(e for e, t in resident.items() if t == math.inf)
    active = set(batch)
    victim = next((e for e in never if e not in active), never[0])
    return victim                                     # its heap entry becomes stale once deleted from resident


def _slot_cache_class():
    return ExpertSlotCache


def online_misses(batches: Sequence[Sequence[int]], cache_size: int, policy: str) -> int:
    """Misses of ``eviction.ExpertSlotCache(cache_size, policy)`` on one device's access sequence; the cache's
    slot plan is replayed and checked (a RuntimeError names the first inconsistency)."""
    if policy not in ONLINE_POLICIES:
        raise ValueError(f"unknown online policy {policy!r}; known: {', '.join(ONLINE_POLICIES)}")
    if cache_size < 1:
        raise ValueError(f"cache size must be >= 1, got {cache_size}")
    cache = _slot_cache_class()(cache_size, policy)
    slots: Dict[int, int] = {}                   # slot -> expert, as replayed from the plans
    where: Dict[int, int] = {}                   # expert -> slot
    misses = 0
    for b, batch in enumerate(batches):
        if not batch:
            continue
        plan = cache.plan_batch(list(batch))
        if [int(p[0]) for p in plan] != list(batch):
            raise RuntimeError(f"{policy}: batch {b}: the plan covers experts {[p[0] for p in plan]}, "
                               f"expected {list(batch)} in ascending order")
        for expert, slot, loaded, evicted in plan:
            expert, slot = int(expert), int(slot)
            if not 0 <= slot < cache_size:
                raise RuntimeError(f"{policy}: batch {b}: expert {expert} in slot {slot} of a {cache_size}-slot cache")
            if loaded:
                misses += 1
                if expert in where:
                    raise RuntimeError(f"{policy}: batch {b}: expert {expert} loaded while resident in slot "
                                       f"{where[expert]}")
                if slots.get(slot) != (None if evicted is None else int(evicted)):
                    raise RuntimeError(f"{policy}: batch {b}: loading expert {expert} into slot {slot} reports "
                                       f"evicting {evicted}, the slot held {slots.get(slot)}")
                if slot in slots:
                    del where[slots[slot]]
                slots[slot], where[expert] = expert, slot
            elif slots.get(slot) != expert:
                raise RuntimeError(f"{policy}: batch {b}: hit on expert {expert} in slot {slot}, which holds "
                                   f"{slots.get(slot)}")
    if int(getattr(cache, "misses", misses)) != misses:
        raise RuntimeError(f"{policy}: the cache counts {cache.misses} misses, its plans {misses}")
    return misses


def _device_misses(batches, cache_size: int, policy: str) -> int:
    if policy == "belady":
        return belady_misses(batches, cache_size)
    return online_misses(batches, cache_size, policy)


# --- simulation --------------------------------------------------------------------------------------------------
def simulate_counts(trace, num_devices: int, cache_size: int, policy: str, placement: Placement = None
                    ) -> Tuple[np.ndarray, np.ndarray]:
    """(misses, accesses), int arrays [L, D], of a per-device cache of `cache_size` slots under `policy`
    (lifo | fifo | lru | lfu | belady) replaying `trace` (see ``activity``); `placement` as ``layer_placements``."""
    if policy not in POLICIES:
        raise ValueError(f"unknown cache policy {policy!r}; known: {', '.join(POLICIES)}")
    seqs = access_sequences(activity(trace), num_devices, placement)
    L = len(seqs)
    misses = np.zeros((L, num_devices), dtype=np.int64)
    accesses = np.zeros((L, num_devices), dtype=np.int64)
    for l in range(L):
        for d in range(num_devices):
            batches = seqs[l][d]
            accesses[l, d] = sum(len(b) for b in batches)
            misses[l, d] = _device_misses(batches, cache_size, policy)
    return misses, accesses


def _rates(misses: np.ndarray, accesses: np.ndarray) -> np.ndarray:
    return np.where(accesses > 0, misses / np.maximum(accesses, 1), 0.0)


def simulate(trace, num_devices: int, cache_size: int, policy: str, placement: Placement = None) -> np.ndarray:
    """Miss rate per layer per device, float [L, D] (0 where a device had no access); see ``simulate_counts``."""
    return _rates(*simulate_counts(trace, num_devices, cache_size, policy, placement))


def miss_curve(trace, num_devices: int, sizes: Optional[Sequence[int]] = None,
               policies: Sequence[str] = ("lifo", "fifo", "lru", "lfu", "belady"), placement: Placement = None,
               expert_params: Optional[float] = None, total_params: Optional[float] = None) -> dict:
    """Miss rate against cache size per device (Fig. 12). Returns a dict:
    sizes, num_devices, experts_per_device, memory_saved (of the expert parameters, per size),
    memory_saved_total (share of all parameters, when `expert_params` and `total_params` are given, else None),
    and per policy: worst[policy] (max over layers and devices), mean[policy] (over the cells with accesses),
    pooled[policy] (all misses / all accesses), per_cell[policy] (the [L, D] rates, as nested lists)."""
    active = activity(trace)
    S, L, E = active.shape
    if num_devices < 1 or E % num_devices:
        raise ValueError(f"{E} experts cannot be split evenly over {num_devices} devices")
    per = E // num_devices
    sizes = list(range(1, per + 1)) if sizes is None else [int(c) for c in sizes]
    if any(c < 1 for c in sizes):
        raise ValueError(f"cache sizes must be >= 1, got {sizes}")
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"unknown cache policy {p!r}; known: {', '.join(POLICIES)}")
    seqs = access_sequences(active, num_devices, placement)
    accesses = np.array([[sum(len(b) for b in seqs[l][d]) for d in range(num_devices)] for l in range(L)])
    out = {"sizes": sizes, "num_devices": num_devices, "experts_per_device": per, "layers": L, "batches": S,
           "memory_saved": [max(0.0, 1.0 - c / per) for c in sizes], "memory_saved_total": None,
           "worst": {}, "mean": {}, "pooled": {}, "per_cell": {}}
    if expert_params is not None and total_params is not None:
        if not 0 < expert_params <= total_params:
            raise ValueError(f"expert parameters ({expert_params}) must be > 0 and <= total ({total_params})")
        out["memory_saved_total"] = [s * expert_params / total_params for s in out["memory_saved"]]
    has = accesses > 0
    for p in policies:
        worst, mean, pooled, cells = [], [], [], []
        for c in sizes:
            misses = np.array([[_device_misses(seqs[l][d], c, p) for d in range(num_devices)] for l in range(L)])
            r = _rates(misses, accesses)
            worst.append(float(r.max()) if r.size else 0.0)
            mean.append(float(r[has].mean()) if has.any() else 0.0)
            pooled.append(float(misses.sum() / accesses.sum()) if accesses.sum() else 0.0)
            cells.append(r.tolist())
        out["worst"][p], out["mean"][p], out["pooled"][p], out["per_cell"][p] = worst, mean, pooled, cells
    return out


# --- reporting ---------------------------------------------------------------------------------------------------
def format_miss_table(curve: dict) -> str:
    """Markdown table: one row per cache size, per policy the worst-case / mean miss rate."""
    policies = list(curve["worst"])
    head = ["cache/device", "expert mem saved"] + (["total mem saved"] if curve["memory_saved_total"] else []) + \
        [f"{p} worst / mean" for p in policies]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for i, c in enumerate(curve["sizes"]):
        row = [str(c), f"{100 * curve['memory_saved'][i]:.1f}%"]
        if curve["memory_saved_total"]:
            row.append(f"{100 * curve['memory_saved_total'][i]:.1f}%")
        row += [f"{curve['worst'][p][i]:.3f} / {curve['mean'][p][i]:.3f}" for p in policies]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot_miss_curve(curve: dict, path: str, title: Optional[str] = None) -> str:
    """PNG of miss rate against cache size per device, one colour per policy (Fig. 12's shape): worst case over
    layers and devices (solid, the paper's metric) and the mean (dashed). Returns path."""
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    x = curve["sizes"]
    for i, p in enumerate(curve["worst"]):
        color = f"C{i}"
        ax.plot(x, curve["worst"][p], "-o", color=color, markersize=3, label=f"{p} (worst case)")
        ax.plot(x, curve["mean"][p], "--", color=color, linewidth=1, alpha=0.7, label=f"{p} (mean)")
    ax.set_xlabel(f"cache size per device (experts, of {curve['experts_per_device']})")
    ax.set_ylabel("cache miss rate")
    ax.set_ylim(0, 1.02)
    ax.set_xticks(x)
    ax.grid(alpha=0.3)
    ax.set_title(title or f"Expert buffering miss rate, {curve['num_devices']} device(s), "
                          f"{curve['layers']} layer(s), {curve['batches']} batches")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
