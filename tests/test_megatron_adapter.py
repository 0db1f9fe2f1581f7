"""The plugin inside megatron-core, in one process (real megatron-core, CPU shims, a 1-rank gloo group):

- same weights, same batch: PluginMoELayer (built by Megatron from the substituted spec, aux losses entering through
  MoEAuxLossAutoScaler) gives the core MoELayer's output, loss and gradients;
- every gate is selectable by flag and is the one that routes;
- bad flag combinations fail at argument validation, with the flag named, before anything is built.
"""

import pytest
import torch

from megamoe_plugin.config import ConfigError, MoEConfig
from megamoe_plugin.megatron_adapter.peer import ensure_megatron_parallel_state

H, F, E = 32, 64, 4


def _trainer_module():
    from megamoe_plugin.megatron_adapter import trainer
    return trainer


def _plugin_layer(gate="naive", **flags):
    from megamoe_plugin.megatron_adapter.compat import build_mlp
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megamoe_plugin.megatron_adapter.args import config_from_megatron
    from megamoe_plugin.megatron_adapter.spec import moe_plugin_spec

    ensure_megatron_parallel_state()
    top_k = flags.pop("top_k", 2)
    tc = TransformerConfig(num_layers=2, hidden_size=H, ffn_hidden_size=F, num_attention_heads=4, num_moe_experts=E,
                           moe_router_topk=top_k, moe_router_pre_softmax=top_k == 1, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001,
                           use_cpu_initialization=True, add_bias_linear=False, bias_dropout_fusion=False,
                           gradient_accumulation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False)
    cfg = config_from_megatron(tc, world_size=1, gate=gate, second_expert_policy="all", **flags)
    spec = moe_plugin_spec(get_gpt_layer_local_spec(num_experts=E), cfg)
    layer = build_mlp(spec.submodules.mlp, tc)
    layer.set_layer_number(1)
    return layer, cfg


def test_plugin_layer_matches_core_layer():
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megamoe_plugin.megatron_adapter.doctor import core_twin
    from megamoe_plugin.megatron_adapter.layer import PluginMoELayer

    torch.manual_seed(0)
    layer, cfg = _plugin_layer("naive")
    assert isinstance(layer, PluginMoELayer)
    core = core_twin(layer, cfg)                   # the core layer with the same weights
    x = torch.randn(8, 3, H)
    xm, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    out, bias = layer(xm)
    assert bias is None and out.shape == x.shape
    out.square().sum().backward()                     # aux losses ride along through the autoscaler
    yc = core(xc.reshape(-1, H))
    (yc.square().sum() + core.aux_loss).backward()
    assert set(layer.aux_losses) == {"balance", "z"} and core.aux_loss > 0
    torch.testing.assert_close(out.reshape(-1, H), yc, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xm.grad, xc.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.router.gate.weight.grad, core.gate.weight.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(layer.experts.bank.w1.grad, core.experts.w1.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(layer.experts.bank.w2.grad, core.experts.w2.grad, rtol=1e-5, atol=1e-7)
    # the aux loss really reached the router: without it the router gradient differs
    core.zero_grad()
    core(x.reshape(-1, H)).square().sum().backward()
    assert not torch.allclose(core.gate.weight.grad, layer.router.gate.weight.grad)


@pytest.mark.parametrize("gate,top_k", [("switch", 1), ("gshard", 2), ("naive", 3), ("hir", 2), ("ta_moe", 2)])
def test_each_gate_selectable_by_flag_and_used(gate, top_k, monkeypatch):
    from megamoe_plugin.gates import registry

    mod = _trainer_module()
    args = mod.parse_args(["--num-experts", str(E), "--moe-router-topk", str(top_k), "--moe-plugin",
                           "--moe-aux-loss-coeff", "0.01",
                           *(["--moe-router-pre-softmax"] if top_k == 1 else []),
                           "--moe-plugin-gate", gate, "--moe-plugin-topology", "[[0]]"])
    assert args.moe_plugin_config.gate == gate and args.moe_plugin_config.top_k == top_k
    layer, _ = _plugin_layer(gate, top_k=top_k, topology="[[0]]")
    cls = type(layer.router.gate)
    assert registry.registered_gates()[gate] is cls
    calls = []
    real = cls.select
    monkeypatch.setattr(cls, "select", lambda self, *a: calls.append(1) or real(self, *a))
    layer(torch.randn(4, 2, H))
    assert calls and layer.last_routing.expert_ids.shape == (8, top_k)


BAD = [
    (["--moe-plugin", "--moe-plugin-gate", "switch", "--moe-router-topk", "2"], "--moe-router-topk=2"),
    (["--moe-plugin-gate", "hir"], "--moe-plugin-gate given without --moe-plugin"),
    (["--moe-plugin", "--num-experts", "0"], "--num-experts"),
    (["--moe-plugin", "--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "0.01"],
     "--moe-router-load-balancing-type=sinkhorn with --moe-aux-loss-coeff=0.01"),
    (["--moe-plugin", "--moe-router-enable-expert-bias"], "needs --moe-router-score-function sigmoid"),
    (["--moe-plugin", "--moe-router-num-groups", "2", "--moe-router-group-topk", "3"],
     "--moe-router-group-topk=3: cannot exceed --moe-router-num-groups=2"),
    (["--moe-plugin", "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss", "--moe-aux-loss-coeff", "0.1"],
     "give one coefficient per --moe-router-load-balancing-type"),
    (["--moe-plugin", "--moe-plugin-placement", "no_such_module:Policy"], "--moe-plugin-placement"),
    (["--moe-plugin", "--moe-plugin-gate", "nope"], "--moe-plugin-gate"),
    (["--moe-plugin", "--moe-plugin-topology", "[[0,1]]", "--moe-plugin-gate", "hir"], "--moe-plugin-topology"),
]


@pytest.mark.parametrize("argv,needle", BAD, ids=[b[1] for b in BAD])
def test_bad_flag_combinations_fail_at_argument_validation(argv, needle, capsys):
    mod = _trainer_module()
    base = [] if "--num-experts" in argv else ["--num-experts", str(E)]
    with pytest.raises((ConfigError, SystemExit)) as err:
        mod.parse_args(base + argv)
    text = str(err.value) + capsys.readouterr().err
    assert needle in text, text


def test_tensor_parallel_needs_sequence_parallel_and_expert_tp_1(monkeypatch):
    mod = _trainer_module()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="--expert-tensor-parallel-size"):
        mod.parse_args(["--num-experts", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                        "--moe-plugin"])
    with pytest.raises(ConfigError, match="--sequence-parallel"):
        mod.parse_args(["--num-experts", "4", "--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size",
                        "1", "--moe-plugin"])
    args = mod.parse_args(["--num-experts", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                           "--expert-tensor-parallel-size", "1", "--moe-plugin"])
    assert isinstance(args.moe_plugin_config, MoEConfig)


def test_the_plugin_calls_no_deprecated_megatron_api():
    """A training forward/backward of the plugin's layer with every loss, the metrics report and a sharded state
    dict: no DeprecationWarning / FutureWarning raised from the plugin's own code (megatron-core's deprecated
    calls, e.g. save_to_aux_losses_tracker, warn at their caller)."""
    import os
    import warnings

    import megamoe_plugin
    from megamoe_plugin.megatron_adapter.trainer import report_moe_metrics

    pkg = os.path.dirname(megamoe_plugin.__file__)
    layer, _ = _plugin_layer("topk", top_k=2, z_loss_coeff=0.001)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, _ = layer(torch.randn(8, 3, H))
        out.sum().backward()
        aux = {}
        report_moe_metrics(loss_scale=1.0, iteration=1, total_loss_dict=aux, force_initialize=True,
                           track_names=["load_balancing_loss", "z_loss"], num_layers=2, moe_layer_freq=1)
        layer.sharded_state_dict(prefix="decoder.layers.0.mlp.")
    assert aux["load_balancing_loss"] > 0 and aux["z_loss"] > 0, aux       # (other names: earlier tests' entries)
    ours = [f"{w.category.__name__} at {w.filename}:{w.lineno}: {w.message}" for w in caught
            if issubclass(w.category, (DeprecationWarning, FutureWarning)) and w.filename.startswith(pkg)]
    assert not ours, ours


@pytest.mark.one_release
def test_topology_aware_gates_take_megatrons_router_flags():
    """--moe-plugin-gate node_limited_sender reads M from --moe-router-group-topk (megatron-core's own router, which
    it replaces, would ask for --moe-router-num-groups); ta_moe with the expert bias steers by bias and keeps the
    gate's gradients reduced as usual."""
    from megamoe_plugin.config import ConfigError
    trainer = _trainer_module()
    args = trainer.parse_args(["--num-experts", "4", "--moe-plugin", "--moe-plugin-gate", "node_limited_sender",
                               "--moe-router-group-topk", "1", "--moe-router-score-function", "sigmoid",
                               "--moe-router-enable-expert-bias"])
    cfg = args.moe_plugin_config
    assert (cfg.gate, cfg.group_topk, cfg.num_groups) == ("node_limited_sender", 1, 0)
    assert args.moe_router_group_topk is None
    assert trainer.transformer_config(args).moe_router_group_topk is None      # megatron-core accepts it
    from megamoe_plugin.megatron_adapter.args import config_from_megatron
    assert config_from_megatron(args).group_topk == 1                          # a second validation sees M again
    with pytest.raises(ConfigError, match="--moe-router-num-groups"):
        trainer.parse_args(["--num-experts", "4", "--moe-plugin", "--moe-plugin-gate", "node_limited",
                            "--moe-router-group-topk", "1", "--moe-router-num-groups", "2"])
    ta = trainer.parse_args(["--num-experts", "4", "--moe-plugin", "--moe-plugin-gate", "ta_moe",
                             "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"])
    assert ta.moe_plugin_config.gate_sync_mode == ("all", 0) and ta.moe_plugin_config.per_rank_gate_state
