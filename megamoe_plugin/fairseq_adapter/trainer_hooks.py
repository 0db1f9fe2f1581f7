"""What the plugin adds to fairseq's trainer, installed once when the user dir is imported.

fairseq has no plugin hook for these, so the user dir wraps a few trainer functions; each wrapper does nothing
unless the model has plugin MoE layers (``model.moe_config``), so other models train exactly as before.

- ``Trainer.__init__``: reject settings that cannot work with sharded experts (``args.check_trainer_settings``).
- ``Trainer.train_step``: routing traces of training steps (``--moe-trace-path``, ``TrainingTrace``); after every
  successful update, the after-step hook (``--moe-placement``, every
  ``--moe-placement-interval`` updates) with the model, optimizer and update number (FlexMoE paper 001 §3:
  placement changes happen between optimizer steps). An update skipped by the fp16 scaler is not a step.
- ``FairseqOptimizer.all_reduce_grads`` and ``utils.clip_grad_norm_``: expert gradients (``distributed.py``).
- ``checkpoint_utils.save_checkpoint`` / ``Trainer.state_dict`` / ``Trainer.load_checkpoint``: checkpoints hold
  every expert and its optimizer state by global expert id (gathered onto rank 0 before it writes, sliced on
  load), so nothing is lost and a checkpoint loads at any expert-parallel size (1 for fairseq-generate/eval-lm).
- torch >= 2.6 compatibility that fairseq itself lacks: the checkpoint broadcast of a distributed resume
  (``distributed.utils._broadcast_object_slow``) and ``argparse.Namespace`` configs in checkpoints.
"""
from __future__ import annotations

import atexit
import functools
import logging
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from ..placement import AfterStepHook
from ..stats import TraceRecorder
from . import distributed as moe_dist
from .args import check_trainer_settings
from .layers import FairseqMoEFFN, gather_experts, moe_ffns, release_gathered

logger = logging.getLogger(__name__)
_INSTALLED = False


def _raw_model(trainer):
    return getattr(trainer, "_model", None) or trainer.model


def _moe_config(trainer):
    return getattr(_raw_model(trainer), "moe_config", None)


# --- optimizer state of expert parameters --------------------------------------------------------------------------
def _expert_optimizer_params(trainer) -> List[Tuple[FairseqMoEFFN, torch.nn.Parameter, int]]:
    """(layer, optimizer-side parameter, index in the torch optimizer's state_dict) of every expert parameter."""
    opt = trainer.optimizer
    torch_opt = opt.optimizer
    to_opt = {}
    if getattr(opt, "fp32_params", None) is not None and isinstance(opt.fp32_params, list):
        to_opt = {id(p16): p32 for p16, p32 in zip(opt.fp16_params, opt.fp32_params)}
    index = {}
    for group in torch_opt.param_groups:
        for p in group["params"]:
            index[id(p)] = len(index)
    out = []
    for layer in moe_ffns(_raw_model(trainer)):
        for p in layer.moe.experts.parameters():
            q = to_opt.get(id(p), p)
            if id(q) in index:
                out.append((layer, q, index[id(q)]))
    return out


def gather_expert_optimizer_state(trainer, dst: int = 0) -> Dict[int, Dict[str, torch.Tensor]]:
    """Collective: {state index: {key: full [E, ...] tensor}} on rank `dst` ({} elsewhere)."""
    full: Dict[int, Dict[str, torch.Tensor]] = {}
    state = trainer.optimizer.optimizer.state
    me = dist.get_rank()
    for layer, q, idx in _expert_optimizer_params(trainer):
        members = layer.ep.global_ranks
        if layer.ep.size == 1 or dst not in members:
            continue
        st = state.get(q, {})
        for key in sorted(k for k, v in st.items() if torch.is_tensor(v) and v.shape == q.shape):
            t = st[key].detach().contiguous()
            parts = [torch.empty_like(t) for _ in members] if me == dst else None
            dist.gather(t, parts, dst=dst, group=layer.ep.group)
            if me == dst:
                full.setdefault(idx, {})[key] = torch.cat(parts, 0)
    return full


def slice_expert_optimizer_state(trainer) -> None:
    """After loading: keep this rank's rows of full [E, ...] expert optimizer state tensors."""
    state = trainer.optimizer.optimizer.state
    for layer, q, _ in _expert_optimizer_params(trainer):
        E = layer.moe.cfg.num_experts
        st = state.get(q, {})
        for key, v in list(st.items()):
            if torch.is_tensor(v) and v.dim() == q.dim() and v.shape[0] == E and v.shape[0] != q.shape[0] \
                    and v.shape[1:] == q.shape[1:]:
                st[key] = v[layer.expert_rows()].clone()


# --- routing traces of the training steps (--moe-trace-path) -----------------------------------------------------
class TrainingTrace:
    """Records every MoE layer's routing during ``train_step`` (not validation) under the update's number; each
    rank writes its shard ``<path>.rank<r>`` at every checkpoint save and at exit (``stats.load_trace`` merges)."""

    def __init__(self, model, moe):
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.recorder = TraceRecorder(moe.trace_path, rank, world, moe.num_experts, moe.top_k, moe.trace_token_ids)
        self.recording = False
        for m in moe_ffns(model):
            m.moe.stats.listeners.append(self)
        atexit.register(self.recorder.flush)

    def __call__(self, layer_id, routing):
        if self.recording:
            self.recorder(layer_id, routing)


# --- wrappers ------------------------------------------------------------------------------------------------------
def _wrap_trainer(Trainer) -> None:
    init, train_step, state_dict, load_checkpoint = (Trainer.__init__, Trainer.train_step, Trainer.state_dict,
                                                    Trainer.load_checkpoint)

    @functools.wraps(init)
    def __init__(self, cfg, *args, **kwargs):
        init(self, cfg, *args, **kwargs)
        moe = _moe_config(self)
        if moe is not None:
            check_trainer_settings(cfg, moe)
            self._megamoe_hook = AfterStepHook(moe)
            self._megamoe_trace = TrainingTrace(_raw_model(self), moe) if moe.trace_path else None

    @functools.wraps(train_step)
    def wrapped_train_step(self, samples, *args, **kwargs):
        before = self.get_num_updates()
        trace = getattr(self, "_megamoe_trace", None)
        if trace is not None:
            trace.recorder.next_step(before + 1)
            trace.recording = True
        try:
            out = train_step(self, samples, *args, **kwargs)
        finally:
            if trace is not None:
                trace.recording = False
        hook = getattr(self, "_megamoe_hook", None)
        if hook is not None and self.get_num_updates() > before:
            hook.run(_raw_model(self), self.optimizer, self.get_num_updates(), trainer=self)
        return out

    @functools.wraps(state_dict)
    def wrapped_state_dict(self):
        sd = state_dict(self)
        full = getattr(self, "_megamoe_optimizer_full", None)
        opt_state = sd.get("last_optimizer_state")
        if full and isinstance(opt_state, dict):
            for idx, tensors in full.items():    # a new dict: torch's state_dict shares the live state's dicts
                opt_state["state"][idx] = {**opt_state["state"][idx], **tensors}
        return sd

    @functools.wraps(load_checkpoint)
    def wrapped_load_checkpoint(self, *args, **kwargs):
        extra = load_checkpoint(self, *args, **kwargs)
        if _moe_config(self) is not None:
            slice_expert_optimizer_state(self)
        return extra

    Trainer.__init__ = __init__
    Trainer.train_step = wrapped_train_step
    Trainer.state_dict = wrapped_state_dict
    Trainer.load_checkpoint = wrapped_load_checkpoint


def _wrap_save(checkpoint_utils) -> None:
    save = checkpoint_utils.save_checkpoint

    @functools.wraps(save)
    def save_checkpoint(cfg, trainer, epoch_itr, val_loss):
        sharded = (_moe_config(trainer) is not None and not cfg.no_save and dist.is_initialized()
                   and _moe_config(trainer).expert_parallel_size > 1)
        if sharded:
            gather_experts(_raw_model(trainer))
            if not cfg.no_save_optimizer_state:
                trainer._megamoe_optimizer_full = gather_expert_optimizer_state(trainer)
        trace = getattr(trainer, "_megamoe_trace", None)
        if trace is not None:
            trace.recorder.flush()
        try:
            return save(cfg, trainer, epoch_itr, val_loss)
        finally:
            if sharded:
                release_gathered(_raw_model(trainer))
                trainer._megamoe_optimizer_full = None

    checkpoint_utils.save_checkpoint = save_checkpoint


def _wrap_gradients(FairseqOptimizer, fairseq_utils) -> None:
    all_reduce = FairseqOptimizer.all_reduce_grads

    @functools.wraps(all_reduce)
    def all_reduce_grads(self, module):
        all_reduce(self, module)
        moe_dist.sync_expert_grads(module)

    FairseqOptimizer.all_reduce_grads = all_reduce_grads
    original_clip = fairseq_utils.clip_grad_norm_
    fairseq_utils.clip_grad_norm_ = functools.partial(moe_dist.clip_grad_norm_, fallback=original_clip)


def _wrap_broadcast_object(fairseq_dist_utils) -> None:
    """Compatibility: torch >= 2.6 loads with weights_only=True by default, and fairseq's checkpoint broadcast
    (rank 0 reads the checkpoint, pickles it to the other ranks of the same job) then fails on its omegaconf
    config. Unpickle that one object as before (weights_only=False): it comes from this job's rank 0."""
    slow = getattr(fairseq_dist_utils, "_broadcast_object_slow", None)
    if slow is None:
        return

    @functools.wraps(slow)
    def broadcast_object_slow(*args, **kwargs):
        load = torch.load
        torch.load = functools.partial(load, weights_only=False)
        try:
            return slow(*args, **kwargs)
        finally:
            torch.load = load

    fairseq_dist_utils._broadcast_object_slow = broadcast_object_slow


def _allow_namespace_checkpoints() -> None:
    """Compatibility: fairseq stores a legacy (argparse) model's config, e.g. ``moe_transformer``'s, as an
    ``argparse.Namespace`` in the checkpoint, which torch >= 2.6's default ``torch.load(weights_only=True)``
    refuses (fairseq-generate, fairseq-train --restore-file). A Namespace is a plain attribute container: allow it."""
    import argparse
    add = getattr(torch.serialization, "add_safe_globals", None)
    if add is not None:
        add([argparse.Namespace])


def install() -> None:
    """Idempotent: wrap fairseq's trainer, checkpointing and gradient functions."""
    global _INSTALLED
    if _INSTALLED:
        return
    from fairseq import checkpoint_utils, utils
    from fairseq.distributed import utils as fairseq_dist_utils
    from fairseq.optim import FairseqOptimizer
    from fairseq.trainer import Trainer
    _wrap_trainer(Trainer)
    _wrap_save(checkpoint_utils)
    _wrap_gradients(FairseqOptimizer, utils)
    _wrap_broadcast_object(fairseq_dist_utils)
    _allow_namespace_checkpoints()
    _INSTALLED = True
