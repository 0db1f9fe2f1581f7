"""Topology: which ranks share which switch, and the alpha-beta cost of each level of the tree.

A topology is a nested list of ranks whose sub-lists share a switch (TA-MoE paper 002 §3.2): ``[[0,1],[2,3]]`` is
2 nodes x 2 devices, ``[0,1,2,3]`` one homogeneous node, ``[[[0,1],[2,3]],[[4,5],[6,7]]]`` a 3-level tree. Every
leaf sits at the same depth. The *level* of a rank pair is the number of tree levels its path climbs: 0 for the
rank itself, 1 for devices under the same innermost switch (intra-node), ..., ``depth`` for the outermost
(inter-node) links. Each level has a latency alpha (seconds) and a bandwidth (bytes/s), the alpha-beta model of
paper 002 §4.1 (beta = 1 / bandwidth). FasterMoE's Hir gate (paper 003 §4.3) reads W_local (level 1) and W_net
(the top level) from here; TA-MoE's target dispatch pattern and the performance model read the matrices.

``Topology.from_env`` builds the default from the launcher: the nodes and per-level bandwidths the emulated cluster
exports (``MEGAMOE_TOPOLOGY``, ``MEGAMOE_TOPOLOGY_BANDWIDTH_GBPS``, set by ``megamoe cluster run``), else nodes of
LOCAL_WORLD_SIZE ranks (torchrun's layout). ``measure`` times point-to-point transfers over a real process group and
returns a copy with measured alpha and bandwidth per level; ``discover`` measures every rank pair and infers the
nodes themselves (ranks whose pairs are markedly faster than the slowest pairs share a node).
"""
from __future__ import annotations

import ast
import os
import time
from typing import List, Optional, Sequence

import torch

from .parallel import comm_device

# Defaults per level, innermost first, for GPU clusters: NVLink/PCIe inside a node, 100 Gb/s NIC between nodes.
DEFAULT_BANDWIDTH_GBPS = (100.0, 12.5, 6.25, 3.125)
DEFAULT_LATENCY_US = (2.0, 10.0, 20.0, 40.0)


class Topology:
    def __init__(self, groups, bandwidth_gbps: Optional[Sequence[float]] = None,
                 latency_us: Optional[Sequence[float]] = None):
        self.groups = groups
        paths = {}
        depth = _collect_paths(groups, (), paths)
        ranks = sorted(paths)
        if ranks != list(range(len(ranks))):
            raise ValueError(f"ranks must be 0..{len(ranks) - 1} each exactly once, got {ranks}")
        if depth is None:
            raise ValueError("every rank must sit at the same depth of the nested list")
        self.depth = depth
        self.num_ranks = len(ranks)
        self._paths = [paths[r] for r in ranks]
        self.bandwidth_gbps = _per_level(bandwidth_gbps, DEFAULT_BANDWIDTH_GBPS, depth, "bandwidth")
        self.latency_us = _per_level(latency_us, DEFAULT_LATENCY_US, depth, "latency")

    # --- construction ------------------------------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str, **kw) -> "Topology":
        try:
            groups = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            raise ValueError("not a nested list of ints, e.g. '[[0,1],[2,3]]'") from None
        if not isinstance(groups, (list, tuple)):
            raise ValueError("not a nested list of ints, e.g. '[[0,1],[2,3]]'")
        return cls(groups, **kw)

    @classmethod
    def from_env(cls, world_size: Optional[int] = None, local_world_size: Optional[int] = None, **kw) -> "Topology":
        """The launcher's topology: ``MEGAMOE_TOPOLOGY`` (+ ``MEGAMOE_TOPOLOGY_BANDWIDTH_GBPS`` unless bandwidths
        are given) when it describes ``world_size`` ranks, else nodes of LOCAL_WORLD_SIZE consecutive ranks
        (torchrun's layout); one flat node when that is unknown."""
        world = world_size or int(os.environ.get("WORLD_SIZE", "1"))
        spec = os.environ.get("MEGAMOE_TOPOLOGY", "")
        if spec and local_world_size is None:
            env_bw = os.environ.get("MEGAMOE_TOPOLOGY_BANDWIDTH_GBPS", "")
            launcher_kw = dict(kw)
            if kw.get("bandwidth_gbps") is None and env_bw:
                launcher_kw["bandwidth_gbps"] = [float(v) for v in env_bw.split(",")]
            topo = cls.parse(spec, **launcher_kw)
            if topo.num_ranks == world:
                return topo
        local = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        if local < 1 or world % local:
            raise ValueError(f"LOCAL_WORLD_SIZE={local} does not divide WORLD_SIZE={world}")
        if local == world:
            return cls(list(range(world)), **kw)
        return cls([list(range(n * local, (n + 1) * local)) for n in range(world // local)], **kw)

    # --- queries -----------------------------------------------------------------------------------------------
    def level(self, i: int, j: int) -> int:
        if i == j:
            return 0
        a, b = self._paths[i], self._paths[j]
        common = 0
        while common < len(a) and a[common] == b[common]:
            common += 1
        return self.depth - common

    def level_matrix(self) -> torch.Tensor:
        return torch.tensor([[self.level(i, j) for j in range(self.num_ranks)] for i in range(self.num_ranks)])

    def bandwidth_matrix(self) -> torch.Tensor:
        """Bytes/s between every rank pair (float64); the diagonal (no link) is +inf."""
        bw = torch.tensor([float("inf")] + [b * 1e9 for b in self.bandwidth_gbps], dtype=torch.float64)
        return bw[self.level_matrix()]

    def latency_matrix(self) -> torch.Tensor:
        """Seconds of fixed latency between every rank pair (float64); 0 on the diagonal."""
        lat = torch.tensor([0.0] + [a * 1e-6 for a in self.latency_us], dtype=torch.float64)
        return lat[self.level_matrix()]

    def node_of(self, rank: int) -> int:
        """Index of the innermost group (the "node" of FasterMoE's Hir gate) holding `rank`."""
        return self.node_ids()[rank]

    def node_ids(self) -> List[int]:
        keys = [p[:-1] for p in self._paths]
        index = {k: n for n, k in enumerate(dict.fromkeys(keys))}
        return [index[k] for k in keys]

    def ranks_per_node(self, rank: int = 0) -> int:
        node = self.node_of(rank)
        return sum(1 for n in self.node_ids() if n == node)

    @property
    def local_bandwidth(self) -> float:
        """W_local of paper 003 §4.3 in bytes/s: the innermost level."""
        return self.bandwidth_gbps[0] * 1e9

    @property
    def net_bandwidth(self) -> float:
        """W_net of paper 003 §4.3 in bytes/s: the outermost level (equals W_local on one node)."""
        return self.bandwidth_gbps[-1] * 1e9

    def spec(self) -> str:
        return str(self.groups).replace(" ", "")

    def __repr__(self):
        return (f"Topology({self.spec()}, bandwidth_gbps={list(self.bandwidth_gbps)}, "
                f"latency_us={list(self.latency_us)})")

    def with_levels(self, bandwidth_gbps, latency_us) -> "Topology":
        return Topology(self.groups, bandwidth_gbps=bandwidth_gbps, latency_us=latency_us)

    # --- measurement -------------------------------------------------------------------------------------------
    def measure(self, group=None, small_bytes: int = 8, large_bytes: int = 1 << 22, iters: int = 5) -> "Topology":
        """Time ping-pong transfers between rank pairs of every level over `group` and fit alpha and bandwidth.

        Collective over the group (every rank must call it). For each level present, rank 0 of the group pings
        the first rank at that level: alpha = half the round trip of a `small_bytes` message, bandwidth =
        large_bytes / (half round trip of `large_bytes` - alpha). Levels absent from the group keep their values.
        Returns a new Topology with the same tree; every rank gets the same numbers (broadcast from rank 0).
        """
        import torch.distributed as dist

        world = dist.get_world_size(group)
        if world != self.num_ranks:
            raise ValueError(f"topology has {self.num_ranks} ranks, the process group {world}")
        me = dist.get_rank(group)
        gl = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
        lat, bw = list(self.latency_us), list(self.bandwidth_gbps)
        device = comm_device(group)
        result = torch.zeros(2 * self.depth, dtype=torch.float64, device=device)
        for lvl in range(1, self.depth + 1):
            peer = next((j for j in range(world) if self.level(0, j) == lvl), None)
            if peer is None:
                continue
            if me in (0, peer):
                other = peer if me == 0 else 0
                alpha, bandwidth = _link(me == 0, gl(other), small_bytes, large_bytes, iters, device)
                if me == 0:
                    result[2 * (lvl - 1)] = alpha * 1e6
                    result[2 * (lvl - 1) + 1] = bandwidth / 1e9
            dist.barrier(group)
        dist.broadcast(result, gl(0), group=group)
        for lvl in range(1, self.depth + 1):
            if result[2 * (lvl - 1) + 1] > 0:
                lat[lvl - 1] = float(result[2 * (lvl - 1)])
                bw[lvl - 1] = float(result[2 * (lvl - 1) + 1])
        return self.with_levels(bw, lat)


    @classmethod
    def discover(cls, group=None, small_bytes: int = 8, large_bytes: int = 4 << 20, iters: int = 3,
                 fast_ratio: float = 2.0) -> "Topology":
        """Collective: measure every rank pair's point-to-point bandwidth and infer the nodes: pairs at least
        ``fast_ratio`` times faster than the slowest pairs share a node (connected components). Returns the
        two-level tree ``[[...], [...]]`` (nodes may differ in size) with the median measured bandwidth and latency
        of each level, or one flat node when no pair stands out. Every rank gets the same answer."""
        import torch.distributed as dist

        world, me = dist.get_world_size(group), dist.get_rank(group)
        gl = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
        device = comm_device(group)
        bw = torch.zeros(world, world, dtype=torch.float64, device=device)
        lat = torch.zeros(world, world, dtype=torch.float64, device=device)
        for i in range(world):
            for j in range(i + 1, world):
                if me in (i, j):
                    other = j if me == i else i
                    alpha, bandwidth = _link(me == i, gl(other), small_bytes, large_bytes, iters, device)
                    if me == i:
                        lat[i, j], bw[i, j] = alpha, bandwidth
                dist.barrier(group)
        dist.all_reduce(bw, group=group)
        dist.all_reduce(lat, group=group)
        bw, lat = (bw + bw.t()).cpu(), (lat + lat.t()).cpu()
        return cls.from_pair_bandwidths(bw, lat, fast_ratio)

    @classmethod
    def from_pair_bandwidths(cls, bw: torch.Tensor, lat: Optional[torch.Tensor] = None,
                             fast_ratio: float = 2.0) -> "Topology":
        """The tree ``discover`` infers from a symmetric [P, P] matrix of pair bandwidths (bytes/s; the diagonal
        is ignored) and optional latencies (seconds)."""
        P = bw.shape[0]
        if P == 1:
            return cls([0])
        off = ~torch.eye(P, dtype=torch.bool)
        slow = float(bw[off].min())
        fast = (bw >= fast_ratio * slow) & off
        parent = list(range(P))

        def find(a):
            while parent[a] != a:
                parent[a] = parent[parent[a]]
                a = parent[a]
            return a
        for i, j in fast.nonzero().tolist():
            parent[find(i)] = find(j)
        nodes: dict = {}
        for r in range(P):
            nodes.setdefault(find(r), []).append(r)
        groups = sorted(nodes.values())
        lat = lat if lat is not None else torch.zeros_like(bw)

        def median(mask):
            vals = bw[mask].tolist()
            lats = lat[mask].tolist()
            return sorted(vals)[len(vals) // 2] / 1e9, sorted(lats)[len(lats) // 2] * 1e6
        node_of = torch.tensor([next(k for k, g in enumerate(groups) if r in g) for r in range(P)])
        same = (node_of[:, None] == node_of[None, :]) & off
        if len(groups) == 1 or len(groups) == P:
            b, a = median(off)           # no pair stands out: one flat level
            return cls(list(range(P)), bandwidth_gbps=[b], latency_us=[a])
        b_in, a_in = median(same)
        b_out, a_out = median(off & ~same)
        return cls(groups, bandwidth_gbps=[b_in, b_out], latency_us=[a_in, a_out])


def _link(initiator: bool, peer: int, small_bytes: int, large_bytes: int, iters: int, device):
    """(alpha in seconds, bandwidth in bytes/s) of the link to ``peer``: alpha = the one-way time of a small
    message; bandwidth = the slope between messages of large_bytes / 4 and large_bytes (a shaped link's token
    bucket lets the first burst through at line rate: the slope cancels it, where bytes / time would not)."""
    t_small = _pingpong(initiator, peer, small_bytes, iters, device)
    t_quarter = _pingpong(initiator, peer, large_bytes // 4, iters, device)
    t_large = _pingpong(initiator, peer, large_bytes, iters, device)
    direct = large_bytes / max(t_large - t_small, 1e-9)
    slope = (t_large - t_quarter) / (large_bytes - large_bytes // 4)
    # on a fast unshaped link the slope is within timing noise: then bytes / time (no bucket to cancel)
    bandwidth = 1.0 / slope if slope > 0 and 0.4 * direct <= 1.0 / slope <= 1.05 * direct else direct
    return t_small, bandwidth


def _pingpong(initiator: bool, peer: int, nbytes: int, iters: int, device) -> float:
    """Median one-way time (half a round trip) of an `nbytes` message between this rank and `peer`."""
    import torch.distributed as dist

    buf = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    times = []
    for it in range(iters + 1):  # the first round warms the connection up
        t0 = time.perf_counter()
        if initiator:
            dist.send(buf, peer, group=None)
            dist.recv(buf, peer, group=None)
        else:
            dist.recv(buf, peer, group=None)
            dist.send(buf, peer, group=None)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if it:
            times.append((time.perf_counter() - t0) / 2)
    times.sort()
    return times[len(times) // 2]


def _collect_paths(node, prefix, out) -> Optional[int]:
    """Fill out[rank] = index path; return the common leaf depth, or None if leaves sit at different depths."""
    if isinstance(node, bool) or not isinstance(node, (int, list, tuple)):
        raise ValueError(f"unexpected element {node!r}: use nested lists of ints")
    if isinstance(node, int):
        if node in out:
            raise ValueError(f"rank {node} appears twice")
        out[node] = prefix
        return 0
    if not node:
        raise ValueError("empty group")
    depths = {_collect_paths(child, prefix + (i,), out) for i, child in enumerate(node)}
    if len(depths) != 1 or None in depths:
        return None
    return depths.pop() + 1


def _per_level(values, defaults, depth, what) -> List[float]:
    if values is None:
        return [float(v) for v in defaults[:depth]] + [float(defaults[-1])] * max(0, depth - len(defaults))
    values = [float(v) for v in values]
    if len(values) != depth:
        raise ValueError(f"{len(values)} {what} value(s) given for a topology of {depth} level(s)")
    return values
