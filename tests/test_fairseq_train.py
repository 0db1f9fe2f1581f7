"""fairseq's own command-line tools with the plugin's --user-dir, for real: fairseq-preprocess, fairseq-train
(1 process, and 2 gloo processes started as torchrun starts them, with experts sharded over them), fairseq-eval-lm and
fairseq-generate on the checkpoints.

- LM, 1 process: loss falls, the aux loss and per-layer expert metrics are logged.
- LM, 2 processes, EP=2: every update runs the after-step hook on both ranks (the recording policy in
  tests/helpers writes what it saw): expert weights differ across ranks, shared weights are identical. A restart
  from the checkpoint of update 3 gives exactly the losses of the uninterrupted run at updates 4 and 5 (expert
  weights and their Adam state came back), and fairseq-eval-lm (1 process) evaluates that EP=2 checkpoint.
- Translation: the encoder-decoder MoE model trains on a synthetic parallel corpus; fairseq-generate decodes.
- Bad flags stop fairseq-train before training, naming the flag.
"""
import json
import math
import os
import re
import subprocess
import sys

import pytest
from conftest import ranks_command

pytest.importorskip("fairseq")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELPERS = os.path.join(REPO, "tests", "helpers")
INNER = re.compile(r"train_inner \| epoch \d+:\s+\d+ / \d+ (.*)")


def user_dir():
    from megamoe_plugin.fairseq_adapter import user_dir as ud
    return ud()


def env(**extra):
    e = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
             PYTHONPATH=os.pathsep.join([HELPERS, REPO, os.environ.get("PYTHONPATH", "")]))
    e.update(extra)
    return e


def fairseq_cli(tool, args, nproc=1, check=True, timeout=300, **extra_env):
    """Run a fairseq console tool as `python -m fairseq_cli.<tool>` (1 process) or fairseq-train on ``nproc`` ranks
    (``ranks_command``) through the plugin's launcher."""
    if nproc == 1:
        cmd = [sys.executable, "-m", f"fairseq_cli.{tool}", *args]
    else:
        assert tool == "train"
        cmd = ranks_command(nproc) + ["-m", "megamoe_plugin.fairseq_adapter.launch", *args]
    p = subprocess.run(cmd, env=env(**extra_env), capture_output=True, text=True, timeout=timeout, cwd=REPO)
    out = p.stdout + p.stderr
    if check:
        assert p.returncode == 0, out[-5000:]
    return p.returncode, out


def updates(out):
    """{update number: {metric: value}} from fairseq's simple-format train_inner lines."""
    rows = {}
    for m in INNER.finditer(out):
        kv = dict(item.split("=", 1) for item in m.group(1).split(", "))
        rows[int(kv["num_updates"])] = {k: float(v) for k, v in kv.items()}
    return rows


@pytest.fixture(scope="module")
def lm_data(tmp_path_factory):
    from megamoe_plugin.data.corpus import write_text_splits
    d = tmp_path_factory.mktemp("fairseq_lm")
    write_text_splits(d / "raw", formats=("txt",), max_bytes=300_000)
    fairseq_cli("preprocess", ["--only-source", "--trainpref", str(d / "raw/train.txt"), "--validpref",
                               str(d / "raw/valid.txt"), "--destdir", str(d / "bin"), "--nwordssrc", "2000",
                               "--workers", "1"])
    return str(d / "bin")


def lm_args(data, save_dir, max_update, *extra):
    return [data, "--user-dir", user_dir(), "--task", "language_modeling", "--arch", "moe_transformer_lm_tiny",
            "--criterion", "moe_cross_entropy", "--cpu", "--optimizer", "adam", "--lr", "0.003",
            "--tokens-per-sample", "64", "--batch-size", "8", "--log-interval", "1", "--log-format", "simple",
            "--save-dir", str(save_dir), "--no-epoch-checkpoints", "--seed", "1", "--max-update", str(max_update),
            "--clip-norm", "1.0", *extra]


def test_lm_single_process_trains_and_logs_moe_metrics(lm_data, tmp_path):
    trace = tmp_path / "trace" / "routing"
    _, out = fairseq_cli("train", lm_args(lm_data, tmp_path / "ck", 8, "--moe-gate", "switch", "--moe-trace-path",
                                          str(trace)))
    rows = updates(out)
    assert sorted(rows) == list(range(1, 9)), out[-3000:]
    assert rows[8]["loss"] < rows[1]["loss"] - 1.0, {u: r["loss"] for u, r in rows.items()}
    for r in rows.values():
        assert r["moe_aux"] > 0 and math.isfinite(r["moe_aux"])
        assert r["moe_bal_dec2"] == 1.0            # one device: the balance ratio is 1 by definition
        assert r["moe_drop_dec2"] == 0.0           # switch gate, dropless dispatch: nothing dropped
        assert r["moe_load_dec2"] >= 1.0
    assert (tmp_path / "ck" / "checkpoint_last.pt").exists()
    from megamoe_plugin.stats import load_trace
    t = load_trace(str(trace))               # training steps only, every token routed to its 1 expert once
    assert t["steps"].tolist() == list(range(1, 9)) and t["layers"] == [0]
    assert t["counts"].sum(dim=(1, 2, 3)).tolist() == [8 * 64] * 8


def read_records(record_dir, rank):
    with open(os.path.join(record_dir, f"rank{rank}.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_lm_two_ranks_expert_parallel_hook_resume_and_eval_lm(lm_data, tmp_path):
    common = ["--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp", "--moe-gate", "gshard",
              "--save-interval-updates", "3", "--no-last-checkpoints", "--moe-placement",
              "recording_policy:RecordingPolicy"]
    rec_full, rec_resumed = tmp_path / "rec_full", tmp_path / "rec_resumed"
    rec_full.mkdir(), rec_resumed.mkdir()
    _, out = fairseq_cli("train", lm_args(lm_data, tmp_path / "full", 5, *common), nproc=2,
                         MEGAMOE_RECORD_DIR=str(rec_full))
    full = updates(out)
    assert sorted(full) == [1, 2, 3, 4, 5], out[-3000:]
    assert full[1]["moe_bal_dec2"] >= 1.0 and full[1]["wpb"] == 2 * 8 * 64    # both ranks' tokens in one update

    r0, r1 = read_records(rec_full, 0), read_records(rec_full, 1)
    assert [r["iteration"] for r in r0] == [1, 2, 3, 4, 5] == [r["iteration"] for r in r1]
    last0, last1 = r0[-1]["param_norms"], r1[-1]["param_norms"]
    experts = [n for n in last0 if ".experts." in n]
    shared = [n for n in last0 if ".experts." not in n]
    assert experts and shared
    for n in experts:
        assert abs(last0[n] - last1[n]) > 1e-6, n          # each rank holds other experts
    for n in shared:
        assert last0[n] == pytest.approx(last1[n], rel=1e-6, abs=1e-7), n    # data-parallel copies agree
    assert all(r["optimizer_has_state"] for r in r0)

    ckpt = tmp_path / "full" / "checkpoint_1_3.pt"
    assert ckpt.exists()
    _, out = fairseq_cli("train", lm_args(lm_data, tmp_path / "full", 5, *common, "--restore-file", str(ckpt)),
                         nproc=2, MEGAMOE_RECORD_DIR=str(rec_resumed))
    resumed = updates(out)
    assert sorted(resumed) == [4, 5], out[-3000:]
    for u in (4, 5):
        assert resumed[u]["loss"] == full[u]["loss"], (u, resumed[u], full[u])
        assert resumed[u]["gnorm"] == full[u]["gnorm"], (u, resumed[u], full[u])
    resumed0 = read_records(rec_resumed, 0)[-1]["param_norms"]
    for n in experts + shared:
        assert resumed0[n] == pytest.approx(last0[n], rel=1e-5), n

    # the EP=2 checkpoint holds all 4 experts: a single process evaluates it
    _, out = fairseq_cli("eval_lm", [lm_data, "--path", str(ckpt), "--user-dir", user_dir(), "--cpu",
                                     "--tokens-per-sample", "64", "--batch-size", "8", "--gen-subset", "valid"])
    m = re.search(r"Loss \(base 2\): ([0-9.]+), Perplexity: ([0-9.]+)", out)
    assert m and math.isfinite(float(m.group(2))), out[-3000:]


@pytest.fixture(scope="module")
def mt_data(tmp_path_factory):
    from megamoe_plugin.data.parallel import write_parallel_corpus
    d = tmp_path_factory.mktemp("fairseq_mt")
    write_parallel_corpus(d / "raw", n_train=1000, n_valid=50, n_test=20)
    fairseq_cli("preprocess", ["--source-lang", "src", "--target-lang", "tgt", "--trainpref", str(d / "raw/train"),
                               "--validpref", str(d / "raw/valid"), "--testpref", str(d / "raw/test"),
                               "--destdir", str(d / "bin"), "--joined-dictionary", "--workers", "1"])
    return str(d / "bin")


def test_translation_trains_and_generates(mt_data, tmp_path):
    _, out = fairseq_cli("train", [
        mt_data, "--user-dir", user_dir(), "--task", "translation", "--arch", "moe_transformer_tiny",
        "--criterion", "moe_label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--share-all-embeddings",
        "--cpu", "--optimizer", "adam", "--lr", "0.005", "--max-tokens", "1500", "--max-update", "40",
        "--log-interval", "5", "--log-format", "simple", "--save-dir", str(tmp_path / "ck"),
        "--no-epoch-checkpoints", "--seed", "1", "--moe-gate", "naive", "--moe-top-k", "2"])
    rows = updates(out)
    assert rows and max(rows) == 40, out[-3000:]
    assert rows[40]["loss"] < rows[min(rows)]["loss"] - 0.5, {u: r["loss"] for u, r in rows.items()}
    for label in ("enc2", "dec2"):          # MoE FFNs in encoder and decoder
        assert f"moe_bal_{label}" in rows[40] and f"moe_load_{label}" in rows[40]
    _, out = fairseq_cli("generate", [mt_data, "--user-dir", user_dir(), "--path",
                                      str(tmp_path / "ck" / "checkpoint_last.pt"), "--cpu", "--beam", "2",
                                      "--batch-size", "16", "--gen-subset", "test"])
    hyps = re.findall(r"^H-(\d+)\t(-?[0-9.]+)\t(.*)$", out, flags=re.M)
    sources = re.findall(r"^S-(\d+)\t", out, flags=re.M)
    # fairseq-generate itself leaves out a few of the longest test sentences (a dense transformer_tiny does too)
    assert len(hyps) == len(sources) >= 15, out[-3000:]
    assert all(re.fullmatch(r"[a-z ]*", h[2]) for h in hyps), hyps[:3]
    assert "BLEU" in out


@pytest.mark.parametrize("flags, needle", [
    (["--moe-gate", "nosuch"], "--moe-gate"),
    (["--moe-gate", "switch", "--moe-top-k", "2"], "--moe-top-k"),
    (["--moe-second-expert-policy", "sampling"], "--moe-second-expert-policy"),
    (["--checkpoint-activations"], "--checkpoint-activations"),
])
def test_bad_flags_stop_before_training(lm_data, tmp_path, flags, needle):
    code, out = fairseq_cli("train", lm_args(lm_data, tmp_path / "ck", 2, *flags), check=False)
    assert code != 0
    assert needle in out, out[-3000:]
    assert "begin training epoch" not in out


def test_expert_groups_inside_data_parallel(lm_data, tmp_path):
    """4 ranks, --moe-expert-parallel-size 2: two EP groups {0,1}, {2,3}; ranks 0 and 2 (and 1 and 3) hold the same
    experts and keep them identical (the plugin sums their gradients), shared weights agree everywhere."""
    rec = tmp_path / "rec"
    rec.mkdir()
    _, out = fairseq_cli("train", lm_args(lm_data, tmp_path / "ck", 3, "--distributed-backend", "gloo",
                                          "--ddp-backend", "legacy_ddp", "--no-save", "--moe-expert-parallel-size",
                                          "2", "--moe-placement", "recording_policy:RecordingPolicy"),
                         nproc=4, MEGAMOE_RECORD_DIR=str(rec))
    assert sorted(updates(out)) == [1, 2, 3], out[-3000:]
    last = [read_records(rec, r)[-1]["param_norms"] for r in range(4)]
    for name in last[0]:
        if ".experts." in name:
            assert last[0][name] == pytest.approx(last[2][name], rel=1e-6), name
            assert last[1][name] == pytest.approx(last[3][name], rel=1e-6), name
            assert abs(last[0][name] - last[1][name]) > 1e-6, name
        else:
            assert all(last[r][name] == pytest.approx(last[0][name], rel=1e-6) for r in range(4)), name


def test_lm_with_megatron_core_router_family(lm_data, tmp_path):
    """fairseq-train with DeepSeek-V3's router (the same MoEConfig options as every trainer): sigmoid scores,
    group-limited top-4, the per-sequence loss and the expert bias, which moves by +-rate once per update and is
    saved in the checkpoint."""
    import torch
    rate = 0.01
    _, out = fairseq_cli("train", lm_args(lm_data, tmp_path / "ck", 5, "--moe-gate", "topk", "--moe-top-k", "4",
                                          "--moe-expert-count", "8", "--moe-score-function", "sigmoid",
                                          "--moe-router-expert-bias", "--moe-router-bias-update-rate", str(rate),
                                          "--moe-num-groups", "4", "--moe-group-topk", "2",
                                          "--moe-load-balancing-type", "seq_aux_loss:0.01"))
    rows = updates(out)
    assert sorted(rows) == list(range(1, 6)) and all(r["moe_aux"] > 0 for r in rows.values()), out[-3000:]
    model = torch.load(tmp_path / "ck" / "checkpoint_last.pt", weights_only=False)["model"]
    biases = [v for k, v in model.items() if k.endswith("gate.expert_bias")]
    assert biases and all(b.abs().max() > 0 for b in biases), list(model)
    for b in biases:         # 5 updates of +-rate (or 0) per expert
        assert torch.allclose(b / rate, (b / rate).round(), atol=1e-4) and (b / rate).abs().max() <= 5


def test_lm_two_ranks_ta_moe_by_bias_keeps_each_senders_bias(lm_data, tmp_path):
    """fairseq-train on 2 ranks (2 nodes of one rank, the inter-node link 4x slower) with TA-MoE steered by its
    per-sender bias: the expert bias is replicated in the model, each rank's sender bias rides in the checkpoint's
    per-rank gate state."""
    import torch
    _, out = fairseq_cli("train", lm_args(lm_data, tmp_path / "ck", 3, "--distributed-backend", "gloo",
                                          "--ddp-backend", "legacy_ddp", "--moe-gate", "ta_moe",
                                          "--moe-score-function", "sigmoid", "--moe-router-expert-bias",
                                          "--moe-load-balancing-type", "none", "--moe-topology", "[[0],[1]]",
                                          "--moe-topology-bandwidth-gbps", "4,1"), nproc=2)
    assert sorted(updates(out)) == [1, 2, 3], out[-3000:]
    state = torch.load(tmp_path / "ck" / "checkpoint_last.pt", weights_only=False)
    gates = state["extra_state"]["megamoe_gates"]
    assert len(gates) == 2
    keys = [k for k in gates[0] if k.startswith("rank_buffer/") and k.endswith("gate.sender_bias")]
    assert keys and all(gates[r][k].shape == (2,) for r in range(2) for k in keys), list(gates[0])
    assert not any(k.endswith("sender_bias") for k in state["model"])
