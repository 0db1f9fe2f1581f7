"""What the plugin does between Megatron optimizer steps: the placement hook and the metrics at log intervals.

``PluginStepHooks.after_step(model, optimizer, iteration)`` runs on every rank right after ``optimizer.step()``
(FlexMoE paper 001 §3: experts are re-placed between steps, when the optimizer state matches the weights). It
calls the core ``AfterStepHook`` (the policy named by ``--moe-plugin-placement``, every
``--moe-plugin-placement-interval`` steps) with Megatron's model chunks, optimizer, iteration and the MoE layers.
Trainers: the megatron-core example calls it directly; for Megatron-LM's ``pretrain_gpt.py``,
``megatron_lm.install_megatron_lm_hooks()`` wraps ``megatron.training.training.train_step`` so it is called after
every successful update (an update skipped by the fp16 loss scaler is not a step).
"""
from __future__ import annotations

import atexit
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from ..config import MoEConfig
from ..placement import AfterStepHook
from ..stats import TraceRecorder
from .layer import PluginMoELayer, plugin_stats
from .metrics import collect_layer_metrics, write_layer_metrics


def plugin_layers(model) -> List[PluginMoELayer]:
    """The PluginMoELayers of a model or a list of model chunks (Megatron wraps them: DDP, Float16Module)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m for c in chunks for m in c.modules() if isinstance(m, PluginMoELayer)]


class PluginStepHooks:
    def __init__(self, cfg: MoEConfig, num_layers: int, policy=None):
        self.cfg, self.num_layers = cfg, num_layers
        self.after = AfterStepHook(cfg, policy)
        self.trace: Optional[TraceRecorder] = None
        if cfg.trace_path:          # routing of training forwards (grad enabled), under the coming iteration
            rank = dist.get_rank() if dist.is_initialized() else 0
            world = dist.get_world_size() if dist.is_initialized() else 1
            self.trace = TraceRecorder(cfg.trace_path, rank, world, cfg.num_experts, cfg.top_k, cfg.trace_token_ids)
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

    def after_step(self, model, optimizer, iteration: int, **extra) -> bool:
        """Call on every rank after a successful ``optimizer.step()``; ``iteration`` = steps done so far."""
        self.start_iteration(iteration + 1)
        return self.after.run(model, optimizer, iteration, moe_layers=plugin_layers(model), **extra)

    def log_metrics(self, iteration: int, writer=None, wandb_writer=None) -> Dict[int, dict]:
        """Collective (every rank): reduce the per-layer stats since the last call and write them."""
        metrics = collect_layer_metrics(self.num_layers, self.cfg.num_experts, self.cfg.expert_parallel_size)
        write_layer_metrics(metrics, iteration, writer, wandb_writer)
        return metrics


_HOOKS: Optional[PluginStepHooks] = None


def get_step_hooks(cfg: Optional[MoEConfig] = None, num_layers: int = 0) -> PluginStepHooks:
    """The process-wide hooks object (built on first use from the plugin config)."""
    global _HOOKS
    if _HOOKS is None or (cfg is not None and _HOOKS.cfg is not cfg):
        if cfg is None:
            raise RuntimeError("megamoe-plugin: step hooks requested before the plugin config exists")
        _HOOKS = PluginStepHooks(cfg, num_layers)
    return _HOOKS
