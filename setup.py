"""Packaging of megamoe-plugin.

    pip install -e .                     # the core (pure PyTorch + torch.distributed) and the `megamoe` command
    pip install -e ".[megatron]"         # + Megatron-Core adapter
    pip install -e ".[megatron-lm]"      # + what a Megatron-LM checkout's pretrain_gpt.py imports (six, pydantic, ...)
    pip install -e ".[dev]"              # + tests, Megatron-Core, plotting

fairseq: the adapter targets fairseq-fixed==0.12.3.1, whose published metadata pins dependencies that do not
resolve next to torch 2.13 and whose build needs torch importable. Install it by hand, without its dependencies
and without build isolation, then install its runtime dependencies (FAIRSEQ_RUNTIME_DEPS below, also the
"fairseq" extra):

    pip install -e ".[fairseq]"
    pip install --no-deps --no-build-isolation fairseq-fixed==0.12.3.1
"""
import os
import re

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def read_version() -> str:
    """``__version__`` of megamoe_plugin/__init__.py, read as text (importing the package would need torch)."""
    with open(os.path.join(HERE, "megamoe_plugin", "__init__.py"), encoding="utf-8") as f:
        match = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', f.read(), re.M)
    if not match:
        raise RuntimeError("megamoe_plugin/__init__.py defines no __version__")
    return match.group(1)


def read_readme() -> str:
    path = os.path.join(HERE, "README.md")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    return ""


MEGATRON = ["megatron-core==0.16.1", "psutil"]   # psutil: megatron-core's dist_checkpointing writer needs it
# What Megatron-LM's training code (megatron/training, pretrain_gpt.py) imports beyond megatron-core's own needs
# (found by running tests/test_megatron_lm.py in a fresh virtual environment)
MEGATRON_LM = ["six", "regex", "pyyaml", "pydantic"]
# Runtime dependencies of fairseq-fixed==0.12.3.1, which itself must be installed with
# `pip install --no-deps --no-build-isolation fairseq-fixed==0.12.3.1` (see the module docstring).
FAIRSEQ_RUNTIME_DEPS = ["hydra-core==1.3.2", "omegaconf==2.3.0", "bitarray", "sacrebleu>=1.4.12", "regex", "tqdm",
                        "cffi", "scikit-learn", "cython"]

setup(
    name="megamoe-plugin",
    version=read_version(),
    description="MoE research systems (FasterMoE, TA-MoE, FlexMoE, DynaMoE, Meta's MoE deployment) for Megatron "
                "and fairseq",
    long_description=read_readme(),
    long_description_content_type="text/markdown",
    packages=find_packages(exclude=["tests", "tests.*"]),
    package_data={"megamoe_plugin": ["data/traces/*"]},     # routing traces for `megamoe reproduce`
    python_requires=">=3.10",
    install_requires=["torch==2.13.0", "numpy"],
    extras_require={
        "megatron": MEGATRON,
        "megatron-lm": MEGATRON + MEGATRON_LM,
        "fairseq": FAIRSEQ_RUNTIME_DEPS,
        "dev": ["pytest", "matplotlib"] + MEGATRON,
    },
    entry_points={"console_scripts": ["megamoe=megamoe_plugin.cli:main"]},
)
