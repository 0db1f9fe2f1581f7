"""ExpertParallel: the expert-parallel process group as the core sees it (rank, size, global ranks); ``comm_device``:
where a collective's tensors must live under the group's backend.

Adapters hand the core their trainer's expert-parallel group (Megatron's parallel_state / process-group
collection, fairseq's data-parallel group); ``None`` means no expert parallelism (all experts on this rank).
Gates use it to know where each expert lives (its rank and the node of that rank in the Topology); the
dispatchers use it for the all-to-all exchanges.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist


def comm_device(group=None) -> torch.device:
    """Where a tensor for a collective over ``group`` (the default group when None) must live: this rank's GPU
    under NCCL, which moves CUDA tensors only; the host under gloo and the rest (and without torch.distributed)."""
    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class ExpertParallel:
    def __init__(self, group=None):
        self.group = group
        if group is not None and not dist.is_initialized():
            raise RuntimeError("an expert-parallel group was given but torch.distributed is not initialised")
        distributed = dist.is_available() and dist.is_initialized()
        self.size = dist.get_world_size(group) if (distributed and group is not None) else 1
        self.rank = dist.get_rank(group) if (distributed and group is not None) else 0
        if distributed and group is not None:
            self.global_ranks: List[int] = dist.get_process_group_ranks(group)
        else:
            self.global_ranks = [dist.get_rank() if distributed else 0]

    @classmethod
    def layout(cls, rank: int, global_ranks: List[int]) -> "ExpertParallel":
        """A group described by its layout only (no process group): for gates and planners that need to know
        where experts live, e.g. to evaluate rank `rank`'s routing offline. Dispatchers refuse it."""
        ep = cls(None)
        ep.rank, ep.size, ep.global_ranks, ep.layout_only = rank, len(global_ranks), list(global_ranks), True
        return ep

    layout_only = False

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def global_rank_of(self, ep_rank: int) -> int:
        return self.global_ranks[ep_rank]

    @classmethod
    def world(cls) -> "ExpertParallel":
        """Every rank of the default group (the usual choice for tests and the core's own examples)."""
        return cls(dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None)

    def __repr__(self):
        return f"ExpertParallel(rank={self.rank}, size={self.size}, global_ranks={self.global_ranks})"


def expert_parallel(group: Optional[object]) -> ExpertParallel:
    return group if isinstance(group, ExpertParallel) else ExpertParallel(group)
