"""Per-call MoE statistics (StatsSink) and routing traces (TraceRecorder / load_trace).

StatsSink: every MoELayer call records its per-expert kept counts and dropped count as device tensors (no host
sync on the hot path). ``summary()`` (called by the trainer at log intervals, on every rank of the group when a
group is given) reduces them and returns, per layer: tokens per expert, dropped fraction, FlexMoE's balance ratio
(paper 001 Eq. 6: max over devices of the device's load over the mean device load, with the expert->rank
placement) and the expert-level max/mean load. Adapters forward these to their loggers.

Routing traces: per layer and step, the [source rank x expert] token counts, optionally every token's expert
ids. Each rank writes its own shard (no collective needed); ``load_trace`` merges the shards.
Schema of a shard (``torch.save`` of a dict of tensors, ints, strings and lists only, ``schema =
"megamoe-trace/1"``):
    rank, world_size, num_experts, top_k, layers (list of layer ids)
    steps: LongTensor [S]                      training step of each record row
    counts: IntTensor [S, L, E]                this rank's kept tokens per expert
    token_ids: list (len S) of list (len L) of ShortTensor/IntTensor [T, k] (only with token ids; -1 = dropped)
``load_trace(path)`` returns a dict with the same keys but ``counts`` [S, L, P, E] (source rank x expert), over the
union of the shards' layers (pipeline stages own different layers; a rank without a layer has zero rows).
Traces are meant to be shared: a shard is read with ``torch.load(weights_only=True)``, whose unpickler builds
tensors and plain containers and nothing else, so a crafted file cannot run code; its fields are then checked
against the schema. Anything else is refused with a ``TraceError`` naming the file.
"""
from __future__ import annotations

import glob
import os
from collections import defaultdict
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .parallel import comm_device

TRACE_SCHEMA = "megamoe-trace/1"


class TraceError(ValueError):
    """A file that is not a readable routing-trace shard; the message names it and says what is wrong."""


class NonFiniteRoutingError(FloatingPointError):
    """An MoE layer's router produced NaN/inf (combine weights or aux losses); the message names the layers, the
    step and the ranks."""


class StatsSink:
    def __init__(self):
        self._nonfinite: Dict[int, torch.Tensor] = {}
        self._counts: Dict[int, torch.Tensor] = {}
        self._dropped: Dict[int, torch.Tensor] = {}
        self._assignments: Dict[int, int] = defaultdict(int)
        self._calls: Dict[int, int] = defaultdict(int)
        self.last: Dict[int, torch.Tensor] = {}
        self.listeners = []          # callables(layer_id, routing) e.g. a TraceRecorder

    def record(self, layer_id: int, routing) -> None:
        c = routing.counts.detach()
        self.last[layer_id] = c
        if layer_id in self._counts and self._counts[layer_id].shape != c.shape:
            # a different layer now reports under this id (e.g. a model rebuilt with another expert count in the
            # same process): its statistics start afresh
            for table in (self._counts, self._dropped, self._assignments, self._calls):
                table.pop(layer_id, None)
        self._counts[layer_id] = self._counts[layer_id] + c if layer_id in self._counts else c.clone()
        d = routing.dropped.detach()
        self._dropped[layer_id] = self._dropped[layer_id] + d if layer_id in self._dropped else d.clone()
        self._assignments[layer_id] += routing.expert_ids.numel()
        self._calls[layer_id] += 1
        bad = ~torch.isfinite(routing.weights.detach()).all()      # NaN/inf logits reach every weight of the row
        for aux in routing.aux_losses.values():
            bad = bad | ~torch.isfinite(aux.detach())
        prev = self._nonfinite.get(layer_id)
        self._nonfinite[layer_id] = bad if prev is None else prev | bad
        for fn in self.listeners:
            fn(layer_id, routing)

    def take_nonfinite(self) -> Dict[int, torch.Tensor]:
        """Per layer, whether any call since the last take produced a non-finite router output (device bools)."""
        out, self._nonfinite = self._nonfinite, {}
        return out

    def reset(self) -> None:
        self._counts.clear(); self._dropped.clear(); self._assignments.clear(); self._calls.clear()

    def totals(self) -> Dict[int, tuple]:
        """Per layer since the last reset: (kept counts [E] tensor, dropped assignments, assignments, calls)."""
        return {lid: (self._counts[lid], float(self._dropped[lid]), self._assignments[lid], self._calls[lid])
                for lid in sorted(self._counts)}

    def summary(self, group=None, ranks_of_experts: Optional[List[int]] = None, reset: bool = True) -> Dict[int, dict]:
        """Per-layer statistics since the last reset. With `group`, counts are summed over its ranks
        (collective: every rank of the group must call it). `ranks_of_experts[e]` is the rank holding expert e
        (default: contiguous blocks over the group); it defines the devices of the balance ratio."""
        out = {}
        for layer_id, (counts, dropped, assignments, calls) in self.totals().items():
            counts = counts.double()
            extra = torch.tensor([dropped, float(assignments)], dtype=torch.float64, device=counts.device)
            world = 1
            if group is not None and dist.is_initialized():
                both = torch.cat([counts, extra])
                dist.all_reduce(both, group=group)
                counts, extra = both[:-2], both[-2:]
                world = dist.get_world_size(group)
            out[layer_id] = layer_summary(counts, float(extra[0]), float(extra[1]), ranks_of_experts, world, calls)
        if reset:
            self.reset()
        return out


def check_nonfinite(sinks, step: int, group=None) -> Optional[str]:
    """None when every MoE layer's router output since the last call was finite on every rank of ``group``; else
    a message naming the layers, the step and the ranks. Reads the sinks' device flags once (one host sync per
    step, not per layer); with a group, one scalar all-reduce (and an all-gather only when something is wrong).
    Collective over the group: every rank calls it at the same point of the step."""
    flags: Dict[int, torch.Tensor] = {}
    for sink in sinks:
        flags.update(sink.take_nonfinite())
    ids = sorted(flags)
    bad = [i for i, f in zip(ids, torch.stack([flags[i].cpu() for i in ids]).tolist()) if f] if ids else []
    per_rank = {dist.get_rank() if dist.is_initialized() else 0: bad}
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        n = torch.tensor([len(bad)], dtype=torch.long, device=comm_device(group))
        dist.all_reduce(n, group=group)
        if int(n) == 0:
            return None
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (dist.get_rank(), bad), group=group)
        per_rank = {r: b for r, b in gathered}
    elif not bad:
        return None
    where = "; ".join(f"rank {r}: MoE layer(s) {', '.join(map(str, b))}" for r, b in sorted(per_rank.items()) if b)
    return (f"non-finite router output (NaN/inf in the combine weights or aux loss) at step {step}: {where}. The "
            "layer's input or the gate weights hold NaN/inf (check the data, the learning rate, fp16 overflow)")


def layer_summary(counts: torch.Tensor, dropped: float, assignments: float, ranks_of_experts: Optional[List[int]],
                  devices: int, calls: int) -> dict:
    """Tokens per expert, dropped fraction, balance ratio (paper 001 Eq. 6) and expert max/mean of one layer."""
    counts = counts.double().cpu()
    E = counts.numel()
    owner = ranks_of_experts or [e * devices // E for e in range(E)]
    device_load = torch.zeros(max(max(owner) + 1, devices), dtype=torch.float64).index_add_(
        0, torch.tensor(owner), counts)
    total = float(counts.sum())
    return {
        "tokens_per_expert": counts.long().tolist(),
        "dropped_fraction": dropped / max(assignments, 1.0),
        "balance_ratio": float(device_load.max() / device_load.mean()) if total > 0 else 1.0,
        "expert_max_over_mean": float(counts.max() / counts.mean()) if total > 0 else 1.0,
        "calls": calls,
    }


class TraceRecorder:
    """Collects per-layer counts (and optionally token ids) per step; ``flush`` writes this rank's shard."""

    def __init__(self, path: str, rank: int = 0, world_size: int = 1, num_experts: int = 0, top_k: int = 0,
                 token_ids: bool = False):
        self.path, self.rank, self.world_size = path, rank, world_size
        self.num_experts, self.top_k, self.with_token_ids = num_experts, top_k, token_ids
        self.step = 0
        self._rows: Dict[int, Dict[int, torch.Tensor]] = defaultdict(dict)
        self._ids: Dict[int, Dict[int, torch.Tensor]] = defaultdict(dict)

    def __call__(self, layer_id: int, routing) -> None:
        row = self._rows[self.step]
        c = routing.counts.detach().to("cpu", torch.int32)
        row[layer_id] = row[layer_id] + c if layer_id in row else c      # several micro-batches add up
        if self.with_token_ids:
            ids = torch.where(routing.kept, routing.expert_ids, -1).detach().cpu()
            ids = ids.to(torch.int16 if self.num_experts < 32767 else torch.int32)
            prev = self._ids[self.step].get(layer_id)
            self._ids[self.step][layer_id] = ids if prev is None else torch.cat([prev, ids])

    def next_step(self, step: Optional[int] = None) -> None:
        self.step = self.step + 1 if step is None else step

    def shard_path(self) -> str:
        return f"{self.path}.rank{self.rank}"

    def flush(self) -> Optional[str]:
        if not self._rows:
            return None
        steps = sorted(self._rows)
        layers = sorted({l for s in steps for l in self._rows[s]})
        E = self.num_experts or next(iter(self._rows[steps[0]].values())).numel()
        counts = torch.zeros(len(steps), len(layers), E, dtype=torch.int32)
        for i, s in enumerate(steps):
            for j, l in enumerate(layers):
                if l in self._rows[s]:
                    counts[i, j] = self._rows[s][l]
        data = {"schema": TRACE_SCHEMA, "rank": self.rank, "world_size": self.world_size, "num_experts": E,
                "top_k": self.top_k, "layers": layers, "steps": torch.tensor(steps), "counts": counts}
        if self.with_token_ids:
            data["token_ids"] = [[self._ids[s].get(l) for l in layers] for s in steps]
        os.makedirs(os.path.dirname(os.path.abspath(self.shard_path())), exist_ok=True)
        torch.save(data, self.shard_path())
        return self.shard_path()


def load_trace(path: str) -> dict:
    """Merge the per-rank shards ``<path>.rank<r>`` into counts [S, L, P, E] (source rank x expert)."""
    shards = [p for p in glob.glob(glob.escape(path) + ".rank*") if p.rsplit(".rank", 1)[1].isdigit()]
    shards.sort(key=lambda p: int(p.rsplit(".rank", 1)[1]))
    if not shards:
        raise FileNotFoundError(f"no trace shards {path}.rank*")
    parts = [read_shard(p) for p in shards]
    first = parts[0]
    if len(parts) != first["world_size"]:
        raise TraceError(f"{path}: {len(parts)} shard(s) found, world size {first['world_size']}")
    if [p["rank"] for p in parts] != list(range(len(parts))):
        raise TraceError(f"{path}: shards of ranks {[p['rank'] for p in parts]}, expected 0..{len(parts) - 1}")
    for p in parts[1:]:
        if (p["world_size"], p["num_experts"]) != (first["world_size"], first["num_experts"]):
            raise TraceError(f"{path}: shards disagree on world size or expert count")
        if not torch.equal(p["steps"], first["steps"]):
            raise TraceError(f"{path}: shards disagree on steps")
    # pipeline stages own different layers: the merged trace has every layer, zero rows for ranks without it
    layers = sorted({l for p in parts for l in p["layers"]})
    S, E = len(first["steps"]), first["num_experts"]
    counts = torch.zeros(S, len(layers), len(parts), E, dtype=first["counts"].dtype)
    for r, p in enumerate(parts):
        for j, l in enumerate(p["layers"]):
            counts[:, layers.index(l), r] = p["counts"][:, j]
    out = {k: first[k] for k in ("schema", "world_size", "num_experts", "top_k", "steps")}
    out["layers"], out["counts"] = layers, counts
    if "token_ids" in first:       # [P][S][L] over the merged layers (None where a rank has no such layer)
        out["token_ids"] = [[[p["token_ids"][s][p["layers"].index(l)] if l in p["layers"] else None
                              for l in layers] for s in range(S)] for p in parts]
    return out


def read_shard(path: str) -> dict:
    """One trace shard, read without executing anything and checked against the schema (``TraceError`` else)."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:       # UnpicklingError (code, foreign classes), a truncated zip, garbage bytes
        text = str(err).strip()
        why = text.splitlines()[0][:200] if text else type(err).__name__
        raise TraceError(f"{path}: not a readable routing trace (refused by torch.load(weights_only=True): {why})"
                         ) from None
    if not isinstance(data, dict) or data.get("schema") != TRACE_SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise TraceError(f"{path}: not a {TRACE_SCHEMA} trace shard (schema found: {found!r})")
    ints = ("rank", "world_size", "num_experts", "top_k")
    bad = [k for k in ints if not isinstance(data.get(k), int)]
    layers = data.get("layers")
    if not isinstance(layers, list) or not all(isinstance(l, int) for l in layers):
        bad.append("layers")
    steps, counts = data.get("steps"), data.get("counts")
    if not (torch.is_tensor(steps) and steps.dim() == 1):
        bad.append("steps")
    if not (torch.is_tensor(counts) and counts.dim() == 3 and not counts.is_floating_point()
            and "steps" not in bad and isinstance(layers, list)
            and tuple(counts.shape[:2]) == (steps.numel(), len(layers))
            and counts.shape[2] == data.get("num_experts")):
        bad.append("counts")
    if bad:
        raise TraceError(f"{path}: trace shard with malformed field(s) {', '.join(bad)} (schema in megamoe_plugin/"
                         "stats.py)")
    return data
