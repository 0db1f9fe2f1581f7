"""Sample-assignment caching (DynaMoE paper 000 §4.2, §5.3): remember each training sample's expert assignment.

The gate's assignments converge early in training (Fig. 10). Once they have, the expert batches can be formed from
the assignment the gate gave the same sample one epoch earlier, before the gate has run, so gate and experts run
concurrently; the gate keeps training (the combine weights are its probabilities at the cached experts) and its
fresh choices refresh the cache for the next epoch.

* Keys: a token's key is ``sample_index * positions + position``, with the sample's index in its dataset as the
  trainer's data pipeline gives it (``set_batch``): fairseq's ``sample["id"]``, the Megatron trainer's sample
  index. ``positions`` is the trainer's sequence length.
* One table per MoE layer: [keys, k] int16/int32 on the layer's device (-1 = not cached), grown on demand; memory
  is samples x positions x k x 2 bytes per layer.
* Reassignment metric: a token of a sample last seen in an EARLIER epoch is compared with its cached assignment
  (as a set of k experts); per layer the stable and compared counts accumulate on the device (no sync on the hot
  path) and RECOMPILE's trigger turns them into the per-epoch fraction of tokens not reassigned.
* ``CachePolicy``: caching on when that fraction is >= ``on`` (paper: 96%) and the epoch is >= ``min_epoch``
  (paper: 10), off when it falls below ``off`` (paper: 90%); decided off the training thread, applied at a step
  boundary (``runtime.DynamicRuntime``).
* While on, a batch whose every sample has a cached assignment for all its positions (a host-side check, no sync)
  is dispatched by the cached ids; any other batch goes through the gate as usual.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

__all__ = ["AssignmentCache", "CachePolicy"]


class AssignmentCache:
    def __init__(self, top_k: int, positions: int, num_experts: int):
        if positions < 1:
            raise ValueError(f"assignment cache: positions per sample (the sequence length) must be >= 1, got {positions}")
        self.top_k, self.positions, self.num_experts = top_k, positions, num_experts
        self.dtype = torch.int16 if num_experts < 2 ** 15 else torch.int32
        self.active = False                                  # switched by the policy at step boundaries
        self.epoch = 0
        self.tables: Dict[int, torch.Tensor] = {}
        self.counts: Dict[int, torch.Tensor] = {}           # layer -> [2] (stable, compared) since last take
        self._last_epoch = np.zeros(0, dtype=np.int64)       # per sample: epoch it was last seen in (0 = never)
        self._known = np.zeros(0, dtype=np.int64)            # per sample: positions with a cached assignment
        self._batch: Optional[Tuple[torch.Tensor, torch.Tensor, Tuple[int, ...], bool]] = None
        self.cached_calls = 0                                # layer calls dispatched by cached ids

    # --- the data pipeline's side --------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def set_batch(self, sample_ids, seq_len: int, layout: str = "bs", epoch: Optional[int] = None) -> None:
        """The next training forward's samples (dataset indices, [B], on the host) and sequence length;
        `layout` is how the MoE layers see the tokens: "bs" ([B, S, ...]) or "sb" ([S, B, ...]: Megatron, fairseq)."""
        if epoch is not None:
            self.epoch = int(epoch)
        ids = np.asarray(torch.as_tensor(sample_ids).cpu(), dtype=np.int64).reshape(-1)
        if ids.size and ids.min() < 0:
            raise ValueError(f"assignment cache: sample indices must be >= 0, got {ids.min()}")
        if seq_len > self.positions:
            raise ValueError(f"assignment cache: sequence length {seq_len} exceeds the positions per sample it "
                             f"was made for, {self.positions} (the trainer's sequence length)")
        if layout not in ("bs", "sb"):
            raise ValueError(f"assignment cache: layout must be 'bs' or 'sb', got {layout!r}")
        need = int(ids.max()) + 1 if ids.size else 0
        if need > self._last_epoch.size:
            grow = max(need, 2 * self._last_epoch.size)
            self._last_epoch = np.concatenate([self._last_epoch, np.zeros(grow - self._last_epoch.size, np.int64)])
            self._known = np.concatenate([self._known, np.zeros(grow - self._known.size, np.int64)])
        cached = bool(ids.size) and bool((self._known[ids] >= seq_len).all())
        seen = self._last_epoch[ids]
        compare = torch.from_numpy((seen > 0) & (seen < self.epoch))
        self._last_epoch[ids] = self.epoch
        self._known[ids] = np.maximum(self._known[ids], seq_len)
        keys = torch.from_numpy(ids)[:, None] * self.positions + torch.arange(seq_len)[None, :]
        compare = compare[:, None].expand(-1, seq_len)
        if layout == "sb":
            keys, compare = keys.t(), compare.t()
        self._batch = (keys.contiguous(), compare.contiguous(), tuple(keys.shape), cached)   # host until first use

    def clear_batch(self) -> None:
        self._batch = None

    # --- the layer's side ------------------------------------------------------------------------------------------
    def token_keys(self, shape: Sequence[int], device) -> Optional[Tuple[torch.Tensor, torch.Tensor, bool]]:
        """(keys [N], compare [N], whole batch cached) for a layer input of `shape` (without the hidden dim), or
        None when no batch is set or the layer sees other tokens than the batch's (e.g. sequence-parallel shards)."""
        if self._batch is None:
            return None
        keys, compare, bshape, cached = self._batch
        if tuple(shape) != bshape:
            return None
        if keys.device != torch.device(device):      # one copy per batch, shared by every layer's call
            keys, compare = keys.to(device, non_blocking=True), compare.to(device, non_blocking=True)
            self._batch = (keys, compare, bshape, cached)
        return keys.reshape(-1), compare.reshape(-1), cached

    def lookup(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        return self._on(layer, keys.device)[keys].long()

    def observe(self, layer: int, keys: torch.Tensor, compare: torch.Tensor, chosen: torch.Tensor) -> None:
        """Count the tokens whose assignment (as a set) is unchanged since it was cached, then cache `chosen`."""
        table = self._table(layer, keys, chosen.device)
        old = table[keys].long()
        same = (old.sort(-1).values == chosen.sort(-1).values).all(-1) & (old[:, 0] >= 0) & compare
        c = torch.stack([same.sum(), compare.sum()]).to(torch.float64)
        self.counts[layer] = self.counts[layer] + c if layer in self.counts else c
        table[keys] = chosen.to(self.dtype)

    def take_counts(self) -> Dict[int, torch.Tensor]:
        out, self.counts = self.counts, {}
        return out

    def _on(self, layer: int, device) -> torch.Tensor:
        """The layer's table on `device` in the cache's dtype (a loaded checkpoint's tables arrive on the host)."""
        t = self.tables[layer]
        if t.device != torch.device(device) or t.dtype != self.dtype:
            self.tables[layer] = t = t.to(device=device, dtype=self.dtype)
        return t

    def _table(self, layer: int, keys: torch.Tensor, device) -> torch.Tensor:
        rows = self._known.size * self.positions
        t = self._on(layer, device) if layer in self.tables else None
        if t is None or t.shape[0] < rows:
            new = torch.full((rows, self.top_k), -1, dtype=self.dtype, device=device)
            if t is not None:
                new[: t.shape[0]] = t
            self.tables[layer] = t = new
        return t

    # --- checkpoints -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Host tensors; tables as int32 (collectives such as gloo's broadcast of a resumed checkpoint have no
        int16); ``load_state_dict`` narrows them again and moves them to the layers' device on first use."""
        return {"active": self.active, "epoch": self.epoch, "positions": self.positions,
                "tables": {k: v.to("cpu", torch.int32) for k, v in self.tables.items()},
                "last_epoch": torch.from_numpy(self._last_epoch.copy()), "known": torch.from_numpy(self._known.copy()),
                "cached_calls": self.cached_calls}

    def load_state_dict(self, state: dict) -> None:
        if state["positions"] != self.positions:
            raise ValueError(f"assignment cache: checkpoint has {state['positions']} positions per sample, this run "
                             f"{self.positions} (the sequence length)")
        self.active, self.epoch = bool(state["active"]), int(state["epoch"])
        self.tables = {int(k): v for k, v in state["tables"].items()}
        self._last_epoch = state["last_epoch"].numpy().copy()
        self._known = state["known"].numpy().copy()
        self.cached_calls = int(state.get("cached_calls", 0))

    @staticmethod
    def merge_states(states: List[dict]) -> dict:
        """One cache state from several data-parallel ranks' ``state_dict``s (a resume at another world size): each
        sample's rows come from the rank that saw it last."""
        positions = states[0]["positions"]
        n = max(int(s["last_epoch"].numel()) for s in states)

        def pad(t):
            return torch.cat([t, t.new_zeros(n - t.numel())])
        last = torch.stack([pad(s["last_epoch"]) for s in states])           # [ranks, samples]
        known = torch.stack([pad(s["known"]) for s in states])
        owner = last.argmax(0)
        samples = torch.arange(n)
        out = {"active": bool(states[0]["active"]), "epoch": max(int(s["epoch"]) for s in states),
               "positions": positions, "last_epoch": last[owner, samples].clone(),
               "known": known[owner, samples].clone(), "tables": {},
               "cached_calls": max(int(s.get("cached_calls", 0)) for s in states)}
        for layer in sorted({k for s in states for k in s["tables"]}):
            k = next(s["tables"][layer] for s in states if layer in s["tables"])
            table = torch.full((n * positions, k.shape[1]), -1, dtype=k.dtype)
            for i, s in enumerate(states):
                t = s["tables"].get(layer)
                if t is None:
                    continue
                mine = samples[owner == i]
                rows = (mine[:, None] * positions + torch.arange(positions)[None, :]).reshape(-1)
                rows = rows[rows < t.shape[0]]
                table[rows] = t[rows]
            out["tables"][layer] = table
        return out


class CachePolicy:
    """On/off from per-epoch fractions of tokens not reassigned (module docstring). ``update(epoch, stable,
    compared)`` is fed every step (from the RECOMPILE trigger); when an epoch has ended it returns the new state
    (True/False) if it changes, else None. ``history`` holds (epoch, fraction, on) per closed epoch (Fig. 10)."""

    def __init__(self, on: float = 0.96, off: float = 0.90, min_epoch: int = 10):
        self.on_threshold, self.off_threshold, self.min_epoch = on, off, min_epoch
        self.on = False
        self.history: List[Tuple[int, Optional[float], bool]] = []
        self._epoch: Optional[int] = None
        self._stable = self._compared = 0.0

    @classmethod
    def from_config(cls, cfg) -> "CachePolicy":
        return cls(cfg.assignment_cache_on, cfg.assignment_cache_off, cfg.assignment_cache_min_epoch)

    def update(self, epoch: int, stable: float, compared: float) -> Optional[bool]:
        decision = None
        if self._epoch is not None and epoch > self._epoch:
            decision = self._close(next_epoch=epoch)
        if self._epoch is None or epoch > self._epoch:
            self._epoch, self._stable, self._compared = epoch, 0.0, 0.0
        self._stable += stable
        self._compared += compared
        return decision

    def state_dict(self) -> dict:
        """On/off, the closed epochs' history and the open epoch's running counts (a resume mid-epoch keeps them)."""
        return {"on": self.on, "history": list(self.history), "open": (self._epoch, self._stable, self._compared)}

    def load_state_dict(self, state: dict) -> None:
        self.on, self.history = bool(state["on"]), [tuple(h) for h in state["history"]]
        if "open" in state:
            epoch, stable, compared = state["open"]
            self._epoch = None if epoch is None else int(epoch)
            self._stable, self._compared = float(stable), float(compared)

    def _close(self, next_epoch: int) -> Optional[bool]:
        fraction = self._stable / self._compared if self._compared > 0 else None
        want = self.on
        if fraction is not None:
            if not self.on and fraction >= self.on_threshold and next_epoch >= self.min_epoch:
                want = True
            elif self.on and fraction < self.off_threshold:
                want = False
        self.history.append((self._epoch, fraction, want))
        if want != self.on:
            self.on = want
            return want
        return None

    @property
    def last_fraction(self) -> Optional[float]:
        return self.history[-1][1] if self.history else None
