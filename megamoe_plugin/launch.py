"""One launcher for the multi-process runs of this package (calibration, benchmarks, reproduce) and its tests:
``run_processes(fn, world, *args)`` runs ``fn(rank, world, *args)`` in ``world`` local processes joined in a gloo
process group (file rendezvous: no port to collide with), then tears the group down. A failing rank fails the
call. Children are forked where the OS allows it (they inherit the imported modules: no re-imports per run),
unless this process already has a default process group (a fork could not start its own), else spawned (``fn``
must then be a module-level function). Under torchrun or on a cluster, call the worker on every rank instead."""
from __future__ import annotations

import atexit
import multiprocessing
import os
import sys
import tempfile
import time
from typing import Optional

import torch
import torch.distributed as dist


def _forget_inherited_finalizers() -> None:
    """A forked child inherits the parent's weakref finalizers, a ``tempfile.TemporaryDirectory``'s cleanup among
    them. Its exit handlers (run below) must not run them: the child would delete the parent's temporary
    directories, files the parent reads after the join included."""
    import weakref
    for f in list(getattr(weakref.finalize, "_registry", {})):
        f.atexit = False


def _entry(rank: int, world: int, init_file: str, threads: int, fn, args, forked: bool = False) -> None:
    if forked:
        _forget_inherited_finalizers()
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    os.environ.pop("LOCAL_WORLD_SIZE", None)          # one node of `world` ranks (Topology.from_env)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()          # no rank tears its gloo pairs down while another still talks over them
    finally:
        dist.destroy_process_group()
    # Done: leave without the interpreter's teardown. Under load, a spawned child's C++ static destructors can find
    # one of gloo's threads still joinable and abort ("terminate called without an active exception", SIGABRT)
    # after the work has succeeded; the exit handlers (trace flushes) still run, and stdout / stderr are flushed.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_processes(fn, world: int, *args, threads: Optional[int] = None, label: Optional[str] = None,
                  start_method: Optional[str] = None) -> None:
    """``threads``: intra-op threads per process (default 1). ``label``: print a start and a done line with the
    elapsed time on stderr (long phases of a command are then never silent)."""
    import torch.multiprocessing as mp
    inherited = dist.is_available() and dist.is_initialized()
    method = start_method or ("fork" if "fork" in multiprocessing.get_all_start_methods() and not inherited
                              else "spawn")
    t0 = time.perf_counter()
    quiet = os.environ.get("MEGAMOE_QUIET", "") not in ("", "0")
    if label and not quiet:
        print(f"[{label}] starting {world} processes ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_entry, args=(world, os.path.join(d, "init"), int(threads or 1), fn, args,
                                         method == "fork"), nprocs=world, join=True, start_method=method)
    if label and not quiet:
        print(f"[{label}] done in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
