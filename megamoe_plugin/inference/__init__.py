"""Inference deployment (paper 004, Meta's MoE deployment): dynamic gating at inference is the core's dropless path
in eval mode; this package adds expert buffering (a device cache of hot experts backed by CPU memory), the cache
simulator over recorded routing traces (LIFO / FIFO / LRU / LFU and Belady's MIN), expert load balancing
placements (greedy, anti-correlation) applied as expert permutations, and ``prepare_for_inference`` (what the
adapters call when a checkpoint is loaded for inference)."""
from .balance import apply_expert_permutation, apply_placement_file, read_placement_file, write_placement_file
from .buffering import ExpertBuffer, disable_expert_buffering, enable_expert_buffering
from .deploy import prepare_for_inference, refuse_in_training
from .eviction import POLICIES, ExpertSlotCache

__all__ = ["ExpertBuffer", "ExpertSlotCache", "POLICIES", "apply_expert_permutation", "apply_placement_file",
           "disable_expert_buffering", "enable_expert_buffering", "prepare_for_inference", "read_placement_file",
           "refuse_in_training", "write_placement_file"]
