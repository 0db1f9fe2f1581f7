"""``megamoe bench planners``: the balance bound (the expert compute perfect balance saves on a run's routing)."""
import os

import pytest
import torch

from megamoe_plugin.bench import planners
from megamoe_plugin.perfmodel.profiles import HardwareProfile


def _profile(tmp_path, gflops: float) -> str:
    path = str(tmp_path / "p.json")
    HardwareProfile(name="t", nodes=1, gpus_per_node=2, gemm_tflops=gflops / 1e3, bytes_per_element=4).save(path)
    return path


def test_balance_bound_is_the_busiest_ranks_excess_compute(tmp_path):
    """Two ranks of two experts: rank 0's expert gets 300 rows, rank 1's 100 (the bound counts the second half of
    the steps). Every rank at the mean, 200 rows, saves 100 rows of forward + backward: 3 x 100 x 4 H F FLOPs at
    the profile's rate, in each of the two layers."""
    hidden, ffn = 256, 512                     # the benchmark's model (MODEL)
    counts = torch.zeros(4, 2, 2, 2)            # [S, L, P source, E]
    counts[:, :, 0, 0] = 150.0
    counts[:, :, 1, 0] = 150.0                  # expert 0 (rank 0's block): 300 rows
    counts[:, :, 1, 1] = 100.0                  # expert 1 (rank 1's block): 100 rows
    counts[:2] = 1.0                            # the first half does not count
    saved = planners.balance_bound_saving(counts, _profile(tmp_path, 10.0))
    expected = 2 * 3.0 * 100 * 4 * hidden * ffn / 10e9
    assert saved == pytest.approx(expected, rel=1e-9)
    balanced = torch.full((4, 2, 2, 2), 50.0)
    assert planners.balance_bound_saving(balanced, _profile(tmp_path, 10.0)) == pytest.approx(0.0, abs=1e-12)
    assert planners.balance_bound_saving(counts, None) is None


def test_profile_of_reads_the_path_the_policy_logged(tmp_path):
    path = _profile(tmp_path, 10.0)
    os.makedirs(tmp_path / "run" / "logs")
    with open(tmp_path / "run" / "logs" / "rank0.log", "w") as f:
        f.write(f"megamoe-plugin: placement cost model: the cached calibration of this cluster ({path})\n")
    assert planners._profile_of(str(tmp_path / "run")) == path
    with open(tmp_path / "run" / "logs" / "rank0.log", "w") as f:
        f.write("megamoe-plugin: placement cost model: calibrated this cluster in 1.4s: 31.0 GFLOP/s per rank, "
                f"links 0.655 / 0.102 GB/s (intra / inter-node), cached in {path}\n")
    assert planners._profile_of(str(tmp_path / "run")) == path
    assert planners._profile_of(str(tmp_path / "nowhere")) is None


def test_the_table_says_how_long_the_steps_waited_for_overlapped_gradient_reduces():
    row = {"run": "flexmoe_overlap", "step_seconds": 2.0, "token_efficiency": 1.0, "expert_efficiency": 0.9,
           "moves": 4, "final_valid_loss": 2.8, "sync_wait_s": 0.0125}
    static = dict(row, run="static", sync_wait_s=None)
    text = planners.format_results({"cells": [{"tokens_per_rank": 2048, "inter_node_bandwidth": 100e6,
                                               "routing": "skewed", "rows": [static, row]}]})
    assert "flexmoe_overlap: 12.5 ms per step waited at the backward's end for the overlapped replicas'" in text
    assert not [line for line in text.splitlines() if "static:" in line and "waited" in line]
    shadow = dict(row, run="shadow_overlap", sync_wait_s=None, shadow_wait_s=0.003)
    text = planners.format_results({"cells": [{"tokens_per_rank": 2048, "inter_node_bandwidth": 100e6,
                                               "routing": "skewed", "rows": [static, shadow]}]})
    assert "shadow_overlap: 3.0 ms per step waited at the backward's end for the overlapped shadows' reduces" in text


def test_replica_runs_take_a_spare_slot_count_policy_runs_an_interval_and_others_do_not():
    assert planners.run_flags("flexmoe_overlap_spare2", 1.25) == [
        "--moe-placement", "flexmoe", "--moe-placement-overlap-sync", "--moe-placement-spare-slots", "2"]
    assert planners.run_flags("eplb", 1.25) == ["--moe-placement", "eplb"]
    assert planners.run_flags("flexmoe_overlap_spare2_every5", 1.25) == [
        "--moe-placement", "flexmoe", "--moe-placement-overlap-sync",
        "--moe-placement-spare-slots", "2", "--moe-placement-interval", "5"]
    assert planners.run_flags("shadow_every3", 1.25) == ["--moe-placement", "shadow", "--moe-placement-interval", "3"]
    assert planners.run_flags("shadow_guard0", 1.25) == ["--moe-placement", "shadow", "--moe-placement-guard", "0.0"]
    assert planners.run_flags("eplb_guard5", 1.25) == ["--moe-placement", "eplb", "--moe-placement-guard", "0.05"]
    assert planners.run_flags("flexmoe_unguarded", 1.25) == ["--moe-placement", "flexmoe", "--moe-placement-guard", "-1"]
    assert planners.run_flags("eplb_unguarded_spare2", 1.25) == [
        "--moe-placement", "eplb", "--moe-placement-guard", "-1", "--moe-placement-spare-slots", "2"]
    for bad in ("static_spare2", "shadow_spare1", "flexmoe_spare0", "flexmoe_spare", "nothing", "static_every5",
                "idle_every5", "flexmoe_every0", "flexmoe_every5_spare2", "flexmoe_plan3", "shadow_sync",
                "static_guard0", "idle_guard0", "shadow_guard0_every5", "flexmoe_unguarded_guard3"):
        assert planners.split_run(bad) is None, bad
    assert sorted(["eplb", "flexmoe_spare2", "static", "flexmoe_spare2_every5", "flexmoe", "eplb_guard0"],
                  key=planners.run_order) == ["static", "flexmoe", "flexmoe_spare2", "flexmoe_spare2_every5", "eplb",
                                              "eplb_guard0"]
    with pytest.raises(SystemExit, match="static_spare2: unknown"):
        planners.main(["--runs", "static,static_spare2", "--steps", "1"])


def test_rounds_alternate_the_order_of_the_runs_so_static_is_not_always_first():
    runs = ["static", "flexmoe", "shadow", "eplb", "idle"]
    assert planners.round_order(runs, 0) == runs
    assert planners.round_order(runs, 1) == ["idle", "eplb", "shadow", "flexmoe", "static"]
    assert planners.round_order(runs, 2) == runs
    positions = {r: sum(planners.round_order(runs, k).index(r) for k in range(2)) for r in runs}
    assert set(positions.values()) == {len(runs) - 1}     # over a pair of rounds every run has the same mean place
    assert runs == ["static", "flexmoe", "shadow", "eplb", "idle"]    # the caller's list is not reordered
