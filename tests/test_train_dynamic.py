"""DynaMoE in `megamoe train`: dynamic capacity and the sample-assignment cache keyed by the
trainer's own sample indices, metrics in the progress line, and a checkpoint that resumes the same run.

A tiny corpus (110 samples of 32 tokens, 13 steps per epoch) so epochs recur within a few seconds; thresholds are
lowered (on = off = 0, min epoch 2) so caching switches on when epoch 2 closes, as it would at 96% / epoch 10 on a
converged run."""
import re

import pytest
import torch

from megamoe_plugin import train

TINY = ["--hidden", "32", "--layers", "2", "--heads", "2", "--ffn-hidden", "64", "--seq-len", "32",
        "--batch-size", "8", "--corpus-bytes", "4000", "--threads", "1", "--eval-interval", "0",
        "--eval-batches", "2", "--moe-every", "1", "--log-interval", "13", "--warmup", "3",
        "--moe-num-experts", "4", "--moe-top-k", "2", "--moe-gate", "naive", "--moe-dispatch", "capacity",
        "--moe-capacity-policy", "dynamic", "--moe-capacity-min-interval", "3", "--moe-assignment-cache",
        "--moe-assignment-cache-on", "0", "--moe-assignment-cache-off", "0", "--moe-assignment-cache-min-epoch", "2"]
DYN_RE = re.compile(r"\| dynamic cf ([\d.]+) drop ([\d.]+) recompiles (\d+) cache (on|off)")


pytestmark = pytest.mark.usefixtures("single_process")   # conftest: no launcher env, threads restored


def test_megamoe_train_runs_dynamic_capacity_and_caching_and_resumes_the_same_run(tmp_path, capsys):
    ck = str(tmp_path / "ck.pt")
    straight = train.main(TINY + ["--steps", "39"])
    out = capsys.readouterr().out
    lines = DYN_RE.findall(out)
    assert len(lines) == 3, out
    assert [on for *_, on in lines] == ["off", "off", "on"]          # epoch 2 closes at step 26: caching on
    assert int(lines[-1][2]) == straight.dynamic["recompilations"] > 0
    assert [h[0] for h in straight.cache_history] == [1, 2] and straight.cache_history[0][1] is None
    # epoch 3 = steps 27..39; step 27's metrics close epoch 2 on the trigger thread, the decision lands Δ_launch = 1
    # step later (before step 29): steps 29..39 of both layers are dispatched by cached ids
    assert straight.dynamic["cached_calls"] == 2 * 11
    assert all(float(cf) > 0 for cf, *_ in lines)

    first = train.main(TINY + ["--steps", "39", "--exit-interval", "32", "--save", ck])   # mid-epoch 3, cache on
    assert first.step == 32
    saved = torch.load(ck, weights_only=True)
    (state,) = saved["dynamic"]
    assert state["cache"]["active"] and state["cache"]["cached_calls"] == 2 * 4
    resumed = train.main(TINY + ["--steps", "39", "--resume", ck])
    assert resumed.start_step == 32
    assert resumed.evals[-1] == straight.evals[-1]
    assert resumed.dynamic["cached_calls"] == straight.dynamic["cached_calls"]
    assert resumed.dynamic["recompilations"] == straight.dynamic["recompilations"]
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value, straight.model.state_dict()[name]), name


def test_assignment_cache_positions_too_short_is_a_clear_error(capsys):
    with pytest.raises(ValueError, match="--moe-assignment-cache-positions"):
        train.main(TINY + ["--steps", "2", "--moe-assignment-cache-positions", "16"])
