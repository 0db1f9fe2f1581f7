"""Deploying a trained MoE model for inference (paper 004): what the inference flags do when a checkpoint is loaded.

The three fixes of paper 004 as the adapters apply them:

* **Dynamic gating** (§V) needs nothing here: the core's dropless dispatch is what an eval forward runs by
  default (``--moe-dispatch dropless``, or capacity dispatch with ``--moe-eval-capacity-factor 0``): no capacity,
  no padding, no [tokens x experts x capacity] masks.
* **Load balancing** (§VII): ``--moe-placement-file`` (written by ``megamoe balance`` from a routing trace) permutes
  each MoE layer's experts (gate rows and expert weights alike) so that experts often active together sit on
  different devices; the model's outputs are unchanged (``balance.apply_expert_permutation``).
* **Expert buffering** (§VI): ``--moe-expert-cache-size N`` keeps every expert's weights in (pinned) host memory
  and N device slots per expert bank, filled per batch by ``--moe-expert-cache-policy`` (``buffering.py``).

``prepare_for_inference(model, cfg)`` applies them in that order (the permutation moves weights that buffering then
copies to the host); the fairseq models call it from ``prepare_for_inference_`` (fairseq-generate, fairseq-eval-lm,
fairseq-interactive, after ``.half()`` / ``.cuda()``), the Megatron example trainer with ``--skip-train``, and
``megamoe trace`` / the inference benchmark directly. ``refuse_in_training`` is the adapters' check that these
flags are not given to a training run: a permutation would not match the optimizer's state, and buffered experts
do not train.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch.nn as nn

from ..config import ConfigError, MoEConfig, flag
from .balance import apply_placement_file
from .buffering import enable_expert_buffering

__all__ = ["inference_flags_set", "refuse_in_training", "prepare_for_inference"]


def inference_flags_set(cfg: MoEConfig) -> List[str]:
    """The names of the inference-only options `cfg` sets."""
    out = []
    if cfg.expert_cache_size:
        out.append("expert_cache_size")
    if cfg.placement_file:
        out.append("placement_file")
    return out


def refuse_in_training(cfg: MoEConfig, where: str, spell: Callable[[str], str] = flag) -> None:
    """ConfigError naming the flags (as `spell` writes them for the trainer) when a training run sets them."""
    names = inference_flags_set(cfg)
    if names:
        flags = ", ".join(f"{spell(n)}={getattr(cfg, n)!r}" for n in names)
        raise ConfigError(f"{flags}: inference only (paper 004), not for training with {where}: a placement file "
                          f"permutes experts without their optimizer state and buffered experts do not train. Use "
                          f"them with fairseq-generate / fairseq-eval-lm (--model-overrides), the Megatron example's "
                          f"--skip-train, or `megamoe trace`; for placement during training see --moe-placement.")


def prepare_for_inference(model: nn.Module, cfg: MoEConfig, log: Optional[Callable[[str], None]] = None,
                          strict: bool = True) -> Dict[str, object]:
    """Apply ``--moe-placement-file`` then ``--moe-expert-cache-size`` to `model` (module docstring); returns what
    was done: permuted layer ids, buffers, device bytes of the expert slots vs all experts. `strict`: every layer
    of the placement file must be in `model` (pass False on a pipeline stage)."""

    out: Dict[str, object] = {"permuted_layers": [], "buffers": []}
    if cfg.placement_file:
        out["permuted_layers"] = apply_placement_file(model, cfg.placement_file, strict=strict)
        if log:
            log(f"megamoe-plugin: {flag('placement_file')} {cfg.placement_file}: experts of MoE layer(s) "
                f"{out['permuted_layers']} permuted (outputs unchanged)")
    if cfg.expert_cache_size:
        model.eval()
        buffers = enable_expert_buffering(model, cfg.expert_cache_size, cfg.expert_cache_policy)
        out["buffers"] = buffers
        slots = sum(b.device_bytes() for b in buffers)
        full = sum(b.full_bytes() for b in buffers)
        out["device_bytes"], out["full_bytes"] = slots, full
        if log:
            log(f"megamoe-plugin: expert buffering, {cfg.expert_cache_size} slot(s) per bank, "
                f"{cfg.expert_cache_policy}: {len(buffers)} bank(s), expert weights on the device "
                f"{slots / 2**20:.2f} MiB instead of {full / 2**20:.2f} MiB")
    return out
