"""Placement at run time: training with Expand / Shrink / Migrate / shadowing forced every step is the
same training as without (losses, final weights and Adam state by logical id) on 2 and 4 real gloo processes; a
checkpoint written after moves loads into EP=1 and EP=2 and gives the original model's loss; routing among
replicas follows FlexMoE Alg. 3; the replica group cache; optimizer-state lookup through trainer wrappers."""
import os
import random

import pytest
import torch
import torch.distributed as dist

from conftest import run_distributed
from megamoe_plugin import MoEConfig, MoELayer
from megamoe_plugin.layer import collect_aux_loss
from megamoe_plugin.placement import PlacementState
from megamoe_plugin.placement.checkpoint import gather_logical, load_logical, local_from_logical
from megamoe_plugin.placement.optim_state import check_optimizer_supported, param_state_tensors
from megamoe_plugin.placement.runtime import GroupCache, apply_placement, group_cache

H, F, T = 8, 12, 24


def _cfg(world, **kw):
    base = dict(num_experts=2 * world, top_k=2, gate="gshard", second_expert_policy="all", world_size=world,
                expert_parallel_size=world, aux_loss_coeff=0.01, linear_bias=True)
    base.update(kw)
    return MoEConfig(**base)


def _random_changes(rt, rng: random.Random, step: int):
    """A random valid Move for this state (same on every rank: same seed) and a random shadow set."""
    s = rt.state.copy()
    E, P = s.num_experts, s.num_ranks
    options = []
    for e in range(E):
        for r in range(P):
            if s.free_slots(r) and not s.count(e, r):
                options.append(("expand", e, r))
                for src in s.ranks_of(e):
                    options.append(("migrate", e, src, r))
            if s.count(e, r) and s.num_replicas(e) > 1:
                options.append(("shrink", e, r))
    kinds = sorted({o[0] for o in options})
    want = ("expand", "migrate", "shrink")[step % 3]               # every kind comes up, at random places
    kind_first = want if want in kinds else rng.choice(kinds)
    op = rng.choice([o for o in options if o[0] == kind_first])
    if op[0] == "expand":
        mv = s.expand(op[1], op[2])
    elif op[0] == "migrate":
        mv = s.migrate(op[1], op[2], op[3])
    else:
        mv = s.shrink(op[1], op[2])
    shadow = rng.sample(range(E), rng.choice([0, 1, 2]))
    return [mv], shadow


def _data(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)


def _train_step(layer, opt, x, target):
    opt.zero_grad()
    y = layer(x)
    loss = ((y - target) ** 2).mean() + collect_aux_loss(layer)
    loss.backward()
    if dist.get_world_size() > 1:             # the gate is data parallel: what DDP does for it
        for p in layer.gate.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        for p in layer.experts.parameters():  # DDP's averaging of expert grads over data-parallel ranks: 1/world
            p.grad /= dist.get_world_size()
    opt.step()
    return loss.detach()


def _equivalence(rank, world, steps, out_dir, extra=None):
    torch.manual_seed(0)
    extra = extra or {}
    ref = MoELayer(_cfg(world, **extra), H, F, ep_group=dist.group.WORLD)
    moved = MoELayer(_cfg(world, placement_spare_slots=2, **extra), H, F, ep_group=dist.group.WORLD)
    with torch.no_grad():
        for (n, p), q in zip(ref.named_parameters(), moved.parameters()):
            q[:p.shape[0]].copy_(p) if n.startswith("experts.") else q.copy_(p)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt_mov = torch.optim.Adam(moved.parameters(), lr=1e-2)
    rt = moved.plan.placement
    rng = random.Random(42)
    kinds, shadowed_steps = set(), 0
    for step in range(steps):
        x, target = _data(rank, step)
        l_ref = _train_step(ref, opt_ref, x, target)
        replicated = any(rt.state.num_replicas(e) > 1 and rank in rt.state.replicas(e) for e in range(rt.num_experts))
        l_mov = _train_step(moved, opt_mov, x, target)
        assert torch.allclose(l_ref, l_mov, rtol=1e-5, atol=1e-6), (step, l_ref.item(), l_mov.item())
        # the backward's end waited (the wait is timed) only for overlapped all-reduces of replicas this rank holds,
        # and for the overlapped reduces of shadow copies (every rank takes part in those; they run inside the
        # layer when a shadowed expert also has replicas)
        waited, shadow_waited, _ = rt.take_waits()
        assert (waited > 0) == (replicated and rt.overlap_sync), (step, waited, replicated)
        assert (shadow_waited > 0) == rt.shadow_reduce_overlapped, (step, shadow_waited, rt.shadowed)
        moves, shadow = _random_changes(rt, rng, step)
        kinds.update(m.kind for m in moves)
        apply_placement([(rt, moves, moved.experts)], opt_mov)
        rt.set_shadowed(shadow)
        group_cache().ensure(rt.needed_groups())     # the shadows' own group, as the policies make it
        shadowed_steps += bool(shadow)
    assert kinds == {"expand", "shrink", "migrate"}, kinds
    assert shadowed_steps > 0
    assert any(rt.state.num_replicas(e) > 1 for e in range(rt.num_experts)) or rt.moves_done > 0
    # every slot holds its expert's weights and Adam state exactly as the reference holds them
    full_ref = gather_logical(ref.experts, ref.plan.placement, opt_ref)
    for name, p in moved.experts.named_parameters():
        want = local_from_logical(full_ref[name], rt)
        assert torch.allclose(p.detach(), want, rtol=1e-4, atol=1e-6), name
        for i, t in enumerate(param_state_tensors(opt_mov, p)):
            assert torch.allclose(t, local_from_logical(full_ref[f"{name}/{i}"], rt), rtol=1e-4, atol=1e-7)
    for p, q in zip(ref.gate.parameters(), moved.gate.parameters()):
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-6)
    # checkpoint by logical id, written after the moves
    full = gather_logical(moved.experts, rt)
    x, target = _data(rank, 999)
    with torch.no_grad():
        loss = ((moved(x) - target) ** 2).mean()
    if rank == 0:
        torch.save({"experts": full, "gate": moved.gate.state_dict()}, os.path.join(out_dir, "ckpt.pt"))
    torch.save(loss, os.path.join(out_dir, f"loss{rank}.pt"))
    dist.barrier()


def _load_and_eval(rank, world, out_dir, source_world):
    ckpt = torch.load(os.path.join(out_dir, "ckpt.pt"))
    cfg = _cfg(source_world, world_size=world, expert_parallel_size=world)
    layer = MoELayer(cfg, H, F, ep_group=dist.group.WORLD if world > 1 else None)
    layer.gate.load_state_dict(ckpt["gate"])
    load_logical(layer.experts, layer.plan.placement, ckpt["experts"])
    for src in range(source_world):
        if src % world != rank:
            continue
        x, target = _data(src, 999)
        with torch.no_grad():
            loss = ((layer(x) - target) ** 2).mean() if world == 1 else None
        if world == 1:
            want = torch.load(os.path.join(out_dir, f"loss{src}.pt"))
            assert torch.allclose(loss, want, rtol=1e-5), (src, loss.item(), want.item())
    if world > 1:      # every rank evaluates its own source's tokens together (EP needs all ranks in the call)
        x, target = _data(rank, 999)
        with torch.no_grad():
            loss = ((layer(x) - target) ** 2).mean()
        want = torch.load(os.path.join(out_dir, f"loss{rank}.pt"))
        assert torch.allclose(loss, want, rtol=1e-5), (rank, loss.item(), want.item())


@pytest.mark.parametrize("world,extra", [
    (2, None), (4, None),
    (2, {"schedule": "smart:2"}),              # FasterMoE's pipelined exchange over the slots
    (2, {"dispatch": "capacity", "capacity_factor": 0.75}),    # the gate drops; the kept go to the replicas
    (4, {"placement_overlap_sync": False}),     # replicas' gradient all-reduces inside the layer's backward
])
def test_forced_moves_are_the_same_training(world, extra, tmp_path):
    run_distributed(_equivalence, world, 6 if world == 2 else 4, str(tmp_path), extra)
    if extra:
        return
    # the checkpoint written after the moves, in one process (EP=1) ...
    _single(lambda: _load_and_eval(0, 1, str(tmp_path), world))
    # ... and on 2 ranks (EP=2: rank r evaluates source r's tokens)
    run_distributed(_load_and_eval, 2, str(tmp_path), world)


def _single(fn):
    fn()


# --- routing among replicas is FlexMoE Alg. 3 -----------------------------------------------------------------------
def _routing_follows_algorithm3(rank, world):
    torch.manual_seed(1)
    layer = MoELayer(_cfg(world, placement_spare_slots=1), H, F, ep_group=dist.group.WORLD)
    rt = layer.plan.placement
    apply_placement([(rt, [rt.state.copy().expand(0, 1)], layer.experts)])      # expert 0 on ranks 0 and 1
    x = torch.randn(40 + 13 * rank, H)
    routing = layer.gate(x)
    slots = rt.route_tokens(routing)
    parts = [torch.empty_like(routing.counts) for _ in range(world)]
    dist.all_gather(parts, routing.counts)
    want = rt.state.route(torch.stack(parts), integer=True)[rank]               # [E, P]
    W = rt.width
    for q in range(world):
        for i, e in enumerate(rt.state.slots_of(q)):
            if e is not None:
                assert int(slots.counts[q * W + i]) == int(want[e, q]), (q, i, e)
    assert int(slots.counts.sum()) == int(routing.counts.sum())
    # what this rank receives per slot, computed from the gathered counts, is what the count exchange would say
    from megamoe_plugin.dispatch.comm import exchange_counts
    assert torch.equal(slots.recv_counts, exchange_counts(slots.counts, dist.group.WORLD))
    # every kept assignment of expert e went to a slot holding e
    kept = routing.masked_ids < rt.num_experts
    owner_of_slot = torch.tensor([e if e is not None else -1 for q in range(world) for e in rt.state.slots_of(q)])
    assert torch.equal(owner_of_slot[slots.masked_ids[kept]], routing.masked_ids[kept])
    # and with an expert shadowed beside the replicas (its tokens stay on their source)
    rt.set_shadowed([3])
    shadowed = rt.route_tokens(routing)
    from_sources = shadowed.recv_counts.view(world, rt.width)
    assert int(from_sources[rank, -1]) == int(routing.counts[3])          # my shadow slot: my own tokens only
    assert int(from_sources[1 - rank, -1]) == 0
    assert torch.equal(shadowed.recv_counts, exchange_counts(shadowed.counts, dist.group.WORLD))


def test_routing_among_replicas_is_algorithm3():
    run_distributed(_routing_follows_algorithm3, 2)


# --- the policies through the after-step hook -------------------------------------------------------------------
from megamoe_plugin.gates import Gate, register_gate  # noqa: E402
from megamoe_plugin.placement import AfterStepHook  # noqa: E402


@register_gate("test_placement_hot")
class HotGate(Gate):
    """Top-2 with experts 0 and 1 (both on rank 0) made popular: a skew the policies must react to."""

    def select(self, logits, probs):
        score = logits.detach().clone()
        score[:, 0] += 3.0
        score[:, 1] += 0.02
        ids = torch.topk(score, self.top_k, dim=-1).indices
        return ids, torch.ones_like(ids, dtype=torch.bool)


def _slow_compute_profile(path):
    from megamoe_plugin.perfmodel.profiles import get_profile
    p = get_profile("flexmoe-a100")
    p.gemm_tflops = 1e-6            # compute dominates: balancing pays off even for these tiny experts
    p.save(path)
    return path


def _policy_run(rank, world, policy, profile):
    torch.manual_seed(0)
    kw = dict(gate="test_placement_hot", placement_profile=profile, placement_threshold=1.0, placement_interval=1,
              placement_guard=-1.0)      # the planners' own decisions, not the wall-clock guard's
    ref = MoELayer(_cfg(world, **kw), H, F, ep_group=dist.group.WORLD)
    cfg = _cfg(world, placement=policy, **kw)
    moved = MoELayer(cfg, H, F, ep_group=dist.group.WORLD)
    with torch.no_grad():
        for (n, p), q in zip(ref.named_parameters(), moved.parameters()):
            q[:p.shape[0]].copy_(p) if n.startswith("experts.") else q.copy_(p)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt_mov = torch.optim.Adam(moved.parameters(), lr=1e-2)
    hook = AfterStepHook(cfg)
    ever_shadowed = set()
    for step in range(5):
        x, target = _data(rank, step)
        l_ref = _train_step(ref, opt_ref, x, target)
        l_mov = _train_step(moved, opt_mov, x, target)
        assert torch.allclose(l_ref, l_mov, rtol=1e-5, atol=1e-6), (step, l_ref.item(), l_mov.item())
        assert hook.run(moved, opt_mov, step + 1)
        if step == 0:
            first = dict(hook.policy.metrics)
        ever_shadowed.update(moved.plan.placement.shadowed)
    m = hook.policy.metrics
    assert set(m) >= {"balance_ratio", "balance_ratio_next", "token_efficiency", "expert_efficiency", "replicas",
                      "shadowed", "moves", "bytes_moved", "predicted_step_s", "measured_step_s",
                      "verdict_measured_s", "verdict_reference_s"}, m
    assert m["verdict_measured_s"] == m["verdict_reference_s"] == 0.0       # the guard is off: nothing judged
    rt = moved.plan.placement
    if policy in ("flexmoe", "eplb"):
        assert hook.policy.total_moves > 0 and hook.policy.total_bytes > 0
        assert rt.state != PlacementState(rt.num_experts, world, rt.slots_per_rank), rt.state
        # the steps after the moves ran better balanced than the first (hot expert 0's rank was relieved)
        assert m["balance_ratio"] < first["balance_ratio"] - 0.05, (first, m)
        assert first["balance_ratio_next"] < first["balance_ratio"]
    else:
        assert 0 in ever_shadowed and hook.policy.total_moves == 0, (ever_shadowed, m)   # the hot expert
        assert m["shadow_wait_s"] > 0.0, m       # the overlapped reduces of the copies' gradients were waited for
    assert m["token_efficiency"] == 1.0 and 0 < m["expert_efficiency"] <= 1.0


@pytest.mark.parametrize("policy", ["flexmoe", "shadow", "eplb"])
def test_policy_in_the_hook_moves_and_keeps_the_math(policy, tmp_path):
    run_distributed(_policy_run, 2, policy, _slow_compute_profile(str(tmp_path / "slow.json")))


def _free_rows_run(rank, world):
    torch.manual_seed(0)
    cfg = _cfg(world, placement="flexmoe", placement_spare_slots=1, placement_interval=10**9)   # never decides
    ref, layer = MoELayer(cfg, H, F, ep_group=dist.group.WORLD), MoELayer(cfg, H, F, ep_group=dist.group.WORLD)
    spare = layer.experts.w1.shape[0] - 1                           # the free slot: the last row of every bank
    with torch.no_grad():                   # free slots start as zeros, which decay leaves alone: give them values
        for p in ref.experts.parameters():
            p[spare].normal_()
    layer.load_state_dict(ref.state_dict())
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)     # steps every row
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2, weight_decay=0.1)
    hook = AfterStepHook(cfg)
    for step in range(4):
        x, target = _data(rank, step)
        l_ref, l_new = _train_step(ref, opt_ref, x, target), _train_step(layer, opt, x, target)
        assert torch.equal(l_ref, l_new), (step, l_ref.item(), l_new.item())
        assert not hook.run(layer, opt, step + 1)                    # the policy never runs
        if step == 0:                        # the first step creates the optimizer's state: it steps every row
            before = {n: p.detach()[spare].clone() for n, p in layer.experts.named_parameters()}
    assert hook.free_rows is not None and hook.free_rows.narrowed_steps == 3   # the first step makes the state
    for (n, p), q in zip(layer.experts.named_parameters(), ref.experts.parameters()):
        assert torch.equal(p.detach()[:spare], q.detach()[:spare]), n            # occupied rows: the same update
        assert torch.equal(p.detach()[spare], before[n]), n              # free row: not stepped after the first
        assert not torch.equal(q.detach()[spare], before[n]), n          # (the plain AdamW decays it)
        assert p.grad.shape == p.shape and all(t.shape == p.shape for t in param_state_tensors(opt, p)), n


def test_free_slots_cost_no_optimizer_work():
    """FlexMoE's spare slot, never filled: the optimizer steps only the occupied rows (placement/free_rows.py),
    and the training is exactly the one a plain AdamW over every row gives."""
    run_distributed(_free_rows_run, 2)


# --- the LRU cache of replica groups ----------------------------------------------------------------------------------
def _group_cache(rank, world):
    cache = GroupCache(capacity=1)
    for needed in ([(0, 1), (2, 3)], [(0, 2), (1, 3)], [(0, 1), (2, 3)]):
        mine = [g for g in needed if rank in g]
        assert cache.ensure(mine) == 2                           # the union of every rank's missing groups
        assert len(cache) == 1                                   # the other group was evicted (LRU, capacity 1)
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=cache.get(mine[0]))
        assert float(t) == sum(r + 1 for r in mine[0])
    assert cache.created == 6
    assert cache.ensure([g for g in [(0, 1), (2, 3)] if rank in g]) == 0   # cached: nothing created


def test_group_cache_is_lru_and_collective():
    run_distributed(_group_cache, 4)


# --- optimizer state through trainer wrappers ---------------------------------------------------------------------
def test_param_state_tensors_follow_wrappers_and_masters():
    p16 = torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.bfloat16))
    master = torch.nn.Parameter(torch.zeros(3, 2))
    inner = torch.optim.Adam([master])
    master.grad = torch.ones_like(master)
    inner.step()

    class MixedPrecision:                      # the attributes Megatron's Float16Optimizer exposes
        def __init__(self):
            self.optimizer, self.float16_groups, self.fp32_from_float16_groups = inner, [[p16]], [[master]]

    class Chained:
        chained_optimizers = [MixedPrecision()]

    got = param_state_tensors(Chained(), p16)
    assert got[0] is master and len(got) == 3
    assert got[1] is inner.state[master]["exp_avg"] and got[2] is inner.state[master]["exp_avg_sq"]
    assert param_state_tensors(None, p16) == []

    class DistributedOptimizer:
        optimizer = inner
        model_param_group_index_map = {}
        ddp_config = type("DDPConfig", (), {"overlap_param_gather": True})()

        def _get_model_param_range_map(self, param):
            raise KeyError(param)
    with pytest.raises(ValueError, match="overlap-param-gather"):
        check_optimizer_supported(DistributedOptimizer())


def test_slot_state_views_of_a_sharding_optimizer():
    """Megatron's distributed optimizer holds, on each data-parallel rank, one flat range of a parameter: its fp32
    main copy and that copy's Adam state. A slot's views are the part of the slot's flat range in the rank's range,
    by hand: a [3, 2, 2] bank (4 elements per slot) of which this rank holds flat elements 3..9."""
    from megamoe_plugin.placement.optim_state import sharded_range, slot_state_views

    bank = torch.nn.Parameter(torch.arange(12.0).reshape(3, 2, 2))
    main = torch.nn.Parameter(bank.detach().reshape(-1)[3:10].clone())
    inner = torch.optim.Adam([main], lr=0.0)          # state without changing the values
    main.grad = torch.ones_like(main)
    inner.step()

    class Range:
        start, end = 3, 10

    class DistributedOptimizer:
        optimizer = inner
        model_param_group_index_map = {bank: (0, 0)}
        ddp_config = type("DDPConfig", (), {"overlap_param_gather": False})()

        def _get_model_param_range_map(self, param):
            return {"param": Range()}

    class Chained:
        chained_optimizers = [DistributedOptimizer()]

    check_optimizer_supported(Chained())
    assert sharded_range(Chained(), bank)[1:] == (3, 10)
    state = inner.state[main]
    views = slot_state_views(Chained(), bank, 0)          # slot 0 is flat 0..3: this rank holds element 3
    assert [v.numel() for v in views] == [1, 1, 1]
    assert float(views[0]) == 3.0 and views[0].data_ptr() == main.data_ptr()
    assert views[1].data_ptr() == state["exp_avg"].data_ptr()          # exp_avg, then exp_avg_sq (by key)
    assert views[2].data_ptr() == state["exp_avg_sq"].data_ptr()
    views = slot_state_views(Chained(), bank, 1)          # slot 1 is flat 4..7: shard elements 1..4, all of it
    assert [v.numel() for v in views] == [4, 4, 4] and views[0].tolist() == [4.0, 5.0, 6.0, 7.0]
    views = slot_state_views(Chained(), bank, 2)          # slot 2 is flat 8..11: shard elements 5..6
    assert views[0].tolist() == [8.0, 9.0]
    views[1].fill_(7.0)                                   # views write through to the optimizer's state
    assert state["exp_avg"][5:7].tolist() == [7.0, 7.0] and state["exp_avg"][4] != 7.0
    assert slot_state_views(None, bank, 2) == []


# --- the project's own trainer (megamoe train) with placement: 2 EP groups x 2 ranks --------------------------------
def _main_job(rank, world, profile, out_dir):
    from megamoe_plugin import train
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank))
    tiny = ["--hidden", "32", "--layers", "2", "--heads", "2", "--ffn-hidden", "64", "--seq-len", "32",
            "--batch-size", "4", "--corpus-bytes", "100000", "--threads", "1", "--eval-interval", "0",
            "--eval-batches", "2", "--steps", "6", "--log-interval", "1", "--moe-expert-parallel-size", "2",
            "--moe-placement-profile", profile, "--moe-placement-threshold", "1.0", "--moe-placement-interval", "1",
            "--moe-placement-guard", "-1"]
    plain = train.main(tiny)
    placed = train.main(tiny + ["--moe-placement", "flexmoe", "--save",
                                os.path.join(out_dir, "ck")])
    assert [h["loss"] for h in placed.history] == pytest.approx([h["loss"] for h in plain.history], rel=1e-5)
    layers = placed.model.moe_layers
    rts = [m.plan.placement for m in layers]
    assert sum(rt.moves_done for rt in rts) > 0
    states = [None] * world
    dist.all_gather_object(states, [rt.state.to_dict() for rt in rts])
    assert states[0] == states[2] and states[1] == states[3]         # both EP groups keep the same placement
    for m, p_ in zip(layers, plain.model.moe_layers):                # the same experts, by logical id
        got = gather_logical(m.experts, m.plan.placement)
        want = gather_logical(p_.experts, p_.plan.placement)
        for k in want:
            assert torch.allclose(got[k], want[k], rtol=1e-4, atol=1e-6), k
    # resume from the checkpoint written after the moves: the placement comes back with the rows
    resumed = train.main(tiny[:-12] + ["--steps", "6", "--moe-expert-parallel-size", "2", "--moe-placement",
                                       "flexmoe", "--moe-placement-profile", profile, "--resume",
                                       os.path.join(out_dir, "ck")])
    assert [m.plan.placement.state for m in resumed.model.moe_layers] == [rt.state for rt in rts]
    assert resumed.evals[-1]["loss"] == pytest.approx(placed.evals[-1]["loss"], rel=1e-6)


def test_megamoe_train_with_flexmoe_is_the_same_training(tmp_path):
    run_distributed(_main_job, 4, _slow_compute_profile(str(tmp_path / "slow.json")), str(tmp_path))
