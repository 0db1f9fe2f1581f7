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
        "--moe-capacity-policy", "dynamic", "--moe-assignment-cache",
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


def test_max_train_samples_gives_short_epochs_and_metrics_json_carries_the_cache(tmp_path):
    """16 training samples at 8 per step: an epoch every 2 steps, so 8 steps close epochs 1-3 (the tiny corpus alone
    gives 13 steps per epoch); metrics.json keeps the per-epoch cache history and each log line's cache state."""
    import json
    path = tmp_path / "metrics.json"
    res = train.main(TINY + ["--steps", "8", "--max-train-samples", "16", "--log-interval", "2",
                             "--metrics-json", str(path)])
    m = json.loads(path.read_text())
    assert [h[0] for h in m["cache_history"]] == [1, 2, 3] == [h[0] for h in res.cache_history]
    assert [h["step"] for h in m["history"]] == [2, 4, 6, 8]
    # on = 0 from epoch 2: the decision closing epoch 2 (step 5) lands a step later, so step 8's line has it on
    assert [h["dynamic"]["cache_on"] for h in m["history"]][0] == 0.0 and m["history"][-1]["dynamic"]["cache_on"] == 1.0
    assert m["dynamic"]["cached_calls"] == res.dynamic["cached_calls"] > 0


def test_max_train_samples_bad_values_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        train.main(TINY + ["--steps", "2", "--max-train-samples", "-1"])
    assert "--max-train-samples must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.main(TINY + ["--steps", "2", "--max-train-samples", "4"])      # fewer than one batch of 8
    assert "--max-train-samples" in capsys.readouterr().err
