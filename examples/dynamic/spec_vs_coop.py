#!/usr/bin/env python
"""Specification vs cooperation loss (DynaMoE paper 000, §2.1 Eq. 1-2, §5.1 Figure 7) at small scale, on CPU.

Next-byte prediction on the project's embedded corpus (Python standard-library sources and docs read at run time,
``megamoe_plugin.data.corpus``): a context encoder (embeddings of the previous ``--context`` bytes, concatenated,
-> MLP) feeds a ``PredictorMoE`` head whose experts each predict the next byte.  Runs, all from the same seed:

- learned gate + specification loss, learned gate + cooperation loss;
- fixed assignment + each loss: the gate is zeroed and frozen (uniform weights 1/k) and a context goes to the k
  experts picked by a fixed random hash of its bytes (the paper's "uniformly fixed" assignment);
- hierarchical: 2 outer experts, each an MoE of experts/2 inner experts (outer top-2 of 2, inner top-k), with the
  specification loss over all leaves, and with inner cooperation / outer specification (Figure 11's mixed losses).

Every run is scored the same way on the validation split: the NLL of the aggregate (the mixture sum_i g_i O_i) and
its accuracy.  Run: ``python examples/dynamic/spec_vs_coop.py`` (the defaults take about 2 minutes on 2 cores, under
3 on a busy one).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megamoe_plugin.data.corpus import VOCAB_SIZE, build_corpus  # noqa: E402
from megamoe_plugin.dynamic.predictors import (PredictorMoE, aggregate, cooperation_loss, hierarchical,  # noqa: E402
                                               moe_predictor_loss, specification_loss)

AUX_COEFF = 0.01


class ByteModel(nn.Module):
    """Previous ``context`` bytes -> embeddings, concatenated -> Linear -> GELU -> hidden -> PredictorMoE head."""

    def __init__(self, context: int, embed: int, hidden: int, head: PredictorMoE):
        super().__init__()
        self.embed = nn.Embedding(VOCAB_SIZE, embed)
        self.proj = nn.Linear(context * embed, hidden)
        self.head = head

    def forward(self, ctx: torch.Tensor, assigned: Optional[torch.Tensor] = None):
        h = F.gelu(self.proj(self.embed(ctx).flatten(1)))
        return self.head(h, assigned=assigned)


def windows(tokens: torch.Tensor, positions: torch.Tensor, context: int):
    """(contexts [N, context], targets [N]) of the bytes at ``positions`` (>= context)."""
    ctx = tokens[positions.unsqueeze(1) - context + torch.arange(context)]
    return ctx, tokens[positions]


def fixed_assignment(ctx: torch.Tensor, num_experts: int, top_k: int, table: torch.Tensor) -> torch.Tensor:
    """k distinct experts per context from a fixed random hash of its bytes: h = sum_i table[i, byte_i] mod E, then
    experts h, h+1, ..., h+k-1 (mod E).  The same context always goes to the same experts."""
    h = table.gather(1, ctx.t()).sum(0) % num_experts
    return (h.unsqueeze(1) + torch.arange(top_k)) % num_experts


def make_runs(experts: int, top_k: int) -> List[Dict]:
    inner = experts // 2
    flat = f"flat E={experts} k={top_k}"
    hier = f"hier 2x{inner} k=2x{top_k}"
    return [
        dict(name=f"{flat}", gate="learned", loss="specification", hier=None),
        dict(name=f"{flat}", gate="learned", loss="cooperation", hier=None),
        dict(name=f"{flat}", gate="fixed", loss="specification", hier=None),
        dict(name=f"{flat}", gate="fixed", loss="cooperation", hier=None),
        dict(name=hier, gate="learned", loss="specification", hier=("specification", inner)),
        dict(name=hier, gate="learned", loss="specification", hier=("cooperation", inner),
             label="inner coop + outer spec"),
    ]


def build_model(run: Dict, args) -> ByteModel:
    torch.manual_seed(args.seed)
    kw = dict(expert_hidden=args.expert_hidden, aux_loss_coeff=AUX_COEFF)
    if run["hier"] is None:
        head = PredictorMoE(args.hidden, VOCAB_SIZE, args.experts, args.top_k, **kw)
    else:
        inner_loss, inner = run["hier"]
        head = hierarchical(args.hidden, VOCAB_SIZE, 2, inner, 2, args.top_k, inner_loss=inner_loss, **kw)
    model = ByteModel(args.context, args.embed, args.hidden, head)
    if run["gate"] == "fixed":
        with torch.no_grad():
            head.gate.weight.zero_()        # uniform probabilities -> weights exactly 1/k over the assigned experts
        head.gate.weight.requires_grad_(False)
    return model


def train_and_eval(run: Dict, args, train: torch.Tensor, valid_ctx: torch.Tensor, valid_y: torch.Tensor,
                   table: torch.Tensor) -> Dict:
    model = build_model(run, args)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed + 1)      # the same batches for every run
    fixed = run["gate"] == "fixed"
    t0 = time.perf_counter()
    model.train()
    for _ in range(args.steps):
        pos = torch.randint(args.context, train.numel(), (args.batch,), generator=gen)
        ctx, y = windows(train, pos, args.context)
        assigned = fixed_assignment(ctx, args.experts, args.top_k, table) if fixed else None
        p = model(ctx, assigned)
        loss = moe_predictor_loss(p, y, run["loss"]) + p.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    train_s = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        assigned = fixed_assignment(valid_ctx, args.experts, args.top_k, table) if fixed else None
        p = model(valid_ctx, assigned)
        nll = float(cooperation_loss(p, valid_y))
        spec = float(specification_loss(p, valid_y))
        acc = float((aggregate(p).argmax(-1) == valid_y).float().mean())
        load = torch.bincount(p.expert_ids.flatten(), minlength=int(p.expert_ids.max()) + 1).float()
    return dict(run=run["name"], gate=run["gate"], loss=run.get("label", run["loss"]), preds=p.top_k,
                nll=nll, bits=nll / math.log(2), spec=spec, acc=acc,
                load=float(load.max() / load[load > 0].mean()), seconds=train_s)


COLUMNS = [("run", "{}"), ("gate", "{}"), ("loss", "{}"), ("preds", "{}"), ("nll", "{:.4f}"), ("bits", "{:.3f}"),
           ("spec", "{:.4f}"), ("acc", "{:.4f}"), ("load", "{:.2f}"), ("seconds", "{:.1f}")]
HEADERS = {"run": "run", "gate": "gate", "loss": "loss", "preds": "preds/tok", "nll": "val NLL (mixture)",
           "bits": "bits/byte", "spec": "val spec loss", "acc": "val acc", "load": "max/mean load",
           "seconds": "train s"}


def format_table(rows: Sequence[Dict], args) -> str:
    cells = [[HEADERS[c] for c, _ in COLUMNS]] + [[f.format(r[c]) for c, f in COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    threads = f"{args.threads} thread{'s' if args.threads > 1 else ''}"
    lines = [f"Specification vs cooperation loss (DynaMoE Fig. 7 at small scale), measured here on CPU "
             f"({threads}): next-byte prediction, steps={args.steps} batch={args.batch} "
             f"context={args.context} seed={args.seed}, validation on {args.eval_tokens} bytes"]
    for i, row in enumerate(cells):
        lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1500, help="optimizer steps per run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--experts", type=int, default=8, help="experts of the flat runs (hierarchical: 2 x experts/2)")
    ap.add_argument("--top-k", type=int, default=2, help="experts per token (flat) / per inner MoE (hierarchical)")
    ap.add_argument("--batch", type=int, default=256, help="bytes per step")
    ap.add_argument("--context", type=int, default=8, help="previous bytes the model sees")
    ap.add_argument("--embed", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--expert-hidden", type=int, default=128, help="experts' MLP width (0: one Linear)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--max-bytes", type=int, default=2_000_000, help="corpus size cap (all splits)")
    ap.add_argument("--eval-tokens", type=int, default=20_000)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: these small matmuls gain nothing from more, and 2 threads on a "
                         "busy 2-core machine ran 5-40x slower here)")
    args = ap.parse_args(argv)
    for name in ("steps", "experts", "top_k", "batch", "context", "eval_tokens", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if args.top_k > args.experts // 2:
        ap.error(f"--top-k={args.top_k}: must be <= experts/2 = {args.experts // 2} (the hierarchical runs' inner "
                 f"MoEs have experts/2 experts)")
    return args


def main(argv=None) -> List[Dict]:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args) -> List[Dict]:
    corpus = build_corpus(max_bytes=args.max_bytes, seed=args.seed)
    train, valid = corpus.train, corpus.valid
    n_eval = min(args.eval_tokens, valid.numel() - args.context)
    args.eval_tokens = n_eval
    valid_ctx, valid_y = windows(valid, torch.arange(args.context, args.context + n_eval), args.context)
    table = torch.randint(0, 1 << 20, (args.context, VOCAB_SIZE), generator=torch.Generator().manual_seed(12345))
    rows = [train_and_eval(run, args, train, valid_ctx, valid_y, table) for run in make_runs(args.experts,
                                                                                            args.top_k)]
    print(format_table(rows, args), flush=True)
    return rows


if __name__ == "__main__":
    main()
