"""`megamoe reproduce flexmoe --fast` end to end: files, parsed tables, and invariants that hold on any machine.

One fast run (module fixture) writes the five tables and three figures; the tests read them back with
``parse_markdown_table`` and check what must hold whatever the timings: the source labels, dropless token
efficiency exactly 100%, efficiencies in [0, 1], the capacity strategy's expert efficiency bounded by its token
efficiency (its padded buffers hold at least the routed tokens at capacity factor 1), the dropless training run
dropping nothing, the prediction errors recomputed from the measured and predicted rows, the scaling table's
normalisation recomputed from its own columns, and the paper's Table 2 numbers as printed in the paper.
"""
import math
import os

import pytest
import torch

from megamoe_plugin.reproduce import common, flexmoe
from reproduce_checks import SOURCE as SOURCE_RE

TABLES = {"fig5_time_to_quality", "fig6ab_policies", "fig6c_cost_model", "fig6c_error_summary", "table2_quality",
          "fig7a_efficiency", "fig7b_scaling"}
FIGURES = {"fig6ab_policies", "fig6c_cost_model", "fig7a_efficiency", "fig7b_scaling"}
# the measured results of `megamoe bench planners` on the emulated cluster, shipped with the docs
PLANNERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "data", "bench_planners_fixed_speed", "fig5")
# paper 001 Table 2, validation perplexity: (DeepSpeed, FlexMoE), copied from the paper's text
PAPER_PPL = {"BERT-MoE-S": (3.53, 3.14), "BERT-MoE-L": (3.31, 3.07), "GPT-MoE-S": (12.2, 11.72),
             "GPT-MoE-L": (10.71, 10.47)}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("flexmoe"))
    lines = []
    threads = torch.get_num_threads()
    res = flexmoe.run(out, fast=True, log=lines.append, cluster_results=PLANNERS)
    assert torch.get_num_threads() == threads          # the training runs' --threads does not leak
    return out, res, "\n".join(str(l) for l in lines)


def _table(result, name):
    out = result[0]
    with open(os.path.join(out, f"{name}.md")) as f:
        return common.parse_markdown_table(f.read())


def _num(cell):
    return float(cell.rstrip("%")) / (100.0 if cell.endswith("%") else 1.0)


def test_files_written_and_tables_printed(result):
    out, res, log = result
    assert {os.path.basename(p)[:-3] for p in res["tables"]} == TABLES
    assert {os.path.basename(p)[:-4] for p in res["figures"]} == FIGURES
    for p in res["tables"] + res["figures"]:
        assert os.path.dirname(p) == out and os.path.getsize(p) > 0
    for p in res["figures"]:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    for name in TABLES:                                  # every table printed, with its rows
        rows = _table(result, name)
        assert rows
        assert rows[0]["source"] in log


def test_every_row_has_a_valid_source_and_paper_rows_are_labelled(result):
    for name in TABLES:
        rows = _table(result, name)
        for r in rows:
            assert SOURCE_RE.match(r["source"]), (name, r)
        assert any(r["source"] == "paper" for r in rows), name          # the paper's number beside ours
        assert any(r["source"] != "paper" for r in rows), name


def test_fig7a_efficiencies(result):
    rows = [r for r in _table(result, "fig7a_efficiency") if r["source"] != "paper"]
    strategies = {r["strategy"] for r in rows}
    assert strategies == set(flexmoe.STRATEGIES)
    for r in rows:
        tok, eff, bal = float(r["token efficiency"]), float(r["expert efficiency"]), float(r["balance ratio"])
        assert 0.0 <= tok <= 1.0 and 0.0 < eff <= 1.0, r
        assert bal >= 1.0, r                                     # Eq. 6: max over ranks / mean >= 1
        if r["strategy"] in flexmoe.DROPLESS:
            assert tok == 1.0, r                                 # dropless: every token processed, exactly
        else:
            # capacity 1.0: processed <= routed <= padded slots, so expert efficiency <= token efficiency
            assert eff <= tok + 1e-4, r
    # a whole-run row and the phases for every strategy
    for s in flexmoe.STRATEGIES:
        phases = [r["training phase"] for r in rows if r["strategy"] == s]
        assert "all" in phases and len(phases) >= 2, phases
    # the capacity strategy drops tokens on a real (skewed) routing trace
    cap_all = next(r for r in rows if r["strategy"] == flexmoe.DEEPSPEED and r["training phase"] == "all")
    assert float(cap_all["token efficiency"]) < 1.0


def test_table2_drops_vs_dropless(result):
    rows = _table(result, "table2_quality")
    ours = [r for r in rows if r["source"] != "paper"]
    assert all(SOURCE_RE.match(r["source"]) and r["source"].startswith("measured here") for r in ours)
    dropless = [r for r in ours if r["training dispatch"] == "dropless"]
    capacity = [r for r in ours if r["training dispatch"] == "capacity 1.0"]
    assert dropless and capacity
    for r in dropless:
        assert float(r["train assignments dropped"]) == 0.0, r
        assert float(r["ppl / dropless ppl"]) == 1.0
    for r in capacity:
        assert 0.0 < float(r["train assignments dropped"]) < 1.0, r
    steps = {r["steps"] for r in ours}
    seeds = {r["seed"] for r in ours}
    assert len(steps) == 1 and len(seeds) == 1                   # same steps and seed for every run (fast mode)
    for r in ours:
        loss, ppl = float(r["valid loss"]), float(r["valid ppl"])
        assert 0 < loss < math.log(258) + 1                       # byte-level vocabulary: near or below uniform
        assert ppl == pytest.approx(math.exp(loss), rel=2e-4)
        d = next(x for x in dropless if x["seed"] == r["seed"])
        assert float(r["ppl / dropless ppl"]) == pytest.approx(ppl / float(d["valid ppl"]), rel=2e-4)
    paper = [r for r in rows if r["source"] == "paper"]
    for model, (ds, fx) in PAPER_PPL.items():
        got = {r["training dispatch"]: float(r["valid ppl"]) for r in paper if r["model"] == model}
        assert got == {"capacity 1.0 (DeepSpeed)": ds, "dropless (FlexMoE)": fx}, (model, got)


def test_fig6c_measured_and_predicted_rows_pair_up(result):
    rows = _table(result, "fig6c_cost_model")
    ours = [r for r in rows if r["source"] != "paper"]
    models = {r["source"] for r in ours if r["source"].startswith("predicted")}
    assert len(models) == 2                                 # calibrate()'s profile and the refit
    pairs = {}
    for r in ours:
        key = (r["operation"], r["input size"], r["points"])
        assert r["source"] not in pairs.setdefault(key, {}), key
        pairs[key][r["source"]] = r
    ops = {k[0] for k in pairs}
    assert ops == {"computation", "all-to-all", "all-reduce"}
    for op in ops:
        assert any(k[0] == op and k[2] == "held-out" for k in pairs), op     # out-of-sample points for each
    assert not any(k[0] == "all-reduce" and k[2] == "fit" for k in pairs)   # the calibration never fits it
    errors = {}
    for key, pair in pairs.items():
        meas = [r for s, r in pair.items() if s.startswith("measured here")]
        assert len(meas) == 1 and set(pair) - {meas[0]["source"]} == models, key
        m = float(meas[0]["time (ms)"])
        assert m > 0 and meas[0]["prediction error"] == "-"
        lo, hi = (float(x) for x in meas[0]["min-max over rounds (ms)"].split("-"))
        assert 0 < lo <= m * (1 + 1e-3) and m <= hi * (1 + 1e-3)          # the median lies within min-max
        for model in models:
            p = float(pair[model]["time (ms)"])
            assert p > 0
            err = _num(pair[model]["prediction error"])
            assert err == pytest.approx((p - m) / m, abs=2e-3 + 2e-3 * abs(p / m)), (key, model)
            errors.setdefault((model, key[0], key[2]), []).append(abs((p - m) / m))
    summary = [r for r in _table(result, "fig6c_error_summary") if r["source"] != "paper"]
    assert {(r["operation"], r["source"]) for r in summary} == {(op, m) for op in ops for m in models}
    assert len(summary) == len(ops) * len(models)
    for r in summary:
        held = errors[(r["source"], r["operation"], "held-out")]
        assert int(r["held-out sizes"]) == len(held)
        assert _num(r["mean abs. error (held-out)"]) == pytest.approx(sum(held) / len(held),
                                                                     abs=2e-3 + 2e-3 * max(held))


def test_fig7b_scaling(result):
    rows = [r for r in _table(result, "fig7b_scaling") if r["source"] != "paper"]
    for s in flexmoe.STRATEGIES:
        assert sorted(int(r["GPUs"]) for r in rows if r["strategy"] == s) == [8, 16, 32, 64], s
    base = next(r for r in rows if r["strategy"] == flexmoe.DEEPSPEED and r["GPUs"] == "8")
    assert float(base["input throughput (norm.)"]) == 1.0 and float(base["processed throughput (norm.)"]) == 1.0
    base_in, base_tok = float(base["input tokens/s"]), float(base["token efficiency"])
    for r in rows:
        W, ms = int(r["GPUs"]), float(r["predicted ms/step"])
        tps, tok, eff = float(r["input tokens/s"]), float(r["token efficiency"]), float(r["expert efficiency"])
        assert ms > 0 and 0 < tok <= 1 and 0 < eff <= 1
        assert tps == pytest.approx(W * 4096 / (ms / 1e3), rel=2e-3)             # weak scaling: 4096 tokens/GPU
        assert float(r["input throughput (norm.)"]) == pytest.approx(tps / base_in, rel=2e-3)
        assert float(r["processed throughput (norm.)"]) == pytest.approx(tps * tok / (base_in * base_tok), rel=3e-3)
        if r["strategy"] in flexmoe.DROPLESS:
            assert tok == 1.0, r
        else:
            assert tok < 1.0 and eff <= tok + 1e-4, r


def test_fig5_time_to_quality(result):
    rows = _table(result, "fig5_time_to_quality")
    paper = [r for r in rows if r["source"] == "paper"]
    assert [r["FlexMoE faster by"] for r in paper] == ["1.70x avg, up to 2.10x", "1.30x avg, up to 1.45x"]
    cluster = [r for r in rows if r["source"].startswith("measured, emulated cluster")]
    assert {r["system"] for r in cluster} == {"DeepSpeed (static EP, capacity)", "static EP, dropless",
                                              "FasterMoE (shadowing)", "FlexMoE", "EPLB (DeepSeek; measured only)"}
    assert all("fixed-speed ranks (0.45 core each)" in r["source"] for r in cluster)
    for routing in {r["routing"] for r in cluster}:
        mine = {r["system"]: r for r in cluster if r["routing"] == routing}
        flex = _num(mine["FlexMoE"]["time to target (s)"])
        assert _num(mine["FlexMoE"]["FlexMoE faster by"]) == 1.0
        for r in mine.values():
            assert _num(r["FlexMoE faster by"]) == pytest.approx(_num(r["time to target (s)"]) / flex, rel=2e-3)
            assert 0 < int(_num(r["iterations to target"])) <= 200
    pred = [r for r in rows if r["source"].startswith("predicted")]
    assert {r["routing"].split()[0] for r in pred} == {"8", "16", "32", "64"}
    for r in pred:      # iterations measured on the cluster x predicted step time
        assert _num(r["time to target (s)"]) == pytest.approx(
            _num(r["iterations to target"]) * _num(r["ms / iteration"]) / 1e3, rel=2e-3)


def test_fig6ab_policies(result):
    rows = _table(result, "fig6ab_policies")
    pred = {r["policy"]: r for r in rows if r["source"].startswith("predicted")}
    static = pred["static EP (no adjustment)"]
    assert int(_num(static["moves"])) == 0 and _num(static["speedup vs static"]) == 1.0
    ours = next(r for k, r in pred.items() if "(ours)" in k)
    assert _num(ours["Max (ours) faster by"]) == 1.0
    for r in pred.values():
        assert _num(r["Max (ours) faster by"]) == pytest.approx(
            _num(r["predicted ms / step"]) / _num(ours["predicted ms / step"]), rel=2e-3)
        assert _num(r["mean balance ratio"]) >= 1.0
    assert any(int(_num(r["moves"])) > 0 for r in pred.values())
    paper = {r["panel"] for r in rows if r["source"] == "paper"}
    assert paper == {"6(a)", "6(b)"}


def test_triggered_planner_policies():
    from megamoe_plugin.reproduce.flexmoe_time import TriggeredPlanner

    class Recorder:
        threshold = 1.2
        last = {}

        def __init__(self):
            self.seen = []

        def plan(self, state, counts):
            self.seen.append(self.threshold)
            return ["move"]

    class State:
        def __init__(self, loads):
            self.loads = torch.tensor(loads, dtype=torch.float64)

        def rank_loads(self, counts):
            return self.loads

    rec = Recorder()
    every3 = TriggeredPlanner(rec, "interval", interval=3)
    s = State([1, 1])
    assert [bool(every3.plan(s, None)) for _ in range(7)] == [True, False, False, True, False, False, True]
    assert rec.seen == [1.0, 1.0, 1.0] and rec.threshold == 1.2      # plans to completion, threshold restored
    var = TriggeredPlanner(Recorder(), "variance", var_threshold=0.04)
    assert var.plan(State([1.0, 1.0, 1.0, 1.0]), None) == []           # CV^2 = 0
    assert var.plan(State([1.5, 0.5, 1.0, 1.0]), None) == ["move"]     # CV^2 = 0.125
    assert var.plan(State([1.2, 0.8, 1.0, 1.0]), None) == []           # CV^2 = 0.02
    with pytest.raises(ValueError, match="trigger"):
        TriggeredPlanner(rec, "sometimes")


def test_cluster_rows_say_how_the_ranks_ran():
    from megamoe_plugin.reproduce.flexmoe import shaping_label
    assert shaping_label({}) == "measured, emulated cluster: 2 nodes x 2, ranks sharing the cores, inter-node 100 MB/s"
    assert shaping_label({"cpu_shares": [0.45] * 4, "inter_node_bandwidth": 25e6, "tokens_per_rank": 2048}) == (
        "measured, emulated cluster: 2 nodes x 2, fixed-speed ranks (0.45 core each), inter-node 25 MB/s, "
        "2,048 tokens per rank")
    assert "ranks sharing the cores" in shaping_label({"cpu_shares": None, "inter_node_bandwidth": 1e8})
