"""Network namespaces, veth pairs, a bridge and token-bucket shaping: N emulated "nodes" on one Linux machine.

Layout (all names start with ``mmoe`` + a run id, so nothing else on the machine is ever touched)::

    root namespace:  bridge mmoe<id>br  (no address: the cluster's /24 exists only inside the node namespaces)
                       |-- mmoe<id>h0  ==veth==  mmoe<id>v0  in namespace mmoe<id>n0 (node 0), 10.213.77.1/24
                       |-- mmoe<id>h1  ==veth==  mmoe<id>v1  in namespace mmoe<id>n1 (node 1), 10.213.77.2/24
                       ...

A node's NIC is its veth pair, shaped in both directions with ``tc ... tbf`` at the inter-node bandwidth (tbf
shapes egress only: the namespace end shapes what the node sends, the bridge end what it receives). Processes of
one node reach each other's address through that namespace's own stack (loopback): intra-node traffic never
crosses the veth, and is unshaped unless an intra-node bandwidth shapes the namespace's ``lo``.

``EmulatedCluster`` is a context manager: it creates everything on enter and removes everything it created on
exit (an error or a signal included); ``leftovers(run_id)`` lists what a run left behind (tests check it is empty)
and ``remove_leftovers()`` removes the namespaces/links of runs whose launcher is gone. ``unavailable()`` says,
in one sentence, why the emulation cannot run here (not root, no ``ip``/``tc``, namespaces or tbf refused).
What is not emulated: latency (netem is not available), RDMA congestion control, GPU compute.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from typing import List, Optional

from .cpu_caps import remove_leftovers as remove_cpu_cap_leftovers
from .resource import CreatedResource

PREFIX = "mmoe"
SUBNET = "10.213.77"            # one private /24, configured only inside the node namespaces
STATE_DIR = "/run/megamoe-cluster"
QUEUE_BYTES = 4 << 20           # tbf queue per link direction
_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3}


class ClusterError(RuntimeError):
    """The emulated cluster cannot be created (the message names the command and what it said)."""


MIN_BANDWIDTH = 1 << 16          # bytes/s: slower than this, a link cannot carry a training job's probes and exchanges


def parse_bandwidth(text: str) -> float:
    """'25MB/s', '200Mbit', '1.5GB/s', '800mbps', '3e7' (bytes/s) -> bytes per second; a bare number is bytes/s,
    and anything under 64 KB/s is refused (a unit left out: '25' is 25 bytes/s)."""
    rate = _parse_rate(text)
    if rate < MIN_BANDWIDTH:
        raise ValueError(f"bandwidth {text!r} is {rate:g} bytes/s, below the {MIN_BANDWIDTH // 1024} KB/s a link "
                         f"needs; a bare number is bytes/s: give a unit (e.g. {text}MB/s)")
    return rate


def _parse_rate(text: str) -> float:
    t = str(text).strip().lower().replace(" ", "")
    m = re.fullmatch(r"([0-9.]+(?:e[+-]?[0-9]+)?)([a-z/]*)", t)
    if not m:
        raise ValueError(f"not a bandwidth: {text!r} (e.g. 25MB/s, 200Mbit)")
    value, unit = float(m.group(1)), m.group(2)
    if unit in ("", "b/s", "bps"):
        return value
    bits = unit.endswith(("bit", "bit/s", "bps")) and not unit.endswith("b/s")
    base = unit.replace("bit/s", "").replace("bit", "").replace("bps", "").replace("/s", "")
    base = base if base.endswith("b") else base + "b"
    if base not in _UNITS:
        raise ValueError(f"unknown bandwidth unit in {text!r} (use B/s, KB/s, MB/s, GB/s, Mbit, Gbit)")
    return value * _UNITS[base] / (8.0 if bits else 1.0)


def unavailable() -> Optional[str]:
    """None when namespaces, veth and tbf work here; else why not (one sentence naming what is missing)."""
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        return "the emulated cluster needs Linux network namespaces (not available on this system)"
    if os.geteuid() != 0:
        return "the emulated cluster needs root (creating network namespaces, veth pairs and tc qdiscs)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the emulated cluster needs the '{tool}' command (iproute2), which is not installed"
    rid = "chk" + secrets.token_hex(2)
    ns, a, b = f"{PREFIX}{rid}n", f"{PREFIX}{rid}a", f"{PREFIX}{rid}b"
    try:
        _run(["ip", "netns", "add", ns], "network namespaces")
        _run(["ip", "link", "add", a, "type", "veth", "peer", "name", b], "veth pairs")
        _run(["tc", "qdisc", "add", "dev", a, "root", "tbf", "rate", "100mbit", "burst", "32kb", "latency", "50ms"],
             "the tbf qdisc")
    except ClusterError as err:
        return f"the emulated cluster cannot run here: {err}"
    finally:
        subprocess.run(["ip", "link", "del", a], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    return None


def _run(cmd: List[str], what: str = "") -> str:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise ClusterError(f"{' '.join(cmd)} failed{' (' + what + ')' if what else ''}: "
                           f"{(p.stderr or p.stdout).strip()[:300]}")
    return p.stdout


@dataclass
class Node:
    index: int
    namespace: str
    ifname: str          # the node's NIC inside its namespace (GLOO_SOCKET_IFNAME)
    host_ifname: str     # the other end of the pair, on the bridge
    address: str


class EmulatedCluster(CreatedResource):
    """N network namespaces behind one bridge, each node's link shaped to ``inter_bandwidth`` bytes/s."""

    def __init__(self, nodes: int, inter_bandwidth: float, intra_bandwidth: Optional[float] = None,
                 run_id: Optional[str] = None):
        if not 1 <= nodes <= 200:
            raise ValueError(f"--nodes must be in 1..200, got {nodes}")
        if inter_bandwidth <= 0 or (intra_bandwidth is not None and intra_bandwidth <= 0):
            raise ValueError("bandwidths must be > 0")
        self.run_id = run_id or secrets.token_hex(3)[:5]
        self.inter_bandwidth, self.intra_bandwidth = float(inter_bandwidth), intra_bandwidth
        self.bridge = f"{PREFIX}{self.run_id}br"
        self.nodes = [Node(k, f"{PREFIX}{self.run_id}n{k}", f"{PREFIX}{self.run_id}v{k}",
                           f"{PREFIX}{self.run_id}h{k}", f"{SUBNET}.{k + 1}") for k in range(nodes)]
        self._created: List[tuple] = []          # ("netns", name) / ("link", name), in creation order

    # --- lifecycle ----------------------------------------------------------------------------------------------
    def create(self) -> None:
        os.makedirs(STATE_DIR, exist_ok=True)
        with open(os.path.join(STATE_DIR, f"{self.run_id}.json"), "w") as f:
            json.dump({"pid": os.getpid(), "bridge": self.bridge, "namespaces": [n.namespace for n in self.nodes],
                       "links": [n.host_ifname for n in self.nodes]}, f)
        _run(["ip", "link", "add", self.bridge, "type", "bridge"], "bridge")
        self._created.append(("link", self.bridge))
        _run(["ip", "link", "set", self.bridge, "up"])
        for n in self.nodes:
            _run(["ip", "netns", "add", n.namespace], "network namespace")
            self._created.append(("netns", n.namespace))
            _run(["ip", "link", "add", n.host_ifname, "type", "veth", "peer", "name", n.ifname], "veth pair")
            self._created.append(("link", n.host_ifname))
            _run(["ip", "link", "set", n.ifname, "netns", n.namespace])
            _run(["ip", "link", "set", n.host_ifname, "master", self.bridge])
            _run(["ip", "link", "set", n.host_ifname, "up"])
            ns = ["ip", "netns", "exec", n.namespace]
            _run(ns + ["ip", "addr", "add", f"{n.address}/24", "dev", n.ifname])
            _run(ns + ["ip", "link", "set", n.ifname, "up"])
            _run(ns + ["ip", "link", "set", "lo", "up"])
            self._shape(n.host_ifname, self.inter_bandwidth)            # what the node receives
            self._shape(n.ifname, self.inter_bandwidth, n.namespace)    # what the node sends
            if self.intra_bandwidth:
                self._shape("lo", self.intra_bandwidth, n.namespace)

    @staticmethod
    def _shape(dev: str, rate: float, namespace: Optional[str] = None) -> None:
        """tbf at ``rate`` bytes/s on dev's egress; the bucket holds 4 ms of traffic (at least 32 KiB). The queue
        holds 4 MiB (a TCP connection's largest send window here), so a burst waits rather than drops: a NIC with
        flow control does not drop either, and a drop can cost a TCP retransmission timeout of 200 ms or more."""
        burst = max(int(rate * 0.004), 32 * 1024)
        cmd = ["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{int(rate * 8)}bit", "burst", str(burst),
               "limit", str(QUEUE_BYTES)]
        _run((["ip", "netns", "exec", namespace] if namespace else []) + cmd, "tbf shaping")

    def destroy(self) -> None:
        """Remove everything this run created (namespaces take their veth ends, and so the pairs, with them)."""
        for kind, name in reversed(self._created):
            cmd = ["ip", "netns", "del", name] if kind == "netns" else ["ip", "link", "del", name]
            subprocess.run(cmd, capture_output=True)
        self._created.clear()
        try:
            os.remove(os.path.join(STATE_DIR, f"{self.run_id}.json"))
        except FileNotFoundError:
            pass

    # --- queries ------------------------------------------------------------------------------------------------
    def exec_prefix(self, node: int) -> List[str]:
        return ["ip", "netns", "exec", self.nodes[node].namespace]

    def link_bytes(self) -> dict:
        """{node: (bytes the node sent, bytes it received)} over its link so far (the bridge end's counters)."""
        out = {}
        for n in self.nodes:
            base = f"/sys/class/net/{n.host_ifname}/statistics/"
            with open(base + "rx_bytes") as rx, open(base + "tx_bytes") as tx:
                out[n.index] = (int(rx.read()), int(tx.read()))       # the bridge end receives what the node sends
        return out

    @property
    def master_addr(self) -> str:
        return self.nodes[0].address


def leftovers(run_id: str = "") -> List[str]:
    """Namespaces and links named ``mmoe<run_id>...`` that exist now."""
    pattern = PREFIX + run_id
    found = [f"netns {line.split()[0]}" for line in _list(["ip", "netns", "list"]) if line.startswith(pattern)]
    for line in _list(["ip", "-o", "link", "show"]):
        m = re.match(r"\d+:\s+([^:@\s]+)", line)
        if m and m.group(1).startswith(pattern):
            found.append(f"link {m.group(1)}")
    return found


def _list(cmd: List[str]) -> List[str]:
    p = subprocess.run(cmd, capture_output=True, text=True)
    return p.stdout.splitlines() if p.returncode == 0 else []


def remove_leftovers(all_runs: bool = False) -> List[str]:
    """Remove the namespaces, links and CPU cgroups of runs whose launcher process is gone (all ``mmoe*`` ones
    with ``all_runs``); returns what was removed."""
    live = set()
    if os.path.isdir(STATE_DIR):
        for name in os.listdir(STATE_DIR):
            path = os.path.join(STATE_DIR, name)
            try:
                pid = json.load(open(path))["pid"]
                os.kill(pid, 0)
                if not all_runs:
                    live.add(name[:-len(".json")])
                    continue
            except (OSError, ValueError, KeyError):
                pass
            os.remove(path)
    removed = []
    for item in leftovers():
        kind, name = item.split(" ", 1)
        if any(name.startswith(PREFIX + rid) for rid in live):
            continue
        cmd = ["ip", "netns", "del", name] if kind == "netns" else ["ip", "link", "del", name]
        if subprocess.run(cmd, capture_output=True).returncode == 0:
            removed.append(item)
    return removed + remove_cpu_cap_leftovers(sorted(live))  # the runs' CPU cgroups, named by the same run ids
