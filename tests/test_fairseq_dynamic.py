"""DynaMoE (paper 000) in fairseq: dynamic capacity by RECOMPILE and sample-assignment caching through the plugin's
trainer hooks (megamoe_plugin/fairseq_adapter/dynamic.py, trainer_hooks.py).

In process (cheap):
- fairseq's decoder hands the MoE FFN its tokens as [T, B, C] (position-major), so the cache's "sb" keys of
  ``sample["id"]`` x positions + position land on the right tokens: every real token's cached expert is the
  gate's choice for that token's own hidden state, padding is never cached, a second epoch finds all of them
  stable; a dummy batch and an eval forward leave the cache alone; a cached forward gives the gate's forward's
  outputs. Encoder-decoder models are refused; --add-bos-token adds a position.

The real fairseq-train (subprocesses, as in test_fairseq_train.py):
- 2 gloo processes on a small slice of the embedded corpus, --moe-dispatch capacity --moe-capacity-policy dynamic
  with the assignment cache and an odd number of batches per epoch (one rank runs fairseq's dummy batch every
  epoch): capacities are recompiled (moe_dyn_recompilations > 0), the average capacity factor is logged, the loss
  is finite, and the checkpoint holds the same capacities, policy state and pending decisions for both ranks, each
  with its own cache (between them every sample once per epoch: the dummy batch keyed nothing).
- 2 processes on the LM corpus resume from a checkpoint saved with dynamic capacity: the restored capacities are
  the saved ones, and the losses, gradient norms, recompilation counts and largest capacity of the uninterrupted
  run come back exactly (capacities in force and RECOMPILE's decisions in flight restored).
- 1 process, 6 epochs at a tiny learning rate: the assignments converge, the per-epoch stable fraction is logged,
  caching switches on after --moe-assignment-cache-min-epoch and then every layer call uses the cache; resumed
  after epoch 4, caching is on from the first update, epoch 5 is compared with the restored tables, and the
  validation loss is the uninterrupted run's.
- bad settings stop fairseq-train before training, naming the flag.
"""
import math
import re
from types import SimpleNamespace as NS

import pytest

pytest.importorskip("fairseq")

import torch  # noqa: E402

from megamoe_plugin.config import ConfigError  # noqa: E402
from megamoe_plugin.fairseq_adapter import register  # noqa: E402,F401  (registers models/criteria, installs hooks)
from test_fairseq_placement import VALID, updates  # noqa: E402
from test_fairseq_train import fairseq_cli, lm_args, lm_data, user_dir  # noqa: E402,F401  (lm_data: fixture)

DIST = ["--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp"]
SUMMARY = re.compile(r"\| INFO \| train \| epoch (\d+) \| (.*)")
EPOCH_LINE = re.compile(r"DynaMoE epoch (\d+): (?:cache_stable_fraction ([0-9.]+)|no sample seen)[^;]*; "
                        r"assignment caching (on|off)")
RESTORED = re.compile(r"DynaMoE state restored: capacities (\{.*?\}|from the capacity factor), (\d+) pending "
                      r"decision\(s\)(?:, assignment caching (on|off))?")


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    """A slice of the embedded corpus small enough for many epochs (about 23 samples of up to 64 tokens; the
    corpus is read from this machine's stdlib, so the count is measured): (data dir, samples)."""
    from fairseq import options, tasks
    from megamoe_plugin.data.corpus import write_text_splits
    d = tmp_path_factory.mktemp("fairseq_tiny_lm")
    write_text_splits(d / "raw", formats=("txt",), max_bytes=12_000)
    fairseq_cli("preprocess", ["--only-source", "--trainpref", str(d / "raw/train.txt"), "--validpref",
                               str(d / "raw/valid.txt"), "--destdir", str(d / "bin"), "--nwordssrc", "500",
                               "--workers", "1"])
    args = options.parse_args_and_arch(options.get_training_parser(), input_args=[
        str(d / "bin"), "--task", "language_modeling", "--arch", "transformer_lm", "--tokens-per-sample", "64"])
    task = tasks.setup_task(args)
    task.load_dataset("train")
    n = len(task.dataset("train"))
    assert 12 <= n <= 40, n
    return str(d / "bin"), n


def summaries(out):
    """{epoch: {metric: value}} from the end-of-epoch train lines."""
    rows = {}
    for m in SUMMARY.finditer(out):
        kv = dict(item.rsplit(" ", 1) for item in m.group(2).split(" | "))
        rows[int(m.group(1))] = {k: float(v) for k, v in kv.items() if v != "None"}
    return rows


# --- in process ---------------------------------------------------------------------------------------------------
def _build(data, *flags, task="language_modeling", arch="moe_transformer_lm_tiny"):
    from fairseq import options, tasks
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, input_args=[data, "--user-dir", user_dir(), "--task", task,
                                                           "--arch", arch, *flags])
    t = tasks.setup_task(args)
    return args, t, t.build_model(args)


def _dynamic(args, model):
    from megamoe_plugin.fairseq_adapter.dynamic import FairseqDynamic
    return FairseqDynamic.create(NS(cfg=NS(task=args, model=args), model=model), model.moe_config)


def test_cache_keys_follow_fairseq_token_layout(tmp_path):
    from megamoe_plugin.fairseq_adapter.layers import moe_ffns
    (tmp_path / "dict.txt").write_text("".join(f"w{i} 10\n" for i in range(40)))
    torch.manual_seed(0)
    args, task, model = _build(str(tmp_path), "--tokens-per-sample", "12", "--moe-gate", "switch",
                               "--moe-assignment-cache")
    (ffn,) = moe_ffns(model)
    dyn = _dynamic(args, model)
    cache, lid = dyn.cache, ffn.moe.layer_id
    assert cache.positions == 12 and dyn.rt.layers == {lid: ffn.moe}
    seen = []
    ffn.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
    B, T, pad = 3, 10, task.dictionary.pad()
    tokens = torch.randint(4, 40, (B, T))
    tokens[2, 6:] = pad                                          # right padding (fairseq's LM collater)
    lengths = torch.tensor([T, T, 6])
    ids = torch.tensor([5, 0, 9])
    sample = {"id": ids, "net_input": {"src_tokens": tokens, "src_lengths": lengths}}
    model.train()

    dyn.begin_epoch(1)
    dyn.before_forward(sample)
    y_plain = model(tokens)[0].detach()
    x = seen[-1]
    assert x.shape == (T, B, 64)                                # [T, B, C]: position-major, layout "sb"
    assert cache.take_counts()[lid].tolist() == [0, 0]          # first epoch: nothing to compare with
    table = cache.tables[lid]
    for b in range(B):
        for t in range(T):
            row = table[int(ids[b]) * 12 + t]
            if t < lengths[b]:               # the gate's own choice for this very token's hidden state
                own = ffn.moe.gate(x[t, b][None]).expert_ids[0]
                assert row.tolist() == own.tolist(), (b, t)
            else:
                assert row.tolist() == [-1], (b, t)             # padding is never routed nor cached
    written = (table >= 0).any(1).nonzero().squeeze(1).tolist()
    assert sorted(written) == sorted(int(i) * 12 + t for i, n in zip(ids, lengths) for t in range(int(n)))
    # dim 1 is the batch: sample b alone gives x[:, b] (causal attention, right padding)
    dyn.clear_batch()
    for b in (0, 2):
        model(tokens[b:b + 1, :int(lengths[b])])
        torch.testing.assert_close(seen[-1][:, 0], x[:int(lengths[b]), b], rtol=1e-5, atol=1e-6)
    assert cache.take_counts() == {}                           # forwards without a batch set: nothing recorded

    # epoch 2, same weights: every real token compared with its epoch-1 assignment, all stable
    dyn.begin_epoch(2)
    dyn.before_forward(sample)
    model(tokens)
    stable, compared = cache.take_counts()[lid].tolist()
    assert stable == compared == float(lengths.sum())

    # a dummy batch (ignore_grad) and an eval forward leave the cache alone
    before = table.clone()
    dyn.before_forward(sample, ignore_grad=True)
    model(tokens)
    dyn.begin_epoch(3)
    dyn.before_forward(sample)
    model.eval()
    model(tokens)
    model.train()
    assert cache.take_counts() == {} and torch.equal(cache.tables[lid], before)

    # caching on: the layer routes by the cached ids (the gate's own choice): the same outputs
    cache.active = True
    dyn.before_forward(sample)
    y_cached = model(tokens)[0].detach()
    assert cache.cached_calls == 1
    torch.testing.assert_close(y_cached, y_plain, rtol=1e-5, atol=1e-5)
    dyn.close()

    # --add-bos-token makes samples one token longer
    from megamoe_plugin.fairseq_adapter.dynamic import sequence_positions
    assert sequence_positions(NS(task=NS(tokens_per_sample=12, add_bos_token=True)), model)[0] == 13


def test_cache_refused_for_encoder_decoder_models(tmp_path):
    for side in ("src", "tgt"):
        (tmp_path / f"dict.{side}.txt").write_text("".join(f"{c} 10\n" for c in "abcdefgh"))
    args, _, model = _build(str(tmp_path), "-s", "src", "-t", "tgt", "--moe-assignment-cache", task="translation",
                            arch="moe_transformer_tiny")
    with pytest.raises(ConfigError, match="--moe-assignment-cache needs a decoder-only model"):
        _dynamic(args, model)
    # dynamic capacity alone works for any model
    args, _, model = _build(str(tmp_path), "-s", "src", "-t", "tgt", "--moe-dispatch", "capacity",
                            "--moe-capacity-policy", "dynamic", task="translation", arch="moe_transformer_tiny")
    dyn = _dynamic(args, model)
    assert sorted(dyn.rt.layers) == [0, 1] and dyn.cache is None
    dyn.close()


# --- fairseq-train ------------------------------------------------------------------------------------------------
def _epoch_checkpoints(args):
    """lm_args with fairseq's per-epoch checkpoints (checkpoint<N>.pt) kept."""
    return [a for a in args if a != "--no-epoch-checkpoints"]


def test_two_ranks_dynamic_capacity_with_dummy_batches(tiny_lm, tmp_path):
    data, n = tiny_lm
    # 3 batches per epoch: rank 0 runs two, rank 1 one and fairseq's dummy batch (a copy of the first batch, no
    # gradient); every rank does 2 updates per epoch, 4 epochs
    common = [*DIST, "--moe-gate", "gshard", "--moe-dispatch", "capacity", "--moe-capacity-policy", "dynamic",
              "--moe-assignment-cache", "--batch-size", str(math.ceil(n / 3)),
              "--required-batch-size-multiple", "1"]
    _, out = fairseq_cli("train", lm_args(data, tmp_path / "ck", 8, *common), nproc=2)
    rows = updates(out)
    assert sorted(rows) == list(range(1, 9)), out[-3000:]
    assert re.search(r"epoch 004:\s+2 / 2 ", out), out[-3000:]              # 2 updates per epoch on each rank
    assert all(math.isfinite(r["loss"]) for r in rows.values())
    assert max(r["moe_dyn_recompilations"] for r in rows.values()) > 0, out[-3000:]
    factors = [r["moe_dyn_avg_capacity_factor"] for r in rows.values() if "moe_dyn_avg_capacity_factor" in r]
    assert factors and all(0 < f < 10 for f in factors), factors
    assert "moe_dyn_dropped_fraction" in rows[8] and "moe_dyn_cached_calls" in rows[8]

    # the last checkpoint holds both ranks' states: the same capacities, policy state and pending decisions
    ck = torch.load(tmp_path / "ck" / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    saved = ck["extra_state"]["megamoe_dynamic"]
    assert saved["world_size"] == 2 and sorted(saved["states"]) == [0, 1]
    s0, s1 = saved["states"][0], saved["states"][1]
    assert s0["capacity"] == s1["capacity"] and s0["capacity"][0] is not None and len(s0["capacity"][0]) == 4
    assert s0["pending"] == s1["pending"] and s0["recompilations"] == s1["recompilations"] > 0
    torch.testing.assert_close(s0["capacity_policy"]["average"][0], s1["capacity_policy"]["average"][0], rtol=0, atol=0)
    # each rank its own cache: in epoch 4 the ranks saw every sample once between them, and rank 1's dummy batch
    # (fairseq's copy of the first batch) keyed nothing
    seen = [set((s["cache"]["last_epoch"] == 4).nonzero().squeeze(1).tolist()) for s in (s0, s1)]
    assert not (seen[0] & seen[1]) and sorted(seen[0] | seen[1]) == list(range(n)), seen


def test_two_ranks_resume_restores_capacities_exactly(lm_data, tmp_path):  # noqa: F811
    """Resume inside epoch 1 (fairseq re-draws later epochs' batch orders in a new process, so only a resume in the
    first epoch can be compared update by update)."""
    common = [*DIST, "--moe-gate", "gshard", "--moe-dispatch", "capacity", "--moe-capacity-policy", "dynamic",
              "--moe-assignment-cache"]
    _, out = fairseq_cli("train", lm_args(lm_data, tmp_path / "full", 6, *common, "--save-interval-updates", "3"),
                         nproc=2)
    full = updates(out)
    assert sorted(full) == list(range(1, 7)), out[-3000:]
    ck = torch.load(tmp_path / "full" / "checkpoint_1_3.pt", map_location="cpu", weights_only=True)
    s0, s1 = (ck["extra_state"]["megamoe_dynamic"]["states"][r] for r in (0, 1))
    assert s0["capacity"] == s1["capacity"] and s0["capacity"][0] is not None
    assert s0["pending"] == s1["pending"] and any(d for v in s0["pending"].values() for _, d in v)   # in flight

    # 2 processes resume from it: the restored capacities are the saved ones, the rest of the run is the same
    _, out = fairseq_cli("train", lm_args(lm_data, tmp_path / "resumed", 6, *common, "--no-save", "--restore-file",
                                          str(tmp_path / "full" / "checkpoint_1_3.pt")), nproc=2)
    m = RESTORED.search(out)
    assert m and m.group(1) == str({0: s0["capacity"][0]}), out[-3000:]
    assert int(m.group(2)) == sum(bool(d) for v in s0["pending"].values() for _, d in v) and m.group(3) == "off"
    resumed = updates(out)
    assert sorted(resumed) == [4, 5, 6], out[-3000:]
    assert max(full[u]["moe_dyn_recompilations"] for u in (4, 5, 6)) > s0["recompilations"]  # capacities moved on
    for u in (4, 5, 6):
        for key in ("loss", "gnorm", "moe_dyn_recompilations", "moe_dyn_capacity_max"):
            assert resumed[u][key] == full[u][key], (u, key, resumed[u], full[u])


def test_assignment_cache_switches_on_when_assignments_converge(tiny_lm, tmp_path):
    data, n = tiny_lm
    per_epoch = math.ceil(n / 8)                   # batches of 8 (the last one smaller, with a short sample)
    last = 6 * per_epoch
    # 6 epochs; the learning rate is so small the routing hardly moves
    flags = ["--moe-gate", "switch", "--moe-assignment-cache", "--moe-assignment-cache-min-epoch", "2",
             "--max-epoch", "6", "--lr", "1e-5", "--required-batch-size-multiple", "1"]
    _, out = fairseq_cli("train", _epoch_checkpoints(lm_args(data, tmp_path / "full", 1000, *flags)))
    full = updates(out)
    assert sorted(full) == list(range(1, last + 1)), out[-3000:]
    assert all(math.isfinite(r["loss"]) for r in full.values())

    # one line per closed epoch: epoch 1 has nothing to compare; epochs 2.. keep >= 96% of their assignments
    lines = {int(e): (f, on) for e, f, on in EPOCH_LINE.findall(out)}
    assert sorted(lines) == [1, 2, 3, 4, 5], out[-3000:]
    assert lines[1] == ("", "off")
    assert all(float(lines[e][0]) >= 0.96 for e in range(2, 6)), lines
    assert lines[2][1] == "on"                     # closing epoch 2 (>= --moe-assignment-cache-min-epoch): on
    ep = summaries(out)
    assert sorted(ep) == [1, 2, 3, 4, 5, 6]
    for e in range(3, 7):                          # every epoch summary from epoch 3 on: the last closed epoch's
        assert ep[e]["moe_dyn_cache_stable_fraction"] >= 0.96 and ep[e]["moe_dyn_cache_on"] == 1, ep[e]
    assert "moe_dyn_cache_stable_fraction" not in ep[1] and ep[2]["moe_dyn_cache_on"] == 0

    # epoch 3's first step closes epoch 2 on the trigger thread; the decision lands Δ_launch = 1 step later
    first_on = min(u for u, r in full.items() if r["moe_dyn_cache_on"] == 1)
    assert first_on == 2 * per_epoch + 2, (first_on, per_epoch)
    assert all(full[u]["moe_dyn_cached_calls"] == 0 for u in range(1, first_on + 1))
    assert full[last]["moe_dyn_cached_calls"] == last - first_on, full[last]    # then every call used the cache
    valid = [float(v) for v in VALID.findall(out)]

    # resume after epoch 4: caching is on from the first update, every call uses the restored tables (the counter
    # goes on), epoch 5 is compared with the assignments cached in epoch 4 (fairseq draws other batch orders for a
    # new process's epochs, so the per-update losses differ slightly; the validation loss does not)
    _, out = fairseq_cli("train", lm_args(data, tmp_path / "resumed", 1000, *flags, "--no-save", "--restore-file",
                                          str(tmp_path / "full" / "checkpoint4.pt")))
    m = RESTORED.search(out)
    assert m and m.group(3) == "on", out[-3000:]
    resumed = updates(out)
    saved_calls = full[4 * per_epoch]["moe_dyn_cached_calls"]
    assert sorted(resumed) == list(range(4 * per_epoch + 1, last + 1)), out[-3000:]
    for i, u in enumerate(sorted(resumed)):
        assert resumed[u]["moe_dyn_cache_on"] == 1 and resumed[u]["moe_dyn_cached_calls"] == saved_calls + i + 1
    # epoch 4 was still open in the checkpoint (the policy closes it at epoch 5's first step): its counts came back
    again = {int(e): (f, on) for e, f, on in EPOCH_LINE.findall(out)}
    assert sorted(again) == [4, 5] and again[4] == lines[4], (again, lines)
    assert float(again[5][0]) >= 0.96 and again[5][1] == "on", again
    valid_resumed = [float(v) for v in VALID.findall(out)]
    assert valid_resumed[-1] == pytest.approx(valid[-1], abs=2e-3), (valid_resumed, valid)


@pytest.mark.parametrize("flags, needle", [
    (["--moe-capacity-policy", "dynamic"], "--moe-capacity-policy"),          # dropless dispatch has no capacity
    (["--moe-assignment-cache", "--moe-assignment-cache-on", "0.5", "--moe-assignment-cache-off", "0.8"],
     "--moe-assignment-cache-off"),
])
def test_bad_dynamic_settings_stop_before_training(tiny_lm, tmp_path, flags, needle):
    code, out = fairseq_cli("train", lm_args(tiny_lm[0], tmp_path / "ck", 2, *flags), check=False)
    assert code != 0
    assert needle in out and "ConfigError" in out, out[-3000:]
    assert "begin training epoch" not in out
