"""The gate registry: ``@register_gate("name")`` makes a Gate subclass selectable by ``MoEConfig.gate``.

Users extend it from their own code (import the module before building the config):

    from megamoe_plugin.gates import Gate, register_gate

    @register_gate("my_gate")
    class MyGate(Gate):
        def select(self, logits, probs): ...
"""
from __future__ import annotations

from ..gate_registry import _GATES, gate_class, register_gate, registered_gates

__all__ = ["register_gate", "registered_gates", "gate_class", "gate_warnings", "build_gate"]


def gate_warnings(cfg, topology=None):
    """The gate's own option checks (``Gate.check_options``) before any model exists: raises ``ConfigError`` for
    what cannot work, returns the warnings for what works but does not do what the gate is for."""
    cls = _GATES.get(cfg.gate)
    if cls is None:
        return []
    if topology is None:
        try:
            topology = cfg.build_topology()
        except ValueError:
            return []          # MoEConfig's own validation reports a bad topology
    return list(cls.check_options(cfg, topology))


def build_gate(cfg, hidden_size: int, ep=None, topology=None):
    try:
        cls = _GATES[cfg.gate]
    except KeyError:
        raise ValueError(f"--moe-gate={cfg.gate!r}: unknown gate; known: {', '.join(sorted(_GATES))}") from None
    return cls(cfg, hidden_size, ep=ep, topology=topology)
