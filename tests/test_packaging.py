"""Packaging: installing the plugin next to another torch release leaves that torch alone (torch is a lower bound,
not a pin), the version is one string, and the documented extras exist."""
import json
import os
import re
import subprocess
import sys
import tomllib
import venv

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_torch_is_a_lower_bound_and_the_extras_exist():
    project = _pyproject()["project"]
    torch_req = [r for r in project["dependencies"] if re.match(r"torch\b", r)]
    assert torch_req and all("==" not in r and ">=" in r for r in torch_req), torch_req
    assert {"megatron", "megatron-lm", "fairseq", "dev", "plots"} <= set(project["optional-dependencies"])
    assert "six" in project["optional-dependencies"]["megatron-lm"]
    assert "pydantic" in project["optional-dependencies"]["megatron-lm"]


def test_version_and_changelog_agree():
    import megamoe_plugin
    with open(os.path.join(ROOT, "CHANGELOG.md")) as f:
        changelog = f.read()
    assert f"## {megamoe_plugin.__version__}" in changelog
    assert megamoe_plugin.__version__ != "0.1.0" and "## 0.1.0" in changelog


def _fake_wheel(tmp, name, version):
    """A do-nothing distribution `name==version` (stands in for another torch release: no second real torch
    build exists on this machine)."""
    src = os.path.join(tmp, f"src_{name}")
    os.makedirs(os.path.join(src, name))
    with open(os.path.join(src, name, "__init__.py"), "w") as f:
        f.write(f"__version__ = {version!r}\n")
    with open(os.path.join(src, "pyproject.toml"), "w") as f:
        f.write(f'[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
                f'[project]\nname = "{name}"\nversion = "{version}"\n[tool.setuptools]\npackages = ["{name}"]\n')
    return src


def test_install_next_to_another_torch_leaves_it_alone(tmp_path):
    env = str(tmp_path / "venv")
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env)
    py = os.path.join(env, "bin", "python")
    pip = [sys.executable, "-m", "pip", "--python", py] if _pip_has_python_flag() else [py, "-m", "pip"]
    quiet = dict(capture_output=True, text=True, timeout=300)
    fake = _fake_wheel(str(tmp_path), "torch", "2.7.0")
    r = subprocess.run(pip + ["install", "--no-index", "--no-build-isolation", "--no-deps", fake], **quiet)
    assert r.returncode == 0, r.stderr
    version = lambda: subprocess.run([py, "-c", "import importlib.metadata as m; print(m.version('torch'))"],
                                     **quiet).stdout.strip()
    assert version() == "2.7.0"            # the venv's own torch shadows the system one
    report = str(tmp_path / "report.json")
    r = subprocess.run(pip + ["install", "--no-index", "--no-build-isolation", "--dry-run", "--report", report,
                              ROOT], **quiet)
    assert r.returncode == 0, r.stdout + r.stderr          # resolvable offline: nothing to fetch, torch included
    with open(report) as f:
        installs = [i["metadata"]["name"] for i in json.load(f)["install"]]
    assert installs == ["megamoe-plugin"], installs
    assert version() == "2.7.0"


def _pip_has_python_flag() -> bool:
    out = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True).stdout
    m = re.search(r"pip (\d+)\.(\d+)", out)
    return bool(m) and (int(m.group(1)), int(m.group(2))) >= (22, 3)


@pytest.mark.parametrize("name", ["setup.py", "pyproject.toml", "README.md", "CHANGELOG.md"])
def test_top_level_files(name):
    assert os.path.isfile(os.path.join(ROOT, name))
