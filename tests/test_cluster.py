"""The emulated multi-node cluster (`megamoe cluster run`), for real: network namespaces, shaped veth links, gloo
across them. Skipped, with the launcher's own reason, where the emulation cannot run (not root, no ip/tc, ...).

- 2 nodes x 1: the probe's inter-node bandwidth is within 20% of two different settings, and an all-to-all of a
  fixed size takes longer at the lower setting, in proportion.
- 2 nodes x 2: `megamoe topology --measure` infers [[0,1],[2,3]]; intra-node pairs are measurably faster.
- A job stopped midway (SIGTERM), or with a failing rank, leaves no namespace, link or process behind.
- `megamoe train` (EP=4 over 2 nodes) gives exactly the losses of the same run under torchrun: time, not math.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from megamoe_plugin.cluster import leftovers, unavailable

WHY = unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELPERS = os.path.join(REPO, "tests", "helpers")
PROBE = re.compile(r"measured \(TCP probe\): inter-node ([0-9.]+) MB/s, intra-node ([0-9.]+) MB/s")


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
                PYTHONPATH=os.pathsep.join([HELPERS, REPO, os.environ.get("PYTHONPATH", "")]))


def cluster(args, cmd, timeout=300, port=29610):
    full = [sys.executable, "-m", "megamoe_plugin.cli", "cluster", "run", "--master-port", str(port),
            "--timeout", str(timeout - 30), *(args if "--split" in args else [*args, "--no-split"]), "--", *cmd]
    return subprocess.run(full, env=_env(), capture_output=True, text=True, timeout=timeout, cwd=REPO)


def _namespaces():
    return {line.split()[0] for line in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                       text=True).stdout.splitlines() if line.startswith("mmoe")}


@pytest.mark.slow
def test_two_nodes_bandwidth_follows_the_shaping(tmp_path):
    seconds = {}
    for mbs in (30, 90):
        out = tmp_path / f"a2a{mbs}.json"
        p = cluster(["--nodes", "2", "--procs-per-node", "1", "--inter-node-bandwidth", f"{mbs}MB/s"],
                    [sys.executable, os.path.join(HELPERS, "cluster_alltoall.py"), str(out), str(12 << 20)])
        assert p.returncode == 0, p.stderr[-3000:]
        inter, intra = map(float, PROBE.search(p.stderr).groups())
        assert abs(inter - mbs) <= 0.2 * mbs, (mbs, inter)
        assert intra > 3 * inter                                   # within a node: loopback, unshaped
        seconds[mbs] = json.loads(out.read_text())["seconds"]
    # 12 MiB over one shaped link per direction: time ~ bytes / bandwidth, so 3x the bandwidth ~ a third of the time
    ratio = seconds[30] / seconds[90]
    assert 2.3 < ratio < 3.6, seconds


@pytest.mark.slow
def test_two_by_two_topology_is_measured_not_assumed():
    p = subprocess.run([sys.executable, "-m", "megamoe_plugin.cli", "cluster", "run", "--nodes", "2",
                        "--procs-per-node", "2", "--inter-node-bandwidth", "50MB/s", "--master-port", "29620", "--",
                        "megamoe", "topology", "--measure"], env=_env(), capture_output=True, text=True, timeout=300,
                       cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    split = re.search(r"reference MoE layer .* \(([0-9]+)% of the step\)", p.stderr)     # measured at start-up
    assert split and 0 < int(split.group(1)) < 100, p.stderr[-2000:]
    m = re.search(r"Topology\((\[\[0,1\],\[2,3\]\]), bandwidth_gbps=\[([0-9.e-]+), ([0-9.e-]+)\]", p.stdout)
    assert m, p.stdout[-2000:]
    intra, inter = float(m.group(2)), float(m.group(3))
    assert abs(inter * 1e3 - 50) <= 0.2 * 50 and intra > 3 * inter, (intra, inter)


@pytest.mark.slow
def test_a_stopped_or_failing_job_leaves_nothing_behind(tmp_path):
    before = _namespaces()
    marker = f"megamoe-cluster-test-{os.getpid()}"
    cmd = [sys.executable, "-m", "megamoe_plugin.cli", "cluster", "run", "--nodes", "2", "--procs-per-node", "2",
           "--no-probe", "--master-port", "29640", "--log-dir", str(tmp_path / "logs"), "--",
           sys.executable, "-c", f"import time; time.sleep(120)  # {marker}"]
    p = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not (_namespaces() - before and _procs(marker, p.pid) == 4):
            time.sleep(0.2)
        assert _namespaces() - before and _procs(marker, p.pid) == 4, "the job did not start"
    finally:
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    assert p.returncode == 143 and "stopping every rank" in err, err[-2000:]
    assert _namespaces() == before and _procs(marker) == 0
    assert not [x for x in leftovers() if x.split()[1][4:9] not in {n[4:9] for n in before}]
    # a rank that fails: the job's status is its status, the others are stopped, nothing is left
    q = cluster(["--nodes", "2", "--procs-per-node", "2", "--no-probe"],
                [sys.executable, "-c", f"import os, sys, time; sys.exit(3) if os.environ['RANK'] == '1' "
                 f"else time.sleep(120)  # {marker}"], timeout=120)
    assert q.returncode == 3 and "rank 1 exited with status 3" in q.stderr, q.stderr[-2000:]
    assert _namespaces() == before and _procs(marker) == 0


def _procs(marker, launcher=None):
    """Processes whose command line holds ``marker``, the launcher's own excluded."""
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    return len([pid for pid in out if int(pid) not in (os.getpid(), launcher)])


@pytest.mark.slow
def test_megamoe_train_on_the_cluster_has_the_losses_of_torchrun(tmp_path):
    flags = ["megamoe", "train", "--hidden", "64", "--layers", "2", "--heads", "2", "--ffn-hidden", "128",
             "--seq-len", "32", "--batch-size", "4", "--corpus-bytes", "200000", "--threads", "1",
             "--eval-interval", "0", "--eval-batches", "2", "--log-interval", "1", "--moe-every", "1", "--steps", "4",
             "--moe-num-experts", "8", "--moe-expert-parallel-size", "4", "--corpus-cache", str(tmp_path)]
    p = cluster(["--nodes", "2", "--procs-per-node", "2", "--inter-node-bandwidth", "100MB/s"], flags)
    assert p.returncode == 0, p.stderr[-3000:]
    q = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                        "-m", "megamoe_plugin.cli", *flags[1:]], env=_env(), capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    assert q.returncode == 0, q.stderr[-3000:]
    pattern = re.compile(r"^step\s+\d+/\d+ \| loss [0-9.]+ \| lm [0-9.]+ \| aux [0-9.]+", re.M)
    on_cluster, plain = pattern.findall(p.stdout), pattern.findall(q.stdout)
    assert len(on_cluster) == 4 and on_cluster == plain, (on_cluster, plain)
    assert "world 4, expert-parallel 4" in p.stdout
