"""Runtime shims that let megatron-core run on a CPU-only torch build.

megatron-core (checked against 0.16.1; the 0.19 names are guarded with ``hasattr``)
assumes CUDA in a handful of places, lettered (a)-(h) below and in the code: the RNG tracker,
``torch.cuda`` used as a device, causal masks, the dispatcher's stream, ``te_general_gemm``, split sizes, layer norms
under sequence parallelism, and the optimizers' CUDA tensors (the distributed optimizer's parameter types included).  ``install_cpu_shims()`` patches them *at runtime, inside this process*;
nothing in site-packages is edited.  It is idempotent and does nothing when
``torch.cuda.is_available()``.

Two mechanisms are used:

1. **A CPU stand-in for ``torch`` in megatron modules.**  megatron code spells CUDA as
   ``torch.cuda.current_device()``, ``torch.cuda.Stream()``, ``torch.zeros(...,
   device="cuda")``, ``torch.cuda.FloatTensor`` ... .  Every such lookup goes through
   the module global ``torch``, so for each loaded ``megatron.*`` module whose source
   mentions ``cuda`` we rebind that global to a copy of the ``torch`` module in which
   ``torch.cuda`` is a CPU stand-in (current_device -> cpu, Stream/Event/stream() are
   no-ops, RNG calls use the CPU generator, FloatTensor -> CPU FloatTensor, memory
   statistics are 0) and the tensor factories map ``device="cuda"`` to cpu.  The real
   ``torch`` module, and every non-megatron module, is left untouched.  An import hook
   does the same for ``megatron.*`` modules imported later (e.g. ``megatron.training``
   when ``pretrain_gpt.py`` runs); ``patch_module(mod)`` does it for a module outside
   the ``megatron`` package (e.g. ``pretrain_gpt``'s ``__main__``).

2. **Replacing specific megatron functions** where the CUDA assumption is not a
   ``torch.<attr>`` lookup (``from torch.cuda import _lazy_call``, hard-coded logic,
   names that are undefined without Transformer Engine).  A replaced function is also
   rebound in every loaded megatron module that imported it by name.

``tensor.cuda()`` / ``module.cuda()`` keep things on the CPU (only on a torch build without CUDA, where they could
never succeed). Not covered: ``tensor.to("cuda")``, CUDA graphs,
``torch.autocast("cuda")``, anything needing NCCL.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.abc
import sys
import time
import types
from typing import Callable, List, Optional

import torch

__all__ = [
    "install_cpu_shims",
    "cpu_shims_installed",
    "applied_shims",
    "patch_module",
]

_REAL_TORCH = torch
_CPU = torch.device("cpu")

_INSTALLED = False
_APPLIED: List[str] = []
# (original, replacement) pairs: rebound wherever a megatron module holds `original`.
_REPLACEMENTS: List[tuple] = []
_CPU_TORCH: Optional[types.ModuleType] = None
_IMPORT_HOOK = None


# ---------------------------------------------------------------------------
# Mechanism 1: a CPU stand-in for `torch` / `torch.cuda` inside megatron modules
# ---------------------------------------------------------------------------


def _cpu_if_cuda(device):
    """Map a CUDA device spec (``"cuda"``, ``"cuda:1"``, ``torch.device("cuda")``, an int
    index) to the CPU device; leave anything else unchanged."""
    if device is None:
        return None
    if isinstance(device, torch.device):
        return _CPU if device.type == "cuda" else device
    if isinstance(device, str):
        return _CPU if device.split(":", 1)[0] == "cuda" else device
    if isinstance(device, int) and not isinstance(device, bool):
        return _CPU  # a bare index means a CUDA device to torch
    return device


class _CpuEvent:
    """Stand-in for ``torch.cuda.Event``: CPU work is synchronous, so record() just
    stamps the wall clock (elapsed_time() keeps megatron's timers meaningful)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess=False):
        self._t = None

    def record(self, stream=None):
        self._t = time.perf_counter()

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def elapsed_time(self, end_event) -> float:
        if self._t is None or end_event._t is None:
            raise RuntimeError("event was not recorded")
        return (end_event._t - self._t) * 1000.0


class _CpuStream:
    """Stand-in for ``torch.cuda.Stream``/``ExternalStream``: every operation is a no-op
    because CPU kernels run synchronously on the calling thread."""

    device = _CPU
    cuda_stream = 0
    priority = 0

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        event = event if event is not None else _CpuEvent()
        event.record(self)
        return event

    def synchronize(self):
        pass

    def query(self):
        return True


_CPU_DEFAULT_STREAM = _CpuStream()


def _noop(*args, **kwargs):
    return None


def _zero(*args, **kwargs):
    return 0


def _cpu_manual_seed(seed):
    torch.default_generator.manual_seed(int(seed))


def _cpu_get_rng_state_any(device="cuda"):
    return torch.get_rng_state()


def _cpu_set_rng_state_any(new_state, device="cuda"):
    torch.set_rng_state(new_state)


def _make_cpu_cuda_module() -> types.ModuleType:
    """A copy of ``torch.cuda`` whose CUDA-only entry points act on the CPU."""
    real = torch.cuda
    mod = types.ModuleType("torch.cuda", "CPU stand-in for torch.cuda (megamoe_plugin)")
    mod.__dict__.update(real.__dict__)
    mod.__dict__["__getattr__"] = lambda name: getattr(real, name)

    # (b) torch.cuda.current_device() is used as `device=` all over megatron.
    mod.current_device = lambda: _CPU
    mod.set_device = _noop
    mod.synchronize = _noop
    # (d) streams / events: CPU execution is synchronous.
    mod.Stream = _CpuStream
    mod.ExternalStream = _CpuStream
    mod.Event = _CpuEvent
    mod.current_stream = lambda device=None: _CPU_DEFAULT_STREAM
    mod.default_stream = lambda device=None: _CPU_DEFAULT_STREAM
    mod.set_stream = _noop
    mod.stream = lambda stream=None: contextlib.nullcontext()
    # (a) the "CUDA" RNG is the CPU generator.
    mod.get_rng_state = _cpu_get_rng_state_any
    mod.set_rng_state = _cpu_set_rng_state_any
    mod.manual_seed = _cpu_manual_seed
    mod.manual_seed_all = _cpu_manual_seed
    mod.default_generators = (torch.default_generator,)
    rnd = types.ModuleType("torch.cuda.random", "CPU stand-in for torch.cuda.random")
    rnd.get_rng_state = _cpu_get_rng_state_any
    rnd.set_rng_state = _cpu_set_rng_state_any
    rnd.manual_seed = _cpu_manual_seed
    rnd.manual_seed_all = _cpu_manual_seed
    mod.random = rnd
    # Memory statistics and cache control.
    for name in (
        "memory_allocated",
        "max_memory_allocated",
        "memory_reserved",
        "max_memory_reserved",
    ):
        setattr(mod, name, _zero)
    mod.memory_stats = lambda device=None: {}
    for name in ("empty_cache", "reset_peak_memory_stats", "reset_max_memory_allocated"):
        setattr(mod, name, _noop)
    # nvtx ranges (only used when megatron's nvtx tracing is switched on).
    nvtx = types.ModuleType("torch.cuda.nvtx", "no-op nvtx on CPU")
    nvtx.range_push = _zero
    nvtx.range_pop = _zero
    nvtx.range_start = _zero
    nvtx.range_end = _noop
    nvtx.mark = _noop
    nvtx.range = lambda *a, **k: contextlib.nullcontext()
    mod.nvtx = nvtx
    # (h) `isinstance(grad, torch.cuda.FloatTensor)` asserts in the optimizer code.
    for name in (
        "FloatTensor",
        "DoubleTensor",
        "HalfTensor",
        "BFloat16Tensor",
        "ByteTensor",
        "CharTensor",
        "ShortTensor",
        "IntTensor",
        "LongTensor",
        "BoolTensor",
    ):
        if hasattr(torch, name):
            setattr(mod, name, getattr(torch, name))
    return mod


_FACTORIES = (
    "tensor",
    "as_tensor",
    "scalar_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "linspace",
    "logspace",
    "eye",
    "rand",
    "randn",
    "randint",
    "randperm",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "rand_like",
    "randn_like",
    "empty_strided",
    "tril_indices",
    "triu_indices",
)


def _device_remapping(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        return fn(*args, **kwargs)

    return wrapper


class _CpuDeviceMeta(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, _REAL_TORCH.device)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, _REAL_TORCH.device)

    def __call__(cls, *args, **kwargs):
        dev = _REAL_TORCH.device(*args, **kwargs)
        return _CPU if dev.type == "cuda" else dev


class _CpuDevice(metaclass=_CpuDeviceMeta):
    """``torch.device`` inside megatron modules: ``torch.device("cuda")`` -> cpu;
    ``isinstance(x, torch.device)`` keeps working."""


def _make_cpu_torch_module() -> types.ModuleType:
    """A copy of the ``torch`` module namespace with ``cuda`` replaced by the CPU
    stand-in and the tensor factories mapping ``device="cuda"`` to cpu.  A real module
    object with a full ``__dict__`` (not a ``__getattr__`` proxy), so TorchDynamo can
    still trace functions that reference it."""
    mod = types.ModuleType("torch", "CPU stand-in for torch inside megatron (megamoe_plugin)")
    mod.__dict__.update(torch.__dict__)
    # Attributes added to torch later (lazy submodules) are still found.
    mod.__dict__["__getattr__"] = lambda name: getattr(_REAL_TORCH, name)
    mod.cuda = _make_cpu_cuda_module()
    for name in _FACTORIES:
        if hasattr(torch, name):
            setattr(mod, name, _device_remapping(getattr(torch, name)))
    mod.device = _CpuDevice
    return mod


def _cpu_torch() -> types.ModuleType:
    global _CPU_TORCH
    if _CPU_TORCH is None:
        _CPU_TORCH = _make_cpu_torch_module()
    return _CPU_TORCH


def _is_megatron_name(name: str) -> bool:
    return name == "megatron" or name.startswith("megatron.")


_MENTIONS_CUDA: dict = {}  # source path -> bool


def _source_mentions_cuda(module) -> bool:
    spec = getattr(module, "__spec__", None)
    origin = getattr(spec, "origin", None) or getattr(module, "__file__", None)
    if not origin or not str(origin).endswith(".py"):
        return False
    if origin not in _MENTIONS_CUDA:
        try:
            with open(origin, "r", encoding="utf-8", errors="replace") as f:
                _MENTIONS_CUDA[origin] = "cuda" in f.read()
        except OSError:
            _MENTIONS_CUDA[origin] = False
    return _MENTIONS_CUDA[origin]


def patch_module(module, force: bool = False) -> bool:
    """Apply the shims to one already-imported module: rebind its global ``torch`` to the
    CPU stand-in (when its source mentions ``cuda``, or always with ``force``) and rebind
    any replaced megatron function it imported by name.  Use it for modules outside the
    ``megatron`` package, e.g. ``patch_module(sys.modules["__main__"], force=True)`` in a
    ``pretrain_gpt.py`` run.  Returns True when the module's ``torch`` was rebound."""
    if torch.cuda.is_available():
        return False
    d = getattr(module, "__dict__", None)
    if d is None:
        return False
    for original, replacement in _REPLACEMENTS:
        for attr, val in list(d.items()):
            if val is original:
                d[attr] = replacement
    if d.get("torch") is _REAL_TORCH and (force or _source_mentions_cuda(module)):
        d["torch"] = _cpu_torch()
        return True
    return False


def _patch_loaded_megatron_modules() -> None:
    for name, module in list(sys.modules.items()):
        if module is not None and _is_megatron_name(name):
            patch_module(module)


class _PatchingLoader(importlib.abc.Loader):
    """Wraps the real loader of a ``megatron.*`` module and patches it after it ran."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        if _INSTALLED:
            patch_module(module)

    def __getattr__(self, name):  # get_source, is_package, get_resource_reader, ...
        return getattr(self._loader, name)


class _MegatronImportHook(importlib.abc.MetaPathFinder):
    """Makes ``megatron.*`` modules imported after ``install_cpu_shims()`` get the shims."""

    def find_spec(self, fullname, path, target=None):
        if not _is_megatron_name(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, _MegatronImportHook):
                continue
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is not None and hasattr(loader, "exec_module") and not isinstance(
            loader, _PatchingLoader
        ):
            spec.loader = _PatchingLoader(loader)
        return spec


# ---------------------------------------------------------------------------
# Mechanism 2: replacements of specific megatron functions
# ---------------------------------------------------------------------------


def _replace(owner, attr: str, replacement, label: str) -> bool:
    """Replace ``owner.attr`` (module function or class attribute) by ``replacement``;
    module-level functions are also rebound in megatron modules that imported them."""
    if owner is None or not hasattr(owner, attr):
        return False
    original = owner.__dict__.get(attr, getattr(owner, attr))
    setattr(owner, attr, replacement)
    if isinstance(owner, types.ModuleType):
        _REPLACEMENTS.append((original, replacement))
    _APPLIED.append(label)
    return True


def _import(name: str):
    try:
        return importlib.import_module(name)
    except Exception:  # a module missing from this megatron-core version
        return None


# (a) ------------------------------------------------------------------------


def _cpu_get_cuda_rng_state(device="cuda", clone: bool = False, graph_safe: bool = False):
    """Replaces megatron.core.tensor_parallel.random._get_cuda_rng_state: the original
    reads torch.cuda / torch.cuda.default_generators[idx]; on CPU the tracked "CUDA" RNG
    is the CPU default generator."""
    return torch.get_rng_state()


def _cpu_set_cuda_rng_state(new_state, device=-1, graph_safe: bool = False):
    """Replaces megatron.core.tensor_parallel.random._set_cuda_rng_state: the original
    queues a torch.cuda._lazy_call on torch.cuda.default_generators (never runs, or fails,
    without CUDA); here the CPU default generator's state is set."""
    if isinstance(new_state, torch.Generator):
        new_state = new_state.get_state()
    torch.set_rng_state(new_state)


def _cpu_tracker_add(self, name, seed):
    """Replaces CudaRNGStatesTracker.add: the original calls torch.cuda.get_rng_state()
    and torch.cuda.manual_seed(); here the state of a CPU generator seeded with `seed` is
    stored (the global generator is left alone)."""
    self._is_initialized = True
    clash = ([f"seed {seed}"] if seed in self.seeds_ else []) + ([f"state {name!r}"] if name in self.states_ else [])
    if clash:      # the tracker's contract: one state per name, one name per seed
        raise Exception(f"megamoe-plugin CPU RNG tracker: {' and '.join(clash)} registered twice")
    self.seeds_.add(seed)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed))
    self.states_[name] = gen.get_state()


def _make_cpu_tracker_fork(default_name: str):
    @contextlib.contextmanager
    def _cpu_tracker_fork(self, name=default_name):
        """Replaces CudaRNGStatesTracker.fork: same bookkeeping, but swaps the CPU
        generator state; the original's "CPU RNG state changed within GPU RNG context"
        warning would fire on every random op since both RNGs are the same here."""
        if name not in self.states_:
            raise Exception("cuda rng state {} is not added".format(name))
        orig_state = torch.get_rng_state()
        orig_name = getattr(self, "_current_state_name", "default-rng")
        if orig_name != "default-rng":
            self.states_[orig_name] = orig_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            if getattr(self, "_current_state_name", name) != name:
                raise Exception(
                    f"current state name {self._current_state_name} is not the same as the "
                    f"desired state name {name}."
                )
            self.states_[name] = torch.get_rng_state()
            if orig_name != "default-rng":
                orig_state = self.states_[orig_name]
            torch.set_rng_state(orig_state)
            self._current_state_name = orig_name

    return _cpu_tracker_fork


def _shim_rng() -> None:
    rnd = _import("megatron.core.tensor_parallel.random")
    if rnd is None:
        return
    _replace(rnd, "_get_cuda_rng_state", _cpu_get_cuda_rng_state, "a:_get_cuda_rng_state")
    _replace(rnd, "_set_cuda_rng_state", _cpu_set_cuda_rng_state, "a:_set_cuda_rng_state")
    tracker = getattr(rnd, "CudaRNGStatesTracker", None)
    if tracker is not None:
        _replace(tracker, "add", _cpu_tracker_add, "a:CudaRNGStatesTracker.add")
        default = getattr(rnd, "_MODEL_PARALLEL_RNG_TRACKER_NAME", "model-parallel-rng")
        _replace(tracker, "fork", _make_cpu_tracker_fork(default), "a:CudaRNGStatesTracker.fork")
    # model_parallel_cuda_manual_seed itself only calls torch.cuda.manual_seed (CPU seed
    # via the torch stand-in) and the tracker methods above.


# (c) ------------------------------------------------------------------------


def _cpu_get_default_causal_mask(sq: int) -> torch.Tensor:
    """Replaces megatron.core.transformer.utils.get_default_causal_mask, which hard-codes
    device="cuda"."""
    return torch.triu(torch.ones(sq, sq, device=_CPU), diagonal=1).bool()


def _cpu_get_sliding_window_causal_mask(sq, skv, window_size):
    """Replaces megatron.core.transformer.utils.get_sliding_window_causal_mask (same
    hard-coded device="cuda")."""
    m = torch.ones(sq, skv, dtype=torch.bool, device=_CPU)
    mu = torch.triu(m, diagonal=skv - sq - window_size[0])
    ml = torch.tril(mu, diagonal=skv - sq + window_size[1])
    return ~ml


def _shim_masks() -> None:
    tu = _import("megatron.core.transformer.utils")
    if tu is None:
        return
    _replace(
        tu, "get_default_causal_mask", _cpu_get_default_causal_mask, "c:get_default_causal_mask"
    )
    _replace(
        tu,
        "get_sliding_window_causal_mask",
        _cpu_get_sliding_window_causal_mask,
        "c:get_sliding_window_causal_mask",
    )


# (d) ------------------------------------------------------------------------


def _shim_dispatcher_stream() -> None:
    """MoEAlltoAllTokenDispatcher.__init__ does
    ``if cls.cuda_dtoh_stream is None: cls.cuda_dtoh_stream = torch.cuda.Stream()``:
    pre-set the class attribute to a no-op CPU stream so that branch is skipped (the
    torch stand-in also covers the later torch.cuda.stream()/current_stream() uses in
    ``_maybe_dtoh_and_synchronize``)."""
    td = _import("megatron.core.transformer.moe.token_dispatcher")
    cls = getattr(td, "MoEAlltoAllTokenDispatcher", None)
    if cls is not None and hasattr(cls, "cuda_dtoh_stream"):
        if cls.cuda_dtoh_stream is None or not isinstance(cls.cuda_dtoh_stream, _CpuStream):
            cls.cuda_dtoh_stream = _CpuStream()
        _APPLIED.append("d:MoEAlltoAllTokenDispatcher.cuda_dtoh_stream")


# (e) + (f) --------------------------------------------------------------------

# Names imported from megatron.core.extensions.transformer_engine inside moe_utils' TE
# try-block; without TE they are never bound, yet some are read unguarded
# (router_gating_linear reads `te_general_gemm is not None`).
_MOE_UTILS_TE_NAMES = (
    "te_general_gemm",
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "fused_permute",
    "fused_permute_with_probs",
    "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs",
    "fused_topk_with_score_function",
    "fused_unpermute",
)


def _cpu_maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    """Replaces megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu: the
    original only converts CUDA tensors, so on CPU the alltoall split sizes stay tensors
    instead of becoming numpy arrays as the dispatcher (EP>1) expects."""
    if torch.is_tensor(tensor):
        if tensor.device.type != "cpu":
            tensor = tensor.to(_CPU)
        if as_numpy:
            tensor = tensor.detach().numpy()
    return tensor


def _shim_moe_utils() -> None:
    mu = _import("megatron.core.transformer.moe.moe_utils")
    if mu is None:
        return
    for name in _MOE_UTILS_TE_NAMES:
        if name not in mu.__dict__:
            setattr(mu, name, None)
            _APPLIED.append(f"e:moe_utils.{name}=None")
    _replace(
        mu, "maybe_move_tensor_to_cpu", _cpu_maybe_move_tensor_to_cpu, "f:maybe_move_tensor_to_cpu"
    )


# (h) ------------------------------------------------------------------------


def _cpu_clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad: bool = False):
    """megatron's clip_grad_by_total_norm_fp32 without its ``grad.type() == 'torch.cuda.FloatTensor'`` assert
    (a string comparison the torch stand-in cannot satisfy); same scaling rule."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = []
    for param in parameters:
        g = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if g is not None:
            if g.dtype not in (torch.float32, torch.bfloat16):
                raise AssertionError(f"clip_grad_by_total_norm_fp32: grad dtype {g.dtype}")
            grads.append(g.detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        torch._foreach_mul_(grads, clip_coeff)


def _shim_cuda_methods() -> None:
    """``tensor.cuda()`` / ``module.cuda()`` calls in megatron (e.g. the tied embedding's ``weight.data.cuda()``
    before the pipeline all-reduce, Megatron-LM's ``model_module.cuda(...)``) are out of the torch stand-in's
    reach. A torch build without CUDA can never honour them, so they keep the tensor / module on the CPU."""
    if getattr(torch.Tensor.cuda, "_megamoe_wrapped", False):
        return

    def tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        return self

    def module_cuda(self, device=None):
        return self

    tensor_cuda._megamoe_wrapped = module_cuda._megamoe_wrapped = True
    torch.Tensor.cuda = tensor_cuda
    torch.nn.Module.cuda = module_cuda
    _APPLIED.append("h:Tensor.cuda / Module.cuda stay on the CPU (torch without CUDA)")


_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
                    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


def _cuda_type_name(param, name: str):
    """``param.type`` that names the CUDA tensor type when asked with no arguments (a conversion is the real one)."""
    def type_(*args, **kwargs):
        return name if not args and not kwargs else torch.Tensor.type(param, *args, **kwargs)
    return type_


@contextlib.contextmanager
def _answering_cuda_type_names(params):
    """While inside, each CPU parameter's ``type()`` names its CUDA twin (an attribute on the parameter, removed on
    the way out): for the optimizers that sort or check their parameters by those names."""
    tagged = []
    for param in params:
        name = _CUDA_TYPE_NAMES.get(torch.Tensor.type(param))
        if name is not None and "type" not in param.__dict__:
            param.type = _cuda_type_name(param, name)
            tagged.append(param)
    try:
        yield
    finally:
        for param in tagged:
            del param.type


def _shim_float16_optimizer() -> None:
    """The bf16/fp16 optimizer (``--bf16`` without the distributed optimizer) refuses any parameter whose
    ``type()`` is not a CUDA type name. While it builds its fp32 main copies, each CPU parameter answers its CUDA
    twin's name, as for the distributed optimizer below."""
    mod = _import("megatron.core.optimizer.optimizer")
    cls = getattr(mod, "Float16OptimizerWithFloat16Params", None)
    init = cls.__dict__.get("__init__") if cls is not None else None
    if init is None or getattr(init, "_megamoe_wrapped", False):
        return

    @functools.wraps(init)
    def _cpu_init(self, optimizer, *args, **kwargs):
        with _answering_cuda_type_names([p for group in optimizer.param_groups for p in group["params"]]):
            init(self, optimizer, *args, **kwargs)

    _cpu_init._megamoe_wrapped = True
    cls.__init__ = _cpu_init
    _APPLIED.append("h:Float16OptimizerWithFloat16Params parameter types on CPU")


def _shim_distributed_optimizer() -> None:
    """The distributed optimizer sorts its parameters by ``model_param.type()`` against the CUDA type names and
    refuses any other. While it builds its groups, each CPU parameter answers its CUDA twin's name (an attribute
    on the parameter, removed right after); everything else it does works on CPU tensors with gloo."""
    mod = _import("megatron.core.optimizer.distrib_optimizer")
    cls = getattr(mod, "DistributedOptimizer", None)
    original = cls.__dict__.get("_build_model_and_main_param_groups") if cls is not None else None
    if not isinstance(original, classmethod) or getattr(original.__func__, "_megamoe_wrapped", False):
        return
    build = original.__func__

    @functools.wraps(build)
    def _cpu_build_groups(klass, gbuf_ranges, param_gbuf_map, *args, **kwargs):
        with _answering_cuda_type_names(list(param_gbuf_map)):
            return build(klass, gbuf_ranges, param_gbuf_map, *args, **kwargs)

    _cpu_build_groups._megamoe_wrapped = True
    cls._build_model_and_main_param_groups = classmethod(_cpu_build_groups)
    _APPLIED.append("h:DistributedOptimizer parameter types on CPU")

    # Without Apex or Transformer Engine (always so on CPU) its state_dict() reads Adam's "step" from the inner
    # optimizer's state, which a fresh optimizer about to load a checkpoint does not have yet: give it the dummy
    # state Megatron itself creates for its FSDP checkpoints (replaced in place by the load).
    sharded = cls.__dict__.get("sharded_state_dict")
    dummy = getattr(cls, "_init_optimizer_states_with_dummy_values", None)
    if sharded is None or dummy is None or getattr(sharded, "_megamoe_wrapped", False):
        return

    setter = cls.__dict__.get("_set_main_param_and_optimizer_states")
    if setter is not None:
        @functools.wraps(setter)
        def _cpu_set_states(self, model_param, tensors):
            # torch's Adam keeps "step" per parameter; the checkpoint has it per group (restored from there)
            group, order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state.get(self.optimizer.param_groups[group]["params"][order]) or {}
            if "step" in state and "step" not in tensors:
                tensors = dict(tensors, step=state["step"])
            return setter(self, model_param, tensors)
        cls._set_main_param_and_optimizer_states = _cpu_set_states

    @functools.wraps(sharded)
    def _cpu_sharded_state_dict(self, *args, **kwargs):
        loading = kwargs.get("is_loading", args[1] if len(args) > 1 else False)
        if loading and not any(self.optimizer.state.get(p) for g in self.optimizer.param_groups
                               for p in g["params"]):
            self._init_optimizer_states_with_dummy_values()
        return sharded(self, *args, **kwargs)

    _cpu_sharded_state_dict._megamoe_wrapped = True
    cls.sharded_state_dict = _cpu_sharded_state_dict
    _APPLIED.append("h:DistributedOptimizer loads a checkpoint without Apex / Transformer Engine")


def _shim_clip_grads() -> None:
    cg = _import("megatron.core.optimizer.clip_grads")
    if cg is None:
        return
    _replace(cg, "clip_grad_by_total_norm_fp32", _cpu_clip_grad_by_total_norm_fp32,
             "h:clip_grad_by_total_norm_fp32")


# (g) ------------------------------------------------------------------------


def _shim_torch_norm() -> None:
    """WrappedTorchNorm.__new__ asserts ``not config.sequence_parallel``; MoE with TP>1
    requires sequence parallelism, and without TE/apex torch's LayerNorm is the only norm.
    LayerNorm is per token, so it is correct on a sequence shard; only its grads must be
    all-reduced over TP, which finalize_model_grads does for params carrying
    ``sequence_parallel=True``.  Replace __new__ to build the norm from a config copy with
    sequence_parallel=False and then tag the params."""
    tn = _import("megatron.core.transformer.torch_norm")
    cls = getattr(tn, "WrappedTorchNorm", None)
    if cls is None or "__new__" not in cls.__dict__:
        return
    original_new = cls.__new__

    def _cpu_wrapped_torch_norm_new(klass, config, *args, **kwargs):
        sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        if sequence_parallel:
            config = copy.copy(config)
            config.sequence_parallel = False
        norm = original_new(klass, config, *args, **kwargs)
        if sequence_parallel:
            for p in norm.parameters():
                setattr(p, "sequence_parallel", True)
        return norm

    cls.__new__ = staticmethod(_cpu_wrapped_torch_norm_new)
    _APPLIED.append("g:WrappedTorchNorm.__new__(sequence_parallel)")


# ---------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------

# Modules imported up front so their torch global is rebound and their functions patched.
_PRELOAD = (
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.torch_norm",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.shared_experts",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.fusions.fused_softmax",
)


def install_cpu_shims() -> bool:
    """Patch megatron-core's CUDA assumptions so it runs on CPU (see module docstring).

    Idempotent.  A no-op returning False when ``torch.cuda.is_available()``; otherwise
    returns True.  Safe to call again after importing more megatron modules (each call
    re-patches every loaded ``megatron.*`` module; an import hook also covers later
    imports).  Imports megatron-core (about 2 s the first time)."""
    global _INSTALLED, _IMPORT_HOOK
    if torch.cuda.is_available():
        return False
    if not _INSTALLED:
        for name in _PRELOAD:
            _import(name)
        _shim_rng()  # (a)
        _APPLIED.append("b:torch stand-in in megatron modules")  # (b), (d), (h)
        _shim_masks()  # (c)
        _shim_dispatcher_stream()  # (d)
        _shim_moe_utils()  # (e), (f)
        _shim_torch_norm()  # (g)
        _shim_clip_grads()  # (h)
        _shim_cuda_methods()  # (h)
        _shim_distributed_optimizer()  # (h)
        _shim_float16_optimizer()  # (h)
        if _IMPORT_HOOK is None:
            _IMPORT_HOOK = _MegatronImportHook()
            sys.meta_path.insert(0, _IMPORT_HOOK)
        _INSTALLED = True
    _patch_loaded_megatron_modules()
    return True


def cpu_shims_installed() -> bool:
    """True once install_cpu_shims() has patched megatron-core in this process."""
    return _INSTALLED


def applied_shims() -> List[str]:
    """Labels of the patches applied (prefixed with the environment-note letter a-h)."""
    return list(_APPLIED)
