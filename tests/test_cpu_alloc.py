"""The CPU allocator setting (cpu_alloc.py): glibc is told to keep freed large blocks, unless the environment says
``MEGAMOE_CPU_MALLOC=default``; each case in a fresh process (the setting is process-wide)."""
import os
import subprocess
import sys

import pytest

CODE = "from megamoe_plugin.cpu_alloc import retain_freed_memory as r; print(r(), r())"


def _run(**env):
    return subprocess.run([sys.executable, "-c", CODE], env=dict(os.environ, **env), capture_output=True, text=True,
                          timeout=60).stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_retain_freed_memory_and_its_opt_out():
    assert _run(MEGAMOE_CPU_MALLOC="") == ["True", "True"]           # set once, idempotent
    assert _run(MEGAMOE_CPU_MALLOC="default") == ["False", "False"]   # left alone
