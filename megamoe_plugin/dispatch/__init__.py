"""Token dispatch: dropless (dynamic gating) and capacity (GShard drop-and-pad), with expert parallelism."""
from .capacity import CapacityDispatcher
from .dropless import DroplessDispatcher
from .comm import all_to_all, gather_rows, weighted_combine

__all__ = ["CapacityDispatcher", "DroplessDispatcher", "all_to_all", "gather_rows", "weighted_combine"]
