"""Gates: the registry and the built-in gates (naive, switch, gshard, hir, ta_moe). See base.py for Routing."""
from .base import Gate, Routing, apply_capacity, assignment_fractions, capacity_from_factor
from .registry import build_gate, gate_warnings, register_gate, registered_gates
from . import standard, hir, ta_moe  # noqa: F401  (register the built-ins)
from .ta_moe import target_dispatch_pattern

__all__ = ["Gate", "Routing", "apply_capacity", "assignment_fractions", "capacity_from_factor", "build_gate", "gate_warnings",
           "register_gate", "registered_gates", "target_dispatch_pattern"]
