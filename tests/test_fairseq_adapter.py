"""The plugin inside fairseq, in process (real fairseq parsers, tasks, models, criteria and optimizers; no mocks):

- fairseq's moe-branch flag names (--moe-expert-count, --moe-gate-loss-wt, ...) and ours parse and map onto MoEConfig;
- every registered gate is selectable by --moe-gate and routes a real model's tokens;
- bad flags fail with the fairseq spelling of the flag in the message;
- layer surgery: every --moe-freq-th encoder/decoder layer gets the MoE FFN, the others stay dense;
- the MoE FFN is the core MoELayer, and pads (via fairseq's padding masks) are neither routed nor given an output;
- the criteria add the combined aux loss and log per-layer expert counts; reduce_metrics derives the statistics;
- checkpoints hold every expert ([E, ...]) and reject a wrong expert count;
- with 2 gloo processes: expert gradient sync, the global gradient norm, gathering/slicing expert checkpoints.
"""
import argparse
import math

import pytest

pytest.importorskip("fairseq")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from conftest import run_distributed  # noqa: E402
from megamoe_plugin.config import GATE_NAMES, ConfigError, MoEConfig  # noqa: E402
from megamoe_plugin.fairseq_adapter import register  # noqa: E402,F401  (registers models/criteria, installs hooks)
from megamoe_plugin.fairseq_adapter import user_dir  # noqa: E402
from megamoe_plugin.fairseq_adapter.args import config_from_fairseq  # noqa: E402
from megamoe_plugin.fairseq_adapter.layers import FairseqMoEFFN, _read_local_experts, moe_ffns  # noqa: E402
from megamoe_plugin.gates import registered_gates  # noqa: E402
from megamoe_plugin.layer import MoELayer  # noqa: E402

LM = ["--task", "language_modeling", "--arch", "moe_transformer_lm_tiny"]
MT = ["--task", "translation", "--arch", "moe_transformer_tiny", "-s", "de", "-t", "en"]
SYMBOLS = "abcdefghij"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A data dir with the dictionaries fairseq's language_modeling and translation tasks load at setup."""
    d = tmp_path_factory.mktemp("fairseq-data")
    for name in ("dict.txt", "dict.de.txt", "dict.en.txt"):
        (d / name).write_text("".join(f"{w} 10\n" for w in SYMBOLS))
    return str(d)


def _parse(data, *argv):
    from fairseq import options
    parser = options.get_training_parser()
    return options.parse_args_and_arch(parser, input_args=[data, "--user-dir", user_dir(), *argv])


def _build(data, *argv, seed=0):
    from fairseq import tasks
    args = _parse(data, *argv)
    task = tasks.setup_task(args)
    torch.manual_seed(seed)
    return args, task, task.build_model(args)


def _tokens(dictionary, lengths, T, left_pad=False, seed=0):
    """[B, T] random real symbols with pads beyond each row's length (on the left with left_pad)."""
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(dictionary.nspecial, len(dictionary), (len(lengths), T), generator=g)
    for b, n in enumerate(lengths):
        if left_pad:
            toks[b, :T - n] = dictionary.pad()
        else:
            toks[b, n:] = dictionary.pad()
    return toks


def _lm_sample(task, lengths=(7, 5, 3), T=7, seed=0):
    d = task.dictionary
    src = _tokens(d, lengths, T, seed=seed)
    target = torch.full_like(src, d.pad())
    target[:, :-1] = src[:, 1:]
    return {"id": torch.arange(len(lengths)), "nsentences": len(lengths), "ntokens": int(target.ne(d.pad()).sum()),
            "net_input": {"src_tokens": src, "src_lengths": torch.tensor(lengths)}, "target": target}


# --- 1. flags ----------------------------------------------------------------------------------------------------
def test_lm_flags_use_fairseq_moe_names_and_map_to_config(data):
    args = _parse(data, *LM, "--moe-expert-count", "8", "--moe-freq", "1", "--moe-gate-loss-wt", "0.05",
                  "--moe-second-expert-policy", "all", "--moe-eval-capacity-token-fraction", "0.25",
                  "--moe-gating-use-fp32", "--moe-gate", "gshard", "--moe-dispatch", "capacity",
                  "--moe-topology", "[[0]]", "--moe-no-normalize-top-k", "--activation-fn", "gelu")
    assert (args.moe_expert_count, args.moe_freq, args.moe_gate_loss_wt) == (8, 1, 0.05)
    assert (args.moe_second_expert_policy, args.moe_eval_capacity_token_fraction) == ("all", 0.25)
    assert args.moe_gating_use_fp32 is True and args.moe_no_normalize_top_k is True
    assert (args.moe_gate, args.moe_dispatch, args.moe_topology) == ("gshard", "capacity", "[[0]]")
    cfg = config_from_fairseq(args)
    assert isinstance(cfg, MoEConfig)
    assert (cfg.num_experts, cfg.top_k, cfg.gate, cfg.dispatch, cfg.topology) == (8, 2, "gshard", "capacity", "[[0]]")
    assert cfg.aux_loss_coeff == 0.05 and cfg.second_expert_policy == "all"
    assert cfg.router_dtype == "fp32" and cfg.normalize_top_k is False and cfg.activation == "gelu"
    # fairseq: capacity = fraction * tokens; ours: CF * tokens * k / E  ->  CF = fraction * E / k
    assert cfg.eval_capacity_factor == pytest.approx(0.25 * 8 / 2)
    # defaults where fairseq's moe branch has its own: fp32 gating off, normalisation on, relu from the arch
    cfg = config_from_fairseq(_parse(data, *LM))
    assert cfg.router_dtype == "input" and cfg.normalize_top_k is True and cfg.activation == "relu"
    assert cfg.num_experts == 4 and cfg.eval_capacity_factor == 0.0 and cfg.expert_parallel_size == 1


def test_translation_flags_use_fairseq_moe_names_and_map_to_config(data):
    args = _parse(data, *MT, "--moe-expert-count", "6", "--moe-gate", "switch", "--moe-gate-loss-wt", "0.2",
                  "--moe-eval-capacity-token-fraction", "0.5", "--moe-second-expert-policy", "all",
                  "--moe-gating-use-fp32", "--moe-freq", "1", "--moe-dispatch", "capacity")
    cfg = config_from_fairseq(args)
    assert (cfg.num_experts, cfg.gate, cfg.top_k, cfg.dispatch) == (6, "switch", 1, "capacity")
    assert cfg.aux_loss_coeff == 0.2 and cfg.router_dtype == "fp32" and cfg.second_expert_policy == "all"
    assert cfg.eval_capacity_factor == pytest.approx(0.5 * 6 / 1)
    assert args.moe_freq == 1
    # -1 = the training capacity
    args = _parse(data, *MT, "--moe-capacity-factor", "1.5", "--moe-eval-capacity-token-fraction", "-1")
    assert config_from_fairseq(args).eval_capacity_factor == 1.5
    # the architecture's defaults
    cfg = config_from_fairseq(_parse(data, *MT))
    assert (cfg.num_experts, cfg.gate, cfg.top_k, cfg.router_dtype) == (4, "gshard", 2, "input")


@pytest.mark.parametrize("argv", [LM, MT], ids=["lm", "translation"])
@pytest.mark.parametrize("core_flag", ["--moe-num-experts", "--moe-aux-loss-coeff", "--moe-gate-fp32"])
def test_core_spellings_of_renamed_options_are_not_flags(data, argv, core_flag, capsys):
    value = [] if core_flag == "--moe-gate-fp32" else ["4"]
    with pytest.raises(SystemExit):
        _parse(data, *argv, core_flag, *value)
    assert core_flag in capsys.readouterr().err


# --- 2. every gate -----------------------------------------------------------------------------------------------
GATES = sorted(n for n in registered_gates() if not n.startswith("test_"))


def test_builtin_gates_are_registered():
    assert set(GATE_NAMES) <= set(GATES)


@pytest.mark.parametrize("gate", GATES)
def test_every_registered_gate_selectable_by_flag(data, gate):
    argv = (*LM, "--moe-gate", gate, "--moe-topology", "[[0]]", "--moe-freq", "1")
    args, task, model = _build(data, *argv)
    cfg = config_from_fairseq(args)
    k = 1 if gate == "switch" else 2          # --moe-top-k 0 (default): the gate's own k
    assert cfg.gate == gate and cfg.top_k == k
    ffns = moe_ffns(model)
    assert len(ffns) == 2
    for f in ffns:
        assert type(f.moe.gate) is registered_gates()[gate]
    sample = _lm_sample(task, lengths=(6, 6), T=6)
    out, _ = model(**sample["net_input"])
    assert out.shape == (2, 6, len(task.dictionary)) and torch.isfinite(out).all()
    for f in ffns:
        assert f.routing.expert_ids.shape == (12, k)


# --- 3. bad flags ------------------------------------------------------------------------------------------------
BAD = [
    (LM, ["--moe-gate", "nosuch"], "--moe-gate", None),
    (LM, ["--moe-gate", "switch", "--moe-top-k", "2"], "--moe-top-k", None),
    (MT, ["--moe-gate", "gshard", "--moe-top-k", "1"], "--moe-top-k", None),
    (LM, ["--moe-gate", "naive", "--moe-top-k", "5"], "--moe-expert-count=4", "--moe-num-experts"),
    (LM, ["--moe-second-expert-policy", "sampling"], "--moe-second-expert-policy", None),
    (MT, ["--moe-second-expert-policy", "sampling"], "--moe-second-expert-policy", None),
    (LM, ["--moe-eval-capacity-token-fraction", "-2"], "--moe-eval-capacity-token-fraction", None),
    (LM, ["--activation-fn", "tanh"], "--activation-fn", "--moe-activation"),
    (MT, ["--activation-fn", "tanh"], "--activation-fn", "--moe-activation"),
    (LM, ["--moe-expert-count", "0"], "--moe-expert-count", "--moe-num-experts"),
    (MT, ["--moe-expert-count", "0"], "--moe-expert-count", "--moe-num-experts"),
    (LM, ["--moe-gate-loss-wt", "-1"], "--moe-gate-loss-wt", "--moe-aux-loss-coeff"),
    (LM, ["--moe-dispatch", "bogus"], "--moe-dispatch", None),
    (LM, ["--moe-gate", "hir", "--moe-topology", "[[0,1]]"], "--moe-topology", None),
]


@pytest.mark.parametrize("arch,argv,needle,absent", BAD, ids=[" ".join(b[1]) for b in BAD])
def test_bad_flags_rejected_naming_the_fairseq_flag(data, arch, argv, needle, absent):
    from fairseq import tasks
    args = _parse(data, *arch, *argv)
    with pytest.raises(ConfigError) as err:
        config_from_fairseq(args)
    assert needle in str(err.value), str(err.value)
    if absent:
        assert absent not in str(err.value), str(err.value)
    task = tasks.setup_task(args)
    with pytest.raises(ConfigError):                  # building the model fails the same way
        task.build_model(args)


def test_negative_moe_freq_rejected_at_build(data):
    with pytest.raises(ConfigError, match="--moe-freq"):
        _build(data, *LM, "--moe-freq", "-1")


def test_bad_gate_loss_combine_method_rejected(data):
    from fairseq import tasks
    from megamoe_plugin.fairseq_adapter.criteria import MoECrossEntropyCriterion, MoELabelSmoothedCrossEntropyCriterion
    args = _parse(data, *LM, "--criterion", "moe_cross_entropy", "--moe-gate-loss-combine-method", "bogus")
    task = tasks.setup_task(args)
    with pytest.raises(ValueError, match="--moe-gate-loss-combine-method"):
        task.build_criterion(args)
    with pytest.raises(ValueError, match="--moe-gate-loss-combine-method"):
        MoELabelSmoothedCrossEntropyCriterion(task, False, 0.1, moe_gate_loss_combine_method="max")
    assert MoECrossEntropyCriterion(task, False, "sum").combine == "sum"


# --- 4. layer surgery --------------------------------------------------------------------------------------------
def _moe_layer_indices(layers):
    out = []
    for i, layer in enumerate(layers):
        if isinstance(layer.fc1, FairseqMoEFFN):
            assert isinstance(layer.fc2, nn.Identity)
            t = torch.randn(7) - 0.5
            assert torch.equal(layer.activation_fn(t), t)          # experts apply the activation themselves
            out.append(i)
        else:
            assert type(layer.fc1) is nn.Linear and type(layer.fc2) is nn.Linear
    return out


@pytest.mark.parametrize("freq,layers,expected", [(2, 4, [1, 3]), (3, 4, [2]), (1, 3, [0, 1, 2])])
def test_lm_every_freq_th_decoder_layer_is_moe(data, freq, layers, expected):
    args, _, model = _build(data, *LM, "--moe-freq", str(freq), "--decoder-layers", str(layers))
    assert len(model.decoder.layers) == layers
    assert _moe_layer_indices(model.decoder.layers) == expected
    ffns = moe_ffns(model)
    assert [f.label for f in ffns] == [f"dec{i + 1}" for i in expected]
    assert [f.moe.layer_id for f in ffns] == list(range(len(expected)))
    E = args.moe_expert_count
    for f in ffns:
        assert f.moe.experts.w1.shape == (E, args.decoder_embed_dim, args.decoder_ffn_embed_dim)
        assert f.moe.experts.w2.shape == (E, args.decoder_ffn_embed_dim, args.decoder_embed_dim)
        assert f.moe.experts.activation == args.activation_fn
    assert isinstance(model.moe_config, MoEConfig)
    expert_names = [n for n, p in model.named_parameters() if ".moe.experts." in n]
    assert sorted(model._ddp_params_and_buffers_to_ignore) == sorted(expert_names)


@pytest.mark.parametrize("freq,layers", [(0, 2), (3, 2)])
def test_a_moe_freq_that_gives_no_moe_layer_is_refused(data, freq, layers):
    with pytest.raises(ConfigError, match=f"--moe-freq={freq}"):
        _build(data, *LM, "--moe-freq", str(freq), "--decoder-layers", str(layers))


def test_expert_ffn_hidden_size_flag(data):
    _, _, model = _build(data, *LM, "--moe-freq", "1", "--moe-expert-ffn-hidden-size", "32")
    for f in moe_ffns(model):
        assert f.moe.experts.w1.shape == (4, 64, 32)


def test_translation_encoder_and_decoder_get_moe_layers(data):
    args, _, model = _build(data, *MT, "--encoder-layers", "4", "--decoder-layers", "2")
    assert _moe_layer_indices(model.encoder.layers) == [1, 3]
    assert _moe_layer_indices(model.decoder.layers) == [1]
    ffns = moe_ffns(model)
    assert [f.label for f in ffns] == ["enc2", "enc4", "dec2"]
    assert sorted(f.moe.layer_id for f in ffns) == [0, 1, 2]          # unique ids over encoder and decoder
    for f in ffns:
        assert f.moe.experts.w1.shape[0] == args.moe_expert_count
    _, _, model = _build(data, *MT, "--moe-freq", "1")
    assert _moe_layer_indices(model.encoder.layers) == [0, 1] and _moe_layer_indices(model.decoder.layers) == [0, 1]


# --- 5. the MoE FFN is the core layer; pads are not routed -------------------------------------------------------
def _ffn_and_core(gate="naive", **kw):
    cfg = MoEConfig(num_experts=4, top_k=2, gate=gate, activation="relu", world_size=1, **kw)
    torch.manual_seed(0)
    ffn = FairseqMoEFFN(cfg, 16, 24, None, 0, "dec1")
    core = MoELayer(cfg, 16, 24)
    core.load_state_dict(ffn.moe.state_dict())
    return ffn, core


def test_moe_ffn_equals_core_layer():
    ffn, core = _ffn_and_core()
    x = torch.randn(5, 3, 16)
    y = ffn(x)
    assert y.shape == x.shape
    torch.testing.assert_close(y, core(x), rtol=0, atol=0)
    torch.testing.assert_close(y, ffn.moe(x), rtol=0, atol=0)
    assert int(ffn.routing.counts.sum()) == 15 * 2


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_moe_ffn_routes_only_real_tokens(dispatch):
    ffn, core = _ffn_and_core(dispatch=dispatch, capacity_factor=1.0, min_capacity=1)
    T, B = 6, 3
    x = torch.randn(T, B, 16)
    mask = torch.zeros(B, T, dtype=torch.bool)          # [B, T], True = pad
    mask[0, 4:] = True
    mask[2, :3] = True
    ffn.padding_mask = mask
    y = ffn(x)
    real = ~mask.t()                                     # [T, B]
    n = int(real.sum())
    ref = core(x[real])                                  # x[real]: real tokens in [T, B] order
    torch.testing.assert_close(y[real], ref, rtol=0, atol=0)
    assert torch.count_nonzero(y[~real]) == 0
    assert ffn.routing.expert_ids.shape == (n, 2)
    if dispatch == "dropless":
        assert int(ffn.routing.counts.sum()) == n * 2
    torch.testing.assert_close(ffn.routing.counts, core.last_routing.counts, rtol=0, atol=0)
    assert ffn.padding_mask is None                      # one forward only
    ffn(x)
    assert ffn.routing.expert_ids.shape == (T * B, 2)


# --- 6. fairseq's padding masks reach the MoE FFN ----------------------------------------------------------------
def test_translation_forward_routes_only_non_pad_tokens(data):
    args, task, model = _build(data, *MT, "--moe-gate", "naive")
    model.train()
    enc = model.encoder.layers[1].fc1
    dec = model.decoder.layers[1].fc1
    assert isinstance(enc, FairseqMoEFFN) and isinstance(dec, FairseqMoEFFN)
    seen = {}

    def capture(name):
        def pre(module, inputs):
            seen[name + "_x"] = inputs[0].detach().clone()
            seen[name + "_mask"] = module.padding_mask

        def post(module, inputs, output):
            seen[name + "_y"] = output.detach().clone()
        return pre, post

    for name, m in (("enc", enc), ("dec", dec)):
        pre, post = capture(name)
        m.register_forward_pre_hook(pre)
        m.register_forward_hook(post)

    src = _tokens(task.src_dict, [6, 4, 2], 6, left_pad=True, seed=1)
    prev = _tokens(task.tgt_dict, [5, 3, 4], 5, seed=2)
    model(src_tokens=src, src_lengths=src.ne(task.src_dict.pad()).sum(1), prev_output_tokens=prev)

    k = config_from_fairseq(args).top_k
    for name, m, toks in (("enc", enc, src), ("dec", dec, prev)):
        pad = toks.eq(task.src_dict.pad())
        assert seen[name + "_mask"] is not None and torch.equal(seen[name + "_mask"], pad)
        real = ~pad.t()                                   # [T, B]
        n = int(real.sum())
        r = m.routing
        assert int(r.counts.sum()) == n * k and r.expert_ids.shape == (n, k)
        # the routed tokens are exactly the real ones, in [T, B] order: redo the naive gate on them
        probs = torch.softmax(seen[name + "_x"][real] @ m.moe.gate.weight.t(), dim=-1)
        torch.testing.assert_close(r.expert_ids, torch.topk(probs, k, dim=-1).indices, rtol=0, atol=0)
        assert torch.count_nonzero(seen[name + "_y"][~real]) == 0

    # no pads: fairseq passes no mask, every token is routed
    src = _tokens(task.src_dict, [5, 5], 5, left_pad=True, seed=3)
    prev = _tokens(task.tgt_dict, [4, 4], 4, seed=4)
    model(src_tokens=src, src_lengths=torch.tensor([5, 5]), prev_output_tokens=prev)
    assert seen["enc_mask"] is None and int(enc.routing.counts.sum()) == 10 * k
    assert int(dec.routing.counts.sum()) == 8 * k


# --- 7. criteria ----------------------------------------------------------------------------------------------------
def _expert_counts(log, label):
    keys = sorted((k for k in log if k.startswith(f"_moe_{label}_e") and k[len(f"_moe_{label}_e"):].isdigit()),
                  key=lambda k: int(k.rsplit("_e", 1)[1]))
    return torch.stack([torch.as_tensor(log[k]) for k in keys]).double()


@pytest.mark.parametrize("gate,combine", [("gshard", "average"), ("naive", "sum")])
def test_moe_cross_entropy_adds_combined_aux_loss(data, gate, combine):
    from fairseq.criterions.cross_entropy import CrossEntropyCriterion
    args, task, model = _build(data, *LM, "--moe-freq", "1", "--moe-gate", gate, "--criterion", "moe_cross_entropy",
                               "--moe-gate-loss-combine-method", combine, "--moe-gate-loss-wt", "0.1")
    model.train()
    crit = task.build_criterion(args)
    assert crit.combine == combine
    plain = CrossEntropyCriterion(task, sentence_avg=False)
    sample = _lm_sample(task)
    torch.manual_seed(11)
    loss, sample_size, log = crit(model, sample)
    ffns = moe_ffns(model)
    aux = torch.stack([f.aux_loss.detach() for f in ffns])
    assert len(ffns) == 2 and (aux > 0).all()
    torch.manual_seed(11)                                   # same routing (gshard's random 2nd expert)
    ce, ce_size, ce_log = plain(model, sample)
    ntok = int(sample["target"].ne(task.dictionary.pad()).sum())
    assert sample_size == ce_size == ntok
    combined = aux.mean() if combine == "average" else aux.sum()
    torch.testing.assert_close(loss.detach(), ce.detach() + combined * sample_size, rtol=1e-6, atol=1e-6)
    assert loss.requires_grad
    torch.testing.assert_close(torch.as_tensor(log["loss"]), ce.detach(), rtol=1e-6, atol=1e-6)   # task's own
    torch.testing.assert_close(torch.as_tensor(log["moe_aux_loss"]), combined * sample_size, rtol=1e-6, atol=1e-6)
    real = int(sample["net_input"]["src_tokens"].ne(task.dictionary.pad()).sum())
    for label in ("dec1", "dec2"):
        counts = _expert_counts(log, label)
        assert counts.numel() == 4
        assert int(log[f"_moe_{label}_asg"]) == real * 2
        assert int(counts.sum()) + int(log[f"_moe_{label}_drop"]) == real * 2
        if gate == "naive":
            assert int(counts.sum()) == real * 2 and int(log[f"_moe_{label}_drop"]) == 0
    # the aux loss is part of the graph: its gradient reaches the gate
    w = ffns[0].moe.gate.weight
    g_total = torch.autograd.grad(loss, w, retain_graph=True)[0]
    g_ce = torch.autograd.grad(ce, w)[0]
    assert not torch.allclose(g_total, g_ce)


def test_reduce_metrics_logs_per_layer_statistics(data):
    from fairseq.logging import metrics
    from megamoe_plugin.fairseq_adapter.criteria import MoECrossEntropyCriterion
    args, task, model = _build(data, *LM, "--criterion", "moe_cross_entropy")   # --moe-freq 2: dec2 only
    model.train()
    crit = task.build_criterion(args)
    logs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        _, _, log = crit(model, _lm_sample(task, seed=seed))
        logs.append(log)
    assert not any(k.startswith("_moe_dec1_") for k in logs[0])
    counts = _expert_counts(logs[0], "dec2") + _expert_counts(logs[1], "dec2")
    total = lambda key: sum(float(l[key]) for l in logs)  # noqa: E731
    with metrics.aggregate(new_root=True) as agg:
        MoECrossEntropyCriterion.reduce_metrics(logs)
    v = agg.get_smoothed_values()
    assert v["moe_load_dec2"] == pytest.approx(float(counts.max() / counts.mean()), abs=6e-4)
    assert v["moe_drop_dec2"] == pytest.approx(total("_moe_dec2_drop") / total("_moe_dec2_asg"), abs=6e-4)
    assert v["moe_bal_dec2"] == pytest.approx(1.0)     # one expert-parallel device holds all experts
    assert v["moe_aux"] == pytest.approx(total("moe_aux_loss") / total("sample_size"), abs=6e-5)
    assert v["loss"] == pytest.approx(total("loss") / total("sample_size") / math.log(2), abs=6e-4)

    # logs of two expert-parallel ranks (EP=2: experts 0,1 on device 0, experts 2,3 on device 1), once as two
    # outputs and once summed key by key as fairseq's fast stat sync does
    def rank_log(c):
        log = {"loss": 1.0, "nll_loss": 1.0, "ntokens": 10, "nsentences": 2, "sample_size": 10,
               "_moe_enc1_drop": 1, "_moe_enc1_asg": 40, "_moe_enc1_ep": 2, "_moe_enc1_n": 1}
        log.update({f"_moe_enc1_e{j}": torch.tensor(v) for j, v in enumerate(c)})
        return log
    a, b = [9, 8, 3, 19], [13, 1, 6, 20]
    c = [x + y for x, y in zip(a, b)]
    dev = [c[0] + c[1], c[2] + c[3]]
    bal = max(dev) / (sum(dev) / 2)
    two = [rank_log(a), rank_log(b)]
    summed = [{k: two[0][k] + two[1][k] for k in two[0]}]
    for outputs in (two, summed):
        with metrics.aggregate(new_root=True) as agg:
            MoECrossEntropyCriterion.reduce_metrics(outputs)
        v = agg.get_smoothed_values()
        assert v["moe_bal_enc1"] == pytest.approx(bal, abs=6e-4)
        assert v["moe_load_enc1"] == pytest.approx(max(c) / (sum(c) / 4), abs=6e-4)
        assert v["moe_drop_enc1"] == pytest.approx(2 / 80, abs=6e-4)


def test_label_smoothed_criterion_adds_aux_loss(data):
    from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion
    args, task, model = _build(data, *MT, "--moe-gate", "naive", "--criterion", "moe_label_smoothed_cross_entropy",
                               "--label-smoothing", "0.1")
    model.train()
    crit = task.build_criterion(args)
    plain = LabelSmoothedCrossEntropyCriterion(task, False, 0.1)
    src = _tokens(task.src_dict, [6, 4], 6, left_pad=True, seed=5)
    tgt = _tokens(task.tgt_dict, [5, 3], 5, seed=6)
    prev = torch.full_like(tgt, task.tgt_dict.pad())
    prev[:, 0] = task.tgt_dict.eos()
    prev[:, 1:] = tgt[:, :-1]
    sample = {"id": torch.arange(2), "nsentences": 2, "ntokens": int(tgt.ne(task.tgt_dict.pad()).sum()),
              "net_input": {"src_tokens": src, "src_lengths": torch.tensor([6, 4]), "prev_output_tokens": prev},
              "target": tgt}
    loss, size, log = crit(model, sample)
    aux = torch.stack([f.aux_loss.detach() for f in moe_ffns(model)])
    assert [f.label for f in moe_ffns(model)] == ["enc2", "dec2"] and (aux > 0).all()
    ls, _, _ = plain(model, sample)
    torch.testing.assert_close(loss.detach(), ls.detach() + aux.mean() * size, rtol=1e-6, atol=1e-6)
    real_src = int(src.ne(task.src_dict.pad()).sum())
    assert int(_expert_counts(log, "enc2").sum()) == real_src * 2


# --- 8. checkpoint format ------------------------------------------------------------------------------------------
def test_state_dict_holds_all_experts_and_rejects_wrong_expert_count(data):
    args, _, model = _build(data, *LM, "--moe-freq", "1", "--moe-expert-count", "4", seed=0)
    sd = model.state_dict()
    keys = [k for k in sd if k.endswith(".moe.experts.w1") or k.endswith(".moe.experts.w2")]
    assert len(keys) == 4
    for k in keys:
        assert sd[k].shape[0] == 4
    assert sd["decoder.layers.0.fc1.moe.experts.w1"].shape == (4, args.decoder_embed_dim, args.decoder_ffn_embed_dim)
    # round trip into a differently initialised model
    _, _, fresh = _build(data, *LM, "--moe-freq", "1", "--moe-expert-count", "4", seed=1)
    assert not torch.equal(fresh.state_dict()[keys[0]], sd[keys[0]])
    fresh.load_state_dict(sd)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, sd[k]), k
    # a checkpoint with another expert count
    _, _, eight = _build(data, *LM, "--moe-freq", "1", "--moe-expert-count", "8")
    with pytest.raises(RuntimeError, match=r"has 8 experts, the model 4.*--moe-expert-count"):
        fresh.load_state_dict(eight.state_dict())
    ffn = model.decoder.layers[0].fc1
    bad = {"x.moe.experts.w1": torch.zeros(3, 64, 128)}
    with pytest.raises(RuntimeError, match=r"x\.moe\.experts\.w1 has 3 experts"):
        _read_local_experts(ffn, bad, "x.")
    ok = {"x.moe.experts.w1": torch.zeros(4, 64, 128)}
    _read_local_experts(ffn, ok, "x.")
    assert ok["x.moe.experts.w1"].shape[0] == 4


# --- regressions -----------------------------------------------------------------------------------------------------
def test_missing_no_flag_attribute_keeps_core_default():
    cfg = config_from_fairseq(argparse.Namespace())
    assert cfg.normalize_top_k is True


def test_layerdrop_skipped_layers_do_not_contribute(data):
    args, task, model = _build(data, *LM, "--moe-freq", "1", "--decoder-layers", "4", "--decoder-layerdrop", "0.5",
                               "--moe-gate", "naive", "--criterion", "moe_cross_entropy")
    model.train()
    crit = task.build_criterion(args)
    ran = []
    for f in moe_ffns(model):
        f.register_forward_hook(lambda m, i, o: ran.append(m.label))
    sample = _lm_sample(task)
    for step in range(6):
        ran.clear()
        torch.manual_seed(step)
        loss, _, log = crit(model, sample)
        labels = {k[len("_moe_"):].rsplit("_", 1)[0] for k in log if k.startswith("_moe_")}
        assert labels == set(ran), (step, labels, ran)
        loss.backward()


# --- 9. two processes: expert gradients, global norm, expert checkpoints -------------------------------------------
def _dist_checks(rank, world, data):
    import torch.distributed as dist
    from fairseq.logging import metrics
    from megamoe_plugin.fairseq_adapter.criteria import MoECrossEntropyCriterion
    from fairseq.optim.sgd import SGD
    from megamoe_plugin.fairseq_adapter import distributed as md
    from megamoe_plugin.fairseq_adapter.layers import gather_experts, release_gathered

    def all_gather(t):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        return parts

    def sgd(params):
        return SGD(argparse.Namespace(lr=[0.1], momentum=0.0, weight_decay=0.0), params)

    # (a) EP = 2 over 2 ranks: experts sharded, no replicas
    ep, edp = md.expert_groups(2)
    assert dist.get_process_group_ranks(ep) == [0, 1] and edp is None
    md.activate(ep, edp, world)
    cfg = MoEConfig(num_experts=4, top_k=2, gate="naive", activation="relu", expert_parallel_size=2, world_size=2)
    torch.manual_seed(rank)
    ffn = FairseqMoEFFN(cfg, 8, 16, ep, 0, "dec1")
    experts = list(ffn.moe.experts.parameters())
    shared = ffn.moe.gate.weight
    assert experts and all(getattr(p, "expert", False) and p.shape[0] == 2 for p in experts)
    assert not hasattr(shared, "expert")
    shared.grad = torch.randn(shared.shape, generator=torch.Generator().manual_seed(7))   # as after DP all-reduce
    g = torch.Generator().manual_seed(100 + rank)
    for p in experts:
        p.grad = torch.randn(p.shape, generator=g)
    before = [p.grad.clone() for p in experts]
    shared_before = shared.grad.clone()
    opt = sgd(list(ffn.parameters()))
    opt.all_reduce_grads(ffn)                       # fairseq's call, wrapped by the plugin
    for p, b in zip(experts, before):
        torch.testing.assert_close(p.grad, b / world, rtol=0, atol=0)
    assert torch.equal(shared.grad, shared_before)

    # (b) the global norm: shared grads once, every rank's experts once
    shared_sq = shared.grad.double().square().sum()
    expert_sq = sum(p.grad.double().square().sum() for p in experts).reshape(1)
    expected = float(torch.sqrt(shared_sq + torch.cat(all_gather(expert_sq)).sum()))
    local_only = float(torch.sqrt(shared_sq + expert_sq.sum()))
    assert abs(expected - local_only) > 1e-3
    max_norm = 0.5 * expected
    grads = [p.grad.clone() for p in (shared, *experts)]
    total = opt.clip_grad_norm(max_norm)            # fairseq's optimizer -> utils.clip_grad_norm_ (wrapped)
    assert float(total) == pytest.approx(expected, rel=1e-5)
    totals = all_gather(total.reshape(1).float())
    assert torch.equal(totals[0], totals[1])
    coef = max_norm / (float(total) + 1e-6)
    for p, g0 in zip((shared, *experts), grads):
        torch.testing.assert_close(p.grad, g0 * coef, rtol=1e-5, atol=1e-7)

    # (a') EP = 1 over 2 ranks: replicated experts, summed over the EDP group (= both ranks), divided by DP size
    ep1, edp1 = md.expert_groups(1)
    assert ep1 is None and dist.get_process_group_ranks(edp1) == [0, 1]
    md.activate(ep1, edp1, world)
    mod = nn.Module()
    mod.w = nn.Parameter(torch.zeros(3, 4))
    mod.w.expert = True
    mod.s = nn.Parameter(torch.zeros(5))
    mod.w.grad = torch.randn(3, 4, generator=torch.Generator().manual_seed(200 + rank))
    mod.s.grad = torch.randn(5, generator=torch.Generator().manual_seed(9))
    parts = all_gather(mod.w.grad)
    s_before = mod.s.grad.clone()
    opt1 = sgd(list(mod.parameters()))
    opt1.all_reduce_grads(mod)
    torch.testing.assert_close(mod.w.grad, (parts[0] + parts[1]) / world, rtol=1e-6, atol=1e-7)
    assert torch.equal(mod.s.grad, s_before)
    expected1 = float(torch.sqrt(mod.s.grad.double().square().sum() + mod.w.grad.double().square().sum()))
    total1 = opt1.clip_grad_norm(0.0)               # 0: no clipping, just the norm (no sum over replicas)
    assert float(total1) == pytest.approx(expected1, rel=1e-5)

    # (c) checkpoints: rank 0 writes all experts, every rank loads its rows, any EP size loads it
    md.activate(ep, edp, world)
    torch.manual_seed(10 + rank)
    src = FairseqMoEFFN(cfg, 8, 16, ep, 0, "dec1")
    local = {n: p.detach().clone() for n, p in src.moe.experts.named_parameters()}
    full = {n: torch.cat(all_gather(t)) for n, t in local.items()}
    assert not torch.equal(full["w1"][:2], full["w1"][2:])
    with pytest.raises(RuntimeError, match="gather_experts"):
        src.state_dict()
    gather_experts(src)
    if rank == 0:
        sd = src.state_dict()
        for n, t in full.items():
            assert sd["moe.experts." + n].shape[0] == 4
            assert torch.equal(sd["moe.experts." + n], t)
    else:
        with pytest.raises(RuntimeError, match="gather_experts"):
            src.state_dict()
        sd = None
    release_gathered(src)
    if rank == 0:
        with pytest.raises(RuntimeError, match="gather_experts"):
            src.state_dict()
    box = [sd]
    dist.broadcast_object_list(box, src=0)
    sd = box[0]
    torch.manual_seed(50 + rank)
    dst = FairseqMoEFFN(cfg, 8, 16, ep, 0, "dec1")
    dst.load_state_dict(sd)
    rows = slice(2 * rank, 2 * rank + 2)
    for n, p in dst.moe.experts.named_parameters():
        assert torch.equal(p.detach(), full[n][rows]), n
    assert torch.equal(dst.moe.gate.weight.detach(), sd["moe.gate.weight"])
    assert sd["moe.experts.w1"].shape[0] == 4        # loading did not slice the caller's dict
    one = FairseqMoEFFN(cfg.replace(expert_parallel_size=1), 8, 16, None, 0, "dec1")
    one.load_state_dict(sd)
    for n, p in one.moe.experts.named_parameters():
        assert torch.equal(p.detach(), full[n]), n
    x = torch.randn(5, 3, 8, generator=torch.Generator().manual_seed(300 + rank))
    with torch.no_grad():
        torch.testing.assert_close(dst(x), one(x), rtol=1e-5, atol=1e-6)   # EP=2 layer = the full layer

    # (d) a model built by fairseq in the 2-rank job: experts sharded over the data-parallel ranks (EP 0 = all);
    # the criterion's logs, summed over ranks as fairseq does, give the balance over the 2 devices
    args, task, model = _build(data, *LM, "--criterion", "moe_cross_entropy", "--moe-gate", "naive")
    assert model.moe_config.expert_parallel_size == 2 and model.moe_config.world_size == 2
    (ffn,) = moe_ffns(model)
    assert ffn.moe.experts.w1.shape[0] == 2 and ffn.ep.size == 2
    model.train()
    _, _, log = task.build_criterion(args)(model, _lm_sample(task, lengths=(7, 6 - 2 * rank), seed=rank))
    assert int(log["_moe_dec2_ep"]) == 2
    logs = [None] * world
    dist.all_gather_object(logs, log)
    summed = {k: sum(torch.as_tensor(l[k]).double() for l in logs) for k in logs[0]}
    counts = _expert_counts(summed, "dec2")
    device_load = torch.stack([counts[:2].sum(), counts[2:].sum()])
    assert device_load[0] != device_load[1]                 # a balance ratio other than 1 to check
    with metrics.aggregate(new_root=True) as agg:
        MoECrossEntropyCriterion.reduce_metrics([summed])
    v = agg.get_smoothed_values()
    assert v["moe_bal_dec2"] == pytest.approx(float(device_load.max() / device_load.mean()), abs=6e-4)
    assert v["moe_load_dec2"] == pytest.approx(float(counts.max() / counts.mean()), abs=6e-4)


def test_two_process_expert_grads_norm_and_checkpoints(data):
    run_distributed(_dist_checks, 2, data)


def test_trainer_settings_that_cannot_shard_experts_are_rejected():
    """check_trainer_settings runs at trainer construction: each refusal names the fairseq flag."""
    from types import SimpleNamespace as NS
    from megamoe_plugin.fairseq_adapter.args import check_trainer_settings

    def cfg(ddp="legacy_ddp", fp16=False, bf16=False, mem=False, no_flatten=False, ckpt_act=False, mp=1):
        return NS(distributed_training=NS(ddp_backend=ddp, zero_sharding="none"),
                  common=NS(fp16=fp16, bf16=bf16, memory_efficient_fp16=mem, memory_efficient_bf16=False,
                            fp16_no_flatten_grads=no_flatten, model_parallel_size=mp),
                  model=NS(checkpoint_activations=ckpt_act), ema=NS(store_ema=False))
    sharded = MoEConfig(num_experts=4, expert_parallel_size=2, world_size=2)
    check_trainer_settings(cfg(), sharded)                                  # the supported setting passes
    check_trainer_settings(cfg(fp16=True, mem=True), sharded)
    check_trainer_settings(cfg(fp16=True, no_flatten=True), sharded)
    check_trainer_settings(cfg(fp16=True), MoEConfig(num_experts=4))        # EP=1: nothing is sharded
    for bad, needle in [(cfg(fp16=True), "--fp16"), (cfg(bf16=True), "--bf16"),
                        (cfg(ddp="fully_sharded"), "--ddp-backend"), (cfg(ckpt_act=True), "--checkpoint-activations"),
                        (cfg(mp=2), "--model-parallel-size")]:
        with pytest.raises(ConfigError, match=needle):
            check_trainer_settings(bad, sharded)


def test_launcher_adds_torchrun_ranks_and_gloo_on_cpu():
    from megamoe_plugin.fairseq_adapter.launch import backend_flags, distributed_flags
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    flags = distributed_flags(env)
    assert flags[flags.index("--distributed-rank") + 1] == "1" and flags[flags.index("--device-id") + 1] == "1"
    assert distributed_flags({}) == []                                   # not under torchrun: nothing added
    assert backend_flags(["data", "--cpu"], cuda_available=True) == ["--distributed-backend", "gloo"]
    assert backend_flags(["data"], cuda_available=False) == ["--distributed-backend", "gloo"]
    assert backend_flags(["data"], cuda_available=True) == []             # GPUs: fairseq's default (NCCL)
    assert backend_flags(["data", "--cpu", "--distributed-backend", "gloo"], cuda_available=False) == []
