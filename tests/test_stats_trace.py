"""StatsSink.summary (single process and a real 2-process gloo group), TraceRecorder + load_trace (2 gloo ranks).

Routing is forced by a test gate whose ``select`` returns a plan set by the test, so every expected number
(kept assignments under GShard's capacity rule, counts, dropped fraction, FlexMoE balance ratio) is computed here
by hand from that plan, independently of the code under test.
"""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from conftest import run_distributed
from megamoe_plugin import MoEConfig, MoELayer, StatsSink, TraceRecorder, load_trace
from megamoe_plugin.gates import Gate, Routing, register_gate

E, K, H, FFN = 4, 2, 8, 12
CAP = [2, 3, 1, 4]                       # fixed per-expert capacity (per source rank): forces drops


@register_gate("test_stats_planned")
class PlannedGate(Gate):
    """Routes by the plan the test sets: ``plan`` [T, k] expert ids, ``plan_kept`` [T, k] gate-level keep mask."""
    plan = None
    plan_kept = None

    def select(self, logits, probs):
        assert self.plan is not None and self.plan.shape == (logits.shape[0], self.top_k)
        return self.plan.clone(), self.plan_kept.clone()


# --- hand-made expectations ------------------------------------------------------------------------------------
def make_plan(seed, T):
    """Deterministic plan: distinct experts per token, every 5th second choice unkept by the gate."""
    g = torch.Generator().manual_seed(seed)
    first = torch.randint(0, E, (T,), generator=g)
    second = (first + torch.randint(1, E, (T,), generator=g)) % E
    ids = torch.stack([first, second], 1)
    gate_kept = torch.ones(T, K, dtype=torch.bool)
    gate_kept[::5, 1] = False
    return ids, gate_kept


def hand_kept(ids, gate_kept, cap):
    """GShard priority by hand: all first choices in token order, then all second choices; cap[e] slots each."""
    T, k = ids.shape
    used = [0] * len(cap)
    kept = [[False] * k for _ in range(T)]
    for j in range(k):
        for t in range(T):
            if not bool(gate_kept[t, j]):
                continue
            e = int(ids[t, j])
            if used[e] < cap[e]:
                used[e] += 1
                kept[t][j] = True
    return kept


def hand_counts(ids, kept):
    counts = [0] * E
    for t in range(len(kept)):
        for j in range(len(kept[t])):
            if kept[t][j]:
                counts[int(ids[t, j])] += 1
    return counts


def hand_ids(ids, kept):
    return [[int(ids[t, j]) if kept[t][j] else -1 for j in range(len(kept[t]))] for t in range(len(kept))]


def hand_balance(counts, owner):
    devices = max(owner) + 1
    load = [0] * devices
    for e, c in enumerate(counts):
        load[owner[e]] += c
    return max(load) / (sum(load) / devices)


def hand_max_over_mean(counts):
    return max(counts) / (sum(counts) / len(counts))


def run_planned(layer, ids, gate_kept):
    layer.gate.plan, layer.gate.plan_kept = ids, gate_kept
    torch.manual_seed(0)
    return layer(torch.randn(ids.shape[0], H))


def cfg(**kw):
    base = dict(num_experts=E, top_k=K, gate="test_stats_planned", aux_loss_coeff=0.0)
    base.update(kw)
    return MoEConfig(**base)


# --- 1. single process -----------------------------------------------------------------------------------------
def test_summary_single_process_capacity_and_dropless():
    sink = StatsSink()
    capl = MoELayer(cfg(dispatch="capacity"), H, FFN, layer_id=0, stats=sink)
    capl.set_expert_capacity(CAP)
    drop = MoELayer(cfg(dispatch="dropless"), H, FFN, layer_id=1, stats=sink)

    exp_cap, exp_free = [0] * E, [0] * E
    exp_dropped, exp_assign = 0, 0
    free_dropped = 0
    for call, T in enumerate((7, 6, 9)):
        ids, gk = make_plan(100 + call, T)
        kept = hand_kept(ids, gk, CAP)
        run_planned(capl, ids, gk)
        assert capl.last_routing.kept.tolist() == kept
        c = hand_counts(ids, kept)
        exp_cap = [a + b for a, b in zip(exp_cap, c)]
        exp_dropped += T * K - sum(map(sum, kept))
        exp_assign += T * K
        assert sink.last[0].tolist() == c

        ids2, gk2 = make_plan(200 + call, T + 1)
        kept2 = hand_kept(ids2, gk2, [10 ** 6] * E)       # dropless: only the gate's own drops
        run_planned(drop, ids2, gk2)
        exp_free = [a + b for a, b in zip(exp_free, hand_counts(ids2, kept2))]
        free_dropped += (T + 1) * K - sum(map(sum, kept2))

    assert exp_dropped > free_dropped > 0                 # the plan really exercises capacity drops
    assert len(set(exp_cap)) > 1                          # and an imbalanced load

    owner = [0, 1, 1, 0]
    s = sink.summary(ranks_of_experts=owner, reset=False)
    assert sorted(s) == [0, 1]
    a = s[0]
    assert a["tokens_per_expert"] == exp_cap
    assert a["dropped_fraction"] == pytest.approx(exp_dropped / exp_assign)
    assert a["balance_ratio"] == pytest.approx(hand_balance(exp_cap, owner))
    assert a["expert_max_over_mean"] == pytest.approx(hand_max_over_mean(exp_cap))
    assert a["calls"] == 3
    b = s[1]
    assert b["tokens_per_expert"] == exp_free
    assert b["dropped_fraction"] == pytest.approx(free_dropped / ((7 + 1 + 6 + 1 + 9 + 1) * K))
    assert b["balance_ratio"] == pytest.approx(hand_balance(exp_free, owner))
    assert b["calls"] == 3

    # another placement, still not reset; the default placement on one process is a single device -> 1.0
    owner3 = [0, 0, 1, 2]
    s3 = sink.summary(ranks_of_experts=owner3, reset=False)
    assert s3[0]["balance_ratio"] == pytest.approx(hand_balance(exp_cap, owner3))
    assert s3[0]["tokens_per_expert"] == exp_cap and s3[0]["calls"] == 3
    sd = sink.summary()                                   # resets by default
    assert sd[0]["balance_ratio"] == pytest.approx(1.0)
    assert sd[0]["tokens_per_expert"] == exp_cap
    assert sink.summary() == {}

    # after a reset, counting starts again from zero
    ids, gk = make_plan(300, 5)
    run_planned(capl, ids, gk)
    kept = hand_kept(ids, gk, CAP)
    s = sink.summary(ranks_of_experts=owner, reset=False)
    assert list(s) == [0]
    assert s[0]["tokens_per_expert"] == hand_counts(ids, kept) and s[0]["calls"] == 1
    assert s[0]["dropped_fraction"] == pytest.approx((5 * K - sum(map(sum, kept))) / (5 * K))
    sink.reset()
    assert sink.summary() == {}


# --- 2. summary over a real 2-process group ----------------------------------------------------------------------
def _tokens(rank, call):
    return 6 + 3 * rank + call                            # uneven token counts per rank


def _summary_worker(rank, world):
    sink = StatsSink()
    layer = MoELayer(cfg(dispatch="capacity", expert_parallel_size=world, world_size=world), H, FFN,
                     ep_group=dist.group.WORLD, layer_id=4, stats=sink)
    layer.set_expert_capacity(CAP)
    for call in range(3):
        ids, gk = make_plan(1000 * rank + call, _tokens(rank, call))
        run_planned(layer, ids, gk)
        assert layer.last_routing.kept.tolist() == hand_kept(ids, gk, CAP)

    # every rank's plan is deterministic, so each rank computes the group totals by hand without communication
    total, dropped, assign = [0] * E, 0, 0
    per_rank = []
    for r in range(world):
        mine = [0] * E
        for call in range(3):
            T = _tokens(r, call)
            ids, gk = make_plan(1000 * r + call, T)
            kept = hand_kept(ids, gk, CAP)
            mine = [a + b for a, b in zip(mine, hand_counts(ids, kept))]
            dropped += T * K - sum(map(sum, kept))
            assign += T * K
        per_rank.append(mine)
        total = [a + b for a, b in zip(total, mine)]
    assert per_rank[0] != per_rank[1]                     # the ranks really route different tokens

    s = sink.summary(group=dist.group.WORLD, reset=False)
    assert list(s) == [4]
    a = s[4]
    assert a["tokens_per_expert"] == total
    assert a["dropped_fraction"] == pytest.approx(dropped / assign)
    assert a["balance_ratio"] == pytest.approx(hand_balance(total, [0, 0, 1, 1]))   # default: contiguous blocks
    assert a["expert_max_over_mean"] == pytest.approx(hand_max_over_mean(total))
    assert a["calls"] == 3
    owner = [0, 1, 1, 0]
    s2 = sink.summary(group=dist.group.WORLD, ranks_of_experts=owner)
    assert s2[4]["balance_ratio"] == pytest.approx(hand_balance(total, owner))
    assert s2[4]["tokens_per_expert"] == total
    both = [None] * world
    dist.all_gather_object(both, (s, s2))
    assert both[0] == both[1]                             # every rank gets the same summary
    assert sink.summary(group=dist.group.WORLD) == {}     # reset by the previous call


def test_summary_sums_over_a_gloo_group():
    run_distributed(_summary_worker, 2)


# --- 3. traces on 2 gloo ranks -------------------------------------------------------------------------------------
STEPS = [0, 1, 7]                 # next_step() then next_step(7)
MICRO = [1, 2, 1]                 # micro-batches per step: step 1's add up
LAYERS = [2, 5]                   # created in the order 5, 2: the trace sorts them


def _trace_worker(rank, world, d):
    sink = StatsSink()
    rec = TraceRecorder(os.path.join(d, "trace"), rank=rank, world_size=world, num_experts=E, top_k=K,
                        token_ids=True)
    plain = TraceRecorder(os.path.join(d, "plain"), rank=rank, world_size=world, num_experts=E, top_k=K)
    sink.listeners += [rec, plain]
    c = cfg(dispatch="capacity", expert_parallel_size=world, world_size=world)
    layers = {lid: MoELayer(c, H, FFN, ep_group=dist.group.WORLD, layer_id=lid, stats=sink) for lid in (5, 2)}
    for layer in layers.values():
        layer.set_expert_capacity(CAP)

    seen = torch.zeros(len(STEPS), len(LAYERS), E, dtype=torch.long)       # from the layers' routing
    seen_ids = [[[] for _ in LAYERS] for _ in STEPS]
    hand = torch.zeros_like(seen)
    for si, step in enumerate(STEPS):
        if si == 1:
            rec.next_step(); plain.next_step()
        elif si > 1:
            rec.next_step(step); plain.next_step(step)
        for mb in range(MICRO[si]):
            for lid in (5, 2):
                T = 4 + 2 * rank + si + mb
                ids, gk = make_plan(10000 * rank + 100 * si + 10 * mb + lid, T)
                run_planned(layers[lid], ids, gk)
                r = layers[lid].last_routing
                li = LAYERS.index(lid)
                seen[si, li] += r.counts
                seen_ids[si][li].append(torch.where(r.kept, r.expert_ids, -1))
                kept = hand_kept(ids, gk, CAP)
                hand[si, li] += torch.tensor(hand_counts(ids, kept))
                assert seen_ids[si][li][-1].tolist() == hand_ids(ids, kept)
    assert torch.equal(seen, hand)
    assert rec.flush() == os.path.join(d, "trace") + f".rank{rank}"
    plain.flush()
    torch.save({"counts": seen, "ids": [[torch.cat(x) for x in row] for row in seen_ids]},
               os.path.join(d, f"seen{rank}.pt"))


def test_trace_recorder_and_load_trace_on_two_ranks():
    with tempfile.TemporaryDirectory() as d:
        run_distributed(_trace_worker, 2, d)
        seen = [torch.load(os.path.join(d, f"seen{r}.pt")) for r in range(2)]

        shard = torch.load(os.path.join(d, "trace.rank1"), weights_only=True)      # the documented shard schema
        assert shard["schema"] == "megamoe-trace/1" and shard["rank"] == 1 and shard["world_size"] == 2
        assert shard["counts"].dtype == torch.int32 and shard["counts"].shape == (3, 2, E)
        assert shard["steps"].dtype == torch.long and shard["steps"].tolist() == STEPS
        assert torch.equal(shard["counts"].long(), seen[1]["counts"])
        assert shard["token_ids"][0][0].dtype == torch.int16

        t = load_trace(os.path.join(d, "trace"))
        assert t["steps"].tolist() == STEPS
        assert t["layers"] == LAYERS
        assert t["world_size"] == 2 and t["num_experts"] == E and t["top_k"] == K
        assert t["counts"].shape == (3, 2, 2, E)
        for r in range(2):
            assert torch.equal(t["counts"][:, :, r].long(), seen[r]["counts"]), r
        assert not torch.equal(t["counts"][:, :, 0], t["counts"][:, :, 1])
        assert len(t["token_ids"]) == 2
        for r in range(2):
            for si in range(3):
                for li in range(2):
                    got = t["token_ids"][r][si][li]
                    want = seen[r]["ids"][si][li]
                    assert got.shape == want.shape and torch.equal(got.long(), want), (r, si, li)
        assert any((x == -1).any() for x in seen[0]["ids"][0])           # drops really show up as -1

        p = load_trace(os.path.join(d, "plain"))
        assert "token_ids" not in p
        assert torch.equal(p["counts"], t["counts"]) and p["steps"].tolist() == STEPS


def _one_routing():
    ids = torch.tensor([[0, 1], [2, 3], [1, 0]])
    kept = torch.tensor([[True, True], [True, False], [True, True]])
    return Routing(ids, torch.ones(3, 2), kept, torch.tensor([2, 2, 1, 0]), torch.tensor(1))


def test_load_trace_errors():
    with tempfile.TemporaryDirectory() as d:
        with pytest.raises(FileNotFoundError):
            load_trace(os.path.join(d, "nothing"))

        # a world-size-2 trace with only rank 0's shard
        rec = TraceRecorder(os.path.join(d, "half"), rank=0, world_size=2, num_experts=4, top_k=2)
        rec(3, _one_routing())
        rec.flush()
        with pytest.raises(ValueError):
            load_trace(os.path.join(d, "half"))

        # a shard with another schema
        rec = TraceRecorder(os.path.join(d, "bad"), rank=0, world_size=1, num_experts=4, top_k=2)
        rec(3, _one_routing())
        path = rec.flush()
        data = torch.load(path, weights_only=True)
        good = load_trace(os.path.join(d, "bad"))                        # valid as written
        assert good["counts"].tolist() == [[[[2, 2, 1, 0]]]]
        data["schema"] = "megamoe-trace/0"
        torch.save(data, path)
        with pytest.raises(ValueError, match="schema"):
            load_trace(os.path.join(d, "bad"))
