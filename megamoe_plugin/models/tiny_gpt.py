"""TinyMoEGPT: a small decoder-only GPT whose FFN is the core MoELayer every ``moe_every`` layers.

The core's own language model (``megamoe train``, see ``megamoe_plugin.train``): token + learned position
embeddings, pre-LN blocks (LN -> causal self-attention -> residual, LN -> FFN -> residual) with attention through
``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``, a final LayerNorm and an output head tied to
the token embedding. Block ``i`` uses an MoELayer (layer_id ``i``) when ``moe_every > 0`` and
``(i + 1) % moe_every == 0`` (GShard's "every other layer" for ``moe_every=2``: blocks 1, 3, ...), a dense
GELU MLP otherwise; ``moe_every=0`` gives the dense baseline. All MoE layers share one StatsSink.

Init follows GPT-2: normal(0, 0.02), the residual output projections of attention and of the dense MLP scaled by
1/sqrt(2 * layers); gates and experts normal(0, 0.02). It draws from generators seeded by one
draw of the global RNG at construction, and each MoE layer's experts from a generator of its own over the whole
bank of ``num_experts`` experts, of which EP rank r keeps its slice: after ``torch.manual_seed(s)`` the model is the
same whatever the expert-parallel size (EP rank r holds experts [r*E_local, (r+1)*E_local) of the EP=1 model).
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import INIT_STD, MoEConfig
from ..layer import MoELayer, moe_layers
from ..stats import StatsSink

__all__ = ["CausalSelfAttention", "DenseMLP", "Block", "TinyMoEGPT", "is_moe_block"]


def is_moe_block(index: int, moe_every: int) -> bool:
    """Whether block ``index`` (0-based) of the model carries an MoE FFN."""
    return moe_every > 0 and (index + 1) % moe_every == 0


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float = 0.0):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden size {hidden} is not divisible by the number of heads {heads}")
        self.heads, self.head_dim, self.dropout = heads, hidden // heads, dropout
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, H))


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn_hidden)
        self.fc2 = nn.Linear(ffn_hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: nn.Module, dropout: float = 0.0):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads, dropout)
        self.ln2 = nn.LayerNorm(hidden)
        self.ffn = ffn
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.ffn(self.ln2(x)))


class TinyMoEGPT(nn.Module):
    """Decoder-only GPT; ``forward(tokens [B, T] long) -> logits [B, T, vocab_size]``."""

    def __init__(self, moe_cfg: MoEConfig, vocab_size: int, hidden: int = 128, heads: int = 4, layers: int = 4,
                 ffn_hidden: int = 256, seq_len: int = 128, moe_every: int = 2, ep_group=None,
                 stats: Optional[StatsSink] = None, topology=None, dropout: float = 0.0, edp_group=None):
        super().__init__()
        for name, v in (("vocab_size", vocab_size), ("hidden", hidden), ("heads", heads), ("layers", layers),
                        ("ffn_hidden", ffn_hidden), ("seq_len", seq_len)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if moe_every < 0:
            raise ValueError(f"moe_every must be >= 0 (0 = no MoE layer), got {moe_every}")
        self.moe_cfg, self.vocab_size, self.hidden, self.seq_len = moe_cfg, vocab_size, hidden, seq_len
        self.num_layers, self.moe_every = layers, moe_every
        init_seed = int(torch.randint(0, 2 ** 62, ()).item())     # the only draw from the global RNG
        self.stats = stats if stats is not None else StatsSink()
        self.wte = nn.Embedding(vocab_size, hidden)
        self.wpe = nn.Embedding(seq_len, hidden)
        self.drop = nn.Dropout(dropout)
        blocks = []
        for i in range(layers):
            if is_moe_block(i, moe_every):
                ffn = MoELayer(moe_cfg, hidden, ffn_hidden, ep_group=ep_group, topology=topology, layer_id=i,
                               stats=self.stats, edp_group=edp_group)
            else:
                ffn = DenseMLP(hidden, ffn_hidden)
            blocks.append(Block(hidden, heads, ffn, dropout))
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(hidden)
        self._init_weights(init_seed)

    @torch.no_grad()
    def _init_weights(self, seed: int):
        gen = torch.Generator().manual_seed(seed)
        resid_std = 0.02 / math.sqrt(2 * self.num_layers)
        moe = [m for m in self.modules() if isinstance(m, MoELayer)]
        inside_moe = {id(sub) for m in moe for sub in m.modules()}
        for name, m in self.named_modules():
            if id(m) in inside_moe:
                continue
            if isinstance(m, nn.Linear):
                std = resid_std if name.endswith((".proj", ".fc2")) else 0.02
                nn.init.normal_(m.weight, std=std, generator=gen)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=0.02, generator=gen)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        for layer in moe:
            std = INIT_STD
            lgen = torch.Generator().manual_seed((seed + 7919 * (layer.layer_id + 1)) % (2 ** 63))
            nn.init.normal_(layer.gate.weight, std=std, generator=lgen)
            bank = layer.experts
            El = self.moe_cfg.num_local_experts
            lo = layer.ep.rank * El
            for p in (bank.w1, bank.w2):
                full = torch.empty((self.moe_cfg.num_experts,) + tuple(p.shape[1:]), dtype=p.dtype)
                nn.init.normal_(full, std=std, generator=lgen)
                p.zero_()                                   # spare vExpert slots (placement) start free
                p[:El].copy_(full[lo:lo + El])
            for p in (bank.b1, bank.b2):
                if p is not None:
                    nn.init.zeros_(p)

    # ------------------------------------------------------------------------------------------------------------
    @property
    def moe_layers(self) -> List[MoELayer]:
        return moe_layers(self)

    def num_parameters(self, active: bool = False) -> int:
        """Parameters on this rank; ``active=True`` counts what one token goes through: every non-expert
        parameter plus ``top_k`` experts' worth of each expert bank."""
        total = 0
        for p in self.parameters():
            n = p.numel()
            if active and getattr(p, "expert", False):
                n = n // p.shape[0] * min(self.moe_cfg.top_k, p.shape[0])
            total += n
        return total

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        T = tokens.shape[1]
        if T > self.seq_len:
            raise ValueError(f"sequence length {T} exceeds the model's seq_len {self.seq_len}")
        pos = torch.arange(T, device=tokens.device)
        x = self.drop(self.wte(tokens) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)          # tied output head
