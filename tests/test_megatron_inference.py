"""Paper 004's inference options in the Megatron example trainer, for real: 2 gloo processes with experts sharded
over them (EP=2) train and save a checkpoint; `--skip-train` evaluates it plainly and with an expert placement file
(an expert permutation across the two ranks: experts change devices) plus expert buffering (1 device slot per
bank); the validation loss is the same. Training with the inference options is refused, naming the flag."""
import re
import subprocess
import sys

import pytest

from megamoe_plugin.inference.balance import write_placement_file
from test_megatron_trainer import SCRIPT, TINY, run  # noqa: F401

VALID = re.compile(r"validation at iteration (\d+) \| lm loss ([0-9.]+)")
EP2 = ["--expert-model-parallel-size", "2", "--train-iters", "3", "--eval-iters", "2"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("corpus"))


@pytest.mark.one_release             # expert buffering and the placement file are the plugin's own logic
def test_skip_train_with_placement_file_and_expert_buffering_gives_the_same_validation_loss(cache, tmp_path):
    ck = str(tmp_path / "ck")
    _, out = run(2, [*EP2, "--save", ck], cache)
    trained = VALID.findall(out)
    assert trained and trained[-1][0] == "3", out[-3000:]

    _, out = run(2, [*EP2, "--load", ck, "--skip-train"], cache)
    plain = VALID.findall(out)
    assert plain == [trained[-1]], out[-3000:]                   # the loaded model, evaluated, nothing trained

    placement = tmp_path / "placement.json"
    write_placement_file(str(placement), {1: [2, 0, 3, 1], 2: [3, 2, 1, 0]}, {"made_by": "test"})
    _, out = run(2, [*EP2, "--load", ck, "--skip-train", "--moe-plugin-placement-file", str(placement),
                     "--moe-plugin-expert-cache-size", "1", "--moe-plugin-expert-cache-policy", "fifo"], cache)
    assert "experts of MoE layer(s) [1, 2] permuted" in out, out[-3000:]
    assert "expert buffering, 1 slot(s) per bank, fifo" in out, out[-3000:]
    deployed = VALID.findall(out)
    assert len(deployed) == 1 and abs(float(deployed[0][1]) - float(plain[0][1])) <= 2e-4, (deployed, plain)


def test_training_with_inference_options_is_refused(cache, tmp_path):
    cmd = [sys.executable, SCRIPT, *TINY, "--data-cache-path", cache, "--train-iters", "2",
           "--moe-plugin-expert-cache-size", "2"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "--moe-plugin-expert-cache-size=2: inference only" in p.stdout + p.stderr, \
        (p.stdout + p.stderr)[-3000:]
