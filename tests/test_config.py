"""Every invalid option fails at construction with a message naming the option; the registry is extensible."""
import pytest
import torch

from megamoe_plugin import ConfigError, MoEConfig, MoELayer
from megamoe_plugin.config import iter_options
from megamoe_plugin.gates import Gate, register_gate


@pytest.mark.parametrize("kwargs, flag", [
    (dict(top_k=9, num_experts=8, gate="naive"), "--moe-top-k"),
    (dict(num_experts=6, expert_parallel_size=4, world_size=4), "--moe-num-experts"),
    (dict(capacity_factor=0.0), "--moe-capacity-factor"),
    (dict(capacity_factor=-1.0), "--moe-capacity-factor"),
    (dict(gate="nope"), "--moe-gate"),
    (dict(topology="[[0,1],[2,3]]", world_size=2), "--moe-topology"),
    (dict(topology="[[0,1],[1,2]]", world_size=4), "--moe-topology"),
    (dict(topology="[[0,1],2,3]", world_size=4), "--moe-topology"),
    (dict(topology="not a list", world_size=4), "--moe-topology"),
    (dict(topology="[[0,1],[2,3]]", world_size=4, topology_bandwidth_gbps="1,2,3"), "--moe-topology"),
    (dict(topology_bandwidth_gbps="10,-1", topology="[[0,1],[2,3]]", world_size=4), "--moe-topology-bandwidth"),
    (dict(gate="switch", top_k=2), "--moe-top-k"),
    (dict(gate="gshard", top_k=1), "--moe-top-k"),
    (dict(dispatch="padded"), "--moe-dispatch"),
    (dict(activation="tanh"), "--moe-activation"),
    (dict(expert_parallel_size=3, num_experts=6, world_size=4), "--moe-expert-parallel-size"),
    (dict(num_experts="eight"), "--moe-num-experts"),
    (dict(jitter_eps=1.5), "--moe-jitter-eps"),
    (dict(num_experts=0), "--moe-num-experts"),
])
def test_invalid_values_name_the_option(kwargs, flag):
    with pytest.raises(ConfigError) as err:
        MoEConfig(**kwargs)
    assert flag in str(err.value)


def test_hir_needs_a_topology_matching_the_world():
    with pytest.raises(ConfigError, match="--moe-topology"):
        MoEConfig(gate="hir", topology="[[0,1],[2,3]]", world_size=8)


def test_world_size_from_launcher_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = MoEConfig(gate="hir")
    assert cfg.build_topology().spec() == "[[0,1],[2,3]]"
    with pytest.raises(ConfigError, match="--moe-expert-parallel-size"):
        MoEConfig(expert_parallel_size=3, num_experts=6)


def test_strings_from_command_lines_are_converted():
    cfg = MoEConfig(num_experts="16", capacity_factor="1.5", normalize_top_k="false")
    assert cfg.num_experts == 16 and cfg.capacity_factor == 1.5 and cfg.normalize_top_k is False


def test_layer_rejects_group_size_mismatch():
    with pytest.raises(ConfigError, match="--moe-expert-parallel-size"):
        MoELayer(MoEConfig(expert_parallel_size=2, world_size=2), 8, 16)


def test_every_option_has_help_and_type():
    opts = list(iter_options())
    # a new option has to displace one: the measured mechanisms and the papers' features fit in 55
    assert 20 < len(opts) <= 55, [o["name"] for o in opts]
    for o in opts:
        assert o["help"] and o["type"] in (int, float, bool, str) and o["flag"].startswith("--moe-")
        assert isinstance(o["default"], o["type"])


def test_register_gate_decorator_extends_the_registry():
    @register_gate("test_last_expert")
    class LastExpertGate(Gate):
        def select(self, logits, probs):
            ids = torch.full((probs.shape[0], self.top_k), self.num_experts - 1, dtype=torch.long)
            return ids, torch.ones_like(ids, dtype=torch.bool)

    cfg = MoEConfig(gate="test_last_expert", top_k=1, num_experts=4)
    layer = MoELayer(cfg, 8, 16)
    layer(torch.randn(5, 8))
    assert layer.last_routing.counts.tolist() == [0, 0, 0, 5]
    with pytest.raises(ValueError, match="already registered"):
        register_gate("naive")(LastExpertGate)


def test_an_option_dict_of_an_earlier_release_loads_in_this_releases_spelling():
    """A checkpoint's option dict from before the options were folded: renamed and folded options are mapped,
    retired constants dropped, anything else still refused."""
    now = MoEConfig().to_dict()
    now.pop("linear_bias")
    old = dict(now, expert_bias=True, router_bias=False, schedule="smart", smart_groups=-1, placement_prefetch=False,
               capacity_spread=0.0, init_std=0.01)
    cfg = MoEConfig.from_dict(old)
    assert cfg.linear_bias and cfg.schedule == "smart:node"
    assert MoEConfig.from_dict(dict(old, smart_groups=1)).schedule == "smart:1"
    assert MoEConfig.from_dict(dict(old, smart_groups=0)).schedule == "smart"
    dyn = MoEConfig.from_dict(dict(now, dispatch="capacity", capacity_policy="dynamic", capacity_quantile=0.9))
    assert dyn.capacity_policy == "quantile"
    assert MoEConfig.from_dict(dict(now, dispatch="capacity", capacity_policy="dynamic",
                                    capacity_quantile=0.0)).capacity_policy == "dynamic"
    with pytest.raises(ConfigError, match="unknown MoE option"):
        MoEConfig.from_dict(dict(old, no_such_option=1))
