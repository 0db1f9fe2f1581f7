"""Checkpoint sets of ``megamoe train``: complete or refused, resumable at any expert-parallel size.

A checkpoint is one file per expert-parallel rank (``PATH.rank<r>``; a single ``PATH`` when every rank holds every
expert) plus ``PATH.manifest.json``, written by rank 0 only after every rank's file is on disk: the step, the
layout and, for every file, its size and SHA-256. A set is *complete* when a manifest exists and every file it
lists has exactly the recorded bytes. Saving first moves the newest complete set aside (``<file>.prev``,
``PATH.manifest.json.prev``), so a job killed mid-save (say between two ranks' renames) leaves the previous
complete set intact; ``resolve`` then resumes from it, saying so. When no complete set exists the load is refused
with a message naming each file and what is wrong with it. Checkpoints without a manifest (format 1) load when
their files agree on the step.

Every file is read with ``torch.load(weights_only=True)`` (tensors and plain values only: a crafted file cannot
run code); a truncated or foreign file is a ``CheckpointError`` naming it.

Resharding (``state_for_rank``): experts are rows of each rank's bank, and the saved placement says which logical
expert each row is (``PlacementState.logical_rows``). Loading at the saving job's expert-parallel size takes the
file of the same EP rank (any data-parallel replica of it: they are identical) with its placement; at another
size it rebuilds every expert bank parameter and its optimizer state tensors as [E, ...] in logical order from the
saved EP group's files and slices this rank's contiguous block (placement back to the initial one), so training
continues with every expert's weights and Adam state.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

FORMAT = "megamoe-train/2"
LEGACY_FORMAT = "megamoe-train/1"
PREV = ".prev"


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed; the message names the files and what is wrong."""


def file_name(path: str, rank: int, ep_size: int) -> str:
    """One file when experts are not sharded (every rank holds the same weights), else one per rank."""
    return path if ep_size == 1 else f"{path}.rank{rank}"


def manifest_name(path: str) -> str:
    return path + ".manifest.json"


def read_state(file: str) -> dict:
    """A checkpoint file, read with the weights-only unpickler; ``CheckpointError`` naming it otherwise."""
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing") from None
    except Exception as err:         # a truncated zip, garbage, or a pickle that wants to build other objects
        text = str(err).strip()
        raise CheckpointError(f"{file}: not a readable checkpoint (torch.load(weights_only=True): "
                              f"{text.splitlines()[0][:200] if text else type(err).__name__})") from None
    if not isinstance(state, dict) or state.get("format") not in (FORMAT, LEGACY_FORMAT):
        raise CheckpointError(f"{file}: not a {FORMAT} checkpoint (megamoe train --save)")
    return state


def _sha256(file: str) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# --- which files make the newest complete set ---------------------------------------------------------------------
class CheckpointSet:
    """A complete checkpoint set: its manifest (the step, layout, options) and its files in saving-rank order."""

    def __init__(self, manifest: dict, files: List[str], manifest_file: Optional[str], notes: List[str]):
        self.manifest, self.files, self.manifest_file, self.notes = manifest, files, manifest_file, notes

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def ep_size(self) -> int:
        return int(self.manifest["expert_parallel_size"])


def _locate(directory: str, entry: dict) -> Optional[str]:
    """The copy (current or moved-aside) of a manifest entry's file with the recorded size and digest."""
    for name in (entry["name"], entry["name"] + PREV):
        f = os.path.join(directory, name)
        if os.path.isfile(f) and os.path.getsize(f) == entry["bytes"] and _sha256(f) == entry["sha256"]:
            return f
    return None


def _read_manifest(file: str) -> Optional[dict]:
    try:
        with open(file) as f:
            m = json.load(f)
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and m.get("format") == FORMAT and isinstance(m.get("files"), list) else None


def resolve(path: str) -> CheckpointSet:
    """The newest complete set saved under ``path`` (``CheckpointError`` with the evidence when there is none)."""
    directory = os.path.dirname(os.path.abspath(path))
    problems: List[str] = []
    manifests = [(f, _read_manifest(f)) for f in (manifest_name(path), manifest_name(path) + PREV)
                 if os.path.exists(f)]
    for f, m in sorted(((f, m) for f, m in manifests if m is not None), key=lambda fm: -int(fm[1]["step"])):
        found = [(e, _locate(directory, e)) for e in m["files"]]
        missing = [e["name"] for e, loc in found if loc is None]
        if not missing:
            notes = []
            if problems or f.endswith(PREV):
                why = "; ".join(problems) or "its manifest was never written: the save was interrupted"
                notes.append(f"{path}: the newest checkpoint is incomplete ({why}): resuming from the previous "
                             f"complete one, step {m['step']}")
            return CheckpointSet(m, [loc for _, loc in found], f, notes)
        problems.append(f"{os.path.basename(f)} (step {m['step']}) lists {', '.join(missing)}, which "
                        f"{'is' if len(missing) == 1 else 'are'} missing or differ from what was saved")
    problems += [f"{os.path.basename(f)} is unreadable" for f, m in manifests if m is None]
    legacy = _legacy_set(path, problems) if not manifests else None
    if legacy is not None:
        return legacy
    raise CheckpointError(f"{path}: no complete checkpoint set: " + ("; ".join(problems) or "no files"))


def _legacy_set(path: str, problems: List[str]) -> Optional[CheckpointSet]:
    """A set written without a manifest (format 1): usable when its files agree on the step."""
    import glob
    if os.path.isfile(path):
        files = [path]
    else:
        files = sorted((p for p in glob.glob(glob.escape(path) + ".rank*") if p.rsplit(".rank", 1)[1].isdigit()),
                       key=lambda p: int(p.rsplit(".rank", 1)[1]))
    if not files:
        problems.append(f"neither {path} nor {path}.rank<r> nor {os.path.basename(manifest_name(path))} exists")
        return None
    states = [read_state(f) for f in files]
    steps = {f: int(s["step"]) for f, s in zip(files, states)}
    first = states[0]
    expected = int(first.get("world_size", 1)) if int(first.get("expert_parallel_size", 1)) > 1 else 1
    if len(set(steps.values())) > 1 or len(files) != expected:
        problems.append("files without a manifest that do not form one checkpoint: "
                        + ", ".join(f"{os.path.basename(f)} (step {s})" for f, s in steps.items())
                        + f"; expert-parallel size {first.get('expert_parallel_size', 1)} needs the files of ranks "
                        f"0..{expected - 1}")
        return None
    return CheckpointSet(_manifest_fields(first, files), files, None,
                         [f"{path}: written without a manifest (an older version); its files agree on step "
                          f"{first['step']}"])


def _manifest_fields(state: dict, files: Sequence[str]) -> dict:
    return {"format": FORMAT, "step": int(state["step"]), "world_size": int(state.get("world_size", 1)),
            "expert_parallel_size": int(state.get("expert_parallel_size", 1)), "moe_config": state["moe_config"],
            "model_args": state["model_args"], "files": [{"name": os.path.basename(f)} for f in files]}


# --- saving ---------------------------------------------------------------------------------------------------------
def save(path: str, state: dict, rank: int, world_size: int, ep_size: int) -> Optional[str]:
    """Collective over the job. Writes this rank's file (every rank when experts are sharded, else rank 0), then
    the manifest; the newest complete set is kept aside until the new one is complete. Returns the file written."""
    distributed = world_size > 1 and dist.is_initialized()
    writes = ep_size > 1 or rank == 0
    mine = file_name(path, rank, ep_size)
    keep = [None]
    if rank == 0:
        try:
            done = resolve(path)
            keep = [{"files": [os.path.basename(f) for f in done.files], "manifest": done.manifest_file}]
        except CheckpointError:
            keep = [None]
    if distributed:
        dist.broadcast_object_list(keep, src=0)
    if distributed:
        dist.barrier()
    _set_aside(path, mine if writes else None, keep[0], rank == 0)
    if distributed:
        dist.barrier()
    entry = None
    if writes:
        os.makedirs(os.path.dirname(os.path.abspath(mine)), exist_ok=True)
        tmp = f"{mine}.tmp{os.getpid()}"
        torch.save(state, tmp)
        os.replace(tmp, mine)
        entry = {"rank": rank, "name": os.path.basename(mine), "bytes": os.path.getsize(mine),
                 "sha256": _sha256(mine)}
    entries = [entry]
    if distributed:
        entries = [None] * world_size
        dist.all_gather_object(entries, entry)
    if rank == 0:
        manifest = _manifest_fields(state, [])
        manifest["files"] = [e for e in entries if e is not None]
        tmp = manifest_name(path) + ".tmp"
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1)
        os.replace(tmp, manifest_name(path))
    if distributed:
        dist.barrier()
    return mine if writes else None


def _set_aside(path: str, mine: Optional[str], keep: Optional[dict], is_main: bool) -> None:
    """Move this rank's file of the newest complete set (and, on rank 0, its manifest) to ``.prev``; a current
    file that is not part of it (a leftover of an interrupted save) is dropped."""
    if mine is not None:
        base = os.path.basename(mine)
        in_set = keep is not None and base in keep["files"]
        prev_in_set = keep is not None and (base + PREV) in keep["files"]
        if os.path.exists(mine):
            if in_set:
                os.replace(mine, mine + PREV)
            elif prev_in_set:
                os.remove(mine)
    if is_main and keep is not None and keep["manifest"] == manifest_name(path) and os.path.exists(keep["manifest"]):
        os.replace(keep["manifest"], keep["manifest"] + PREV)


# --- loading, resharded to this rank --------------------------------------------------------------------------------
def state_for_rank(ckpt: CheckpointSet, ep_rank: int, ep_size: int, slots_per_rank: int,
                   expert_param_names: Dict[str, int], optimizer_names: List[str],
                   log: Callable[[str], None] = print) -> dict:
    """The checkpoint dict this rank loads: its EP rank's file when the expert-parallel size is the saved one,
    else one rebuilt from the saved EP group's files (module docstring). ``expert_param_names`` maps every expert
    bank parameter's state-dict name to its MoE layer's index (moe_layers order); ``optimizer_names`` are the
    parameter names in the optimizer's index order."""
    old_ep = ckpt.ep_size
    if old_ep == ep_size:
        return read_state(ckpt.files[ep_rank if old_ep > 1 else 0])
    states = read_expert_group(ckpt)
    log(f"resharding the step-{ckpt.step} checkpoint from expert-parallel size {old_ep} to {ep_size}: every "
        f"expert's weights and optimizer state by logical id; the placement restarts from the initial one")
    out = dict(states[0])
    out["model"] = dict(states[0]["model"])
    out["placement"] = []
    out["optimizer"] = _copy_optimizer(states[0]["optimizer"])
    index = {name: i for i, name in enumerate(optimizer_names)}
    for name, layer in expert_param_names.items():
        rows = logical_rows(states, [s["model"][name] for s in states], layer)
        out["model"][name] = _local_block(rows, ep_rank, ep_size, slots_per_rank)
        i = index[name]
        saved = [s["optimizer"]["state"].get(i) for s in states]
        if all(st is not None for st in saved):
            mine = out["optimizer"]["state"][i]
            for key, val in saved[0].items():
                if torch.is_tensor(val) and val.dim() > 0 and val.shape == states[0]["model"][name].shape:
                    full = logical_rows(states, [st[key] for st in saved], layer)
                    mine[key] = _local_block(full, ep_rank, ep_size, slots_per_rank)
    return out


def _copy_optimizer(sd: dict) -> dict:
    return {"state": {i: dict(st) for i, st in sd["state"].items()}, "param_groups": sd["param_groups"]}


def read_expert_group(ckpt: CheckpointSet) -> List[dict]:
    """The files of the saving job's first expert-parallel group (every expert once), read and checked."""
    states = [read_state(f) for f in ckpt.files[:ckpt.ep_size]]
    for f, st in zip(ckpt.files, states):
        if int(st["step"]) != ckpt.step:
            raise CheckpointError(f"{f}: holds step {st['step']}, the manifest step {ckpt.step}")
    ranks = [int(st.get("ep_rank", i)) for i, st in enumerate(states)]
    if len(states) != ckpt.ep_size or ranks != list(range(ckpt.ep_size)):
        raise CheckpointError(f"expert-parallel size {ckpt.ep_size} needs the files of EP ranks 0..{ckpt.ep_size - 1}, "
                              f"found {[os.path.basename(f) for f in ckpt.files]} (EP ranks {ranks})")
    return states


def logical_rows(states: List[dict], parts: List[torch.Tensor], layer: int) -> torch.Tensor:
    """[E, ...] in logical expert order from one bank tensor of each EP rank ([slots, ...], in rank order), by the
    saved placement of MoE layer ``layer`` (the initial contiguous one when none was saved)."""
    from .placement.state import PlacementState

    placements = states[0].get("placement") or []
    num_experts = int(states[0]["moe_config"]["num_experts"])
    rows, slots, ep = torch.cat(parts, 0), parts[0].shape[0], len(parts)
    if layer < len(placements) and placements[layer]:
        order = PlacementState.from_dict(placements[layer]["state"]).logical_rows()
    else:
        per = num_experts // ep
        order = [(e // per) * slots + e % per for e in range(num_experts)]
    return rows.index_select(0, torch.tensor(order))


def _local_block(full: torch.Tensor, ep_rank: int, ep_size: int, slots: int) -> torch.Tensor:
    """This EP rank's [slots, ...] rows under the initial placement: its contiguous block, zeros in spare slots."""
    per = full.shape[0] // ep_size
    out = full.new_zeros((slots,) + tuple(full.shape[1:]))
    out[:per] = full[ep_rank * per:(ep_rank + 1) * per]
    return out
