"""Expert load balancing for inference deployment (paper 004 §VII, Fig. 14): placements from historical
activation data, their evaluation, the placement file, and applying a placement to a model as an expert
permutation.

Data. ``loads`` [B, E] is one MoE layer's per-batch per-expert load (token counts, e.g. a routing trace's
[S, L, P, E] counts summed over the source ranks: ``layer_loads``). The paper's activation matrix A_mb is the
fraction of batch b's tokens assigned to expert m (``shares``: each batch's row divided by its total, so a
device's share of a batch is the share of the batch's expert work it computes; with top-k routing the total is
the batch's kept assignments). Ã_m is expert m's average share over the fitting batches.

Placement = ``device_of_expert`` [E] with the same number of experts, E / D, on every device (the paper's
constraint sum_m P_mn = E / D).

* ``greedy_placement`` (§VII-A): experts by descending Ã_m (ties: lower id first), each to the device with the
  smallest load sum_{m on n} Ã_m among the devices that still have room (ties: lower device id); a device that
  reaches E / D experts leaves the candidates.
* ``anticorrelation_placement`` (§VII-B): the same greedy pass, but placing expert a the load of device n becomes
  sum_{m on n} (Ã_m + w * S_am), S the Pearson correlation of the experts' shares over the fitting batches (0 for
  an expert whose share never changes) and w = 0.5 in the paper: an expert goes preferably next to experts it is
  anti-correlated with, so the experts that are busy together end up on different devices.
* ``eplb_placement``: DeepSeek's EPLB (``placement/eplb.py``) without redundant slots, as a permutation file
  holds one copy per expert: experts packed onto nodes (``nodes`` contiguous groups of devices), then onto the
  node's devices, each time heaviest first into the lightest pack with room (hierarchical balanced packing).
* ``max_load`` / ``avg_max_load`` (§VII-A): per batch, the max over devices of the device's share of the batch;
  Max Load is the max over batches (worst case: out-of-memory risk), Avg Max Load the mean over batches (average
  bottleneck). Both are shares of the batch's tokens ("normalized by the total batch size"): 1/D is perfect
  balance, 1 means one device computes everything. Batches without tokens are skipped.
* ``evaluate_placements``: the paper's protocol, fit on the first half of the batches, Max Load / Avg Max Load
  on the held-out second half, for the identity (contiguous blocks), greedy and anti-correlation placements.

Placement file (``--moe-placement-file``, written by ``megamoe balance``): JSON
``{"schema": "megamoe-placement/1", "num_experts": E, "layers": {"<layer id>": perm}, "meta": {...}}`` where
``perm[new_slot] = old_expert`` is a permutation of 0..E-1 and devices get consecutive slots: device d holds new
slots d*E/D .. (d+1)*E/D - 1, i.e. the experts placed on it, in ascending old id (``placement_to_perm``). Layer ids
are the ids the trace recorded (core ``MoELayer.layer_id``, Megatron's layer number).

``apply_expert_permutation(layer, perm)`` moves expert perm[s] to slot s in place: the rows of the gate's
per-expert parameters (the router weight, any per-expert bias), the ExpertBank's w1/w2/b1/b2 rows (gathered from
the owning ranks with one all-to-all per parameter when the experts are spread over an expert-parallel group),
the layer's fixed per-expert capacities and its assignment-cache entries. The layer computes the same function
afterwards (outputs and gradients, up to the permutation of the expert dimension), it just runs its experts in
another place. Gate buffers that describe where a *slot* lives (Hir's ``local_expert``, TA-MoE's ``target`` and
``loss_weight``) are not moved: they belong to the slot's rank; with a multi-node topology the hir gate's routing
and TA-MoE's aux loss therefore follow the new locality, as they should. Parameters are written in place (the same
``nn.Parameter`` objects; their version counters change, so an enabled expert buffer, ``buffering.py``, reloads);
gradients present are permuted too, optimizer state is not: apply it at load time, before an optimizer has state.
A dynamic placement that has replicated, moved or shadowed experts, and spare vExpert slots, are refused.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from ..experts import ExpertBank
from ..gates.base import Gate
from ..layer import find_moe_layers
from ..placement.eplb import eplb_table

__all__ = ["PLACEMENT_SCHEMA", "PlacementFileError", "PlacementFile", "layer_loads", "shares",
           "identity_placement", "greedy_placement", "anticorrelation_placement", "eplb_placement", "device_shares", "max_load",
           "avg_max_load", "evaluate_placements", "placement_to_perm", "perm_to_placement",
           "write_placement_file", "read_placement_file", "apply_expert_permutation", "apply_placement_file",
           "moe_layers_by_id"]

PLACEMENT_SCHEMA = "megamoe-placement/1"
FLAG = "--moe-placement-file"
# gate buffers indexed by expert slot that describe where the slot lives (its rank / node), not the expert in it
SLOT_LOCATION_BUFFERS = ("local_expert", "target", "loss_weight")


# --- data --------------------------------------------------------------------------------------------------------
def layer_loads(trace, layer_index: int) -> np.ndarray:
    """[S, E] float64 per-batch per-expert tokens of one layer (position in the trace) from ``load_trace``'s dict or
    counts [S, L, P, E] (summed over the source ranks P) or [S, L, E]."""
    counts = trace["counts"] if isinstance(trace, Mapping) else trace
    a = counts.detach().cpu().numpy() if hasattr(counts, "detach") else np.asarray(counts)
    if a.ndim == 4:
        a = a.sum(axis=2)
    if a.ndim != 3:
        raise ValueError(f"trace counts must be [S, L, P, E] or [S, L, E]; got shape {a.shape}")
    return a[:, layer_index, :].astype(np.float64)


def _loads(loads) -> np.ndarray:
    a = loads.detach().cpu().numpy() if hasattr(loads, "detach") else np.asarray(loads)
    a = a.astype(np.float64)
    if a.ndim != 2:
        raise ValueError(f"loads must be [batches, experts], got shape {a.shape}")
    if (a < 0).any():
        raise ValueError("loads must be non-negative")
    return a


def shares(loads) -> np.ndarray:
    """A_mb as [B, E]: each batch's loads divided by the batch total (all-zero batches stay zero)."""
    a = _loads(loads)
    tot = a.sum(axis=1, keepdims=True)
    return np.divide(a, tot, out=np.zeros_like(a), where=tot > 0)


def _check_split(num_experts: int, num_devices: int) -> int:
    if num_devices < 1 or num_experts % num_devices:
        raise ValueError(f"{num_experts} experts cannot be split evenly over {num_devices} devices")
    return num_experts // num_devices


def _check_placement(device_of_expert: Sequence[int], num_experts: int, num_devices: int) -> np.ndarray:
    per = _check_split(num_experts, num_devices)
    dev = np.asarray([int(d) for d in device_of_expert], dtype=np.int64)
    if dev.shape != (num_experts,):
        raise ValueError(f"placement has {dev.size} entries for {num_experts} experts")
    if dev.size and (dev.min() < 0 or dev.max() >= num_devices):
        raise ValueError(f"placement device ids must be in [0, {num_devices})")
    counts = np.bincount(dev, minlength=num_devices)
    if (counts != per).any():
        raise ValueError(f"placement must put {per} experts on every device, got {counts.tolist()}")
    return dev


# --- placements ----------------------------------------------------------------------------------------------------
def identity_placement(num_experts: int, num_devices: int) -> List[int]:
    """Contiguous blocks: expert e on device e // (E / D) (what a model without a placement file does)."""
    per = _check_split(num_experts, num_devices)
    return [e // per for e in range(num_experts)]


def _greedy(avg: np.ndarray, num_devices: int, pair: Optional[np.ndarray]) -> List[int]:
    E = avg.size
    per = _check_split(E, num_devices)
    order = sorted(range(E), key=lambda m: (-avg[m], m))
    on = [[] for _ in range(num_devices)]
    dev = [-1] * E
    for a in order:
        best, best_load = None, None
        for n in range(num_devices):
            if len(on[n]) >= per:
                continue                               # full: removed from the candidates
            load = sum(avg[m] + (pair[a, m] if pair is not None else 0.0) for m in on[n])
            if best is None or load < best_load:
                best, best_load = n, load
        on[best].append(a)
        dev[a] = best
    return dev


def greedy_placement(loads, num_devices: int) -> List[int]:
    """Paper 004 §VII-A: device_of_expert [E] from the fitting batches' loads [B, E] (module docstring)."""
    return _greedy(shares(loads).mean(axis=0), num_devices, None)


def pearson(loads) -> np.ndarray:
    """S [E, E]: Pearson correlation of the experts' per-batch shares (0 where an expert's share is constant)."""
    a = shares(loads)
    c = a - a.mean(axis=0, keepdims=True)
    sd = np.sqrt((c * c).sum(axis=0))
    denom = np.outer(sd, sd)
    return np.divide(c.T @ c, denom, out=np.zeros((a.shape[1], a.shape[1])), where=denom > 0)


def anticorrelation_placement(loads, num_devices: int, weight: float = 0.5) -> List[int]:
    """Paper 004 §VII-B: greedy with device load sum_{m on n} (Ã_m + weight * S_am) when placing expert a."""
    return _greedy(shares(loads).mean(axis=0), num_devices, float(weight) * pearson(loads))


def eplb_placement(loads, num_devices: int, nodes: int = 1) -> List[int]:
    """DeepSeek's EPLB placement without redundant experts (module docstring): device_of_expert [E]."""
    E = _loads(loads).shape[1]
    per = _check_split(E, num_devices)
    if nodes < 1 or num_devices % nodes:
        raise ValueError(f"{num_devices} devices do not split into {nodes} node(s) of equal size")
    size = num_devices // nodes
    table = eplb_table(shares(loads).mean(axis=0).tolist(), [list(range(k * size, (k + 1) * size))
                                                              for k in range(nodes)], per, keep_free=0)
    dev = [-1] * E
    for d, row in enumerate(table):
        for e in row:
            dev[e] = d
    return dev


# --- evaluation ----------------------------------------------------------------------------------------------------
def device_shares(loads, device_of_expert: Sequence[int], num_devices: int) -> np.ndarray:
    """[B', D]: each device's share of every batch with tokens (B' <= B)."""
    a = _loads(loads)
    dev = _check_placement(device_of_expert, a.shape[1], num_devices)
    a = shares(a[a.sum(axis=1) > 0])
    out = np.zeros((a.shape[0], num_devices))
    for n in range(num_devices):
        out[:, n] = a[:, dev == n].sum(axis=1)
    return out


def max_load(loads, device_of_expert: Sequence[int], num_devices: int) -> float:
    """Max Load (§VII-A): the largest share of a batch's tokens any device ever gets (0 without tokens)."""
    d = device_shares(loads, device_of_expert, num_devices)
    return float(d.max()) if d.size else 0.0


def avg_max_load(loads, device_of_expert: Sequence[int], num_devices: int) -> float:
    """Avg Max Load (§VII-A): per batch the largest device share, averaged over the batches (0 without tokens)."""
    d = device_shares(loads, device_of_expert, num_devices)
    return float(d.max(axis=1).mean()) if d.size else 0.0


def evaluate_placements(loads, num_devices: int, weight: float = 0.5, nodes: int = 1) -> Dict[str, dict]:
    """Fit on the first half of the batches, evaluate on the held-out second half (paper 004 §VII-A).
    Returns {"identity" | "greedy" | "anticorrelation" | "eplb": {"placement": device_of_expert, "max_load": ...,
    "avg_max_load": ... (held-out half), "fit_max_load": ..., "fit_avg_max_load": ... (the fitted half: what a
    choice between the placements may look at)}}."""
    a = _loads(loads)
    B, E = a.shape
    if B < 2:
        raise ValueError(f"need at least 2 batches to fit on one half and evaluate on the other, got {B}")
    fit, test = a[: B // 2], a[B // 2:]
    out = {}
    for name, dev in (("identity", identity_placement(E, num_devices)),
                      ("greedy", greedy_placement(fit, num_devices)),
                      ("anticorrelation", anticorrelation_placement(fit, num_devices, weight)),
                      ("eplb", eplb_placement(fit, num_devices, nodes))):
        out[name] = {"placement": list(dev), "max_load": max_load(test, dev, num_devices),
                     "avg_max_load": avg_max_load(test, dev, num_devices),
                     "fit_max_load": max_load(fit, dev, num_devices),
                     "fit_avg_max_load": avg_max_load(fit, dev, num_devices)}
    return out


# --- placement <-> permutation -----------------------------------------------------------------------------------
def placement_to_perm(device_of_expert: Sequence[int], num_devices: int) -> List[int]:
    """perm[new_slot] = old_expert: device d gets slots d*E/D .. (d+1)*E/D - 1 holding its experts in ascending
    old id."""
    dev = _check_placement(device_of_expert, len(device_of_expert), num_devices)
    return [int(e) for n in range(num_devices) for e in np.flatnonzero(dev == n)]


def perm_to_placement(perm: Sequence[int], num_devices: int) -> List[int]:
    """device_of_expert [E] of a permutation when devices hold consecutive slots."""
    perm = _check_perm(perm, len(perm), "permutation")
    per = _check_split(len(perm), num_devices)
    dev = [0] * len(perm)
    for s, e in enumerate(perm):
        dev[e] = s // per
    return dev


def _check_perm(perm, num_experts: int, what: str) -> List[int]:
    try:
        p = [int(v) for v in perm]
        if any(float(v) != int(v) for v in perm):
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(f"{what}: expected a list of integer expert ids") from None
    if len(p) != num_experts or sorted(p) != list(range(num_experts)):
        raise ValueError(f"{what}: not a permutation of the {num_experts} expert ids 0..{num_experts - 1}")
    return p


# --- the placement file ---------------------------------------------------------------------------------------------
class PlacementFileError(ValueError):
    """A placement file that cannot be used; the message names the flag and the file."""


@dataclass
class PlacementFile:
    num_experts: int
    layers: Dict[int, List[int]]                # layer id -> perm (perm[new_slot] = old expert)
    meta: dict = field(default_factory=dict)

    def perm(self, layer_id: int) -> Optional[List[int]]:
        return self.layers.get(int(layer_id))


def write_placement_file(path: str, perms: Mapping[int, Sequence[int]], meta: Optional[dict] = None) -> str:
    """Write {layer id: perm} (and free-form JSON `meta`, e.g. num_devices, method, trace) as a placement file."""
    if not perms:
        raise ValueError("a placement file needs at least one layer")
    E = len(next(iter(perms.values())))
    layers = {}
    for lid, perm in perms.items():
        layers[str(int(lid))] = _check_perm(perm, E, f"placement of layer {lid}")
    data = {"schema": PLACEMENT_SCHEMA, "num_experts": E, "layers": layers, "meta": dict(meta or {})}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    rows = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in layers.items())    # one line per layer
    text = (f'{{\n "schema": {json.dumps(PLACEMENT_SCHEMA)},\n "num_experts": {E},\n "layers": {{\n{rows}\n }},\n'
            f' "meta": {json.dumps(data["meta"], indent=1).replace(chr(10), chr(10) + " ")}\n}}')
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)
    return path


def read_placement_file(path: str, num_experts: Optional[int] = None) -> PlacementFile:
    """Read and validate a placement file; `num_experts`, when given, must match the file's. Errors are
    ``PlacementFileError`` naming --moe-placement-file and the path."""
    def bad(msg):
        return PlacementFileError(f"{FLAG}={path}: {msg}")

    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise bad("no such file (write one with `megamoe balance`)") from None
    except json.JSONDecodeError as err:
        raise bad(f"not valid JSON ({err})") from None
    except OSError as err:
        raise bad(f"cannot be read ({err})") from None
    if not isinstance(data, dict):
        raise bad("expected a JSON object")
    if data.get("schema") != PLACEMENT_SCHEMA:
        raise bad(f"schema is {data.get('schema')!r}, expected {PLACEMENT_SCHEMA!r}")
    E = data.get("num_experts")
    if not isinstance(E, int) or isinstance(E, bool) or E < 1:
        raise bad(f"num_experts must be a positive integer, got {E!r}")
    if num_experts is not None and E != int(num_experts):
        raise bad(f"written for {E} experts, the model has {num_experts}")
    layers = data.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise bad("'layers' must be a non-empty object {layer id: permutation}")
    out = {}
    for key, perm in layers.items():
        try:
            lid = int(key)
        except ValueError:
            raise bad(f"layer id {key!r} is not an integer") from None
        if not isinstance(perm, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in perm):
            raise bad(f"layer {key}: expected a list of integer expert ids")
        try:
            out[lid] = _check_perm(perm, E, f"layer {key}")
        except ValueError as err:
            raise bad(str(err)) from None
    meta = data.get("meta", {})
    if not isinstance(meta, dict):
        raise bad("'meta' must be an object")
    return PlacementFile(E, out, meta)


# --- applying a permutation to a layer ----------------------------------------------------------------------------
def _parts(layer):
    """(gate, bank, plan) of a core MoELayer, a Megatron PluginMoELayer (router.gate, experts.bank) or a module
    wrapping one in ``.moe`` (fairseq's FairseqMoEFFN). Detected by attributes (no framework import)."""

    if not isinstance(getattr(layer, "gate", None), Gate) and isinstance(getattr(layer, "moe", None), nn.Module):
        layer = layer.moe
    gate = getattr(layer, "gate", None)
    if not isinstance(gate, Gate):
        gate = getattr(getattr(layer, "router", None), "gate", None)
    bank = getattr(layer, "experts_bank", None)
    if not isinstance(bank, ExpertBank):
        experts = getattr(layer, "experts", None)
        bank = experts if isinstance(experts, ExpertBank) else getattr(experts, "bank", None)
    if not isinstance(gate, Gate) or not isinstance(bank, ExpertBank):
        raise TypeError(f"apply_expert_permutation: {type(layer).__name__} is not an MoE layer of this plugin "
                        "(expected .gate or .router.gate, and .experts or .experts.bank)")
    return gate, bank, getattr(layer, "plan", None)


@torch.no_grad()
def _permute_rows_(t: torch.Tensor, index: torch.Tensor) -> None:
    t.copy_(t.index_select(0, index.to(t.device)))


@torch.no_grad()
def _gather_rows_ep_(p: torch.Tensor, perm: List[int], ep) -> None:
    """p [E_local, ...] on every rank of the EP group: afterwards rank r's slot i holds old global expert
    perm[r*E_local + i], fetched from its owner with one all-to-all-v."""
    El, P, me = p.shape[0], ep.size, ep.rank
    send_rows, send_splits = [], []
    for q in range(P):                 # to rank q: my experts its new slots need, in q's slot order
        mine = [perm[s] - me * El for s in range(q * El, (q + 1) * El) if perm[s] // El == me]
        send_rows += mine
        send_splits.append(len(mine))
    recv_from = [perm[me * El + i] // El for i in range(El)]
    recv_splits = [recv_from.count(q) for q in range(P)]
    flat = p.detach().reshape(El, -1)
    send = flat.index_select(0, torch.tensor(send_rows, dtype=torch.long, device=p.device)).contiguous()
    recv = torch.empty_like(flat)
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=ep.group)
    # received rows: grouped by source rank, within a source in ascending new slot
    order = sorted(range(El), key=lambda i: (recv_from[i], i))
    dest = torch.tensor(order, dtype=torch.long, device=p.device)
    out = torch.empty_like(flat)
    out.index_copy_(0, dest, recv)
    p.copy_(out.view_as(p))


@torch.no_grad()
def apply_expert_permutation(layer: nn.Module, perm: Sequence[int]) -> None:
    """Move old expert perm[s] to slot s of `layer` in place (module docstring); the layer's outputs are unchanged.
    With expert parallelism the call is collective over the layer's expert-parallel group (every rank, same perm;
    the rows travel by all-to-all over that group, so the bank must be where the group's backend works, e.g. on the
    GPU under NCCL: apply it before enabling expert buffering, which moves the weights to host memory)."""
    gate, bank, plan = _parts(layer)
    E = gate.num_experts
    perm = _check_perm(perm, E, "expert permutation")
    index = torch.tensor(perm, dtype=torch.long)
    ep = gate.ep
    runtime = getattr(bank, "placement", None)
    if runtime is not None and not runtime.trivial:
        raise NotImplementedError("apply_expert_permutation: the layer's dynamic placement has replicated, moved or "
                                  "shadowed experts; apply the placement file before --moe-placement moves any")
    El = bank.w1.shape[0]
    if El * ep.size != E:
        raise NotImplementedError(f"apply_expert_permutation: the bank has {El} slots per rank for {E} experts over "
                                  f"{ep.size} rank(s) (spare vExpert slots are not supported)")
    if ep.size > 1 and getattr(ep, "layout_only", False):
        raise RuntimeError("apply_expert_permutation: the expert-parallel group is a layout without a process group")

    # the gate: per-expert parameters (router rows, any per-expert bias) and buffers other than slot locations
    for name, p in gate.named_parameters(recurse=False):
        if p.dim() >= 1 and p.shape[0] == E:
            _permute_rows_(p, index)
            if p.grad is not None:
                _permute_rows_(p.grad, index)
    keep = set(SLOT_LOCATION_BUFFERS) | set(getattr(gate, "expert_location_buffers", ()))
    for name, b in gate.named_buffers(recurse=False):
        if b is not None and b.dim() >= 1 and b.shape[0] == E and name not in keep:
            _permute_rows_(b, index)

    # the experts
    for p in bank.parameters():
        if ep.size == 1:
            _permute_rows_(p, index)
            if p.grad is not None:
                _permute_rows_(p.grad, index)
        else:
            _gather_rows_ep_(p, perm, ep)
            if p.grad is not None:
                _gather_rows_ep_(p.grad, perm, ep)

    # per-expert state of the layer's plan and placement runtime
    if runtime is not None:
        runtime.permute_counts(index)
    if plan is not None:
        cap = getattr(plan, "expert_capacity", None)
        if cap is not None:
            plan.expert_capacity = [cap[e] for e in perm]
        cache = getattr(plan, "assignment_cache", None)
        lid = getattr(plan, "layer_id", None)
        if cache is not None and lid in getattr(cache, "tables", {}):
            t = cache.tables[lid]
            inverse = torch.empty(E, dtype=torch.long)
            inverse[index] = torch.arange(E)
            ids = t.long()
            cache.tables[lid] = torch.where(ids >= 0, inverse.to(t.device)[ids.clamp_min(0)], ids).to(t.dtype)


def moe_layers_by_id(model: nn.Module) -> Dict[int, nn.Module]:
    """{layer id: layer} of the model's MoE layers (``layer.find_moe_layers``), the ids a routing trace records."""

    out = {}
    for m in find_moe_layers(model):
        lid = m.layer_id
        if lid is None:
            continue
        if lid in out and out[lid] is not m:
            raise ValueError(f"two MoE layers report layer id {lid}; cannot apply a placement by layer id")
        out[int(lid)] = m
    return out


def apply_placement_file(model: nn.Module, placement, strict: bool = True) -> List[int]:
    """Apply a placement file (path or ``PlacementFile``) to every MoE layer of `model` it names; returns the layer
    ids permuted. `strict`: a layer id of the file that the model does not have is an error (pipeline stages hold
    only some layers: pass strict=False there)."""
    layers = moe_layers_by_id(model)
    if not isinstance(placement, PlacementFile):
        path = os.fspath(placement)
        E = {_parts(l)[0].num_experts for l in layers.values()}
        placement = read_placement_file(path, next(iter(E)) if len(E) == 1 else None)
    missing = sorted(set(placement.layers) - set(layers))
    if missing and strict:
        raise PlacementFileError(f"{FLAG}: layer id(s) {missing} are not MoE layers of this model (it has "
                                 f"{sorted(layers)})")
    done = []
    for lid, perm in sorted(placement.layers.items()):
        if lid in layers:
            apply_expert_permutation(layers[lid], perm)
            done.append(lid)
    return done
