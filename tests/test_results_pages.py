"""The results pages say what the shipped data says: every generated block of BENCHMARKS.md, README.md,
docs/results.md and the data and history indexes equals what `megamoe results` writes from docs/data, a changed
number in the data makes the check fail, and the pages stay short, current and free of development labels."""
import json
import os
import re
import shutil

import pytest

from megamoe_plugin.results import main as results_main
from megamoe_plugin.results.mdtable import number, read_tables, span
from megamoe_plugin.results.pages import apply
from megamoe_plugin.results.sections_cluster import (_pairs_table, dynamic_vs_static, never_lose, over_static,
                                                     pairs_over_static)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", "BENCHMARKS.md", "docs/results.md", "docs/data/README.md", "docs/history/README.md"]


def _copy(tmp_path):
    for page in ("README.md", "BENCHMARKS.md"):
        shutil.copy(os.path.join(ROOT, page), tmp_path / page)
    shutil.copytree(os.path.join(ROOT, "docs"), tmp_path / "docs")
    return str(tmp_path)


def test_the_pages_are_what_the_shipped_data_gives():
    assert results_main(["--check", "--root", ROOT]) == 0


def test_a_changed_number_in_the_data_fails_the_check(tmp_path):
    root = _copy(tmp_path)
    assert apply(root, write=False) == []
    path = os.path.join(root, "docs", "data", "bench_gates_bias", "2x2", "results.json")
    with open(path) as f:
        res = json.load(f)
    row = next(r for r in res["summary"] if r["config"] == "ta_moe_bias")
    row["speedup_vs_alf"] = 0.5
    with open(path, "w") as f:
        json.dump(res, f)
    differ = apply(root, write=False)
    assert "BENCHMARKS.md: headline" in differ and "README.md: headline" in differ
    assert "docs/results.md: summary" in differ and "BENCHMARKS.md: section gates" in differ
    apply(root, write=True)                                  # regenerating puts the new number on the pages
    assert "0.50x (2 x 2)" in open(os.path.join(root, "BENCHMARKS.md")).read()
    assert apply(root, write=False) == []


def test_every_data_file_is_indexed(tmp_path):
    root = _copy(tmp_path)
    with open(os.path.join(root, "docs", "data", "stray.json"), "w") as f:
        f.write("{}")
    with pytest.raises(RuntimeError, match="stray.json"):
        apply(root, write=False)


def test_benchmarks_page_is_current_and_short():
    page = open(os.path.join(ROOT, "BENCHMARKS.md"), encoding="utf-8").read()
    assert len(page.encode()) <= 30 * 1024
    for bench in ("layer", "megatron", "schedule", "placement", "dynamic", "inference", "cluster", "gates",
                  "planners", "capacity"):
        assert f"`megamoe bench {bench}`" in page, bench
    headline = page[page.index("## Headline"):page.index("<a id=")]
    assert len(read_tables(headline)[0]) >= 10


LABELS = re.compile(r"\b(issue(?:'s)? ?\d*|this session|previous session|this round|previous round|last round|"
                    r"latest run|previous run)\b", re.I)


@pytest.mark.parametrize("page", PAGES + ["docs/benchmarks.md"])
def test_no_page_speaks_of_issues_sessions_or_rounds(page):
    text = open(os.path.join(ROOT, page), encoding="utf-8").read()
    # "issues" as in the GitHub sense of a bug report stays allowed in the README; development labels do not
    found = [m.group() for m in LABELS.finditer(text) if not (page == "README.md" and m.group().lower() == "issue")]
    assert not found, found


def test_the_contradictions_once_found_are_gone():
    results = open(os.path.join(ROOT, "docs", "results.md"), encoding="utf-8").read()
    bench = open(os.path.join(ROOT, "BENCHMARKS.md"), encoding="utf-8").read()
    assert "1.11-1.74x" not in results
    assert "lent for one session" not in bench
    assert not any("latest" in name for _d, _s, names in os.walk(os.path.join(ROOT, "docs", "data")) for name in names)
    assert "H100" in results                                # the GPU results are in the summary


def test_table_reading_and_the_comparisons_by_hand():
    tables = read_tables("text\n\n| a | b |\n|---|---:|\n| x | 1,234.5 ms |\n| y | - |\n\nmore\n")
    assert tables == [[{"a": "x", "b": "1,234.5 ms"}, {"a": "y", "b": "-"}]]
    assert number("1,234.5 ms") == 1234.5 and number("-") is None
    assert span([1.2, None, 0.9]) == "0.90-1.20x" and span([1.0]) == "1.00x"
    # static's time to target over each run's, per round
    rows = [{"run": "static", "time_to_target_rounds": [100.0, 120.0]},
            {"run": "flexmoe", "time_to_target_rounds": [80.0, 150.0]}]
    assert over_static(rows)["flexmoe"] == [pytest.approx(1.25), pytest.approx(0.8)]
    # the 512-token floor: met only where the run that changes nothing (idle) stays within the floor's 3% of 1.00x
    assert never_lose({"static": [1.0, 1.0], "shadow": [0.98, 1.01], "idle": [0.99, 1.02]}) == (
        "0.98-1.02x (runs x rounds)", True)
    assert never_lose({"static": [1.0, 1.0], "shadow": [0.96, 1.01], "idle": [0.99, 1.02]})[1] is False
    text, met = never_lose({"static": [1.0, 1.0], "shadow": [0.98, 1.05], "idle": [1.16, 1.20]})
    assert met is False and text.endswith("not resolved: `idle`, which changes nothing, measured 1.16-1.20x")
    assert never_lose({"static": [1.0, 1.0], "eplb": [0.98, 0.99]})[1] is True     # no idle run: the floor alone
    # side by side: each pair's own static over the run, the floor read the same way
    pairs = {"flexmoe": {"pairs": [{"static_train_s": 300.0, "run_train_s": 312.5, "static_time_to_target_s": 250.0,
                                    "run_time_to_target_s": 200.0},
                                   {"static_train_s": 290.0, "run_train_s": 290.0, "static_time_to_target_s": 1.0,
                                    "run_time_to_target_s": 1.0}]},
             "idle": {"pairs": [{"static_train_s": 100.0, "run_train_s": 101.0, "static_time_to_target_s": 90.0,
                                 "run_time_to_target_s": 90.0}]}}
    over = pairs_over_static(pairs)                      # the floor's measure: training time for the same steps
    assert over == {"flexmoe": [pytest.approx(0.96), pytest.approx(1.0)], "idle": [pytest.approx(100 / 101)]}
    assert pairs_over_static(pairs, "time_to_target")["flexmoe"] == [pytest.approx(1.25), pytest.approx(1.0)]
    assert never_lose(over, "pairs") == ("0.96-1.00x (runs x pairs)", False)
    # two static runs side by side (an A/A pair) are a row of their own, named so, and not a run of the floor
    aa = {"static": {"pairs": [{"static_train_s": 102.6, "run_train_s": 100.0, "static_time_to_target_s": 90.0,
                                "run_time_to_target_s": 90.0, "static_step_ms": 2466.0, "run_step_ms": 2313.0,
                                "late_over_static": 1.07, "moves": 0}]}}
    row = next(line for line in _pairs_table(aa).splitlines() if "static beside static" in line)
    assert "1.026x" in row and "2466 / 2313" in row
    assert never_lose({**pairs_over_static(aa), "eplb": [0.98]}, "pairs") == ("0.98x (runs x pairs)", True)
    # static at the dynamic policy's drop rate (7%): between CF=4 (1%, 0.60 s) and CF=2 (13%, 0.48 s) -> 0.54 s
    summary = {"CF=1.0": {"dropped": [0.30], "step_seconds": [0.40]},
               "CF=2.0": {"dropped": [0.13], "step_seconds": [0.48]},
               "CF=4.0": {"dropped": [0.01], "step_seconds": [0.60]},
               "dynamic q=0.9": {"dropped": [0.07], "step_seconds": [0.60]}}
    name, r = dynamic_vs_static(summary)
    assert name == "CF=4.0 and CF=2.0" and r == pytest.approx(0.54 / 0.60)
    summary["dynamic q=0.9"]["dropped"] = [0.0]            # fewer drops than any static factor: the nearest one
    assert dynamic_vs_static(summary) == ("CF=4.0", pytest.approx(1.0))
