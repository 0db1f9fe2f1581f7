"""Today's MoE recipes through Megatron-LM's own ``pretrain_gpt.py`` with ``--moe-plugin`` (the patched script and the
launcher, EP=2 on two gloo processes, scaled down), and checkpoints that pass between a native megatron-core run and a
plugin run.

- every recipe of RECIPES trains with the plugin, its router flags unchanged (the start-up line names the router);
- interchange: a native run saves at iteration 2; from it, a native run and a plugin run print the same lm loss for
  five iterations (to 1e-4 relative) and save at iteration 7; the plugin's checkpoint then loads into a native run
  that continues exactly as the native checkpoint's does, at EP=2 with its optimizer state and at EP=1 (a native
  resume is the reference: a resumed megatron-core run is not bit-equal to an uninterrupted one).

Megatron-LM core_v0.19.0 (megatron-core 0.19.x, Python 3.12: ``tests/run_megatron_py312.sh``); core_v0.16.1 runs the
interchange with the Mixtral recipe (0.16 lacks some options and computes some losses as 0.17+ no longer do).
Native megatron-core MoE runs on CPU need ``--swiglu`` (its local experts fuse no other activation) and
``--disable-bias-linear`` (its SequentialMLP adds the expert bias in place on an autograd view). On CPU,
Megatron-LM's own argument validation refuses ``--moe-grouped-gemm`` (it asks for a GPU of compute capability 8+),
so the Qwen3 recipe runs here without it."""
import os
import re

import pytest
from conftest import ranks_command

from test_megatron_lm import (CPU_ARGS, EAGER_FUSIONS, LM_LOSS, TIMEOUT, _apply_patch, _copy_checkout,  # noqa: F401
                              _megatron_version, _tail, checkout)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
         "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0", "--moe-ffn-hidden-size", "48"]
NATIVE_OK = ["--swiglu", "--disable-bias-linear"]

RECIPES = {
    "mixtral": NATIVE_OK + ["--num-experts", "8", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
                            "--moe-token-dispatcher-type", "alltoall"],
    "qwen3_30b_a3b": NATIVE_OK + ["--num-experts", "16", "--moe-router-topk", "8", "--moe-router-load-balancing-type",
                                  "global_aux_loss", "--moe-aux-loss-coeff", "1e-3", "--moe-router-dtype", "fp32",
                                  "--moe-token-dispatcher-type", "flex"],
    "deepseek_v3": NATIVE_OK + ["--num-experts", "8", "--moe-router-topk", "4", "--moe-router-score-function", "sigmoid",
                                "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-3",
                                "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
                                "--moe-router-topk-scaling-factor", "2.5", "--moe-router-load-balancing-type",
                                "seq_aux_loss", "--moe-aux-loss-coeff", "1e-4", "--moe-shared-expert-intermediate-size",
                                "64", "--moe-router-dtype", "fp32", "--moe-token-dispatcher-type", "alltoall",
                                "--mtp-num-layers", "1", "--position-embedding-type", "rope", "--no-rope-fusion"],
    "deepseek_v2_lite": NATIVE_OK + ["--num-experts", "8", "--moe-router-topk", "6", "--moe-router-pre-softmax",
                                     "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-3",
                                     "--moe-shared-expert-intermediate-size", "96"],
    "gpt_oss": ["--quick-geglu", "--num-experts", "8", "--moe-router-topk", "4", "--moe-aux-loss-coeff", "1e-2",
                "--moe-z-loss-coeff", "1e-3", "--moe-token-dispatcher-type", "alltoall"],
    "nemotron_3_nano": ["--squared-relu", "--disable-bias-linear", "--num-experts", "8", "--moe-router-topk", "6",
                        "--moe-router-score-function", "sqrtsoftplus", "--moe-router-enable-expert-bias",
                        "--moe-router-topk-scaling-factor", "2.5", "--moe-aux-loss-coeff", "1e-4",
                        "--moe-shared-expert-intermediate-size", "64", "--moe-router-dtype", "fp64"],
    "llama4_scout": NATIVE_OK + ["--num-experts", "8", "--moe-router-topk", "1", "--moe-router-score-function",
                                 "sigmoid", "--moe-shared-expert-intermediate-size", "64",
                                 "--moe-shared-expert-overlap", "--moe-token-dispatcher-type", "alltoall"],
    "capacity_drop_position": NATIVE_OK + ["--num-experts", "8", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
                                           "--moe-expert-capacity-factor", "1.0", "--moe-token-drop-policy",
                                           "position", "--moe-pad-expert-input-to-capacity"],
}
ROUTER_LINE = re.compile(r"megamoe-plugin: note: MoE layers: the plugin's router \[([^\]]*)\]")


def _run(root, tmp_path, args, nproc=2, check=True, patched=False):
    """pretrain_gpt.py through the launcher (or, ``patched``, the patched script itself), its ranks started as
    torchrun starts them (``ranks_command``): ({iteration: lm loss},
    output); with check=False the exit status is returned as the output's first line instead of asserted."""
    import subprocess
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", **EAGER_FUSIONS,
               PYTHONPATH=os.pathsep.join([root, REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env.pop("MEGATRON_LM_DIR", None)
    entry = [] if patched else ["-m", "megamoe_plugin.megatron_adapter.launch"]
    cmd = ranks_command(nproc) + [*entry, os.path.join(root, "pretrain_gpt.py")] + CPU_ARGS + MODEL + args
    p = subprocess.run(cmd, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=TIMEOUT)
    if not check:
        return {}, f"rc={p.returncode}\n{p.stdout}"
    assert p.returncode == 0, _tail(p.stdout)
    return {int(i): float(v) for i, v in LM_LOSS.findall(p.stdout)}, p.stdout


def _needs_019(checkout):  # noqa: F811
    if _megatron_version(checkout) < (0, 19):
        pytest.skip(f"{os.path.basename(checkout)}: these recipes need megatron-core 0.19's router options "
                    "(tests/run_megatron_py312.sh runs them on core_v0.19.0)")


# what the start-up line's router description must say for each recipe
ROUTER_WORDS = {
    "mixtral": ["softmax", "top-2", "aux_loss 0.01"],
    "qwen3_30b_a3b": ["softmax", "top-8", "global_aux_loss 0.001"],
    "deepseek_v3": ["sigmoid", "top-4", "2 of 4 groups", "expert bias (rate 0.001)", "scaling 2.5",
                    "seq_aux_loss 0.0001"],
    "deepseek_v2_lite": ["softmax", "top-6", "seq_aux_loss 0.001"],
    "gpt_oss": ["softmax", "top-4", "aux_loss 0.01", "z-loss 0.001"],
    "nemotron_3_nano": ["sqrtsoftplus", "top-6", "expert bias", "scaling 2.5", "aux_loss 0.0001"],
    "llama4_scout": ["sigmoid", "top-1", "no balance loss"],
    "capacity_drop_position": ["softmax", "top-2", "aux_loss 0.01"],
}


@pytest.mark.slow
def test_recipes_train_with_the_plugin(checkout, tmp_path):  # noqa: F811
    """Every recipe of RECIPES, 3 iterations at EP=2 with --moe-plugin, every other one through the patched
    pretrain_gpt.py and the others through the launcher: a finite lm loss every iteration, and the router the
    start-up line describes is the recipe's."""
    _needs_019(checkout)
    root = _copy_checkout(checkout, tmp_path / "Megatron-LM")
    _apply_patch(root)
    for i, (name, flags) in enumerate(RECIPES.items()):
        losses, out = _run(root, tmp_path, flags + ["--expert-model-parallel-size", "2", "--train-iters", "3",
                                                    "--moe-plugin"], patched=i % 2 == 1)
        assert sorted(losses) == [1, 2, 3] and all(0 < v < 10 for v in losses.values()), (name, _tail(out))
        router = ROUTER_LINE.search(out)
        assert router and all(w in router.group(1) for w in ROUTER_WORDS[name]), (name, _tail(out))
        if "--mtp-num-layers" in flags:      # the MTP block's MoE layer is the plugin's too: its metrics say L3
            assert re.search(r"\[megamoe-plugin\] iteration\s+3 \|.*\| L3 experts", out), (name, _tail(out))
    assert "capacity 1 (position, padded)" in out, _tail(out)


@pytest.mark.slow
def test_native_checkpoint_into_plugin_and_back(checkout, tmp_path):  # noqa: F811
    root = _copy_checkout(checkout, tmp_path / "Megatron-LM")
    recipe = "deepseek_v3" if _megatron_version(checkout) >= (0, 19) else "mixtral"
    base = RECIPES[recipe] + ["--train-iters", "9"]
    ep2 = ["--expert-model-parallel-size", "2"]
    ck = {n: str(tmp_path / n) for n in ("start", "native7", "plugin7")}
    first, _ = _run(root, tmp_path, base + ep2 + ["--save", ck["start"], "--save-interval", "2", "--exit-interval", "2"])
    assert sorted(first) == [1, 2]
    runs = {}
    for name, plugin in (("native7", []), ("plugin7", ["--moe-plugin"])):
        runs[name], out = _run(root, tmp_path, base + ep2 + plugin + ["--load", ck["start"], "--save", ck[name],
                                                                      "--save-interval", "7", "--exit-interval", "7"])
        assert sorted(runs[name]) == [3, 4, 5, 6, 7], _tail(out)
        assert ("MoE layers: the plugin's router" in out) == bool(plugin), _tail(out)
    for it, v in runs["native7"].items():
        assert abs(runs["plugin7"][it] - v) <= 1e-4 * abs(v), (recipe, runs)
    # both checkpoints continue natively: with their optimizer state at EP=2, and at EP=1 (weights only:
    # megatron-core's Adam state and RNG states do not reshard to another expert-parallel size)
    layouts = [ep2]
    if _megatron_version(checkout) >= (0, 19):      # the resharded resume on one release (the suite's time budget)
        layouts.append(["--expert-model-parallel-size", "1", "--no-load-optim", "--no-load-rng"])
    for layout in layouts:
        resumed = {}
        for name in ("native7", "plugin7"):
            resumed[name], out = _run(root, tmp_path, base + layout + ["--load", ck[name]])
            assert sorted(resumed[name]) == [8, 9] and "MoE layers: the plugin" not in out, _tail(out)
        for it, v in resumed["native7"].items():
            assert abs(resumed["plugin7"][it] - v) <= 1e-4 * abs(v), (recipe, layout, resumed)


@pytest.mark.slow
def test_distributed_optimizer_flat_state_is_not_loaded_across_layer_kinds(checkout, tmp_path):  # noqa: F811
    """A native run's distributed-optimizer checkpoint in its default (per-rank flat buffer) format holds the Adam
    state in the native parameter order: a plugin run refuses to load it into its own layers, naming what to do
    (the weights alone load with --no-load-optim; measured: loading it silently put the state on the wrong
    parameters). bf16 with fp32 main parameters, as Megatron's distributed optimizer runs on CPU."""
    _needs_019(checkout)
    root = _copy_checkout(checkout, tmp_path / "Megatron-LM")
    base = RECIPES["mixtral"] + ["--train-iters", "4", "--expert-model-parallel-size", "2",
                                 "--use-distributed-optimizer", "--bf16", "--no-masked-softmax-fusion"]
    ck = str(tmp_path / "native")
    _run(root, tmp_path, base + ["--save", ck, "--save-interval", "2", "--exit-interval", "2"])
    _, out = _run(root, tmp_path, base + ["--load", ck, "--moe-plugin"], check=False)
    assert not out.startswith("rc=0") and "was written by a native megatron-core run" in out, _tail(out)
    assert "--no-load-optim" in out and "--dist-ckpt-optim-fully-reshardable" in out
    losses, _ = _run(root, tmp_path, base + ["--load", ck, "--moe-plugin", "--no-load-optim"])
    assert sorted(losses) == [3, 4]
