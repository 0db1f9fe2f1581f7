"""`megamoe trace` (megamoe_plugin/trace_cli.py): a trained checkpoint run over held-out text with its
routing recorded (paper 004 Fig. 6 traces), for the three trainers' checkpoints.

- core (`megamoe train --save`, a few steps here): the trace has one row per batch and MoE layer whose counts sum
  to tokens x k; the recorded token ids are the top-k of the gate computed here from the trained model's own
  layer inputs; the reported held-out loss is the trained model's (computed here on windows built here); the
  heatmap is a PNG that reads back. A checkpoint sharded over 2 expert-parallel ranks with a moved and a
  replicated expert (faked from the single file) loads into the same model.
- fairseq (`fairseq-train` of moe_transformer_lm_tiny, 2 updates) and Megatron (examples/megatron/pretrain_moe_gpt.py
  --moe-plugin, 2 iterations, one process): traced end to end, counts sum to tokens x k per batch and layer.
- Wrong inputs are argparse errors that name what is supported.
"""
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from megamoe_plugin import train
from megamoe_plugin import trace_cli
from megamoe_plugin.stats import load_trace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--hidden", "64", "--layers", "2", "--heads", "2", "--ffn-hidden", "128", "--seq-len", "64",
        "--batch-size", "8", "--corpus-bytes", "300000", "--threads", "2", "--eval-interval", "0",
        "--eval-batches", "2", "--moe-every", "1", "--log-interval", "4"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


pytestmark = pytest.mark.usefixtures("single_process")   # conftest: no launcher env, threads restored


def _env():
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))


def _check_png(path):
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    import matplotlib.image as mpimg
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def _check_counts(t, batches, layers, E, k, tokens_per_batch):
    assert t["schema"] == "megamoe-trace/1"
    assert t["counts"].shape == (batches, len(layers), 1, E)
    assert t["layers"] == layers and t["steps"].tolist() == list(range(1, batches + 1))
    assert t["num_experts"] == E and t["top_k"] == k
    per = t["counts"].sum(dim=(2, 3))                         # [batches, layers]
    assert per.tolist() == [[tokens_per_batch * k] * len(layers)] * batches


@pytest.fixture(scope="module")
def core_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("core")
    res = train.main(TINY + ["--steps", "4", "--save", str(d / "ck.pt")])
    return d, res


def test_core_checkpoint_trace_matches_the_trained_model(core_run, tmp_path, capsys):
    d, res = core_run
    out, png = str(tmp_path / "tr" / "lm"), str(tmp_path / "heat.png")
    B, S, N = 4, 32, 3
    got = trace_cli.main(["--checkpoint", str(d / "ck.pt"), "--trainer", "core", "--out", out, "--batches", str(N),
                          "--batch-size", str(B), "--seq-len", str(S), "--token-ids", "--heatmap", png,
                          "--threads", "2"])
    text = capsys.readouterr().out
    t = load_trace(out)
    _check_counts(t, N, [0, 1], 8, 2, B * S)
    assert got["batches"] == N and got["tokens"] == N * B * S and os.path.exists(out + ".rank0")
    _check_png(png)
    assert "| layer |" in text and "held-out loss" in text

    # independently: the trained model on the valid split's first windows, its gate's top-2 from its own layer inputs
    from megamoe_plugin.data import build_corpus
    toks = build_corpus(max_bytes=300000).split("valid").tokens
    model = res.model.eval()
    inputs = {}
    hooks = [b.ffn.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0].detach()))
             for i, b in enumerate(model.blocks)]
    nll, n = 0.0, 0
    with torch.no_grad():
        for b in range(N):
            w = torch.stack([toks[(b * B + j) * S:(b * B + j) * S + S + 1] for j in range(B)])
            logits = model(w[:, :-1])
            nll += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum"))
            n += B * S
            for layer in (0, 1):
                x = inputs[layer].reshape(-1, 64)
                gate_w = model.blocks[layer].ffn.gate.weight
                top = torch.topk(torch.softmax(x @ gate_w.t(), -1), 2, -1).indices
                rec = t["token_ids"][0][b][layer].long()
                assert rec.shape == (B * S, 2)
                assert torch.equal(rec, top)
                counts = torch.bincount(rec.reshape(-1), minlength=8)
                assert counts.tolist() == t["counts"][b, layer, 0].tolist()
    for h in hooks:
        h.remove()
    assert got["loss"] == pytest.approx(nll / n, rel=1e-5)
    assert got["loss"] < math.log(259) - 0.3                   # trained for a few steps: better than uniform


def test_core_checkpoint_sharded_with_moved_experts_loads_the_same_model(core_run, tmp_path):
    from megamoe_plugin.layer import MoELayer
    from megamoe_plugin.placement.state import PlacementState

    d, _ = core_run
    ref, cfg, _ = trace_cli.load_core_checkpoint(str(d / "ck.pt"))
    state = torch.load(d / "ck.pt", weights_only=True)
    st = PlacementState(8, 2, 5)                               # 4 experts + 1 spare slot per rank
    st.migrate(1, 0, 1)                                        # expert 1 moves to rank 1's spare slot
    st.expand(6, 0)                                            # expert 6 gets a second vExpert on rank 0
    # a checkpoint row speaks for an expert from its owner, the first replica in rank order
    owners = {e: (st.replicas(e)[0], st.slots_of(st.replicas(e)[0]).index(e)) for e in range(8)}
    assert owners[1][0] == 1 and owners[6][0] == 0
    shards = []
    for r in range(2):
        sd = dict(state["model"])
        for name, m in ref.named_modules():
            if not isinstance(m, MoELayer):
                continue
            for pname in ("w1", "w2"):
                key = f"{name}.experts.{pname}"
                full = state["model"][key]                     # [8, ...] in expert order
                rows = torch.full((5,) + tuple(full.shape[1:]), 7.0)      # free / non-owner slots: garbage
                for slot, e in enumerate(st.slots_of(r)):
                    if e is not None and owners[e] == (r, slot):
                        rows[slot] = full[e]
                sd[key] = rows
        shard = dict(state, model=sd, expert_parallel_size=2, world_size=2, ep_rank=r,
                     placement=[{"state": st.to_dict(), "shadowed": []}] * 2)
        torch.save(shard, tmp_path / f"sh.pt.rank{r}")
        shards.append(shard)
    model, cfg2, _ = trace_cli.load_core_checkpoint(str(tmp_path / "sh.pt"))
    assert cfg2.expert_parallel_size == 1 and cfg2.num_experts == 8
    a, b = ref.state_dict(), model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    torch.save(dict(shards[1]), tmp_path / "one.pt.rank0")      # rank 1's shard alone: refused
    with pytest.raises(trace_cli.CheckpointError, match="ranks 0..1"):
        trace_cli.load_core_checkpoint(str(tmp_path / "one.pt"))


def test_wrong_inputs_are_argparse_errors(core_run, tmp_path, capsys):
    d, _ = core_run
    torch.save({"cfg": {}, "model": {}}, tmp_path / "other.pt")      # not a megamoe train checkpoint
    with pytest.raises(SystemExit):
        trace_cli.main(["--checkpoint", str(tmp_path / "other.pt"), "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert "megamoe train --save" in err and "fairseq" in err and "megatron" in err
    with pytest.raises(SystemExit):
        trace_cli.main(["--checkpoint", str(d), "--trainer", "megatron", "--out", str(tmp_path / "x")])
    assert "--megatron-args" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        trace_cli.main(["--checkpoint", str(d / "ck.pt"), "--out", str(tmp_path / "x"), "--seq-len", "65"])
    assert "exceeds the model's 64" in capsys.readouterr().err


def test_fairseq_checkpoint_trace(tmp_path, capsys):
    pytest.importorskip("fairseq")
    from megamoe_plugin.data.corpus import write_text_splits
    from megamoe_plugin.fairseq_adapter import user_dir

    write_text_splits(tmp_path / "raw", formats=("txt",), max_bytes=200_000)
    run = lambda tool, args: subprocess.run([sys.executable, "-m", f"fairseq_cli.{tool}", *args], env=_env(),   # noqa
                                            capture_output=True, text=True, timeout=300, cwd=REPO)
    p = run("preprocess", ["--only-source", "--trainpref", str(tmp_path / "raw/train.txt"), "--validpref",
                           str(tmp_path / "raw/valid.txt"), "--destdir", str(tmp_path / "bin"), "--nwordssrc",
                           "2000", "--workers", "1"])
    assert p.returncode == 0, p.stderr[-3000:]
    p = run("train", [str(tmp_path / "bin"), "--user-dir", user_dir(), "--task", "language_modeling", "--arch",
                      "moe_transformer_lm_tiny", "--criterion", "moe_cross_entropy", "--cpu", "--optimizer", "adam",
                      "--lr", "0.003", "--tokens-per-sample", "64", "--batch-size", "8", "--save-dir",
                      str(tmp_path / "ck"), "--no-epoch-checkpoints", "--seed", "1", "--max-update", "2",
                      "--moe-gate", "gshard"])
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    out, png = str(tmp_path / "tr" / "fs"), str(tmp_path / "fs.png")
    got = trace_cli.main(["--checkpoint", str(tmp_path / "ck" / "checkpoint_last.pt"), "--trainer", "fairseq",
                          "--out", out, "--batches", "3", "--batch-size", "4", "--heatmap", png, "--threads", "2"])
    t = load_trace(out)
    _check_counts(t, 3, [0], 4, 2, 4 * 64)                     # tiny arch: 4 experts, MoE on the 2nd decoder layer
    assert got["seq_len"] == 64 and math.isfinite(got["loss"]) and got["loss"] < math.log(2000) + 1
    _check_png(png)


def test_megatron_checkpoint_trace(tmp_path):
    pytest.importorskip("megatron.core")
    model_flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                   "--max-position-embeddings", "32", "--micro-batch-size", "4", "--corpus-bytes", "200000",
                   "--num-experts", "4", "--moe-router-topk", "2", "--hidden-dropout", "0", "--attention-dropout",
                   "0", "--moe-plugin"]
    p = subprocess.run([sys.executable, "-m", "megamoe_plugin.megatron_adapter.trainer", *model_flags, "--global-batch-size", "4",
                        "--lr", "3e-3", "--log-interval", "1", "--train-iters", "2", "--eval-iters", "1",
                        "--save", str(tmp_path / "ck"), "--data-cache-path", str(tmp_path / "cache")],
                       env=_env(), capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    out, png = str(tmp_path / "tr" / "mg"), str(tmp_path / "mg.png")
    # its own process: the trace initializes megatron's global parallel state
    p = subprocess.run([sys.executable, "-m", "megamoe_plugin.trace_cli", "--checkpoint",
                        str(tmp_path / "ck"), "--trainer", "megatron", "--out", out, "--batches", "3",
                        "--batch-size", "4", "--heatmap", png, "--megatron-args", " ".join(model_flags)],
                       env=_env(), capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    t = load_trace(out)
    _check_counts(t, 3, [1, 2], 4, 2, 4 * 32)                  # Megatron's layer numbers: both layers are MoE
    assert "held-out loss" in p.stdout
    _check_png(png)
