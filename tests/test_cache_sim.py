"""Expert-buffering cache simulator (paper 004 §VI-C): hand-computed miss counts, Belady's MIN against a brute-force
optimum and against every online policy, placements, the miss curve and its plot, the `megamoe cache-sim` CLI."""
import functools
import json
import types

import numpy as np
import pytest
import torch

from megamoe_plugin.inference import cache_sim
from megamoe_plugin.inference.cache_sim import (ONLINE_POLICIES, activity, belady_misses, miss_curve, online_misses,
                                                simulate, simulate_counts)

# Paper's example (§VI-B): 4 experts, 2 slots, experts 1, 2, 3 active, three batches in a row.
PAPER = [[1, 2, 3]] * 3
# Hand-computed misses (tiers: inactive in the batch, then active and already computed, then still needed;
# inside a tier by the policy). Batch 1 is 3 cold misses for all (3 evicts 2 under LIFO, the oldest otherwise).
#  lifo:  {1,3} | 1 hit, 2 evicts 1 (done), 3 hit -> {3,2} | 1 evicts 2 (both later, 2 newer), 2 evicts 1 | = 3+1+2
#  fifo:  {2,3} | 1 evicts 2 (both later, older), 2 evicts 1 (done), 3 hit | 1 evicts 3, 2 hit, 3 evicts 2 | = 3+2+2
#  lru:   {2,3} | 1 evicts 2 (used t2 < t3), 2 evicts 1 (done), 3 hit | 1 evicts 2 (t5 < t6), 2 evicts 1 | = 3+2+2
#  lfu:   same choices as lru (equal frequencies) = 7
#  belady: 1 2 3(evict 2) 1 2(evict 1) 3 1(evict 3) 2 3 = 6
PAPER_MISSES = {"lifo": 6, "fifo": 7, "lru": 7, "lfu": 7, "belady": 6}

# A second hand trace, 2 slots: every online policy misses 8 times, Belady 7 (computed step by step by hand:
# belady 0 1 2(ev 1) 0 1(ev 0) 2 3(ev 2) 0(ev 1) 3 1).
SECOND = [[0, 1, 2], [0, 1], [2, 3], [0, 3], [1]]
SECOND_MISSES = {"lifo": 8, "fifo": 8, "lru": 8, "lfu": 8, "belady": 7}


def _misses(batches, size, policy):
    return belady_misses(batches, size) if policy == "belady" else online_misses(batches, size, policy)


@pytest.mark.parametrize("policy", sorted(PAPER_MISSES))
def test_hand_computed_miss_counts(policy):
    assert _misses(PAPER, 2, policy) == PAPER_MISSES[policy]
    assert _misses(SECOND, 2, policy) == SECOND_MISSES[policy]
    # a cache as large as the experts only has cold misses; a 1-slot cache misses whenever the expert changes
    assert _misses(SECOND, 4, policy) == 4
    assert _misses([[0], [0], [1], [0, 1], [1]], 1, policy) == 4      # m h m m m h


def _brute_force(batches, size):
    """Fewest misses over every choice of victim at every miss (demand paging is optimal)."""
    seq = tuple(e for b in batches for e in b)

    @functools.lru_cache(maxsize=None)
    def best(i, resident):
        if i == len(seq):
            return 0
        e = seq[i]
        if e in resident:
            return best(i + 1, resident)
        if len(resident) < size:
            return 1 + best(i + 1, resident | {e})
        return 1 + min(best(i + 1, (resident - {v}) | {e}) for v in resident)

    return best(0, frozenset())


def _random_batches(rng, n, experts, p):
    return [sorted(np.flatnonzero(rng.random(experts) < p).tolist()) for _ in range(n)]


def test_belady_matches_brute_force_optimum():
    rng = np.random.default_rng(7)
    checked = 0
    for trial in range(40):
        batches = _random_batches(rng, 6, 5, 0.5)
        for size in (1, 2, 3, 4):
            assert belady_misses(batches, size) == _brute_force(batches, size), (trial, size, batches)
            checked += 1
    assert checked == 160


def _skewed_activity(seed, S=80, L=2, E=16, D=2):
    """Zipf-like popularity with temporal correlation: each batch keeps most of the previous batch's experts."""
    rng = np.random.default_rng(seed)
    pop = 1.0 / np.arange(1, E + 1) ** 0.8
    pop = pop[rng.permutation(E)]
    act = np.zeros((S, L, E), dtype=bool)
    for l in range(L):
        prev = rng.random(E) < pop
        for s in range(S):
            fresh = rng.random(E) < pop
            keep = rng.random(E) < 0.6
            act[s, l] = np.where(keep, prev, fresh)
            prev = act[s, l]
    return act


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_belady_never_beaten_by_online_policies(seed):
    act = _skewed_activity(seed)
    strictly_better = 0
    for size in (1, 2, 3, 5, 7):
        bel, acc = simulate_counts(act, 2, size, "belady")
        for policy in ONLINE_POLICIES:
            m, acc2 = simulate_counts(act, 2, size, policy)
            assert (acc2 == acc).all()
            assert (bel <= m).all(), (seed, size, policy, bel, m)
            strictly_better += int((bel < m).any())
    assert strictly_better > 0          # MIN is not just tied with everything on these traces


def test_trace_counts_and_placement():
    # E=4, D=2, 4 batches, counts split over 2 source ranks (active = summed count > 0)
    counts = torch.zeros(4, 1, 2, 4, dtype=torch.int32)
    counts[0, 0, 1, 0] = 3                              # batch 0: expert 0 (only rank 1's tokens)
    counts[1, 0, 0, 0] = 1; counts[1, 0, 1, 2] = 2; counts[1, 0, 0, 3] = 5     # batch 1: 0, 2, 3
    counts[2, 0, 0, 1] = 4; counts[2, 0, 1, 3] = 1      # batch 2: 1, 3
    counts[3, 0, 0, 0] = 2; counts[3, 0, 1, 1] = 2; counts[3, 0, 0, 3] = 1     # batch 3: 0, 1, 3
    trace = {"counts": counts}
    assert activity(trace).sum() == 9
    # identity: device 0 = {0, 1}: 0 | 0 | 1 | 0 1 -> miss hit miss miss miss = 4 / 5
    #           device 1 = {2, 3}: - | 2 3 | 3 | 3 -> miss miss hit hit = 2 / 4
    for policy in ("lifo", "belady"):
        m, a = simulate_counts(trace, 2, 1, policy)
        assert m.tolist() == [[4, 2]] and a.tolist() == [[5, 4]]
        assert np.allclose(simulate(trace, 2, 1, policy), [[0.8, 0.5]])
    # placement [0, 1, 0, 1]: device 0 = {0, 2}: 0 | 0 2 | - | 0 -> miss hit miss miss = 3 / 4
    #                          device 1 = {1, 3}: - | 3 | 1 3 | 1 3 -> 5 misses / 5
    m, a = simulate_counts(trace, 2, 1, "fifo", placement=[0, 1, 0, 1])
    assert m.tolist() == [[3, 5]] and a.tolist() == [[4, 5]]
    m, a = simulate_counts(trace, 2, 1, "fifo", placement={0: [0, 1, 0, 1]})
    assert m.tolist() == [[3, 5]]
    with pytest.raises(ValueError, match="every device must hold 2"):
        simulate(trace, 2, 1, "lru", placement=[0, 0, 0, 1])
    with pytest.raises(ValueError, match="unknown cache policy"):
        simulate(trace, 2, 1, "random")
    with pytest.raises(ValueError, match="evenly"):
        simulate(trace, 3, 1, "lru")


def test_online_plan_is_checked(monkeypatch):
    class Liar:                      # claims a hit for an expert it never loaded
        def __init__(self, size, policy):
            self.misses = 0

        def plan_batch(self, active):
            return [(e, 0, False, None) for e in sorted(active)]

    monkeypatch.setattr(cache_sim, "_slot_cache_class", lambda: Liar)
    with pytest.raises(RuntimeError, match="hit on expert 0 in slot 0"):
        online_misses([[0]], 1, "lifo")


def test_miss_curve_and_plot(tmp_path):
    act = _skewed_activity(3, S=40, L=2, E=8, D=2)
    curve = miss_curve(act, 2, policies=("lifo", "lru", "belady"), expert_params=600, total_params=1000)
    assert curve["sizes"] == [1, 2, 3, 4] and curve["experts_per_device"] == 4
    assert np.allclose(curve["memory_saved"], [0.75, 0.5, 0.25, 0.0])
    assert np.allclose(curve["memory_saved_total"], [0.45, 0.3, 0.15, 0.0])
    for p in ("lifo", "lru", "belady"):
        assert all(w >= m for w, m in zip(curve["worst"][p], curve["mean"][p]))
        assert all(b <= o + 1e-12 for b, o in zip(curve["worst"]["belady"], curve["worst"][p]))
    assert curve["worst"]["belady"] == sorted(curve["worst"]["belady"], reverse=True)   # MIN: more slots, fewer misses
    # with every expert cached only cold misses remain: distinct experts used / accesses, per (layer, device)
    cold = [[len(np.flatnonzero(act[:, l, d * 4:(d + 1) * 4].any(0))) / act[:, l, d * 4:(d + 1) * 4].sum()
             for d in range(2)] for l in range(2)]
    assert np.allclose(curve["per_cell"]["lifo"][-1], cold)
    assert curve["worst"]["lifo"][-1] == pytest.approx(max(max(r) for r in cold))
    png = cache_sim.plot_miss_curve(curve, str(tmp_path / "curve.png"))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    table = cache_sim.format_miss_table(curve)
    assert table.splitlines()[0].startswith("| cache/device") and len(table.splitlines()) == 2 + 4


def _write_trace(path, steps=12, E=8):
    from megamoe_plugin.stats import TraceRecorder
    rng = np.random.default_rng(0)
    for rank in range(2):
        rec = TraceRecorder(path, rank=rank, world_size=2, num_experts=E, top_k=1)
        for s in range(steps):
            for lid in (3, 5):
                c = torch.from_numpy(rng.poisson(np.linspace(3, 0.1, E)).astype(np.int64))
                rec(lid, types.SimpleNamespace(counts=c))
            rec.next_step()
        rec.flush()
    return path


def test_cli_cache_sim(tmp_path, capsys):
    from megamoe_plugin.inference.cli import main
    trace = _write_trace(str(tmp_path / "trace" / "routing"))
    out = tmp_path / "out"
    assert main(["cache-sim", "--trace", trace, "--devices", "2", "--sizes", "1-2,4",
                 "--policies", "lifo,belady", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    rows = [l for l in text.splitlines() if l.startswith("| ") and l[2].isdigit()]
    assert [r.split("|")[1].strip() for r in rows] == ["1", "2", "4"]
    assert (out / "miss_curve.png").exists()
    data = json.loads((out / "miss_curve.json").read_text())
    assert data["layer_ids"] == [3, 5] and data["sizes"] == [1, 2, 4]
    assert all(b <= l + 1e-12 for b, l in zip(data["worst"]["belady"], data["worst"]["lifo"]))
    with pytest.raises(SystemExit) as err:
        main(["cache-sim", "--help"])
    assert err.value.code == 0
    with pytest.raises(SystemExit):
        main(["cache-sim", "--trace", trace, "--devices", "3"])          # 8 experts over 3 devices
    assert "evenly" in capsys.readouterr().err
