"""MoELayer: x[..., H] -> y[..., H] = gate -> dispatch -> experts -> combine, with aux losses and statistics.

The framework-agnostic layer the adapters wrap. After each forward, ``aux_loss`` holds the sum of the gate's aux
losses (already scaled by their coefficients, differentiable) and ``aux_losses`` the named parts; the layer's
``StatsSink`` has the call's counts. ``collect_aux_loss(model)`` sums the aux losses of every MoELayer of a
model (what a training loop adds to its task loss).

Capacity: in ``capacity`` mode each expert's capacity comes from ``capacity_factor`` (or
``eval_capacity_factor`` at inference, where 0 means dropless), unless ``set_expert_capacity`` fixed a
per-expert vector (dynamic capacity, DynaMoE paper 000 §4.1, changes it between steps).

DynaMoE (``dynamic/``): ``plan.route`` meters the demand for dynamic capacity and uses cached sample assignments
when the model's assignment cache is on; ``plan.finish`` refreshes the cache.

Schedule: with ``schedule == "smart"`` (FasterMoE paper 003 §4.2) a dropless call with expert parallelism runs
dispatch, experts and combine as one pipelined grouped pairwise exchange (dispatch/smart.py); outputs and
gradients are the plain path's.
"""
from __future__ import annotations

from typing import List, Optional, Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist
import torch.nn as nn

from .config import ConfigError, MoEConfig, flag
from .dispatch.plan import DispatchPlan
from .experts import ExpertBank, check_input_dtype
from .gates import build_gate
from .gates.balance import end_global_batch
from .gates.base import TokenBatch
from .parallel import expert_parallel
from .stats import StatsSink


class MoELayer(nn.Module):
    def __init__(self, cfg: MoEConfig, hidden_size: int, ffn_hidden_size: Optional[int] = None,
                 ep_group=None, topology=None, layer_id: int = 0, stats: Optional[StatsSink] = None,
                 dtype: Optional[torch.dtype] = None, device=None, edp_group=None, sequence_layout: str = "bs",
                 batch_group=None):
        super().__init__()
        self.cfg, self.hidden_size, self.layer_id = cfg, hidden_size, layer_id
        if sequence_layout not in ("bs", "sb"):
            raise ValueError(f"sequence_layout={sequence_layout!r}: 'bs' ([batch, seq, H]) or 'sb' ([seq, batch, H])")
        self.sequence_layout = sequence_layout
        self._per_sequence = cfg.balance_coeff("seq_aux_loss") > 0     # the gate needs the tokens' sequences
        self.ep = expert_parallel(ep_group)
        if self.ep.size != cfg.expert_parallel_size:
            raise ConfigError(f"{flag('expert_parallel_size')}={cfg.expert_parallel_size} but the expert-parallel "
                              f"group has {self.ep.size} rank(s)")
        ffn = cfg.expert_ffn_hidden_size or ffn_hidden_size
        if not ffn:
            raise ConfigError(f"{flag('expert_ffn_hidden_size')}: no FFN hidden size given")
        self.gate = build_gate(cfg, hidden_size, ep=self.ep, topology=topology)
        # the global balance loss sums its counts over the global batch: every data-parallel rank (the world,
        # unless the trainer names another group)
        if batch_group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            batch_group = dist.group.WORLD
        self.gate.set_reduction_groups(batch_group=batch_group)
        self.experts = ExpertBank.from_config(cfg, hidden_size, ffn, dtype=dtype, device=device)
        if device is not None:
            self.gate.to(device)
        self.plan = DispatchPlan(cfg, self.ep, topology=topology, edp_group=edp_group)
        if cfg.slots_per_rank > cfg.num_local_experts:
            with torch.no_grad():
                for p in self.experts.parameters():
                    p[cfg.num_local_experts:].zero_()      # spare vExpert slots start free (zeros)
        self.experts.placement = self.plan.placement
        self.stats = stats if stats is not None else StatsSink()
        self.aux_loss: torch.Tensor = torch.zeros(())
        self.aux_losses = {}
        self.last_routing = None

    @property
    def experts_bank(self) -> ExpertBank:
        return self.experts

    # --- capacity (the rules live in DispatchPlan) ----------------------------------------------------------------
    @property
    def dropless(self):
        return self.plan.dropless

    @property
    def capacity_dispatch(self):
        return self.plan.capacity_dispatch

    @property
    def expert_capacity(self) -> Optional[List[int]]:
        return self.plan.expert_capacity

    def set_expert_capacity(self, capacity: Optional[Sequence[int]]) -> None:
        """Fix each expert's capacity (per source rank), or None to go back to the capacity factor."""
        self.plan.set_expert_capacity(capacity)

    def capacity_for(self, num_tokens: int) -> Optional[List[int]]:
        """Per-expert capacity for this call, or None for dropless dispatch."""
        return self.plan.capacity_for(num_tokens, self.training)

    # --- forward -------------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, keys_shape=None, select=None, padding=None) -> torch.Tensor:
        """x [..., H] -> [..., H]. `keys_shape`/`select` (adapters): how x's tokens map to the batch the
        assignment cache was given (default: x's own shape); see ``DispatchPlan.route``. ``padding`` [T] bool
        (True = a padding token, counted in no loss) over the routed tokens. A [B, S, H] input ([S, B, H] with
        ``sequence_layout='sb'``) gives the per-sequence balance loss its sequences."""
        shape = x.shape
        if shape[-1] != self.hidden_size:
            raise ValueError(f"MoELayer expects hidden size {self.hidden_size}, got input of shape {tuple(shape)}")
        check_input_dtype(x, self.experts, f"MoE layer {self.layer_id}")
        tokens = x.reshape(-1, self.hidden_size)
        keys_shape = tuple(shape[:-1]) if keys_shape is None else keys_shape
        batch = None
        if padding is not None or self._per_sequence:
            batch = TokenBatch.from_shape(keys_shape, self.sequence_layout, padding, select, tokens.device)
        y, routing = self.plan.forward(self.gate, tokens, self.training, self.experts, keys_shape, select,
                                       batch=batch)
        self.aux_losses = routing.aux_losses
        self.aux_loss = routing.aux_loss()
        self.last_routing = routing
        self.stats.record(self.layer_id, routing)
        return y.view(shape)


@runtime_checkable
class MoELayerProtocol(Protocol):
    """What every MoE layer of this project is to the features and tools, whichever trainer built it: the core
    ``MoELayer`` (also inside fairseq's ``FairseqMoEFFN``) and Megatron's ``PluginMoELayer``."""

    plan: DispatchPlan                          # the dispatch core it runs, with the features attached to it
    layer_id: int                               # the id traces, placement files and checkpoints use

    @property
    def experts_bank(self) -> ExpertBank: ...

    def set_expert_capacity(self, capacity: Optional[Sequence[int]]) -> None: ...


def find_moe_layers(model) -> List[MoELayerProtocol]:
    """The MoE layers of a model, or of a list of model chunks (Megatron's virtual pipeline), in model order;
    through any wrapper (DDP, Float16Module, fairseq's FairseqMoEFFN). The one finder every feature and adapter
    uses."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m for c in chunks for m in c.modules() if isinstance(m, MoELayerProtocol)]


def moe_layers(model: nn.Module) -> List[MoELayer]:
    """The core MoELayers of a model (the ones that carry ``aux_loss``); ``find_moe_layers`` for every kind."""
    return [m for m in find_moe_layers(model) if isinstance(m, MoELayer)]


def finish_global_batch(model, batch_group=None, data_group=None) -> None:
    """Once per global batch, after its last backward, on every rank: the balancing state of every MoE layer's
    gate moves on (the expert bias's sign update over ``batch_group``, quantile balancing's bias over
    ``data_group``, the global balance loss's counts reset; gates/balance.py). megatron-core's
    ``finalize_model_grads`` does the same for the plugin's Megatron layers; the other trainers call this."""
    end_global_batch([m.gate for m in moe_layers(model)], batch_group, data_group)


def collect_aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum of the aux losses of every MoELayer's last forward (0 when there is none)."""
    losses = [m.aux_loss for m in moe_layers(model)]
    return sum(losses) if losses else torch.zeros(())
