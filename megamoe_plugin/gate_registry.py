"""Names -> Gate classes: the one table both the config (to check ``--moe-gate`` and ask the gate for its rules)
and the gates package (to register and build gates) use. It imports nothing of the project, so the config
depends on no gate module and the gates depend on the config, never the other way round.

A registered class answers, without a model: ``fixed_top_k`` (None, or the only top-k it routes with),
``needs_topology`` (its rules read the job's topology), ``default_gate_sync`` (what ``--moe-gate-sync auto``
means for it) and ``validate_config(cfg)`` (raise ``ConfigError`` for settings it cannot work with)."""
from __future__ import annotations

from typing import Callable, Dict, Optional, Type

_GATES: Dict[str, type] = {}


def register_gate(name: str) -> Callable[[Type], Type]:
    def deco(cls):
        if name in _GATES and _GATES[name] is not cls:
            raise ValueError(f"gate {name!r} is already registered by {_GATES[name].__qualname__}")
        _GATES[name] = cls
        cls.gate_name = name
        return cls

    return deco


def registered_gates() -> Dict[str, type]:
    return dict(_GATES)


def gate_class(name: str) -> Optional[type]:
    return _GATES.get(name)
