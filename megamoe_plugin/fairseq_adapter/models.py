"""fairseq models with MoE FFNs: ``moe_transformer_lm`` (decoder-only LM) and ``moe_transformer`` (translation).

Both are fairseq's own models (``transformer_lm``, ``transformer``) built as usual, then ``install_moe`` turns every
``--moe-freq``-th encoder/decoder layer's FFN into a plugin MoE layer (paper 004's two workloads: language
modelling and machine translation). Their flags are fairseq's plus the MoE flags of ``args.py``. Architectures:

    moe_transformer_lm        fairseq transformer_lm sizes (512/2048, 6 layers), 8 experts on every 2nd layer
    moe_transformer_lm_tiny   64/128, 2 layers, 2 heads, 4 experts: for tests and laptops
    moe_transformer_lm_gpt    GPT-like: fairseq's transformer_lm_gpt sizes (768/3072, 12 layers, gelu)
    moe_transformer           fairseq transformer (base) sizes, MoE in encoder and decoder
    moe_transformer_base      the same
    moe_transformer_tiny      64/128, 2+2 layers, 4 experts
"""
from __future__ import annotations

import logging

from fairseq.distributed import utils as dist_utils
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerModel
from fairseq.models.transformer.transformer_legacy import base_architecture, tiny_architecture
from fairseq.models.transformer_lm import (TransformerLanguageModel, TransformerLanguageModelConfig,
                                           base_lm_architecture, transformer_lm_gpt)
from fairseq.utils import safe_getattr

import torch
import torch.distributed as dist

from ..config import ConfigError, MoEConfig
from ..cpu_alloc import retain_freed_memory
from ..gate_sync import gate_params
from . import distributed as moe_dist
from .args import add_moe_args, config_from_fairseq, fill_moe_defaults, moe_dataclass, moe_freq
from .layers import install_moe

logger = logging.getLogger(__name__)


def build_moe_config(args) -> MoEConfig:
    """The MoEConfig of a model being built in this process: EP size resolved against fairseq's DP group."""
    distributed = dist.is_available() and dist.is_initialized()
    world = dist_utils.get_data_parallel_world_size() if distributed else 1
    requested = int(safe_getattr(args, "moe_expert_parallel_size", 0) or 0)
    if not distributed and requested > 1:
        logger.info("megamoe-plugin: single process: --moe-expert-parallel-size %d -> 1 (checkpoints hold every "
                    "expert, so they load at any expert-parallel size)", requested)
        args.moe_expert_parallel_size = 1
    return config_from_fairseq(args, world_size=world)


def moe_ify(model, args, encoder_layers, decoder_layers):
    if not torch.cuda.is_available() or safe_getattr(args, "cpu", False):
        retain_freed_memory()     # CPU: reuse large activation/gradient blocks instead of page-faulting them each step
    cfg = build_moe_config(args)
    freq = moe_freq(args)
    ep_group, edp_group = moe_dist.expert_groups(cfg.expert_parallel_size)
    moe_dist.activate(ep_group, edp_group, cfg.resolved_world_size())
    next_id = install_moe(encoder_layers, cfg, freq, ep_group, 0, "enc", edp_group=edp_group)
    if install_moe(decoder_layers, cfg, freq, ep_group, next_id, "dec", edp_group=edp_group) == 0:
        raise ConfigError(f"megamoe-plugin: --moe-freq={freq} with {len(encoder_layers)} encoder / "
                          f"{len(decoder_layers)} decoder layers: no layer gets an MoE FFN; use a smaller "
                          "--moe-freq")
    model.moe_config = cfg
    if cfg.local_gates:       # --moe-gate-sync local / average:K: fairseq's DDP leaves gates alone
        for p in gate_params(model):
            p.expert = True
    # c10d DDP: expert parameters are synchronised by the plugin, never by DDP
    model._ddp_params_and_buffers_to_ignore = [n for n, p in model.named_parameters() if getattr(p, "expert", False)]
    return model


MoETransformerLanguageModelConfig = moe_dataclass(TransformerLanguageModelConfig, "MoETransformerLanguageModelConfig")


class _InferenceMixin:
    """fairseq-generate / fairseq-eval-lm / fairseq-interactive call ``prepare_for_inference_`` after loading the
    checkpoint (and after ``.half()`` / ``.cuda()``): there the paper 004 options apply (``inference.deploy``),
    given as ``--model-overrides "{'moe_placement_file': 'p.json', 'moe_expert_cache_size': 2}"``."""

    def prepare_for_inference_(self, cfg):
        super().prepare_for_inference_(cfg)
        moe = getattr(self, "moe_config", None)
        if moe is not None:
            from ..inference.deploy import prepare_for_inference
            prepare_for_inference(self, moe, log=logger.info)


@register_model("moe_transformer_lm", dataclass=MoETransformerLanguageModelConfig)
class MoETransformerLanguageModel(_InferenceMixin, TransformerLanguageModel):
    """fairseq's transformer_lm with MoE FFNs on every --moe-freq-th decoder layer."""

    @classmethod
    def build_model(cls, args, task):
        moe_freq(args)                                    # a bad --moe-freq fails before fairseq builds anything
        model = super().build_model(args, task)
        return moe_ify(model, args, [], model.decoder.layers)


@register_model("moe_transformer")
class MoETransformerModel(_InferenceMixin, TransformerModel):
    """fairseq's transformer (encoder-decoder) with MoE FFNs on every --moe-freq-th encoder and decoder layer."""

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        add_moe_args(parser)

    @classmethod
    def build_model(cls, args, task):
        fill_moe_defaults(args)
        moe_freq(args)
        model = super().build_model(args, task)
        return moe_ify(model, args, model.encoder.layers, model.decoder.layers)


# --- architectures -------------------------------------------------------------------------------------------------
def _set(args, **defaults):
    for k, v in defaults.items():
        if safe_getattr(args, k, None) is None:
            setattr(args, k, v)


@register_model_architecture("moe_transformer_lm", "moe_transformer_lm_tiny")
def moe_transformer_lm_tiny(args):
    _set(args, decoder_embed_dim=64, decoder_input_dim=64, decoder_output_dim=64, decoder_ffn_embed_dim=128,
         decoder_layers=2, decoder_attention_heads=2, moe_expert_count=4, dropout=0.0)
    base_lm_architecture(args)
    fill_moe_defaults(args)


@register_model_architecture("moe_transformer_lm", "moe_transformer_lm_gpt")
def moe_transformer_lm_gpt(args):
    transformer_lm_gpt(args)
    _set(args, decoder_input_dim=args.decoder_embed_dim, decoder_output_dim=args.decoder_embed_dim)
    fill_moe_defaults(args)


@register_model_architecture("moe_transformer", "moe_transformer")
def moe_transformer(args):
    base_architecture(args)
    fill_moe_defaults(args)


@register_model_architecture("moe_transformer", "moe_transformer_base")
def moe_transformer_base(args):
    moe_transformer(args)


@register_model_architecture("moe_transformer", "moe_transformer_tiny")
def moe_transformer_tiny(args):
    _set(args, encoder_embed_dim=64, encoder_ffn_embed_dim=128, decoder_ffn_embed_dim=128, moe_expert_count=4,
         dropout=0.0)
    tiny_architecture(args)
    fill_moe_defaults(args)
