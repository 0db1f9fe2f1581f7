#!/usr/bin/env python
"""Pretrain an MoE GPT on megatron-core alone (no Megatron-LM checkout), optionally with megamoe_plugin.

    # one process, CPU, the embedded real-text corpus, plugin on:
    python examples/megatron/pretrain_moe_gpt.py --num-experts 8 --moe-router-topk 2 --moe-plugin
    # two processes, expert parallel:
    torchrun --nproc-per-node 2 examples/megatron/pretrain_moe_gpt.py --num-experts 8 \
        --expert-model-parallel-size 2 --moe-plugin --moe-plugin-gate gshard

Everything is megatron-core's: GPTModel from the GPT decoder-block spec (``--moe-layer-freq`` decides the MoE
layers), parallel_state groups (TP, PP, EP, DP), DistributedDataParallel, get_megatron_optimizer, the
OptimizerParamScheduler, get_forward_backward_func schedules (pipelining included), GPTDataset / MockGPTDataset
through BlendedMegatronDatasetBuilder, dist_checkpointing. With ``--moe-plugin`` the MoE layers of the spec become
the plugin's (spec.py) and the after-step hook runs after every optimizer step (hooks.py). Flags use Megatron-LM's
names (core_args.py) plus ``--moe-plugin-*`` (args.py); ``-h`` lists them. With ``--moe-plugin-placement flexmoe``
or ``shadow`` experts are re-placed between steps and the progress line ends with ``placement moves N replicas R
shadowed S balance B``; checkpoints hold experts by logical id, so they load at any EP size and placement. Without
CUDA, megatron-core runs on CPU with gloo through the plugin's shims (cpu_compat.py).
"""
import argparse
import math
import os
import random
import sys
import time
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from megamoe_plugin.megatron_adapter.args import add_moe_plugin_args, validate_moe_plugin_args
from megamoe_plugin.megatron_adapter.core_args import add_megatron_core_args, validate_core_args


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_megatron_core_args(p)
    add_moe_plugin_args(p)
    args = p.parse_args(argv)
    # every check runs before any process group or model exists
    validate_core_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    validate_moe_plugin_args(args)
    return args


def print0(*a):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*a, flush=True)


def initialize(args):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megamoe_plugin.megatron_adapter.cpu_compat import install_cpu_shims

    cuda = torch.cuda.is_available()
    if not cuda:
        install_cpu_shims()
    backend = args.distributed_backend or ("nccl" if cuda else "gloo")
    if "RANK" in os.environ:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
    else:
        import tempfile
        fd, path = tempfile.mkstemp(prefix="megamoe_pg_")
        os.close(fd)
        dist.init_process_group(backend=backend, init_method=f"file://{path}", world_size=1, rank=0)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size)
    seed = args.seed + 100 * ps.get_pipeline_model_parallel_rank()      # Megatron-LM's _set_random_seed
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def transformer_config(args):
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    moe = {}
    if args.num_experts:
        moe = dict(num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                   moe_layer_freq=args.moe_layer_freq, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                   moe_aux_loss_coeff=args.moe_aux_loss_coeff, moe_z_loss_coeff=args.moe_z_loss_coeff,
                   moe_input_jitter_eps=args.moe_input_jitter_eps,
                   moe_expert_capacity_factor=args.moe_expert_capacity_factor,
                   moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
                   moe_router_load_balancing_type=args.moe_router_load_balancing_type,
                   moe_router_dtype=args.moe_router_dtype, moe_router_pre_softmax=args.moe_router_pre_softmax,
                   moe_token_dispatcher_type=args.moe_token_dispatcher_type, moe_grouped_gemm=args.moe_grouped_gemm)
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, init_method_std=args.init_method_std,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        add_bias_linear=args.add_bias_linear, gated_linear_unit=args.swiglu,
        activation_func=torch.nn.functional.silu if args.swiglu else torch.nn.functional.gelu,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size, sequence_parallel=args.sequence_parallel,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=args.bf16,
        use_cpu_initialization=not torch.cuda.is_available(),
        bias_dropout_fusion=False, gradient_accumulation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, **moe)


def build_model(args, config, vocab_size):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    if args.num_experts:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    else:
        spec = get_gpt_layer_local_spec()
    if args.moe_plugin:
        from megamoe_plugin.megatron_adapter.spec import moe_plugin_spec
        spec = moe_plugin_spec(spec, args.moe_plugin_config)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab_size,
                     max_sequence_length=args.max_position_embeddings,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                     position_embedding_type=args.position_embedding_type)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=args.bf16, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


def build_optimizer(args, model):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt_config = OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                                 adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                                 clip_grad=args.clip_grad, bf16=args.bf16,
                                 params_dtype=torch.bfloat16 if args.bf16 else torch.float32)
    optimizer = get_megatron_optimizer(opt_config, [model])
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters,
        lr_decay_steps=args.train_iters, lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
        end_wd=args.weight_decay, wd_incr_steps=args.train_iters, wd_incr_style="constant")
    return optimizer, scheduler


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum().clamp_min(1.0)
    # a copy: the schedule divides the returned loss by the number of micro-batches in place
    return loss, {"lm loss": loss.detach().clone()}


DYNAMIC = None      # the DynaMoE runtime (megamoe_plugin.dynamic) when the assignment cache is on


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    if DYNAMIC is not None and DYNAMIC.cache is not None:
        if torch.is_grad_enabled():      # training: key this micro-batch's tokens by (sample index, position)
            DYNAMIC.cache.set_batch(batch["sample_ids"], batch["tokens"].shape[1], layout="sb", epoch=batch["epoch"])
        else:
            DYNAMIC.cache.clear_batch()
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def run_schedule(args, model, data_iter, num_microbatches, forward_only):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    out = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data_iter, model=[model], num_microbatches=num_microbatches,
        seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length,
        forward_only=forward_only)
    return average_loss(out)


def average_loss(losses_reduced):
    """The micro-batch average of 'lm loss' on the last stage, averaged over it and sent to every rank."""
    from megatron.core import parallel_state as ps

    last = ps.is_pipeline_last_stage()
    t = torch.zeros(2, dtype=torch.float64)
    if last and losses_reduced:
        t[0] = sum(float(x["lm loss"]) for x in losses_reduced) / len(losses_reduced)
        t[1] = 1.0
    dist.all_reduce(t)
    return float(t[0] / t[1])


# --- checkpoints: megatron-core dist_checkpointing (experts stored by global id) + per-rank RNG/scheduler ---------
def save_checkpoint(args, iteration, model, optimizer, scheduler):
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    path = os.path.join(args.save, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    # RNG states first: saving must not change what the next step draws
    extra = {"iteration": iteration, "scheduler": scheduler.state_dict(),
             "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
                     "tracker": get_cuda_rng_tracker().get_states()}}
    if DYNAMIC is not None:              # capacities in force, the policies' state, the assignment cache
        extra["dynamic"] = DYNAMIC.state_dict()
    model_sd = model.module.sharded_state_dict()
    dist_checkpointing.save({"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd)}, path)
    torch.save(extra, os.path.join(path, f"extra_rank{dist.get_rank()}.pt"))
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(args.save, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    print0(f" saved checkpoint at iteration {iteration} to {path}")


def load_checkpoint(args, model, optimizer, scheduler) -> int:
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker_file = os.path.join(args.load, "latest_checkpointed_iteration.txt")
    if not os.path.exists(tracker_file):
        print0(f" no checkpoint in {args.load}: starting from scratch")
        return 0
    iteration = int(open(tracker_file).read().strip())
    path = os.path.join(args.load, f"iter_{iteration:07d}")
    model_sd = model.module.sharded_state_dict()
    state = dist_checkpointing.load(
        {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True)}, path)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    extra_file = os.path.join(path, f"extra_rank{dist.get_rank()}.pt")
    if os.path.exists(extra_file):
        extra = torch.load(extra_file, weights_only=False)
        scheduler.load_state_dict(extra["scheduler"])
        rng = extra["rng"]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        get_cuda_rng_tracker().set_states(rng["tracker"])
        if DYNAMIC is not None and "dynamic" in extra:
            DYNAMIC.load_state_dict(extra["dynamic"])
    else:
        print0(f" {extra_file} missing (different world size?): RNG and LR schedule start fresh")
        scheduler.step(increment=iteration)
    print0(f" loaded checkpoint from {path} at iteration {iteration}")
    return iteration


def main(argv=None):
    args = parse_args(argv)
    initialize(args)
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, track_moe_metrics
    from megamoe_plugin.data import VOCAB_SIZE
    from megamoe_plugin.megatron_adapter.data import batches, build_datasets

    config = transformer_config(args)
    tp = args.tensor_model_parallel_size
    raw_vocab = (args.vocab_size or 1024) if args.mock_data else VOCAB_SIZE
    multiple = args.make_vocab_size_divisible_by * tp
    vocab = int(math.ceil(raw_vocab / multiple) * multiple)
    model = build_model(args, config, vocab)
    optimizer, scheduler = build_optimizer(args, model)
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss

    hooks = None
    if args.moe_plugin:
        from megamoe_plugin.megatron_adapter.hooks import get_step_hooks
        from megamoe_plugin.megatron_adapter.metrics import (format_dynamic_metrics, format_layer_metrics,
                                                             format_placement_metrics)
        hooks = get_step_hooks(args.moe_plugin_config, args.num_layers)
        global DYNAMIC
        DYNAMIC = hooks.setup(model, positions=args.seq_length)     # DynaMoE runtime, before the first forward

    start = load_checkpoint(args, model, optimizer, scheduler) if args.load else 0
    if args.skip_train:
        if args.moe_plugin:        # paper 004: expert permutation, then expert buffering (inference only)
            from megamoe_plugin.inference.deploy import prepare_for_inference
            prepare_for_inference(model, args.moe_plugin_config, log=print0,
                                  strict=args.pipeline_model_parallel_size == 1)
        dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        n_micro = args.global_batch_size // (args.micro_batch_size * dp)
        eval_samples = args.eval_iters * args.global_batch_size
        _, valid_ds, _ = build_datasets(args.seq_length, (max(args.train_iters, 1) * args.global_batch_size,
                                                          eval_samples, eval_samples), args.seed, args.mock_data,
                                        raw_vocab, args.data_cache_path, args.corpus_bytes, dist.get_rank())
        evaluate(args, model, valid_ds, n_micro, dp_rank, dp, start)
        dist.barrier()
        dist.destroy_process_group()
        return
    if hooks is not None:
        hooks.start_iteration(start + 1)        # routing traces label forwards with their iteration
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    n_micro = args.global_batch_size // (args.micro_batch_size * dp)
    eval_samples = args.eval_iters * args.global_batch_size
    train_ds, valid_ds, _ = build_datasets(args.seq_length, (args.train_iters * args.global_batch_size,
                                                             eval_samples, eval_samples), args.seed,
                                           args.mock_data, raw_vocab, args.data_cache_path, args.corpus_bytes,
                                           dist.get_rank())
    train_iter = batches(train_ds, start, n_micro, args.micro_batch_size, dp_rank, dp,
                         epoch_samples=args.epoch_samples)
    writer = None
    if args.tensorboard_dir and dist.get_rank() == dist.get_world_size() - 1:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(args.tensorboard_dir)
    n_params = sum(p.numel() for p in model.parameters())
    print0(f" model: {args.num_layers} layers, hidden {args.hidden_size}, experts {args.num_experts}, "
           f"{n_params / 1e6:.2f}M params on rank 0 | world {dist.get_world_size()} (TP {tp}, "
           f"PP {args.pipeline_model_parallel_size}, EP {args.expert_model_parallel_size}, DP {dp}) | "
           f"data: {'mock' if args.mock_data else 'embedded corpus'} | plugin: "
           f"{args.moe_plugin_config.gate if args.moe_plugin else 'off'}")

    track = ["load_balancing_loss"] + (["z_loss"] if args.moe_z_loss_coeff else [])
    t0, window, window_loss, aux_window = time.time(), 0, 0.0, {}
    iteration = start
    while iteration < args.train_iters:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = run_schedule(args, model, train_iter, n_micro, forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        iteration += 1
        if ok:
            scheduler.step(increment=1)
            if hooks is not None:
                hooks.after_step(model, optimizer, iteration)
        if args.num_experts:
            aux = {}
            track_moe_metrics(loss_scale=1.0 / n_micro, iteration=iteration, writer=writer, total_loss_dict=aux,
                              force_initialize=True, track_names=track, num_layers=args.num_layers,
                              moe_layer_freq=args.moe_layer_freq)
            clear_aux_losses_tracker()
            for k, v in aux.items():
                aux_window[k] = aux_window.get(k, 0.0) + float(v)
        window += 1
        window_loss += loss
        if writer is not None:
            writer.add_scalar("lm loss", loss, iteration)
        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            moe = ""
            if hooks is not None:
                moe = " | " + format_layer_metrics(hooks.log_metrics(iteration, writer))
                for text in (format_placement_metrics(hooks.placement_metrics()),
                             format_dynamic_metrics(hooks.dynamic_metrics())):
                    moe += " | " + text if text else ""
            aux_text = "".join(f" | {k} {v / window:.4f}" for k, v in aux_window.items())
            ms = (time.time() - t0) * 1000 / window
            tokens = args.global_batch_size * args.seq_length * window / (time.time() - t0)
            print0(f" iteration {iteration:6d}/{args.train_iters} | lm loss {window_loss / window:.5f}{aux_text} | "
                   f"lr {scheduler.get_lr(optimizer.param_groups[0]):.2e} | grad norm {float(grad_norm or 0):.3f} | "
                   f"{ms:.0f} ms/it | {tokens:.0f} tokens/s{moe}")
            t0, window, window_loss, aux_window = time.time(), 0, 0.0, {}
        if args.eval_interval and iteration % args.eval_interval == 0:
            evaluate(args, model, valid_ds, n_micro, dp_rank, dp, iteration)
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save_checkpoint(args, iteration, model, optimizer, scheduler)
        if args.exit_interval and iteration % args.exit_interval == 0:
            print0(f" exiting at iteration {iteration} (--exit-interval)")
            break
    if iteration >= args.train_iters:
        evaluate(args, model, valid_ds, n_micro, dp_rank, dp, iteration)
        if args.save and (not args.save_interval or iteration % args.save_interval):
            save_checkpoint(args, iteration, model, optimizer, scheduler)
    dist.barrier()
    dist.destroy_process_group()


def evaluate(args, model, valid_ds, n_micro, dp_rank, dp, iteration):
    from megamoe_plugin.megatron_adapter.data import batches

    model.eval()
    with torch.no_grad():
        it = batches(valid_ds, 0, n_micro, args.micro_batch_size, dp_rank, dp)
        loss = sum(run_schedule(args, model, it, n_micro, forward_only=True) for _ in range(args.eval_iters))
    model.train()
    loss /= args.eval_iters
    print0(f" validation at iteration {iteration} | lm loss {loss:.4f} | ppl {math.exp(min(loss, 20)):.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
