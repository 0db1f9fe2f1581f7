"""Gates: the registry and the built-in gates (topk, naive, switch, gshard, hir, ta_moe, node_limited,
node_limited_sender). See base.py for Routing."""
from .base import Gate, Routing, apply_capacity, assignment_fractions, capacity_from_factor
from .registry import build_gate, gate_warnings, register_gate, registered_gates
from . import standard, hir, node_limited, ta_moe  # noqa: F401  (register the built-ins)
from .ta_moe import target_dispatch_pattern

__all__ = ["Gate", "Routing", "apply_capacity", "assignment_fractions", "capacity_from_factor", "build_gate", "gate_warnings",
           "register_gate", "registered_gates", "target_dispatch_pattern"]
