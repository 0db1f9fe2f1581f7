"""`megamoe train` (megamoe_plugin.train), the plain-PyTorch trainer: a tiny MoE GPT trained for real on the embedded corpus, on CPU.

Runs train.main([...]) end to end: the loss falls, the per-expert load line is printed and sums to 1, an invalid
MoE option is an argparse error before any training, save + resume reproduces an uninterrupted run, the capacity
dispatch path works in one process, and the data/expert-parallel gradient sync over gloo equals one process
training on the whole batch.
"""
import argparse
import os
import re

import pytest
import torch
import torch.nn.functional as F

from conftest import run_distributed
from megamoe_plugin import MoEConfig
from megamoe_plugin import train
from megamoe_plugin.cli import main as cli_main, options_table
from megamoe_plugin.config import iter_options

TINY = ["--hidden", "64", "--layers", "2", "--heads", "2", "--ffn-hidden", "128", "--seq-len", "64",
        "--batch-size", "8", "--corpus-bytes", "300000", "--threads", "2", "--eval-interval", "0",
        "--eval-batches", "4"]
LOAD_RE = re.compile(r"L(\d+) load=\[([^\]]*)\] bal=([\d.]+) drop=([\d.]+)")
STEP_RE = re.compile(r"^step\s+(\d+)/(\d+) \| loss ([\d.]+) \| lm ([\d.]+) \| aux ([\d.]+)", re.M)


pytestmark = pytest.mark.usefixtures("single_process")   # conftest: no launcher env, threads restored


def _loads(out):
    """[(layer id, [fractions], bal, drop)] of every load entry printed."""
    return [(int(m[1]), [float(v) for v in m[2].split()], float(m[3]), float(m[4])) for m in LOAD_RE.finditer(out)]


def test_megamoe_train_learns_and_prints_expert_load(capsys):
    res = train.main(TINY + ["--steps", "30", "--log-interval", "10", "--moe-every", "1", "--lr", "3e-3"])
    out = capsys.readouterr().out
    steps = [(int(s), float(loss)) for s, _, loss, _, _ in STEP_RE.findall(out)]
    assert [s for s, _ in steps] == [10, 20, 30]
    assert steps[-1][1] < steps[0][1] - 0.3, steps                    # it learns
    assert res.history[-1]["loss"] < res.history[0]["loss"]
    assert res.step == 30 and len(res.model.moe_layers) == 2
    loads = _loads(out)
    assert {layer for layer, *_ in loads} == {0, 1} and len(loads) == 2 * 3     # every MoE layer on every line
    for layer, fracs, bal, drop in loads:
        assert len(fracs) == 8
        assert abs(sum(fracs) - 1.0) < 0.05, fracs                  # printed with 2 decimals
        assert bal >= 1.0 and 0.0 <= drop < 1.0
    for h in res.history:                                           # exact values behind the printed ones
        for s in h["moe"].values():
            assert sum(s["tokens_per_expert"]) > 0
    ev = res.evals[-1]
    assert "eval  step    30" in out and ev["tokens"] == 4 * 8 * 64
    assert ev["bpb"] == pytest.approx(ev["loss"] / 0.6931471805599453, rel=0.05)   # tokens are bytes (+ <eod>)
    assert ev["ppl"] == pytest.approx(torch.tensor(ev["loss"]).exp().item(), rel=1e-6)


def test_invalid_moe_option_is_an_argparse_error_before_training(capsys, monkeypatch):
    def no_corpus(*a, **k):
        raise AssertionError("training started despite an invalid option")

    monkeypatch.setattr(train, "build_corpus", no_corpus)
    with pytest.raises(SystemExit) as exc:
        train.main(TINY + ["--steps", "5", "--moe-top-k", "9"])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert "--moe-top-k" in captured.err and "error:" in captured.err and "9" in captured.err
    assert "step" not in captured.out
    with pytest.raises(SystemExit) as exc:                            # also through the console command
        cli_main(["train", "--moe-num-experts", "6", "--moe-expert-parallel-size", "4"])
    assert exc.value.code == 2 and "--moe-num-experts" in capsys.readouterr().err
    with pytest.raises(SystemExit):                                   # a choice is checked by argparse itself
        train.main(["--moe-dispatch", "sometimes"])
    assert "--moe-dispatch" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.main(TINY + ["--steps", "5", "--moe-expert-cache-size", "2"])        # inference only (paper 004)
    assert "--moe-expert-cache-size=2: inference only" in capsys.readouterr().err


def test_every_moe_option_is_a_flag(capsys):
    parser = train.build_parser()
    flags = {s for a in parser._actions for s in a.option_strings}
    for opt in iter_options():
        assert opt["flag"] in flags
        if opt["type"] is bool:
            assert "--no-" + opt["flag"][2:] in flags
    args = parser.parse_args(["--moe-num-experts", "4", "--moe-gate", "switch", "--moe-top-k", "1",
                              "--moe-router-dtype", "input", "--moe-capacity-factor", "1.5"])
    cfg = train.moe_config_from_args(args)
    assert (cfg.num_experts, cfg.gate, cfg.top_k, cfg.router_dtype, cfg.capacity_factor) == (4, "switch", 1, "input", 1.5)
    default = train.moe_config_from_args(parser.parse_args([]))
    assert (default.num_experts, default.gate, default.top_k, default.dispatch, default.aux_loss_coeff) == \
        (8, "gshard", 2, "dropless", 0.01)
    assert cli_main(["options", "--width", "100"]) == 0
    out = capsys.readouterr().out
    assert out == options_table(100) + "\n"
    for opt in iter_options():
        assert opt["flag"] in out


def test_options_table_spells_each_trainers_flags(capsys):
    """`megamoe options --trainer X` lists the flags the way X's command line takes them."""
    def flags(trainer):
        assert cli_main(["options", "--width", "200", "--trainer", trainer]) == 0
        return {line.split()[0] for line in capsys.readouterr().out.splitlines()[2:] if line.startswith("--")}
    megatron, fairseq = flags("megatron"), flags("fairseq")
    assert {"--moe-plugin", "--num-experts", "--moe-router-topk", "--expert-model-parallel-size",
            "--moe-plugin-gate", "--moe-plugin-schedule"} <= megatron
    assert "--moe-num-experts" not in megatron and "--moe-gate" not in megatron
    assert {"--moe-expert-count", "--moe-gate-loss-wt", "--moe-second-expert-policy", "--moe-gating-use-fp32",
            "--moe-eval-capacity-token-fraction", "--moe-freq", "--moe-gate", "--moe-no-normalize-top-k",
            "--activation-fn"} <= fairseq
    assert "--moe-num-experts" not in fairseq and "--moe-aux-loss-coeff" not in fairseq
    # every flag fairseq lists is one its parser really has (rendered from the same fields)
    pytest.importorskip("fairseq")
    from fairseq import options
    from megamoe_plugin.fairseq_adapter import user_dir
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, input_args=["/nonexistent", "--user-dir", user_dir(), "--task",
                                                           "language_modeling", "--arch", "moe_transformer_lm_tiny"])
    for f in fairseq - {"--activation-fn"}:
        assert hasattr(args, f[2:].replace("-", "_")), f


def test_save_resume_reproduces_an_uninterrupted_run(tmp_path, capsys):
    ck = str(tmp_path / "ck.pt")
    common = TINY + ["--steps", "16", "--log-interval", "4", "--warmup", "2"]
    straight = train.main(common)
    first = train.main(common + ["--exit-interval", "8", "--save", ck])
    assert first.step == 8 and os.path.exists(ck)
    saved = torch.load(ck, weights_only=True)
    assert saved["step"] == 8 and MoEConfig.from_dict(saved["moe_config"]) == first.moe_config
    capsys.readouterr()

    loaded = train.main(TINY + ["--steps", "8", "--resume", ck])       # nothing left to train: the loaded weights
    assert loaded.step == 8 and loaded.start_step == 8
    for name, value in loaded.model.state_dict().items():
        assert torch.equal(value, saved["model"][name]), name
    opt_state = loaded.optimizer.state_dict()["state"]
    assert all(torch.equal(opt_state[i]["exp_avg"], saved["optimizer"]["state"][i]["exp_avg"]) for i in opt_state)

    resumed = train.main(common + ["--resume", ck])
    out = capsys.readouterr().out
    assert "resumed from" in out and "at step 8" in out
    assert resumed.start_step == 8 and resumed.step == 16
    assert [h["step"] for h in resumed.history] == [12, 16]
    for name, value in resumed.model.state_dict().items():            # same data, LR, RNG and optimizer state
        assert torch.equal(value, straight.model.state_dict()[name]), name
    assert resumed.history[-1]["loss"] == straight.history[-1]["loss"]

    with pytest.raises(SystemExit):                                   # another model shape does not resume
        train.main(TINY + ["--steps", "16", "--hidden", "32", "--resume", ck])
    assert "--hidden" in capsys.readouterr().err


def test_capacity_dispatch_single_process_and_trace(tmp_path, capsys):
    assert "WORLD_SIZE" not in os.environ                             # the torchrun-free path
    trace = str(tmp_path / "trace")
    res = train.main(TINY + ["--steps", "6", "--log-interval", "3", "--moe-dispatch", "capacity",
                             "--moe-capacity-factor", "0.5", "--trace", trace])
    out = capsys.readouterr().out
    assert "dispatch capacity (capacity factor 0.5)" in out
    loads = _loads(out)
    assert len(loads) == 2 and all(abs(sum(f) - 1.0) < 0.05 for _, f, _, _ in loads)
    assert all(drop > 0.2 for *_, drop in loads)                      # CF 0.5 drops at least half of k=2
    capacity = res.model.moe_layers[0].capacity_for(8 * 64)
    assert capacity is not None and max(h["moe"][1]["tokens_per_expert"][e] for h in res.history
                                        for e in range(8)) <= 3 * capacity[0]
    from megamoe_plugin.stats import load_trace
    t = load_trace(trace)
    assert t["counts"].shape == (6, 1, 1, 8) and t["steps"].tolist() == list(range(1, 7))
    assert int(t["counts"][0].sum()) <= 8 * capacity[0]


def test_cli_passes_flags_through(monkeypatch):
    seen = {}
    monkeypatch.setattr(train, "main", lambda argv: seen.setdefault("argv", argv))
    assert cli_main(["train", "--steps", "3", "--moe-top-k", "1", "-h"]) == 0
    assert seen["argv"] == ["--steps", "3", "--moe-top-k", "1", "-h"]
    with pytest.raises(SystemExit):
        cli_main([])


# --- data + expert parallelism over gloo: the gradients equal one process on the whole batch -----------------
ARCH = dict(seed=3, hidden=32, heads=2, layers=2, ffn_hidden=48, seq_len=16, moe_every=1, dropout=0.0)


def _moe_cfg(world, ep):
    return MoEConfig(num_experts=4, top_k=2, gate="gshard", second_expert_policy="all", aux_loss_coeff=0.0,
                     router_dtype="input",                           # all float64: compare to 1e-12
                     world_size=world, expert_parallel_size=ep)


def _global_batch(world):
    gen = torch.Generator().manual_seed(11)
    return torch.randint(0, 258, (2 * world, ARCH["seq_len"] + 1), generator=gen)


def _step_grads(model, tokens, ps):
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
    train.sync_gradients(model, ps)
    norm = train.clip_grad_norm(model, 0.05, ps)                      # clips: the global norm is compared too
    return norm, {n: p.grad.clone() for n, p in model.named_parameters()}


def _dist_worker(rank, world, ep, out_dir):
    ps = train.make_parallel_state(ep)
    model = train.build_model(_moe_cfg(world, ep), 258, argparse.Namespace(**ARCH), ps).double()
    tokens = _global_batch(world)[2 * rank:2 * rank + 2]
    norm, grads = _step_grads(model, tokens, ps)
    torch.save({"norm": norm, "grads": grads, "params": dict(model.state_dict())},
               os.path.join(out_dir, f"ep{ep}.rank{rank}"))


@pytest.mark.parametrize("world,ep", [(2, 1), (2, 2), (4, 2)])     # DP only; EP = world; 2 EP groups x 2
def test_parallel_gradients_equal_single_process(tmp_path, world, ep):
    run_distributed(_dist_worker, world, ep, str(tmp_path))
    ref = train.build_model(_moe_cfg(1, 1), 258, argparse.Namespace(**ARCH), train.ParallelState()).double()
    ref_norm, ref_grads = _step_grads(ref, _global_batch(world), train.ParallelState())
    for rank in range(world):
        got = torch.load(os.path.join(tmp_path, f"ep{ep}.rank{rank}"), weights_only=True)
        assert got["norm"] == pytest.approx(ref_norm, rel=1e-9)
        per = 4 // ep
        lo = (rank % ep) * per
        for name, g in got["grads"].items():
            want, param = ref_grads[name], ref.state_dict()[name]
            if name.endswith(("experts.w1", "experts.w2")):
                want, param = want[lo:lo + per], param[lo:lo + per]   # this rank's experts
            assert torch.equal(got["params"][name], param), name       # the same init for every EP size
            assert (g - want).abs().max() < 1e-12, (name, ep)


def test_logged_throughput_counts_the_training_steps_only(capsys, monkeypatch):
    """An interval whose steps straddle an evaluation: the logged tok/s is the interval's tokens over its steps'
    own training time, so the log lines' step times add up to the run's training seconds (an evaluation made
    slow here, 0.3 s, would otherwise either inflate the interval's time or, by restarting its clock, shrink it)."""
    import time as _time
    real = train.evaluate

    def slow_eval(*a, **k):
        _time.sleep(0.3)
        return real(*a, **k)
    monkeypatch.setattr(train, "evaluate", slow_eval)
    argv = [a for a in TINY]
    argv[argv.index("--eval-interval") + 1] = "2"
    res = train.main(argv + ["--steps", "9", "--log-interval", "3", "--eval-batches", "1"])
    tokens = 8 * 64
    logged = sum(3 * tokens / h["tokens_per_s"] for h in res.history)
    assert abs(logged / res.train_seconds - 1) < 0.05, (logged, res.train_seconds)


def test_router_family_trains_moves_its_expert_bias_and_resumes(tmp_path):
    """DeepSeek-V3's router in `megamoe train`: sigmoid scores, group-limited top-4, scaling, the per-sequence loss
    and the aux-loss-free expert bias, which the trainer moves once per step by +-rate (the sign of each expert's
    load error) and which a checkpoint carries: the resumed run ends where the uninterrupted one does."""
    ck = str(tmp_path / "ck.pt")
    rate = 0.01
    common = TINY + ["--steps", "8", "--log-interval", "4", "--moe-gate", "topk", "--moe-top-k", "4",
                     "--moe-score-function", "sigmoid", "--moe-router-expert-bias", "--moe-router-bias-update-rate",
                     str(rate), "--moe-num-groups", "4", "--moe-group-topk", "2", "--moe-topk-scaling-factor", "2.5",
                     "--moe-load-balancing-type", "seq_aux_loss:0.001"]
    straight = train.main(common)
    biases = [m.expert_bias for m in straight.model.modules() if getattr(m, "expert_bias", None) is not None]
    assert biases and all(b.abs().max() > 0 for b in biases)
    for b in biases:        # 8 sign steps of +-rate (or 0) per expert: a multiple of the rate, at most 8 of them
        steps = b / rate
        assert torch.allclose(steps, steps.round(), atol=1e-4) and steps.abs().max() <= 8
    assert straight.history[-1]["aux_loss"] > 0
    train.main(common + ["--exit-interval", "4", "--save", ck])
    assert any(k.endswith("gate.expert_bias") for k in torch.load(ck, weights_only=True)["model"])
    resumed = train.main(common + ["--resume", ck])
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value, straight.model.state_dict()[name]), name
