"""megatron-core's own MoE layer, built standalone as a reference ("peer") implementation.

    from megamoe_plugin.megatron_adapter.peer import (
        build_megatron_moe_layer, load_expert_weights, load_router_weight)

    layer = build_megatron_moe_layer(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=k)
    load_expert_weights(layer, w1, w2)    # w1 [E, H, F], w2 [E, F, H]
    load_router_weight(layer, wg)         # wg [E, H]
    x = torch.randn(S, B, H, requires_grad=True)   # megatron layout: [seq, batch, hidden]
    out, bias = layer(x)                  # out [S, B, H]; bias is None (no bias, see below)
    out.sum().backward()                  # grads in x.grad and the layer's parameters

What the layer computes (megatron-core 0.16.1 defaults, which this builder keeps):
``logits = x @ wg.T`` (in the input dtype; ``moe_router_dtype`` is left unset), the top-k
experts are chosen on the logits and their probabilities are a softmax over the k
selected logits (``moe_router_pre_softmax=False``, ``moe_router_score_function="softmax"``);
that equals softmax over all experts, top-k, renormalised to sum 1.  For ``top_k == 1``
megatron requires ``moe_router_pre_softmax=True`` (the builder sets it): the single
probability is then the full-softmax probability, not renormalised.  Each token's output
is ``sum_j p_j * act(x @ w1[e_j]) @ w2[e_j]`` (the prob is applied after fc2 in the
unpermute/combine step).  No token is dropped (no capacity factor), there are no biases,
and the aux loss coefficient is 0, so nothing but the layer itself is timed.

The layer runs in whatever process calls the builder: a single-process gloo default group
and megatron ``parallel_state`` with TP=PP=EP=1 are created when missing (an existing
default group and parallel state are reused), and ``install_cpu_shims()`` is applied on a
machine without CUDA.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

from .compat import spec_submodules
from .cpu_compat import install_cpu_shims

__all__ = [
    "ensure_megatron_parallel_state",
    "build_megatron_moe_layer",
    "load_expert_weights",
    "load_router_weight",
]

_ACTIVATIONS = {
    # name -> (activation_func, gated_linear_unit)
    "gelu": (F.gelu, False),
    "relu": (F.relu, False),
    "silu": (F.silu, False),
    "swiglu": (F.silu, True),
    "geglu": (F.gelu, True),
}


def ensure_megatron_parallel_state() -> None:
    """Make sure torch.distributed and megatron's parallel_state are initialised.

    * No default process group: create a single-process group (world_size=1, rank=0;
      nccl with CUDA, gloo without) over an in-memory store (no port to collide with, no file left behind).
    * An existing default group is reused as it is (whatever its backend/world size).
    * parallel_state not initialised: ``initialize_model_parallel(1, 1,
      expert_model_parallel_size=1)``; if it is initialised already it is reused, but it
      must have TP=PP=EP=1 (the layer built here holds all experts locally).
    Neither is ever torn down, so other code in the same process can keep using them.
    """
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    if not dist.is_initialized():
        # nccl on a GPU: megatron-core's MoE code may reduce CUDA tensors over the (size-1) groups
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend, store=dist.HashStore(), world_size=1, rank=0)

    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            expert_model_parallel_size=1,
        )
    sizes = (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_expert_model_parallel_world_size(),
    )
    if sizes != (1, 1, 1):
        raise RuntimeError(
            "megatron parallel_state is already initialised with (TP, PP, EP) = "
            f"{sizes}; build_megatron_moe_layer needs (1, 1, 1)"
        )


def build_megatron_moe_layer(
    hidden_size: int,
    ffn_hidden_size: int,
    num_experts: int,
    top_k: int,
    activation: Union[str, Callable] = "gelu",
    dtype: torch.dtype = torch.float32,
    seed: Optional[int] = None,
    grouped_gemm: bool = False,
    use_te: bool = False,
    router: Optional[dict] = None,
):
    """Return megatron-core's ``MoELayer`` (a ``torch.nn.Module``, in training mode).

    Configuration: ``moe_token_dispatcher_type="alltoall"``, dropless
    (``moe_expert_capacity_factor=None``), ``SequentialMLP`` experts built from the local
    (non-TE) spec (``moe_grouped_gemm=False``), ``add_bias_linear=False``, every fusion
    off, ``use_cpu_initialization=True``, ``params_dtype=dtype``, ``moe_aux_loss_coeff=0``.
    ``activation``: "gelu" (default, exact erf gelu = ``F.gelu``), "relu", "silu", a
    callable, or the gated "swiglu"/"geglu" (then fc1 has 2*F outputs, see
    ``load_expert_weights``).  Routing: top-k on the logits + softmax over the k selected
    (= softmax, top-k, renormalise); for ``top_k == 1`` megatron insists on
    ``moe_router_pre_softmax=True`` (p = full softmax prob, no renormalisation).
    ``seed``: if given, the random init uses a private RNG stream seeded with it (the
    global CPU RNG is left as it was); if None the init draws from the global CPU RNG.
    Load real weights with ``load_expert_weights`` / ``load_router_weight`` (SequentialMLP only).
    ``router``: TransformerConfig router fields that replace the defaults above (e.g. a DeepSeek-V3 router:
    ``moe_router_score_function="sigmoid"``, ``moe_router_enable_expert_bias=True``, groups, scaling, a loss).
    ``grouped_gemm`` / ``use_te``: megatron's GroupedMLP (needs the ``grouped_gemm`` package) or Transformer
    Engine's grouped linear experts instead, for timing comparisons on a GPU (random init, weights not loadable).

    Forward: ``output, bias = layer(hidden_states)`` with ``hidden_states`` of shape
    ``[seq, batch, hidden]``; ``output`` has the same shape and dtype, ``bias`` is None.
    Backward: ``output.backward(grad)`` (or a loss on it); grads land in ``x.grad``,
    ``layer.router.weight.grad`` and each
    ``layer.experts.local_experts[e].linear_fc{1,2}.weight.grad`` ([out, in] layout).
    """
    install_cpu_shims()
    ensure_megatron_parallel_state()

    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    if callable(activation):
        activation_func, gated = activation, False
    else:
        try:
            activation_func, gated = _ACTIVATIONS[activation]
        except KeyError:
            raise ValueError(
                f"unknown activation {activation!r}; use one of {sorted(_ACTIVATIONS)} "
                "or a callable"
            ) from None

    fields = dict(
        num_layers=1,
        hidden_size=hidden_size,
        ffn_hidden_size=ffn_hidden_size,
        num_attention_heads=1,
        # MoE
        num_moe_experts=num_experts,
        moe_router_topk=top_k,
        moe_ffn_hidden_size=ffn_hidden_size,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=grouped_gemm,
        moe_expert_capacity_factor=None,
        moe_pad_expert_input_to_capacity=False,
        moe_aux_loss_coeff=0.0,
        moe_z_loss_coeff=None,
        moe_input_jitter_eps=None,
        # megatron rejects top-1 without pre-softmax (softmax over one logit is constant).
        moe_router_pre_softmax=(top_k == 1),
        moe_router_score_function="softmax",
        moe_permute_fusion=False,
        moe_router_fusion=False,
        moe_shared_expert_intermediate_size=None,
        # MLP
        activation_func=activation_func,
        gated_linear_unit=gated,
        add_bias_linear=False,
        # no fusions (CPU, no apex/TE)
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        # parallelism / init
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=1,
        sequence_parallel=False,
        use_cpu_initialization=True,
        perform_initialization=True,
        params_dtype=dtype,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    config = TransformerConfig(**{**fields, **(router or {})})
    spec = get_moe_module_spec(use_te=use_te, num_experts=num_experts, moe_grouped_gemm=grouped_gemm)

    def _build():
        return MoELayer(config=config, submodules=spec_submodules(spec), layer_number=1)

    if seed is None:
        layer = _build()
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            layer = _build()
    return layer


def _local_experts(layer):
    experts = getattr(layer, "experts", None)
    local = getattr(experts, "local_experts", None)
    if local is None:
        raise TypeError(
            f"expected an MoELayer with SequentialMLP experts, got experts={type(experts)!r}"
        )
    return local


def load_expert_weights(layer, w1: torch.Tensor, w2: torch.Tensor) -> None:
    """Copy expert weights into the layer's SequentialMLP experts.

    ``w1``: [E, H, F] and ``w2``: [E, F, H] in the math layout
    ``y = act(x @ w1[e]) @ w2[e]``.  megatron's linears store ``weight`` as [out, in], so
    ``linear_fc1.weight <- w1[e].T`` ([F, H]) and ``linear_fc2.weight <- w2[e].T`` ([H, F]).
    For gated activations ("swiglu"/"geglu") w1 is [E, H, 2F]: columns [:F] feed the
    activation, columns [F:] are the linear (multiplied) half, as megatron's glu splits.
    E is the global expert count; with EP>1 only this rank's experts
    (``layer.local_expert_indices``) are copied.  Values are cast to the layer's dtype.
    """
    local = _local_experts(layer)
    indices = list(getattr(layer, "local_expert_indices", range(len(local))))
    if w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w1 and w2 must be 3-D, got {tuple(w1.shape)} and {tuple(w2.shape)}")
    with torch.no_grad():
        for expert, e in zip(local, indices):
            fc1 = expert.linear_fc1.weight
            fc2 = expert.linear_fc2.weight
            if e >= w1.shape[0] or e >= w2.shape[0]:
                raise ValueError(f"expert {e} missing: w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}")
            if tuple(w1[e].t().shape) != tuple(fc1.shape):
                raise ValueError(
                    f"w1[{e}] is {tuple(w1[e].shape)}, expected [H, F] = {tuple(fc1.t().shape)}"
                )
            if tuple(w2[e].t().shape) != tuple(fc2.shape):
                raise ValueError(
                    f"w2[{e}] is {tuple(w2[e].shape)}, expected [F, H] = {tuple(fc2.t().shape)}"
                )
            fc1.copy_(w1[e].t().to(dtype=fc1.dtype, device=fc1.device))
            fc2.copy_(w2[e].t().to(dtype=fc2.dtype, device=fc2.device))


def load_router_weight(layer, wg: torch.Tensor) -> None:
    """Copy the router (gate) weight: ``wg`` is [E, H] with ``logits = x @ wg.T``, the
    same layout as megatron's ``layer.router.weight``."""
    weight = layer.router.weight
    if tuple(wg.shape) != tuple(weight.shape):
        raise ValueError(f"wg is {tuple(wg.shape)}, expected [E, H] = {tuple(weight.shape)}")
    with torch.no_grad():
        weight.copy_(wg.to(dtype=weight.dtype, device=weight.device))
