"""The megatron-core example trainer (examples/megatron/pretrain_moe_gpt.py) with --moe-plugin, for real: 2 gloo
processes started as torchrun starts them, megatron-core's DDP, optimizer, schedules, datasets and dist_checkpointing.

- EP=2 and PP=2 (MoE layers in both stages): loss finite and falling; the placement hook ran after every step on
  every rank (the recording policy in tests/helpers writes what it saw).
- TP=2 + sequence parallel, EP=1: save at iteration 2, restart from it, the next steps' losses equal those of the
  uninterrupted run.
"""
import json
import math
import os
import re
import subprocess

import pytest
from conftest import ranks_command

from megamoe_plugin.megatron_adapter.checkpointing import TRACKER

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "examples", "megatron", "pretrain_moe_gpt.py")
HELPERS = os.path.join(REPO, "tests", "helpers")
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "4", "--log-interval", "1", "--lr", "3e-3", "--corpus-bytes", "300000",
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--moe-plugin"]
LINE = re.compile(r"iteration\s+(\d+)/\d+ \| lm loss ([0-9.naninf]+)")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("corpus"))


def run(nproc, args, cache, record_dir=None, timeout=420):
    # TORCHDYNAMO_DISABLE: the trainer turns Megatron's fused kernels off, so torch.compile would only cost its
    # import with megatron.core (the launch times are in the CHANGELOG)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1",
               PYTHONPATH=os.pathsep.join([HELPERS, REPO, os.environ.get("PYTHONPATH", "")]))
    if record_dir:
        env["MEGAMOE_RECORD_DIR"] = str(record_dir)
    cmd = ranks_command(nproc) + [SCRIPT, *TINY, "--data-cache-path", cache, *args]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    return {int(i): float(v) for i, v in LINE.findall(p.stdout)}, out


def records(record_dir, rank):
    with open(os.path.join(record_dir, f"rank{rank}.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("layout", [
    # EP=2 on the second release: test_checkpoint_resume_next_steps_match[EP2-exact] trains it there; what this
    # test adds (the hook's records, the routing trace) is the plugin's own logic
    pytest.param(["--expert-model-parallel-size", "2"], marks=pytest.mark.one_release),
    ["--pipeline-model-parallel-size", "2", "--moe-layer-freq", "1"]], ids=["EP2", "PP2"])
def test_trainer_two_processes_loss_falls_and_hook_runs(layout, cache, tmp_path):
    iters = 8
    trace = str(tmp_path / "trace" / "routing")
    losses, out = run(2, [*layout, "--train-iters", str(iters), "--moe-plugin-gate", "gshard",
                          "--moe-plugin-placement", "recording_policy:RecordingPolicy", "--moe-plugin-trace-path",
                          trace], cache, record_dir=tmp_path)
    assert sorted(losses) == list(range(1, iters + 1)), out[-3000:]
    assert all(math.isfinite(v) for v in losses.values())
    assert losses[iters] < losses[1] - 0.2, losses
    for rank in range(2):
        recs = records(tmp_path, rank)
        assert [r["iteration"] for r in recs] == list(range(1, iters + 1))
        assert all(r["moe_layers"] >= 1 and r["optimizer_has_state"] for r in recs)
        norms = [r["expert_w1_norms"][0] for r in recs]
        assert len(set(norms)) > 1          # the hook saw the weights after each update
    from megamoe_plugin.stats import load_trace
    t = load_trace(trace)                     # training forwards only (no eval), labelled by iteration
    assert t["steps"].tolist() == list(range(1, iters + 1))
    per_step = t["counts"].sum(dim=(2, 3))    # [steps, layers]: kept token->expert assignments
    assert (per_step > 0).all()
    if "--pipeline-model-parallel-size" in layout:   # stage r holds layer r+1: only rank r routes through it
        assert t["layers"] == [1, 2]
        assert (t["counts"][:, 0, 1] == 0).all() and (t["counts"][:, 1, 0] == 0).all()
    else:   # gshard keeps every token's 1st choice and some 2nd choices: T <= kept <= 2T per rank and step,
        T = 4 * 64                          # T = micro batch 4 x seq 64 (one micro-batch per step and rank)
        kept = t["counts"].sum(-1)
        assert ((kept >= T) & (kept <= 2 * T)).all() and (kept < 2 * T).any(), kept
    if "--pipeline-model-parallel-size" in layout:   # one MoE layer per stage: layer numbers 1 and 2
        assert records(tmp_path, 0)[0]["layer_numbers"] == [1]
        assert records(tmp_path, 1)[0]["layer_numbers"] == [2]


@pytest.mark.parametrize("layout,tol", [
    (["--expert-model-parallel-size", "2"], 0.0),
    # TP=2 + SP: the replicated parameters (layernorms, router, experts) of the two tensor-parallel ranks drift
    # apart at the 1e-6 level during training and the checkpoint keeps TP rank 0's copy, so the resumed losses
    # match to ~1e-4, not bit for bit.
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1"], 5e-4),
], ids=["EP2-exact", "TP2-SP"])
def test_checkpoint_resume_next_steps_match(layout, tol, cache, tmp_path):
    """A run saves at iteration 2 and goes on to 4; resumed from iteration 2's checkpoint, a second run's
    iterations 3 and 4 are the first run's (so saving perturbed nothing either)."""
    layout = [*layout, "--train-iters", "4", "--moe-input-jitter-eps", "0.01"]
    ck = tmp_path / "ck"
    full, _ = run(2, [*layout, "--save", str(ck), "--save-interval", "2"], cache)
    assert sorted(full) == [1, 2, 3, 4] and (ck / "iter_0000002").is_dir()
    (ck / TRACKER).write_text("2")     # resume from iteration 2, not the last save
    resumed, out = run(2, [*layout, "--load", str(ck)], cache)
    assert "loaded checkpoint" in out and sorted(resumed) == [3, 4], out[-3000:]
    for it in (3, 4):
        assert abs(resumed[it] - full[it]) <= tol, (resumed, full)


@pytest.mark.one_release             # FasterMoE's schedule is the plugin's own layer
def test_smart_schedule_in_megatron_matches_plain(cache):
    """--moe-plugin-schedule smart (FasterMoE §4.2 pipelined exchange, 2 groups of 1 rank) inside Megatron's MoE
    layer with EP=2: the same losses as the plain all-to-all schedule."""
    layout = ["--expert-model-parallel-size", "2", "--train-iters", "3"]
    plain, _ = run(2, layout, cache)
    smart, out = run(2, [*layout, "--moe-plugin-schedule", "smart:2"], cache)
    assert sorted(smart) == [1, 2, 3], out[-3000:]
    assert smart[1] == plain[1]                        # forward of the first step: bitwise the same
    for it in (2, 3):
        assert abs(smart[it] - plain[it]) < 1e-4, (smart, plain)


def test_bf16_trains_like_fp32(cache):
    """--bf16: the model in bf16 behind Megatron's Float16Module with fp32 main parameters in the optimizer (on CPU
    through the plugin's shims): the first step's loss is fp32's to bf16 precision, and the loss falls."""
    args = ["--train-iters", "5"]
    fp32, _ = run(1, args, cache)
    bf16, out = run(1, [*args, "--bf16"], cache)
    assert sorted(bf16) == [1, 2, 3, 4, 5], out[-3000:]
    assert abs(bf16[1] - fp32[1]) < 0.02 * fp32[1], (bf16, fp32)
    assert bf16[5] < bf16[1] - 0.3, bf16


# --- checkpoints: saved at --exit-interval, loud when missing, code-free, one LR schedule for every rank ----------
@pytest.mark.one_release
def test_exit_interval_saves_and_missing_checkpoint_is_loud(cache, tmp_path):
    layout = ["--train-iters", "4", "--moe-plugin-second-expert-policy", "all"]
    ck = str(tmp_path / "ck")
    # the relaunch idiom (--save and --load the same empty folder): starts afresh and says so; no --save-interval
    first, out = run(1, [*layout, "--save", ck, "--load", ck, "--exit-interval", "2"], cache)
    assert sorted(first) == [1, 2] and "saved checkpoint at iteration 2" in out, out[-2000:]
    assert "WARNING: --load" in out and "no checkpoint there" in out, out[-2000:]
    resumed, out = run(1, [*layout, "--load", ck], cache)
    assert "loaded checkpoint" in out and sorted(resumed) == [3, 4], out[-2000:]
    # a --load that names another folder, or --exit-on-missing-checkpoint: an error, nothing trained
    fresh = str(tmp_path / "fresh")
    for extra in (["--load", str(tmp_path / "typo")],
                  ["--save", fresh, "--load", fresh, "--exit-on-missing-checkpoint"]):
        p = _run_raw(1, [*layout, *extra], cache)
        assert p.returncode != 0 and "no checkpoint there" in p.stderr and "iteration" not in p.stdout, p.stderr[-2000:]


class _Payload:
    """Unpickling this calls pathlib.Path.touch(<marker>): what a malicious checkpoint file would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import pathlib
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


@pytest.mark.one_release
def test_code_in_a_checkpoint_file_is_refused_without_running(cache, tmp_path):
    import torch
    layout = ["--train-iters", "4"]
    ck = str(tmp_path / "ck")
    run(1, [*layout, "--save", ck, "--exit-interval", "2"], cache)
    marker = tmp_path / "pwned"
    for name in ("extra_rank0.pt", "run_state.pt"):
        target = os.path.join(ck, "iter_0000002", name)
        original = open(target, "rb").read()
        torch.save({"format": "megamoe-megatron/2", "rng": _Payload(str(marker))}, target)
        p = _run_raw(1, [*layout, "--load", ck], cache)
        assert p.returncode != 0 and name in p.stderr and "weights_only" in p.stderr, p.stderr[-2000:]
        assert not marker.exists()
        open(target, "wb").write(original)


@pytest.mark.one_release
def test_resume_at_larger_world_keeps_the_checkpoint_lr_schedule_on_every_rank(cache, tmp_path):
    """Saved by 1 process (train-iters 6), resumed by 2 (EP=2) with --train-iters 10: rank 1 has no per-rank file,
    and must still follow the checkpoint's schedule (the same LR as rank 0), or the flags' with
    --override-opt_param-scheduler."""
    ck = str(tmp_path / "ck")
    run(1, ["--train-iters", "6", "--lr-warmup-iters", "1", "--save", ck, "--exit-interval", "3"], cache)
    policy = ["--moe-plugin-placement", "recording_policy:RecordingPolicy"]
    schedules = {}
    for name, extra in (("checkpoint", []), ("override", ["--override-opt_param-scheduler"])):
        rec = tmp_path / name
        rec.mkdir()
        _, out = run(2, ["--train-iters", "10", "--lr-warmup-iters", "1", "--expert-model-parallel-size", "2",
                         "--global-batch-size", "8", "--load", ck, *policy, *extra], cache, record_dir=rec)
        assert "extra_rank{1}.pt not in the checkpoint" in out, out[-2000:]
        per_rank = [[r["lrs"] for r in records(rec, rank)] for rank in range(2)]
        assert per_rank[0] == per_rank[1] and len(per_rank[0]) == 7, per_rank
        schedules[name] = [lrs[0] for lrs in per_rank[0]]
    # the checkpoint's schedule decays over 6 iterations: from iteration 6 on it sits at --min-lr (1e-4)
    assert schedules["checkpoint"][-1] == pytest.approx(1e-4) and schedules["checkpoint"][3] == pytest.approx(1e-4)
    assert schedules["override"][3] > 2e-4 and schedules["override"][-1] == pytest.approx(1e-4)


def _run_raw(nproc, args, cache):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([HELPERS, REPO, os.environ.get("PYTHONPATH", "")]))
    cmd = ranks_command(nproc) + [SCRIPT, *TINY, "--data-cache-path", cache, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
