"""``megamoe doctor`` against the installed megatron-core: every check passes here (the layer is built from
Megatron's own spec, run forward and backward and compared with the core layer), and a broken setup is reported
as a failed check with exit status 1."""
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _doctor(*args, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "megamoe_plugin.cli", "doctor", *args], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=300)


def test_doctor_passes_against_the_installed_megatron(tmp_path):
    r = _doctor(tmp_path=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    lines = [line.strip() for line in r.stdout.splitlines()]
    for label in ("installed:", "mlp spec style:", "grad-norm collector:",
                  "plugin MoE layer from Megatron's GPT layer spec, forward and backward:",
                  "the plugin spec inside a TransformerLayer:"):
        assert any(line.startswith(f"ok    {label}") for line in lines), r.stdout
    diff = float(re.search(r"max \|diff\| (\S+)\)", r.stdout).group(1))
    assert diff <= 1e-5, r.stdout
    assert "FAIL" not in r.stdout and lines[-1] == "all checks passed", r.stdout


def test_doctor_reports_a_bad_checkout(tmp_path):
    empty = tmp_path / "not-megatron-lm"
    empty.mkdir()
    r = _doctor("--megatron-lm", str(empty), tmp_path=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr[-3000:]
    assert f"FAIL  Megatron-LM checkout {empty}: FileNotFoundError: no pretrain_gpt.py in {empty}" in r.stdout
    assert "1 check(s) failed" in r.stdout
