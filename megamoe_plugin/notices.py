"""One-line notices to the user: ``warn_once`` prints a warning naming a flag once per process, on rank 0 only
(``megamoe-plugin: warning: ...`` on stderr), however many layers or models repeat it."""
from __future__ import annotations

import os
import sys
from typing import Set

_SEEN: Set[str] = set()


def _rank() -> int:
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:
        pass
    return int(os.environ.get("RANK", "0"))


def warn_once(message: str, kind: str = "warning") -> bool:
    """Print ``message`` as a warning (or, with ``kind="note"``, a note) unless it was printed before in this
    process; True when printed."""
    if message in _SEEN:
        return False
    _SEEN.add(message)
    if _rank() == 0:
        print(f"megamoe-plugin: {kind}: {message}", file=sys.stderr, flush=True)
    return True
