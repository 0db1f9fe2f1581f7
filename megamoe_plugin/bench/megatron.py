"""`megamoe bench megatron`: one megatron-core MoE transformer layer, forward+backward on CPU, ours vs megatron's.

What is compared: megatron-core's own ``TransformerLayer`` (input layernorm, causal self-attention, pre-MLP
layernorm, MoE MLP), built from megatron's local (non-TE) GPT layer spec
``get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)``, twice, from ONE ``TransformerConfig``:

- ``ours``: that spec passed through ``megamoe_plugin.megatron_adapter.spec.moe_plugin_spec`` (the MoE ``mlp`` becomes
  ``PluginMoELayer`` with ``PluginRouter`` and ``PluginExperts``; attention and norms stay megatron's), the plugin
  config from ``config_from_megatron(config, world_size=1, gate="naive")``: naive softmax top-k gate, dropless.
- ``megatron``: the spec unchanged: megatron's ``MoELayer`` with ``TopKRouter``, the ``alltoall`` token
  dispatcher (dropless, ``moe_expert_capacity_factor=None``) and ``SequentialMLP`` experts.

The config: ``use_cpu_initialization=True``, no biases (``add_bias_linear=False``), every fusion off (bias-dropout,
bias-activation, gradient-accumulation, masked-softmax, persistent layernorm, rope, permute, router),
``hidden_dropout = attention_dropout = 0``, ``moe_aux_loss_coeff = 0`` (no aux loss: only the layer is timed), gelu
experts, k >= 2 with softmax over the selected logits (megatron's ``moe_router_pre_softmax=False``; its top-1 would
need pre-softmax, so the configs use k=2). Both layers hold the SAME weights: norms and attention are copied by
parameter name from the megatron layer into ours, the router weight [E, H] and the expert weights
(``bank.w1[e] = local_experts[e].linear_fc1.weight.T``, ``bank.w2[e] = linear_fc2.weight.T``) are loaded into both
from ``bench.layer.make_inputs``.

Routing: the layer input is ``make_inputs``' x (noise plus the preferred experts' router directions, preferences
drawn uniformly for ``balanced`` or from Zipf(1.2) popularity for ``skewed``), laid out [seq, batch, hidden]. The
MoE sees ``pre_mlp_layernorm(x + attention(x))``, not x: the attention output is left as megatron initialises it
(it is small next to the residual) and the layernorm only centres and rescales each token, so the router mostly
follows the draw; the table prints the expert load (max/mean over experts of the tokens routed by each layer's
own router, in the check pass) that actually happened, for both layers.

Check: before timing, one forward+backward of each layer on the same input and output gradient; the outputs, the
input gradients and the expert-weight gradients must agree (max abs diff printed; fp32 gives ~1e-6) and both
routers must have produced the same per-expert counts, otherwise the benchmark raises (it would be comparing
different functions).

Timing: CPU fp32, ``--threads`` intra-op threads, glibc told to keep freed large blocks (``cpu_alloc``), the same
for both. Each step clears the parameter and input grads and runs ``layer(x)`` then ``out.backward(grad)``.
``--warmup`` untimed rounds, then ``--repeat`` timed rounds; every round runs each layer once (the order alternates
between rounds), so a shared machine's slow phases hit both alike; the time is the median over rounds.
"speedup" is megatron's median over ours (> 1: ours faster). Attention and norms are the same megatron modules
with the same weights in both layers, so their time is common to both rows and the layer-level ratio is smaller than
the MoE-only ratio that ``megamoe bench layer`` reports.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from ..cpu_alloc import retain_freed_memory
from .layer_inputs import make_inputs
from .report import emit_report

# S: sequence length, B: micro-batch size (T = S * B tokens), heads: attention heads
CONFIGS = {
    "1": dict(H=256, F=1024, E=8, k=2, S=512, B=4, heads=4),
    "2": dict(H=256, F=512, E=32, k=2, S=512, B=4, heads=4),
    "tiny": dict(H=64, F=128, E=8, k=2, S=64, B=4, heads=4),
}

IMPLS = ("ours", "megatron")


def _transformer_config(H, F_, E, k, heads):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=H, ffn_hidden_size=F_, num_attention_heads=heads,
        # MoE: dropless, alltoall dispatcher, SequentialMLP (no grouped GEMM), no aux loss
        num_moe_experts=E, moe_router_topk=k, moe_ffn_hidden_size=F_, moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False, moe_expert_capacity_factor=None, moe_pad_expert_input_to_capacity=False,
        moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None, moe_input_jitter_eps=None,
        moe_router_pre_softmax=(k == 1), moe_router_score_function="softmax",
        moe_permute_fusion=False, moe_router_fusion=False,
        activation_func=F.gelu, gated_linear_unit=False, add_bias_linear=False,
        # every fusion off (CPU, no apex / Transformer Engine)
        bias_activation_fusion=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1,
        sequence_parallel=False, use_cpu_initialization=True, perform_initialization=True,
        params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
    )


def _setup_megatron() -> None:
    """CPU shims, a single-process gloo group + TP=PP=EP=1 parallel state, and megatron's RNG tracker (the
    attention forks it for dropout) when nobody in this process has seeded it yet."""
    from ..megatron_adapter.peer import ensure_megatron_parallel_state, install_cpu_shims

    install_cpu_shims()
    ensure_megatron_parallel_state()
    from megatron.core.tensor_parallel import random as mrandom

    if not mrandom.get_cuda_rng_tracker().get_states():
        with torch.random.fork_rng(devices=[]):      # leave the global CPU RNG as it was
            mrandom.model_parallel_cuda_manual_seed(1234, tp_rank=0, ep_rank=0, etp_rank=0)


def build_layers(H, F_, E, k, heads, wg, w1, w2, seed: int = 0):
    """(ours, megatron): two megatron ``TransformerLayer``s from one config with identical weights."""
    _setup_megatron()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from ..megatron_adapter.args import config_from_megatron
    from ..megatron_adapter.layer import plugin_stats
    from ..megatron_adapter.peer import load_expert_weights, load_router_weight
    from ..megatron_adapter.spec import moe_plugin_spec

    # the plugin's process-wide StatsSink sums per-expert counts by layer number; a previous config with another
    # expert count under the same layer number would not add up
    plugin_stats().reset()

    config = _transformer_config(H, F_, E, k, heads)
    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
    plugin_cfg = config_from_megatron(config, world_size=1, gate="naive")
    if plugin_cfg.dispatch != "dropless" or plugin_cfg.aux_loss_coeff != 0.0:
        raise AssertionError(f"plugin config is not dropless without aux loss: {plugin_cfg}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        megatron_layer = TransformerLayer(config, spec.submodules, layer_number=1)
        ours_layer = TransformerLayer(config, moe_plugin_spec(spec, plugin_cfg).submodules, layer_number=1)
    # same weights: attention + norms by name, router and experts from the inputs
    load_router_weight(megatron_layer.mlp, wg)
    load_expert_weights(megatron_layer.mlp, w1, w2)
    theirs = dict(megatron_layer.named_parameters())
    with torch.no_grad():
        for name, p in ours_layer.named_parameters():
            if name.startswith("mlp."):
                continue
            p.copy_(theirs[name])
        ours_layer.mlp.router.gate.weight.copy_(wg)
        ours_layer.mlp.experts.bank.w1.copy_(w1)
        ours_layer.mlp.experts.bank.w2.copy_(w2)
    copied = {n for n, _ in ours_layer.named_parameters() if not n.startswith("mlp.")}
    missing = {n for n in theirs if not n.startswith("mlp.")} - copied
    if missing:
        raise AssertionError(f"megatron layer parameters with no counterpart in ours: {sorted(missing)}")
    return ours_layer, megatron_layer


def make_step(layer, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    """One forward+backward of a TransformerLayer ([S, B, H] in and out), grads cleared first."""
    xin = x.clone().requires_grad_()
    params = list(layer.parameters())

    def step():
        for p in params:
            p.grad = None
        xin.grad = None
        out, _ = layer(xin, attention_mask=None)
        out.backward(grad)

    step.xin = xin
    return step


def _expert_counts(layer, E: int) -> Dict[str, torch.Tensor]:
    """Forward hook on the MoE's router recording how many tokens each expert got, from the router's own output."""
    box = {}

    def hook(module, args, output):
        if isinstance(output, tuple):            # megatron TopKRouter: (probs, routing_map [T, E] bool)
            box["counts"] = output[1].detach().sum(0).long()
        else:                                    # PluginRouter: Routing with expert_ids [T, k]
            box["counts"] = torch.bincount(output.expert_ids.detach().reshape(-1), minlength=E).long()

    return box, layer.mlp.router.register_forward_hook(hook)


def check_agree(ours_layer, megatron_layer, x, grad, E: int) -> dict:
    """One forward+backward of each; outputs, input grads and expert grads must match, routings too."""
    res = {}
    outs = {}
    for name, layer in (("ours", ours_layer), ("megatron", megatron_layer)):
        box, handle = _expert_counts(layer, E)
        try:
            for p in layer.parameters():
                p.grad = None
            xin = x.clone().requires_grad_()
            out, _ = layer(xin, attention_mask=None)
            out.backward(grad)
        finally:
            handle.remove()
        outs[name] = (out.detach(), xin.grad.detach(), box["counts"])
    (yo, go, co), (ym, gm, cm) = outs["ours"], outs["megatron"]
    bank = ours_layer.mlp.experts.bank
    experts = megatron_layer.mlp.experts.local_experts
    gw1 = max(float((bank.w1.grad[e] - experts[e].linear_fc1.weight.grad.t()).abs().max()) for e in range(E))
    gw2 = max(float((bank.w2.grad[e] - experts[e].linear_fc2.weight.grad.t()).abs().max()) for e in range(E))
    res["out_diff"] = float((yo - ym).abs().max())
    res["xgrad_diff"] = float((go - gm).abs().max())
    res["wgrad_diff"] = max(gw1, gw2)
    res["counts"] = {"ours": co.tolist(), "megatron": cm.tolist()}
    res["load"] = {n: float(c.max()) / (float(c.sum()) / E) for n, c in (("ours", co), ("megatron", cm))}
    scale = {"out_diff": float(ym.abs().max()), "xgrad_diff": float(gm.abs().max()),
             "wgrad_diff": max(max(float(experts[e].linear_fc1.weight.grad.abs().max()),
                                   float(experts[e].linear_fc2.weight.grad.abs().max())) for e in range(E))}
    bad = [f"{n} {res[n]:.2e} (scale {scale[n]:.2e})" for n in scale if not res[n] <= 1e-4 * max(scale[n], 1e-6)]
    if not torch.equal(co, cm):
        bad.append(f"expert counts differ: ours {co.tolist()} megatron {cm.tolist()}")
    res["agree"] = not bad
    if bad:
        raise AssertionError("ours and megatron's transformer layers disagree: " + "; ".join(bad))
    return res


def time_rounds(fns: Dict[str, Callable[[], None]], repeat: int, warmup: int) -> Dict[str, List[float]]:
    """Per-callable times over ``repeat`` rounds after ``warmup`` untimed ones; each round runs every callable
    once, in alternating order."""
    names = list(fns)
    for i in range(warmup):
        for n in (names if i % 2 == 0 else names[::-1]):
            fns[n]()
    times = {n: [] for n in names}
    for i in range(repeat):
        for n in (names if i % 2 == 0 else names[::-1]):
            t = time.perf_counter()
            fns[n]()
            times[n].append(time.perf_counter() - t)
    return times


def run_config(name: str, routing: str, repeat: int, warmup: int, seed: int = 0) -> List[dict]:
    c = CONFIGS[name]
    H, F_, E, k, S, B, heads = c["H"], c["F"], c["E"], c["k"], c["S"], c["B"], c["heads"]
    x2d, wg, w1, w2 = make_inputs(H, F_, E, k, S * B, routing, seed=seed)
    x = x2d.view(S, B, H)
    grad = torch.randn(S, B, H, generator=torch.Generator().manual_seed(seed + 1))
    ours_layer, megatron_layer = build_layers(H, F_, E, k, heads, wg, w1, w2, seed=seed)
    check = check_agree(ours_layer, megatron_layer, x, grad, E)
    steps = {"ours": make_step(ours_layer, x, grad), "megatron": make_step(megatron_layer, x, grad)}
    times = time_rounds(steps, repeat, warmup)
    med = {n: statistics.median(ts) for n, ts in times.items()}
    rows = []
    for n in IMPLS:
        rows.append(dict(config=name, routing=routing, impl=n, time=med[n], times=times[n],
                         speedup=med["megatron"] / med[n], load=check["load"][n], counts=check["counts"][n],
                         out_diff=check["out_diff"], xgrad_diff=check["xgrad_diff"],
                         wgrad_diff=check["wgrad_diff"], agree=check["agree"]))
    return rows


def _label(cfg: str) -> str:
    c = CONFIGS[cfg]
    return (f"config {cfg}: H={c['H']} F={c['F']} E={c['E']} k={c['k']} seq={c['S']} x batch={c['B']} "
            f"(T={c['S'] * c['B']}) heads={c['heads']}")


def format_table(rows: List[dict]) -> str:
    out = []
    for cfg, routing in dict.fromkeys((r["config"], r["routing"]) for r in rows):
        group = [r for r in rows if r["config"] == cfg and r["routing"] == routing]
        g0 = group[0]
        out.append(f"{_label(cfg)}, routing {routing}: outputs agree: {'yes' if g0['agree'] else 'NO'} "
                   f"(max abs diff: output {g0['out_diff']:.2e}, input grad {g0['xgrad_diff']:.2e}, "
                   f"expert weight grads {g0['wgrad_diff']:.2e})")
        out.append("| routing | layer | median ms (fwd+bwd) | min..max ms | speedup (megatron / this) "
                   "| expert load max/mean |")
        out.append("|---|---|---:|---:|---:|---:|")
        for r in group:
            out.append(f"| {routing} | {r['impl']} | {r['time'] * 1e3:.1f} | {min(r['times']) * 1e3:.1f}.."
                       f"{max(r['times']) * 1e3:.1f} | {r['speedup']:.3f} | {r['load']:.2f} |")
        out.append("")
    return "\n".join(out).rstrip()


def targets(rows: List[dict]) -> List[str]:
    """The product owner's targets (>= 1.2x on skewed, never slower on balanced), checked on this run."""
    lines = []
    for cfg, routing in dict.fromkeys((r["config"], r["routing"]) for r in rows):
        o = next(r for r in rows if r["config"] == cfg and r["routing"] == routing and r["impl"] == "ours")
        s = o["speedup"]
        goal, ok = (">= 1.20", s >= 1.2) if routing == "skewed" else (">= 1.00", s >= 1.0)
        lines.append(f"config {cfg} {routing}: ours {s:.2f}x vs megatron (target {goal}: {'met' if ok else 'MISSED'})")
    return lines


def main(argv: Optional[List[str]] = None) -> List[dict]:
    p = argparse.ArgumentParser(prog="megamoe bench megatron", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="1,2", help="comma list of: " + ", ".join(
        f"{n} ({', '.join(f'{k}={v}' for k, v in c.items())})" for n, c in CONFIGS.items()))
    p.add_argument("--routing", default="balanced,skewed")
    p.add_argument("--repeat", type=int, default=11, help="timed rounds (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", help="also write the tables here")
    p.add_argument("--no-retain-freed-memory", action="store_true",
                   help="leave glibc's malloc thresholds alone")
    args = p.parse_args(argv)
    if args.repeat < 1 or args.warmup < 0:
        p.error("--repeat must be >= 1 and --warmup >= 0")
    names = args.configs.split(",")
    for n in names:
        if n not in CONFIGS:
            p.error(f"--configs: unknown config {n!r}; known: {', '.join(CONFIGS)}")
        if CONFIGS[n]["k"] < 2:
            p.error(f"--configs: config {n!r} has k=1 (megatron then needs pre-softmax routing; use k >= 2)")
    routings = args.routing.split(",")
    for r in routings:
        if r not in ("balanced", "skewed"):
            p.error(f"--routing: {r!r} is not balanced or skewed")
    torch.set_num_threads(args.threads)
    retained = False if args.no_retain_freed_memory else retain_freed_memory()
    rows = []
    for n in names:
        for r in routings:
            rows += run_config(n, r, args.repeat, args.warmup, seed=args.seed)
    header = (f"megatron-core TransformerLayer (attention + MoE MLP), CPU fp32, {args.threads} thread(s), median of "
              f"{args.repeat} interleaved forward+backward rounds after {args.warmup} warm-up round(s), one process, "
              f"glibc malloc {'retaining freed memory' if retained else 'default'}; torch {torch.__version__}.")
    table = format_table(rows)
    summary = "\n".join(targets(rows))
    emit_report([header, table, summary], args.output)
    return rows
