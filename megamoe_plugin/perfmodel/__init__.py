"""Performance model of MoE training: predicted times of MoE layers on a given cluster, used by the planners
(shadowing, placement, scheduling) and the analysis tools. Pure PyTorch, no distributed calls.

Modules:

* ``network``: ``Network``, the directed link graph of a cluster (ranks, switches, NICs) with fixed routes, and the
  traffic model of all-to-all-v, ring all-reduce, broadcast and reduce (paper 003 FasterMoE §3.2, Eq.2).
* ``cost``: ``LayerShape``, ``Breakdown`` and ``CostModel``: one MoE layer's step time from a routing count matrix
  and an expert placement: computation (paper 003 §3.1 Eq.1, or FlexMoE's TPS, paper 001 §3.4 Eq.7),
  all-to-all (Eq.2), replica synchronisation (paper 001 Eq.9), shadowing (paper 003 §4.1 Eq.8), expert moves.
* ``profiles``: ``HardwareProfile``, ``PROFILES`` (johnny, trevor, flexmoe-a100) and ``get_profile``: the
  papers' clusters with documented sources, JSON save/load for measured ones.
* ``roofline``: the DDL-Roofline model (paper 003 §3.3, Eqs.3-6).
* ``simulate``: replaying routing traces through the cost model; ``placement_replay``: the placement planners
  replayed through them, with FlexMoE §5.4 metrics, and the synthetic skewed, drifting trace.
* ``schedule``: predicted plain vs smart-scheduled times (paper 003 §4.2).
* ``calibrate``: measuring a profile on the running cluster.

Only network, cost and profiles are imported here; import the others from their modules.
"""
from .cost import Breakdown, CostModel, LayerShape
from .network import Network
from .profiles import PROFILES, HardwareProfile, get_profile

__all__ = ["Network", "LayerShape", "Breakdown", "CostModel", "HardwareProfile", "PROFILES", "get_profile"]
