"""Fixed-speed ranks: each rank of the emulated cluster in its own CPU cgroup, capped by a CFS quota.

On one machine the ranks share its cores, so a rank with more work borrows the cores its idle peers leave while they
wait: imbalance costs little, and balancing it wins little. A GPU does not speed up when its peers idle. Capping
each rank's CPU share (``quota / period``) makes every rank a device of fixed speed; one rank's smaller share
emulates a slower device. The period is short (10 ms), so throttling is smooth at the scale of a layer's step.

Layout (names start with ``mmoe`` + the cluster's run id, like its namespaces, so nothing else is touched)::

    <cpu controller root>/mmoe<id>/r<rank>    cgroup v1: cpu.cfs_period_us + cpu.cfs_quota_us
                                              cgroup v2: cpu.max = "<quota> <period>"

Whichever the machine has: the v1 ``cpu`` controller (``/sys/fs/cgroup/cpu`` or ``cpu,cpuacct``), or cgroup v2 with
the ``cpu`` controller available at its root. A rank joins its cgroup in the child before ``exec`` (before ``ip
netns exec``, which remounts /sys inside the namespace); its children inherit it. What is modelled: a rank's
compute rate. What is not: memory bandwidth and caches stay shared, and the quota is CPU time, so a rank blocked in
a collective spends none of it (as a GPU waiting on NCCL spends none of its FLOPs).
"""
from __future__ import annotations

import os
import time
from typing import List, Optional, Sequence

from .resource import CreatedResource

PREFIX = "mmoe"
PERIOD_US = 10_000
_V1_ROOTS = ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct")
_V2_ROOTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")


def controller_root() -> Optional[tuple]:
    """``("v1" | "v2", path)`` of a writable CPU controller, or None."""
    for root in _V1_ROOTS:
        if os.path.isfile(os.path.join(root, "cpu.cfs_quota_us")):
            return "v1", root
    for root in _V2_ROOTS:
        try:
            with open(os.path.join(root, "cgroup.controllers")) as f:
                if "cpu" in f.read().split():
                    return "v2", root
        except OSError:
            continue
    return None


def unavailable() -> Optional[str]:
    """None when per-rank CPU caps work here; else why not (one sentence)."""
    if os.name != "posix":
        return "per-rank CPU caps need Linux cgroups"
    found = controller_root()
    if found is None:
        return ("per-rank CPU caps need the cgroup 'cpu' controller (v1 at /sys/fs/cgroup/cpu, or v2 with 'cpu' in "
                "cgroup.controllers); none is mounted here")
    if os.geteuid() != 0 or not os.access(found[1], os.W_OK):
        return f"per-rank CPU caps need root (writing {found[1]})"
    return None


def parse_shares(text: str, world: int, cores: Optional[int] = None) -> Optional[List[float]]:
    """``--cpu-share``: "off" -> None; "auto" -> 0.9 x cores / world for every rank (at most 1 core each); one number
    -> that share (in cores) for every rank; ``world`` comma-separated numbers -> one per rank."""
    t = str(text).strip().lower()
    if t in ("off", "none", "0"):
        return None
    cores = cores or os.cpu_count() or 1
    if t == "auto":
        return [round(min(1.0, 0.9 * cores / world), 3)] * world
    try:
        values = [float(v) for v in t.split(",")]
    except ValueError:
        raise ValueError(f"--cpu-share {text!r}: 'auto', 'off', a share in cores (e.g. 0.45), or one per rank "
                         "separated by commas") from None
    if len(values) == 1:
        values = values * world
    if len(values) != world:
        raise ValueError(f"--cpu-share {text!r}: {len(values)} values for {world} ranks (give one, or one per rank)")
    bad = [v for v in values if not 0.01 <= v <= cores]
    if bad:
        raise ValueError(f"--cpu-share {text!r}: each share must be between 0.01 and {cores} cores (got {bad[0]:g})")
    if sum(values) > cores * 1.0001:
        raise ValueError(f"--cpu-share {text!r}: the shares add up to {sum(values):g} cores but this machine has "
                         f"{cores}: the ranks would not run at their fixed speeds")
    return values


def bench_shares(text: str, world: int, prog: str) -> Optional[List[float]]:
    """A benchmark's ``--cpu-share``: the shares per rank (None: uncapped), or SystemExit naming the flag when the
    value is bad or caps are unavailable here."""
    try:
        shares = parse_shares(text, world)
    except ValueError as e:
        raise SystemExit(f"{prog}: {e}") from None
    why = unavailable() if shares else None
    if why:
        raise SystemExit(f"{prog}: --cpu-share {text}: {why} (--cpu-share off runs the ranks uncapped)")
    return shares


def describe(shares: Optional[Sequence[float]]) -> str:
    """The benchmarks' one-line description of the ranks' speed."""
    if not shares:
        return "ranks uncapped (sharing the machine's cores)"
    if len(set(shares)) == 1:
        return f"fixed-speed ranks: each capped at {shares[0]:g} core"
    return "fixed-speed ranks: capped at " + ",".join(f"{s:g}" for s in shares) + " cores"


def source_label(shares: Optional[Sequence[float]]) -> str:
    """The ranks' speed as the reproduce tables' source column names it."""
    if not shares:
        return "ranks sharing the cores"
    if len(set(shares)) == 1:
        return f"fixed-speed ranks ({shares[0]:g} core each)"
    return "fixed-speed ranks (" + ", ".join(f"{s:g}" for s in shares) + " cores)"


class CpuCaps(CreatedResource):
    """One cgroup per rank with a CFS quota of ``shares[rank]`` cores (a context manager; removes everything it
    made: ``destroy`` removes the run's whole cgroup tree)."""

    def __init__(self, run_id: str, shares: Sequence[float], period_us: int = PERIOD_US):
        found = controller_root()
        if found is None:
            raise RuntimeError(unavailable() or "no cgroup cpu controller")
        self.kind, self.root = found
        self.shares = [float(s) for s in shares]
        self.period_us = int(period_us)
        self.base = os.path.join(self.root, f"{PREFIX}{run_id}")

    def path(self, rank: int) -> str:
        return os.path.join(self.base, f"r{rank}")

    def create(self) -> None:
        os.mkdir(self.base)
        if self.kind == "v2":
            _write(os.path.join(self.root, "cgroup.subtree_control"), "+cpu", ignore_errors=True)
            _write(os.path.join(self.base, "cgroup.subtree_control"), "+cpu")
        for rank, share in enumerate(self.shares):
            d = self.path(rank)
            os.mkdir(d)
            quota = max(1000, int(round(share * self.period_us)))
            if self.kind == "v1":
                _write(os.path.join(d, "cpu.cfs_period_us"), str(self.period_us))
                _write(os.path.join(d, "cpu.cfs_quota_us"), str(quota))
            else:
                _write(os.path.join(d, "cpu.max"), f"{quota} {self.period_us}")

    def joiner(self, rank: int):
        """A function for a child process (``preexec_fn``) that moves the calling process into ``rank``'s cgroup."""
        procs = os.path.join(self.path(rank), "cgroup.procs")

        def join() -> None:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        return join

    def describe(self) -> str:
        same = len(set(self.shares)) == 1
        shares = f"{self.shares[0]:g} core each" if same else ", ".join(f"r{r} {s:g}" for r, s in
                                                                         enumerate(self.shares)) + " cores"
        return f"fixed-speed ranks: {shares} (cgroup {self.kind} CFS quota, {self.period_us // 1000} ms period)"

    def destroy(self) -> None:
        remove_tree(self.root, self.base)


def _write(path: str, value: str, ignore_errors: bool = False) -> None:
    try:
        with open(path, "w") as f:
            f.write(value)
    except OSError:
        if not ignore_errors:
            raise


def remove_tree(root: str, base: str, wait: float = 5.0) -> bool:
    """Remove cgroup ``base`` and its children (processes still inside are moved to ``root`` first); True when it
    is gone. cgroup directories are removed with rmdir (their files cannot be deleted)."""
    if not os.path.isdir(base):
        return True
    deadline = time.monotonic() + wait
    children = sorted((os.path.join(base, d) for d in os.listdir(base) if os.path.isdir(os.path.join(base, d))),
                      reverse=True)
    for d in children + [base]:
        while True:
            try:
                with open(os.path.join(d, "cgroup.procs")) as f:
                    pids = f.read().split()
                for pid in pids:
                    _write(os.path.join(root, "cgroup.procs"), pid, ignore_errors=True)
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.05)
    return not os.path.isdir(base)


def leftovers(run_id: str = "") -> List[str]:
    """The run cgroups named ``mmoe<run_id>...`` that exist now (as "cgroup <path>")."""
    found = controller_root()
    if found is None or not os.path.isdir(found[1]):
        return []
    root = found[1]
    return [f"cgroup {os.path.join(root, d)}" for d in sorted(os.listdir(root))
            if d.startswith(PREFIX + run_id) and os.path.isdir(os.path.join(root, d))]


def remove_leftovers(live_run_ids: Sequence[str] = ()) -> List[str]:
    """Remove the run cgroups of every run not in ``live_run_ids``; returns what was removed."""
    found = controller_root()
    removed = []
    for item in leftovers():
        path = item.split(" ", 1)[1]
        if any(os.path.basename(path).startswith(PREFIX + rid) for rid in live_run_ids):
            continue
        if found is not None and remove_tree(found[1], path):
            removed.append(item)
    return removed


__all__ = ["CpuCaps", "PERIOD_US", "controller_root", "leftovers", "parse_shares", "remove_leftovers",
           "unavailable"]
