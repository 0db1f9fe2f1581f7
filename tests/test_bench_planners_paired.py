"""``bench planners --paired``: two jobs run at once, and each run's ratio is over the static that ran beside it."""
import os
import time

import pytest

from megamoe_plugin.bench import planners, planners_paired
from megamoe_plugin.results.sections_cluster import over_static


def test_two_jobs_run_at_the_same_time_and_a_failed_one_raises(tmp_path, monkeypatch):
    monkeypatch.setattr(planners_paired, "START_GAP_S", 0.05)

    def job(name):
        def run():
            start = time.time()
            time.sleep(0.5)
            return {"run": name, "start": start, "end": time.time(), "pid": os.getpid()}
        return run
    a, b = planners_paired.run_side_by_side(job("static"), job("flexmoe"), str(tmp_path / "pair"))
    assert (a["run"], b["run"]) == ("static", "flexmoe")
    assert a["pid"] != b["pid"] != os.getpid()                     # each in its own process
    assert b["start"] < a["end"] and a["start"] < b["end"]          # at the same time

    def fails():
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match=r"side \[1\] failed"):
        planners_paired.run_side_by_side(job("static"), fails, str(tmp_path / "bad"))


def _round(run, step, ttt):
    return {"run": run, "step_seconds": step, "mean_step_seconds": step, "late_step_seconds": step,
            "time_to_target": ttt}


def test_a_paired_runs_ratio_is_over_the_static_beside_it_round_by_round():
    # round 1: the machine is slow for both (static 1.2 s beside flexmoe 1.0 s); round 2: fast for both
    static_copies = [[_round("static", 1.2, 120.0), _round("static", 0.9, 90.0), _round("static", 1.0, 100.0)],
                     [_round("static", 0.6, 60.0)]]
    assert planners_paired.median_static(static_copies[0])["time_to_target"] == 100.0
    flex = [planners_paired.pair_rows(static_copies[0][0], _round("flexmoe", 1.0, 100.0)),
            planners_paired.pair_rows(static_copies[1][0], _round("flexmoe", 0.5, 50.0))]
    static = [planners_paired.median_static(c) for c in static_copies]
    rows = [planners._summarise(static), planners._summarise(flex)]
    assert "static_beside_rounds" not in rows[0]
    assert [b["time_to_target"] for b in rows[1]["static_beside_rounds"]] == [120.0, 60.0]
    assert over_static(rows)["flexmoe"] == [pytest.approx(1.2), pytest.approx(1.2)]
    planners._predicted_vs_measured(rows)
    assert rows[1]["measured_speedup"] == pytest.approx(1.2)     # not static's median 0.8 s over flexmoe's 0.75 s
    assert rows[1]["late_speedup"] == pytest.approx(1.2)


def test_paired_needs_static_among_the_runs_and_is_not_for_the_balanced_model():
    with pytest.raises(SystemExit, match="--paired: --runs must include static"):
        planners.main(["--paired", "--runs", "flexmoe,shadow", "--steps", "1"])
    with pytest.raises(SystemExit, match="--balanced is not paired"):
        planners.main(["--paired", "--balanced", "--runs", "static,flexmoe", "--steps", "1"])
