"""The megatron-core trainer: pretrain an MoE GPT on megatron-core alone (no Megatron-LM checkout), optionally
with the plugin. ``examples/megatron/pretrain_moe_gpt.py`` is its command line; ``python -m
megamoe_plugin.megatron_adapter.trainer`` is the same.

    python -m megamoe_plugin.megatron_adapter.trainer --num-experts 8 --moe-router-topk 2 --moe-plugin
    torchrun --nproc-per-node 2 -m megamoe_plugin.megatron_adapter.trainer --num-experts 8 \\
        --expert-model-parallel-size 2 --moe-plugin --moe-plugin-gate gshard

Everything is megatron-core's: GPTModel from the GPT decoder-block spec (``--moe-layer-freq`` decides the MoE
layers), parallel_state groups (TP, PP, EP, DP), DistributedDataParallel, get_megatron_optimizer, the
OptimizerParamScheduler, get_forward_backward_func schedules (pipelining included), GPTDataset / MockGPTDataset
through BlendedMegatronDatasetBuilder, dist_checkpointing (``checkpointing.py``). With ``--moe-plugin`` the MoE
layers of the spec become the plugin's (spec.py) and the after-step hook runs after every optimizer step
(hooks.py). Flags use Megatron-LM's names (core_args.py) plus ``--moe-plugin-*`` (args.py); ``-h`` lists them.
Without CUDA, megatron-core runs on CPU with gloo through the plugin's shims (cpu_compat.py).
"""
from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from functools import partial
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from ..parallel import comm_device
from .args import add_moe_plugin_args, validate_moe_plugin_args
from .core_args import add_megatron_core_args, validate_core_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pretrain_moe_gpt", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_megatron_core_args(p)
    add_moe_plugin_args(p)
    return p


def parse_args(argv=None):
    """Parsed and validated flags; a bad combination raises ``ConfigError`` / ``ValueError`` naming the flag,
    before any process group or model exists (``main`` turns it into argparse's one line and exit status 2)."""
    args = build_parser().parse_args(argv)
    validate_core_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    validate_moe_plugin_args(args)
    return args


def print0(*a):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*a, flush=True)


def initialize(args):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from ..cpu_alloc import retain_freed_memory
    from .cpu_compat import install_cpu_shims

    cuda = torch.cuda.is_available()
    if not cuda:
        install_cpu_shims()
        retain_freed_memory()     # reuse large activation/gradient blocks instead of page-faulting them each step
    backend = args.distributed_backend or ("nccl" if cuda else "gloo")
    if "RANK" in os.environ:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
    else:
        # one process: an in-memory store (no port to collide with, no file left behind)
        dist.init_process_group(backend=backend, store=dist.HashStore(), world_size=1, rank=0)
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


def _one_or_list(values):
    """Megatron-LM's nargs='+' MoE flags: one value stays a scalar (TransformerConfig's default form)."""
    return values[0] if isinstance(values, (list, tuple)) and len(values) == 1 else values


def _activation(args) -> dict:
    """TransformerConfig's activation fields for --swiglu / --quick-geglu / --squared-relu (as Megatron-LM's
    core_transformer_config_from_args sets them)."""
    from megatron.core.activations import squared_relu
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    if sum(map(bool, (args.swiglu, args.quick_geglu, args.squared_relu))) > 1:
        raise ValueError("--swiglu, --quick-geglu and --squared-relu are exclusive")
    if args.swiglu:
        return dict(gated_linear_unit=True, activation_func=torch.nn.functional.silu)
    if args.quick_geglu:
        return dict(gated_linear_unit=True, activation_func=quick_gelu)
    if args.squared_relu:
        return dict(gated_linear_unit=False, activation_func=squared_relu)
    return dict(gated_linear_unit=False, activation_func=torch.nn.functional.gelu)


def transformer_config(args):
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    moe = {}
    if args.num_experts:
        moe = dict(num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                   moe_layer_freq=args.moe_layer_freq, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                   moe_aux_loss_coeff=_one_or_list(args.moe_aux_loss_coeff), moe_z_loss_coeff=args.moe_z_loss_coeff,
                   moe_input_jitter_eps=args.moe_input_jitter_eps,
                   moe_expert_capacity_factor=args.moe_expert_capacity_factor,
                   moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
                   moe_router_load_balancing_type=_one_or_list(args.moe_router_load_balancing_type),
                   moe_router_dtype=args.moe_router_dtype, moe_router_pre_softmax=args.moe_router_pre_softmax,
                   moe_router_score_function=args.moe_router_score_function,
                   moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
                   moe_router_num_groups=args.moe_router_num_groups,
                   moe_router_group_topk=args.moe_router_group_topk,
                   moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
                   moe_router_bias_update_rate=args.moe_router_bias_update_rate,
                   moe_token_drop_policy=args.moe_token_drop_policy,
                   moe_apply_probs_on_input=args.moe_apply_probs_on_input,
                   moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
                   moe_shared_expert_overlap=args.moe_shared_expert_overlap,
                   moe_token_dispatcher_type=args.moe_token_dispatcher_type, moe_grouped_gemm=args.moe_grouped_gemm)
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, init_method_std=args.init_method_std,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        add_bias_linear=args.add_bias_linear, **_activation(args),
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
        from .spec import moe_plugin_spec
        spec = moe_plugin_spec(spec, args.moe_plugin_config)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab_size,
                     max_sequence_length=args.max_position_embeddings,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                     position_embedding_type=args.position_embedding_type)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if args.bf16:     # as Megatron-LM: the whole model in bf16, the first stage's inputs cast, the loss in fp32
        from megatron.core.transformer.module import Float16Module
        model = Float16Module(config, model)
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
        end_wd=args.weight_decay, wd_incr_steps=args.train_iters, wd_incr_style="constant",
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=not args.override_opt_param_scheduler)
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
    if torch.cuda.is_available():       # the data pipeline builds host tensors; the model is on this rank's GPU
        batch.update({k: batch[k].cuda(non_blocking=True) for k in ("tokens", "position_ids", "labels", "loss_mask")})
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
    t = torch.zeros(2, dtype=torch.float64, device=comm_device())
    if last and losses_reduced:
        t[0] = sum(float(x["lm loss"]) for x in losses_reduced) / len(losses_reduced)
        t[1] = 1.0
    dist.all_reduce(t)
    return float(t[0] / t[1])


# --- checkpoints --------------------------------------------------------------------------------------------------
def save_checkpoint(args, iteration, model, optimizer, scheduler):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from . import checkpointing

    path = checkpointing.save(args.save, iteration, model, optimizer, scheduler, get_cuda_rng_tracker().get_states(),
                              DYNAMIC, local_gates=_local_gates(args))
    print0(f" saved checkpoint at iteration {iteration} to {path}")


def load_checkpoint(args, model, optimizer, scheduler) -> int:
    """The iteration to start from: the newest complete checkpoint under --load, else 0 (loudly), or an error
    when the run asked for a checkpoint explicitly (module ``checkpoint_required``)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from . import checkpointing

    if checkpointing.read_tracker(args.load) is None:
        why = checkpoint_required(args)
        if why:
            raise checkpointing.CheckpointError(f"--load {args.load}: no checkpoint there "
                                                f"({checkpointing.TRACKER} not found) and {why}")
        print0(f" WARNING: --load {args.load}: no checkpoint there ({checkpointing.TRACKER} not found): training "
               "starts from a freshly initialised model (--exit-on-missing-checkpoint makes this an error)")
        return 0
    iteration = checkpointing.load(args.load, model, optimizer, scheduler, get_cuda_rng_tracker().set_states,
                                   DYNAMIC, log=print0, local_gates=_local_gates(args))
    print0(f" loaded checkpoint from {checkpointing.iteration_dir(args.load, iteration)} at iteration {iteration}")
    return iteration


def _local_gates(args) -> bool:
    """Whether the checkpoint keeps every rank's own gate state (local gates, per-sender biases)."""
    cfg = getattr(args, "moe_plugin_config", None)
    return cfg is not None and cfg.per_rank_gate_state


def checkpoint_required(args) -> Optional[str]:
    """Why a missing checkpoint under --load is an error, or None when starting afresh is what the user meant
    (``--load`` equal to ``--save``: the usual relaunch-until-done command line, whose first launch has none)."""
    if args.exit_on_missing_checkpoint:
        return "--exit-on-missing-checkpoint is set"
    if args.skip_train:
        return "--skip-train evaluates a checkpoint"
    if not args.save or os.path.abspath(args.save) != os.path.abspath(args.load):
        return "--load names a checkpoint to resume from (not this run's own --save folder)"
    return None


# --- the run ------------------------------------------------------------------------------------------------------
class Run:
    """What one training run holds: args, model, optimizer, scheduler, plugin hooks, data."""

    def __init__(self, args):
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import finalize_model_grads
        from ..data import VOCAB_SIZE

        self.args = args
        config = transformer_config(args)
        tp = args.tensor_model_parallel_size
        self.raw_vocab = (args.vocab_size or 1024) if args.mock_data else VOCAB_SIZE
        multiple = args.make_vocab_size_divisible_by * tp
        self.vocab = int(math.ceil(self.raw_vocab / multiple) * multiple)
        self.model = build_model(args, config, self.vocab)
        self.optimizer, self.scheduler = build_optimizer(args, self.model)
        config.no_sync_func = self.model.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss
        self.hooks = None
        if args.moe_plugin:
            from .gate_sync import keep_local_gate_grads, with_sender_bias_update
            from .hooks import get_step_hooks
            global DYNAMIC
            self.hooks = get_step_hooks(args.moe_plugin_config, args.num_layers)
            DYNAMIC = self.hooks.setup(self.model, positions=args.seq_length)   # before the first forward
            if args.moe_plugin_config.local_gates:            # each rank's gate its own gradient
                config.finalize_model_grads_func = keep_local_gate_grads(finalize_model_grads)
                self.hooks.attach_gate_sync([self.model], self.optimizer)
            config.finalize_model_grads_func = with_sender_bias_update(config.finalize_model_grads_func)
        self.dp_rank, self.dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.n_micro = args.global_batch_size // (args.micro_batch_size * self.dp)

    def datasets(self, train_iters: int):
        from .data import build_datasets

        a = self.args
        eval_samples = a.eval_iters * a.global_batch_size
        return build_datasets(a.seq_length, (train_iters * a.global_batch_size, eval_samples, eval_samples), a.seed,
                              a.mock_data, self.raw_vocab, a.data_cache_path, a.corpus_bytes, dist.get_rank())

    def evaluate(self, valid_ds, iteration):
        from .data import batches

        a = self.args
        self.model.eval()
        with torch.no_grad():
            it = batches(valid_ds, 0, self.n_micro, a.micro_batch_size, self.dp_rank, self.dp)
            loss = sum(run_schedule(a, self.model, it, self.n_micro, forward_only=True) for _ in range(a.eval_iters))
        self.model.train()
        loss /= a.eval_iters
        print0(f" validation at iteration {iteration} | lm loss {loss:.4f} | ppl {math.exp(min(loss, 20)):.2f}")

    def describe(self):
        a = self.args
        n_params = sum(p.numel() for p in self.model.parameters())
        print0(f" model: {a.num_layers} layers, hidden {a.hidden_size}, experts {a.num_experts}, "
               f"{n_params / 1e6:.2f}M params on rank 0 | world {dist.get_world_size()} "
               f"(TP {a.tensor_model_parallel_size}, PP {a.pipeline_model_parallel_size}, "
               f"EP {a.expert_model_parallel_size}, DP {self.dp}) | "
               f"data: {'mock' if a.mock_data else 'embedded corpus'} | plugin: "
               f"{a.moe_plugin_config.gate if a.moe_plugin else 'off'}")


def evaluate_checkpoint(run: Run, start: int) -> None:
    """--skip-train: the paper-004 inference options, then one evaluation of the loaded checkpoint."""
    args = run.args
    if args.moe_plugin:
        from ..inference.deploy import prepare_for_inference
        prepare_for_inference(run.model, args.moe_plugin_config, log=print0,
                              strict=args.pipeline_model_parallel_size == 1)
    _, valid_ds, _ = run.datasets(max(args.train_iters, 1))
    run.evaluate(valid_ds, start)


def report_moe_metrics(**kwargs) -> None:
    """megatron-core's MoE metrics reported (aux losses into ``total_loss_dict`` and the writer) and cleared: its
    metrics tracker where the release has one, else the module functions (deprecated since 0.16)."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, track_moe_metrics
        track_moe_metrics(**kwargs)
        clear_aux_losses_tracker()
        return
    get_moe_metrics_tracker().report(**kwargs)


class ProgressLog:
    """The progress line every --log-interval iterations (Megatron-LM's fields plus the plugin's MoE metrics)."""

    def __init__(self, run: Run, writer):
        self.run, self.writer = run, writer
        args = run.args
        kinds = args.moe_router_load_balancing_type
        kinds = kinds if isinstance(kinds, (list, tuple)) else [kinds]
        names = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                 "global_aux_loss": "global_load_balancing_loss"}
        self.track = [names[k] for k in kinds if k in names] + (["z_loss"] if args.moe_z_loss_coeff else [])
        self.reset()

    def reset(self):
        self.t0, self.window, self.loss, self.aux = time.time(), 0, 0.0, {}

    def step(self, iteration: int, loss: float, grad_norm) -> None:
        args = self.run.args
        if args.num_experts:
            aux = {}
            report_moe_metrics(loss_scale=1.0 / self.run.n_micro, iteration=iteration, writer=self.writer,
                               total_loss_dict=aux, force_initialize=True, track_names=self.track,
                               num_layers=args.num_layers, moe_layer_freq=args.moe_layer_freq)
            for k, v in aux.items():
                self.aux[k] = self.aux.get(k, 0.0) + float(v)
        self.window += 1
        self.loss += loss
        if self.writer is not None:
            self.writer.add_scalar("lm loss", loss, iteration)
        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            self.print(iteration, grad_norm)

    def print(self, iteration: int, grad_norm) -> None:
        run, args = self.run, self.run.args
        moe = ""
        if run.hooks is not None:
            from .metrics import format_dynamic_metrics, format_layer_metrics, format_placement_metrics
            moe = " | " + format_layer_metrics(run.hooks.log_metrics(iteration, self.writer))
            for text in (format_placement_metrics(run.hooks.placement_metrics()),
                         format_dynamic_metrics(run.hooks.dynamic_metrics())):
                moe += " | " + text if text else ""
        aux_text = "".join(f" | {k} {v / self.window:.4f}" for k, v in self.aux.items())
        elapsed = time.time() - self.t0
        tokens = args.global_batch_size * args.seq_length * self.window / elapsed
        print0(f" iteration {iteration:6d}/{args.train_iters} | lm loss {self.loss / self.window:.5f}{aux_text} | "
               f"lr {run.scheduler.get_lr(run.optimizer.param_groups[0]):.2e} | grad norm {float(grad_norm or 0):.3f} | "
               f"{elapsed * 1000 / self.window:.0f} ms/it | {tokens:.0f} tokens/s{moe}")
        self.reset()


def nonfinite_routing(run: Run, iteration: int) -> bool:
    """--moe-plugin-nonfinite: before the optimizer step, whether any plugin MoE layer's router produced NaN/inf
    this iteration on any rank; raise (naming layer, iteration and rank) or tell the loop to skip the update."""
    cfg = getattr(run.args, "moe_plugin_config", None)
    if cfg is None or cfg.nonfinite == "off":
        return False
    from ..stats import NonFiniteRoutingError, check_nonfinite
    from .layer import plugin_stats

    problem = check_nonfinite([plugin_stats()], iteration, dist.group.WORLD)
    if problem and cfg.nonfinite == "raise":
        raise NonFiniteRoutingError(f"{problem} (--moe-plugin-nonfinite skip drops such iterations)")
    if problem:
        print0(f" iteration {iteration:6d}: update skipped (--moe-plugin-nonfinite skip): {problem}")
    return bool(problem)


def train(run: Run, start: int) -> None:
    from .data import batches

    args = run.args
    if run.hooks is not None:
        run.hooks.start_iteration(start + 1)        # routing traces label forwards with their iteration
    train_ds, valid_ds, _ = run.datasets(args.train_iters)
    train_iter = batches(train_ds, start, run.n_micro, args.micro_batch_size, run.dp_rank, run.dp,
                         epoch_samples=args.epoch_samples)
    writer = None
    if args.tensorboard_dir and dist.get_rank() == dist.get_world_size() - 1:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(args.tensorboard_dir)
    run.describe()
    log = ProgressLog(run, writer)
    iteration, saved_at = start, None
    while iteration < args.train_iters:
        run.model.zero_grad_buffer()
        run.optimizer.zero_grad()
        loss = run_schedule(args, run.model, train_iter, run.n_micro, forward_only=False)
        if nonfinite_routing(run, iteration + 1):           # --moe-plugin-nonfinite skip: no update this iteration
            iteration += 1
            continue
        ok, grad_norm, _ = run.optimizer.step()
        iteration += 1
        if ok:
            run.scheduler.step(increment=1)
            if run.hooks is not None:
                run.hooks.after_step(run.model, run.optimizer, iteration, last_step=args.train_iters)
        log.step(iteration, loss, grad_norm)
        if args.eval_interval and iteration % args.eval_interval == 0:
            run.evaluate(valid_ds, iteration)
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save_checkpoint(args, iteration, run.model, run.optimizer, run.scheduler)
            saved_at = iteration
        if args.exit_interval and iteration % args.exit_interval == 0 and iteration < args.train_iters:
            if args.save and saved_at != iteration:          # as Megatron-LM: an exit is also a checkpoint
                save_checkpoint(args, iteration, run.model, run.optimizer, run.scheduler)
            print0(f" exiting at iteration {iteration} (--exit-interval)")
            return
    run.evaluate(valid_ds, iteration)
    if args.save and saved_at != iteration:
        save_checkpoint(args, iteration, run.model, run.optimizer, run.scheduler)


def main(argv=None):
    try:
        args = parse_args(argv)
    except ValueError as err:          # ConfigError included
        build_parser().error(str(err))
    initialize(args)
    from .checkpointing import CheckpointError

    try:
        run = Run(args)
        try:
            start = load_checkpoint(args, run.model, run.optimizer, run.scheduler) if args.load else 0
        except CheckpointError as err:
            # every rank that fails says so: a rank's own shard can fail where rank 0's loads
            who = f"rank {dist.get_rank()}: " if dist.get_world_size() > 1 else ""
            print(f"error: {who}{err}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        if args.skip_train:
            evaluate_checkpoint(run, start)
        else:
            train(run, start)
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
