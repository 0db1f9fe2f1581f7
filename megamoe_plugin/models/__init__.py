"""Models of the core's own trainer (``megamoe_plugin.train``): a small MoE GPT on the core MoELayer."""
from .tiny_gpt import Block, CausalSelfAttention, DenseMLP, TinyMoEGPT, is_moe_block

__all__ = ["Block", "CausalSelfAttention", "DenseMLP", "TinyMoEGPT", "is_moe_block"]
