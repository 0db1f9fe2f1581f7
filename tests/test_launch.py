"""The package's process launcher (megamoe_plugin/launch.py) with forked children: what the parent owns survives
them."""
import os
import subprocess
import sys
import textwrap

# Runs in a fresh interpreter: the bug shows only when the parent has no process group before the fork, and
# earlier tests in this pytest process may have initialised one.
_SCRIPT = textwrap.dedent("""
    import os, sys, tempfile
    import torch.distributed as dist
    from megamoe_plugin.launch import run_processes

    def write_in_parents_dir(rank, world, path):
        if rank == 0:
            with open(path, "w") as f:
                f.write("from rank 0")

    if __name__ == "__main__":
        assert not dist.is_initialized()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "result.txt")
            run_processes(write_in_parents_dir, 2, path, start_method="fork")
            assert os.path.isdir(tmp), "the parent's temporary directory was removed by a child"
            with open(path) as f:
                assert f.read() == "from rank 0"
        print("OK")
""")


def test_forked_children_leave_the_parents_temporary_directory(tmp_path):
    """Rank 0 writes into a TemporaryDirectory the parent made; the file is still there after the join (the
    children's exit handlers must not run the parent's cleanup, as `megamoe reproduce` reads such files)."""
    script = tmp_path / "fork_children.py"
    script.write_text(_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("OK")
