"""Progress lines for long commands: ``[label] 3/12 config 2 skewed | 1m04s elapsed, ETA 4m16s`` on stderr, so a
run that takes minutes says where it is without mixing into the report on stdout (``MEGAMOE_QUIET=1`` silences)."""
from __future__ import annotations

import os
import sys
import time


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Progress:
    def __init__(self, label: str, total: int, stream=None):
        self.label, self.total, self.done = label, max(int(total), 1), 0
        self.t0 = time.perf_counter()
        self.stream = stream if stream is not None else sys.stderr
        self.quiet = os.environ.get("MEGAMOE_QUIET", "") not in ("", "0")

    def line(self, what: str) -> str:
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / self.done * (self.total - self.done) if self.done else None
        tail = f"{_clock(elapsed)} elapsed" + (f", ETA {_clock(eta)}" if eta is not None and self.done < self.total
                                               else "")
        return f"[{self.label}] {self.done}/{self.total} {what} | {tail}"

    def step(self, what: str = "") -> None:
        """One unit of work finished."""
        self.done += 1
        self.say(what)

    def say(self, what: str) -> None:
        if not self.quiet:
            print(self.line(what), file=self.stream, flush=True)
