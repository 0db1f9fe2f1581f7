"""Calibration of the cost model on this machine: a real 2-process gloo group measures GEMM throughput, all-to-all
and point-to-point links, fits a HardwareProfile, then predicts real MoELayer forward+backward steps.

The accuracy numbers themselves depend on the machine (BENCHMARKS.md reports those of this project's machines); the test checks
they are computed from real measurements, finite, and that the predictions order layer configurations whose work
differs by 2x or more the same way the measurements do.
"""
import json
import math

import pytest

from megamoe_plugin.perfmodel.calibrate import accuracy, run_calibration
from megamoe_plugin.perfmodel.profiles import HardwareProfile

pytestmark = pytest.mark.serial         # the calibration orders configurations by measured time


def test_accuracy_metrics_by_hand():
    r2, mre, conc = accuracy([1.0, 2.0, 3.0], [1.0, 2.0, 4.0])
    # mean 2, ss_tot = 2, ss_res = 1 -> R^2 = 0.5; relative errors 0, 0, 1/3; every pair ordered alike
    assert r2 == pytest.approx(0.5) and mre == pytest.approx(1 / 9) and conc == 1.0
    _, _, conc = accuracy([1.0, 2.0, 3.0], [3.0, 2.0, 1.0])
    assert conc == 0.0


def test_calibration_on_two_gloo_processes(tmp_path):
    out = tmp_path / "local.json"
    res = run_calibration(nproc=2, out=str(out), quick=True)
    prof = HardwareProfile.load(str(out))
    assert prof.gemm_tflops > 0 and math.isfinite(prof.gemm_tflops)
    assert prof.intra_bandwidth_gbps > 0 and math.isfinite(prof.intra_bandwidth_gbps)
    assert prof.nodes * prof.gpus_per_node == 2
    cases = res["cases"]
    assert len(cases) == 4
    for c in cases:
        assert c["measured"] > 0 and c["predicted"] > 0
        b = c["breakdown"]
        assert b["compute"] > 0 and b["alltoall"] > 0
    for key in ("r2", "mean_rel_error", "concordance"):
        assert math.isfinite(res[key]), res["report"]
    # the quick configurations differ in expert work by >= 2x: the model must order them as measured
    assert res["concordance"] == 1.0, res["report"]
    assert "R^2" in res["report"]
    json.dumps(res)
