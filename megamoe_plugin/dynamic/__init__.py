"""Dynamic shapes between steps (DynaMoE paper 000): ``recompile`` is the RECOMPILE mechanism (§3, Appendix B),
triggers run off the training thread and their decisions land at a step boundary Δ_launch steps later."""
from .recompile import Recompiler

__all__ = ["Recompiler"]
