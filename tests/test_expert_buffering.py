"""Expert buffering (paper 004 §VI): the eviction policies on hand-written access sequences and against a
separately written reference, and buffered inference equal to unbuffered on real MoELayers (1 and 2 processes)."""
import random

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from conftest import run_distributed
from megamoe_plugin import MoEConfig, MoELayer
from megamoe_plugin.config import ConfigError
from megamoe_plugin.experts import ExpertBank
from megamoe_plugin.inference.buffering import (ExpertBuffer, disable_expert_buffering, enable_expert_buffering,
                                                 expert_buffers)
from megamoe_plugin.inference.eviction import POLICIES, ExpertSlotCache


# --- eviction: hand-written sequences ---------------------------------------------------------------------------
def _run(policy, size, batches):
    c = ExpertSlotCache(size, policy)
    plans = [c.plan_batch(b) for b in batches]
    return c, plans


def test_paper_lifo_example():
    # E=4, 2 slots, experts (1, 2, 3) active from empty: 1 and 2 are loaded, then 2 (not 1) is evicted for 3
    c, (plan,) = _run("lifo", 2, [(1, 2, 3)])
    assert plan == [(1, 0, True, None), (2, 1, True, None), (3, 1, True, 2)]
    assert c.resident() == {1: 0, 3: 1}
    assert (c.hits, c.misses) == (0, 3)
    # the next identical batch hits 1 (the shortest reuse distance); 2 replaces 1 (computed) rather than 3 (still
    # needed in this batch), and 3 hits
    plan = c.plan_batch((3, 2, 1))                         # any order: executed in ascending id order
    assert plan == [(1, 0, False, None), (2, 0, True, 1), (3, 1, False, None)]
    assert (c.hits, c.misses) == (2, 4)


@pytest.mark.parametrize("batches,size,victims", [
    # loads 0, 1, 2; 1 used 3 times; 2 loaded last; 0 used last -> every policy a different or shared victim
    ([[0], [1], [1], [1], [2], [0], [3]], 3, {"lifo": 2, "fifo": 0, "lru": 1, "lfu": 2}),
    # 0 used twice, then 1 loaded
    ([[0], [0], [1], [2]], 2, {"lifo": 1, "fifo": 0, "lru": 0, "lfu": 1}),
    # 1 used twice after 0
    ([[0], [1], [1], [2]], 2, {"lifo": 1, "fifo": 0, "lru": 0, "lfu": 0}),
    # equal frequencies: lfu falls back to the least recently used
    ([[0], [1], [0], [1], [2]], 2, {"lifo": 1, "fifo": 0, "lru": 0, "lfu": 0}),
])
def test_policies_choose_their_victim(batches, size, victims):
    for policy in POLICIES:
        c, plans = _run(policy, size, batches)
        (e, slot, loaded, evicted), = plans[-1]
        assert loaded and evicted == victims[policy], policy
        assert c.resident()[e] == slot and evicted not in c.resident()


@pytest.mark.parametrize("batches,last_plan", [
    # 0 inactive in the last batch, 1 active (already computed): 0 goes, although LIFO alone would evict 1
    ([[0, 1], [1, 2]], [(1, 1, False, None), (2, 0, True, 0)]),
    # 3 inactive; 0 active and the oldest loaded (FIFO alone would evict 0)
    ([[0], [3], [0, 4]], [(0, 0, False, None), (4, 1, True, 3)]),
    # 3 inactive and the most frequent; 0 (loaded into the free slot) active (LFU alone would evict 0)
    ([[3], [3], [3], [0, 4]], [(0, 1, True, None), (4, 0, True, 3)]),
    # 6 inactive goes first; then 1 (computed) before 5 (still needed in this batch), although FIFO, LRU and
    # LFU alone would evict 5
    ([[5], [6], [1, 2, 5]], [(1, 1, True, 6), (2, 1, True, 1), (5, 0, False, None)]),
])
def test_inactive_first_then_needed_later_last(batches, last_plan):
    for policy in POLICIES:
        _, plans = _run(policy, 2, batches)
        assert plans[-1] == last_plan, policy


def test_needed_later_evicted_only_when_all_are():
    # slots hold 5 and 6, both needed later in the batch (1, 5, 6): the policy decides among them
    first = {"lifo": 6, "fifo": 5, "lru": 5, "lfu": 5}
    for policy in POLICIES:
        _, plans = _run(policy, 2, [[5], [6], [1, 5, 6]])
        assert plans[-1][0] == (1, {5: 0, 6: 1}[first[policy]], True, first[policy]), policy


def test_more_active_than_slots():
    for policy in POLICIES:
        c, (plan,) = _run(policy, 1, [[4, 0, 2]])
        assert plan == [(0, 0, True, None), (2, 0, True, 0), (4, 0, True, 2)]
        assert c.resident() == {4: 0}


def test_bad_arguments_name_the_flags():
    with pytest.raises(ValueError, match="--moe-expert-cache-size"):
        ExpertSlotCache(0, "lifo")
    with pytest.raises(ValueError, match="--moe-expert-cache-size"):
        ExpertSlotCache(1.5, "lifo")
    with pytest.raises(ValueError, match="--moe-expert-cache-policy"):
        ExpertSlotCache(2, "mru")


# --- eviction: random sequences against a reference written another way ----------------------------------------
class _Reference:
    """The rule of the paper's §VI-B with lists: load order, recency order and access counts."""

    def __init__(self, size, policy):
        self.size, self.policy = size, policy
        self.cached = []            # experts in load order (oldest first)
        self.recency = []           # experts by last access (oldest first), every expert ever seen
        self.count = {}

    def batch(self, active):
        victims = []
        order = sorted(set(active))
        for i, e in enumerate(order):
            later = order[i + 1:]
            self.count[e] = self.count.get(e, 0) + 1
            if e in self.recency:
                self.recency.remove(e)
            self.recency.append(e)
            if e in self.cached:
                victims.append(None)
                continue
            victim = None
            if len(self.cached) == self.size:
                for tier in ([r for r in self.cached if r not in order],
                             [r for r in self.cached if r in order and r not in later],
                             list(self.cached)):
                    if tier:
                        break
                if self.policy == "lifo":
                    victim = tier[-1]
                elif self.policy == "fifo":
                    victim = tier[0]
                elif self.policy == "lru":
                    victim = min(tier, key=self.recency.index)
                else:
                    victim = min(tier, key=lambda r: (self.count[r], self.recency.index(r)))
                self.cached.remove(victim)
            self.cached.append(e)
            victims.append(victim)
        return order, victims


def test_random_sequences_match_reference_and_invariants():
    rng = random.Random(0)
    for trial in range(60):
        policy = POLICIES[trial % 4]
        E, size = rng.randint(2, 9), rng.randint(1, 6)
        cache, ref = ExpertSlotCache(size, policy), _Reference(size, policy)
        occupant = {}                                   # slot -> expert, rebuilt from the plans alone
        accesses = 0
        for _ in range(25):
            active = rng.sample(range(E), rng.randint(0, E))
            plan = cache.plan_batch(active)
            order, victims = ref.batch(active)
            assert [s[0] for s in plan] == order
            assert [s[3] for s in plan] == victims, (policy, size)
            for e, slot, loaded, evicted in plan:       # after every step
                assert 0 <= slot < size
                assert loaded == (e not in occupant.values())
                if loaded:
                    assert occupant.get(slot) == evicted
                    assert evicted is None or evicted != e
                    occupant[slot] = e
                else:
                    assert occupant[slot] == e and evicted is None
                assert len(occupant) <= size and len(set(occupant.values())) == len(occupant)
            assert cache.resident() == {e: s for s, e in occupant.items()}
            accesses += len(set(active))
            assert cache.hits + cache.misses == accesses


# --- buffered inference on real layers ---------------------------------------------------------------------------
def _layer(E, H=16, F=24, activation="gelu", bias=False, lanes=0, ep=1, group=None, seed=0):
    cfg = MoEConfig(num_experts=E, top_k=2, gate="gshard", second_expert_policy="all", dispatch="dropless",
                    activation=activation, linear_bias=bias,
                    expert_parallel_size=ep, world_size=ep,
                    expert_kernel="loop")          # the buffered bank's kernel: outputs compare bitwise
    torch.manual_seed(seed)
    layer = MoELayer(cfg, H, F, ep_group=group)
    layer.experts.cpu_lanes = lanes
    if bias:
        with torch.no_grad():
            for p in (layer.experts.b1, layer.experts.b2):
                p.normal_(std=0.1)
    return layer.eval()


def _batches(seed, H=16, sizes=(1, 3, 2, 17, 5, 1, 40)):
    """Different routings: tiny batches leave most experts inactive, larger ones activate most."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, H, generator=g) for T in sizes]


def _sweep(layer, xs, sizes):
    """Unbuffered outputs vs buffered ones for every policy and cache size; counters and restore checked."""
    bank = layer.experts
    E_local = bank.w1.shape[0]
    seen = []
    hook = bank.register_forward_pre_hook(lambda m, args: seen.append(sum(1 for c in args[1] if int(c) > 0)))
    original = {n: p.detach().clone() for n, p in bank.named_parameters()}
    params = dict(bank.named_parameters())
    with torch.no_grad():
        ref = [layer(x) for x in xs]
    expert_bytes = sum(p[0].numel() * p.element_size() for p in params.values())
    try:
        for policy in POLICIES:
            for size in sizes:
                (buf,) = enable_expert_buffering(layer, size, policy)
                seen.clear()
                with torch.no_grad():
                    out = [layer(x) for x in xs]
                for a, b in zip(out, ref):
                    assert torch.equal(a, b), (policy, size, (a - b).abs().max())
                slots = min(size, E_local)
                assert len(buf.cache.resident()) <= slots
                assert buf.hits + buf.misses == sum(seen)
                assert buf.bytes_copied == buf.misses * expert_bytes
                assert buf.device_bytes() == slots * expert_bytes
                assert buf.full_bytes() == E_local * expert_bytes
                assert disable_expert_buffering(layer) == 1
                assert dict(bank.named_parameters()) == params          # the same Parameter objects
                for n, p in bank.named_parameters():
                    assert torch.equal(p, original[n]) and p.device == original[n].device, n
    finally:
        hook.remove()
        disable_expert_buffering(layer)


@pytest.mark.parametrize("activation,bias,lanes", [("gelu", False, 0), ("swiglu", True, 1)])
def test_buffered_layer_equals_unbuffered(activation, bias, lanes):
    layer = _layer(6, activation=activation, bias=bias, lanes=lanes)
    _sweep(layer, _batches(1), sizes=range(1, 8))                 # 7 > E_local: everything resident


def _ep_sweep(rank, world):
    layer = _layer(8, ep=2, group=dist.group.WORLD)
    assert layer.experts.w1.shape[0] == 4
    _sweep(layer, _batches(100 + rank, sizes=(2, 1, 9, 3, 30)), sizes=range(1, 5))
    smart = MoELayer(layer.cfg.replace(schedule="smart"), 16, 24, ep_group=dist.group.WORLD).eval()
    with pytest.raises(ConfigError, match="--moe-schedule"):      # it reads the bank's weights, never calls it
        enable_expert_buffering(smart, 2, "lifo")


def test_buffered_layer_expert_parallel():
    run_distributed(_ep_sweep, 2)


def test_banks_in_any_module_with_hand_counts():
    """Every ExpertBank of a model is buffered; groups with empty experts and more active experts than slots."""
    torch.manual_seed(3)
    model = nn.ModuleList([ExpertBank(5, 8, 16, "relu", bias=True, kernel="loop"),
                           ExpertBank(5, 8, 16, "gelu", kernel="loop")]).eval()
    counts = [[3, 0, 4, 1, 2], [0, 0, 0, 0, 6], [1, 1, 1, 1, 1], [0, 2, 0, 0, 0], [0, 0, 0, 0, 0]]
    xs = [torch.randn(sum(c), 8) for c in counts]
    with torch.no_grad():
        ref = [[bank(x, c) for x, c in zip(xs, counts)] for bank in model]
    for policy in POLICIES:
        bufs = enable_expert_buffering(model, 2, policy)
        assert len(bufs) == 2 and expert_buffers(model) == bufs
        with torch.no_grad():
            for bank, want in zip(model, ref):
                for x, c, w in zip(xs, counts, want):
                    assert torch.equal(bank(x, c), w), policy
        assert all(b.hits + b.misses == 4 + 1 + 5 + 1 for b in bufs)
        disable_expert_buffering(model)
    assert enable_expert_buffering(model, 0, "lifo") == [] and expert_buffers(model) == []


def test_reloaded_weights_are_noticed():
    """load_state_dict writes into the host copies: the cached slots are reloaded, outputs follow the weights."""
    layer, other = _layer(4, seed=0), _layer(4, seed=1)
    xs = _batches(5, sizes=(6, 6))
    with torch.no_grad():
        want = other(xs[1])
        enable_expert_buffering(layer, 2, "lifo")
        layer(xs[0])                                                     # fills the slots with seed-0 experts
        layer.load_state_dict(other.state_dict())
        assert torch.equal(layer(xs[1]), want)
        # state_dict while buffered: same keys, host tensors with the loaded values
        sd = layer.state_dict()
        assert sd.keys() == other.state_dict().keys()
        assert torch.equal(sd["experts.w1"], other.experts.w1)
    disable_expert_buffering(layer)


def test_training_and_gradients_refused():
    layer = _layer(4)
    x = torch.randn(5, 16)
    enable_expert_buffering(layer, 2, "fifo")
    layer.train()
    with pytest.raises(RuntimeError, match="--moe-expert-cache-size"):
        with torch.no_grad():
            layer(x)
    layer.eval()
    with pytest.raises(RuntimeError, match="--moe-expert-cache-size"):
        layer(x.requires_grad_())
    disable_expert_buffering(layer)
    layer.train()
    layer(x).sum().backward()                  # restored: the bank trains again
    assert layer.experts.w1.grad is not None


def test_bad_cache_arguments():
    layer = _layer(4)
    with pytest.raises(ValueError, match="--moe-expert-cache-size"):
        enable_expert_buffering(layer, -1, "lifo")
    with pytest.raises(ValueError, match="--moe-expert-cache-policy"):
        enable_expert_buffering(layer, 2, "random")
    with pytest.raises(TypeError):
        ExpertBuffer(nn.Linear(2, 2), 2)


def test_model_cast_after_enabling_is_followed():
    """.double() after enabling: the parameters stay on the host, the slots follow the new dtype."""
    layer, twin = _layer(4, seed=2), _layer(4, seed=2).double()
    x = _batches(6, sizes=(7,))[0]
    with torch.no_grad():
        want = twin(x.double())
        (buf,) = enable_expert_buffering(layer, 1, "lru")
        layer(x)
        layer.double()
        assert torch.equal(layer(x.double()), want)
    assert buf.slots["w1"].dtype == torch.float64 and layer.experts.w1.dtype == torch.float64
    disable_expert_buffering(layer)
    assert torch.equal(layer.experts.w1, twin.experts.w1)
