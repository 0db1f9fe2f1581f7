"""The package's process launcher (megamoe_plugin/launch.py) with forked children: what the parent owns survives
them."""
import os
import tempfile

import torch.distributed as dist


def _write_in_parents_dir(rank, world, path):
    if rank == 0:
        with open(path, "w") as f:
            f.write("from rank 0")


def test_forked_children_leave_the_parents_temporary_directory():
    """Rank 0 writes into a TemporaryDirectory the parent made; the file is still there after the join (the
    children's exit handlers must not run the parent's cleanup, as `megamoe reproduce` reads such files)."""
    from megamoe_plugin.launch import run_processes
    assert not (dist.is_available() and dist.is_initialized())
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.txt")
        run_processes(_write_in_parents_dir, 2, path, start_method="fork")
        assert os.path.isdir(tmp)
        with open(path) as f:
            assert f.read() == "from rank 0"
