"""Packaging: installing the plugin next to another torch release leaves that torch alone (torch is a lower bound,
not a pin), the version is one string, and the documented extras exist."""
import json
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
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


def _child_venv(path) -> str:
    """A fresh venv that sees this interpreter's installed packages after its own (a ``.pth`` in its site-packages
    lists them): ``system_site_packages`` would give the base interpreter's packages instead, which differ when the
    suite itself runs inside a venv. Returns its python."""
    venv.EnvBuilder(system_site_packages=False, with_pip=False).create(str(path))
    purelib = sysconfig.get_path("purelib", vars={"base": str(path), "platbase": str(path)})
    ours = [p for p in [*site.getsitepackages(), site.getusersitepackages(), sysconfig.get_path("purelib")]
            if os.path.isdir(p)]
    with open(os.path.join(purelib, "_parent_site.pth"), "w") as f:
        f.write("\n".join(dict.fromkeys(ours)) + "\n")
    return os.path.join(str(path), "bin", "python")


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
    py = _child_venv(tmp_path / "venv")
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


@pytest.mark.slow
def test_wheel_in_a_fresh_venv_traces_a_megatron_checkpoint(tmp_path):
    """The package stands alone: built as a wheel, installed in a fresh environment (torch and megatron-core from
    the system, no repository on the path, run from an empty folder), its Megatron trainer writes a checkpoint and
    `megamoe trace --trainer megatron` reads it."""
    pytest.importorskip("megatron.core")
    quiet = dict(capture_output=True, text=True, timeout=600)
    wheels, src = tmp_path / "wheels", tmp_path / "src"      # built from a copy: no build/ left in the checkout
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", "results",
                                                             "cluster_logs", "tests"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                        str(src)], **quiet)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (wheel,) = list(wheels.glob("megamoe_plugin-*.whl"))
    env_dir = tmp_path / "venv"
    py, bindir = _child_venv(env_dir), env_dir / "bin"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index",
                        str(wheel)], **quiet)
    assert r.returncode == 0, r.stderr[-2000:]
    work = tmp_path / "empty"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                                                            "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PATH=f"{bindir}:{env.get('PATH', '')}", OMP_NUM_THREADS="1")
    where = subprocess.run([py, "-c", "import megamoe_plugin; print(megamoe_plugin.__file__)"], cwd=work, env=env,
                           **quiet).stdout.strip()
    assert where.startswith(str(env_dir)), where                # the wheel's copy, not the repository
    model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--max-position-embeddings", "32", "--micro-batch-size", "4", "--corpus-bytes", "200000",
             "--num-experts", "4", "--moe-router-topk", "2", "--moe-plugin"]
    r = subprocess.run([py, "-m", "megamoe_plugin.megatron_adapter.trainer", *model, "--global-batch-size", "4",
                        "--lr", "3e-3", "--log-interval", "1", "--train-iters", "2", "--eval-iters", "1",
                        "--save", str(work / "ck"), "--data-cache-path", str(work / "cache")], cwd=work, env=env,
                       **quiet)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    r = subprocess.run([str(bindir / "megamoe"), "trace", "--checkpoint", str(work / "ck"), "--trainer", "megatron",
                        "--out", str(work / "trace"), "--batches", "2", "--batch-size", "4",
                        "--megatron-args", " ".join(model)], cwd=work, env=env, **quiet)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "held-out loss" in r.stdout and list(work.glob("trace.rank*"))
