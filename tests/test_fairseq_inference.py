"""Paper 004's inference options in fairseq's own tools, for real: a checkpoint trained with fairseq-train is
evaluated by fairseq-eval-lm with an expert placement file (experts permuted) and expert buffering (1 device slot,
every expert copied in as needed); the loss is the plain evaluation's. fairseq-train refuses both options, naming
them, before training."""
import math
import re

import pytest

from megamoe_plugin.inference.balance import write_placement_file
from test_fairseq_train import fairseq_cli, lm_args, lm_data, user_dir  # noqa: F401 (fixture)

LOSS = re.compile(r"Loss \(base 2\): ([0-9.]+), Perplexity: ([0-9.]+)")


def _eval(data, ckpt, *extra):
    _, out = fairseq_cli("eval_lm", [data, "--path", str(ckpt), "--user-dir", user_dir(), "--cpu",
                                     "--tokens-per-sample", "64", "--batch-size", "8", "--gen-subset", "valid",
                                     "--max-valid-steps", "6", *extra])
    m = LOSS.search(out)
    assert m, out[-3000:]
    return float(m.group(1)), out


def test_eval_lm_with_placement_file_and_expert_buffering_gives_the_same_loss(lm_data, tmp_path):
    fairseq_cli("train", lm_args(lm_data, tmp_path / "ck", 6, "--moe-gate", "gshard"))
    ckpt = tmp_path / "ck" / "checkpoint_last.pt"
    plain, _ = _eval(lm_data, ckpt)
    assert math.isfinite(plain)

    placement = tmp_path / "placement.json"
    write_placement_file(str(placement), {0: [3, 1, 0, 2]}, {"made_by": "test"})
    overrides = ("{'moe_placement_file': '%s', 'moe_expert_cache_size': 1, 'moe_expert_cache_policy': 'lru'}"
                 % placement)
    deployed, out = _eval(lm_data, ckpt, "--model-overrides", overrides)
    assert "experts of MoE layer(s) [0] permuted" in out, out[-3000:]
    assert "expert buffering, 1 slot(s) per bank, lru: 1 bank(s)" in out, out[-3000:]
    assert deployed == pytest.approx(plain, abs=1e-4)

    wrong = tmp_path / "wrong.json"
    write_placement_file(str(wrong), {7: [3, 1, 0, 2]}, {})
    code, out = fairseq_cli("eval_lm", [lm_data, "--path", str(ckpt), "--user-dir", user_dir(), "--cpu",
                                        "--tokens-per-sample", "64", "--batch-size", "8", "--gen-subset", "valid",
                                        "--model-overrides", "{'moe_placement_file': '%s'}" % wrong], check=False)
    assert code != 0 and "--moe-placement-file" in out and "[7]" in out, out[-3000:]


@pytest.mark.parametrize("flags, needle", [
    (["--moe-expert-cache-size", "2"], "--moe-expert-cache-size"),
    (["--moe-expert-cache-policy", "mru"], "--moe-expert-cache-policy"),
])
def test_fairseq_train_refuses_inference_options(lm_data, tmp_path, flags, needle):
    code, out = fairseq_cli("train", lm_args(lm_data, tmp_path / "ck", 2, *flags), check=False)
    assert code != 0 and needle in out, out[-3000:]
    assert "begin training epoch" not in out
