"""HardwareProfile: the clusters of the papers (and measured ones) as data, turned into a Network / Topology / CostModel.

Owns the hardware numbers of the performance model. Named profiles:

* ``johnny``: paper 003 (FasterMoE) §5.1, 2 nodes x 8 V100-PCIe behind PCIe switches, 50 Gb/s network per node;
* ``trevor``: paper 003 §5.1, 16 nodes x 4 V100-SXM2 in an NVLink ring whose alternate edges are bonded pairs of
  links, 100 Gb/s InfiniBand EDR per node;
* ``flexmoe-a100``: paper 001 (FlexMoE) §5.1, Azure VMs of 8 A100 with NVLink 3.0 and 8 x 200 Gb/s InfiniBand
  NICs, 64 GPUs.

Each profile's ``source`` says where every number comes from: the paper's text, a vendor specification, or a
stated assumption (the papers give no GEMM throughput or latency). Measured profiles (``calibrate``) are saved to
and loaded from JSON with ``save`` / ``load``; ``get_profile`` accepts a name or a JSON path.

Units in a profile: GB/s (1e9 bytes/s, one direction), microseconds, TFLOP/s; ``network()`` converts to the
Network's bytes/s and seconds.
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Dict, List, Optional

from .cost import CostModel, LayerShape
from .network import Network
from ..topology import Topology

# Fraction of the GEMM peak used as P_w (paper 003 §3.1 / §5.3: "we use 90% of the peak performance").
GEMM_EFFICIENCY = 0.9


@dataclass
class HardwareProfile:
    name: str
    description: str = ""
    source: str = ""
    nodes: int = 1
    gpus_per_node: int = 1
    gemm_tflops: float = 1.0               # per device, the effective P of Eq.1 (already x efficiency)
    intra: str = "switch"                   # "switch" | "ring"
    intra_bandwidth_gbps: float = 10.0      # GB/s per device link, one direction
    ring_bandwidths_gbps: Optional[List[float]] = None   # ring only: edge i joins local GPUs i and i+1 (mod g)
    nic_bandwidth_gbps: float = 1.0         # GB/s per node, one direction
    intra_latency_us: float = 0.0           # alpha of an intra-node pair (per ring hop for "ring")
    nic_latency_us: float = 0.0             # alpha of an inter-node pair
    bytes_per_element: int = 2
    tokens_per_second: Optional[float] = None  # profiled forward TPS of one expert (FlexMoE Eq.7); None = Eq.1
    sync_bps: Dict[str, float] = field(default_factory=dict)  # profiled all-reduce B/s, key "0,1,5" (sorted ranks)
    shared_gemm_tflops: float = 0.0        # a compute pool all ranks share (CPU ranks on one machine); 0 = none
    bcast_gbps: float = 0.0                # measured broadcast + reduce over all ranks, effective GB/s; 0 = modelled
    bcast_latency_us: float = 0.0          # ... and its fixed cost per call
    layer_overhead_us: float = 0.0         # measured fixed cost of one MoE layer step (gate, sort, count exchange)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def _layout(self, world_size):
        g = self.gpus_per_node
        world = self.world_size if world_size is None else int(world_size)
        if world < 1:
            raise ValueError(f"world_size must be >= 1, got {world}")
        return -(-world // g), g, world

    def network(self, world_size: Optional[int] = None) -> Network:
        """Network of `world_size` ranks (default nodes * gpus_per_node), filling nodes in order; a last partial
        node keeps its other GPUs as idle vertices (a ring still routes through them)."""
        nodes, g, world = self._layout(world_size)
        return Network.hierarchical(
            nodes, g, self.intra, self.intra_bandwidth_gbps * 1e9, self.nic_bandwidth_gbps * 1e9,
            intra_latency=self.intra_latency_us * 1e-6, nic_latency=self.nic_latency_us * 1e-6,
            ring_bandwidths=None if self.ring_bandwidths_gbps is None else
            [b * 1e9 for b in self.ring_bandwidths_gbps], num_ranks=world)

    def topology(self, world_size: Optional[int] = None):
        """Nested-list tree approximation for the gates (Hir, TA-MoE): level 1 = a node, at the intra bandwidth
        (a ring: its narrowest edge) and latency; level 2 = the network, nic bandwidth per node and latency."""

        nodes, g, world = self._layout(world_size)
        intra_bw = self.intra_bandwidth_gbps
        if self.intra == "ring" and self.ring_bandwidths_gbps:
            intra_bw = min(self.ring_bandwidths_gbps)
        if nodes == 1:
            return Topology(list(range(world)), bandwidth_gbps=[intra_bw], latency_us=[self.intra_latency_us])
        groups = [list(range(n * g, min((n + 1) * g, world))) for n in range(nodes)]
        if len(groups[-1]) != g:
            raise ValueError(f"a Topology needs equal nodes: world_size {world} is not a multiple of {g}")
        return Topology(groups, bandwidth_gbps=[intra_bw, self.nic_bandwidth_gbps],
                        latency_us=[self.intra_latency_us, self.nic_latency_us])

    def cost_model(self, shape: LayerShape, world_size: Optional[int] = None) -> CostModel:
        net = self.network(world_size)
        sync = {tuple(int(r) for r in k.split(",")): v for k, v in self.sync_bps.items()}
        sync = {k: v for k, v in sync.items() if max(k) < net.num_ranks}
        return CostModel(net, self.gemm_tflops * 1e12, shape, tokens_per_second=self.tokens_per_second,
                         sync_bps=sync, shared_gemm_flops=self.shared_gemm_tflops * 1e12,
                         bcast=(self.bcast_gbps * 1e9, self.bcast_latency_us * 1e-6) if self.bcast_gbps else None)

    # --- persistence -------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "HardwareProfile":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown profile field(s): {sorted(unknown)}")
        return cls(**copy.deepcopy(d))

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> "HardwareProfile":
        with open(path) as f:
            return cls.from_dict(json.load(f))


_V100_NOTE = ("GEMM: the paper gives no throughput; FasterMoE §3.1 measures >90% of peak for transformer GEMMs "
              "and §5.3 uses 90% of the peak as the GEMM throughput. Assumption: fp16 tensor-core GEMM (NVIDIA datasheet peak {peak} TFLOPS "
              "for {part}) x 0.9 = {eff:g} TFLOPS.")

PROFILES: Dict[str, HardwareProfile] = {
    "johnny": HardwareProfile(
        name="johnny",
        description="FasterMoE's johnny: 2 nodes x 8 NVIDIA V100-PCIe, PCIe switches inside a node, 50 Gb/s network",
        source=(
            "Topology, GPU model, 50 Gb/s per node: paper 003 (FasterMoE) §5.1 ('8 NVIDIA Tesla V100-PCIE GPUs "
            "connected to 2 CPU sockets via PCIe switches ... Infiniband EDR, the bandwidth degrades to 50Gb/s'); "
            "50 Gb/s = 6.25 GB/s per node, one direction. "
            + _V100_NOTE.format(peak=112, part="V100-PCIe", eff=112 * GEMM_EFFICIENCY) + " "
            "Intra-node bandwidth: assumption, not in the paper: PCIe 3.0 x16 is 15.75 GB/s per direction in "
            "theory and GPU peer copies through a PCIe switch reach about 12 GB/s, so 12 GB/s per GPU link; the two "
            "CPU sockets (cross-socket UPI/QPI) are not modelled, every GPU hangs off one node switch. "
            "Latencies: assumption, order of magnitude of NCCL small-message latency (5 us intra-node over PCIe, "
            "10 us inter-node), not measured."),
        nodes=2, gpus_per_node=8, gemm_tflops=112 * GEMM_EFFICIENCY, intra="switch",
        intra_bandwidth_gbps=12.0, nic_bandwidth_gbps=6.25, intra_latency_us=5.0, nic_latency_us=10.0,
        bytes_per_element=2),
    "trevor": HardwareProfile(
        name="trevor",
        description="FasterMoE's trevor: 16 nodes x 4 NVIDIA V100-SXM2 in an NVLink ring (alternate edges bonded), "
                    "100 Gb/s InfiniBand EDR",
        source=(
            "Topology, GPU model, 100 Gb/s, 64 GPUs in 16 nodes: paper 003 (FasterMoE) §5.1 ('4 NVIDIA V100-SXM2 "
            "GPUs ... with NVLink interconnecting them to form a heterogeneous ring, where half of the edges have "
            "double bandwidth via a bond of two links. Infiniband EDR at 100Gb/s'); 100 Gb/s = 12.5 GB/s per node. "
            "Ring edge bandwidths: NVIDIA V100-SXM2 spec, one NVLink 2.0 link = 25 GB/s per direction, a bond of two "
            "= 50 GB/s; which edges are bonded is not stated, we assume they alternate (edges 0-1 and 2-3 bonded, "
            "1-2 and 3-0 single). GPU-to-NIC attachment: modelled at the NIC's 12.5 GB/s (PCIe 3.0 is faster). "
            + _V100_NOTE.format(peak=125, part="V100-SXM2", eff=125 * GEMM_EFFICIENCY) + " "
            "Latencies: assumption, order of magnitude (2 us per NVLink hop, 10 us inter-node), not measured."),
        nodes=16, gpus_per_node=4, gemm_tflops=125 * GEMM_EFFICIENCY, intra="ring",
        intra_bandwidth_gbps=25.0, ring_bandwidths_gbps=[50.0, 25.0, 50.0, 25.0], nic_bandwidth_gbps=12.5,
        intra_latency_us=2.0, nic_latency_us=10.0, bytes_per_element=2),
    "flexmoe-a100": HardwareProfile(
        name="flexmoe-a100",
        description="FlexMoE's cluster: 8 Azure VMs x 8 NVIDIA A100, NVLink 3.0, 8 x 200 Gb/s InfiniBand per VM",
        source=(
            "GPUs, NVLink 3.0, 8 x 200 Gbps NICs: paper 001 (FlexMoE) §5.1 machine environment; 64 GPUs = 8 nodes "
            "(its largest runs, Figure 5b). 8 x 200 Gb/s = 200 GB/s per node, one direction, modelled as one "
            "node uplink shared by the 8 GPUs (in reality one NIC per GPU, so a lone pair's p2p is over-estimated "
            "8x; all-to-all totals are right). Intra-node: NVIDIA A100 spec, NVLink 3.0 = 12 links x 25 GB/s = "
            "300 GB/s per GPU per direction; the GPUs reach each other through NVSwitch (the HGX A100 8-GPU board "
            "of Azure's ND A100 v4, vendor documentation, not the paper), so intra='switch'. "
            "GEMM: not in the paper; assumption fp16/bf16 dense tensor-core peak 312 TFLOPS (NVIDIA A100 "
            f"datasheet) x 0.9 (FasterMoE §3.1's efficiency) = {312 * GEMM_EFFICIENCY:g} TFLOPS. "
            "Latencies: assumption, order of magnitude (2 us NVLink/NVSwitch, 10 us inter-node RDMA), not measured."),
        nodes=8, gpus_per_node=8, gemm_tflops=312 * GEMM_EFFICIENCY, intra="switch",
        intra_bandwidth_gbps=300.0, nic_bandwidth_gbps=200.0, intra_latency_us=2.0, nic_latency_us=10.0,
        bytes_per_element=2),
}


def get_profile(name_or_path: str) -> HardwareProfile:
    """A copy of a named profile (``PROFILES``), or a profile loaded from a JSON file."""
    if name_or_path in PROFILES:
        return copy.deepcopy(PROFILES[name_or_path])
    if os.path.isfile(name_or_path):
        return HardwareProfile.load(name_or_path)
    raise ValueError(f"unknown hardware profile {name_or_path!r}: not one of {sorted(PROFILES)} nor a JSON file")
