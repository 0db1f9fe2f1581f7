"""What the plugin does between Megatron optimizer steps: the placement hook and the metrics at log intervals.

``PluginStepHooks.after_step(model, optimizer, iteration)`` runs on every rank right after ``optimizer.step()``
(FlexMoE paper 001 §3: experts are re-placed between steps, when the optimizer state matches the weights). It
calls the core ``AfterStepHook`` (the policy named by ``--moe-plugin-placement``, every
``--moe-plugin-placement-interval`` steps) with Megatron's model chunks, optimizer, iteration and the MoE layers.
Trainers: the megatron-core example calls it directly; for Megatron-LM's ``pretrain_gpt.py``,
``megatron_lm.install_megatron_lm_hooks()`` wraps ``megatron.training.training.train_step`` so it is called after
every successful update (an update skipped by the fp16 loss scaler is not a step).

Placement (``--moe-plugin-placement flexmoe|shadow``): the policy moves experts' rows and their optimizer state
between steps (placement/). Two things Megatron does not know about replicas are handled here:

* gradient-norm clipping: a replicated expert's rows (all equal after the replica all-reduce) would count once per
  replica in Megatron's grad norm. On the first ``after_step`` the optimizers holding expert banks get a
  grad-norm gradient collector (``get_grads_for_grad_norm``; ``get_main_grads_for_grad_norm`` up
  to megatron-core 0.16) that scales each slot's gradient rows by sqrt(1 / replicas) (free slots: 0), so
  the norm, and hence clipping, counts every logical expert once, whatever the placement;
* metrics: the policy's ``metrics`` (placement/policies.py) go to the tensorboard / wandb writers as
  ``moe_placement/<key>`` at log intervals (``log_metrics``) and into one short progress-line fragment
  (``metrics.format_placement_metrics``).

DynaMoE (``--moe-plugin-capacity-policy dynamic``, ``--moe-plugin-assignment-cache``, paper 000): one
``dynamic.DynamicRuntime`` over the model's plugin layers (by global layer number), made by ``setup(model)``
before the first forward (the example trainer calls it; otherwise the first ``after_step`` does) and stepped in
``after_step``: RECOMPILE's trigger thread decides new per-expert capacities / caching on or off from the
job-wide metrics, applied Δ_launch steps later. Its metrics go to the writers as ``moe_dynamic/<key>`` and into
the progress line (``metrics.format_dynamic_metrics``). The trainer's data pipeline gives the assignment cache
each micro-batch's sample indices (``dynamic.cache.set_batch``; layout "sb": Megatron's [S, B, H]).
"""
from __future__ import annotations

import atexit
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from ..config import MoEConfig
from ..placement import AfterStepHook
from ..stats import TraceRecorder
from ..layer import find_moe_layers
from ..placement.optim_state import sharded_range
from .compat import grad_norm_method, wrap_grads_for_norm
from .layer import PluginMoELayer, plugin_stats
from ..dynamic.runtime import DynamicRuntime, dynamic_enabled
from .metrics import collect_layer_metrics, write_dynamic_metrics, write_layer_metrics, write_placement_metrics


def plugin_layers(model) -> List[PluginMoELayer]:
    """The PluginMoELayers of a model or a list of model chunks (Megatron wraps them: DDP, Float16Module)."""
    return [m for m in find_moe_layers(model) if isinstance(m, PluginMoELayer)]


class PluginStepHooks:
    def __init__(self, cfg: MoEConfig, num_layers: int, policy=None):
        self.cfg, self.num_layers = cfg, num_layers
        self.after = AfterStepHook(cfg, policy)
        self.dynamic: Optional[DynamicRuntime] = None
        self.trace: Optional[TraceRecorder] = None
        if cfg.trace_path:          # routing of training forwards (grad enabled), under the coming iteration
            rank = dist.get_rank() if dist.is_initialized() else 0
            world = dist.get_world_size() if dist.is_initialized() else 1
            self.trace = TraceRecorder(cfg.trace_path, rank, world, cfg.num_experts, cfg.top_k)
            self.trace.next_step(1)
            plugin_stats().listeners.append(self._record)
            atexit.register(self.trace.flush)

    def _record(self, layer_id, routing) -> None:
        if torch.is_grad_enabled():
            self.trace(layer_id, routing)

    def start_iteration(self, iteration: int) -> None:
        """Optional: the iteration number the next training forwards belong to (a resumed run calls it once)."""
        if self.trace is not None:
            self.trace.next_step(iteration)

    def setup(self, model, positions: int = 0) -> Optional[DynamicRuntime]:
        """Make the DynaMoE runtime over the model's plugin layers (collective, idempotent; None when neither
        dynamic capacity nor the assignment cache is on). `positions`: the sequence length, the assignment
        cache's positions per sample."""
        if self.dynamic is None and dynamic_enabled(self.cfg):
            if self.cfg.assignment_cache and not positions:
                raise ValueError("megamoe-plugin: --moe-plugin-assignment-cache needs the sequence length "
                                 "(--seq-length)")
            layers = {int(m.layer_id or 0): m for m in plugin_layers(model)}
            self.dynamic = DynamicRuntime(self.cfg, layers, positions=positions)
        return self.dynamic

    def attach_gate_sync(self, model, optimizer) -> None:
        """--moe-plugin-gate-sync local / average:K: clip by a norm identical on every rank (before the first
        step; idempotent). The trainer wraps its finalize_model_grads with ``gate_sync.keep_local_gate_grads``."""
        if self.cfg.local_gates:
            from .gate_sync import identical_clip_norm
            identical_clip_norm(model, optimizer)

    def after_step(self, model, optimizer, iteration: int, **extra) -> bool:
        """Call on every rank after a successful ``optimizer.step()``; ``iteration`` = steps done so far."""
        self.start_iteration(iteration + 1)
        mode, every = self.cfg.gate_sync_mode
        if mode == "average" and iteration % every == 0:
            from .gate_sync import average_gates
            average_gates(model, optimizer)
        layers = plugin_layers(model)
        if self.after.policy is not None:
            weight_replica_grad_norm(layers, optimizer)      # before any replica exists (idempotent)
        ran = self.after.run(model, optimizer, iteration, moe_layers=layers, **extra)
        if dynamic_enabled(self.cfg):
            self.setup(model)
            ran = self.dynamic.after_step(iteration) or ran
        return ran

    def dynamic_metrics(self) -> Dict[str, float]:
        """DynaMoE metrics (average capacity factor, dropped fraction, recompilations, caching) or {}."""
        return self.dynamic.metrics() if self.dynamic is not None else {}

    def placement_metrics(self) -> Dict[str, float]:
        """The placement policy's metrics of its last run (this rank's view; {} without a policy or a run), plus
        ``moves_total`` when the policy counts its moves."""
        policy = self.after.policy
        metrics = getattr(policy, "metrics", None)
        if not isinstance(metrics, dict) or not metrics:
            return {}
        out = {k: float(v) for k, v in metrics.items()}
        if hasattr(policy, "total_moves"):
            out["moves_total"] = float(policy.total_moves)
        return out

    def log_metrics(self, iteration: int, writer=None, wandb_writer=None) -> Dict[int, dict]:
        """Collective (every rank): reduce the per-layer stats since the last call and write them, with the
        placement policy's metrics (``placement_metrics``)."""
        metrics = collect_layer_metrics(self.num_layers, self.cfg.num_experts, self.cfg.expert_parallel_size)
        write_layer_metrics(metrics, iteration, writer, wandb_writer)
        write_placement_metrics(self.placement_metrics(), iteration, writer, wandb_writer)
        write_dynamic_metrics(self.dynamic_metrics(), iteration, writer, wandb_writer)
        return metrics


def _inner_optimizers(optimizer) -> List[object]:
    chain = getattr(optimizer, "chained_optimizers", None)
    return list(chain) if chain else [optimizer]


def weight_replica_grad_norm(layers: List[PluginMoELayer], optimizer) -> int:
    """Make Megatron's grad norm count every logical expert once (module docstring): wrap
    grad-norm gradient collector (compat.GRAD_NORM_METHODS) of each (chained) optimizer that holds expert-bank parameters (or their fp32
    master copies). Idempotent; returns how many optimizers were wrapped by this call."""
    banks: Dict[int, object] = {}            # id(bank parameter) -> its layer's PlacementRuntime
    params = []
    for layer in layers:
        rt = layer.plan.placement
        if rt is None or layer.experts.bank.w1.shape[0] == layer.experts.num_local_experts:
            continue                         # no spare slot: no replica can ever exist
        for p in layer.experts.bank.parameters():
            banks[id(p)] = rt
            params.append(p)
    if not banks or optimizer is None:
        return 0
    wrapped = 0
    for opt in _inner_optimizers(optimizer):
        if getattr(opt, "_megamoe_grad_norm_weighted", False) or grad_norm_method(opt) is None:
            continue
        # id(parameter the optimizer updates) -> (runtime, None) for whole [slots, ...] tensors, or (runtime,
        # (first flat element, elements per slot)) for a distributed optimizer's 1-D shard of one
        table = {}
        for g16, g32 in zip(getattr(opt, "float16_groups", None) or [],
                            getattr(opt, "fp32_from_float16_groups", None) or []):
            for p16, p32 in zip(g16, g32):
                if id(p16) in banks:
                    table[id(p32)] = (banks[id(p16)], None)
        for p in opt.get_parameters():
            if id(p) in banks:
                table[id(p)] = (banks[id(p)], None)
        for p in params:
            held = sharded_range(opt, p)
            if held is not None:
                level, start, _ = held
                group, order = level.model_param_group_index_map[p]
                main = level.optimizer.param_groups[group]["params"][order]
                table[id(main)] = (banks[id(p)], (start, p[0].numel()))
        if not table:
            continue

        def weighted(grads, opt=opt, table=table):
            by_grad = {}
            for p in opt.get_parameters():
                rt = table.get(id(p))
                if rt is not None:
                    for g in (getattr(p, "decoupled_grad", None), p.grad):
                        if g is not None:
                            by_grad[id(g)] = rt
            if not by_grad:
                return grads
            out = []
            for g in grads:
                rt, shard = by_grad.get(id(g), (None, None))
                if rt is not None:
                    w = rt.slot_weights()
                    if bool(((w > 0) & (w < 1)).any()):           # some expert has replicas right now
                        w = w.sqrt().to(device=g.device, dtype=g.dtype)
                        if shard is None:
                            g = g * w.view(-1, *([1] * (g.dim() - 1)))
                        else:                                   # element i of the shard is in slot (start + i) // n
                            start, n = shard
                            slot = torch.div(torch.arange(start, start + g.numel(), device=g.device), n,
                                             rounding_mode="floor")
                            g = g * w[slot].view_as(g)
                out.append(g)
            return out

        wrap_grads_for_norm(opt, weighted)
        opt._megamoe_grad_norm_weighted = True
        wrapped += 1
    return wrapped


_HOOKS: Optional[PluginStepHooks] = None


def get_step_hooks(cfg: Optional[MoEConfig] = None, num_layers: int = 0) -> PluginStepHooks:
    """The process-wide hooks object (built on first use from the plugin config)."""
    global _HOOKS
    if _HOOKS is None or (cfg is not None and _HOOKS.cfg is not cfg):
        if cfg is None:
            raise RuntimeError("megamoe-plugin: step hooks requested before the plugin config exists")
        _HOOKS = PluginStepHooks(cfg, num_layers)
    return _HOOKS
