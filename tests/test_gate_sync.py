"""--moe-gate-sync all | local | average:K in the three trainers, on real gloo processes:

- local: after N steps the gates differ across ranks and every other replicated parameter is identical (clipping
  is identical on every rank); average:K: equal right after a multiple of K; all: always equal;
- a checkpoint keeps every rank's own gate: a resumed run continues exactly as the uninterrupted one on every rank.
"""
import json
import os
import subprocess

import pytest
import torch

from conftest import ranks_command, run_distributed
from megamoe_plugin import train
from megamoe_plugin.gate_sync import gate_params
from megamoe_plugin.megatron_adapter.checkpointing import TRACKER

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELPERS = os.path.join(REPO, "tests", "helpers")
TINY = ["--hidden", "64", "--layers", "2", "--heads", "2", "--ffn-hidden", "128", "--seq-len", "32",
        "--batch-size", "4", "--corpus-bytes", "200000", "--threads", "1", "--eval-interval", "0",
        "--eval-batches", "2", "--log-interval", "1", "--moe-every", "1", "--moe-expert-parallel-size", "2",
        "--clip-grad", "0.05"]                 # clipping active every step: a rank-dependent norm would show


def _worker(rank, world, argv, out):
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    res = train.main(argv)
    gates = [p.detach().clone() for p in gate_params(res.model)]
    others = {n: p.detach().clone() for n, p in res.model.named_parameters()
              if not getattr(p, "megamoe_gate", False) and not getattr(p, "expert", False)}
    torch.save({"gates": gates, "others": others}, f"{out}.{rank}")


def _core(tmp_path, sync, *extra):
    out = str(tmp_path / f"core_{sync.replace(':', '')}_{len(os.listdir(tmp_path))}")
    run_distributed(_worker, 2, [*TINY, "--moe-gate-sync", sync, *extra], out)
    return [torch.load(f"{out}.{r}", weights_only=True) for r in range(2)]


@pytest.mark.slow
def test_megamoe_train_gate_sync_modes_and_checkpoint(tmp_path, single_process):
    for sync, steps, gates_equal in (("all", 5, True), ("local", 5, False), ("average:3", 6, True),
                                     ("average:3", 5, False)):
        a, b = _core(tmp_path, sync, "--steps", str(steps))
        assert all(torch.equal(a["others"][n], b["others"][n]) for n in a["others"]), sync
        same = all(torch.equal(x, y) for x, y in zip(a["gates"], b["gates"]))
        assert same == gates_equal, (sync, steps)
    # checkpoint: every rank's gate and Adam state come back (resume == uninterrupted, rank by rank)
    ck = str(tmp_path / "ck")
    full = _core(tmp_path, "local", "--steps", "6")
    _core(tmp_path, "local", "--steps", "6", "--exit-interval", "3", "--save", ck)
    resumed = _core(tmp_path, "local", "--steps", "6", "--resume", ck)
    for r in range(2):
        for x, y in zip(full[r]["gates"], resumed[r]["gates"]):
            assert torch.allclose(x, y, rtol=1e-5, atol=1e-7), r
    assert not torch.equal(resumed[0]["gates"][0], resumed[1]["gates"][0])


# --- Megatron (the megatron-core trainer) and fairseq: the recording policy writes every rank's parameter norms --
def _records(d, rank):
    with open(os.path.join(d, f"rank{rank}.jsonl")) as f:
        return [json.loads(line) for line in f]


def _gate_vs_others(d):
    """Per recorded step: (gates equal across the 2 ranks, every non-gate, non-expert parameter equal)."""
    a, b = _records(d, 0), _records(d, 1)
    out = []
    for ra, rb in zip(a, b):
        gate = [n for n in ra["param_norms"] if "gate" in n and ("weight" in n or "bias" in n) and "experts" not in n]
        other = [n for n in ra["param_norms"] if n not in gate and "expert" not in n]
        assert gate and other
        out.append((all(ra["param_norms"][n] == rb["param_norms"][n] for n in gate),
                    all(abs(ra["param_norms"][n] - rb["param_norms"][n]) <= 1e-6 * abs(ra["param_norms"][n])
                        for n in other)))
    return out


def _env(rec):
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", MEGAMOE_RECORD_DIR=str(rec),
                PYTHONPATH=os.pathsep.join([HELPERS, REPO, os.environ.get("PYTHONPATH", "")]))


MEGATRON = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "4", "--log-interval", "1", "--corpus-bytes", "200000", "--num-experts", "4",
            "--moe-plugin", "--moe-aux-loss-coeff", "0.01", "--expert-model-parallel-size", "2", "--clip-grad",
            "0.05", "--moe-plugin-second-expert-policy", "all", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--moe-plugin-placement", "recording_policy:RecordingPolicy"]


def _megatron(rec, *args):
    rec.mkdir()
    cmd = ranks_command(2) + ["-m", "megamoe_plugin.megatron_adapter.trainer", *MEGATRON, *args]
    p = subprocess.run(cmd, env=_env(rec), capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    return p.stdout


@pytest.mark.slow
def test_megatron_gate_sync_modes_and_checkpoint(tmp_path):
    pytest.importorskip("megatron.core")
    cache = ["--data-cache-path", str(tmp_path / "cache")]
    _megatron(tmp_path / "all", *cache, "--train-iters", "4")
    assert all(g and o for g, o in _gate_vs_others(tmp_path / "all"))
    ck = tmp_path / "ck"
    _megatron(tmp_path / "local", *cache, "--train-iters", "4", "--moe-plugin-gate-sync", "local", "--save", str(ck),
              "--save-interval", "2")
    assert [g for g, _ in _gate_vs_others(tmp_path / "local")] == [False] * 4
    assert all(o for _, o in _gate_vs_others(tmp_path / "local"))
    _megatron(tmp_path / "avg", *cache, "--train-iters", "4", "--moe-plugin-gate-sync", "average:2")
    assert [g for g, _ in _gate_vs_others(tmp_path / "avg")] == [False, True, False, True]
    # the checkpoint of iteration 2 keeps each rank's gate: resumed == uninterrupted on both ranks
    (ck / TRACKER).write_text("2")
    _megatron(tmp_path / "resumed", *cache, "--train-iters", "4", "--moe-plugin-gate-sync", "local", "--load",
              str(ck))
    for rank in range(2):
        assert [r["iteration"] for r in _records(tmp_path / "resumed", rank)] == [3, 4]
        full = {r["iteration"]: r["param_norms"] for r in _records(tmp_path / "local", rank)}
        for r in _records(tmp_path / "resumed", rank):
            for n, v in r["param_norms"].items():
                assert abs(full[r["iteration"]][n] - v) <= 1e-5 * abs(v), (rank, r["iteration"], n)


@pytest.mark.slow
def test_fairseq_gate_sync_modes(tmp_path):
    pytest.importorskip("fairseq")
    from test_fairseq_train import fairseq_cli, lm_args
    from megamoe_plugin.data.corpus import write_text_splits
    write_text_splits(tmp_path / "raw", formats=("txt",), max_bytes=100_000)
    fairseq_cli("preprocess", ["--only-source", "--trainpref", str(tmp_path / "raw/train.txt"), "--validpref",
                               str(tmp_path / "raw/valid.txt"), "--destdir", str(tmp_path / "bin"), "--nwordssrc",
                               "500", "--workers", "1"])
    data = str(tmp_path / "bin")
    results = {}
    for sync in ("all", "local", "average:2"):
        rec = tmp_path / sync.replace(":", "")
        rec.mkdir()
        fairseq_cli("train", lm_args(data, tmp_path / "ck", 4, "--distributed-backend", "gloo", "--ddp-backend",
                                     "legacy_ddp", "--no-save", "--moe-gate-sync", sync, "--clip-norm", "0.05",
                                     "--moe-placement", "recording_policy:RecordingPolicy"),
                    nproc=2, MEGAMOE_RECORD_DIR=str(rec))
        results[sync] = _gate_vs_others(rec)
    assert all(g and o for g, o in results["all"])
    assert [g for g, _ in results["local"]] == [False] * 4 and all(o for _, o in results["local"])
    assert [g for g, _ in results["average:2"]] == [False, True, False, True]
