"""Megatron-LM's own ``pretrain_gpt.py`` with the plugin, on every Megatron-LM checkout found: the patch for its tag
(patches/pretrain_gpt.py.<tag>.patch) and the no-patch launcher (``python -m megamoe_plugin.megatron_adapter.launch``),
each on gloo processes (torchrun for those two; the other runs start their ranks as torchrun does, without its
process: tests/helpers/launch_ranks.py) with a tiny MoE GPT on mock data: EP=2 with the test placement policy, TP=2 +
sequence parallel, PP=2, bad flag combinations refused at argument validation, and ``--moe-plugin-placement flexmoe``
in Megatron-LM's loop and checkpoints (same training, checkpoint after moves loads at EP=1), with Megatron's
Adam and with its distributed optimizer.

Checkouts: ``MEGATRON_LM_DIR`` (one path, or several separated by ``os.pathsep``) when set, else every
``../shared/megatron-lm/<tag>/`` beside the repository (Megatron-LM core_v0.16.1 and core_v0.19.0 on this project's
machines). Each is copied to a temporary directory (the patch is applied to the copy; the checkout is never
modified). A checkout whose training code needs a newer Python than the running one (core_v0.17+ use
``typing.override``: Python >= 3.12) is skipped here, naming the reason; ``tests/run_megatron_py312.sh`` runs it
in the Python 3.12 environment. With no checkout at all the module is skipped; ``pytest -rs`` shows the reason.
"""
import atexit
import compileall
import glob
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest
from conftest import ranks_command

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_CHECKOUTS = os.path.join(os.path.dirname(REPO), "shared", "megatron-lm")


def _checkout_dirs():
    if os.environ.get("MEGATRON_LM_DIR"):
        return [d for d in os.environ["MEGATRON_LM_DIR"].split(os.pathsep) if d]
    return sorted(os.path.dirname(p) for p in glob.glob(os.path.join(SHARED_CHECKOUTS, "*", "pretrain_gpt.py")))


CHECKOUT_DIRS = _checkout_dirs()
SKIP_REASON = (f"no Megatron-LM checkout: MEGATRON_LM_DIR is not set and {SHARED_CHECKOUTS} has none; the "
               "Megatron-LM pretrain_gpt.py patch and launcher tests were SKIPPED")
if not CHECKOUT_DIRS:
    pytest.skip(SKIP_REASON, allow_module_level=True)

# Megatron-LM's training code imports these beyond megatron-core's needs (the ".[megatron-lm]" extra)
MISSING = [m for m in ("six", "regex", "yaml", "pydantic") if importlib.util.find_spec(m) is None]
if MISSING:
    pytest.skip(f"Megatron-LM's training code needs {', '.join(MISSING)}: pip install -e '.[megatron-lm]' "
                "(the pretrain_gpt.py tests were SKIPPED)", allow_module_level=True)

HELPERS = os.path.join(REPO, "tests", "helpers")
PATCHES = sorted(glob.glob(os.path.join(REPO, "patches", "pretrain_gpt.py.*.patch")))
ITERS = 4
TIMEOUT = 300
# Megatron's fused kernels (megatron.core.jit) are torch.compile'd, and Megatron-LM compiles them at start-up
# (_warmup_jit_function): on CPU a large part of a short launch, and Megatron's own code, not the plugin's
# (CHANGELOG). Launches run those fusions eagerly (TORCHDYNAMO_DISABLE=1) except test_patched_pretrain_gpt's, which
# runs them compiled as a user's run does.
EAGER_FUSIONS = {"TORCHDYNAMO_DISABLE": "1"}

# What runs on CPU with gloo (see patches/README.md).
CPU_ARGS = ["--distributed-backend", "gloo", "--transformer-impl", "local", "--no-gradient-accumulation-fusion",
            "--no-persist-layer-norm", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
            "--eval-interval", "1000", "--eval-iters", "0"]
TINY_ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
             "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
             "--train-iters", str(ITERS), "--lr", "1e-3"]
MOE_ARGS = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--moe-plugin",
            "--moe-plugin-gate", "gshard"]

# The recording policy (tests/helpers) reads ``getattr(optimizer, "optimizer", optimizer)``; Megatron-LM's
# ChainedOptimizer (EP>1: a dense and an expert optimizer) raises AssertionError from that property, so the
# policy is handed the expert optimizer of the chain here. Everything else is the helper's.
POLICY_ADAPTER = '''
import dataclasses
from recording_policy import RecordingPolicy


class ChainedRecordingPolicy(RecordingPolicy):
    def __call__(self, ctx):
        chained = getattr(ctx.optimizer, "chained_optimizers", None)
        if chained is not None and len(chained) > 1:
            ctx = dataclasses.replace(ctx, optimizer=chained[-1])
        return super().__call__(ctx)
'''
POLICY_ARGS = ["--moe-plugin-placement", "megatron_lm_test_policy:ChainedRecordingPolicy"]


def _megatron_version(root):
    info = {}
    with open(os.path.join(root, "megatron", "core", "package_info.py")) as f:
        exec(compile("\n".join(line for line in f if re.match(r"(MAJOR|MINOR|PATCH) *=", line)), "package_info",
                     "exec"), info)
    return info["MAJOR"], info["MINOR"], info["PATCH"]


@pytest.fixture(scope="module", params=CHECKOUT_DIRS, ids=os.path.basename)
def checkout(request):
    root = request.param
    assert os.path.isfile(os.path.join(root, "pretrain_gpt.py")), (
        f"{root}: no pretrain_gpt.py there (expected a Megatron-LM checkout)")
    version = _megatron_version(root)
    if version >= (0, 17) and sys.version_info < (3, 12):
        pytest.skip(f"Megatron-LM {os.path.basename(root)} (megatron-core {'.'.join(map(str, version))}) needs Python "
                    f">= 3.12 (typing.override); this is {sys.version.split()[0]}: tests/run_megatron_py312.sh runs "
                    "it in the Python 3.12 environment")
    return root


def _apply_patch(root):
    """Apply the one patch of patches/ that applies to this checkout's pretrain_gpt.py (its tag's); returns its
    path."""
    fits = [p for p in PATCHES if subprocess.run(["git", "apply", "--check", p], cwd=root,
                                                 capture_output=True).returncode == 0]
    assert len(fits) == 1, f"{root}: patches that apply: {fits} (of {PATCHES})"
    p = subprocess.run(["git", "apply", "--verbose", fits[0]], cwd=root, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    assert p.returncode == 0, p.stdout
    text = open(os.path.join(root, "pretrain_gpt.py")).read()
    assert "install_megatron_lm_hooks()" in text and "moe_plugin_extra_args(" in text
    assert "moe_plugin_gpt_builder(gpt_builder)" in text or "moe_plugin_model_config(args, model_cfg)" in text
    return fits[0]


_COMPILED_CHECKOUTS = {}


def _compiled_checkout(src):
    """This process's one copy of the checkout ``src`` with its bytecode written. Every test's copy is taken from it,
    so a launch's ranks load Megatron's modules instead of each compiling several hundred of them: where
    PYTHONDONTWRITEBYTECODE is set (as on this project's machines) nothing else writes that bytecode."""
    if src not in _COMPILED_CHECKOUTS:
        base = tempfile.mkdtemp(prefix="megamoe_checkout_")
        atexit.register(shutil.rmtree, base, True)
        dst = os.path.join(base, os.path.basename(src))
        shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns(
            ".git", "tests", "docs", "images", "examples", "__pycache__", "*.pyc"))
        compileall.compile_dir(dst, quiet=1)
        _COMPILED_CHECKOUTS[src] = dst
    return _COMPILED_CHECKOUTS[src]


def _copy_checkout(src, dst):
    shutil.copytree(_compiled_checkout(src), dst, symlinks=True)
    return str(dst)


def _env(tmp_path, checkout_dir, record_dir, compiled_fusions=False):
    policy_dir = tmp_path / "policy"
    policy_dir.mkdir(exist_ok=True)
    (policy_dir / "megatron_lm_test_policy.py").write_text(POLICY_ADAPTER)
    env = dict(os.environ)
    env.pop("MEGATRON_LM_DIR", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(policy_dir), checkout_dir, REPO, HELPERS] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["OMP_NUM_THREADS"] = "1"
    env["MEGAMOE_RECORD_DIR"] = str(record_dir)
    if not compiled_fusions:
        env.update(EAGER_FUSIONS)
    return env


def _launch(cmd_tail, env, cwd, nproc=2, torchrun=False):
    """``nproc`` ranks of ``python <cmd_tail>``: under torchrun itself with ``torchrun`` (a user's command line),
    else started as torchrun starts them (``ranks_command``): (exit status, output)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd = (launcher if torchrun else ranks_command(nproc)) + cmd_tail
    p = subprocess.run(cmd, env=env, cwd=str(cwd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=TIMEOUT)
    return p.returncode, p.stdout


def _tail(out, n=80):
    return "\n".join(out.splitlines()[-n:])


def _check_training(rc, out, record_dir, log_interval):
    assert rc == 0, f"pretrain_gpt.py exited with {rc}:\n{_tail(out)}"
    losses = [float(x) for x in re.findall(r"lm loss: (\S+) \|", out)]
    assert losses, f"no 'lm loss' printed:\n{_tail(out)}"
    assert all(math.isfinite(x) for x in losses), losses
    assert re.search(rf"iteration\s+{ITERS}/\s*{ITERS} \|", out), _tail(out)
    # The recording policy ran after every optimizer step on both ranks, with iteration = steps done.
    for rank in (0, 1):
        path = record_dir / f"rank{rank}.jsonl"
        assert path.exists(), f"rank {rank} recorded nothing:\n{_tail(out)}"
        recs = [json.loads(line) for line in path.read_text().splitlines()]
        assert [r["iteration"] for r in recs] == list(range(1, ITERS + 1)), recs
        assert all(r["rank"] == rank and r["moe_layers"] == 2 and r["layer_numbers"] == [1, 2] for r in recs), recs
        assert all(r["optimizer_has_state"] for r in recs), recs
    # The per-layer metrics summary (rank 0) at every log interval, for both MoE layers.
    summary = re.findall(r"\[megamoe-plugin\] iteration\s+(\d+) \| L1 experts [0-9.]+ bal [0-9.]+ drop [0-9.]+ \| L2 experts", out)
    assert [int(i) for i in summary] == list(range(log_interval, ITERS + 1, log_interval)), _tail(out)


def test_patched_pretrain_gpt(checkout, tmp_path):
    """(a) git apply the patch to a copy of the checkout; run the patched pretrain_gpt.py itself, Megatron's fusions
    compiled as in a user's run."""
    root = _copy_checkout(checkout, tmp_path / "Megatron-LM")
    _apply_patch(root)
    record = tmp_path / "record"
    record.mkdir()
    rc, out = _launch([os.path.join(root, "pretrain_gpt.py")] + CPU_ARGS + TINY_ARGS + MOE_ARGS + POLICY_ARGS
                      + ["--log-interval", "1"], _env(tmp_path, root, record, compiled_fusions=True), tmp_path,
                      torchrun=True)
    _check_training(rc, out, record, log_interval=1)


def test_patched_pretrain_gpt_tensor_parallel_sequence_parallel_expert_parallel(checkout, tmp_path):
    """TP=2 + sequence parallel + EP=2 on 4 gloo processes through the patched script: Megatron-LM's validate_args
    asks the GPU's architecture whenever TP > 1, which the CPU shims answer (no GPU: 0), so the plugin's own TP
    checks are reached and training runs; each tensor-parallel rank routes its own sequence shard."""
    root = _copy_checkout(checkout, tmp_path / "Megatron-LM")
    _apply_patch(root)
    tp = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1"]
    rc, out = _launch([os.path.join(root, "pretrain_gpt.py")] + CPU_ARGS + TINY_ARGS + MOE_ARGS + tp
                      + ["--log-interval", "1"], _env(tmp_path, root, tmp_path), tmp_path, nproc=4)
    assert rc == 0, _tail(out)
    losses = {int(i): float(v) for i, v in LM_LOSS.findall(out)}
    assert sorted(losses) == list(range(1, ITERS + 1)) and all(math.isfinite(v) for v in losses.values()), _tail(out)
    assert re.search(r"tensor model parallel size\s*\.+\s*2", out) or "tensor_model_parallel_size" in out, _tail(out)
    summary = re.findall(r"\[megamoe-plugin\] iteration\s+(\d+) \| L1 experts [0-9.]+ bal", out)
    assert [int(i) for i in summary] == list(range(1, ITERS + 1)), _tail(out)
    # without the plugin's TP requirement met, the plugin's own check now speaks (it was never reached before)
    rc, out = _launch([os.path.join(root, "pretrain_gpt.py")] + CPU_ARGS + TINY_ARGS + MOE_ARGS
                      + ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"],
                      _env(tmp_path, root, tmp_path), tmp_path, nproc=2)
    assert rc != 0 and "error: megamoe-plugin: --expert-tensor-parallel-size=2" in out, _tail(out)


def test_launcher_unmodified_pretrain_gpt(checkout, tmp_path):
    """(b) the same through ``-m megamoe_plugin.megatron_adapter.launch`` on an unmodified copy."""
    root = _copy_checkout(checkout, tmp_path / "Megatron-LM")
    record = tmp_path / "record"
    record.mkdir()
    rc, out = _launch(["-m", "megamoe_plugin.megatron_adapter.launch", os.path.join(root, "pretrain_gpt.py")]
                      + CPU_ARGS + TINY_ARGS + MOE_ARGS + POLICY_ARGS + ["--log-interval", "2"],
                      _env(tmp_path, root, record), tmp_path, torchrun=True)
    _check_training(rc, out, record, log_interval=2)
    with open(os.path.join(root, "pretrain_gpt.py")) as f:
        assert "megamoe" not in f.read()


def test_launcher_pipeline_parallel_expert_parallel(checkout, tmp_path):
    """PP=2 x EP=2 on 4 gloo processes through the launcher: each pipeline stage holds one of the two MoE layers as
    the plugin's layer (the policy sees it on every rank after every step), and the loss is printed every step."""
    root = _copy_checkout(checkout, tmp_path / "Megatron-LM")
    record = tmp_path / "record"
    record.mkdir()
    rc, out = _launch(["-m", "megamoe_plugin.megatron_adapter.launch", os.path.join(root, "pretrain_gpt.py")]
                      + CPU_ARGS + TINY_ARGS + MOE_ARGS + POLICY_ARGS
                      + ["--pipeline-model-parallel-size", "2", "--log-interval", "1"],
                      _env(tmp_path, root, record), tmp_path, nproc=4)
    assert rc == 0, _tail(out)
    losses = {int(i): float(v) for i, v in LM_LOSS.findall(out)}
    assert sorted(losses) == list(range(1, ITERS + 1)) and all(math.isfinite(v) for v in losses.values()), _tail(out)
    layers = {}
    for rank in range(4):
        recs = [json.loads(line) for line in (record / f"rank{rank}.jsonl").read_text().splitlines()]
        assert [r["iteration"] for r in recs] == list(range(1, ITERS + 1)), recs
        assert all(r["moe_layers"] == 1 and r["optimizer_has_state"] for r in recs), recs
        layers[rank] = recs[0]["layer_numbers"]
    assert sorted(map(tuple, layers.values())) == [(1,), (1,), (2,), (2,)], layers
    summary = re.findall(r"\[megamoe-plugin\] iteration\s+(\d+) \| L1 experts [0-9.]+ bal [0-9.]+ drop [0-9.]+ \| L2", out)
    assert [int(i) for i in summary] == list(range(1, ITERS + 1)), _tail(out)


def test_bad_flag_combination_fails_at_validation(checkout, tmp_path):
    """(c) --moe-plugin-gate switch with --moe-router-topk 2: refused after Megatron's validate_args, before
    torch.distributed is initialised or any model is built."""
    root = _copy_checkout(checkout, tmp_path / "Megatron-LM")
    args = [a if a != "gshard" else "switch" for a in MOE_ARGS]
    rc, out = _launch(["-m", "megamoe_plugin.megatron_adapter.launch", os.path.join(root, "pretrain_gpt.py")]
                      + CPU_ARGS + TINY_ARGS + args, _env(tmp_path, root, tmp_path), tmp_path)
    assert rc != 0, _tail(out)
    assert re.search(r"error: megamoe-plugin: --moe-router-topk=2: the switch gate routes each token to 1 expert; "
                     r"use --moe-router-topk=1", out), _tail(out)
    assert "building GPT model" not in out and "initializing torch distributed" not in out, _tail(out)


# --- dynamic expert placement in Megatron-LM's own training loop and checkpoints ------------------------------------
PLACEMENT_LINE = re.compile(r"\[megamoe-plugin\] iteration\s+(\d+) \|.*\| placement moves (\d+) replicas (\d+)")
LM_LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: (\S+) \|")


def _slow_compute_profile(path):
    from megamoe_plugin.perfmodel.profiles import get_profile
    p = get_profile("flexmoe-a100")
    p.gemm_tflops = 1e-6            # compute dominates: the FlexMoE planner acts even for these tiny experts
    p.save(str(path))
    return str(path)


# Megatron's distributed optimizer as MoE recipes run it, bf16 with fp32 main params: EP=2 on 4 processes shards each
# expert's fp32 main copy and Adam moments over an expert-data-parallel group of 2; its fully reshardable checkpoint
# format saves them by logical expert id. (Megatron's fused softmax needs CUDA in bf16: off on CPU.)
DIST_OPT = ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable", "--bf16", "--no-masked-softmax-fusion"]


@pytest.mark.slow
# plain Adam with placement, its moves and its checkpoint resumed at other EP: the megatron-core trainer's placement
# test (tests/test_megatron_placement.py), on both releases; here the optimizer Megatron-LM's MoE recipes run
def test_flexmoe_placement_in_megatron_lm_same_training_and_checkpoint(checkout, tmp_path):
    """The patched pretrain_gpt.py with --moe-plugin-placement flexmoe, bf16 parameters and Megatron's distributed
    optimizer sharding their fp32 main copies and moments over 2 expert-data-parallel ranks (EP=2 on 4 processes):
    experts move (the summary line says so), the losses are those of the run without placement, and the torch_dist
    checkpoint written after the moves (experts and Adam state by logical id; each move carried each rank's part of
    the expert's main copy and moments) loads at EP=1 on 2 processes exactly like the checkpoint of the run without
    placement; equal to bf16 rounding (a replicated expert's gradient is summed in another order). Routing is
    deterministic (second expert always kept); the RNG state is per layout, not loaded. Four trainings of
    pretrain_gpt.py: run on the release users install today, core_v0.19.0 in
    tests/run_megatron_py312.sh; older checkouts are skipped."""
    if _megatron_version(checkout) < (0, 19):
        pytest.skip(f"{os.path.basename(checkout)}: the distributed-optimizer placement run is tested on "
                    "core_v0.19.0 (tests/run_megatron_py312.sh)")
    root = _copy_checkout(checkout, tmp_path / "Megatron-LM")
    _apply_patch(root)
    env = _env(tmp_path, root, tmp_path)
    script = os.path.join(root, "pretrain_gpt.py")
    profile = _slow_compute_profile(tmp_path / "slow.json")
    base = CPU_ARGS + TINY_ARGS + ["--num-experts", "4", "--moe-router-topk", "2", "--moe-plugin", "--moe-plugin-gate",
                                   "gshard", "--moe-plugin-second-expert-policy", "all", "--log-interval", "1"]
    placement = ["--moe-plugin-placement", "flexmoe", "--moe-plugin-placement-profile", profile,
                 "--moe-plugin-placement-threshold", "1.0", "--moe-plugin-placement-interval", "1",
                 "--moe-plugin-placement-guard", "-1"]
    base[base.index("--train-iters") + 1] = str(ITERS + 2)     # the LR schedule's length; the EP=2 runs stop at ITERS
    base[base.index("--global-batch-size") + 1] = "8"             # micro-batch 2 x data-parallel 4
    base += DIST_OPT
    nproc, resume_nproc, tol = 4, 2, 1e-4
    ep2 = ["--expert-model-parallel-size", "2"]
    runs = {}
    for name, extra in (("none", []), ("flexmoe", placement)):
        ck = str(tmp_path / f"ck_{name}")
        rc, out = _launch([script] + base + ep2 + extra + ["--save", ck, "--save-interval", str(ITERS),
                                                           "--exit-interval", str(ITERS)], env, tmp_path, nproc)
        assert rc == 0 and "successfully saved checkpoint" in out, _tail(out)
        losses = {int(i): float(v) for i, v in LM_LOSS.findall(out)}
        assert sorted(losses) == list(range(1, ITERS + 1)), _tail(out)
        runs[name] = (losses, out, ck)
    moves = {int(i): (int(m), int(r)) for i, m, r in PLACEMENT_LINE.findall(runs["flexmoe"][1])}
    assert sorted(moves) == list(range(1, ITERS + 1)) and moves[ITERS][0] > 0, _tail(runs["flexmoe"][1])
    assert "placement moves" not in runs["none"][1]
    for it, v in runs["none"][0].items():
        assert abs(runs["flexmoe"][0][it] - v) <= tol * abs(v), (runs["flexmoe"][0], runs["none"][0])
    # both checkpoints resumed for 2 more steps at EP=1: the same losses
    resumed = {}
    for name in ("none", "flexmoe"):
        cmd = ranks_command(resume_nproc) + [script] + base + ["--expert-model-parallel-size", "1", "--load",
                                                               runs[name][2], "--no-load-rng"]
        p = subprocess.run(cmd, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=TIMEOUT)
        assert p.returncode == 0, _tail(p.stdout)
        resumed[name] = {int(i): float(v) for i, v in LM_LOSS.findall(p.stdout)}
        assert sorted(resumed[name]) == [ITERS + 1, ITERS + 2], _tail(p.stdout)
    for it, v in resumed["none"].items():
        assert abs(resumed["flexmoe"][it] - v) <= tol * abs(v), resumed


def test_distributed_optimizer_placement_checkpoint_format_fails_at_validation(checkout, tmp_path):
    """With --use-distributed-optimizer, a moving placement that saves checkpoints needs the distributed optimizer's
    fully reshardable format (its default stores flat buffers in this run's slot layout): refused after Megatron's
    validate_args, the flags named, before any model is built."""
    root = _copy_checkout(checkout, tmp_path / "Megatron-LM")
    rc, out = _launch(["-m", "megamoe_plugin.megatron_adapter.launch", os.path.join(root, "pretrain_gpt.py")]
                      + CPU_ARGS + TINY_ARGS + MOE_ARGS + ["--use-distributed-optimizer", "--moe-plugin-placement",
                                                           "flexmoe", "--save", str(tmp_path / "ck"),
                                                           "--save-interval", "2"],
                      _env(tmp_path, root, tmp_path), tmp_path)
    assert rc != 0, _tail(out)
    assert re.search(r"error: megamoe-plugin: --use-distributed-optimizer with --moe-plugin-placement=flexmoe and "
                     r"--save/--load: .*--dist-ckpt-optim-fully-reshardable", out), _tail(out)
    assert "building GPT model" not in out, _tail(out)