"""Expert placement between optimizer steps (FlexMoE paper 001 §3-§5). This issue's part: the after-step hook
and the policy registry every trainer adapter calls; policies that move experts build on it."""
from .hooks import (AfterStepHook, StepContext, build_placement_policy, register_placement_policy,
                    registered_placement_policies)

__all__ = ["AfterStepHook", "StepContext", "build_placement_policy", "register_placement_policy",
           "registered_placement_policies"]
