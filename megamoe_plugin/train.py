"""`megamoe train`, the plain-PyTorch trainer (no Megatron, no fairseq): a small MoE GPT language model on the embedded corpus.

    megamoe train --steps 200                          # or: python -m megamoe_plugin.train --steps 200
    torchrun --nproc-per-node 2 -m megamoe_plugin.train --moe-expert-parallel-size 2

Model: ``megamoe_plugin.models.TinyMoEGPT`` (MoELayer every ``--moe-every`` blocks). Data: the embedded default
corpus (``megamoe_plugin.data.build_corpus``), byte-level tokens. Loss: cross-entropy + ``collect_aux_loss``.
AdamW, linear warmup then cosine decay to ``--min-lr-ratio * --lr``, gradient clipping (global norm).

Flags: the model/training flags below plus every MoE option of ``MoEConfig`` rendered from
``config.iter_options()`` (``--moe-<name>``; bools as ``--moe-x/--no-moe-x``). The MoEConfig is built right after
parsing; an invalid combination is an argparse error (exit status 2) before anything runs.

Every ``--log-interval`` steps one line: step, loss, lm loss, aux loss, lr, grad norm, tokens/s, and per MoE layer
``L<id> load=[...] bal=<max/mean expert load> drop=<dropped fraction>`` (from ``StatsSink.summary``; the load is
each expert's fraction of the routed assignments since the last line; ``drop`` counts every assignment not
computed; `megamoe train` keeps every gshard second choice (``--moe-second-expert-policy all``), so a dropless run
shows 0; with ``random`` (GShard's random routing) about a third of the second choices are skipped and counted). Eval on the valid split every
``--eval-interval`` steps and at the end: loss, perplexity and bits per byte (total bits / bytes predicted; the
``<eod>`` targets' bits are counted, they are not counted as bytes).

Multi-process (torchrun, ``WORLD_SIZE > 1``): gloo; the world is the data-parallel group; experts are sharded
over expert-parallel groups of ``--moe-expert-parallel-size`` consecutive ranks (default 1 = every rank holds all
experts). Each rank reads a different shard of every step's batches (``--batch-size`` is per rank). Gradients of
replicated parameters are averaged over the world; expert parameters (``p.expert``) are all-reduced only over the
ranks holding the same experts (none when EP = world), since the all-to-all already brings every EP rank's tokens'
gradient to them, and scaled by 1/world (the gradient of the mean loss over all ranks).

Checkpoints (``--save PATH``): ``{"format", "step", "model", "optimizer", "moe_config", "model_args", "args",
"rng_states", "world_size", "expert_parallel_size", "ep_rank"}`` via ``torch.save``; one file (rank 0's) when
experts are not sharded, else one per rank (``PATH.rank<r>``). ``--resume PATH`` restores model, optimizer, RNG
and step and continues to ``--steps`` (the total): the data order and LR schedule are functions of the step, so a
resumed run reproduces an uninterrupted one (``--exit-interval N`` stops a run early at a multiple of N, e.g. for
preemptible jobs). ``--trace PATH`` (or ``--moe-trace-path``) records routing traces.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .cpu_alloc import retain_freed_memory
from .config import ConfigError, MoEConfig, iter_options, upgrade_options
from .data import build_corpus
from .dynamic import DynamicRuntime, dynamic_enabled
from .dynamic.assignment_cache import AssignmentCache
from .dynamic.runtime import format_metrics as format_dynamic_metrics
from .gates import gate_warnings
from .gate_sync import GateSync, gather_rank_states, load_rank_state, local_grad_sq_norm, rank_state_for
from .inference.deploy import refuse_in_training
from .notices import warn_once
from .layer import collect_aux_loss, finish_global_batch, moe_layers
from .placement import AfterStepHook, apply_placement
from .models import TinyMoEGPT
from .stats import NonFiniteRoutingError, StatsSink, TraceRecorder, check_nonfinite
from . import train_checkpoint as checkpoints

__all__ = ["MAIN_JOB_MOE_DEFAULTS", "CHECKPOINT_FORMAT", "ParallelState", "TrainResult", "TrainBatches",
           "add_moe_arguments", "build_parser", "moe_config_from_args", "init_parallel", "make_parallel_state",
           "build_model", "sync_gradients", "clip_grad_norm", "lr_at", "evaluate", "format_load",
           "save_checkpoint", "load_checkpoint", "checkpoint_path", "main"]

# MoE options of `megamoe train` where they differ from (or restate) MoEConfig's defaults.
MAIN_JOB_MOE_DEFAULTS: Dict[str, object] = {"num_experts": 8, "gate": "gshard", "top_k": 2, "dispatch": "dropless",
                                            "aux_loss_coeff": 0.01, "second_expert_policy": "all"}
CHECKPOINT_FORMAT = checkpoints.FORMAT
MODEL_ARG_NAMES = ("hidden", "layers", "heads", "ffn_hidden", "seq_len", "moe_every", "dropout")
# MoE options that change the parameters' shapes: a checkpoint only resumes with equal values (the expert-parallel
# size may differ: the experts are resharded)
MOE_SHAPE_OPTIONS = ("num_experts", "expert_ffn_hidden_size", "activation", "linear_bias")


# --------------------------------------------------------------------------------------------------- arguments
def moe_dest(name: str) -> str:
    """The argparse dest of MoE option ``name`` (``--moe-top-k`` -> ``moe_top_k``)."""
    return "moe_" + name


def add_moe_arguments(parser: argparse._ActionsContainer, defaults: Optional[Dict[str, object]] = None) -> None:
    """Render every MoEConfig option (``iter_options()``) as a flag: ``--moe-<name>`` with its type, default, help
    and choices; bools as ``--moe-x / --no-moe-x``. ``defaults`` overrides MoEConfig's defaults by option name."""
    defaults = defaults or {}
    for opt in iter_options():
        default = defaults.get(opt["name"], opt["default"])
        help_text = opt["help"].replace("%", "%%")
        kw = {"dest": moe_dest(opt["name"]), "default": default, "help": help_text}
        if opt["type"] is bool:
            parser.add_argument(opt["flag"], action=argparse.BooleanOptionalAction, **kw)
        else:
            parser.add_argument(opt["flag"], type=opt["type"], choices=opt["choices"],
                                metavar=opt["type"].__name__.upper() if not opt["choices"] else None, **kw)


def moe_config_from_args(args: argparse.Namespace) -> MoEConfig:
    """MoEConfig from parsed flags (raises ConfigError on an invalid combination)."""
    return MoEConfig(**{opt["name"]: getattr(args, moe_dest(opt["name"])) for opt in iter_options()})


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog or "megamoe train", allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Train a small MoE GPT language model on CPU on the embedded default corpus (plain "
                    "PyTorch, no Megatron). Launch with torchrun for data + expert parallelism over gloo.")
    m = p.add_argument_group("model")
    m.add_argument("--hidden", type=int, default=128, help="Hidden size.")
    m.add_argument("--layers", type=int, default=4, help="Transformer blocks.")
    m.add_argument("--heads", type=int, default=4, help="Attention heads.")
    m.add_argument("--ffn-hidden", type=int, default=256, help="FFN hidden size (dense MLP and, unless "
                                                               "--moe-expert-ffn-hidden-size, each expert).")
    m.add_argument("--seq-len", type=int, default=128, help="Sequence length (tokens = bytes).")
    m.add_argument("--moe-every", type=int, default=2, help="Block i has an MoE FFN when (i+1) %% N == 0; "
                                                            "1 = every block, 0 = dense model.")
    m.add_argument("--dropout", type=float, default=0.0, help="Dropout on embeddings and residual branches.")
    t = p.add_argument_group("training")
    t.add_argument("--batch-size", type=int, default=16, help="Sequences per step per rank.")
    t.add_argument("--steps", type=int, default=200, help="Total training steps (a resumed run continues to it).")
    t.add_argument("--exit-interval", type=int, default=0, help="Stop early once the step is a multiple of N "
                                                                "(the LR schedule still spans --steps); with --save "
                                                                "the checkpoint is written for --resume.")
    t.add_argument("--lr", type=float, default=3e-3, help="Peak learning rate (AdamW).")
    t.add_argument("--min-lr-ratio", type=float, default=0.1, help="Final LR of the cosine decay, relative to --lr.")
    t.add_argument("--warmup", type=int, default=None, help="Linear warmup steps (default: 10%% of --steps).")
    t.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (matrices only).")
    t.add_argument("--clip-grad", type=float, default=1.0, help="Clip the global gradient norm; 0 disables.")
    t.add_argument("--seed", type=int, default=0, help="Seed of the model init, data order and corpus selection.")
    t.add_argument("--threads", type=int, default=2, help="torch intra-op threads per process.")
    d = p.add_argument_group("data")
    d.add_argument("--corpus-bytes", type=int, default=2_000_000, help="Cap on the corpus size in bytes.")
    d.add_argument("--corpus-cache", default=None, metavar="DIR", help="Cache the selected corpus documents here.")
    d.add_argument("--max-train-samples", type=int, default=0, metavar="N",
                   help="Train on the first N samples of the training split only (0 = all of it): a small dataset "
                        "seen over many epochs, where DynaMoE's assignment cache can switch on.")
    o = p.add_argument_group("logging, eval and checkpoints")
    o.add_argument("--log-interval", type=int, default=20, help="Steps between log lines.")
    o.add_argument("--eval-interval", type=int, default=100, help="Steps between evals on the valid split "
                                                                  "(also at the end); 0 = only at the end.")
    o.add_argument("--eval-batches", type=int, default=0, help="Cap on eval batches per rank; 0 = the whole split.")
    o.add_argument("--save", default=None, metavar="PATH", help="Write a checkpoint here at the end.")
    o.add_argument("--save-interval", type=int, default=0, help="Also checkpoint every N steps (needs --save).")
    o.add_argument("--resume", default=None, metavar="PATH", help="Restore a --save checkpoint and continue.")
    o.add_argument("--metrics-json", default=None, metavar="PATH", help="Write the run's log lines and evaluations "
                   "(with the training time to each) here as JSON at the end (rank 0).")
    o.add_argument("--trace", default=None, metavar="PATH", help="Record routing traces here (overrides "
                                                                 "--moe-trace-path); one shard per rank.")
    add_moe_arguments(p.add_argument_group("MoE options (MoEConfig)"), MAIN_JOB_MOE_DEFAULTS)
    return p


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("hidden", "layers", "heads", "ffn_hidden", "seq_len", "batch_size", "threads", "log_interval"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("steps", "exit_interval", "moe_every", "eval_interval", "eval_batches", "save_interval", "corpus_bytes",
                 "max_train_samples"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.hidden % args.heads:
        parser.error(f"--hidden={args.hidden} must be divisible by --heads={args.heads}")
    if not args.lr > 0:
        parser.error(f"--lr must be > 0, got {args.lr}")
    if not 0 <= args.min_lr_ratio <= 1:
        parser.error(f"--min-lr-ratio must be in [0, 1], got {args.min_lr_ratio}")
    if args.warmup is not None and args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.weight_decay < 0 or args.clip_grad < 0:
        parser.error("--weight-decay and --clip-grad must be >= 0")
    if not 0 <= args.dropout < 1:
        parser.error(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.save_interval and not args.save:
        parser.error("--save-interval needs --save PATH")


# ---------------------------------------------------------------------------------------------------- parallel
@dataclass
class ParallelState:
    """The process layout: the world is data-parallel; experts are sharded over EP groups of consecutive ranks."""
    rank: int = 0
    world_size: int = 1
    ep_size: int = 1
    ep_group: object = None            # this rank's EP group, for MoELayer (None when ep_size == 1)
    expert_dp_group: object = None     # ranks holding the same experts (None when world_size == ep_size)
    initialized_here: bool = False     # this trainer called init_process_group (and destroys it at the end)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def make_parallel_state(ep_size: int) -> ParallelState:
    """Create the EP and expert-data-parallel groups (collective over the world when it has > 1 rank)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if ep_size != 1:
            raise ConfigError(f"--moe-expert-parallel-size={ep_size} needs {ep_size} processes (launch with torchrun)")
        return ParallelState()
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % ep_size:
        raise ConfigError(f"--moe-expert-parallel-size={ep_size}: must divide the world size {world}")
    ep_group = expert_dp_group = None
    if ep_size == world:
        ep_group = dist.group.WORLD
    elif ep_size > 1:
        for g in range(world // ep_size):                 # every rank creates every group, in the same order
            ranks = list(range(g * ep_size, (g + 1) * ep_size))
            grp = dist.new_group(ranks)
            if rank in ranks:
                ep_group = grp
    if ep_size == 1:
        expert_dp_group = dist.group.WORLD
    elif ep_size < world:
        for i in range(ep_size):
            ranks = list(range(i, world, ep_size))
            grp = dist.new_group(ranks)
            if rank in ranks:
                expert_dp_group = grp
    return ParallelState(rank, world, ep_size, ep_group, expert_dp_group)


def init_parallel(ep_size: int) -> ParallelState:
    """Single process, or (``WORLD_SIZE > 1``, e.g. torchrun) a gloo process group from the environment."""
    initialized_here = False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
        initialized_here = True
    ps = make_parallel_state(ep_size)
    ps.initialized_here = initialized_here
    return ps


def _flat_allreduce(tensors: List[torch.Tensor], group, scale: float) -> None:
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if group is not None:
        dist.all_reduce(flat, group=group)
    if scale != 1.0:
        flat.mul_(scale)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


def sync_gradients(model: torch.nn.Module, ps: ParallelState, local_gates: bool = False) -> None:
    """Make the gradients those of the mean loss over all ranks: replicated parameters are averaged over the
    world; expert parameters are summed over the ranks holding the same experts and divided by the world size
    (the all-to-all backward already summed the gradients of the EP group's tokens into them). With
    ``local_gates`` (``--moe-gate-sync local`` / ``average:K``) gate gradients stay those of this rank's loss."""
    if not ps.distributed:
        return
    dense, expert = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if local_gates and getattr(p, "megamoe_gate", False):
            continue
        (expert if getattr(p, "expert", False) else dense).append(p.grad)
    _flat_allreduce(dense, dist.group.WORLD, 1.0 / ps.world_size)
    _flat_allreduce(expert, ps.expert_dp_group, 1.0 / ps.world_size)


def clip_grad_norm(model: torch.nn.Module, max_norm: float, ps: Optional[ParallelState] = None,
                   local_gates: bool = False) -> float:
    """Global L2 norm of all gradients (expert shards of the EP group included); scales them to ``max_norm``
    when larger (``max_norm`` 0: only measure). Equals ``torch.nn.utils.clip_grad_norm_`` in one process. With
    ``local_gates`` the gates' share is the mean over ranks of each rank's own (identical on every rank)."""
    dense, expert, gates = [], [], []
    for p in model.parameters():
        if p.grad is not None:
            if local_gates and getattr(p, "megamoe_gate", False):
                gates.append(p.grad)
            else:
                (expert if getattr(p, "expert", False) else dense).append(p.grad)
    sq = torch.zeros((), dtype=torch.float64)
    if dense:
        sq = sq + torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in dense]).pow(2).sum()
    if local_gates:
        sq = sq + local_grad_sq_norm(gates, dist.group.WORLD if ps is not None and ps.distributed else None)
    esq = torch.zeros((), dtype=torch.float64)
    for layer in moe_layers(model):       # each logical expert once, however many replicas it has (placement)
        esq = esq + layer.plan.placement.expert_grad_sq_norm(layer.experts)
    if ps is not None and ps.ep_group is not None:
        dist.all_reduce(esq, group=ps.ep_group)
    total = float((sq + esq).sqrt())
    if max_norm > 0:
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for g in dense + expert + gates:
                g.mul_(coef)
    return total


# ------------------------------------------------------------------------------------------------------- model
def build_model(cfg: MoEConfig, vocab_size: int, args: argparse.Namespace, ps: ParallelState,
                stats: Optional[StatsSink] = None) -> TinyMoEGPT:
    """The model from ``--seed``: the same on every rank and for every expert-parallel size (each EP
    rank holds its slice of the EP=1 model's experts; see TinyMoEGPT). Replicated parameters are broadcast from
    rank 0 all the same, as DDP does."""
    torch.manual_seed(args.seed)
    model = TinyMoEGPT(cfg, vocab_size, hidden=args.hidden, heads=args.heads, layers=args.layers,
                       ffn_hidden=args.ffn_hidden, seq_len=args.seq_len, moe_every=args.moe_every,
                       ep_group=ps.ep_group, stats=stats, dropout=args.dropout, edp_group=ps.expert_dp_group)
    if ps.distributed:
        with torch.no_grad():
            for p in model.parameters():
                if not getattr(p, "expert", False):
                    dist.broadcast(p.data, src=0)
    return model


def _optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))


def lr_at(step: int, total_steps: int, peak: float, warmup: int, min_ratio: float = 0.1) -> float:
    """LR of (0-based) step ``step``: linear warmup over ``warmup`` steps, then cosine decay to ``min_ratio*peak``."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    span = max(total_steps - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    return peak * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


# -------------------------------------------------------------------------------------------------------- data
class TrainBatches:
    """Step-indexed training batches. Epoch ``e`` is a permutation of the split's samples (sample ``i`` =
    ``tokens[i*T : i*T + T + 1]``, the indexing of ``Corpus.sample``) drawn from a generator seeded with
    ``(seed, e)``; step ``s`` of rank ``r`` takes the ``(s mod steps_per_epoch) * world + r``-th batch of its
    epoch. ``batch(step)`` depends only on the step, so a resumed run reads what an uninterrupted one would."""

    def __init__(self, tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0, rank: int = 0,
                 world_size: int = 1):
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.num_samples = max((tokens.numel() - 1) // seq_len, 0)
        self.steps_per_epoch = self.num_samples // (batch_size * world_size)
        if self.steps_per_epoch < 1:
            raise ValueError(f"the training split has {self.num_samples} samples of {seq_len} tokens: too few for "
                             f"one step of {batch_size} x {world_size} rank(s); raise --corpus-bytes (or --max-train-samples)")
        self._offsets = torch.arange(seq_len + 1)
        self._epoch, self._order = -1, None

    def sample_ids(self, step: int) -> torch.Tensor:
        """Indices (in the split) of the samples of 0-based step ``step`` on this rank: the assignment cache's keys."""
        epoch, i = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.num_samples, generator=gen)
        g = i * self.world_size + self.rank
        return self._order[g * self.batch_size:(g + 1) * self.batch_size]

    def epoch_of(self, step: int) -> int:
        """1-based epoch of 0-based step ``step``."""
        return step // self.steps_per_epoch + 1

    def batch(self, step: int):
        """(input [B, T], target [B, T]) of 0-based step ``step`` on this rank."""
        idx = self.sample_ids(step)
        windows = self.tokens[idx[:, None] * self.seq_len + self._offsets]
        return windows[:, :-1], windows[:, 1:]


@torch.no_grad()
def evaluate(model: TinyMoEGPT, corpus, split: str, batch_size: int, seq_len: int,
             ps: Optional[ParallelState] = None, max_batches: int = 0) -> Dict[str, float]:
    """Loss (nats/token), perplexity and bits per byte of ``split``, in order, sharded over the ranks (every rank
    runs the same number of batches: the MoE layers' collectives need it). The MoE layers record into a separate
    StatsSink meanwhile (returned as ``"moe"``), so eval routing stays out of the training statistics and
    traces."""
    ps = ps or ParallelState()
    was_training = model.training
    model.eval()
    layers = moe_layers(model)
    saved = [m.stats for m in layers]
    eval_stats = StatsSink()
    for m in layers:
        m.stats = eval_stats
    eod = corpus.eod_id
    try:
        n_batches = -(-corpus.num_samples(split, seq_len) // batch_size)
        per_rank = n_batches // ps.world_size
        if max_batches:
            per_rank = min(per_rank, max_batches)
        sums = torch.zeros(3, dtype=torch.float64)                 # nats, target tokens, target bytes
        for b, (inp, tgt, _) in enumerate(corpus.batches(split, batch_size, seq_len)):
            if b >= per_rank * ps.world_size:
                break
            if b % ps.world_size != ps.rank:
                continue
            logits = model(inp)
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1), reduction="sum")
            sums += torch.tensor([float(nll), tgt.numel(), float((tgt != eod).sum())], dtype=torch.float64)
        if ps.distributed:
            dist.all_reduce(sums)
        moe = eval_stats.summary(group=dist.group.WORLD if ps.distributed else None)
    finally:
        for m, s in zip(layers, saved):
            m.stats = s
        model.train(was_training)
    nats, toks, nbytes = sums.tolist()
    loss = nats / toks if toks else float("nan")
    return {"loss": loss, "ppl": math.exp(loss) if toks and loss < 700 else float("inf"),
            "bpb": nats / math.log(2) / nbytes if nbytes else float("nan"), "tokens": int(toks), "moe": moe}


# ----------------------------------------------------------------------------------------------------- logging
def _frac(x: float) -> str:
    s = f"{x:.2f}"
    return s[1:] if s.startswith("0.") else s


def format_load(summary: Dict[int, dict], show_device_balance: bool = False) -> str:
    """``L<id> load=[.12 .13 ...] bal=1.07 drop=0.000`` per layer of a ``StatsSink.summary()``: each expert's
    fraction of the routed (kept) assignments, max/mean expert load, dropped fraction of the assignments; with
    ``show_device_balance`` also FlexMoE's device balance ratio (``dev=``)."""
    parts = []
    for layer_id, s in sorted(summary.items()):
        counts = s["tokens_per_expert"]
        total = sum(counts)
        load = " ".join(_frac(c / total if total else 0.0) for c in counts)
        text = f"L{layer_id} load=[{load}] bal={s['expert_max_over_mean']:.2f} drop={s['dropped_fraction']:.3f}"
        if show_device_balance:
            text += f" dev={s['balance_ratio']:.2f}"
        parts.append(text)
    return " | ".join(parts)


def _format_eval(step: int, ev: Dict[str, float]) -> str:
    return (f"eval  step {step:5d} | valid loss {ev['loss']:.4f} | ppl {ev['ppl']:.2f} | "
            f"bpb {ev['bpb']:.4f} | {ev['tokens']} tokens")


# ------------------------------------------------------------------------------------------------- checkpoints
def checkpoint_path(path: str, ps: ParallelState) -> str:
    """One file when experts are not sharded (every rank holds the same weights), else one per rank."""
    return checkpoints.file_name(path, ps.rank, ps.ep_size)


def save_checkpoint(path: str, model, optimizer, cfg: MoEConfig, step: int, args: argparse.Namespace,
                    ps: ParallelState, dynamic: Optional[DynamicRuntime] = None) -> Optional[str]:
    """Collective. This rank's file of a checkpoint set plus, once every rank's file is written, the set's
    manifest (``train_checkpoint``): a set interrupted mid-save is never mistaken for a complete one."""
    rng = torch.get_rng_state()
    rng_states = [rng]
    dyn_states = [dynamic.state_dict()] if dynamic is not None else None
    if ps.distributed:
        rng_states = [None] * ps.world_size
        dist.all_gather_object(rng_states, rng)
        if dynamic is not None:          # every rank's (its own assignment cache), in every file
            dyn_states = [None] * ps.world_size
            dist.all_gather_object(dyn_states, dynamic.state_dict())
    state = {"format": CHECKPOINT_FORMAT, "step": step, "model": model.state_dict(),
             "placement": [m.plan.placement.to_checkpoint() for m in moe_layers(model)],
             "optimizer": optimizer.state_dict(), "moe_config": cfg.to_dict(),
             "model_args": {n: getattr(args, n) for n in MODEL_ARG_NAMES}, "args": dict(vars(args)),
             "rng_states": rng_states, "world_size": ps.world_size, "expert_parallel_size": ps.ep_size,
             "ep_rank": ps.ep_rank}
    if dyn_states is not None:
        state["dynamic"] = dyn_states
    if cfg.per_rank_gate_state:     # every rank's own gate (and its Adam state) and per-rank buffers, in every file
        state["gates"] = gather_rank_states(model, optimizer, dist.group.WORLD if ps.distributed else None)
    return checkpoints.save(path, state, ps.rank, ps.world_size, ps.ep_size)


def optimizer_param_names(model: torch.nn.Module) -> List[str]:
    """Parameter names in the optimizer's index order (``_optimizer``'s groups: matrices, then the rest)."""
    named = list(model.named_parameters())
    return [n for n, p in named if p.dim() >= 2] + [n for n, p in named if p.dim() < 2]


def load_checkpoint(ckpt: "checkpoints.CheckpointSet", model, cfg: MoEConfig, ps: Optional[ParallelState] = None,
                    log=print) -> dict:
    """The checkpoint dict this rank resumes from: its own EP rank's file, or one resharded from another
    expert-parallel size (``train_checkpoint.state_for_rank``)."""
    ps = ps or ParallelState()
    layers = moe_layers(model)
    index = {id(m): i for i, m in enumerate(layers)}
    experts = {f"{name}.experts.{pname}": index[id(m)] for name, m in model.named_modules() if id(m) in index
               for pname, _ in m.experts.named_parameters()}
    return checkpoints.state_for_rank(ckpt, ps.ep_rank, ps.ep_size, cfg.slots_per_rank, experts,
                                      optimizer_param_names(model), log=log)


def _check_resumable(parser, ckpt: "checkpoints.CheckpointSet", args, cfg: MoEConfig) -> None:
    """Before the corpus is read or the model built: the checkpoint's model must be this model."""
    saved = ckpt.manifest
    diffs = [f"--{n.replace('_', '-')}: checkpoint {saved['model_args'].get(n)!r}, now {getattr(args, n)!r}"
             for n in MODEL_ARG_NAMES if saved["model_args"].get(n) != getattr(args, n)]
    old = upgrade_options(saved["moe_config"])
    diffs += [f"--moe-{n.replace('_', '-')}: checkpoint {old.get(n)!r}, now {getattr(cfg, n)!r}"
              for n in MOE_SHAPE_OPTIONS if old.get(n) != getattr(cfg, n)]
    if diffs:
        parser.error(f"--resume {args.resume}: the checkpoint does not match this model: " + "; ".join(diffs))


def _write_metrics(path: str, result: "TrainResult") -> None:
    import json

    def plain(v):
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"step": result.step, "train_seconds": result.train_seconds, "history": plain(result.history),
                   "evals": [dict(plain(e), train_seconds=result.eval_train_seconds.get(e["step"]))
                             for e in result.evals], "skipped_steps": result.skipped_steps,
                   "dynamic": plain(result.dynamic), "cache_history": plain(result.cache_history)}, f)


# -------------------------------------------------------------------------------------------------------- main
@dataclass
class TrainResult:
    step: int                                   # completed steps
    model: TinyMoEGPT
    optimizer: torch.optim.Optimizer
    moe_config: MoEConfig
    start_step: int = 0                         # step the run started from (> 0 when resumed)
    history: List[dict] = field(default_factory=list)   # one dict per log line
    evals: List[dict] = field(default_factory=list)     # one dict per eval (with "step")
    checkpoint: Optional[str] = None
    trace: Optional[str] = None
    dynamic: Dict[str, float] = field(default_factory=dict)   # DynaMoE runtime metrics at the end
    cache_history: List[tuple] = field(default_factory=list)  # (epoch, kept fraction, caching on) per epoch
    skipped_steps: int = 0                      # updates dropped for non-finite router outputs (--moe-nonfinite skip)
    train_seconds: float = 0.0                  # wall time in training steps (evaluations and checkpoints excluded)
    eval_train_seconds: Dict[int, float] = field(default_factory=dict)   # step of an eval -> train_seconds then


def main(argv: Optional[Sequence[str]] = None) -> TrainResult:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    # everything a user can get wrong is checked here, before the corpus is read or the model built
    try:
        cfg = moe_config_from_args(args)
        refuse_in_training(cfg, "megamoe train")
        hook = AfterStepHook(cfg)      # --moe-placement flexmoe|shadow|...: an unknown policy or profile fails now
        for text in gate_warnings(cfg):
            warn_once(text)
    except ConfigError as err:
        parser.error(str(err))
    if args.moe_every == 0:
        warn_once("--moe-every=0: a dense model without MoE layers; every --moe-* option has no effect")
    ckpt = None
    if args.resume:
        try:
            ckpt = checkpoints.resolve(args.resume)
        except checkpoints.CheckpointError as err:
            parser.error(f"--resume {err}")
        _check_resumable(parser, ckpt, args, cfg)
    torch.set_num_threads(args.threads)
    retain_freed_memory()      # CPU: reuse large activation/gradient blocks instead of page-faulting them each step
    try:
        ps = init_parallel(cfg.expert_parallel_size)
    except ConfigError as err:
        parser.error(str(err))
    try:
        return _train(parser, args, cfg, ps, hook, ckpt)
    finally:
        if ps.initialized_here and dist.is_initialized():
            dist.destroy_process_group()


def _resume(ckpt, model, optimizer, cfg: MoEConfig, ps: ParallelState, log) -> dict:
    """Load the checkpoint set into the model and optimizer (resharded when the expert-parallel size changed);
    returns the state dict it came from (step, RNG, DynaMoE state)."""
    for note in ckpt.notes:
        log(note)
    state = load_checkpoint(ckpt, model, cfg, ps, log=log)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    layers = moe_layers(model)
    for m, placed in zip(layers, state.get("placement") or []):
        m.plan.placement.from_checkpoint(placed)       # the bank rows were saved laid out by it
    apply_placement([(m.plan.placement, [], m.experts) for m in layers])   # replica groups (collective)
    rngs = state.get("rng_states") or []
    if len(rngs) == ps.world_size:
        torch.set_rng_state(rngs[ps.rank])
    if state.get("gates") and cfg.per_rank_gate_state:   # this rank's gate, or the saved gates' mean
        load_rank_state(model, rank_state_for(state["gates"], ps.rank, ps.world_size), optimizer)
    return state


def _log_setup(log, args, cfg: MoEConfig, ps: ParallelState, corpus, model, warmup: int, setup_s: float) -> None:
    """The run's first lines: corpus, model, MoE options, parallel layout."""
    n_moe = len(moe_layers(model))
    log(f"megamoe train | {corpus!r}")
    log(f"model: {args.layers} layers ({n_moe} MoE, every {args.moe_every}), hidden {args.hidden}, heads "
        f"{args.heads}, ffn {args.ffn_hidden}, seq {args.seq_len}, vocab {corpus.vocab_size} | params "
        f"{model.num_parameters() / 1e6:.2f}M on rank 0 ({model.num_parameters(active=True) / 1e6:.2f}M active "
        f"per token)")
    log(f"moe: {cfg.num_experts} experts, gate {cfg.gate} top-{cfg.top_k}, dispatch {cfg.dispatch}"
        + (f" (capacity factor {cfg.capacity_factor})" if cfg.dispatch == "capacity" else "")
        + f", aux {cfg.aux_loss_coeff}, z {cfg.z_loss_coeff}, activation {cfg.activation}")
    log(f"parallel: world {ps.world_size}, expert-parallel {ps.ep_size} ({cfg.num_local_experts} local experts), "
        f"batch {args.batch_size}x{args.seq_len} per rank, {args.threads} thread(s) | steps {args.steps}, "
        f"lr {args.lr} warmup {warmup} cosine | setup {setup_s:.1f}s")


def _dynamic_runtime(cfg: MoEConfig, args, model, ps: ParallelState, state: dict):
    """DynaMoE's runtime (--moe-capacity-policy dynamic / --moe-assignment-cache), restored from a checkpoint's
    per-rank states (merged when the world size changed); None when off."""
    if not dynamic_enabled(cfg):
        return None
    dynamic = DynamicRuntime(cfg, {m.layer_id: m for m in moe_layers(model)},
                             group=dist.group.WORLD if ps.distributed else None, positions=args.seq_len)
    saved = state.get("dynamic")
    if saved:
        mine = dict(saved[ps.rank] if len(saved) == ps.world_size else saved[0])
        if len(saved) != ps.world_size and any("cache" in d for d in saved):
            mine["cache"] = AssignmentCache.merge_states([d["cache"] for d in saved if "cache" in d])
        dynamic.load_state_dict(mine)
    return dynamic


def _progress_line(record: dict, steps: int, hook: AfterStepHook, dynamic, ps: ParallelState) -> str:
    """One log line; adds the placement and DynaMoE metrics to ``record`` as it reports them."""
    line = (f"step {record['step']:5d}/{steps} | loss {record['loss']:.4f} | lm {record['lm_loss']:.4f} | aux "
            f"{record['aux_loss']:.4f} | lr {record['lr']:.2e} | gnorm {record['grad_norm']:.2f} | "
            f"{record['tokens_per_s']:,.0f} tok/s")
    placed = getattr(hook.policy, "metrics", None)
    if placed:
        line += (f" | placement moves {hook.policy.total_moves} replicas {placed['replicas']:.0f} "
                 f"balance {placed['balance_ratio']:.2f}->{placed['balance_ratio_next']:.2f}")
    dyn = dynamic.metrics() if dynamic is not None else {}
    if dyn:
        line += " | dynamic " + format_dynamic_metrics(dyn)
    if record["moe"]:
        # device balance (experts in contiguous blocks over the ranks) only when EP spans the world
        line += " | " + format_load(record["moe"], show_device_balance=1 < ps.ep_size == ps.world_size)
    record["dynamic"] = dyn
    record["placement"] = dict(placed or {}, moves_total=getattr(hook.policy, "total_moves", 0),
                               bytes_moved_total=getattr(hook.policy, "total_bytes", 0))
    return line


def _train(parser, args, cfg: MoEConfig, ps: ParallelState, hook: AfterStepHook, ckpt) -> TrainResult:
    def log(msg: str) -> None:
        if ps.is_main:
            print(msg, flush=True)

    t0 = time.perf_counter()
    corpus = build_corpus(max_bytes=args.corpus_bytes, seed=args.seed, cache_dir=args.corpus_cache)
    try:
        tokens = corpus.split("train").tokens
        if args.max_train_samples:
            tokens = tokens[:args.max_train_samples * args.seq_len + 1]
        batches = TrainBatches(tokens, args.batch_size, args.seq_len, args.seed, ps.rank, ps.world_size)
    except ValueError as err:
        parser.error(str(err))
    stats = StatsSink()
    try:
        model = build_model(cfg, corpus.vocab_size, args, ps, stats)
    except (ConfigError, ValueError) as err:
        parser.error(str(err))
    optimizer = _optimizer(model, args)
    warmup = args.warmup if args.warmup is not None else max(args.steps // 10, 1)
    torch.manual_seed(args.seed * 1_000_003 + 17 + ps.rank)     # per-rank RNG: random routing, dropout, jitter

    start, state = 0, {}
    if ckpt is not None:
        state = _resume(ckpt, model, optimizer, cfg, ps, log)
        start = int(state["step"])

    trace_path = args.trace or cfg.trace_path
    tracer = None
    if trace_path:
        tracer = TraceRecorder(trace_path, ps.rank, ps.world_size, cfg.num_experts, cfg.top_k)
        stats.listeners.append(tracer)

    _log_setup(log, args, cfg, ps, corpus, model, warmup, time.perf_counter() - t0)
    if start:
        log(f"resumed from {args.resume} at step {start}")
    dynamic = _dynamic_runtime(cfg, args, model, ps, state if start else {})
    result = TrainResult(step=start, model=model, optimizer=optimizer, moe_config=cfg, start_step=start)
    gate_sync = GateSync(cfg, dist.group.WORLD if ps.distributed else None)
    world_group = dist.group.WORLD if ps.distributed else None
    tokens_per_step = args.batch_size * args.seq_len * ps.world_size
    acc = torch.zeros(3, dtype=torch.float64)                  # loss, lm, aux sums over the interval
    acc_steps, gnorm = 0, 0.0
    acc_seconds = 0.0                                          # training time of the interval's steps
    model.train()

    end = args.steps
    if args.exit_interval:
        end = min(end, (start // args.exit_interval + 1) * args.exit_interval)
    for step in range(start, end):
        t_step = time.perf_counter()
        lr = lr_at(step, args.steps, args.lr, warmup, args.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        inp, tgt = batches.batch(step)
        if dynamic is not None and dynamic.cache is not None:
            dynamic.cache.set_batch(batches.sample_ids(step), inp.shape[1], layout="bs", epoch=batches.epoch_of(step))
        if tracer is not None:
            tracer.next_step(step + 1)
        logits = model(inp)
        lm_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1))
        aux_loss = collect_aux_loss(model)
        loss = lm_loss + aux_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        sync_gradients(model, ps, gate_sync.local)
        finish_global_batch(model, world_group, world_group)     # expert bias / global loss: once per step
        done = step + 1
        problem = check_nonfinite([stats], done, world_group) if cfg.nonfinite != "off" else None
        if problem and cfg.nonfinite == "raise":
            raise NonFiniteRoutingError(f"rank {ps.rank}: {problem} (--moe-nonfinite skip drops such steps)")
        if problem:                              # --moe-nonfinite skip: no update from this step's gradients
            optimizer.zero_grad(set_to_none=True)
            result.skipped_steps += 1
            log(f"step {done:5d}: update skipped (--moe-nonfinite skip): {problem}")
        else:
            gnorm = clip_grad_norm(model, args.clip_grad, ps, gate_sync.local)
            optimizer.step()
            gate_sync.after_step(model, done)
            hook.run(model, optimizer, done, last_step=args.steps)
        if dynamic is not None:
            if dynamic.cache is not None:
                dynamic.cache.clear_batch()          # evaluation forwards never key into training samples
            dynamic.after_step(done)
        result.step = done
        step_seconds = time.perf_counter() - t_step
        result.train_seconds += step_seconds
        acc_seconds += step_seconds
        if not problem:
            acc += torch.stack([loss.detach(), lm_loss.detach(), aux_loss.detach()]).double()
            acc_steps += 1

        if done % args.log_interval == 0 or done == end:
            if ps.distributed:
                dist.all_reduce(acc, group=world_group)
            mean = (acc / (max(acc_steps, 1) * ps.world_size)).tolist()
            # the interval's own steps, timed as they ran: an evaluation or a checkpoint between two of them is
            # not training time, and neither counts
            tps = acc_steps * tokens_per_step / max(acc_seconds, 1e-9)
            record = {"step": done, "loss": mean[0], "lm_loss": mean[1], "aux_loss": mean[2], "lr": lr,
                      "grad_norm": gnorm, "tokens_per_s": tps, "moe": stats.summary(group=world_group)}
            if dynamic is not None:
                record["dynamic"] = dynamic.metrics()
            log(_progress_line(record, args.steps, hook, dynamic, ps))
            result.history.append(record)
            acc.zero_()
            acc_steps, acc_seconds = 0, 0.0

        if args.eval_interval and done % args.eval_interval == 0 and done != end:
            ev = evaluate(model, corpus, "valid", args.batch_size, args.seq_len, ps, args.eval_batches)
            log(_format_eval(done, ev))
            result.evals.append({"step": done, **ev})
            result.eval_train_seconds[done] = result.train_seconds
        if args.save_interval and done % args.save_interval == 0 and done != end:
            save_checkpoint(args.save, model, optimizer, cfg, done, args, ps, dynamic)

    ev = evaluate(model, corpus, "valid", args.batch_size, args.seq_len, ps, args.eval_batches)
    log(_format_eval(result.step, ev))
    result.evals.append({"step": result.step, **ev})
    result.eval_train_seconds[result.step] = result.train_seconds
    if args.save:
        result.checkpoint = save_checkpoint(args.save, model, optimizer, cfg, result.step, args, ps, dynamic)
        log(f"saved checkpoint {checkpoint_path(args.save, ps)} (step {result.step})")
    if dynamic is not None:
        result.dynamic = dynamic.metrics()
        result.cache_history = dynamic.cache_history()
        dynamic.close()
    if args.metrics_json and ps.is_main:
        _write_metrics(args.metrics_json, result)
    if tracer is not None:
        result.trace = tracer.flush()
        log(f"routing trace: {trace_path}.rank* (steps {start + 1}..{result.step})")
    log(f"done: {result.step - start} steps in {time.perf_counter() - t0:.1f}s"
        + (f" (stopped at --exit-interval, {args.steps - result.step} steps to go)" if result.step < args.steps else ""))
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
