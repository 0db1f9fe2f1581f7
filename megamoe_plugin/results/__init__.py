"""`megamoe results`: the results pages' tables, headline and figures, generated from the shipped raw data.

    megamoe results            # rewrite the generated blocks of BENCHMARKS.md, README.md, docs/results.md,
                               # docs/data/README.md and docs/history/README.md
    megamoe results --check    # exit 1 and name each block that differs from what the data gives
    megamoe results --figures  # also redraw docs/figures/benchmarks/*.png

The raw data and its index (which run, when, which commit, which testbed) are in docs/data/ (runs.json); each
benchmark's section is built in sections_local.py (one machine) or sections_cluster.py (the emulated cluster).
Hand-written prose on the pages interprets the numbers; the numbers themselves come only from here.
"""
from __future__ import annotations

import argparse
import os
from typing import List, Optional

from . import sections_cluster, sections_local  # noqa: F401  (register the section builders)
from .pages import apply


def repository_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="megamoe results", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n")[1])
    p.add_argument("--check", action="store_true", help="compare only; exit 1 when a page differs")
    p.add_argument("--figures", action="store_true", help="also redraw the figures (matplotlib)")
    p.add_argument("--root", default=None, help="the repository (default: the one this package is in)")
    args = p.parse_args(argv)
    root = args.root or repository_root()
    if not os.path.exists(os.path.join(root, "docs", "data", "runs.json")):
        p.error(f"--root {root}: no docs/data/runs.json there (a clone of the repository is needed)")
    differ = apply(root, write=not args.check)
    for d in differ:
        print(("differs: " if args.check else "rewrote: ") + d)
    if args.figures and not args.check:
        from .figures import draw
        from .registry import Data
        for path in draw(Data(root)):
            print("drew:", path)
    if args.check and differ:
        print("run `megamoe results` to regenerate them from docs/data")
        return 1
    return 0
