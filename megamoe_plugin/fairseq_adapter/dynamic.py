"""DynaMoE in fairseq-train (paper 000): dynamic capacity and sample-assignment caching through the trainer hooks.

``trainer_hooks`` builds one ``FairseqDynamic`` per trainer when ``--moe-capacity-policy dynamic`` or
``--moe-assignment-cache`` is on (``create``), around ONE ``dynamic.runtime.DynamicRuntime`` holding every MoE
layer of the model by its global layer id, agreeing over the whole job, and calls it:

- ``begin_epoch(epoch)`` (``Trainer.begin_epoch``, fairseq epochs are 1-based): the assignment cache compares a
  sample's gate choice with the one cached in an earlier epoch.
- ``before_forward(sample, ignore_grad)``: before every training forward of an update (each sample of
  ``--update-freq``), the cache's batch is the sample's dataset indices (``sample["id"]``) and token length
  (``net_input.src_tokens`` is [B, T]). fairseq's decoder layers see the tokens as [T, B, C]
  (``TransformerDecoderBase`` transposes before its layers, and ``FairseqMoEFFN`` hands the MoE layer that shape
  and the real tokens' indices), hence layout "sb". A dummy batch (fairseq's stand-in on a rank without data,
  ``ignore_grad``) gets no keys: it neither reads nor refreshes the cache. ``clear_batch`` after the update, so
  validation forwards never key into training samples.
- ``after_update(num_updates)``: on every rank after each optimizer update (an update skipped by the fp16 scaler
  is none; a rank that ran a dummy batch still updates, like all others): ``DynamicRuntime.after_step`` (two small
  all-reduces over the job), then the runtime's metrics into fairseq's logs as ``moe_dyn_<name>``.
- checkpoints: ``gather_states`` (a collective, from the plugin's save wrapper on every rank) collects every rank's
  state on rank 0 -- the capacities in force, the decisions RECOMPILE has computed but not yet applied, the
  policies' state, the rank's own assignment cache -- and the trainer's state dict writes them under
  ``extra_state["megamoe_dynamic"]``; ``load`` gives each rank its own state back (another world size: rank 0's
  capacities and the merged caches), so a resumed run trains on with the same capacities, the same pending
  decisions and the same cache.

The cache keys a token by ``sample index x positions + position`` and holds one batch shape at a time, so it is
for decoder-only models (``moe_transformer_lm``): an encoder-decoder model's encoder and decoder see sequences of
different lengths (and left-padded sources shift positions with the batch). Its positions per sample are the
task's sequence length: ``--tokens-per-sample`` (+1 with ``--add-bos-token``), else the model's
``max_target_positions``.
"""
from __future__ import annotations

import logging
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from ..config import ConfigError
from ..dynamic.assignment_cache import AssignmentCache
from ..dynamic.runtime import DynamicRuntime, dynamic_enabled
from .layers import moe_ffns

logger = logging.getLogger(__name__)

STATE_KEY = "megamoe_dynamic"
# runtime metrics that are counts or states (the last value of a log interval); the others are means
_LAST_METRICS = ("recompilations", "recompile_waits", "capacity_max", "cache_on", "cached_calls",
                 "cache_stable_fraction")


def log_dynamic_metrics(values: Dict[str, float]) -> None:
    """``DynamicRuntime.metrics()`` into fairseq's active logs (train_inner lines and the epoch summary) as
    ``moe_dyn_<name>``: the average capacity factor and the dropped fraction are means over the updates of the
    interval, counters (recompilations, cached calls, waits) and states (cache on, the last closed epoch's stable
    fraction, the largest capacity) the last value."""
    from fairseq.logging import metrics
    for name, value in values.items():
        try:
            value = float(value)
        except (TypeError, ValueError):
            continue
        metrics.log_scalar(f"moe_dyn_{name}", value, weight=0 if name in _LAST_METRICS else 1, priority=110,
                           round=4)


def _setting(cfg, name, default=None):
    try:
        v = getattr(cfg, name, default)
    except Exception:            # omegaconf: missing key in a struct config
        return default
    return default if v is None else v


def sequence_positions(trainer_cfg, model) -> Tuple[int, str]:
    """(tokens per training sample, the flag that sets it): the assignment cache's positions per sample."""
    task = getattr(trainer_cfg, "task", None)
    tps = _setting(task, "tokens_per_sample")
    if tps:
        bos = bool(_setting(task, "add_bos_token", False))
        return int(tps) + int(bos), f"--tokens-per-sample={int(tps)}" + (" with --add-bos-token" if bos else "")
    decoder = getattr(model, "decoder", None)
    mtp = getattr(decoder, "max_target_positions", None) or _setting(getattr(trainer_cfg, "model", None),
                                                                      "max_target_positions")
    if mtp:
        return int(mtp), f"--max-target-positions={int(mtp)}"
    raise ConfigError("megamoe-plugin: --moe-assignment-cache: cannot tell the task's sequence length (no "
                      "--tokens-per-sample, no --max-target-positions); set --tokens-per-sample")


def check_cache_model(model) -> None:
    """The assignment cache keys the tokens of ``net_input.src_tokens``: every MoE layer must see exactly those."""
    encoder = getattr(model, "encoder", None)
    if encoder is not None and moe_ffns(encoder):
        raise ConfigError("megamoe-plugin: --moe-assignment-cache needs a decoder-only model (moe_transformer_lm): "
                          f"{type(model).__name__} has MoE layers in its encoder, whose source sequences have "
                          "another length than the decoder's (the cache keys one batch shape per forward)")


class FairseqDynamic:
    """The trainer's DynaMoE state (module docstring)."""

    def __init__(self, runtime: DynamicRuntime, positions_source: Optional[str] = None):
        self.rt = runtime
        self.cache = runtime.cache
        self.epoch = 1
        self.positions_source = positions_source
        self._epochs_logged = 0

    @classmethod
    def create(cls, trainer, moe) -> Optional["FairseqDynamic"]:
        """The trainer's runtime when --moe-capacity-policy dynamic or --moe-assignment-cache is on, else None.
        Raises ConfigError (naming the flag) for settings that cannot work, before the first step. A collective
        (one all-reduce over the job): every rank builds its trainer."""
        if not dynamic_enabled(moe):
            return None
        model = getattr(trainer, "_model", None) or trainer.model
        layers = {f.moe.layer_id: f.moe for f in moe_ffns(model)}
        cache, source = None, None
        if moe.assignment_cache:
            check_cache_model(model)
            positions, source = sequence_positions(trainer.cfg, model)
            cache = AssignmentCache(moe.top_k, positions, moe.num_experts)
        rt = DynamicRuntime(moe, layers, group=None, cache=cache)
        logger.info("megamoe-plugin: DynaMoE: capacity policy %s, assignment cache %s, RECOMPILE delta_launch %d, "
                    "%d MoE layer(s)", moe.capacity_policy,
                    f"on ({cache.positions} positions per sample)" if cache is not None else "off",
                    rt.recompiler.delta_launch, len(layers))
        return cls(rt, source)

    # --- the training loop --------------------------------------------------------------------------------------
    def begin_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        if self.cache is not None:
            self.cache.set_epoch(self.epoch)

    def before_forward(self, sample, ignore_grad: bool = False) -> None:
        """Before a training forward: the cache's batch is this sample's (none for a dummy batch)."""
        if self.cache is None:
            return
        net_input = sample.get("net_input") if isinstance(sample, dict) else None
        tokens = net_input.get("src_tokens") if isinstance(net_input, dict) else None
        ids = sample.get("id") if isinstance(sample, dict) else None
        if ignore_grad or ids is None or not torch.is_tensor(tokens) or tokens.dim() != 2 or tokens.numel() == 0:
            self.cache.clear_batch()
            return
        try:
            self.cache.set_batch(ids, seq_len=int(tokens.shape[1]), layout="sb", epoch=self.epoch)
        except ValueError as e:
            hint = f" (the task's length: {self.positions_source})" if self.positions_source else ""
            raise ConfigError(f"megamoe-plugin: {e}{hint}") from None

    def clear_batch(self) -> None:
        if self.cache is not None:
            self.cache.clear_batch()

    def intercept(self, task):
        """Wrap ``task.train_step`` (an instance attribute, for this trainer's update only) so every forward of the
        update gets its cache batch first. Returns the function that undoes it (None when already wrapped, as in
        fairseq's AMP retry, which calls train_step again inside train_step)."""
        current = task.train_step
        if self.cache is None or getattr(current, "_megamoe_dynamic", False):
            return None
        had = "train_step" in vars(task)

        def train_step(*args, **kwargs):
            sample = kwargs["sample"] if "sample" in kwargs else (args[0] if args else None)
            ignore = kwargs["ignore_grad"] if "ignore_grad" in kwargs else (len(args) > 5 and bool(args[5]))
            self.before_forward(sample, ignore)
            return current(*args, **kwargs)

        train_step._megamoe_dynamic = True
        task.train_step = train_step

        def undo():
            if had:
                task.train_step = current
            else:
                del task.train_step
        return undo

    def after_update(self, num_updates: int) -> None:
        """On every rank after optimizer update `num_updates`: RECOMPILE's step, then the metrics into the logs,
        and one line per epoch the cache policy has closed (the trigger closes epoch N at the first step of N+1)."""
        self.rt.after_step(num_updates)
        log_dynamic_metrics(self.rt.metrics())
        history = self.rt.cache_history()
        for epoch, fraction, on in history[self._epochs_logged:]:
            kept = "no sample seen in an earlier epoch" if fraction is None else \
                f"cache_stable_fraction {fraction:.4f} of the tokens kept their experts"
            logger.info("megamoe-plugin: DynaMoE epoch %d: %s; assignment caching %s", epoch, kept,
                        "on" if on else "off")
        self._epochs_logged = len(history)

    # --- checkpoints -------------------------------------------------------------------------------------------
    def local_state(self) -> dict:
        """This rank's state: the runtime's (capacities, pending RECOMPILE decisions, policies, cache) and the epoch."""
        return {**self.rt.state_dict(), "epoch": self.epoch}

    def gather_states(self) -> Optional[dict]:
        """Collective over the job: every rank's ``local_state`` on rank 0 (None elsewhere)."""
        mine = self.local_state()
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return {"world_size": 1, "states": {0: mine}}
        world, me = dist.get_world_size(), dist.get_rank()
        parts = [None] * world if me == 0 else None
        dist.gather_object(mine, parts, dst=0)
        return {"world_size": world, "states": dict(enumerate(parts))} if me == 0 else None

    def checkpoint_state(self, gathered: Optional[dict]) -> dict:
        """What the trainer's state dict holds: the gathered states, or (a state dict outside the plugin's save
        wrapper, e.g. fairseq's crash.pt) this rank's own."""
        if gathered is not None:
            return gathered
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        me = dist.get_rank() if world > 1 else 0
        return {"world_size": world, "states": {me: self.local_state()}}

    def load(self, saved: dict, reset_cache: bool = False) -> None:
        """Restore from a checkpoint's ``extra_state["megamoe_dynamic"]``: this rank's own state when the world size
        is the checkpoint's, else the first rank's with the caches of all ranks merged. `reset_cache`
        (--reset-dataloader, --finetune-from-model: sample indices may mean other samples) keeps only capacities."""
        states = {int(r): s for r, s in saved["states"].items()}
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        me = dist.get_rank() if world > 1 else 0
        if int(saved["world_size"]) == world and me in states:
            st = dict(states[me])
        else:
            st = dict(states[min(states)])
            caches = [states[r]["cache"] for r in sorted(states) if "cache" in states[r]]
            if caches:
                st["cache"] = AssignmentCache.merge_states(caches)
        pending = self.rt.load_state_dict(st, keep_cache=not reset_cache)
        self._epochs_logged = len(self.rt.cache_history())
        caps = {lid: c for lid, c in st.get("capacity", {}).items() if c is not None}
        logger.info("megamoe-plugin: DynaMoE state restored: capacities %s, %d pending decision(s)%s",
                    caps or "from the capacity factor", pending,
                    f", assignment caching {'on' if self.cache.active else 'off'}"
                    if self.cache is not None and not reset_cache and "cache" in st else "")

    def close(self) -> None:
        self.rt.close()
