"""MoE FFNs inside fairseq's transformer layers, and their expert-parallel checkpoint format.

``install_moe(model, args, encoder_layers, decoder_layers)`` turns every ``--moe-freq``-th layer of fairseq's
``TransformerEncoderLayerBase`` / ``TransformerDecoderLayerBase`` into an MoE layer without copying fairseq's
layer code: those layers compute ``fc2(activation_dropout(activation_fn(fc1(x))))`` between their own residual,
dropout and layer norm, so ``fc1`` becomes a ``FairseqMoEFFN`` (the core ``MoELayer``: gate -> dispatch -> experts
-> combine) and ``activation_fn``, ``activation_dropout_module`` and ``fc2`` become identities. (The experts apply
their activation themselves; fairseq's --activation-dropout is not applied inside experts.)

Padding: a forward pre-hook hands the layer's padding mask (encoder: ``encoder_padding_mask``; decoder:
``self_attn_padding_mask``) to the FFN, which routes only real tokens, as fairseq's moe branch does (pads neither
cost expert compute nor count in the balance loss; their FFN output is 0). Selecting the real tokens is one
``nonzero`` per MoE layer, a host sync on GPU, only for batches that have padding.

Checkpoints hold every expert by logical id whatever the expert-parallel size and the placement (FlexMoE
vExperts, paper 001 §3.3: where experts live is a run-time matter): every rank's ExpertBank has
``slots_per_rank`` rows (its E/P experts + spare vExpert slots), and the placement runtime (``moe.plan.placement``)
says which logical expert each row holds. ``gather_experts(model)`` (a collective, run by the checkpoint hook on
every rank before rank 0 writes) gathers every rank's rows and stashes the ``[E, ...]`` tensors of each expert's
owner (``placement.checkpoint.logical_from_gathered``), which rank 0's ``state_dict`` then writes; with one
expert-parallel rank ``state_dict`` does the same on the local rows (spare slots dropped). Loading gives every slot
its expert's row under the loader's current placement, zeros for a free slot (``local_from_logical``; a fresh
process has the initial placement). A checkpoint trained on 2 ranks, experts moved or not, therefore loads into
``fairseq-generate`` / ``fairseq-eval-lm`` on one process, and back.
"""
from __future__ import annotations

import inspect
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..config import ConfigError, MoEConfig
from ..layer import MoELayer
from ..parallel import ExpertParallel
from ..placement.checkpoint import local_from_logical, logical_from_gathered
from . import distributed as moe_dist


def _identity(x):
    return x


class FairseqMoEFFN(nn.Module):
    """The FFN of one fairseq transformer layer as an MoE layer. Input and output [T, B, C] (or [N, C])."""

    def __init__(self, cfg: MoEConfig, embed_dim: int, ffn_dim: int, ep_group, layer_id: int, label: str,
                 edp_group=None):
        super().__init__()
        self.label = label
        # edp_group: the placement policies sum the routing counts over it, so every EP group plans the same
        # placement and the expert-data-parallel gradient sum keeps pairing equal slots
        self.moe = MoELayer(cfg, embed_dim, ffn_dim, ep_group=ep_group, layer_id=layer_id, edp_group=edp_group,
                            sequence_layout="sb")
        self.padding_mask: Optional[torch.Tensor] = None
        self._full: Optional[Dict[str, torch.Tensor]] = None     # gathered experts, set only while saving
        if self.moe.ep.size > 1:
            for p in self.moe.experts.parameters():
                p.expert = True          # fairseq: no DP all-reduce; plugin: EDP sum (distributed.py)
                moe_dist.register_expert_placement(p, self.placement)     # clipping counts replicas once
        self._register_state_dict_hook(_write_full_experts)
        self._register_load_state_dict_pre_hook(_read_local_experts, with_module=True)

    # --- forward --------------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask, self.padding_mask = self.padding_mask, None
        if mask is None or x.dim() != 3 or tuple(mask.shape) != (x.shape[1], x.shape[0]):
            return self.moe(x)
        flat = x.reshape(-1, x.shape[-1])
        keep = (~mask).transpose(0, 1).reshape(-1).nonzero().squeeze(1)     # real tokens, [T, B] order
        y = self.moe(flat.index_select(0, keep), keys_shape=tuple(x.shape[:-1]), select=keep)
        return torch.zeros_like(flat).index_copy(0, keep, y).view_as(x)

    @property
    def routing(self):
        return self.moe.last_routing

    @property
    def aux_loss(self) -> torch.Tensor:
        return self.moe.aux_loss

    # --- checkpoint format: all experts by logical id ---------------------------------------------------------------
    @property
    def ep(self) -> ExpertParallel:
        return self.moe.ep

    @property
    def placement(self):
        """The layer's PlacementRuntime: which logical expert each slot of each rank's bank holds."""
        return self.moe.plan.placement

    def logical_layout(self) -> bool:
        """True when this rank's bank rows already are the [E, ...] checkpoint rows (one rank, no spare slot,
        nothing moved): no conversion needed."""
        rt = self.placement
        return self.ep.size == 1 and rt.trivial

    def to_logical(self, local: torch.Tensor) -> torch.Tensor:
        """One rank (EP=1): this rank's [slots, ...] rows -> [E, ...] by logical id (the owners' rows)."""
        return local if self.logical_layout() else logical_from_gathered(local, self.placement)

    def to_local(self, full: torch.Tensor) -> torch.Tensor:
        """[E, ...] by logical id -> this rank's [slots, ...] under its current placement (free slots zero)."""
        return full if self.logical_layout() else local_from_logical(full, self.placement)

    @torch.no_grad()
    def gather_experts(self, dst_global_rank: int = 0) -> None:
        """Collective over the EP group holding `dst_global_rank`: stash the [E, ...] expert tensors by logical id
        there. Ranks of other EP groups (holding the same slots) have nothing to do."""
        self._full = None
        members = self.ep.global_ranks
        if self.ep.size == 1 or dst_global_rank not in members:
            return
        dst, me = dst_global_rank, dist.get_rank()
        full = {}
        for name, p in self.moe.experts.named_parameters():
            parts = [torch.empty_like(p) for _ in members] if me == dst else None
            dist.gather(p.detach().contiguous(), parts, dst=dst, group=self.ep.group)
            if me == dst:
                full[name] = logical_from_gathered(torch.cat(parts, 0), self.placement)
        self._full = full if me == dst else None

    def release_gathered(self) -> None:
        self._full = None


def _write_full_experts(module: FairseqMoEFFN, state_dict, prefix, local_metadata):
    if module.ep.size == 1:
        if not module.logical_layout():      # spare slots / a placement: keep only each expert's owner row
            for name, _ in module.moe.experts.named_parameters():
                key = prefix + "moe.experts." + name
                if key in state_dict:
                    state_dict[key] = module.to_logical(state_dict[key].detach())
        return state_dict
    if module._full is None:
        raise RuntimeError("megamoe-plugin: state_dict() of an expert-parallel MoE layer holds only this rank's "
                           "experts; call megamoe_plugin.fairseq_adapter.layers.gather_experts(model) on every rank first "
                           "(the plugin's checkpoint hook does this for fairseq-train)")
    for name, full in module._full.items():
        state_dict[prefix + "moe.experts." + name] = full
    return state_dict


def _read_local_experts(module: FairseqMoEFFN, state_dict, prefix, *args):
    E = module.moe.cfg.num_experts
    for name, p in module.moe.experts.named_parameters():
        key = prefix + "moe.experts." + name
        if key not in state_dict:
            continue
        t = state_dict[key]
        if t.shape[0] != E:
            raise RuntimeError(f"megamoe-plugin: checkpoint tensor {key} has {t.shape[0]} experts, the model "
                               f"{E}: checkpoints hold all experts (--moe-expert-count must match)")
        state_dict[key] = module.to_local(t)      # torch copied the caller's dict: its tensor stays [E, ...]


def moe_ffns(model) -> List[FairseqMoEFFN]:
    return [m for m in model.modules() if isinstance(m, FairseqMoEFFN)]


def gather_experts(model, dst_global_rank: int = 0) -> None:
    """Collective: every rank calls it before rank `dst_global_rank` writes ``model.state_dict()``."""
    for m in moe_ffns(model):
        m.gather_experts(dst_global_rank)


def release_gathered(model) -> None:
    for m in moe_ffns(model):
        m.release_gathered()


# --- installing MoE FFNs into fairseq layers ---------------------------------------------------------------------
def _mask_argument(layer) -> str:
    from fairseq.modules.transformer_layer import TransformerEncoderLayerBase
    return "encoder_padding_mask" if isinstance(layer, TransformerEncoderLayerBase) else "self_attn_padding_mask"


def _padding_hook(name: str, signature: inspect.Signature):
    def hook(layer, args, kwargs):
        try:
            mask = signature.bind_partial(*args, **kwargs).arguments.get(name)
        except TypeError:
            mask = None
        layer.fc1.padding_mask = mask if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool else None
    return hook


def install_moe(layers, cfg: MoEConfig, freq: int, ep_group, first_layer_id: int, prefix: str,
                edp_group=None) -> int:
    """Make every `freq`-th layer of `layers` an MoE layer. Returns the next free layer id."""
    layer_id = first_layer_id
    if freq <= 0:
        return layer_id
    for i, layer in enumerate(layers):
        if (i + 1) % freq:
            continue
        if not isinstance(getattr(layer, "fc1", None), nn.Linear) or not isinstance(layer.fc2, nn.Linear):
            raise ConfigError("megamoe-plugin: MoE layers need plain fc1/fc2 Linear FFNs "
                              "(--quant-noise-pq and pruned FFNs are not supported)")
        if getattr(layer, "ffn_layernorm", None) is not None:
            raise ConfigError("megamoe-plugin: --scale-fc is not supported in MoE layers")
        embed, ffn = layer.fc1.in_features, layer.fc1.out_features
        dtype, device = layer.fc1.weight.dtype, layer.fc1.weight.device
        layer.fc1 = FairseqMoEFFN(cfg, embed, ffn, ep_group, layer_id, f"{prefix}{i + 1}",
                                  edp_group=edp_group).to(dtype=dtype, device=device)
        layer.fc2 = nn.Identity()
        layer.activation_fn = _identity
        layer.activation_dropout_module = nn.Identity()
        layer.register_forward_pre_hook(_padding_hook(_mask_argument(layer), inspect.signature(layer.forward)),
                                        with_kwargs=True)
        layer_id += 1
    return layer_id
