"""Topology parsing, levels, launcher defaults, and TA-MoE's target dispatch pattern."""
import pytest
import torch

from megamoe_plugin import Topology
from megamoe_plugin.gates import target_dispatch_pattern


def test_levels_and_nodes():
    t = Topology.parse("[[0,1],[2,3]]")
    assert t.depth == 2 and t.num_ranks == 4
    assert t.level_matrix().tolist() == [[0, 1, 2, 2], [1, 0, 2, 2], [2, 2, 0, 1], [2, 2, 1, 0]]
    assert t.node_ids() == [0, 0, 1, 1] and t.ranks_per_node(3) == 2
    t3 = Topology.parse("[[[0,1],[2,3]],[[4,5]]]")
    assert t3.level(0, 2) == 2 and t3.level(0, 4) == 3 and t3.level(4, 5) == 1
    assert t3.node_ids() == [0, 0, 1, 1, 2, 2]
    bw = t.bandwidth_matrix()
    assert bw[0, 1] == 100e9 and bw[0, 2] == 12.5e9 and torch.isinf(bw[0, 0])


def test_from_env_layouts(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert Topology.from_env().spec() == "[[0,1,2,3],[4,5,6,7]]"
    assert Topology.from_env(world_size=3, local_world_size=3).spec() == "[0,1,2]"
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        Topology.from_env(world_size=6, local_world_size=4)


@pytest.mark.parametrize("bad", ["[[0,1],[1,2]]", "[[0,2],[3,4]]", "[[0],[1,[2]]]", "[[]]", "[[0,1.5]]", "7"])
def test_bad_specs(bad):
    with pytest.raises(ValueError):
        Topology.parse(bad)


def test_target_pattern_reproduces_ta_moe_table_1():
    # [[0,1],[0^,1^]], intra/inter bandwidth 4:1, latency negligible: the paper's uneven pattern (1/4,1/2,1/8,1/8)
    t = Topology.parse("[[0,1],[2,3]]", bandwidth_gbps=[4, 1], latency_us=[0, 0])
    c = target_dispatch_pattern(t, smoothing=0.0)
    assert torch.allclose(c[0], torch.tensor([0.25, 0.5, 0.125, 0.125], dtype=torch.float64), atol=1e-9)


def test_target_pattern_properties():
    t = Topology.parse("[[[0,1],[2,3]],[[4,5]]]", bandwidth_gbps=[50, 10, 2], latency_us=[1, 5, 20])
    c = target_dispatch_pattern(t, exchange_bytes=8e6, smoothing=0.0)
    assert torch.allclose(c.sum(1), torch.ones(6, dtype=torch.float64))          # Eq. 3
    assert torch.allclose(c.sum(0), torch.ones(6, dtype=torch.float64), atol=1e-6)  # Eq. 4 (balanced experts)
    assert c[0, 1] > c[0, 2] > c[0, 4]                                           # faster links carry more
    smoothed = target_dispatch_pattern(t, exchange_bytes=8e6, smoothing=0.5)
    assert smoothed.min() >= 0.5 / 6 - 1e-12                                      # no expert isolated
    homogeneous = target_dispatch_pattern(Topology.parse("[0,1,2,3]"), smoothing=0.0)
    assert torch.allclose(homogeneous, torch.full((4, 4), 0.25, dtype=torch.float64))


def test_topology_command_prints_the_target_pattern(capsys):
    from megamoe_plugin.cli import main
    assert main(["topology", "--moe-topology", "[[0,1],[2,3]]", "--moe-topology-bandwidth-gbps", "4,1",
                 "--moe-topology-latency-us", "0,0"]) == 0
    out = capsys.readouterr().out
    assert "0.500" in out and "0.125" in out and "[[0,1],[2,3]]" in out


def test_discovered_tree_from_pair_bandwidths():
    import torch
    fast, slow = 3e9, 25e6
    bw = torch.full((4, 4), slow, dtype=torch.float64)
    bw[0, 1] = bw[1, 0] = fast
    bw[2, 3] = bw[3, 2] = 0.9 * fast
    t = Topology.from_pair_bandwidths(bw)
    assert t.spec() == "[[0,1],[2,3]]"
    assert t.bandwidth_gbps[1] == pytest.approx(slow / 1e9) and t.bandwidth_gbps[0] > 2.5
    assert Topology.from_pair_bandwidths(torch.full((4, 4), slow, dtype=torch.float64)).spec() == "[0,1,2,3]"
    bw[0, 2] = bw[2, 0] = fast                                   # ranks 0-1-2-3 chained: one node of 4
    assert Topology.from_pair_bandwidths(bw).spec() == "[0,1,2,3]"


def test_from_env_takes_the_emulated_clusters_topology(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("MEGAMOE_TOPOLOGY", "[[0,1],[2,3]]")
    monkeypatch.setenv("MEGAMOE_TOPOLOGY_BANDWIDTH_GBPS", "3.0,0.1")
    t = Topology.from_env()
    assert t.spec() == "[[0,1],[2,3]]" and t.bandwidth_gbps == [3.0, 0.1]
    assert Topology.from_env(bandwidth_gbps=[5, 1]).bandwidth_gbps == [5.0, 1.0]      # explicit flags win
    monkeypatch.setenv("WORLD_SIZE", "2")                                              # another job's variable
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert Topology.from_env().spec() == "[0,1]"


def test_bandwidth_units():
    from megamoe_plugin.cluster import parse_bandwidth
    assert parse_bandwidth("25MB/s") == 25e6 and parse_bandwidth("200Mbit") == 25e6
    assert parse_bandwidth("1.5GB/s") == 1.5e9 and parse_bandwidth("2MiB/s") == 2 * 1024 ** 2
    assert parse_bandwidth("3e7") == 3e7                          # a bare number: bytes/s
    with pytest.raises(ValueError, match="give a unit"):
        parse_bandwidth("25")                                     # 25 bytes/s: a unit left out, refused
    with pytest.raises(ValueError, match="unknown bandwidth unit"):
        parse_bandwidth("3 furlongs")
