"""Expert buffering at inference (paper 004 §VI): every expert's weights live in host memory, a few device slots
cache the active ones.

This module owns ``ExpertBuffer`` (the buffer of one ``ExpertBank``) and ``enable_expert_buffering`` /
``disable_expert_buffering``, which act on every ``ExpertBank`` of a model (``model.modules()``): the core
``MoELayer``, the Megatron adapter's bank and fairseq's layer alike, without importing either framework.

Per bank, once enabled:

* the expert parameters ``w1``, ``w2`` (and ``b1``, ``b2``) are moved to host memory, pinned when the bank was on
  CUDA: the parameters stay the same ``nn.Parameter`` objects (names, attributes, ``state_dict`` keys unchanged),
  only their ``.data`` is now the host copy, so ``state_dict()`` returns CPU tensors and the full device copy is
  freed (on CUDA it goes back to PyTorch's caching allocator, reusable at once; ``torch.cuda.empty_cache()``
  returns it to the driver); ``load_state_dict`` / ``ExpertBank.load_expert_state`` write into the host copy and the cache notices
  (the parameters' version counters change) and reloads. Writes through ``.data`` bypass that check: call
  ``ExpertBuffer.invalidate()`` after them. Moving the model (``.to(device)``, ``.half()``) is noticed on the next
  forward: the parameters go back to host memory and the slots follow the new device / dtype.
* the device holds ``cache_size`` slots (tensors ``[slots, ...]`` for w1, w2, b1, b2 in the bank's dtype);
* each forward (inference only: ``eval()`` and no gradients) reads the active experts from ``tokens_per_expert``
  (count > 0), asks ``ExpertSlotCache.plan_batch`` (inference/eviction.py: inactive experts are evicted first, then
  by the policy, LIFO by default) which experts to copy into which slot, copies the missing ones host -> slot and
  runs each expert's FFN on its token group with the slot's weights: experts arrive one by one, so the buffered
  bank always computes with the loop kernel (``experts.expert_forward``'s per-expert GEMMs); its output is bitwise
  the unbuffered bank's under ``--moe-expert-kernel loop``, and within fp32 rounding of it when the unbuffered
  bank uses the grouped GEMM.
* on CUDA the copies run on a dedicated copy stream: a copy waits for the event recorded after the last compute
  that read its slot, the compute waits for its copy's event, and copies are issued ahead as far as their slot is
  free, so loading the next experts overlaps computing the current one. (The bank is called after the dispatch
  exchange, so the copies overlap the expert computation, not the all-to-all as in the paper.)
* elsewhere (CPU) a copy is a plain ``copy_`` and the experts run in phases: all experts whose slots do not clash
  are loaded, then computed together (with the same CPU lanes as the unbuffered bank). The CPU "device" cache is a
  second memory pool next to the host copy, so it saves no memory there; it exists so the whole mechanism (plans,
  slot remapping, counters, outputs) is exercised and tested on every machine.

``disable_expert_buffering`` puts the parameters back on the device (identical values) and frees the slots.
Not supported while buffered (a clear error, not a silent fallback): training, the smart schedule (it reads the
bank's weights directly), a non-trivial expert placement (replicas / shadows), and capacity dispatch at inference
with a static expert graph.

Counters per buffer: hits, misses, loads, bytes copied; ``device_bytes()`` (the slots) vs ``full_bytes()`` (all
local experts on the device) give the static memory saved.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn as nn

from ..config import ConfigError, flag
from ..experts import ExpertBank, _act_into, _bounds, _lanes_for, _mm_into, _run_groups, _use_onednn
from .eviction import POLICIES, ExpertSlotCache
from ..dispatch.plan import DispatchPlan

_NAMES = ("w1", "w2", "b1", "b2")
_SIZE_FLAG = flag("expert_cache_size")


class ExpertBuffer:
    """Host-resident experts of one ``ExpertBank`` with ``cache_size`` device slots (module docstring).

    Attributes: ``bank``, ``cache`` (the ``ExpertSlotCache``), ``device`` (where the slots and the computation
    live), ``slots`` (name -> [S, ...] device tensor), ``host`` (name -> the parameters' host tensors), counters
    ``loads`` and ``bytes_copied``; ``hits`` / ``misses`` are the cache's."""

    def __init__(self, bank: ExpertBank, cache_size: int, policy: str = "lifo"):
        if not isinstance(bank, ExpertBank):
            raise TypeError(f"ExpertBuffer needs an ExpertBank, got {type(bank).__name__}")
        if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 1:
            raise ValueError(f"{_SIZE_FLAG} must be an int >= 1 to buffer experts, got {cache_size!r}")
        if policy not in POLICIES:
            raise ValueError(f"{flag('expert_cache_policy')} must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.bank = bank
        self.num_experts = bank.w1.shape[0]
        self.cache_size = cache_size                       # as asked; the slots are min(cache_size, E_local)
        self.cache = ExpertSlotCache(min(cache_size, self.num_experts), policy)
        self.device = bank.w1.device
        self.slots: Dict[str, torch.Tensor] = {}
        self.host: Dict[str, torch.Tensor] = {}
        self.loads = 0
        self.bytes_copied = 0
        self._copy_stream = None
        self._ready: List = []      # per slot: CUDA event recorded after the copy into it
        self._free: List = []       # per slot: CUDA event recorded after the last compute that read it
        self._sig = None
        self._offload()

    # --- parameters: host copies and device slots ---------------------------------------------------------------
    def _params(self) -> Dict[str, nn.Parameter]:
        return {n: getattr(self.bank, n) for n in _NAMES if getattr(self.bank, n) is not None}

    def _pin(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_available()

    def _signature(self):
        return tuple((n, p.data_ptr(), p._version, p.dtype, p.device) for n, p in self._params().items())

    @torch.no_grad()
    def _offload(self) -> None:
        """Parameters -> host memory (their .data), slots on self.device; the cache starts empty."""
        if self._copy_stream is not None:
            self._copy_stream.synchronize()             # slots may be reallocated below: no copy in flight
        params = self._params()
        for p in params.values():
            if p.device.type != "cpu":
                self.device = p.device              # enabled on a device, or the model was moved since
        pin = self._pin()
        for n, p in params.items():
            host = p.detach()
            if pin and not host.is_pinned():            # straight into pinned memory: one host copy, not two
                host = torch.empty(host.shape, dtype=host.dtype, pin_memory=True).copy_(host)
            elif host.device.type != "cpu":
                host = host.to("cpu")
            if host is not p.data:
                p.data = host
            self.host[n] = p.data
        S = self.cache.size
        for n, p in params.items():
            old = self.slots.get(n)
            shape = (S,) + tuple(p.shape[1:])
            if old is None or old.shape != shape or old.dtype != p.dtype or old.device != self.device:
                self.slots[n] = torch.empty(shape, dtype=p.dtype, device=self.device)
        if self.device.type == "cuda" and (self._copy_stream is None or self._copy_stream.device != self.device):
            self._copy_stream = torch.cuda.Stream(device=self.device)
            self._ready = [torch.cuda.Event() for _ in range(S)]
            self._free = [torch.cuda.Event() for _ in range(S)]
        self.cache.clear()
        self._sig = self._signature()

    def invalidate(self) -> None:
        """The experts' weights changed behind the parameters' back (e.g. through ``.data``): reload them."""
        self._offload()

    @torch.no_grad()
    def restore(self) -> None:
        """Parameters back on the device (identical values); the slots are freed."""
        self._sync()
        if self._copy_stream is not None:
            self._copy_stream.synchronize()             # no copy may still write into the slots freed below
        for n, p in self._params().items():
            if self.device.type != "cpu":
                p.data = self.host[n].to(self.device)
        self.slots.clear()
        self.host.clear()
        self._copy_stream, self._ready, self._free = None, [], []

    def _sync(self) -> None:
        if self._signature() != self._sig:
            self._offload()

    # --- memory accounting --------------------------------------------------------------------------------------
    def expert_bytes(self) -> int:
        """Bytes of one expert's weights (one load)."""
        return sum(t[0].numel() * t.element_size() for t in self.host.values())

    def device_bytes(self) -> int:
        """Static device memory of the buffered bank: the slots."""
        return sum(t.numel() * t.element_size() for t in self.slots.values())

    def full_bytes(self) -> int:
        """Static device memory of the unbuffered bank: every local expert."""
        return self.num_experts * self.expert_bytes()

    def saved_bytes(self) -> int:
        return self.full_bytes() - self.device_bytes()

    @property
    def hits(self) -> int:
        return self.cache.hits

    @property
    def misses(self) -> int:
        return self.cache.misses

    def stats(self) -> Dict[str, float]:
        return {"slots": self.cache.size, "policy": self.cache.policy, "hits": self.hits, "misses": self.misses,
                "miss_rate": self.cache.miss_rate(), "loads": self.loads, "bytes_copied": self.bytes_copied,
                "device_bytes": self.device_bytes(), "full_bytes": self.full_bytes(),
                "saved_bytes": self.saved_bytes()}

    def reset_stats(self) -> None:
        self.cache.reset_stats()
        self.loads = self.bytes_copied = 0

    # --- forward ------------------------------------------------------------------------------------------------
    def _check(self, x: torch.Tensor, counts: Sequence[int]) -> None:
        bank = self.bank
        if bank.training:
            raise RuntimeError(f"expert buffering ({_SIZE_FLAG}) is inference-only: call model.eval(), or "
                               "disable_expert_buffering(model) before training")
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError(f"expert buffering ({_SIZE_FLAG}) computes no gradients: run the model under "
                               "torch.no_grad() / torch.inference_mode()")
        if bank.placement is not None and not bank.placement.trivial:
            raise RuntimeError(f"expert buffering ({_SIZE_FLAG}) needs the initial expert placement; this bank has "
                               "replicated / moved / shadowed experts")
        if len(counts) != self.num_experts:
            raise ValueError(f"tokens_per_expert has {len(counts)} entries, the bank {self.num_experts} experts")
        if x.device != self.device:
            raise RuntimeError(f"expert buffering: input on {x.device} but the expert slots on {self.device}; "
                               "disable_expert_buffering(model) before moving the model to another device kind")

    def _load(self, expert: int, slot: int, non_blocking: bool) -> None:
        for n, host in self.host.items():
            self.slots[n][slot].copy_(host[expert], non_blocking=non_blocking)
        self.loads += 1
        self.bytes_copied += self.expert_bytes()

    def forward(self, x: torch.Tensor, tokens_per_expert) -> torch.Tensor:
        # which experts to load is a host decision: device counts are read here
        counts = tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert) else [int(c) for c in tokens_per_expert]
        self._sync()                        # the parameters were reloaded or moved: back to host, slots follow
        self._check(x, counts)              # before no_grad: it refuses inputs that want gradients
        with torch.no_grad():
            return self._forward(x, counts)

    def _forward(self, x: torch.Tensor, counts: List[int]) -> torch.Tensor:
        bank = self.bank
        groups = _bounds(counts)
        plan = self.cache.plan_batch([e for e, _, _ in groups])
        w1, w2 = self.slots["w1"], self.slots["w2"]
        b1, b2 = self.slots.get("b1"), self.slots.get("b2")
        onednn = _use_onednn(x, bank.cpu_gemm)
        lanes = _lanes_for(x, groups, w1, bank.cpu_lanes)        # as the unbuffered bank: same kernels, same threads
        # the buffers of experts.expert_forward
        h = x.new_empty(x.shape[0], w1.shape[2])
        a = x.new_empty(x.shape[0], w2.shape[1])
        y = x.new_empty(x.shape[0], w2.shape[2])
        y[sum(counts):].zero_()             # rows the gate dropped (kept at the tail by the dispatcher)

        def expert(slot, s, t):
            _mm_into(x[s:t], w1[slot], h[s:t], onednn, None if b1 is None else b1[slot])
            _act_into(h[s:t], a[s:t], bank.activation)
            _mm_into(a[s:t], w2[slot], y[s:t], onednn, None if b2 is None else b2[slot])

        steps = [(e, slot, loaded, s, t) for (e, slot, loaded, _), (_, s, t) in zip(plan, groups)]
        if self.device.type == "cuda":
            self._run_cuda(steps, expert)
        else:
            self._run_phases(steps, expert, lanes)
        return y

    __call__ = forward

    def _run_phases(self, steps, expert, lanes: int) -> None:
        """Synchronous copies: load every expert of a phase, then compute the phase; a load into a slot that an
        expert of the current phase still has to read starts the next phase."""
        phase: List[Tuple[int, int, int]] = []
        for e, slot, loaded, s, t in steps:
            if loaded and any(slot == p[0] for p in phase):
                _run_groups(expert, phase, lanes)
                phase = []
            if loaded:
                self._load(e, slot, non_blocking=False)
            phase.append((slot, s, t))
        if phase:
            _run_groups(expert, phase, lanes)

    def _run_cuda(self, steps, expert) -> None:
        """Copies on the copy stream, issued ahead as far as their slot is free; compute on the current stream."""
        compute = torch.cuda.current_stream(self.device)
        copy = self._copy_stream
        prev_user, dep = {}, {}          # step index -> index of the earlier step of this batch reading its slot
        for i, (_, slot, loaded, _, _) in enumerate(steps):
            if loaded:
                dep[i] = prev_user.get(slot, -1)
            prev_user[slot] = i
        loads = [i for i, st in enumerate(steps) if st[2]]
        nxt = 0
        for i, (_, slot, _, s, t) in enumerate(steps):
            # every copy whose slot's last reader is already enqueued (steps < i) can go now, in order
            while nxt < len(loads) and dep[loads[nxt]] < i:
                j = loads[nxt]
                e_j, slot_j = steps[j][0], steps[j][1]
                copy.wait_event(self._free[slot_j])
                with torch.cuda.stream(copy):
                    self._load(e_j, slot_j, non_blocking=True)
                self._ready[slot_j].record(copy)
                nxt += 1
            compute.wait_event(self._ready[slot])
            expert(slot, s, t)
            self._free[slot].record(compute)

    def __repr__(self) -> str:
        return (f"ExpertBuffer(experts={self.num_experts}, slots={self.cache.size}, policy={self.cache.policy!r}, "
                f"device={self.device}, hits={self.hits}, misses={self.misses})")


# --- model-level switches -------------------------------------------------------------------------------------------
def _check_model(model: nn.Module) -> None:
    """Paths that read the bank's weights without calling it cannot be buffered: refuse them up front."""
    for m in model.modules():
        plan = getattr(m, "plan", None)
        if not isinstance(plan, DispatchPlan):
            continue
        if plan.smart is not None:
            raise ConfigError(f"{_SIZE_FLAG}: the smart schedule ({flag('schedule')}=smart) reads the experts' "
                              f"weights directly; use {flag('schedule')}=plain with expert buffering")
        cfg = plan.cfg
        if plan.static_graph is not None and cfg.dispatch == "capacity" and cfg.eval_capacity_factor != 0:
            raise ConfigError(f"{_SIZE_FLAG}: a static expert graph ({flag('expert_graph')}) reads the experts' "
                              f"weights directly; use {flag('eval_capacity_factor')}=0 (dropless inference) or "
                              f"{flag('expert_graph')}=none with expert buffering")


def expert_banks(model: nn.Module) -> List[ExpertBank]:
    return [m for m in model.modules() if isinstance(m, ExpertBank)]


def enable_expert_buffering(model: nn.Module, cache_size: int, policy: str = "lifo") -> List[ExpertBuffer]:
    """Buffer every ExpertBank of `model` (paper 004 §VI): experts in host memory, `cache_size` device slots per
    bank (>= the bank's experts: all resident). `cache_size` 0 means off (as ``--moe-expert-cache-size 0``):
    buffering is disabled and [] returned. Banks already buffered are restored first. Returns the buffers (also at
    ``bank.expert_buffer``). The model should be in eval mode; forwards must run without gradients."""
    if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 0:
        raise ValueError(f"{_SIZE_FLAG} must be an int >= 0 (0 = off), got {cache_size!r}")
    if policy not in POLICIES:
        raise ValueError(f"{flag('expert_cache_policy')} must be one of {', '.join(POLICIES)}, got {policy!r}")
    disable_expert_buffering(model)
    if cache_size == 0:
        return []
    _check_model(model)
    buffers = []
    for bank in expert_banks(model):
        buf = ExpertBuffer(bank, cache_size, policy)
        bank.expert_buffer = buf
        bank.forward = buf.forward          # instance attribute: nn.Module.__call__ (and its hooks) reach it
        buffers.append(buf)
    return buffers


def disable_expert_buffering(model: nn.Module) -> int:
    """Undo ``enable_expert_buffering``: parameters back on the device with identical values, the bank's own
    forward again. Returns how many banks were restored."""
    n = 0
    for bank in expert_banks(model):
        buf = bank.__dict__.pop("expert_buffer", None)
        if buf is None:
            continue
        bank.__dict__.pop("forward", None)
        buf.restore()
        n += 1
    return n


def expert_buffers(model: nn.Module) -> List[ExpertBuffer]:
    """The buffers of a model's buffered banks."""
    return [b.__dict__["expert_buffer"] for b in expert_banks(model) if "expert_buffer" in b.__dict__]
