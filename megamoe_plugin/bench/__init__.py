"""Benchmarks: `megamoe bench layer` (MoE layer implementations, forward+backward, ratios from one run)."""
from typing import List, Optional


def main(argv: Optional[List[str]] = None):
    import sys
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: megamoe bench layer [options]   (see: megamoe bench layer --help)")
        return None
    what, rest = argv[0], argv[1:]
    if what == "layer":
        from .layer import main as layer_main
        return layer_main(rest)
    raise SystemExit(f"megamoe bench: unknown benchmark {what!r}; known: layer")
