"""megatron-core's own MoE layer against the plugin's, same config, same weights, same tokens: everything the
router and the layer compute, taken from megatron-core itself (the expected values are never our code's).

``ROWS``: router configurations of today's recipes (scaled down). ``compare(row, tp, ep)`` builds, on this rank,
megatron-core's MoELayer (TopKRouter + SequentialMLP, shared experts where the row has them) and the plugin's
PluginMoELayer from one TransformerConfig, copies the native weights into the plugin's layer, runs both forward and
backward on the same input, and returns the differences: output, input gradient, router / expert / shared-expert
parameter gradients, every aux loss megatron-core's metrics tracker recorded, the expert bias's token counts, and
the expert bias after megatron-core's once-per-global-batch update (``finalize_model_grads``'s) and after the
core's own update (``gates.balance.end_global_batch``, what the plugin's other trainers call).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

H, F_MOE, S, B = 32, 24, 8, 3

SWIGLU = dict(gated_linear_unit=True, activation_func=F.silu)

# name -> (TransformerConfig fields, megatron-core release it needs, forward kwargs)
ROWS = {
    "mixtral": dict(num_moe_experts=8, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_router_dtype="fp32",
                    add_bias_linear=False, **SWIGLU),
    "qwen3_top8_global_aux": dict(num_moe_experts=16, moe_router_topk=8, moe_router_load_balancing_type="global_aux_loss",
                                  moe_aux_loss_coeff=1e-3, moe_router_dtype="fp32", add_bias_linear=False, **SWIGLU),
    "deepseek_v3": dict(num_moe_experts=16, moe_router_topk=4, moe_router_score_function="sigmoid",
                        moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-3,
                        moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
                        moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4,
                        moe_shared_expert_intermediate_size=32, moe_router_dtype="fp32", add_bias_linear=False,
                        **SWIGLU),
    "deepseek_v2_lite": dict(num_moe_experts=16, moe_router_topk=6, moe_router_pre_softmax=True,
                             moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-3,
                             moe_shared_expert_intermediate_size=48, add_bias_linear=False, **SWIGLU),
    "gpt_oss": dict(num_moe_experts=8, moe_router_topk=4, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
                    add_bias_linear=True, gated_linear_unit=True, activation_func="quick_gelu",
                    glu_linear_offset=1.0, activation_func_clamp_value=7.0),
    "nemotron_sqrtsoftplus": dict(num_moe_experts=16, moe_router_topk=6, moe_router_score_function="sqrtsoftplus",
                                  moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5,
                                  moe_aux_loss_coeff=1e-4, moe_shared_expert_intermediate_size=32,
                                  moe_router_dtype="fp32", add_bias_linear=False, activation_func="squared_relu"),
    "nemotron_fp64_router": dict(num_moe_experts=16, moe_router_topk=6, moe_router_score_function="sigmoid",
                                 moe_router_enable_expert_bias=True, moe_aux_loss_coeff=1e-4,
                                 moe_router_dtype="fp64", add_bias_linear=False, activation_func="squared_relu"),
    "llama4_sigmoid_top1": dict(num_moe_experts=8, moe_router_topk=1, moe_router_score_function="sigmoid",
                                moe_aux_loss_coeff=1e-3, moe_shared_expert_intermediate_size=32,
                                add_bias_linear=False, **SWIGLU),
    "capacity_probs": dict(num_moe_experts=8, moe_router_topk=2, moe_aux_loss_coeff=1e-2,
                           moe_expert_capacity_factor=0.5, moe_token_drop_policy="probs", add_bias_linear=False),
    "capacity_position_padded": dict(num_moe_experts=8, moe_router_topk=2, moe_aux_loss_coeff=1e-2,
                                     moe_expert_capacity_factor=0.5, moe_token_drop_policy="position",
                                     moe_pad_expert_input_to_capacity=True, add_bias_linear=False),
    "capacity_expert_bias": dict(num_moe_experts=8, moe_router_topk=2, moe_router_score_function="sigmoid",
                                 moe_router_enable_expert_bias=True, moe_aux_loss_coeff=0.0,
                                 moe_expert_capacity_factor=0.75, add_bias_linear=False),
    "sinkhorn_top1": dict(num_moe_experts=8, moe_router_topk=1, moe_router_load_balancing_type="sinkhorn",
                          moe_aux_loss_coeff=0.0, add_bias_linear=False),
    "quantile_balancing": dict(num_moe_experts=8, moe_router_topk=2, moe_router_load_balancing_type="quantile_balancing",
                               moe_aux_loss_coeff=0.0, moe_router_dtype="fp32", add_bias_linear=False),
    "switch_jitter": dict(num_moe_experts=8, moe_router_topk=1, moe_router_pre_softmax=True, moe_input_jitter_eps=0.1,
                          moe_aux_loss_coeff=1e-2, add_bias_linear=False),
    "probs_on_input_top1": dict(num_moe_experts=8, moe_router_topk=1, moe_router_pre_softmax=True,
                                moe_apply_probs_on_input=True, moe_aux_loss_coeff=1e-2, add_bias_linear=False),
    "aux_list_with_z_and_per_token_loss": dict(
        num_moe_experts=8, moe_router_topk=2, moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
        moe_aux_loss_coeff=[1e-2, 1e-3], moe_z_loss_coeff=1e-3, calculate_per_token_loss=True,
        add_bias_linear=False),
    # (megatron-core cannot combine a padding mask with the expert bias: its count broadcasts [T] over [T, E])
    "padding_mask": dict(num_moe_experts=8, moe_router_topk=2, moe_router_score_function="sigmoid",
                         moe_router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
                         moe_aux_loss_coeff=[1e-2, 1e-3, 1e-3], moe_z_loss_coeff=1e-3, add_bias_linear=False),
}
# rows whose math megatron-core 0.16 computes differently (0.17 normalised the sigmoid scores of the aux losses) or
# that it does not have (sqrtsoftplus, quantile balancing): the plugin follows 0.19
NEEDS_019 = {"deepseek_v3", "nemotron_sqrtsoftplus", "nemotron_fp64_router", "llama4_sigmoid_top1", "padding_mask",
             "quantile_balancing", "aux_list_with_z_and_per_token_loss"}
PADDED = {"padding_mask"}


def megatron_release_019() -> bool:
    import megatron.core.transformer.moe.moe_utils as mu
    return hasattr(mu, "qb_dual_update")


def _activation(name):
    if name == "quick_gelu":
        from megatron.core.fusions.fused_bias_geglu import quick_gelu
        return quick_gelu
    if name == "squared_relu":
        from megatron.core.activations import squared_relu
        return squared_relu
    return name


def transformer_config(row: str, tp: int = 1, ep: int = 1):
    from megatron.core.transformer.transformer_config import TransformerConfig
    fields = dict(ROWS[row])
    fields["activation_func"] = _activation(fields.get("activation_func", F.gelu))
    return TransformerConfig(num_layers=2, hidden_size=H, ffn_hidden_size=2 * H, moe_ffn_hidden_size=F_MOE,
                             num_attention_heads=4, use_cpu_initialization=True, bias_activation_fusion=False,
                             gradient_accumulation_fusion=False, masked_softmax_fusion=False,
                             persist_layer_norm=False, moe_token_dispatcher_type="alltoall",
                             tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
                             expert_model_parallel_size=ep, expert_tensor_parallel_size=1, **fields)


def _tracker():
    """{name: per-layer values} of megatron-core's MoE metrics tracker (the metrics recorded since the last call),
    then cleared."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
        tracker = get_moe_metrics_tracker()
        out = {k: v.values.clone() for k, v in tracker.metrics.items()}
        tracker.clear()
    except ImportError:
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, \
            get_moe_layer_wise_logging_tracker
        out = {k: v["values"].clone() for k, v in get_moe_layer_wise_logging_tracker().items()}
        clear_aux_losses_tracker()
    return {k: v for k, v in out.items() if bool(v.abs().sum() > 0)}       # cleared entries stay, as zeros


def _native_and_plugin(tc):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megamoe_plugin.megatron_adapter.args import config_from_megatron
    from megamoe_plugin.megatron_adapter.compat import build_mlp
    from megamoe_plugin.megatron_adapter.spec import moe_plugin_spec
    import torch.distributed as dist

    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    spec = get_gpt_layer_local_spec(num_experts=tc.num_moe_experts)
    groups = get_default_pg_collection()
    native = build_mlp(spec.submodules.mlp, tc, pg_collection=groups)
    cfg = config_from_megatron(tc, world_size=dist.get_world_size())
    plugin = build_mlp(moe_plugin_spec(spec, cfg).submodules.mlp, tc, pg_collection=groups)
    with torch.no_grad():
        plugin.router.gate.weight.copy_(native.router.weight)
        if native.router.bias is not None:
            plugin.router.gate.bias.copy_(native.router.bias)
        bank = plugin.experts.bank
        for i, mlp in enumerate(native.experts.local_experts):
            bank.w1[i].copy_(mlp.linear_fc1.weight.t())
            bank.w2[i].copy_(mlp.linear_fc2.weight.t())
            if bank.b1 is not None:
                bank.b1[i].copy_(mlp.linear_fc1.bias)
                bank.b2[i].copy_(mlp.linear_fc2.bias)
        if native.use_shared_expert:
            plugin.shared_experts.load_state_dict(native.shared_experts.state_dict())
    if tc.add_bias_linear:
        _clone_fc2_outputs(native)
    for layer in (native, plugin):
        layer.set_layer_number(1)
    return native, plugin


def _clone_fc2_outputs(native) -> None:
    """megatron-core's SequentialMLP with expert biases adds the weighted fc2 bias in place to fc2's output, which
    with one tensor-parallel rank is a view returned by a custom autograd Function: autograd refuses it in training
    (megatron-core bug with ``add_bias_linear`` and the local layer spec). Cloning that output (the same values)
    lets the reference run; nothing else of its math is touched."""
    for mlp in native.experts.local_experts:
        fc2 = mlp.linear_fc2
        original = fc2.forward

        def forward(*args, _original=original, **kwargs):
            out, bias = _original(*args, **kwargs)
            return out.clone(), bias

        fc2.forward = forward


def _grads(native, plugin):
    """(name, native gradient, plugin gradient) of every parameter, in the native layout."""
    out = [("router.weight", native.router.weight.grad, plugin.router.gate.weight.grad)]
    if native.router.bias is not None:
        out.append(("router.bias", native.router.bias.grad, plugin.router.gate.bias.grad))
    bank = plugin.experts.bank
    for i, mlp in enumerate(native.experts.local_experts):
        out.append((f"expert{i}.fc1.weight", mlp.linear_fc1.weight.grad, bank.w1.grad[i].t()))
        out.append((f"expert{i}.fc2.weight", mlp.linear_fc2.weight.grad, bank.w2.grad[i].t()))
        if bank.b1 is not None:
            out.append((f"expert{i}.fc1.bias", mlp.linear_fc1.bias.grad, bank.b1.grad[i]))
            out.append((f"expert{i}.fc2.bias", mlp.linear_fc2.bias.grad, bank.b2.grad[i]))
    if native.use_shared_expert:
        theirs = dict(plugin.shared_experts.named_parameters())
        out += [(f"shared.{n}", p.grad, theirs[n].grad) for n, p in native.shared_experts.named_parameters()]
    return out


def _run(layer, x, g, padding, seed):
    torch.manual_seed(seed)
    x = x.clone().requires_grad_()
    out, bias = layer(x, padding_mask=padding) if padding is not None else layer(x)
    assert bias is None
    (out * g).sum().backward()
    return out.detach(), x.grad, _tracker()


def _update_bias(layer, tc):
    """megatron-core's once-per-global-batch expert-bias update on one layer (finalize_model_grads's)."""
    from megatron.core import parallel_state as ps
    import inspect
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias
    kw = {}
    if "tp_dp_cp_group" in inspect.signature(_update_router_expert_bias).parameters:
        kw["tp_dp_cp_group"] = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
    _update_router_expert_bias([layer], tc, **kw)


def compare(row: str, tp: int = 1, ep: int = 1, seed: int = 0) -> dict:
    """{what: max abs difference} between megatron-core's layer and the plugin's on this rank (module docstring).
    Also returns 'routed' (assignments kept) so a caller can check the row exercised something."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megamoe_plugin.gates import balance

    tc = transformer_config(row, tp, ep)
    torch.manual_seed(seed)                     # the same router and shared experts on every rank
    native, plugin = _native_and_plugin(tc)
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1000 + seed + 31 * rank)
    x = torch.randn(S // tp, B, H, generator=gen)
    g = torch.randn(S // tp, B, H, generator=gen)
    padding = None
    if row in PADDED:
        padding = torch.zeros(B, S // tp, dtype=torch.bool)
        padding[0, -3:] = True
        padding[2, :2] = True
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    _tracker()
    y_native, dx_native, tracked_native = _run(native, x, g, padding, seed + 7)
    y_plugin, dx_plugin, tracked_plugin = _run(plugin, x, g, padding, seed + 7)
    diffs = {"output": (y_native - y_plugin).abs().max().item(), "input grad": (dx_native - dx_plugin).abs().max().item()}
    for name, a, b in _grads(native, plugin):
        diffs[f"grad {name}"] = (a - b).abs().max().item() if a is not None else float(b is not None and b.abs().max())
    if set(tracked_native) != set(tracked_plugin):
        diffs["tracked names"] = float("inf")
    for name in tracked_native:
        if name in tracked_plugin:
            diffs[f"tracked {name}"] = (tracked_native[name] - tracked_plugin[name]).abs().max().item()
    if tc.moe_router_enable_expert_bias:
        diffs["expert bias counts"] = (native.router.local_tokens_per_expert -
                                      plugin.router.gate.local_tokens_per_expert).abs().max().item()
        gate = plugin.router.gate
        bias, counts = gate.expert_bias.clone(), gate.local_tokens_per_expert.clone()
        balance.end_global_batch([gate], batch_group=ps.get_tensor_and_data_parallel_group(with_context_parallel=True))
        core_bias = gate.expert_bias.clone()
        gate.expert_bias.copy_(bias)
        gate.local_tokens_per_expert.copy_(counts)
        _update_bias(native, tc)
        _update_bias(plugin, tc)
        diffs["expert bias (megatron update)"] = (native.router.expert_bias - gate.expert_bias).abs().max().item()
        diffs["expert bias (core update)"] = (native.router.expert_bias - core_bias).abs().max().item()
        diffs["expert bias moved"] = -native.router.expert_bias.abs().max().item()     # < 0: it did move
    if row == "quantile_balancing":
        diffs.update(_quantile_second_step(native, plugin, tc, x, g, seed))
    diffs["eval output"] = _eval_difference(native, plugin, x, padding, seed)
    diffs["routed"] = -float(plugin.last_routing.kept.sum())                           # < 0: tokens were routed
    return diffs


def _eval_difference(native, plugin, x, padding, seed) -> float:
    """The two layers in evaluation mode (no losses, no bias counting; megatron-core still drops at capacity and
    still jitters) on the same input."""
    outs = []
    for layer in (native, plugin):
        layer.eval()
        torch.manual_seed(seed + 11)
        with torch.no_grad():
            outs.append((layer(x, padding_mask=padding) if padding is not None else layer(x))[0])
        layer.train()
    return (outs[0] - outs[1]).abs().max().item()


def _quantile_second_step(native, plugin, tc, x, g, seed) -> dict:
    """Quantile balancing's bias after megatron-core's once-per-global-batch update (its finalize_model_grads's,
    on both layers; and the core's own on the plugin's), then a second step routed by that bias."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.finalize_model_grads import _update_router_qb_beta
    from megamoe_plugin.gates import balance
    gate = plugin.router.gate
    saved = [t.clone() for t in (gate.qb_beta, gate.qb_beta_accum, gate.qb_beta_count)]
    balance.end_global_batch([gate], data_group=ps.get_data_parallel_group(with_context_parallel=True))
    core_beta = gate.qb_beta.clone()
    for t, v in zip((gate.qb_beta, gate.qb_beta_accum, gate.qb_beta_count), saved):
        t.copy_(v)
    group = ps.get_data_parallel_group(with_context_parallel=True)
    _update_router_qb_beta([native], tc, dp_cp_group=group)
    _update_router_qb_beta([plugin], tc, dp_cp_group=group)
    out = {"qb bias (megatron update)": (native.router.qb_beta - gate.qb_beta).abs().max().item(),
           "qb bias (core update)": (native.router.qb_beta - core_beta).abs().max().item(),
           "qb bias moved": -native.router.qb_beta.abs().max().item()}
    for layer in (native, plugin):
        layer.zero_grad(set_to_none=True)
    y_native, dx_native, _ = _run(native, x, g, None, seed + 9)
    y_plugin, dx_plugin, _ = _run(plugin, x, g, None, seed + 9)
    out["step 2 output"] = (y_native - y_plugin).abs().max().item()
    out["step 2 input grad"] = (dx_native - dx_plugin).abs().max().item()
    return out


@functools.lru_cache(maxsize=None)
def init_parallel(tp: int, ep: int) -> None:
    from megamoe_plugin.megatron_adapter.cpu_compat import install_cpu_shims
    from megatron.core import parallel_state as ps
    install_cpu_shims()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=1)


def worker(rank: int, world: int, rows, tp: int, ep: int, out_dir: str) -> None:
    """run_distributed target: every row on this rank; the differences written to out_dir/rank<r>.json."""
    import json
    import os
    init_parallel(tp, ep)
    result = {row: compare(row, tp, ep) for row in rows}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
