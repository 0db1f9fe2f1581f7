"""Bad input stops early with a message that names the flag, or warns once where a setting is legal but does
nothing: in the core, `megamoe train`, the Megatron trainer and fairseq-train.

- Non-finite router outputs (a NaN in one token's MoE input) stop training naming the MoE layer, the step and the
  rank (or, with --moe-nonfinite skip, drop exactly that update), in megamoe train, the Megatron trainer and
  fairseq-train.
- A bf16 input into an fp32 MoE layer is a TypeError at the layer's entry that says what to do.
- Gates that would act like another gate warn (hir on one node, ta_moe with a uniform target) or refuse (ta_moe
  without its loss); --moe-every 0 warns; fairseq's --moe-freq 0 is refused.
- Megatron's messages and option listing spell derived options the Megatron way.
"""
import math
import os
import subprocess
import sys

import pytest
import torch

from megamoe_plugin import MoEConfig, MoELayer, train
from megamoe_plugin.config import ConfigError
from megamoe_plugin.gates import gate_warnings
from megamoe_plugin.stats import NonFiniteRoutingError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELPERS = os.path.join(REPO, "tests", "helpers")
TINY = ["--hidden", "64", "--layers", "2", "--heads", "2", "--ffn-hidden", "128", "--seq-len", "32",
        "--batch-size", "4", "--corpus-bytes", "200000", "--threads", "1", "--eval-interval", "0",
        "--eval-batches", "2", "--log-interval", "1", "--moe-every", "1", "--steps", "5",
        "--moe-placement", "poison_policy:PoisonOnce"]


@pytest.fixture
def poison(monkeypatch):
    monkeypatch.syspath_prepend(HELPERS)
    monkeypatch.setenv("MEGAMOE_POISON_AT", "2")


def test_megamoe_train_nonfinite_raise_names_layer_step_and_rank(poison, single_process):
    with pytest.raises(NonFiniteRoutingError) as err:
        train.main(TINY)
    text = str(err.value)
    assert "step 3" in text and "rank 0: MoE layer(s) 1" in text and "--moe-nonfinite skip" in text, text


def test_megamoe_train_nonfinite_skip_drops_exactly_that_update(poison, single_process, capsys):
    res = train.main([*TINY, "--moe-nonfinite", "skip"])
    out = capsys.readouterr().out
    assert res.skipped_steps == 1 and "step     3: update skipped" in out, out[-2000:]
    assert [h["step"] for h in res.history] == [1, 2, 3, 4, 5]
    assert all(math.isfinite(h["loss"]) for h in res.history if h["step"] != 3)
    assert all(torch.isfinite(p).all() for p in res.model.parameters())


def test_bf16_input_into_fp32_layer_is_a_clear_type_error():
    layer = MoELayer(MoEConfig(num_experts=4, top_k=2), 16, 32)
    with pytest.raises(TypeError, match=r"MoE layer 0: input dtype torch.bfloat16 but the expert weights are "
                                        r"torch.float32; cast the model"):
        layer(torch.randn(8, 16, dtype=torch.bfloat16))
    assert layer(torch.randn(8, 16)).shape == (8, 16)


def test_gates_check_their_own_options():
    one_node = dict(topology="[0,1,2,3]", world_size=4, expert_parallel_size=4)
    two_nodes = dict(topology="[[0,1],[2,3]]", topology_bandwidth_gbps="100,25", world_size=4,
                     expert_parallel_size=4)
    warn = gate_warnings(MoEConfig(gate="hir", **one_node))
    assert len(warn) == 1 and "--moe-gate=hir" in warn[0] and "naive top-k" in warn[0]
    assert gate_warnings(MoEConfig(gate="hir", **two_nodes)) == []
    warn = gate_warnings(MoEConfig(gate="ta_moe", **one_node))
    assert len(warn) == 1 and "uniform" in warn[0] and "GShard" in warn[0]
    warn = gate_warnings(MoEConfig(gate="ta_moe", world_size=2, expert_parallel_size=2, topology="[[0],[1]]",
                                   topology_bandwidth_gbps="100,25"))
    assert len(warn) == 1 and "uniform" in warn[0]          # 2 ranks: one remote peer, nothing to reweight
    assert gate_warnings(MoEConfig(gate="ta_moe", **two_nodes)) == []
    with pytest.raises(ConfigError, match=r"--moe-aux-loss-coeff=0.0 with --moe-load-balancing-type=aux_loss switches it off"):
        gate_warnings(MoEConfig(gate="ta_moe", aux_loss_coeff=0.0, **two_nodes))
    assert gate_warnings(MoEConfig(gate="gshard", **one_node)) == []


def test_megamoe_train_warns_once_for_dense_model_and_flat_hir(single_process, capsys):
    from megamoe_plugin import notices
    notices._SEEN.clear()
    train.main([*TINY[:-2], "--steps", "1", "--moe-every", "0"])
    err = capsys.readouterr().err
    assert err.count("--moe-every=0: a dense model") == 1, err
    notices._SEEN.clear()
    train.main([*TINY[:-2], "--steps", "1", "--moe-gate", "hir"])
    err = capsys.readouterr().err
    assert err.count("megamoe-plugin: warning: --moe-gate=hir") == 1, err


def test_megatron_spells_derived_options_and_messages():
    from megamoe_plugin.cli import options_table
    from megamoe_plugin.megatron_adapter import trainer
    table = options_table(200, "megatron")
    rows = [line for line in table.splitlines() if line.startswith("--moe-expert-capacity-factor")]
    assert len(rows) == 4 and "float" in "".join(rows) and "-> dispatch" in "".join(rows), rows
    assert "-> eval_capacity_factor" in "".join(rows) and "-> min_capacity" in "".join(rows), rows
    assert "str" not in rows[0].split()[:3]
    with pytest.raises(ConfigError) as err:
        trainer.parse_args(["--num-experts", "4", "--moe-plugin", "--moe-plugin-capacity-policy", "dynamic"])
    assert "--moe-expert-capacity-factor <factor> (capacity dispatch)" in str(err.value), err.value
    assert "--moe-expert-capacity-factor capacity" not in str(err.value)
    with pytest.raises(ConfigError, match="--moe-aux-loss-coeff=0.0"):       # Megatron's default coefficient is 0
        trainer.parse_args(["--num-experts", "4", "--moe-plugin", "--moe-plugin-gate", "ta_moe",
                            "--moe-plugin-topology", "[[0]]"])



def test_a_flag_error_in_pretrain_gpt_stops_every_rank_with_rank_0s_line(capsys, monkeypatch):
    """Every rank finds a bad flag; torchrun stops the job at the first rank to exit, so rank 0 (the one that
    prints) exits first and the others, silent, only after a grace period, all with argparse's status 2."""
    import time
    from megamoe_plugin.megatron_adapter.args import exit_with_error
    monkeypatch.setenv("RANK", "0")                                    # as torchrun sets it
    with pytest.raises(SystemExit) as stop:
        exit_with_error("--moe-plugin-gate=nope: unknown", grace_s=5.0)
    assert stop.value.code == 2 and capsys.readouterr().err == "error: --moe-plugin-gate=nope: unknown\n"
    start = time.monotonic()
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as stop:
        exit_with_error("--moe-plugin-gate=nope: unknown", status=3, grace_s=0.3)
    assert stop.value.code == 3 and time.monotonic() - start >= 0.3
    assert capsys.readouterr().err == ""

def _megatron(args, **env):
    e = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
             PYTHONPATH=os.pathsep.join([HELPERS, REPO, os.environ.get("PYTHONPATH", "")]), **env)
    cmd = [sys.executable, "-m", "megamoe_plugin.megatron_adapter.trainer", "--num-layers", "2", "--hidden-size",
           "64", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "4", "--log-interval",
           "1", "--corpus-bytes", "200000", "--num-experts", "4", "--moe-plugin", "--train-iters", "4",
           "--moe-plugin-placement", "poison_policy:PoisonOnce", *args]
    return subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=300, cwd=REPO)


def test_megatron_trainer_nonfinite_raise_and_skip(tmp_path):
    pytest.importorskip("megatron.core")
    cache = ["--data-cache-path", str(tmp_path)]
    p = _megatron(cache)
    assert p.returncode != 0 and "NonFiniteRoutingError" in p.stderr, p.stderr[-3000:]
    assert "at step 3: rank 0: MoE layer(s) 2" in p.stderr, p.stderr[-3000:]
    p = _megatron([*cache, "--moe-plugin-nonfinite", "skip"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "iteration      3: update skipped" in p.stdout and " iteration      4/4 | lm loss" in p.stdout, p.stdout


def test_fairseq_nonfinite_raise_and_moe_freq_zero(tmp_path):
    pytest.importorskip("fairseq")
    from test_fairseq_train import fairseq_cli, lm_args
    from megamoe_plugin.data.corpus import write_text_splits
    write_text_splits(tmp_path / "raw", formats=("txt",), max_bytes=100_000)
    fairseq_cli("preprocess", ["--only-source", "--trainpref", str(tmp_path / "raw/train.txt"), "--validpref",
                               str(tmp_path / "raw/valid.txt"), "--destdir", str(tmp_path / "bin"), "--nwordssrc",
                               "500", "--workers", "1"])
    data = str(tmp_path / "bin")
    code, out = fairseq_cli("train", lm_args(data, tmp_path / "ck", 4, "--moe-placement", "poison_policy:PoisonOnce",
                                             "--no-save"), check=False)
    assert code != 0 and "non-finite router output" in out and "at step 3: rank 0: MoE layer(s) 0" in out, out[-3000:]
    code, out = fairseq_cli("train", lm_args(data, tmp_path / "ck", 2, "--moe-freq", "0", "--no-save"), check=False)
    assert code != 0 and "--moe-freq=0: must be >= 1" in out and "begin training epoch" not in out, out[-3000:]


def test_expert_parallel_size_that_does_not_fit_the_world_says_so():
    pytest.importorskip("fairseq")
    import argparse
    from megamoe_plugin.fairseq_adapter.args import config_from_fairseq
    args = argparse.Namespace(moe_expert_count=6, moe_expert_parallel_size=3, arch="moe_transformer_lm_tiny")
    with pytest.raises(ConfigError) as err:
        config_from_fairseq(args, world_size=2)
    assert "--moe-expert-parallel-size=3: does not fit a world of 2 rank(s)" in str(err.value), err.value
