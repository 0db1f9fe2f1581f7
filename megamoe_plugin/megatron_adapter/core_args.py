"""The Megatron-LM flags that the megatron-core example trainer understands, with Megatron-LM's names and defaults.

So that a ``pretrain_gpt.py`` command line (model, parallelism, MoE, optimizer, checkpoint flags) runs unchanged on
``megatron_adapter.trainer`` (``examples/megatron/pretrain_moe_gpt.py``); flags of Megatron-LM that are not listed here are rejected by argparse
rather than silently ignored. The plugin's own flags come from ``args.add_moe_plugin_args``.
"""
from __future__ import annotations

import argparse
import ast
import os
from typing import List, Union


def moe_freq_type(text: str) -> Union[int, List[int]]:
    """``--moe-layer-freq``: an int N (every N-th layer is MoE) or a list like ``[1,0,1,0]``."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        val = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(f"--moe-layer-freq={text!r}: expected an int or a list like [1,0,1,0]")
    if not isinstance(val, list) or not all(v in (0, 1) for v in val):
        raise argparse.ArgumentTypeError(f"--moe-layer-freq={text!r}: a list must hold only 0 and 1")
    return val


def add_megatron_core_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = p.add_argument_group("model (Megatron-LM names)")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden size")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default --seq-length")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="mock data: vocabulary size (default 1024); the corpus uses its byte vocabulary")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"], default="learned_absolute")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--squared-relu", action="store_true", help="squared ReLU activation (Nemotron)")
    g.add_argument("--quick-geglu", action="store_true", help="quick-GeGLU activation (gpt-oss)")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--bf16", action="store_true")

    g = p.add_argument_group("mixture of experts (Megatron-LM names)")
    g.add_argument("--num-experts", type=int, default=None)
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-layer-freq", type=moe_freq_type, default=1)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None)
    g.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=[0.0],
                   help="one coefficient, or one per --moe-router-load-balancing-type")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None)
    g.add_argument("--moe-input-jitter-eps", type=float, default=None)
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None)
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true")
    g.add_argument("--moe-router-load-balancing-type", nargs="+", default=["aux_loss"],
                   choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "quantile_balancing", "none"])
    g.add_argument("--moe-router-dtype", choices=["fp32", "fp64"], default=None)
    g.add_argument("--moe-router-pre-softmax", action="store_true")
    g.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid", "sqrtsoftplus"], default="softmax")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None)
    g.add_argument("--moe-router-num-groups", type=int, default=None)
    g.add_argument("--moe-router-group-topk", type=int, default=None)
    g.add_argument("--moe-router-enable-expert-bias", action="store_true")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    g.add_argument("--moe-token-drop-policy", choices=["probs", "position"], default="probs")
    g.add_argument("--moe-apply-probs-on-input", action="store_true")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    g.add_argument("--moe-shared-expert-overlap", action="store_true")
    g.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall", "flex"], default="alltoall")
    g.add_argument("--moe-grouped-gemm", action="store_true")

    g = p.add_argument_group("parallelism (Megatron-LM names)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None, help="default: the TP size")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl with CUDA, gloo without")

    g = p.add_argument_group("training (Megatron-LM names)")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=None, help="default micro batch x data-parallel size")
    g.add_argument("--train-iters", type=int, default=100)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=1e-4)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="cosine")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--eval-interval", type=int, default=0, help="0 = evaluate only at the end")
    g.add_argument("--eval-iters", type=int, default=4)
    g.add_argument("--exit-interval", type=int, default=None, help="stop after this iteration (for resume tests)")
    g.add_argument("--skip-train", action="store_true",
                   help="load --load, skip training, evaluate and exit (inference: the plugin's paper-004 options "
                        "--moe-plugin-placement-file / --moe-plugin-expert-cache-size apply here)")

    g = p.add_argument_group("data and checkpoints (Megatron-LM names)")
    g.add_argument("--mock-data", action="store_true", help="megatron-core's MockGPTDataset instead of the corpus")
    g.add_argument("--data-cache-path", default=os.path.join(os.path.expanduser("~"), ".cache", "megamoe"),
                   help="where the embedded corpus is written as Megatron indexed datasets")
    g.add_argument("--corpus-bytes", type=int, default=4_000_000, help="size of the embedded corpus")
    g.add_argument("--epoch-samples", type=int, default=0,
                   help="train on the first N samples of the train split, read again in the same order every "
                        "epoch (sample index = position in them; what --moe-plugin-assignment-cache keys by); "
                        "0 = the whole split")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=0)
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="with --load: stop with an error when there is no checkpoint there instead of starting "
                        "afresh (a --load other than --save, or --skip-train, is always an error)")
    g.add_argument("--override-opt_param-scheduler", dest="override_opt_param_scheduler", action="store_true",
                   help="on resume, take the learning-rate schedule from these flags (--lr, --train-iters, ...) "
                        "instead of the checkpoint's; every rank does the same either way")
    g.add_argument("--tensorboard-dir", default=None)
    return p


def validate_core_args(args, world_size: int) -> None:
    """Megatron-LM's own consistency checks for the flags above (clear errors naming the flags)."""
    tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    if world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not divisible by --tensor-model-parallel-size x "
                         f"--pipeline-model-parallel-size = {tp * pp}")
    dp = world_size // (tp * pp)
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp
    etp = args.expert_tensor_parallel_size
    if world_size % (etp * ep * pp):
        raise ValueError(f"world size {world_size} is not divisible by --expert-tensor-parallel-size x "
                         f"--expert-model-parallel-size x --pipeline-model-parallel-size = {etp * ep * pp}")
    if args.num_experts is None and ep > 1:
        raise ValueError("--expert-model-parallel-size > 1 needs --num-experts")
    if args.num_experts is not None and args.num_experts % ep:
        raise ValueError(f"--num-experts={args.num_experts} is not divisible by --expert-model-parallel-size={ep}")
    if args.num_layers % pp:
        raise ValueError(f"--num-layers={args.num_layers} is not divisible by --pipeline-model-parallel-size={pp}")
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise ValueError(f"--global-batch-size={args.global_batch_size} is not divisible by --micro-batch-size x "
                         f"data-parallel size = {args.micro_batch_size * dp}")
    if args.sequence_parallel and args.seq_length % tp:
        raise ValueError(f"--seq-length={args.seq_length} must be divisible by --tensor-model-parallel-size={tp}")
    if not 0 <= args.lr_warmup_iters < args.train_iters:
        raise ValueError(f"--lr-warmup-iters={args.lr_warmup_iters} must be below --train-iters={args.train_iters}")
    if tp == 1:
        args.sequence_parallel = False
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    args.data_parallel_size = dp
    args.world_size = world_size
