"""Network: the directed link graph of a cluster and the traffic model of collectives on it.

Owns paper 003 (FasterMoE) §3.2, "Topology-aware Communication Modeling": every duplex link is two directed
edges, each with its own one-direction bandwidth W_l; a communication puts traffic T_l on every edge of the fixed
route of each (source, destination) pair, and lasts (Eq.2)

    Lat_comm = max_l T_l / W_l

(plus, here, the largest fixed path latency of the pairs that send anything; the paper neglects it, set latencies
to 0 to get Eq.2 exactly). The three collectives of §3.2:

* all-to-all-v: every pair transfers at once, its traffic accumulated on all directed edges along its path;
* ring all-reduce: each of n workers sends 2(n-1)/n * S to its ring successor;
* broadcast / reduce: pipelined over a ring chain, S through each of its links.

Vertices ``0 .. num_ranks-1`` are ranks (GPUs); switches, NICs and idle GPUs are further integer vertices (added
by ``add_vertex``, which also records a readable name in ``vertex_names``). Routes: fewest hops, ties broken by
the widest bottleneck, then the smallest path latency (``path``); a builder may pin a route (``set_path``).
All routes of the rank pairs are computed once and kept as a sparse pair -> edge incidence (two index tensors),
so the traffic of a whole [P, P] matrix is gathered onto the edges with one ``index_add_``: no loop over tokens or
pairs at evaluation time, and a 64-rank all-to-all costs well under a millisecond once the routes exist.

Units: bytes, bytes/s, seconds. ``from_topology`` reads a ``megamoe_plugin.topology.Topology`` (GB/s, us).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

Edge = Tuple[int, int]


class Network:
    """Directed graph of ranks, switches and links (bandwidth in bytes/s per direction, latency in seconds)."""

    def __init__(self, num_ranks: int):
        if int(num_ranks) < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        self.num_ranks = int(num_ranks)
        self.vertex_names: Dict[int, str] = {r: f"rank{r}" for r in range(self.num_ranks)}
        self._num_vertices = self.num_ranks
        self._edge_index: Dict[Edge, int] = {}
        self._edges: List[Edge] = []
        self._bw: List[float] = []
        self._lat: List[float] = []
        self._adj: Dict[int, List[int]] = {r: [] for r in range(self.num_ranks)}
        self._pinned: Dict[Edge, List[Edge]] = {}
        self._invalidate()

    # --- construction ------------------------------------------------------------------------------------------
    def add_vertex(self, name: Optional[str] = None) -> int:
        """A new non-rank vertex (switch, NIC, idle GPU); returns its id (>= num_ranks)."""
        v = self._num_vertices
        self._num_vertices += 1
        self._adj[v] = []
        self.vertex_names[v] = name if name is not None else f"v{v}"
        return v

    def add_link(self, u: int, v: int, bandwidth: float, latency: float = 0.0, duplex: bool = True) -> None:
        """Edge u -> v (and v -> u when duplex) of `bandwidth` bytes/s per direction and `latency` seconds.

        Adding an edge that exists replaces its bandwidth and latency. Vertices not seen before are registered
        (ids >= num_ranks are non-rank vertices)."""
        bandwidth, latency = float(bandwidth), float(latency)
        if not bandwidth > 0:
            raise ValueError(f"bandwidth of link ({u}, {v}) must be > 0, got {bandwidth}")
        if latency < 0 or math.isnan(latency):
            raise ValueError(f"latency of link ({u}, {v}) must be >= 0, got {latency}")
        if u == v:
            raise ValueError(f"self-loop ({u}, {v})")
        for a, b in ((u, v), (v, u)) if duplex else ((u, v),):
            for x in (a, b):
                x = int(x)
                if x < 0:
                    raise ValueError(f"vertex ids are non-negative ints, got {x}")
                if x not in self._adj:
                    self._adj[x] = []
                    self.vertex_names.setdefault(x, f"v{x}")
                    self._num_vertices = max(self._num_vertices, x + 1)
            e = (int(a), int(b))
            if e in self._edge_index:
                i = self._edge_index[e]
                self._bw[i], self._lat[i] = bandwidth, latency
            else:
                self._edge_index[e] = len(self._edges)
                self._edges.append(e)
                self._bw.append(bandwidth)
                self._lat.append(latency)
                self._adj[e[0]].append(e[1])
        self._invalidate()

    def set_path(self, src: int, dst: int, edges: Sequence[Edge]) -> None:
        """Pin the route of rank pair src -> dst to `edges` (consecutive existing edges from src to dst)."""
        src, dst = self._check_rank(src), self._check_rank(dst)
        edges = [(int(a), int(b)) for a, b in edges]
        at = src
        for e in edges:
            if e not in self._edge_index:
                raise ValueError(f"no link {e}")
            if e[0] != at:
                raise ValueError(f"route {edges} is not a walk from {src}")
            at = e[1]
        if at != dst or (src != dst and not edges):
            raise ValueError(f"route {edges} does not end at {dst}")
        self._pinned[(src, dst)] = edges
        self._invalidate()

    # --- queries -----------------------------------------------------------------------------------------------
    @property
    def edges(self) -> List[Edge]:
        """All directed edges, in the order of ``edge_bandwidths`` and ``link_traffic_tensor``."""
        return list(self._edges)

    @property
    def edge_bandwidths(self) -> torch.Tensor:
        return torch.tensor(self._bw, dtype=torch.float64)

    def bandwidth(self, u: int, v: int) -> float:
        return self._bw[self._edge_index[(u, v)]]

    def latency(self, u: int, v: int) -> float:
        return self._lat[self._edge_index[(u, v)]]

    def path(self, src: int, dst: int) -> List[Edge]:
        """Edges (u, v) of the fixed route src -> dst: fewest hops, ties -> widest bottleneck -> least latency."""
        src, dst = self._check_rank(src), self._check_rank(dst)
        if src == dst:
            return []
        key = (src, dst)
        if key in self._pinned:
            return list(self._pinned[key])
        if src not in self._pred:
            self._pred[src] = self._routes_from(src)
        pred = self._pred[src]
        if dst not in pred:
            raise ValueError(f"rank {dst} is unreachable from rank {src}")
        edges, v = [], dst
        while v != src:
            u = pred[v]
            edges.append((u, v))
            v = u
        return edges[::-1]

    def path_latency(self, src: int, dst: int) -> float:
        return sum(self._lat[self._edge_index[e]] for e in self.path(src, dst))

    def latency_matrix(self) -> torch.Tensor:
        """[P, P] path latency in seconds (float64, 0 on the diagonal)."""
        return self._routes()[2].clone()

    def bandwidth_matrix(self) -> torch.Tensor:
        """[P, P] bottleneck bandwidth of each route in bytes/s (float64, inf on the diagonal)."""
        return self._routes()[3].clone()

    # --- traffic -----------------------------------------------------------------------------------------------
    def link_traffic_tensor(self, traffic) -> torch.Tensor:
        """[num_edges] bytes carried by each edge (order of ``edges``) for a [P, P] src -> dst byte matrix."""
        return self._edge_loads(self._traffic(traffic))

    def _edge_loads(self, t: torch.Tensor) -> torch.Tensor:
        pair_idx, edge_idx = self._routes()[:2]
        out = torch.zeros(len(self._edges), dtype=torch.float64)
        if edge_idx.numel():
            out.index_add_(0, edge_idx, torch.index_select(t.reshape(-1), 0, pair_idx))
        return out

    def link_traffic(self, traffic) -> Dict[Edge, float]:
        """Bytes on every directed edge (all edges, 0.0 where nothing flows) for traffic [P, P] src -> dst
        (diagonal ignored): each pair's bytes accumulated on every edge of its path (paper 003 §3.2)."""
        loads = self.link_traffic_tensor(traffic).tolist()
        return dict(zip(self._edges, loads))

    def alltoallv_time(self, traffic) -> float:
        """Eq.2: max over links of T_l / W_l, plus the largest path latency among pairs that send anything."""
        t = self._traffic(traffic)
        if not bool((t > 0).any()):
            return 0.0
        routes = self._routes()
        busy = float((self._edge_loads(t) / routes[4]).max())
        return busy + float(torch.where(t > 0, routes[2], 0.0).max())

    def p2p_time(self, nbytes: float, src: int, dst: int) -> float:
        """nbytes / bottleneck bandwidth of the route + its latency (0 for src == dst or nothing to send)."""
        nbytes = float(nbytes)
        if nbytes < 0:
            raise ValueError(f"negative size {nbytes}")
        if src == dst or nbytes == 0:
            self._check_rank(src), self._check_rank(dst)
            return 0.0
        lat, bw = self._routes()[2:4]
        return nbytes / float(bw[src, dst]) + float(lat[src, dst])

    def allreduce_time(self, nbytes: float, ranks: Optional[Sequence[int]] = None) -> float:
        """Ring all-reduce of `nbytes` over `ranks` (ring in the given order; default all ranks 0..P-1): every rank
        sends 2(n-1)/n * S to its successor along its route; max T_l/W_l + 2(n-1) x the largest hop latency."""
        ranks = self._group(ranks)
        n = len(ranks)
        if n < 2 or float(nbytes) <= 0:
            return 0.0
        return self._chain_time(ranks, [(ranks[i], ranks[(i + 1) % n]) for i in range(n)],
                                2.0 * (n - 1) / n * float(nbytes), 2 * (n - 1))

    def broadcast_time(self, nbytes: float, ranks: Optional[Sequence[int]] = None) -> float:
        """Pipelined broadcast from ranks[0] down the chain ranks[0] -> ranks[1] -> ... -> ranks[-1]: S over each
        chain hop's route; max T_l/W_l + (n-1) x the largest hop latency (pipeline fill)."""
        ranks = self._group(ranks)
        n = len(ranks)
        if n < 2 or float(nbytes) <= 0:
            return 0.0
        return self._chain_time(ranks, [(ranks[i], ranks[i + 1]) for i in range(n - 1)], float(nbytes), n - 1)

    def reduce_time(self, nbytes: float, ranks: Optional[Sequence[int]] = None) -> float:
        """Pipelined reduce to ranks[0]: the broadcast chain run backwards (ranks[-1] -> ... -> ranks[0]), S over
        each hop; equals broadcast_time on a symmetric network."""
        ranks = self._group(ranks)
        n = len(ranks)
        if n < 2 or float(nbytes) <= 0:
            return 0.0
        return self._chain_time(ranks, [(ranks[i + 1], ranks[i]) for i in range(n - 1)], float(nbytes), n - 1)

    def _chain_time(self, ranks, hops, per_hop_bytes, latency_hops) -> float:
        t = torch.zeros(self.num_ranks, self.num_ranks, dtype=torch.float64)
        src = torch.tensor([a for a, _ in hops])
        dst = torch.tensor([b for _, b in hops])
        t.index_put_((src, dst), torch.full((len(hops),), per_hop_bytes, dtype=torch.float64), accumulate=True)
        routes = self._routes()
        busy = float((self._edge_loads(t) / routes[4]).max())
        return busy + latency_hops * float(routes[2][src, dst].max())

    # --- builders ----------------------------------------------------------------------------------------------
    @classmethod
    def from_topology(cls, topo) -> "Network":
        """Tree of a ``Topology``: each rank -> its innermost switch at level-1 bandwidth, each switch -> its parent
        at the next level's (so a node's uplink is its NIC, shared by its ranks); GB/s -> bytes/s.

        Latency: ``topo.latency_us[L-1]`` is the alpha of a rank pair at level L (half a ping-pong, as
        ``Topology.measure`` fits it); the route of such a pair climbs L levels and descends L, so each edge at
        level k gets (alpha_k - alpha_{k-1}) / 2 (clamped at 0) and p2p latencies equal ``topo.latency_matrix()``
        for non-decreasing alphas. Switch ids: innermost groups first, in order, then the next level, ..., the
        root last (``[[0,1],[2,3]]``: 4 and 5 are the node switches, 6 the top)."""
        net = cls(topo.num_ranks)
        bw = [b * 1e9 for b in topo.bandwidth_gbps]
        alpha = [0.0] + [a * 1e-6 for a in topo.latency_us]
        edge_lat = [max(alpha[k] - alpha[k - 1], 0.0) / 2 for k in range(1, len(alpha))]
        # group the tree by height: height 1 = innermost groups (lists of ranks), ..., height depth = root
        by_height: Dict[int, List] = {}

        def walk(node) -> int:
            if isinstance(node, int):
                return 0
            h = 1 + max(walk(c) for c in node)
            by_height.setdefault(h, []).append(node)
            return h

        walk(topo.groups)
        vid: Dict[int, int] = {}  # id(list) -> vertex
        for h in sorted(by_height):
            for i, group in enumerate(by_height[h]):
                vid[id(group)] = net.add_vertex(f"switch L{h} #{i}")
        for h in sorted(by_height):
            for group in by_height[h]:
                for child in group:
                    c = child if isinstance(child, int) else vid[id(child)]
                    net.add_link(c, vid[id(group)], bw[h - 1], edge_lat[h - 1])
        return net

    @classmethod
    def hierarchical(cls, nodes: int, gpus_per_node: int, intra: str, intra_bandwidth, nic_bandwidth,
                     intra_latency=0.0, nic_latency=0.0, ring_bandwidths=None,
                     num_ranks: Optional[int] = None) -> "Network":
        """`nodes` x `gpus_per_node` GPUs (rank = node * gpus_per_node + local index), bytes/s and seconds.

        intra = "switch": every GPU -> a node switch (PCIe switch, NVSwitch) at `intra_bandwidth`; an intra-node
        pair has path latency `intra_latency` (each GPU link gets half).
        intra = "ring": GPU i <-> GPU i+1 (mod g) inside the node, edge i at ``ring_bandwidths[i]`` (default
        `intra_bandwidth`), `intra_latency` per hop; intra-node routes are pinned to the shorter way round the
        ring (ties -> wider bottleneck), never through the NIC. g == 2: the two ring edges join the same GPUs, so
        they form one link of their summed bandwidth. Each GPU reaches its node's NIC vertex at `nic_bandwidth`
        and no latency (the NIC uplink, carrying a superset of that traffic at the same bandwidth, is the binding
        one).
        Nodes (> 1) -> one top switch via the NIC, `nic_bandwidth` per node (shared by its GPUs); an inter-node
        pair has path latency `nic_latency` in total.
        num_ranks: only the first num_ranks GPUs are ranks; the others stay in the graph as idle vertices (a ring
        still forwards through them). Default all."""
        nodes, g = int(nodes), int(gpus_per_node)
        if nodes < 1 or g < 1:
            raise ValueError(f"need nodes >= 1 and gpus_per_node >= 1, got {nodes} x {g}")
        if intra not in ("switch", "ring"):
            raise ValueError(f"intra must be 'switch' or 'ring', got {intra!r}")
        total = nodes * g
        num_ranks = total if num_ranks is None else int(num_ranks)
        if not 1 <= num_ranks <= total:
            raise ValueError(f"num_ranks must be in 1..{total}, got {num_ranks}")
        if intra == "ring":
            ring_bandwidths = [float(intra_bandwidth)] * g if ring_bandwidths is None else \
                [float(b) for b in ring_bandwidths]
            if len(ring_bandwidths) != g:
                raise ValueError(f"{len(ring_bandwidths)} ring bandwidths for {g} GPUs per node")
        net = cls(num_ranks)
        gpu = list(range(num_ranks)) + [net.add_vertex(f"idle gpu {k}") for k in range(num_ranks, total)]
        top = net.add_vertex("top switch") if nodes > 1 else None
        up_lat = max(float(nic_latency) - (float(intra_latency) if intra == "switch" else 0.0), 0.0) / 2
        for n in range(nodes):
            local = gpu[n * g:(n + 1) * g]
            if intra == "switch":
                hub = net.add_vertex(f"node{n} switch")
                for v in local:
                    net.add_link(v, hub, intra_bandwidth, float(intra_latency) / 2)
            else:
                if g == 2:
                    net.add_link(local[0], local[1], ring_bandwidths[0] + ring_bandwidths[1], intra_latency)
                elif g > 2:
                    for i in range(g):
                        net.add_link(local[i], local[(i + 1) % g], ring_bandwidths[i], intra_latency)
                hub = None
                if nodes > 1:
                    hub = net.add_vertex(f"node{n} nic")
                    for v in local:
                        net.add_link(v, hub, nic_bandwidth, 0.0)
                for i in range(g):
                    for j in range(g):
                        if i != j and local[i] < num_ranks and local[j] < num_ranks:
                            net.set_path(local[i], local[j], _ring_route(local, ring_bandwidths, i, j))
            if top is not None:
                net.add_link(hub, top, nic_bandwidth, up_lat)
        return net

    # --- internals ---------------------------------------------------------------------------------------------
    def _invalidate(self):
        self._pred: Dict[int, Dict[int, int]] = {}
        self._route_cache = None

    def _check_rank(self, r) -> int:
        r = int(r)
        if not 0 <= r < self.num_ranks:
            raise ValueError(f"rank {r} out of range 0..{self.num_ranks - 1}")
        return r

    def _group(self, ranks) -> List[int]:
        ranks = list(range(self.num_ranks)) if ranks is None else [self._check_rank(r) for r in ranks]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ranks repeat in {ranks}")
        return ranks

    def _traffic(self, traffic) -> torch.Tensor:
        t = torch.as_tensor(traffic).to(torch.float64)
        p = self.num_ranks
        if t.shape != (p, p):
            raise ValueError(f"traffic must be [{p}, {p}], got {list(t.shape)}")
        if not bool((t >= 0).all()):
            raise ValueError("traffic must be non-negative")
        t = t.clone()
        t.fill_diagonal_(0.0)
        return t

    def _routes_from(self, src: int) -> Dict[int, int]:
        """Predecessor map of the routes from src: BFS layers (fewest hops); within a layer the predecessor with
        the widest bottleneck, then the least latency, then the smallest id. Ranks forward (rings need it)."""
        best = {src: (math.inf, 0.0)}  # vertex -> (bottleneck, latency) of its chosen route
        dist = {src: 0}
        pred: Dict[int, int] = {}
        frontier = [src]
        while frontier:
            nxt = []
            for u in sorted(frontier):
                bu, lu = best[u]
                for v in self._adj[u]:
                    i = self._edge_index[(u, v)]
                    cand = (min(bu, self._bw[i]), lu + self._lat[i])
                    if v not in dist:
                        dist[v] = dist[u] + 1
                        best[v], pred[v] = cand, u
                        nxt.append(v)
                    elif dist[v] == dist[u] + 1:
                        bv, lv = best[v]
                        if cand[0] > bv or (cand[0] == bv and cand[1] < lv):
                            best[v], pred[v] = cand, u
            frontier = nxt
        return pred

    def _routes(self):
        """(pair_idx, edge_idx, latency [P, P], bottleneck [P, P], edge bandwidths) of all rank pairs; cached."""
        if self._route_cache is None:
            p = self.num_ranks
            pair_idx: List[int] = []
            edge_idx: List[int] = []
            lat = [0.0] * (p * p)
            bott = [math.inf] * (p * p)
            index, bw, el = self._edge_index, self._bw, self._lat
            for s in range(p):
                for d in range(p):
                    if s == d:
                        continue
                    idx = [index[e] for e in self.path(s, d)]
                    k = s * p + d
                    pair_idx.extend([k] * len(idx))
                    edge_idx.extend(idx)
                    lat[k] = sum(el[i] for i in idx)
                    bott[k] = min(bw[i] for i in idx)
            self._route_cache = (torch.tensor(pair_idx, dtype=torch.long), torch.tensor(edge_idx, dtype=torch.long),
                                 torch.tensor(lat, dtype=torch.float64).reshape(p, p),
                                 torch.tensor(bott, dtype=torch.float64).reshape(p, p),
                                 torch.tensor(bw, dtype=torch.float64))
        return self._route_cache

    def __repr__(self):
        return f"Network(num_ranks={self.num_ranks}, vertices={self._num_vertices}, edges={len(self._edges)})"


def _ring_route(local: Sequence[int], bws: Sequence[float], i: int, j: int) -> List[Edge]:
    """Edges from local[i] to local[j] the shorter way round the ring (edge k joins k and k+1); ties -> wider
    bottleneck, then clockwise."""
    g = len(local)
    if g == 2:
        return [(local[i], local[j])]
    cw = [(k % g, (k + 1) % g) for k in range(i, i + (j - i) % g)]
    ccw = [((k + 1) % g, k % g) for k in range(i - 1, i - 1 - (i - j) % g, -1)]

    def bottleneck(hops):
        return min(bws[min(a, b) if {a, b} != {0, g - 1} else g - 1] for a, b in hops)

    if len(cw) < len(ccw) or (len(cw) == len(ccw) and bottleneck(cw) >= bottleneck(ccw)):
        hops = cw
    else:
        hops = ccw
    return [(local[a], local[b]) for a, b in hops]
