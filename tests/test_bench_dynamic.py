"""`megamoe bench dynamic --quick` (bench/dynamic.py) end to end through the CLI: every run trains, the capacity
statistics behave as capacity dispatch must, and the printed ratios are the ones the per-step times give."""
import json
import math
import statistics

import pytest

from megamoe_plugin.cli import main as cli_main

RUNS = ["static CF=1", "static CF=2", "static CF=4", "static no-drop", "dynamic", "dynamic spread=0", "dynamic q=0.9",
        "dynamic+cache"]


def test_quick_dynamic_bench(tmp_path, capsys):
    path = tmp_path / "dynamic.json"
    assert cli_main(["bench", "dynamic", "--quick", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    res = json.loads(path.read_text())
    setup, runs = res["setup"], {r["name"]: r for r in res["runs"]}
    assert list(runs) == RUNS
    assert "measured here on CPU" in out and "tiny GPT on the embedded corpus" in out
    E, k, steps, skip = setup["moe"]["num_experts"], setup["moe"]["top_k"], setup["steps"], setup["skip"]

    for name, r in runs.items():
        assert f"| {name} |" in out
        assert math.isfinite(r["val_loss"]) and 0 < r["val_loss"] < math.log(258)      # learnt something
        assert [e for e, _ in r["val_curve"]] == list(range(1, setup["epochs"] + 1))
        assert len(r["step_s"]) == len(r["moe_s"]) == steps
        assert all(0 < m < t for m, t in zip(r["moe_s"], r["step_s"]))                # MoE time inside the step
        assert (r["recompilations"] > 0) == (r["capacity_policy"] in ("dynamic", "quantile"))
        assert r["recompilations"] <= steps * (setup["layers"] // setup["moe_every"])

    # static capacity: CF=1 drops on this skewed routing, the no-drop factor E/k cannot drop and pads E/k-fold
    assert runs["static CF=1"]["avg_capacity_factor"] == pytest.approx(1.0)
    assert runs["static CF=1"]["dropped_fraction"] > 0
    assert runs["static no-drop"]["dropped_fraction"] == 0
    assert runs["static no-drop"]["avg_capacity_factor"] == pytest.approx(E / k)
    drops = [runs[f"static CF={c}"]["dropped_fraction"] for c in (1, 2, 4)]
    assert drops[0] > drops[1] > drops[2]
    # dynamic capacity: far less padding than no-drop, fewer drops than CF=1; no spread term, fewer rows
    dyn = runs["dynamic"]
    assert dyn["avg_capacity_factor"] < runs["static no-drop"]["avg_capacity_factor"]
    assert dyn["dropped_fraction"] < runs["static CF=1"]["dropped_fraction"]
    assert runs["dynamic spread=0"]["avg_capacity_factor"] < dyn["avg_capacity_factor"]   # no jitter cover
    # per epoch: the drops and rows add up to the run's totals (assignments are the same every epoch here)
    for r in runs.values():
        per = r["per_epoch"]
        assert [e["epoch"] for e in per] == list(range(1, setup["epochs"] + 1))
        assert statistics.fmean(e["dropped_fraction"] for e in per) == pytest.approx(r["dropped_fraction"], rel=1e-6)
        assert statistics.fmean(e["avg_capacity_factor"] for e in per) == pytest.approx(r["avg_capacity_factor"],
                                                                                      rel=1e-6)
    # Fig. 8: one capacity list per step for the dynamic runs, none for the static ones
    for name, r in runs.items():
        if r["capacity_policy"] in ("dynamic", "quantile"):
            assert len(r["capacity_trace"]) == steps and len(r["capacity_trace"][-1]) == E
            assert all(c >= 1 for c in r["capacity_trace"][-1])
        else:
            assert "capacity_trace" not in r

    # ratios: recomputed here from the per-step times, and printed as such
    mean = lambda xs: statistics.fmean(xs[skip:])       # noqa: E731
    base = runs["static no-drop"]
    for name in ("dynamic", "dynamic spread=0", "dynamic+cache"):
        moe = mean(base["moe_s"]) / mean(runs[name]["moe_s"])
        step = mean(base["step_s"]) / mean(runs[name]["step_s"])
        assert res["ratios"][name]["moe"] == pytest.approx(moe) and res["ratios"][name]["step"] == pytest.approx(step)
        assert f"{name} vs no-drop: MoE layers {moe:.2f}x, step {step:.2f}x faster" in out
    assert "(paper: 1.4x)" in out and "(paper: 1.7x)" in out

    # Fig. 10: one entry per closed epoch; epoch 1 has nothing to compare with
    hist, cache = res["fig10"], runs["dynamic+cache"]["cache"]
    assert [h[0] for h in hist] == list(range(1, setup["epochs"]))
    assert hist[0][1] is None and all(0.0 <= h[1] <= 1.0 for h in hist[1:])
    if cache["on_epoch"] is None:
        assert "caching never turned on" in out and cache["cached_calls"] == 0 and not any(h[2] for h in hist)
    else:
        assert cache["on_epoch"] >= setup["cache_min_epoch"] and cache["cached_calls"] > 0
