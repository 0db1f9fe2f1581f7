"""Dynamic expert placement inside megatron-core, for real: the example trainer
(examples/megatron/pretrain_moe_gpt.py) on 2 gloo processes started as torchrun starts them with EP=2, megatron-core's DDP, chained
optimizer, schedules and dist_checkpointing.

- ``--moe-plugin-placement flexmoe`` / ``shadow`` act (moves / shadowed experts, printed in the progress line) on a
  hardware profile where compute dominates, and change nothing in the math: the same losses and grad norms as
  without placement (replicated experts count once in the clipped grad norm);
- a distributed checkpoint written after moves (experts and Adam state by logical id) resumes at EP=2 and at EP=1
  (one process; with and without placement) with the uninterrupted run's losses;
- the flag combinations the placement runtime cannot serve fail at argument validation with the flags named.

Routing is deterministic here (gshard with ``--moe-plugin-second-expert-policy all``, no dropout, no jitter), so
runs at different expert-parallel sizes route the same tokens to the same experts.
"""
import math
import re

import pytest

from megamoe_plugin.config import ConfigError
from test_megatron_trainer import run

ITERS = 6
COMMON = ["--train-iters", str(ITERS), "--global-batch-size", "8", "--moe-plugin-gate", "gshard",
          "--moe-plugin-second-expert-policy", "all"]
EP2 = ["--expert-model-parallel-size", "2"]
PLACEMENT = re.compile(r"iteration\s+(\d+)/\d+ \| .*\| grad norm ([0-9.]+) \|.*placement moves (\d+) replicas (\d+) "
                       r"shadowed (\d+) balance ([0-9.]+)")
GRAD_NORM = re.compile(r"iteration\s+(\d+)/\d+ \| .*\| grad norm ([0-9.]+) \|")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    """flexmoe-a100 with GEMMs a million times slower: compute dominates, so balancing pays off even for these
    tiny experts and the planners act."""
    from megamoe_plugin.perfmodel.profiles import get_profile
    path = str(tmp_path_factory.mktemp("profile") / "slow_compute.json")
    p = get_profile("flexmoe-a100")
    p.gemm_tflops = 1e-6
    p.save(path)
    return path


def _policy(name, profile):
    # the pay-off guard is off: these tests check the mechanics of moves on a cost model, not wall-clock verdicts
    return ["--moe-plugin-placement", name, "--moe-plugin-placement-guard", "-1", "--moe-plugin-placement-profile",
            profile, "--moe-plugin-placement-threshold", "1.0", "--moe-plugin-placement-interval", "1"]


def _placement_lines(out):
    """iteration -> (moves so far, replicas, shadowed, balance) from rank 0's progress lines."""
    return {int(m[0]): (int(m[2]), int(m[3]), int(m[4]), float(m[5])) for m in PLACEMENT.findall(out)}


def _grad_norms(out):
    return {int(i): float(g) for i, g in GRAD_NORM.findall(out)}


def _close(a, b, rel):
    assert sorted(a) == sorted(b), (a, b)
    for it in a:
        assert math.isfinite(a[it]) and abs(a[it] - b[it]) <= rel * abs(b[it]) + 1e-5, (it, a, b)


@pytest.fixture(scope="module")
def baseline(cache):
    """The 2-rank EP=2 run without placement: losses and grad norms per iteration."""
    losses, out = run(2, [*EP2, *COMMON], cache)
    assert sorted(losses) == list(range(1, ITERS + 1)), out[-3000:]
    assert "placement moves" not in out
    return losses, _grad_norms(out)


@pytest.fixture(scope="module")
def flexmoe_run(cache, profile):
    """FlexMoE with the replicas' gradient all-reduces overlapped (completed into Megatron's main_grad at the end
    of the backward pass); the synchronous defaults run in Megatron-LM's own loop (test_megatron_lm)."""
    losses, out = run(2, [*EP2, *COMMON, *_policy("flexmoe", profile), "--moe-plugin-placement-overlap-sync"],
                      cache)
    return losses, out


def test_flexmoe_moves_experts_and_keeps_the_math(flexmoe_run, baseline):
    losses, out = flexmoe_run
    lines = _placement_lines(out)
    assert sorted(lines) == list(range(1, ITERS + 1)), out[-3000:]
    assert lines[ITERS][0] > 0, lines                           # Expand / Shrink / Migrate happened
    assert max(r for _, r, _, _ in lines.values()) > 0, lines   # with replicas (vExperts beyond one per expert)
    assert all(s == 0 for _, _, s, _ in lines.values())
    base_losses, base_norms = baseline
    _close(losses, base_losses, 1e-5)
    # grad-norm clipping counts a replicated expert once: the same norm as without placement
    _close(_grad_norms(out), base_norms, 2e-3)


@pytest.mark.one_release             # the flexmoe test covers the release's gradient and optimizer paths
def test_shadow_shadows_experts_and_keeps_the_math(cache, profile, baseline):
    losses, out = run(2, [*EP2, *COMMON, *_policy("shadow", profile)], cache)
    lines = _placement_lines(out)
    assert sorted(lines) == list(range(1, ITERS + 1)), out[-3000:]
    assert sum(s for _, _, s, _ in lines.values()) > 0, lines      # FasterMoE shadowing chose hot experts
    assert all(m == 0 for m, _, _, _ in lines.values()), lines     # ... and never moved one
    base_losses, base_norms = baseline
    _close(losses, base_losses, 1e-5)
    _close(_grad_norms(out), base_norms, 2e-3)


@pytest.fixture(scope="module")
def saved_after_moves(cache, profile, tmp_path_factory, flexmoe_run):
    """Train with flexmoe to the first iteration whose placement has moved and replicated experts (which one depends
    on the megatron-core version's initialisation) and save a distributed checkpoint there: (path, iteration)."""
    full, full_out = flexmoe_run
    live = [it for it, (m, r, _, _) in sorted(_placement_lines(full_out).items()) if m > 0 and r > 0 and it < ITERS]
    assert live, full_out[-3000:]
    save_at = live[0]
    ck = str(tmp_path_factory.mktemp("ck") / "ck")
    losses, out = run(2, [*EP2, *COMMON, *_policy("flexmoe", profile), "--moe-plugin-placement-overlap-sync",
                          "--save", ck, "--save-interval", str(save_at), "--exit-interval", str(save_at)], cache)
    assert sorted(losses) == list(range(1, save_at + 1)) and "saved checkpoint" in out, out[-3000:]
    moves, replicas, _, _ = _placement_lines(out)[save_at]
    assert moves > 0 and replicas > 0, out[-3000:]    # the checkpoint is written from a moved, replicated placement
    for it in losses:
        assert losses[it] == full[it]
    return ck, save_at


@pytest.mark.parametrize("nproc,layout,placement", [
    (2, EP2, "flexmoe"),
    (1, ["--expert-model-parallel-size", "1"], "flexmoe"),
    pytest.param(1, ["--expert-model-parallel-size", "1"], "none", marks=pytest.mark.one_release),
], ids=["EP2-flexmoe", "EP1-flexmoe", "EP1-none"])
def test_checkpoint_after_moves_resumes_at_any_ep(nproc, layout, placement, saved_after_moves, flexmoe_run, cache,
                                                  profile):
    """Experts and their Adam state are saved by logical id (free slots not at all) and loaded into the placement
    of the resuming run (the saving run moved experts behind the steps: the checkpoint waits for their
    transfers): the next steps are the uninterrupted run's (global batch 8 either way: one process takes both
    ranks' micro-batches)."""
    ck, save_at = saved_after_moves
    resumed, out = run(nproc, [*layout, *COMMON, *_policy(placement, profile), "--load", ck], cache)
    assert "loaded checkpoint" in out and sorted(resumed) == list(range(save_at + 1, ITERS + 1)), out[-3000:]
    full, _ = flexmoe_run
    _close({it: resumed[it] for it in resumed}, {it: full[it] for it in resumed}, 1e-5)


# --- flag combinations refused before any model exists ------------------------------------------------------------
def _parse(argv):
    from test_megatron_adapter import _trainer_module
    return _trainer_module().parse_args(["--num-experts", "4", "--moe-plugin", *argv])


def test_flexmoe_without_spare_slots_fails_at_validation():
    with pytest.raises(ConfigError) as err:
        _parse(["--moe-plugin-placement", "flexmoe", "--moe-plugin-placement-spare-slots", "0"])
    assert "--moe-plugin-placement-spare-slots" in str(err.value), err.value
    assert _parse(["--moe-plugin-placement", "flexmoe"]).moe_plugin_config.slots_per_rank == 5


@pytest.mark.parametrize("placement", ["flexmoe", "eplb", "shadow"])
def test_distributed_optimizer_with_placement_validation(placement, tmp_path):
    """Placement runs with Megatron's distributed optimizer; what it cannot serve is refused with the flags named:
    --overlap-param-gather (stale parameters at a move) and checkpoints in a format that stores the optimizer's flat
    buffers in the run's slot layout. Shadowing moves nothing between steps: no condition."""
    from megamoe_plugin.megatron_adapter.args import validate_moe_plugin_args

    def args_with(**kw):
        args = _parse(["--moe-plugin-placement", placement])
        args.use_distributed_optimizer = True        # Megatron-LM's flags (the example trainer has no such flags)
        for k, v in kw.items():
            setattr(args, k, v)
        return args
    assert validate_moe_plugin_args(args_with()) is not None
    ck = str(tmp_path / "ck")
    refused = [dict(overlap_param_gather=True), dict(save=ck), dict(load=ck, dist_ckpt_optim_fully_reshardable=False),
               dict(save=ck, dist_ckpt_optim_fully_reshardable=True, ckpt_format="torch")]
    for kw in refused:
        if placement == "shadow":
            assert validate_moe_plugin_args(args_with(**kw)) is not None
            continue
        with pytest.raises(ConfigError) as err:
            validate_moe_plugin_args(args_with(**kw))
        text = str(err.value)
        assert f"--use-distributed-optimizer with --moe-plugin-placement={placement}" in text, text
        assert ("--overlap-param-gather" in text) if "overlap_param_gather" in kw else \
            ("--dist-ckpt-optim-fully-reshardable" in text), text
    ok = args_with(save=ck, dist_ckpt_optim_fully_reshardable=True, ckpt_format="torch_dist")
    assert validate_moe_plugin_args(ok) is not None


def test_overlapped_replica_sync_is_the_default_except_with_megatron_overlapped_grad_reduce(capsys):
    """Overlapped replica all-reduces complete at the end of the backward pass; Megatron's --overlap-grad-reduce
    starts reducing its buckets before that, so with it the replicas' gradients are reduced synchronously and a
    note names both flags."""
    from megamoe_plugin.megatron_adapter.args import validate_moe_plugin_args
    args = _parse(["--moe-plugin-placement", "flexmoe"])
    assert args.moe_plugin_config.placement_overlap_sync
    args.overlap_grad_reduce = True
    assert not validate_moe_plugin_args(args).placement_overlap_sync
    err = capsys.readouterr().err
    assert "--overlap-grad-reduce" in err and "--moe-plugin-placement-overlap-sync" in err
    args.overlap_grad_reduce = False
    assert validate_moe_plugin_args(args).placement_overlap_sync


def test_placement_metrics_to_writers_and_progress_line():
    from megamoe_plugin.megatron_adapter.metrics import format_placement_metrics, write_placement_metrics

    class Writer:
        def __init__(self):
            self.scalars = []

        def add_scalar(self, k, v, it):
            self.scalars.append((k, v, it))

        def log(self, d, it):
            self.scalars += [(k, v, it) for k, v in d.items()]

    m = {"balance_ratio": 1.25, "replicas": 3.0, "shadowed": 0.0, "moves": 2.0, "moves_total": 7.0}
    tb, wb = Writer(), Writer()
    write_placement_metrics(m, 5, tb, wb)
    assert ("moe_placement/balance_ratio", 1.25, 5) in tb.scalars and len(tb.scalars) == len(m) == len(wb.scalars)
    assert format_placement_metrics(m) == "placement moves 7 replicas 3 shadowed 0 balance 1.25"
    assert format_placement_metrics({}) == ""
