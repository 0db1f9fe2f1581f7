"""`megamoe trace`: run a trained MoE checkpoint over real held-out text and record its routing (paper 004 §IV,
Figs. 6-7: per-batch expert activation of every MoE layer).

    megamoe trace --checkpoint ckpt.pt --trainer core --out traces/lm --heatmap traces/lm.png
    megamoe trace --checkpoint ck/checkpoint_last.pt --trainer fairseq --out traces/fs [--data data-bin]
    megamoe trace --checkpoint ck_dir --trainer megatron --out traces/mg \\
        --megatron-args "--num-layers 2 --hidden-size 64 ... --moe-plugin"      # the training run's model flags

Checkpoints:
- ``core``: a ``megamoe train --save`` checkpoint (format ``megamoe-train/1``): one file, or ``PATH.rank<r>`` when
  the experts were sharded (the ranks of the first expert-parallel group are merged by logical expert id, with the
  saved placement, so spare slots and moved experts come back in order). Model sizes and MoE options come from the
  checkpoint.
- ``fairseq``: a ``fairseq-train`` checkpoint of the plugin's ``moe_transformer_lm*`` architectures, loaded with
  ``fairseq.checkpoint_utils.load_model_ensemble_and_task`` (checkpoints hold every expert, so one process loads
  any expert-parallel size); ``--data`` points at the data-bin folder if it moved (the dictionary lives there).
- ``megatron``: a checkpoint folder of ``examples/megatron/pretrain_moe_gpt.py --moe-plugin`` (``--save DIR``, or
  one ``iter_*`` folder in it). Its dist_checkpointing files hold no model flags, so ``--megatron-args`` must repeat
  the training run's model flags; the model is rebuilt with the example trainer's own functions in one process
  (a gloo group of one) and only the model's tensors are loaded.

Data: the embedded corpus (``megamoe_plugin.data``), the held-out ``--split`` (valid by default; never trained on),
read in order: batch b holds the next ``--batch-size`` windows of ``--seq-len`` tokens, so consecutive batches are
consecutive text, as the paper's traces over consecutive batches. core and megatron read byte tokens (their
training tokens); fairseq encodes the split's text lines with the checkpoint's dictionary (as ``fairseq-preprocess``
did for training: whitespace words, unknown words -> <unk>).

Trace: every MoE layer's routing of every batch goes to a ``TraceRecorder`` (schema ``megamoe-trace/1``, step =
batch number from 1): counts [batches, layers, 1, experts] of kept assignments (at eval the layers run as
configured for inference: dropless unless the checkpoint set ``--moe-eval-capacity-factor``); ``--token-ids`` also
stores every token's experts. ``megamoe_plugin.stats.load_trace(OUT)`` reads it back. ``--heatmap`` writes a Fig. 6
style PNG: per MoE layer, batches x experts, each cell the expert's share of the batch's assignments, and a last
panel of layers x experts over all batches. A summary per layer is printed: inactive experts per batch (Fig. 7),
the hottest expert's load over the mean, and the smallest capacity factor that would have dropped nothing.
"""
from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time
from typing import Iterator, List, Optional, Tuple

import torch

from .config import MoEConfig, upgrade_options
from .layer import MoELayer, moe_layers
from .stats import TraceRecorder, load_trace

__all__ = ["TRAINERS", "inference_config", "load_core_checkpoint", "load_fairseq_checkpoint",
           "load_megatron_checkpoint", "trace_model", "write_heatmap", "summarize", "main"]

TRAINERS = ("core", "fairseq", "megatron")

# options that only matter while training, in a distributed job or for a placement: reset for one-process inference
_INFERENCE_RESET = dict(expert_parallel_size=1, world_size=1, topology="", placement="none", placement_spare_slots=0,
                        placement_file="", capacity_policy="static", expert_graph="none", assignment_cache=False,
                        trace_path="", expert_cache_size=0, schedule="plain")


class CheckpointError(ValueError):
    """A checkpoint this command cannot read (the message says which are supported)."""


def inference_config(d: dict, **overrides) -> MoEConfig:
    """A one-process inference MoEConfig from a checkpoint's option dict (unknown, newer options dropped)."""
    names = {f for f in MoEConfig.__dataclass_fields__}
    kept = {k: v for k, v in upgrade_options(d).items() if k in names}
    kept.update({k: v for k, v in _INFERENCE_RESET.items() if k in names})
    kept.update(overrides)
    return MoEConfig(**kept)


# --- core: `megamoe train --save` ------------------------------------------------------------------------------
def load_core_checkpoint(path: str, **cfg_overrides) -> Tuple[torch.nn.Module, MoEConfig, dict]:
    """(TinyMoEGPT in eval mode with every expert, its inference MoEConfig, the checkpoint's model_args plus the
    training run's ``corpus_bytes`` and ``seed``, None where the checkpoint lacks them)."""
    from .models import TinyMoEGPT
    from . import train_checkpoint as checkpoints

    try:
        states = checkpoints.read_expert_group(checkpoints.resolve(path))
    except checkpoints.CheckpointError as err:
        raise CheckpointError(f"{err} (for fairseq or Megatron checkpoints pass --trainer fairseq / megatron)"
                              ) from None
    first = states[0]
    cfg = inference_config(first["moe_config"], **cfg_overrides)
    margs = dict(first["model_args"])
    run_args = first.get("args") or {}
    margs.update(corpus_bytes=run_args.get("corpus_bytes"), seed=run_args.get("seed"))
    full = dict(first["model"])
    vocab = full["wte.weight"].shape[0]
    model = TinyMoEGPT(cfg, vocab, hidden=margs["hidden"], heads=margs["heads"], layers=margs["layers"],
                       ffn_hidden=margs["ffn_hidden"], seq_len=margs["seq_len"], moe_every=margs["moe_every"],
                       dropout=0.0)
    for j, (name, m) in enumerate((n, m) for n, m in model.named_modules() if isinstance(m, MoELayer)):
        for pname, _ in m.experts.named_parameters():
            key = f"{name}.experts.{pname}"
            full[key] = checkpoints.logical_rows(states, [s["model"][key] for s in states], j)
    model.load_state_dict(full)
    model.eval()
    return model, cfg, margs


# --- fairseq ---------------------------------------------------------------------------------------------------
def load_fairseq_checkpoint(path: str, data: Optional[str] = None):
    """(model in eval mode, task) of a fairseq-train checkpoint of the plugin's MoE architectures."""
    try:
        from fairseq import checkpoint_utils
    except ImportError as err:
        raise CheckpointError(f"--trainer fairseq needs fairseq installed ({err})") from None
    from .fairseq_adapter import register  # noqa: F401  (models, architectures, criteria)

    overrides = {"data": data} if data else {}
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides=overrides)
    model = models[0]
    if not moe_layers(model):
        raise CheckpointError(f"{path}: the fairseq model has no megamoe MoE layer (arch moe_transformer_lm* "
                              f"expected)")
    model.eval()
    return model, task


def fairseq_stream(task, corpus, split: str) -> torch.Tensor:
    """The split's text encoded with the checkpoint's dictionary, lines as fairseq-preprocess saw them (each
    document's non-blank lines, ``corpus.write_text_splits``), every line ending with </s>."""
    d = task.source_dictionary if getattr(task, "source_dictionary", None) is not None else task.dictionary
    parts = []
    for doc in corpus.split_documents(split):
        for line in doc.text.split("\n"):
            if line.strip():
                parts.append(d.encode_line(line.rstrip(), add_if_not_exist=False, append_eos=True).long())
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)


# --- megatron example trainer --------------------------------------------------------------------------------------
def _megatron_iter_dir(path: str) -> str:
    tracker = os.path.join(path, "latest_checkpointed_iteration.txt")
    if os.path.isfile(tracker):
        with open(tracker) as f:
            return os.path.join(path, f"iter_{int(f.read().strip()):07d}")
    if os.path.basename(os.path.normpath(path)).startswith("iter_") and os.path.isdir(path):
        return path
    raise CheckpointError(f"{path}: not a checkpoint folder of examples/megatron/pretrain_moe_gpt.py (no "
                          f"latest_checkpointed_iteration.txt, not an iter_* folder)")


def load_megatron_checkpoint(path: str, megatron_args: List[str]):
    """(GPTModel in eval mode, parsed args) of an example-trainer checkpoint; one process (gloo group of one)."""
    if "--moe-plugin" not in megatron_args:
        raise CheckpointError("--trainer megatron traces the plugin's MoE layers: --megatron-args must include "
                              "--moe-plugin (as the training run did)")
    iter_dir = _megatron_iter_dir(path)
    from .megatron_adapter import trainer as ex
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(var, None)
    args = ex.parse_args(list(megatron_args))
    if args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.expert_model_parallel_size > 1:
        raise CheckpointError("--trainer megatron: one process; drop the TP/PP/EP sizes from --megatron-args "
                              "(dist_checkpointing reshards the saved tensors)")
    ex.initialize(args)
    from megatron.core import dist_checkpointing
    from megamoe_plugin.data import VOCAB_SIZE

    config = ex.transformer_config(args)
    multiple = args.make_vocab_size_divisible_by
    vocab = int(math.ceil(VOCAB_SIZE / multiple) * multiple)
    model = ex.build_model(args, config, vocab).module
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, iter_dir)
    model.load_state_dict(state["model"])
    model.eval()
    return model, args


# --- tracing -------------------------------------------------------------------------------------------------------
def windows(tokens: torch.Tensor, batch_size: int, seq_len: int, batches: int) -> Iterator[torch.Tensor]:
    """Up to `batches` batches [B, S + 1] of consecutive windows of `tokens`, in order (input = the first S tokens,
    target = the last S; the indexing of ``Corpus.sample``)."""
    n = (tokens.numel() - 1) // seq_len if tokens.numel() > seq_len else 0
    for b in range(min(batches, n // batch_size)):
        idx = torch.arange(b * batch_size, (b + 1) * batch_size)
        yield tokens[idx[:, None] * seq_len + torch.arange(seq_len + 1)]


def _sinks(model, trainer: str) -> list:
    """The StatsSinks the model's MoE layers record into (the recorder listens to them)."""
    if trainer == "megatron":
        from .megatron_adapter.layer import PluginMoELayer, plugin_stats
        if not any(isinstance(m, PluginMoELayer) for m in model.modules()):
            raise CheckpointError("the Megatron model has no plugin MoE layer (train with --moe-plugin)")
        return [plugin_stats()]
    layers = moe_layers(model)
    if not layers:
        raise CheckpointError("the model has no MoE layer")
    return list({id(m.stats): m.stats for m in layers}.values())


@torch.no_grad()
def trace_model(model, forward, batches: Iterator[torch.Tensor], sinks, recorder: TraceRecorder,
                log=print) -> dict:
    """Run `forward(model, inputs) -> logits [B, S, V]` on every batch [B, S + 1] with the recorder listening to
    the layers' StatsSinks; returns batches, tokens and the held-out loss (nats per token) of the model on them
    (a check that the checkpoint's weights were loaded: a fresh model scores about ln(vocab))."""
    for s in sinks:
        s.listeners.append(recorder)
    n = tokens = 0
    nll = 0.0
    t0 = time.perf_counter()
    try:
        for i, batch in enumerate(batches):
            recorder.next_step(i + 1)
            logits = forward(model, batch[:, :-1])
            target = batch[:, 1:]
            nll += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                           target.reshape(-1), reduction="sum"))
            n += 1
            tokens += target.numel()
    finally:
        for s in sinks:
            s.listeners.remove(recorder)
    loss = nll / tokens if tokens else float("nan")
    log(f"traced {n} batches ({tokens} tokens) in {time.perf_counter() - t0:.1f}s; held-out loss {loss:.4f} "
        f"nats/token")
    return {"batches": n, "tokens": tokens, "loss": loss}


def summarize(trace: dict, tokens_per_batch: int) -> str:
    """Per layer: assignments per batch, inactive experts per batch (mean, min, max), the hottest expert's load
    over the mean (mean and max over batches), and the capacity factor that would have dropped nothing in every
    batch (max expert load / (T * k / E))."""
    c = trace["counts"].sum(2).double()                       # [S, L, E]
    E, k = trace["num_experts"], trace["top_k"]
    lines = [f"| layer | assignments/batch | inactive experts/batch (mean, min-max of {E}) | max/mean load (mean, "
             f"max over batches) | CF that drops nothing |", "|---:|---:|---|---|---:|"]
    for j, layer in enumerate(trace["layers"]):
        x = c[:, j]                                           # [S, E]
        per = x.sum(1)
        inactive = (x == 0).sum(1).double()
        mean = per / E
        hot = x.max(1).values / mean.clamp_min(1e-9)
        need = x.max(1).values.max() / max(tokens_per_batch * k / E, 1e-9)
        lines.append(f"| {layer} | {per.mean():.0f} | {inactive.mean():.2f} ({int(inactive.min())}-"
                     f"{int(inactive.max())}) | {hot.mean():.2f}, {hot.max():.2f} | {float(need):.2f} |")
    return "\n".join(lines)


def write_heatmap(trace: dict, path: str, title: str = "") -> str:
    """Fig. 6 style PNG: per layer a batches x experts panel (share of the batch's assignments), and a layers x
    experts panel over all batches."""
    import logging
    logging.getLogger("matplotlib").setLevel(logging.WARNING)     # a DEBUG root logger (fairseq's setup) floods

    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    c = trace["counts"].sum(2).double()                       # [S, L, E]
    S, L, E = c.shape
    share = c / c.sum(2, keepdim=True).clamp_min(1)
    overall = c.sum(0) / c.sum((0, 2))[:, None].clamp_min(1)   # [L, E]
    panels = L + 1
    cols = min(panels, 4)
    rows = math.ceil(panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.8 * cols, 3.2 * rows + 0.4), squeeze=False, layout="constrained")
    vmax = float(share.max()) if share.numel() else 1.0
    for j in range(L):
        ax = axes[j // cols][j % cols]
        im = ax.imshow(share[:, j].numpy(), aspect="auto", interpolation="nearest", cmap="viridis", vmin=0,
                       vmax=vmax, extent=(-0.5, E - 0.5, S + 0.5, 0.5))
        ax.set_title(f"MoE layer {trace['layers'][j]}", fontsize=9)
        ax.set_xlabel("expert")
        ax.set_ylabel("batch")
    fig.colorbar(im, ax=[axes[j // cols][j % cols] for j in range(L)], label="share of the batch's assignments",
                 shrink=0.8)
    ax = axes[L // cols][L % cols]
    im2 = ax.imshow(overall.numpy(), aspect="auto", interpolation="nearest", cmap="viridis", vmin=0)
    ax.set_title(f"all {S} batches", fontsize=9)
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(L))
    ax.set_yticklabels([str(l) for l in trace["layers"]])
    fig.colorbar(im2, ax=ax, shrink=0.8)
    for j in range(panels, rows * cols):
        axes[j // cols][j % cols].axis("off")
    fig.suptitle(title or "expert activation per batch (paper 004 Fig. 6 style)", fontsize=10)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: Optional[List[str]] = None) -> dict:
    """`megamoe trace` (module docstring). A process group the Megatron loader starts here is torn down again, so
    a caller's process (a test, a notebook) is left as it was."""
    import torch.distributed as dist
    started_here = not (dist.is_available() and dist.is_initialized())
    try:
        return _main(argv)
    finally:
        if started_here and dist.is_available() and dist.is_initialized():
            try:
                from megatron.core import parallel_state
                parallel_state.destroy_model_parallel()
            except ImportError:
                pass
            dist.destroy_process_group()


def _main(argv: Optional[List[str]] = None) -> dict:
    p = argparse.ArgumentParser(prog="megamoe trace", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="checkpoint file (core: also PATH of PATH.rank<r> shards; "
                                                       "megatron: the --save folder or an iter_* folder)")
    p.add_argument("--trainer", choices=TRAINERS, default="core", help="which trainer wrote the checkpoint")
    p.add_argument("--out", required=True, help="trace prefix: writes OUT.rank0 (read it with stats.load_trace)")
    p.add_argument("--batches", type=int, default=20, help="batches to trace (fewer if the split is shorter)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (0 = the model's training length)")
    p.add_argument("--split", default="valid", choices=("valid", "test", "train"), help="corpus split (held-out "
                                                                                         "by default)")
    p.add_argument("--corpus-bytes", type=int, default=0, help="corpus size cap (0 = the training run's "
                                                               "--corpus-bytes where the checkpoint says, else "
                                                               "2,000,000)")
    p.add_argument("--token-ids", action="store_true", help="also record every token's expert ids")
    p.add_argument("--heatmap", default=None, metavar="PNG", help="write the activation heatmap here")
    p.add_argument("--data", default=None, help="fairseq: the data-bin folder (default: the checkpoint's)")
    p.add_argument("--megatron-args", default="", help="megatron: the training run's model flags, one string")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    args = p.parse_args(argv)
    for name in ("batches", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.seq_len < 0:
        p.error("--seq-len must be >= 0")
    if args.trainer == "megatron" and not args.megatron_args:
        p.error("--trainer megatron: pass the training run's model flags with --megatron-args (its checkpoints do "
                "not store them)")
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    from .data import build_corpus

    try:
        if args.trainer == "core":
            model, cfg, margs = load_core_checkpoint(args.checkpoint)
            max_len = margs["seq_len"]
            # the training run's corpus selection; its held-out split was never trained on
            corpus = build_corpus(max_bytes=args.corpus_bytes or margs["corpus_bytes"] or 2_000_000,
                                  seed=margs["seed"] or 0)
            stream = corpus.split(args.split).tokens
            forward = lambda m, b: m(b)                                      # noqa: E731
            sinks = [model.stats]
        elif args.trainer == "fairseq":
            model, task = load_fairseq_checkpoint(args.checkpoint, args.data)
            max_len = int(model.max_positions() if not isinstance(model.max_positions(), tuple)
                          else model.max_positions()[0])
            corpus = build_corpus(max_bytes=args.corpus_bytes or 2_000_000)
            stream = fairseq_stream(task, corpus, args.split)
            forward = lambda m, b: m(b)[0]                                   # noqa: E731  (logits, extra)
            sinks = _sinks(model, "fairseq")
            cfg = moe_layers(model)[0].cfg
        else:
            model, margs = load_megatron_checkpoint(args.checkpoint, shlex.split(args.megatron_args))
            max_len = margs.seq_length
            cfg = margs.moe_plugin_config
            corpus = build_corpus(max_bytes=args.corpus_bytes or margs.corpus_bytes or 2_000_000)
            stream = corpus.split(args.split).tokens

            def forward(m, b):
                return m(b, torch.arange(b.shape[1]).expand_as(b), None)     # logits [B, S, V]
            sinks = _sinks(model, "megatron")
    except (CheckpointError, FileNotFoundError) as err:
        p.error(f"--checkpoint {args.checkpoint} (--trainer {args.trainer}; supported: core = megamoe train --save, "
                f"fairseq = fairseq-train checkpoints of moe_transformer_lm*, megatron = "
                f"examples/megatron/pretrain_moe_gpt.py --moe-plugin --save folders): {err}")
    seq_len = args.seq_len or max_len
    if seq_len > max_len:
        p.error(f"--seq-len {seq_len} exceeds the model's {max_len}")
    print(f"megamoe trace: {args.trainer} checkpoint {args.checkpoint}: {cfg.num_experts} experts, top-{cfg.top_k} "
          f"{cfg.gate}, dispatch {cfg.dispatch} at eval; {args.split} split, {stream.numel()} tokens; batches of "
          f"{args.batch_size} x {seq_len}", flush=True)
    recorder = TraceRecorder(args.out, 0, 1, cfg.num_experts, cfg.top_k, args.token_ids)
    done = trace_model(model, forward, windows(stream, args.batch_size, seq_len, args.batches), sinks, recorder)
    if not done["batches"]:
        p.error(f"the {args.split} split has {stream.numel()} tokens: not one batch of {args.batch_size} x {seq_len}")
    shard = recorder.flush()
    trace = load_trace(args.out)
    print(f"trace: {shard} ({done['batches']} batches x {len(trace['layers'])} MoE layers x "
          f"{trace['num_experts']} experts)")
    summary = summarize(trace, args.batch_size * seq_len)
    print(summary)
    out = {"trace": args.out, "shard": shard, **done, "seq_len": seq_len, "layers": trace["layers"],
           "summary": summary}
    if args.heatmap:
        out["heatmap"] = write_heatmap(trace, args.heatmap, f"{args.trainer}: {os.path.basename(args.checkpoint)}, "
                                                             f"{args.split} split, batches of {args.batch_size} x "
                                                             f"{seq_len}")
        print(f"heatmap: {out['heatmap']}")
    return out


if __name__ == "__main__":
    main()
    sys.exit(0)
