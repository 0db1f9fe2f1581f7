"""What the plugin adds to fairseq's trainer, installed once when the user dir is imported.

fairseq has no plugin hook for these, so the user dir wraps a few trainer functions; each wrapper does nothing
unless the model has plugin MoE layers (``model.moe_config``), so other models train exactly as before.

- ``Trainer.__init__``: reject settings that cannot work with sharded experts (``args.check_trainer_settings``).
- ``Trainer.train_step``: routing traces of training steps (``--moe-trace-path``, ``TrainingTrace``); after every
  successful update, the after-step hook (``--moe-placement``, every
  ``--moe-placement-interval`` updates) with the model, optimizer and update number (FlexMoE paper 001 §3:
  placement changes happen between optimizer steps). An update skipped by the fp16 scaler is not a step. After
  each policy run its ``metrics`` go into fairseq's logs as ``moe_placement_<name>`` (``log_placement_metrics``).
- ``FairseqOptimizer.all_reduce_grads`` and ``utils.clip_grad_norm_``: expert gradients (``distributed.py``).
- ``checkpoint_utils.save_checkpoint`` / ``Trainer.state_dict`` / ``Trainer.load_checkpoint``: checkpoints hold
  every expert and its optimizer state by logical expert id whatever the placement (each expert's owner row,
  gathered onto rank 0 before it writes; spare vExpert slots are not saved), and loading puts them into this
  rank's slots under its current placement, so nothing is lost and a checkpoint loads at any expert-parallel size
  (1 for fairseq-generate/eval-lm) and any spare-slot count.
- DynaMoE (``--moe-capacity-policy dynamic``, ``--moe-assignment-cache``; ``dynamic.py``): one
  ``DynamicRuntime`` per trainer, built in ``Trainer.__init__``; ``Trainer.begin_epoch`` records the epoch; in
  ``Trainer.train_step`` every training forward gets its samples' cache keys (``task.train_step`` is wrapped for
  the update), and after every successful update RECOMPILE's step runs on every rank and its metrics go into the
  logs as ``moe_dyn_<name>``; checkpoints hold every rank's capacities, pending decisions and cache
  (``extra_state["megamoe_dynamic"]``) and a resumed run restores them.
- torch >= 2.6 compatibility that fairseq itself lacks: the checkpoint broadcast of a distributed resume
  (``distributed.utils._broadcast_object_slow``) and ``argparse.Namespace`` configs in checkpoints.
"""
from __future__ import annotations

import atexit
import functools
import logging
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..layer import finish_global_batch, moe_layers
from ..placement import AfterStepHook
from ..placement.checkpoint import logical_from_gathered
from ..stats import TraceRecorder
from . import distributed as moe_dist
from .args import check_trainer_settings
from ..gate_sync import GateSync, gather_rank_states, load_rank_state, rank_state_for
from .dynamic import STATE_KEY as _DYNAMIC_KEY
from .dynamic import FairseqDynamic
from .layers import FairseqMoEFFN, gather_experts, moe_ffns, release_gathered

# policy metrics that add up over the runs of a log interval (the others: mean over the runs, or the last value)
_SUMMED_METRICS = ("moves", "bytes_moved")
_LAST_METRICS = ("replicas", "shadowed")

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
    """Collective over each expert-parallel group holding rank `dst`: {state index: {key: [E, ...] tensor by
    logical expert id}} on rank `dst` ({} elsewhere). With one expert-parallel rank, local: only when the bank's
    rows are not already the logical ones (spare slots, a placement)."""
    full: Dict[int, Dict[str, torch.Tensor]] = {}
    state = trainer.optimizer.optimizer.state
    me = dist.get_rank() if dist.is_initialized() else 0
    for layer, q, idx in _expert_optimizer_params(trainer):
        members = layer.ep.global_ranks
        if dst not in members or layer.logical_layout():
            continue
        st = state.get(q, {})
        for key in sorted(k for k, v in st.items() if torch.is_tensor(v) and v.shape == q.shape):
            t = st[key].detach().contiguous()
            if layer.ep.size == 1:
                full.setdefault(idx, {})[key] = layer.to_logical(t)
                continue
            parts = [torch.empty_like(t) for _ in members] if me == dst else None
            dist.gather(t, parts, dst=dst, group=layer.ep.group)
            if me == dst:
                full.setdefault(idx, {})[key] = logical_from_gathered(torch.cat(parts, 0), layer.placement)
    return full


def _expert_state_tensors(trainer) -> Dict[Tuple[int, str], torch.Tensor]:
    """The expert optimizer state tensors as they are now (before a load), without building the optimizer."""
    if getattr(trainer, "_optimizer", None) is None:
        return {}
    state = trainer.optimizer.optimizer.state
    return {(id(q), key): v for _, q, _ in _expert_optimizer_params(trainer)
            for key, v in state.get(q, {}).items() if torch.is_tensor(v)}


def slice_expert_optimizer_state(trainer, before: Optional[Dict[Tuple[int, str], torch.Tensor]] = None) -> None:
    """After loading: the expert optimizer state tensors the load put in ([E, ...] by logical id, as checkpoints
    hold them) become this rank's [slots, ...] rows under its current placement (free slots zero). `before`: the
    tensors from before the load (``_expert_state_tensors``), left alone (nothing was loaded when the optimizer
    state is the same objects, e.g. no checkpoint or --reset-optimizer)."""
    before = before or {}
    state = trainer.optimizer.optimizer.state
    for layer, q, _ in _expert_optimizer_params(trainer):
        E = layer.moe.cfg.num_experts
        st = state.get(q, {})
        for key, v in list(st.items()):
            if not torch.is_tensor(v) or v.dim() != q.dim() or v.dim() == 0 or v.shape[1:] != q.shape[1:]:
                continue                                   # scalars such as Adam's step
            if before.get((id(q), key)) is v:
                continue                                   # not loaded: already this rank's rows
            if v.shape[0] != E:
                raise RuntimeError(f"megamoe-plugin: checkpoint optimizer state {key!r} of an expert parameter has "
                                   f"{v.shape[0]} experts, the model {E}: checkpoints hold all experts by logical "
                                   "id (--moe-expert-count must match)")
            st[key] = layer.to_local(v)        # (the load made these tensors: no one else holds them)


def _register_optimizer_placements(trainer) -> None:
    """The optimizer's copies of expert parameters (fp32 masters with --fp16) carry their layer's placement for
    the clipper, like the parameters themselves (once per optimizer object)."""
    opt = getattr(trainer, "_optimizer", None)
    if opt is None or getattr(trainer, "_megamoe_registered_optimizer", None) is opt:
        return
    for layer, q, _ in _expert_optimizer_params(trainer):
        if layer.ep.size > 1:
            moe_dist.register_expert_placement(q, layer.placement)
    trainer._megamoe_registered_optimizer = opt


def log_placement_metrics(policy) -> None:
    """A placement policy's ``metrics`` (dict of floats, set by its last run) into fairseq's active logs (the
    train_inner lines and the epoch summary): ``moe_placement_<name>``. Moves and bytes add up over the runs of a
    log interval; replicas and shadowed experts are the last run's; the ratios and times are means over the runs.
    Times (``*_s``, seconds) keep 6 decimals: the cost model predicts microseconds for small layers."""
    values = getattr(policy, "metrics", None)
    if not isinstance(values, dict) or not values:
        return
    from fairseq.logging import metrics
    for name, value in values.items():
        try:
            value = float(value)
        except (TypeError, ValueError):
            continue
        key, digits = f"moe_placement_{name}", 6 if name.endswith("_s") else 3
        if name in _SUMMED_METRICS:
            metrics.log_scalar_sum(key, value, priority=100, round=digits)
        else:
            metrics.log_scalar(key, value, weight=0 if name in _LAST_METRICS else 1, priority=100, round=digits)


# --- routing traces of the training steps (--moe-trace-path) -----------------------------------------------------
class TrainingTrace:
    """Records every MoE layer's routing during ``train_step`` (not validation) under the update's number; each
    rank writes its shard ``<path>.rank<r>`` at every checkpoint save and at exit (``stats.load_trace`` merges)."""

    def __init__(self, model, moe):
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.recorder = TraceRecorder(moe.trace_path, rank, world, moe.num_experts, moe.top_k)
        self.recording = False
        for m in moe_ffns(model):
            m.moe.stats.listeners.append(self)
        atexit.register(self.recorder.flush)

    def __call__(self, layer_id, routing):
        if self.recording:
            self.recorder(layer_id, routing)


# --- wrappers ------------------------------------------------------------------------------------------------------
def _dynamic(trainer) -> Optional[FairseqDynamic]:
    return getattr(trainer, "_megamoe_dynamic", None)


def _wrap_trainer(Trainer) -> None:
    init, train_step, state_dict, load_checkpoint, begin_epoch = (
        Trainer.__init__, Trainer.train_step, Trainer.state_dict, Trainer.load_checkpoint, Trainer.begin_epoch)

    @functools.wraps(init)
    def __init__(self, cfg, *args, **kwargs):
        init(self, cfg, *args, **kwargs)
        moe = _moe_config(self)
        if moe is not None:
            check_trainer_settings(cfg, moe)
            self._megamoe_dynamic = FairseqDynamic.create(self, moe)
            self._megamoe_hook = AfterStepHook(moe)
            self._megamoe_gate_sync = GateSync(moe, dist.group.WORLD if dist.is_initialized() else None)
            self._megamoe_trace = TrainingTrace(_raw_model(self), moe) if moe.trace_path else None

    @functools.wraps(begin_epoch)
    def wrapped_begin_epoch(self, epoch, *args, **kwargs):
        dyn = _dynamic(self)
        if dyn is not None:
            dyn.begin_epoch(epoch)
        return begin_epoch(self, epoch, *args, **kwargs)

    @functools.wraps(train_step)
    def wrapped_train_step(self, samples, *args, **kwargs):
        if getattr(self, "_megamoe_hook", None) is not None:
            self.optimizer                      # noqa: B018  (built here as train_step would: fp32 copies exist)
            _register_optimizer_placements(self)
        before = self.get_num_updates()
        _UPDATE[0] = before + 1
        for m in moe_layers(_raw_model(self)):     # flags of validation forwards since the last update: not this one's
            m.stats.take_nonfinite()
        trace = getattr(self, "_megamoe_trace", None)
        if trace is not None:
            trace.recorder.next_step(before + 1)
            trace.recording = True
        dyn = _dynamic(self)
        undo = dyn.intercept(self.task) if dyn is not None else None
        try:
            out = train_step(self, samples, *args, **kwargs)
        finally:
            if trace is not None:
                trace.recording = False
            if undo is not None:
                undo()
                dyn.clear_batch()           # validation forwards must not key into training samples
        world = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
        finish_global_batch(_raw_model(self), world, world)      # expert bias / global loss: once per global batch
        if dyn is not None and self.get_num_updates() > before:
            dyn.after_update(self.get_num_updates())       # every rank, every update: two all-reduces
        sync = getattr(self, "_megamoe_gate_sync", None)
        if sync is not None and self.get_num_updates() > before:
            sync.after_step(_raw_model(self), self.get_num_updates())      # --moe-gate-sync average:K
        hook = getattr(self, "_megamoe_hook", None)
        if hook is not None and self.get_num_updates() > before:
            last = getattr(getattr(self.cfg, "optimization", None), "max_update", 0) or None    # 0: no limit
            if hook.run(_raw_model(self), self.optimizer, self.get_num_updates(), last_step=last, trainer=self):
                log_placement_metrics(hook.policy)
        return out

    @functools.wraps(state_dict)
    def wrapped_state_dict(self):
        sd = state_dict(self)
        full = getattr(self, "_megamoe_optimizer_full", None)
        opt_state = sd.get("last_optimizer_state")
        if full and isinstance(opt_state, dict):
            for idx, tensors in full.items():    # a new dict: torch's state_dict shares the live state's dicts
                opt_state["state"][idx] = {**opt_state["state"][idx], **tensors}
        dyn = _dynamic(self)
        if dyn is not None and isinstance(sd.get("extra_state"), dict):
            sd["extra_state"][_DYNAMIC_KEY] = dyn.checkpoint_state(getattr(self, "_megamoe_dynamic_full", None))
        if getattr(self, "_megamoe_gates", None) and isinstance(sd.get("extra_state"), dict):
            sd["extra_state"][_GATES_KEY] = self._megamoe_gates
        return sd

    @functools.wraps(load_checkpoint)
    def wrapped_load_checkpoint(self, *args, **kwargs):
        moe = _moe_config(self) is not None
        before = _expert_state_tensors(self) if moe else {}
        extra = load_checkpoint(self, *args, **kwargs)
        if moe and getattr(self, "_optimizer", None) is not None:
            slice_expert_optimizer_state(self, before)
        dyn = _dynamic(self)
        if dyn is not None and isinstance(extra, dict) and extra.get(_DYNAMIC_KEY):
            ck = self.cfg.checkpoint
            filename = args[0] if args else kwargs.get("filename")
            # a restarted data order or another run's data (--finetune-from-model's first load): the cache's
            # sample indices may mean other samples; the capacities stay
            fresh = bool(ck.reset_dataloader) or (bool(ck.finetune_from_model) and filename == ck.finetune_from_model)
            dyn.load(extra[_DYNAMIC_KEY], reset_cache=fresh)
        sync = getattr(self, "_megamoe_gate_sync", None)
        if sync is not None and sync.per_rank_state and isinstance(extra, dict) and extra.get(_GATES_KEY):
            rank = dist.get_rank() if dist.is_initialized() else 0
            world = dist.get_world_size() if dist.is_initialized() else 1
            load_rank_state(_raw_model(self), rank_state_for(extra[_GATES_KEY], rank, world), self.optimizer)
        return extra

    Trainer.__init__ = __init__
    Trainer.train_step = wrapped_train_step
    Trainer.state_dict = wrapped_state_dict
    Trainer.load_checkpoint = wrapped_load_checkpoint
    Trainer.begin_epoch = wrapped_begin_epoch


def _wrap_save(checkpoint_utils) -> None:
    save = checkpoint_utils.save_checkpoint

    @functools.wraps(save)
    def save_checkpoint(cfg, trainer, epoch_itr, val_loss):
        # experts by logical id: gathered over the EP group, or (one EP rank) the owners' rows of the local bank
        by_logical_id = _moe_config(trainer) is not None and not cfg.no_save
        if by_logical_id:
            gather_experts(_raw_model(trainer))
            if not cfg.no_save_optimizer_state:
                trainer._megamoe_optimizer_full = gather_expert_optimizer_state(trainer)
        trace = getattr(trainer, "_megamoe_trace", None)
        if trace is not None:
            trace.recorder.flush()
        dyn = _dynamic(trainer)
        if dyn is not None and not cfg.no_save:
            trainer._megamoe_dynamic_full = dyn.gather_states()     # every rank's capacities and cache, on rank 0
        if getattr(trainer, "_megamoe_gate_sync", None) is not None and trainer._megamoe_gate_sync.per_rank_state \
                and not cfg.no_save:                                # every rank's own gate and its Adam state
            trainer._megamoe_gates = gather_rank_states(_raw_model(trainer), trainer.optimizer)
        try:
            return save(cfg, trainer, epoch_itr, val_loss)
        finally:
            if by_logical_id:
                release_gathered(_raw_model(trainer))
                trainer._megamoe_optimizer_full = None
            trainer._megamoe_dynamic_full = None
            trainer._megamoe_gates = None

    checkpoint_utils.save_checkpoint = save_checkpoint


_GATES_KEY = "megamoe_gates"      # extra_state: every rank's gate (--moe-gate-sync local / average:K)
_UPDATE = [0]       # the update train_step is computing (for the non-finite check's message)


def _check_nonfinite_routing(module) -> None:
    """--moe-nonfinite raise: after backward, before clipping and the optimizer step. fairseq treats the
    FloatingPointError as it does NaN gradients (crash.pt, NaN detector rerun, stop), with our message naming
    the MoE layers, the update and the ranks."""
    from ..layer import moe_layers
    from ..stats import NonFiniteRoutingError, check_nonfinite
    layers = moe_layers(module)
    if not layers or layers[0].cfg.nonfinite == "off":
        return
    group = dist.group.WORLD if dist.is_initialized() else None
    problem = check_nonfinite({id(m.stats): m.stats for m in layers}.values(), _UPDATE[0], group)
    if problem:
        raise NonFiniteRoutingError(problem)


def _wrap_gradients(FairseqOptimizer, fairseq_utils) -> None:
    all_reduce = FairseqOptimizer.all_reduce_grads

    @functools.wraps(all_reduce)
    def all_reduce_grads(self, module):
        all_reduce(self, module)
        moe_dist.sync_expert_grads(module)
        _check_nonfinite_routing(module)

    FairseqOptimizer.all_reduce_grads = all_reduce_grads
    original_clip = fairseq_utils.clip_grad_norm_
    fairseq_utils.clip_grad_norm_ = functools.partial(moe_dist.clip_grad_norm_, fallback=original_clip)


def _wrap_broadcast_object(fairseq_dist_utils) -> None:
    """Compatibility: fairseq's checkpoint broadcast (rank 0 has loaded the checkpoint, with torch.load's
    weights-only unpickler, and hands the in-memory state, omegaconf config included, to the other ranks of the
    job) serialises it with torch.save and reads it back with torch.load, whose weights-only default (torch >= 2.6)
    refuses the omegaconf config. The object never comes from a file here, only from this job's rank 0 over its
    process group, so it goes through torch.distributed's own object broadcast instead; nothing else in the
    process changes (torch.load keeps its safe default everywhere)."""
    if getattr(fairseq_dist_utils, "_broadcast_object_slow", None) is None:
        return

    def broadcast_object_slow(obj, src_rank, group, dist_device):
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=src_rank, group=group, device=dist_device)
        return box[0]

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
