"""``megamoe cluster run``: start a torch.distributed job on an emulated multi-node cluster, like torchrun.

For N nodes x G processes it creates the cluster (``netns.EmulatedCluster``), probes the shaped links, then starts
G processes inside each node's namespace with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR = node 0's address, MASTER_PORT) plus GLOO_SOCKET_IFNAME (the node's
NIC), so an unmodified program runs: ``megamoe train``, the Megatron trainer, Megatron-LM's ``pretrain_gpt.py``
through the launcher or patch, fairseq-train through the plugin's fairseq launcher, the benchmarks. It also sets
``MEGAMOE_TOPOLOGY`` and ``MEGAMOE_TOPOLOGY_BANDWIDTH_GBPS`` (the nodes and the probed per-level bandwidths), which
the gates and the performance model read when no ``--moe-topology`` is given.

With ``cpu_shares`` every rank runs in its own CPU cgroup capped at its share (``cpu_caps.CpuCaps``): ranks are
fixed-speed devices, as GPUs are, instead of borrowing the cores idle peers leave.

Rank 0's output is streamed; every rank's output goes to ``<log-dir>/rank<r>.log``. The job's exit status is the
first failing rank's (the others are then stopped), 124 on ``--timeout``, 130/143 on Ctrl-C/SIGTERM. On every
exit path every process it started is ended and every namespace, veth, bridge and cgroup it created is removed
(a launcher killed by SIGKILL cannot: ``megamoe cluster cleanup`` and the next run remove what it left).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from .cpu_caps import CpuCaps
from .netns import EmulatedCluster, remove_leftovers

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "probe.py")


class _Stopped(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class ProbeResult:
    inter_bytes_per_s: Optional[float]     # node 1 -> node 0 over the shaped links (None with one node)
    intra_bytes_per_s: float               # two processes of node 0 (loopback inside the namespace)


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the launcher dies (even by SIGKILL), so no rank outlives it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)     # PR_SET_PDEATHSIG
    except OSError:
        pass


def _measure(cluster: EmulatedCluster, src: int, dst: int, nbytes: int, port: int) -> float:
    """Bytes per second of one TCP stream from node ``src`` to node ``dst``'s address."""
    addr = cluster.nodes[dst].address
    server = subprocess.Popen(cluster.exec_prefix(dst) + [sys.executable, PROBE, "serve", addr, str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_die_with_parent)
    try:
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError(f"bandwidth probe: the server did not start: {server.stderr.read()[:300]}")
        subprocess.run(cluster.exec_prefix(src) + [sys.executable, PROBE, "send", addr, str(port), str(nbytes)],
                       check=True, timeout=120, capture_output=True)
        out, err = server.communicate(timeout=120)
        total, seconds = out.split()[:2]
        return float(total) / max(float(seconds), 1e-9)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def probe(cluster: EmulatedCluster, port: int) -> ProbeResult:
    """Inter-node (if there are 2+ nodes) and intra-node bandwidth, measured on the running cluster; each transfer
    is sized for about half a second at the shaped rate."""
    inter = None
    if len(cluster.nodes) > 1:
        inter = _measure(cluster, 1, 0, max(int(cluster.inter_bandwidth * 0.5), 1 << 20), port)
    intra_size = int(cluster.intra_bandwidth * 0.5) if cluster.intra_bandwidth else 256 << 20
    intra = _measure(cluster, 0, 0, max(intra_size, 1 << 20), port)
    return ProbeResult(inter, intra)


def layout(nodes: int, procs_per_node) -> List[List[int]]:
    """The ranks of every node: ``procs_per_node`` is one count for every node or one count per node (an
    asymmetric cluster, e.g. [2, 1, 1]); ranks are numbered node by node."""
    counts = [int(procs_per_node)] * nodes if isinstance(procs_per_node, int) else [int(c) for c in procs_per_node]
    if len(counts) != nodes or min(counts) < 1:
        raise ValueError(f"procs per node {procs_per_node!r} does not describe {nodes} node(s)")
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out


def rank_env(cluster: EmulatedCluster, rank: int, procs_per_node, master_port: int,
             probe_result: Optional[ProbeResult], base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """torchrun's variables for ``rank`` plus GLOO_SOCKET_IFNAME and the topology the job runs on."""
    groups = layout(len(cluster.nodes), procs_per_node)
    world = sum(len(g) for g in groups)
    k = next(i for i, g in enumerate(groups) if rank in g)
    node = cluster.nodes[k]
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(rank), LOCAL_RANK=str(groups[k].index(rank)), WORLD_SIZE=str(world),
               LOCAL_WORLD_SIZE=str(len(groups[k])), GROUP_RANK=str(node.index), NODE_RANK=str(node.index),
               MASTER_ADDR=cluster.master_addr, MASTER_PORT=str(master_port), GLOO_SOCKET_IFNAME=node.ifname,
               TORCHELASTIC_RUN_ID=f"megamoe-cluster-{cluster.run_id}", MEGAMOE_CLUSTER=cluster.run_id,
               MEGAMOE_TOPOLOGY=str(groups).replace(" ", ""),
               MEGAMOE_CLUSTER_SHAPING=f"inter={cluster.inter_bandwidth:.0f},intra={cluster.intra_bandwidth or 0:.0f}")
    if probe_result is not None:
        intra = probe_result.intra_bytes_per_s
        inter = probe_result.inter_bytes_per_s or cluster.inter_bandwidth
        env["MEGAMOE_TOPOLOGY_BANDWIDTH_GBPS"] = f"{intra / 1e9:.6g},{inter / 1e9:.6g}"
    else:
        intra = cluster.intra_bandwidth or 1e9
        env["MEGAMOE_TOPOLOGY_BANDWIDTH_GBPS"] = f"{intra / 1e9:.6g},{cluster.inter_bandwidth / 1e9:.6g}"
    cores = os.cpu_count() or 1
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // world)))
    return env


def _stream(pipe, log_path: str, echo) -> None:
    with open(log_path, "w") as log:
        for line in iter(pipe.readline, ""):
            log.write(line)
            log.flush()
            echo(line)


def _child_setup(caps: Optional[CpuCaps], rank: int):
    """What a rank's child process does before exec: die with the launcher, and join its CPU cgroup."""
    if caps is None:
        return _die_with_parent
    join = caps.joiner(rank)

    def setup() -> None:
        _die_with_parent()
        join()
    return setup


def _start(cluster: EmulatedCluster, cmd: Sequence[str], procs_per_node: int, master_port: int,
           result: Optional[ProbeResult], log_dir: str, echo=None, caps: Optional[CpuCaps] = None):
    """Start ``cmd`` on every rank (each in its CPU cgroup with ``caps``); rank 0's output streamed to ``echo`` (when
    given) and its log."""
    procs, threads = [], []
    groups = layout(len(cluster.nodes), procs_per_node)
    for k, ranks in enumerate(groups):
        for rank in ranks:
            env = rank_env(cluster, rank, procs_per_node, master_port, result)
            if caps is not None:
                env["MEGAMOE_CPU_SHARE"] = f"{caps.shares[rank]:g}"
            full = cluster.exec_prefix(k) + list(cmd)
            log_path = os.path.join(log_dir, f"rank{rank}.log")
            setup = _child_setup(caps, rank)
            if rank == 0 and echo is not None:
                p = subprocess.Popen(full, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     bufsize=1, start_new_session=True, preexec_fn=setup)
                t = threading.Thread(target=_stream, args=(p.stdout, log_path, echo), daemon=True)
                t.start()
                threads.append(t)
            else:
                with open(log_path, "w") as log:
                    p = subprocess.Popen(full, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=setup)
            procs.append(p)
    return procs, threads


def _measure_split(cluster, procs_per_node, master_port, result, log_dir, say, caps=None) -> None:
    """A reference MoE layer step (EP = every rank) on the cluster before the job: its compute / all-to-all split,
    measured (``bench.cluster.split_probe``)."""
    import json
    out = os.path.join(log_dir, "split.json")
    split_dir = os.path.join(log_dir, "split")
    os.makedirs(split_dir, exist_ok=True)
    procs, _ = _start(cluster, [sys.executable, "-m", "megamoe_plugin.bench.cluster", "--split-probe", out],
                      procs_per_node, master_port + 2, result, split_dir, caps=caps)
    try:
        code = _wait(procs, 300, split_dir, lambda text: None)
    finally:
        _terminate(procs)
    if code == 0 and os.path.exists(out):
        r = json.load(open(out))
        say(f"reference MoE layer ({r['shape']}, EP={r['world']}, forward+backward, measured): step "
            f"{r['step'] * 1e3:.0f} ms = compute {r['compute'] * 1e3:.0f} ms + all-to-all {r['exchange'] * 1e3:.0f} ms "
            f"({r['exchange'] / r['step']:.0%} of the step)")
    else:
        say(f"the reference layer step did not run (status {code}; log: {split_dir})")


def run_job(cmd: Sequence[str], nodes: int, procs_per_node, inter_bandwidth: float,
            intra_bandwidth: Optional[float] = None, master_port: int = 29500, log_dir: Optional[str] = None,
            timeout: float = 3600.0, do_probe: bool = True, echo=None, say=None, split: bool = False,
            cpu_shares: Optional[Sequence[float]] = None) -> int:
    """Create the cluster, run ``cmd`` on every rank, tear everything down; returns the job's exit status.
    ``procs_per_node``: one count for every node, or one per node (``layout``).
    ``cpu_shares``: one CPU share (in cores) per rank, each rank then capped in its own cgroup; None: uncapped.
    ``split``: first measure a reference MoE layer step's compute / all-to-all split on the cluster."""
    echo = echo or (lambda line: (sys.stdout.write(line), sys.stdout.flush()))
    say = say or (lambda text: print(f"megamoe cluster: {text}", file=sys.stderr, flush=True))

    def on_signal(signum, frame):
        # the first signal stops the job; later ones (``timeout`` and a shell both forward one) must not break off
        # the removal of the ranks, namespaces and cgroups that this one starts
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        raise _Stopped(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    procs: List[subprocess.Popen] = []
    threads: List[threading.Thread] = []
    world = sum(len(g) for g in layout(nodes, procs_per_node))
    if cpu_shares is not None and len(cpu_shares) != world:
        raise ValueError(f"{len(cpu_shares)} CPU shares for {world} ranks")
    try:
        for item in remove_leftovers():          # namespaces, links and cgroups of launchers killed earlier
            say(f"removed {item} (left by a killed run)")
        with EmulatedCluster(nodes, inter_bandwidth, intra_bandwidth) as cluster, \
                (CpuCaps(cluster.run_id, cpu_shares) if cpu_shares else contextlib.nullcontext()) as caps:
            log_dir = log_dir or os.path.join(os.getcwd(), "cluster_logs", cluster.run_id)
            os.makedirs(log_dir, exist_ok=True)
            result = probe(cluster, master_port + 1) if do_probe else None
            say(_describe(cluster, procs_per_node, result, log_dir, caps))
            if split and world > 1:
                _measure_split(cluster, procs_per_node, master_port, result, log_dir, say, caps)
            before = cluster.link_bytes()
            procs, threads = _start(cluster, cmd, procs_per_node, master_port, result, log_dir, echo, caps)
            code = _wait(procs, timeout, log_dir, say)
            _report_traffic(cluster, before, cluster.link_bytes(), log_dir, say)
            return code
    except _Stopped as s:
        say(f"{s}: stopping every rank and removing the emulated cluster")
        return 128 + s.signum
    finally:
        _terminate(procs)
        for t in threads:
            t.join(timeout=5)
        for s, handler in previous.items():
            signal.signal(s, handler)


def _report_traffic(cluster, before: Dict[int, tuple], after: Dict[int, tuple], log_dir: str, say) -> None:
    """Bytes each node sent and received over its link during the job (the veth counters), printed and written to
    ``<log-dir>/network.json``: the measured inter-node traffic of the job, every collective included."""
    import json
    nodes = {n: {"sent": after[n][0] - before[n][0], "received": after[n][1] - before[n][1]} for n in after}
    with open(os.path.join(log_dir, "network.json"), "w") as f:
        json.dump({"nodes": nodes, "inter_bandwidth": cluster.inter_bandwidth}, f)
    if len(nodes) > 1:
        say("inter-node traffic of the job: " + ", ".join(
            f"node {n} sent {v['sent'] / 1e6:.1f} MB, received {v['received'] / 1e6:.1f} MB" for n, v in nodes.items()))


def _describe(cluster: EmulatedCluster, g, result: Optional[ProbeResult], log_dir: str,
              caps: Optional[CpuCaps] = None) -> str:
    n = len(cluster.nodes)
    g = g if isinstance(g, int) else "+".join(map(str, g))
    shaped = f"inter-node {cluster.inter_bandwidth / 1e6:.1f} MB/s per node and direction (tbf)"
    intra = (f"intra-node {cluster.intra_bandwidth / 1e6:.1f} MB/s (tbf on lo)" if cluster.intra_bandwidth
             else "intra-node unshaped (loopback)")
    text = f"{n} node(s) x {g} process(es), {shaped}, {intra}, "
    text += caps.describe() if caps is not None else "ranks share the machine's cores (no CPU caps)"
    if result is not None:
        measured = f"intra-node {result.intra_bytes_per_s / 1e6:.0f} MB/s"
        if result.inter_bytes_per_s is not None:
            measured = f"inter-node {result.inter_bytes_per_s / 1e6:.1f} MB/s, " + measured
        text += f" | measured (TCP probe): {measured}"
    return text + f" | logs: {log_dir}"


def _wait(procs: List[subprocess.Popen], timeout: float, log_dir: str, say) -> int:
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            say(f"rank {rank} exited with status {code} (log: {os.path.join(log_dir, f'rank{rank}.log')}); "
                "stopping the other ranks")
            return code
        if all(c == 0 for c in codes):
            return 0
        if time.monotonic() > deadline:
            say(f"--timeout {timeout:g}s reached: stopping every rank")
            return 124
        time.sleep(0.1)


def _terminate(procs: List[subprocess.Popen], grace: float = 5.0) -> None:
    """SIGTERM every rank's process group, SIGKILL what is left after ``grace`` seconds."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    end = time.monotonic() + grace
    for p in alive:
        try:
            p.wait(timeout=max(end - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
