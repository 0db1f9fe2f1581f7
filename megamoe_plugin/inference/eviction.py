"""Expert-cache eviction (paper 004 §VI-B): which expert leaves a device slot when an active expert must come in.

``ExpertSlotCache`` is the bookkeeping only (no tensors): it is shared by the runtime expert buffer
(``inference/buffering.py``), which copies weights according to its plans, and by the cache simulator over recorded
routing traces, so the simulated miss rates are those of the runtime.

Per batch, ``plan_batch(active)`` walks the batch's active local experts in ascending id order (the order MoE
implementations run experts in, which is what makes LIFO a good policy, §VI-B) and returns one step per expert:
``(expert, slot, loaded, evicted)``. On a miss with no free slot the victim is chosen in tiers:

1. experts not active in this batch (temporal locality: least likely to be needed soon);
2. active experts already computed in this batch;
3. active experts still needed later in this batch (only when every resident expert is one of them);

and inside a tier by the policy:

* ``lifo``: the most recently loaded (the paper's choice; with E=4, 2 slots and experts 1, 2, 3 active it
  evicts 2, not 1, for 3, keeping the expert with the shortest reuse distance);
* ``fifo``: the oldest loaded;
* ``lru``: the least recently used;
* ``lfu``: the least frequently used, counting every (expert, batch) access since the cache was created (the
  count survives eviction, so a hot expert that was pushed out is still known as hot); ties -> least recently used.

The expert being computed is never a victim (it is the one coming in). With fewer slots than active experts the
experts are loaded, computed and evicted in turn. Counters ``hits`` / ``misses`` count (expert, batch) accesses.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from ..config import EXPERT_CACHE_POLICIES

POLICIES = EXPERT_CACHE_POLICIES           # one list: the config validates --moe-expert-cache-policy with it

SIZE_FLAG = "--moe-expert-cache-size"
POLICY_FLAG = "--moe-expert-cache-policy"

Step = Tuple[int, int, bool, Optional[int]]


class ExpertSlotCache:
    """Which local experts occupy the ``size`` device slots, and the eviction decisions (module docstring)."""

    def __init__(self, size: int, policy: str):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{SIZE_FLAG} must be an int >= 1 to buffer experts, got {size!r}")
        if policy not in POLICIES:
            raise ValueError(f"{POLICY_FLAG} must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.size, self.policy = size, policy
        self.hits = 0
        self.misses = 0
        self._slots: List[Optional[int]] = [None] * size      # slot -> expert
        self._where: Dict[int, int] = {}                       # expert -> slot
        self._loaded_at: Dict[int, int] = {}                   # expert -> clock of its (last) load, resident only
        self._used_at: Dict[int, int] = {}                     # expert -> clock of its last access
        self._freq: Dict[int, int] = {}                        # expert -> accesses since creation
        self._clock = 0

    # --- state -------------------------------------------------------------------------------------------------
    def resident(self) -> Dict[int, int]:
        """expert id -> slot index of every expert in the cache (a copy)."""
        return dict(self._where)

    def clear(self) -> None:
        """Forget which experts are resident (their weights changed); counters and frequencies are kept."""
        self._slots = [None] * self.size
        self._where.clear()
        self._loaded_at.clear()

    def reset_stats(self) -> None:
        self.hits = self.misses = 0

    @property
    def accesses(self) -> int:
        return self.hits + self.misses

    def miss_rate(self) -> float:
        return self.misses / self.accesses if self.accesses else 0.0

    # --- eviction ----------------------------------------------------------------------------------------------
    def _key(self, expert: int):
        """Smaller = evicted first, inside one tier."""
        if self.policy == "lifo":
            return -self._loaded_at[expert]
        if self.policy == "fifo":
            return self._loaded_at[expert]
        if self.policy == "lru":
            return self._used_at[expert]
        return (self._freq.get(expert, 0), self._used_at[expert])

    def _victim(self, active: set, later: set) -> int:
        def tier(e: int) -> int:
            if e not in active:
                return 0
            return 2 if e in later else 1
        return min(self._where, key=lambda e: (tier(e), self._key(e)))

    def plan_batch(self, active: Sequence[int]) -> List[Step]:
        """Steps of one batch, in execution order (ascending expert id): (expert, slot, loaded, evicted expert or
        None). Updates the cache state and the hit / miss counters."""
        order = sorted({int(e) for e in active})
        if order and order[0] < 0:
            raise ValueError(f"expert ids must be >= 0, got {order[0]}")
        active_set, later = set(order), set(order)
        steps: List[Step] = []
        for e in order:
            later.discard(e)
            self._clock += 1
            self._freq[e] = self._freq.get(e, 0) + 1
            slot = self._where.get(e)
            if slot is not None:
                self.hits += 1
                self._used_at[e] = self._clock
                steps.append((e, slot, False, None))
                continue
            self.misses += 1
            evicted = None
            if len(self._where) < self.size:
                slot = self._slots.index(None)
            else:
                evicted = self._victim(active_set, later)
                slot = self._where.pop(evicted)
                del self._loaded_at[evicted]
            self._slots[slot] = e
            self._where[e] = slot
            self._loaded_at[e] = self._used_at[e] = self._clock
            steps.append((e, slot, True, evicted))
        return steps

    def __repr__(self) -> str:
        return (f"ExpertSlotCache(size={self.size}, policy={self.policy!r}, resident={self.resident()}, "
                f"hits={self.hits}, misses={self.misses})")
