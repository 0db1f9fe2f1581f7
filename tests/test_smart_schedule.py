"""Smart schedule (FasterMoE §4.2): the pipelined grouped pairwise exchange computes what the plain all-to-all
path computes (outputs, input/gate/expert gradients) on 2 and 4 real gloo processes with uneven, partly empty
splits; its operation order; config validation; the plain-vs-smart timeline model against hand-drawn timelines."""

import pytest
import torch
import torch.distributed as dist

from conftest import run_distributed
from megamoe_plugin import ConfigError, MoEConfig, MoELayer
from megamoe_plugin.dispatch.smart import SmartDispatcher, schedule_groups
from megamoe_plugin.experts import onednn_available
from megamoe_plugin.gates import Gate, register_gate
from megamoe_plugin.parallel import ExpertParallel
from megamoe_plugin.perfmodel.schedule import (consecutive_groups, predict_schedule_times, schedule_timeline,
                                               speedup_upper_bound, step_traffic)


@register_gate("test_smart_skewed")
class SkewedGate(Gate):
    """Top-k over the logits with a popularity skew (expert 0 first), and with rank r sending nothing to the
    experts of rank (r + 1) % P (on 2 ranks only rank 0; on 4 also rank 0 nothing to rank 2): uneven splits and
    empty pairs."""

    def select(self, logits, probs):
        E, P, r = self.num_experts, self.ep.size, self.ep.rank
        per = E // P
        score = logits.detach() + torch.linspace(2.0, 0.0, E)
        banned = ({(r + 1) % P} if P > 2 or r == 0 else set()) | ({P // 2} if r == 0 and P > 2 else set())
        for b in banned:
            if b != r:
                score[:, b * per:(b + 1) * per] = float("-inf")
        ids = torch.topk(score, self.top_k, dim=-1).indices
        return ids, torch.ones_like(ids, dtype=torch.bool)


def _layers(world, groups, dtype, activation, bias, topology=""):
    base = MoEConfig(num_experts=2 * world, top_k=2, gate="test_smart_skewed", world_size=world,
                     expert_parallel_size=world, activation=activation, linear_bias=bias, aux_loss_coeff=0.01,
                     topology=topology)
    torch.manual_seed(7)
    plain = [MoELayer(base, 16, 24, ep_group=dist.group.WORLD, layer_id=i).to(dtype) for i in range(2)]
    smart_cfg = base.replace(schedule={0: "smart", -1: "smart:node"}.get(groups, f"smart:{groups}"))
    smart = [MoELayer(smart_cfg, 16, 24, ep_group=dist.group.WORLD, layer_id=i).to(dtype) for i in range(2)]
    for p, s in zip(plain, smart):
        with torch.no_grad():
            for q in s.experts.parameters():
                q.normal_(std=0.3)              # nonzero biases too
        p.load_state_dict(s.state_dict())
    return plain, smart


def _close(a, b, tol):
    if a.numel() == 0:
        return a.shape == b.shape
    return (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


def _equal_to_plain(rank, world, groups, dtype, activation, bias, topology="", expect_groups=None):
    plain, smart = _layers(world, groups, dtype, activation, bias, topology)
    if expect_groups is not None:
        assert smart[0].plan.smart.groups == expect_groups
    torch.manual_seed(100 + rank)
    T = ([37, 21] if world == 2 else [37, 0, 25, 50])[rank]    # uneven token counts; on 4 ranks one has none
    x = torch.randn(T, 16, dtype=dtype)
    g = torch.randn(T, 16, dtype=dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = plain[1](plain[0](xa)), smart[1](smart[0](xb))   # two layers: backward through two pipelines
    # fp64 goes to MKL's dgemm, whose row results depend on the row count (measured: ~1e-18 apart); weight
    # gradients are summed chunk by chunk: equal up to summation order
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    if dtype == torch.float32 and onednn_available():
        # oneDNN's row results do not depend on the row count here: same per-token math, bitwise equal
        assert torch.equal(ya, yb), (ya - yb).abs().amax()
    assert _close(ya, yb, tol)
    ((ya * g).sum() + plain[0].aux_loss + plain[1].aux_loss).backward()
    ((yb * g).sum() + smart[0].aux_loss + smart[1].aux_loss).backward()
    assert _close(xa.grad, xb.grad, tol)
    for p, s in zip(plain, smart):
        assert _close(p.gate.weight.grad, s.gate.weight.grad, tol)
        for name, q in p.experts.named_parameters():
            assert _close(q.grad, getattr(s.experts, name).grad, tol), name
    # the routing really is uneven, with empty pairs and traffic between ranks
    sent = smart[0].last_routing.counts.view(world, -1).sum(1)
    pairs = [torch.zeros(world, dtype=torch.long) for _ in range(world)]
    dist.all_gather(pairs, sent)
    pairs = torch.stack(pairs)                                  # [source, destination] tokens
    assert int((pairs == 0).sum()) >= world // 2 and len(set(pairs.view(-1).tolist())) > 2
    assert int(pairs.sum() - pairs.diagonal().sum()) > 0
    with torch.no_grad():                                       # no graph: same forward
        assert _close(plain[0](x), smart[0](x), tol)


def _order(rank, world):
    """Operation order of one forward and backward with n = world groups: S_{j+1} before C_j, R_j after C_j."""
    _, smart = _layers(world, world, torch.float64, "gelu", False)
    smart[0].plan.smart.trace = trace = []
    torch.manual_seed(rank)
    smart[0](torch.randn(20, 16, dtype=torch.float64, requires_grad=True)).sum().backward()
    n = world
    expected = [("S", 0)]
    for j in range(n):
        expected += ([("S", j + 1)] if j + 1 < n else []) + [("C", j), ("R", j)]
    assert trace == expected + expected, trace


def _two(rank, world):
    _equal_to_plain(rank, world, 2, torch.float64, "gelu", False, expect_groups=[[0], [1]])
    _equal_to_plain(rank, world, 2, torch.float32, "swiglu", True)
    # -1 = from the topology: a single node -> one group (plain exchange, no overlap), still equal
    _equal_to_plain(rank, world, -1, torch.float64, "relu", True, expect_groups=[[0, 1]])
    # 0 (the default) = one group per rank
    _equal_to_plain(rank, world, 0, torch.float64, "gelu", False, expect_groups=[[0], [1]])
    _order(rank, world)


def _four(rank, world):
    _equal_to_plain(rank, world, 2, torch.float64, "gelu", True, expect_groups=[[0, 1], [2, 3]])
    _equal_to_plain(rank, world, 4, torch.float64, "swiglu", False, expect_groups=[[0], [1], [2], [3]])
    _equal_to_plain(rank, world, 4, torch.float32, "gelu", False)
    _equal_to_plain(rank, world, 2, torch.float32, "gelu", False)
    _equal_to_plain(rank, world, -1, torch.float64, "gelu", False, topology="[[0,1],[2,3]]",
                    expect_groups=[[0, 1], [2, 3]])
    _order(rank, world)


def test_smart_equals_plain_on_2_processes():
    run_distributed(_two, 2)


def test_smart_equals_plain_on_4_processes():
    run_distributed(_four, 4)


# --- single process -----------------------------------------------------------------------------------------------
def test_one_rank_is_the_plain_path():
    cfg = MoEConfig(num_experts=4, top_k=2, gate="naive", schedule="smart")
    torch.manual_seed(0)
    plain, smart = MoELayer(cfg.replace(schedule="plain"), 8, 12), MoELayer(cfg, 8, 12)
    smart.load_state_dict(plain.state_dict())
    assert smart.plan.smart is None
    x = torch.randn(10, 8)
    assert torch.equal(plain(x), smart(x))


@pytest.mark.parametrize("kwargs, flag", [
    (dict(schedule="fast"), "--moe-schedule"),
    (dict(schedule="smart", dispatch="capacity"), "--moe-schedule"),
    (dict(schedule="smart:-2"), "--moe-schedule"),
    (dict(schedule="smart:3", num_experts=8, expert_parallel_size=4, world_size=4), "--moe-schedule"),
])
def test_invalid_schedule_options_name_the_flag(kwargs, flag):
    with pytest.raises(ConfigError) as err:
        MoEConfig(**kwargs)
    assert flag in str(err.value)


def test_groups_from_flag_and_topology():
    cfg = MoEConfig(num_experts=8, world_size=4, expert_parallel_size=4, schedule="smart", topology="[[0,1],[2,3]]")
    ep4 = ExpertParallel.layout(0, [0, 1, 2, 3])
    assert schedule_groups(cfg, ep4) == [[0], [1], [2], [3]]                           # default: one per rank
    cfg = cfg.replace(schedule="smart:node")
    assert schedule_groups(cfg, ep4) == [[0, 1], [2, 3]]                              # one group per node
    assert schedule_groups(cfg.replace(schedule="smart:2"), ep4) == [[0, 1], [2, 3]]
    assert schedule_groups(cfg.replace(schedule="smart:1"), ep4) == [[0, 1, 2, 3]]
    cross = ExpertParallel.layout(0, [0, 2])          # an EP group spanning the two nodes
    assert schedule_groups(cfg.replace(expert_parallel_size=2), cross) == [[0], [1]]
    inside = ExpertParallel.layout(0, [2, 3])         # an EP group inside node 1
    assert schedule_groups(cfg.replace(expert_parallel_size=2), inside) == [[0, 1]]
    with pytest.raises(ValueError, match="layout-only"):
        SmartDispatcher(8, ep4, [[0, 1], [2, 3]])


# --- the timeline model -------------------------------------------------------------------------------------------
def test_predict_schedule_times_hand_timelines():
    # S = [1, 2], C = [3, 1], R = S. Sequential: 1+2+3+1+1+2 = 10. Two streams:
    #   comm: S0 [0,1] S1 [1,3]             R0 [4,5] R1 [5,7]
    #   comp:          C0 [1,4] C1 [4,5]
    assert predict_schedule_times([1, 2], [3, 1]) == (10.0, 7.0)
    assert schedule_timeline([1, 2], [3, 1]) == [("S", 0, 0, 1), ("S", 1, 1, 3), ("C", 0, 1, 4), ("C", 1, 4, 5),
                                                 ("R", 0, 4, 5), ("R", 1, 5, 7)]
    # communication-bound, 3 steps, local step free: S = [0, 4, 4], C = [1, 1, 1], R = [0, 4, 4]
    #   comm: S1 [0,4] S2 [4,8] R0 [8,8] R1 [8,12] R2 [12,16]; comp: C0 [0,1] C1 [4,5] C2 [8,9]
    assert predict_schedule_times([0, 4, 4], [1, 1, 1]) == (19.0, 16.0)
    # computation-bound: S = [1, 1], C = [5, 5], R = [1, 1]: C0 [1,6] C1 [6,11] R0 [6,7] R1 [11,12]
    assert predict_schedule_times([1, 1], [5, 5]) == (14.0, 12.0)
    # separate return times: S = [2, 2], C = [1, 1], R = [0.5, 3]: S1 ends 4, C0 [2,3], C1 [4,5],
    # R0 [4,4.5], R1 [5,8]
    assert predict_schedule_times([2, 2], [1, 1], [0.5, 3]) == (9.5, 8.0)
    # one group: nothing overlaps
    assert predict_schedule_times([2], [3]) == (7.0, 7.0)
    assert speedup_upper_bound(3.0, 1.0) == pytest.approx(4 / 3)
    with pytest.raises(ValueError):
        predict_schedule_times([1, 2], [1])


def test_step_traffic_splits_pairs_by_step():
    tokens = torch.arange(16, dtype=torch.float64).view(4, 4)
    steps = step_traffic(tokens, consecutive_groups(4, 2))
    assert torch.equal(sum(steps), tokens)
    # step 0: inside each group of 2; step 1: across the groups
    assert steps[0][0, 1] == 1 and steps[0][0, 2] == 0 and steps[1][0, 2] == 2 and steps[1][3, 1] == 13
    steps = step_traffic(tokens, consecutive_groups(4, 4))
    # step j: rank i sends to rank i - j
    for j in range(4):
        for i in range(4):
            assert steps[j][i, (i - j) % 4] == tokens[i, (i - j) % 4]
            assert steps[j][i].sum() == tokens[i, (i - j) % 4]


def test_schedule_benchmark_runs(capsys):
    from megamoe_plugin.bench import schedule as bench
    res = bench.main(["--config", "tiny", "--iters", "2", "--warmup", "1", "--no-calibrate", "--profile", "trevor"])
    out = capsys.readouterr().out
    assert "plain / smart" in out and "predicted: components" in out and "'trevor'" in out
    assert res["measured"]["plain"] > 0 and res["measured"]["smart"] > 0 and res["components_ratio"] > 0
    assert res["max_abs_diff"] < 1e-5 and res["groups"] == [[0], [1]]
    assert len(res["components"]["S"]) == 2
