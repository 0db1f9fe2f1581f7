"""Hooks into Megatron-LM's training loop (``megatron.training``, as ``pretrain_gpt.py`` runs it).

``install_megatron_lm_hooks()`` (idempotent; call it before ``pretrain()``) patches, inside this process only:

1. without CUDA: ``cpu_compat.install_cpu_shims()`` (megatron-core) plus a few ``megatron.training`` adjustments
   (``initialize`` sees one CPU "device" so model parallelism and the model-parallel RNG tracker are set up;
   ``Tensor.cuda()`` / ``Module.cuda()`` stay on the CPU; the legacy fused CUDA kernels are not built), so
   ``pretrain_gpt.py`` runs on CPU with ``--distributed-backend gloo`` (patches/README.md lists the flags). Any
   torch: without triton, ``batch_invariant_kernels`` (imported unconditionally by ``initialize``) is a stub that
   refuses ``--batch-invariant-mode``; a checkout without a built dataset helper (``helpers_cpp``, whose ``make``
   needs pybind11) uses an installed megatron-core's build of the same ``helpers.cpp`` when there is one;
2. ``megatron.training.initialize.parse_args``: the plugin's flags are added whatever ``extra_args_provider``
   ``pretrain()`` was given (composed after it; not added twice when that provider already added them, as the
   ``pretrain_gpt.py`` patch does with ``moe_plugin_extra_args``);
3. ``megatron.training.initialize.validate_args``: Megatron's validation, then ``validate_moe_plugin_args`` (bad
   combinations fail at argument validation, before torch.distributed or any model: ``error: <message naming the
   flag>`` on rank 0's stderr and exit status 2, like argparse; ``args.moe_plugin_config`` is set);
4. ``megatron.training.training.train_step`` (called by ``train()`` through the module global): after a step whose
   update was not skipped, ``PluginStepHooks.after_step(model, optimizer, iteration)`` runs on every rank with
   ``iteration`` = optimizer steps done (``train()`` passes the 0-based ``iteration``/``args.curr_iteration`` and
   increments it after the step, so this is the value ``training_log`` reports); every ``--log-interval``
   iterations the per-layer MoE metrics are reduced over all ranks (a collective: every rank calls it), written
   to Megatron's tensorboard / wandb writers and summarised in one line on rank 0.
5. ``megatron.training.training.load_checkpoint``: a distributed-optimizer checkpoint whose flat per-rank buffers
   were written by the other kind of MoE layer (native vs plugin) is refused with what to do instead
   (``_wrap_load_checkpoint``; weights interchange in every format).

The layer spec is substituted by ``spec.moe_plugin_gpt_builder`` around ``gpt_builders.gpt_builder``: the
``pretrain_gpt.py`` patch passes the wrapped builder to ``model_provider``; the launcher
(``python -m megamoe_plugin.megatron_adapter.launch``) calls ``wrap_gpt_builders()`` before the script imports it.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import types
from typing import Callable, List, Optional

import torch

from ..config import ConfigError
from .args import moe_plugin_extra_args

__all__ = ["install_megatron_lm_hooks", "moe_plugin_extra_args", "moe_plugin_gpt_builder", "moe_plugin_model_config",
           "wrap_gpt_builders",
           "megatron_lm_hooks_installed", "applied_hooks"]

_INSTALLED = False
_APPLIED: List[str] = []


# ---------------------------------------------------------------------------------------------------------------
# 2 + 3: arguments
# ---------------------------------------------------------------------------------------------------------------

def _has_plugin_flags(parser) -> bool:
    return "--moe-plugin" in getattr(parser, "_option_string_actions", {})


def _composed_provider(other: Optional[Callable]) -> Callable:
    """``other``'s flags, then ours unless ``other`` already added them."""
    from .args import add_moe_plugin_args

    def provider(parser):
        if other is not None:
            parser = other(parser) or parser
        if not _has_plugin_flags(parser):
            parser = add_moe_plugin_args(parser)
        return parser

    provider._megamoe_provider = True
    return provider


def _wrap_parse_args(parse_args: Callable) -> Callable:
    if getattr(parse_args, "_megamoe_wrapped", False):
        return parse_args

    @functools.wraps(parse_args)
    def wrapped(extra_args_provider=None, ignore_unknown_args=False, *a, **kw):
        if not getattr(extra_args_provider, "_megamoe_provider", False):
            extra_args_provider = _composed_provider(extra_args_provider)
        return parse_args(extra_args_provider, ignore_unknown_args, *a, **kw)

    wrapped._megamoe_wrapped = True
    return wrapped


def _wrap_validate_args(validate_args: Callable) -> Callable:
    if getattr(validate_args, "_megamoe_wrapped", False):
        return validate_args

    @functools.wraps(validate_args)
    def wrapped(args, *a, **kw):
        out = validate_args(args, *a, **kw)
        from .args import exit_with_error, validate_moe_plugin_args
        try:
            if not torch.cuda.is_available() and getattr(args, "distributed_backend", "gloo") == "nccl":
                raise ConfigError("--distributed-backend=nccl: this torch has no CUDA; use --distributed-backend "
                                  "gloo (the megamoe-plugin CPU shims are installed)")
            cfg = validate_moe_plugin_args(args)
            if cfg is not None and (cfg.expert_cache_size or cfg.placement_file):
                raise ConfigError("megamoe-plugin: --moe-plugin-expert-cache-size / --moe-plugin-placement-file in "
                                  "pretrain_gpt.py: it has no inference path that applies them; evaluate the "
                                  "checkpoint with examples/megatron/pretrain_moe_gpt.py --skip-train")
            if cfg is not None and cfg.nonfinite == "skip":
                raise ConfigError("megamoe-plugin: --moe-plugin-nonfinite skip in pretrain_gpt.py: its train_step "
                                  "updates before the plugin can look; use raise (the default: stop naming the "
                                  "layer), or the megatron-core example trainer, which skips such iterations")
            if cfg is not None and cfg.local_gates and int(os.environ.get("RANK", "0")) == 0:
                print(f"megamoe-plugin: warning: --moe-plugin-gate-sync={cfg.gate_sync} in pretrain_gpt.py: Megatron-LM's "
                      "checkpoint keeps one replica of each gate (rank 0's); a resumed run starts every rank from it "
                      "(the megatron-core trainer saves every rank's)", file=sys.stderr, flush=True)
            if cfg is not None and cfg.per_rank_gate_state and not cfg.local_gates \
                    and int(os.environ.get("RANK", "0")) == 0:
                print("megamoe-plugin: warning: --moe-plugin-gate ta_moe with --moe-router-enable-expert-bias in "
                      "pretrain_gpt.py: Megatron-LM's checkpoint keeps no per-rank state, so each rank's sender "
                      "bias restarts from 0 after a resume and is re-learned (the megatron-core trainer saves "
                      "it)", file=sys.stderr, flush=True)
            if cfg is not None and cfg.assignment_cache:
                raise ConfigError("megamoe-plugin: --moe-plugin-assignment-cache in pretrain_gpt.py: Megatron-LM's "
                                  "GPT batches carry no sample index to key the cache by (its multi-epoch "
                                  "GPTDataset also re-cuts samples every epoch); use the megatron-core example "
                                  "trainer (examples/megatron/pretrain_moe_gpt.py) or fairseq for it")
        except ConfigError as e:
            # Like argparse: one line on stderr (rank 0), exit status 2, before any model is built.
            exit_with_error(str(e), 2)
        return out

    wrapped._megamoe_wrapped = True
    return wrapped


# ---------------------------------------------------------------------------------------------------------------
# 4: after every optimizer step
# ---------------------------------------------------------------------------------------------------------------

def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _moe_layer_count(args) -> int:
    """Layer numbers the plugin's layers can have: the decoder's, then the multi-token-prediction block's."""
    return args.num_layers + (getattr(args, "mtp_num_layers", None) or 0)


def after_train_step(args, model, optimizer, iteration: int) -> None:
    """What runs on every rank after a successful ``train_step``; ``iteration`` = optimizer steps done."""
    from .hooks import get_step_hooks
    cfg = args.moe_plugin_config
    if cfg.nonfinite != "off":            # after the update here (train_step is Megatron's): stop, naming the layer
        from ..stats import NonFiniteRoutingError, check_nonfinite
        from .layer import plugin_stats
        problem = check_nonfinite([plugin_stats()], iteration, torch.distributed.group.WORLD)
        if problem:
            raise NonFiniteRoutingError(problem)
    hooks = get_step_hooks(cfg, _moe_layer_count(args))
    hooks.after_step(model, optimizer, iteration=iteration, last_step=getattr(args, "train_iters", None))
    log_interval = getattr(args, "log_interval", 0) or 0
    if log_interval > 0 and iteration % log_interval == 0:
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer
        from .metrics import format_dynamic_metrics, format_layer_metrics, format_placement_metrics
        metrics = hooks.log_metrics(iteration, get_tensorboard_writer(), get_wandb_writer())
        extra = [t for t in (format_placement_metrics(hooks.placement_metrics()),
                             format_dynamic_metrics(hooks.dynamic_metrics())) if t]
        if _rank() == 0 and metrics:
            print(f"[megamoe-plugin] iteration {iteration:8d} | {format_layer_metrics(metrics)}"
                  f"{''.join(' | ' + t for t in extra)}", flush=True)


def _wrap_train_step(train_step: Callable) -> Callable:
    if getattr(train_step, "_megamoe_wrapped", False):
        return train_step
    sig = inspect.signature(train_step)

    @functools.wraps(train_step)
    def wrapped(*a, **kw):
        out = train_step(*a, **kw)
        from megatron.training.global_vars import get_args
        args = get_args()
        if not getattr(args, "moe_plugin", False) or getattr(args, "moe_plugin_config", None) is None:
            return out
        # (loss_dict, skipped_iter, should_checkpoint, should_exit, exit_code, grad_norm, ...) in 0.16;
        # should_exit returns with skipped_iter=True: no optimizer step happened.
        skipped = bool(out[1]) if isinstance(out, tuple) and len(out) > 1 else False
        should_exit = bool(out[3]) if isinstance(out, tuple) and len(out) > 3 else False
        if skipped or should_exit:
            return out
        bound = sig.bind_partial(*a, **kw).arguments
        step0 = bound.get("iteration")
        if step0 is None:
            step0 = getattr(args, "curr_iteration", 0)
        after_train_step(args, bound["model"], bound["optimizer"], int(step0) + 1)
        return out

    wrapped._megamoe_wrapped = True
    return wrapped


def _plugin_cfg():
    from megatron.training.global_vars import get_args
    args = get_args()
    return getattr(args, "moe_plugin_config", None) if getattr(args, "moe_plugin", False) else None


def _wrap_finalize(finalize: Callable) -> Callable:
    """``finalize_model_grads`` keeping each rank's own gate gradients with --moe-plugin-gate-sync local /
    average:K (gate_sync.keep_local_gate_grads), then moving the per-sender biases of TA-MoE by bias
    (gate_sync.with_sender_bias_update); decided when it runs (the args exist by then)."""
    if getattr(finalize, "_megamoe_wrapped", False):
        return finalize
    from .gate_sync import keep_local_gate_grads, with_sender_bias_update
    local = with_sender_bias_update(keep_local_gate_grads(finalize))
    plain = with_sender_bias_update(finalize)

    @functools.wraps(finalize)
    def wrapped(*a, **kw):
        cfg = _plugin_cfg()
        if cfg is None:
            return finalize(*a, **kw)
        return (local if cfg.local_gates else plain)(*a, **kw)

    wrapped._megamoe_wrapped = True
    return wrapped


def _wrap_setup(setup: Callable) -> Callable:
    """``setup_model_and_optimizer``, then (with local gates) the optimizer's clipping norm made identical on every
    rank before the first step (gate_sync.identical_clip_norm)."""
    if getattr(setup, "_megamoe_wrapped", False):
        return setup

    @functools.wraps(setup)
    def wrapped(*a, **kw):
        out = setup(*a, **kw)
        cfg = _plugin_cfg()
        if cfg is not None:
            from .hooks import get_step_hooks
            from megatron.training.global_vars import get_args
            get_step_hooks(cfg, _moe_layer_count(get_args())).attach_gate_sync(out[0], out[1])
        return out

    wrapped._megamoe_wrapped = True
    return wrapped


def _wrap_load_checkpoint(load: Callable) -> Callable:
    """Megatron-LM's ``load_checkpoint``, refusing the one load that would go wrong without a word: a distributed-
    optimizer checkpoint in a per-rank flat-buffer format (``dp_reshardable``, ``dp_zero_gather_scatter``) written
    by a run whose MoE layers are of the other kind (native megatron-core vs ``--moe-plugin``). Those buffers hold
    the optimizer state in the writing run's parameter order, which the other layers do not share, so it would load
    into the wrong parameters. Model weights interchange in every format (the plugin saves megatron-core's keys)."""
    if getattr(load, "_megamoe_wrapped", False):
        return load

    @functools.wraps(load)
    def wrapped(*a, **kw):
        _check_optimizer_interchange(kw.get("load_arg", "load"))
        return load(*a, **kw)

    wrapped._megamoe_wrapped = True
    return wrapped


def _check_optimizer_interchange(load_arg: str) -> None:
    from megatron.training.global_vars import get_args
    args = get_args()
    load_dir = getattr(args, load_arg, None)
    if (not load_dir or not getattr(args, "use_distributed_optimizer", False) or getattr(args, "no_load_optim", False)
            or getattr(args, "finetune", False) or not getattr(args, "num_experts", None)):
        return
    try:
        from megatron.core import dist_checkpointing
        from megatron.training import checkpointing as ck
        iteration, release = ck.read_metadata(ck.get_checkpoint_tracker_filename(load_dir))
        ckpt_dir = ck.get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
        saved_args = dist_checkpointing.load_common_state_dict(ckpt_dir).get("args")
        kind = (dist_checkpointing.load_content_metadata(ckpt_dir) or {}).get("distrib_optim_sharding_type")
    except Exception:          # not a distributed checkpoint, or nothing there yet: Megatron-LM reports it
        return
    if saved_args is None or kind in ("fully_reshardable", "fully_sharded_model_space", "fsdp_dtensor"):
        return
    written, running = bool(getattr(saved_args, "moe_plugin", False)), bool(getattr(args, "moe_plugin", False))
    if written != running:
        label = {True: "a --moe-plugin run", False: "a native megatron-core run"}
        raise RuntimeError(
            f"megamoe-plugin: {load_dir} was written by {label[written]} and this is {label[running]}: its "
            f"distributed-optimizer state ({kind or 'dp_zero_gather_scatter'}) is stored as flat per-rank buffers in "
            "the writing run's parameter order, which these MoE layers do not share, so it would load into the wrong "
            "parameters. Load the weights with --no-load-optim, or save the checkpoint with "
            "--dist-ckpt-optim-fully-reshardable (then weights and optimizer state both interchange)")


# ---------------------------------------------------------------------------------------------------------------
# the layer spec
# ---------------------------------------------------------------------------------------------------------------

def moe_plugin_gpt_builder(builder: Callable) -> Callable:
    """``spec.moe_plugin_gpt_builder`` (imported on use: it pulls in megatron-core): wrap Megatron-LM's
    ``gpt_builder`` so that with ``--moe-plugin`` the layer spec given to ``GPTModel`` has the plugin's MoE layers."""
    from .spec import moe_plugin_gpt_builder as wrap
    return wrap(builder)


def moe_plugin_model_config(args, model_cfg):
    """``spec.moe_plugin_model_config`` (imported on use): with ``--moe-plugin`` the ``GPTModelConfig`` from
    ``gpt_config_from_args`` builds the plugin's MoE layers (Megatron-LM core_v0.19's ``pretrain_gpt.py``)."""
    from .spec import moe_plugin_model_config as wrap
    return wrap(args, model_cfg)


def wrap_gpt_builders(module=None) -> List[str]:
    """Put the plugin's spec substitution where an unmodified ``pretrain_gpt.py`` will pick it up, whichever way this
    Megatron-LM builds its model (both when both exist): ``gpt_builders.gpt_builder`` (Megatron-LM's root module,
    core_v0.16's ``model_provider`` path) and ``megatron.training.argument_utils.gpt_config_from_args`` (core_v0.19's
    ``GPTModelConfig`` path). The script's later ``from ... import`` gets the wrapped functions. Returns what was
    wrapped."""
    from .compat import has_module
    from .spec import moe_plugin_config_builder, moe_plugin_gpt_builder
    wrapped = []
    if module is None and has_module("gpt_builders"):
        module = importlib.import_module("gpt_builders")
    if module is not None and hasattr(module, "gpt_builder"):
        module.gpt_builder = moe_plugin_gpt_builder(module.gpt_builder)
        wrapped.append("gpt_builders.gpt_builder")
    if has_module("megatron.training.argument_utils"):
        argument_utils = importlib.import_module("megatron.training.argument_utils")
        if hasattr(argument_utils, "gpt_config_from_args"):
            argument_utils.gpt_config_from_args = moe_plugin_config_builder(argument_utils.gpt_config_from_args)
            wrapped.append("argument_utils.gpt_config_from_args")
    if not wrapped:
        raise ImportError("megamoe-plugin: this Megatron-LM has neither gpt_builders.gpt_builder nor "
                          "megatron.training.argument_utils.gpt_config_from_args: no place to put the plugin's "
                          "MoE layers (run `megamoe doctor` to see what is installed)")
    return wrapped


# ---------------------------------------------------------------------------------------------------------------
# 1: megatron.training on CPU (besides cpu_compat's megatron-core shims)
# ---------------------------------------------------------------------------------------------------------------

def _initialize_torch():
    """The torch stand-in for ``megatron.training.initialize`` only: there CUDA's presence decides whether model
    parallelism and the model-parallel RNG tracker are set up at all (``device_count() > 0``) and
    ``initialize_megatron`` asserts ``torch.cuda.is_available()``; on CPU the stand-in says one device."""
    from . import cpu_compat
    base = cpu_compat._cpu_torch()
    mod = types.ModuleType("torch", base.__doc__)
    mod.__dict__.update(base.__dict__)
    cuda = types.ModuleType("torch.cuda", base.cuda.__doc__)
    cuda.__dict__.update(base.cuda.__dict__)
    cuda.is_available = lambda: True
    cuda.device_count = lambda: 1
    mod.cuda = cuda
    return mod


_BIK = "megatron.core.transformer.custom_layers.batch_invariant_kernels"


def _stub_batch_invariant_kernels() -> None:
    """``megatron.training.initialize`` imports ``enable_batch_invariant_mode`` from a module that imports triton
    at the top; a CPU-only torch has no triton. Without triton that module is replaced by a stub whose
    ``enable``/``set`` refuse (``--batch-invariant-mode`` needs triton) and whose queries say "off"."""
    if _BIK in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    stub = types.ModuleType(_BIK, "stand-in for batch_invariant_kernels without triton (megamoe_plugin)")

    def enable_batch_invariant_mode(*a, **kw):
        raise RuntimeError("--batch-invariant-mode needs triton, which is not installed")

    def set_batch_invariant_mode(enabled: bool = True, *a, **kw):
        if enabled:
            enable_batch_invariant_mode()
        return contextlib.nullcontext()

    stub.enable_batch_invariant_mode = enable_batch_invariant_mode
    stub.set_batch_invariant_mode = set_batch_invariant_mode
    stub.disable_batch_invariant_mode = lambda *a, **kw: None
    stub.is_batch_invariant_mode_enabled = lambda *a, **kw: False
    stub.__all__ = ["set_batch_invariant_mode", "is_batch_invariant_mode_enabled", "disable_batch_invariant_mode",
                    "enable_batch_invariant_mode"]
    sys.modules[_BIK] = stub
    _APPLIED.append("batch_invariant_kernels stub (no triton)")


def _shim_training_on_cpu() -> None:
    init = importlib.import_module("megatron.training.initialize")
    if getattr(init.torch, "_megamoe_initialize_torch", False):
        return
    t = _initialize_torch()
    t._megamoe_initialize_torch = True
    init.torch = t
    _APPLIED.append("megatron.training.initialize: one CPU 'device'")
    # `.cuda()` method calls (get_model's `model_module.cuda(torch.cuda.current_device())`, the batch's
    # `data["tokens"].cuda(non_blocking=True)`, loss buffers, ...) are out of the torch stand-in's reach. A torch
    # without CUDA can never honour them, so in this process they keep the tensor / module on the CPU.
    if not getattr(torch.Tensor.cuda, "_megamoe_wrapped", False):
        def tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
            return self
        tensor_cuda._megamoe_wrapped = True
        torch.Tensor.cuda = tensor_cuda

        def module_cuda(self, device=None):
            return self
        module_cuda._megamoe_wrapped = True
        torch.nn.Module.cuda = module_cuda
        _APPLIED.append("Tensor.cuda / Module.cuda -> stay on the CPU (torch without CUDA)")
    # validate_args asks the GPU's architecture whenever TP or CP > 1 (get_device_arch_version() reads
    # torch.cuda.get_device_properties("cuda:0")), to decide whether CUDA_DEVICE_MAX_CONNECTIONS=1 is required for
    # overlapping TP communication with GEMMs. Without CUDA there is no architecture (0) and no CUDA connection:
    # the variable is set to the value Megatron asks for, which nothing on the CPU reads.
    utils = importlib.import_module("megatron.training.utils")
    arguments = importlib.import_module("megatron.training.arguments")
    if not getattr(utils.get_device_arch_version, "_megamoe_wrapped", False):
        def get_device_arch_version():
            return 0
        get_device_arch_version._megamoe_wrapped = True
        for mod in (utils, arguments):
            if hasattr(mod, "get_device_arch_version"):
                mod.get_device_arch_version = get_device_arch_version
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        _APPLIED.append("get_device_arch_version -> 0 (no GPU), CUDA_DEVICE_MAX_CONNECTIONS=1")
    # The legacy fused kernels (CUDA softmax; unused by --transformer-impl local on CPU) are built with nvcc.
    # (megatron.legacy is gone from core_v0.19 on: nothing to stub there)
    from .compat import has_module
    fk = importlib.import_module("megatron.legacy.fused_kernels") if has_module("megatron.legacy.fused_kernels") \
        else None
    if fk is not None and not getattr(fk.load, "_megamoe_wrapped", False):
        def load(args):
            return None
        load._megamoe_wrapped = True
        fk.load = load
        _APPLIED.append("megatron.legacy.fused_kernels.load: nothing to build without CUDA")


def _dataset_helpers_fallback() -> None:
    """``megatron.core.datasets.helpers_cpp`` is a C++ extension Megatron-LM builds at start-up (rank 0 runs
    ``make``, which needs pybind11). When the checkout has no build and an installed megatron-core wheel of this
    interpreter carries one built from the same helpers.cpp, load that instead and skip the make."""
    name = "megatron.core.datasets.helpers_cpp"
    try:
        importlib.import_module(name)
        return
    except ImportError:
        pass
    import megatron.core.datasets as ds
    here = [os.path.realpath(p) for p in ds.__path__]

    def source(d):
        try:
            with open(os.path.join(d, "helpers.cpp"), "rb") as f:
                return f.read()
        except OSError:
            return None

    ours = source(here[0])
    for entry in sys.path:
        d = os.path.join(entry or ".", "megatron", "core", "datasets")
        if os.path.realpath(d) in here or not os.path.isdir(d) or ours is None or source(d) != ours:
            continue
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            so = os.path.join(d, "helpers_cpp" + suffix)
            if os.path.isfile(so):
                spec = importlib.util.spec_from_file_location(name, so)
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
                sys.modules[name] = mod
                ds.helpers_cpp = mod
                utils = importlib.import_module("megatron.core.datasets.utils")
                original = utils.compile_helpers

                @functools.wraps(original)
                def compile_helpers():
                    if name in sys.modules:
                        return
                    original()

                utils.compile_helpers = compile_helpers
                _APPLIED.append(f"dataset helpers from {so}")
                return


# ---------------------------------------------------------------------------------------------------------------

def install_megatron_lm_hooks() -> List[str]:
    """Install the hooks described in the module docstring (idempotent). Needs ``megatron.training`` importable
    (a Megatron-LM checkout on ``sys.path``). Returns the labels of what was patched."""
    global _INSTALLED
    if _INSTALLED:
        return list(_APPLIED)
    if not torch.cuda.is_available():
        from ..cpu_alloc import retain_freed_memory
        from .cpu_compat import install_cpu_shims
        install_cpu_shims()
        _APPLIED.append("cpu_compat shims")
        if retain_freed_memory():     # reuse large activation/gradient blocks instead of page-faulting them
            _APPLIED.append("glibc keeps freed large blocks (cpu_alloc)")
    _stub_batch_invariant_kernels()
    init = importlib.import_module("megatron.training.initialize")
    arguments = importlib.import_module("megatron.training.arguments")
    training = importlib.import_module("megatron.training.training")
    if not torch.cuda.is_available():
        _shim_training_on_cpu()
        from .cpu_compat import install_cpu_shims
        install_cpu_shims()   # re-patch megatron.training modules imported just now
    _dataset_helpers_fallback()
    # Megatron-LM saves its args in every checkpoint, args.moe_plugin_config included; resuming loads them with
    # torch.load(weights_only=True), which refuses classes not registered as safe
    from ..config import MoEConfig
    torch.serialization.add_safe_globals([MoEConfig])
    _APPLIED.append("MoEConfig safe for torch.load")
    # arguments.py defines both; initialize.py imported them too up to core_v0.16 (0.19 parses in pretrain_gpt.py)
    for mod in (init, arguments):
        if hasattr(mod, "parse_args"):
            mod.parse_args = _wrap_parse_args(mod.parse_args)
        if hasattr(mod, "validate_args"):
            mod.validate_args = _wrap_validate_args(mod.validate_args)
    _APPLIED.append("parse_args + validate_args")
    training.train_step = _wrap_train_step(training.train_step)
    _APPLIED.append("train_step")
    training.finalize_model_grads = _wrap_finalize(training.finalize_model_grads)
    training.setup_model_and_optimizer = _wrap_setup(training.setup_model_and_optimizer)
    _APPLIED.append("finalize_model_grads + setup_model_and_optimizer (--moe-plugin-gate-sync)")
    if hasattr(training, "load_checkpoint"):
        training.load_checkpoint = _wrap_load_checkpoint(training.load_checkpoint)
        _APPLIED.append("load_checkpoint: refuses optimizer state in another layer kind's flat-buffer format")
    _INSTALLED = True
    return list(_APPLIED)


def megatron_lm_hooks_installed() -> bool:
    return _INSTALLED


def applied_hooks() -> List[str]:
    """Labels of what install_megatron_lm_hooks() patched."""
    return list(_APPLIED)
